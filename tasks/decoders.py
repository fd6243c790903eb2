"""Build any decoder for a pair; SemanticSpec's probes are loaded from the MLflow registry."""

from __future__ import annotations

import logging

from semspec.models.decoding import (
    AssistedDecoder,
    Decoder,
    DecodeSettings,
    ProbeFn,
    SemanticSpecDecoder,
    SingleModelDecoder,
    SpecReasonDecoder,
    TokenSpecDecoder,
)
from semspec.models.lm import LM
from semspec.models.names import METHODS, PROBE_VARIANTS
from semspec.models.pair import PairConfig
from semspec.models.probe import probe_probability
from semspec.tasks.probe_registry import load_probe

log = logging.getLogger(__name__)


def probe_fn(pair: str, role: str, variant: str, lm: LM) -> ProbeFn:
    """The registered ``champion`` probe of ``role`` as a function of pooled hidden states."""
    probe = load_probe(pair, role, variant, lm.model_id, lm.hidden_size)
    return lambda pooled: probe_probability(probe, pooled)


def build_decoder(
    method: str, pair: PairConfig, lms: dict[str, LM], settings: DecodeSettings, variant: str = "all"
) -> Decoder:
    """A decoder for ``method``; ``semanticspec`` loads the pair's registered probes for ``variant``.
    ``MethodNotApplicable`` when the method cannot run on this pair (``specsampling`` across vocabularies)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if method in ("target", "draft"):
        return SingleModelDecoder(lms[method], settings, method)
    if method == "specsampling":  # raises MethodNotApplicable across two vocabularies
        return TokenSpecDecoder(lms["draft"], lms["target"], settings)
    if method == "assisted":
        return AssistedDecoder(lms["draft"], lms["target"], settings)
    if method == "specreason":
        return SpecReasonDecoder(lms["draft"], lms["target"], settings)
    if variant not in PROBE_VARIANTS:
        raise ValueError(f"unknown probe variant {variant!r}; expected one of {PROBE_VARIANTS}")
    q = probe_fn(pair.name, "draft", variant, lms["draft"])
    p = probe_fn(pair.name, "target", variant, lms["target"])
    return SemanticSpecDecoder(lms["draft"], lms["target"], q, p, settings)
