"""Build any decoder for a pair; SemanticSpec's probes are loaded from the MLflow registry, or from a folder
of exported probes (``semspec.models.project.probe_card``), a path on which nothing imports MLflow."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from semspec.models.lm import LM, Pooled
from semspec.models.lm.pair import PairConfig
from semspec.models.project.probe_card import ProbeCard, check_card, load_card_probe
from semspec.models.project.probe_folder import read_card
from semspec.models.spec.batching import SingleModelDecoder
from semspec.models.spec.names import FLOOR_AUTO, GAMMA_AUTO, METHODS, ROLES, split_probe_key
from semspec.models.spec.probe import probe_probabilities, probe_probability
from semspec.models.spec.results import Decoder
from semspec.models.spec.semanticspec import SemanticSpecDecoder
from semspec.models.spec.settings import DecodeSettings, gamma_for
from semspec.models.spec.specreason import SpecReasonDecoder
from semspec.models.spec.token_level import AssistedDecoder, TokenSpecDecoder
from semspec.models.spec.verifier import ProbeFn
from semspec.tasks.config import EvaluateConfig

log = logging.getLogger(__name__)


def decode_settings(cfg: EvaluateConfig, **overrides: Any) -> DecodeSettings:
    """The evaluation's decode settings (``params.yaml``'s ``evaluate.decode``) with ``overrides`` in place
    of single fields (a command-line option, the seed, how answers are read; None: the params' value);
    the evaluation, ``semspec decode``, ``semspec bench``, the API and the flow's smoke test all start
    here, so none has defaults of its own."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg.decode, **given)


class RegisteredProbe:
    """A registered probe as a function of pooled hidden states; ``many`` scores a batch in one call."""

    def __init__(self, probe: torch.nn.Module, sha256: str) -> None:
        self.probe, self.sha256 = probe, sha256

    def __call__(self, pooled: Pooled) -> float:
        return probe_probability(self.probe, pooled)

    def many(self, pooled: list[Pooled]) -> list[float]:
        """Semantic probabilities of a batch of pooled steps, one forward."""
        return probe_probabilities(self.probe, pooled)


_PINNED: dict[tuple, RegisteredProbe] = {}  # pinned versions never change: read each once per process


def probe_fn(pair: str, role: str, variant: str, lm: LM, version: str | None = None) -> tuple[ProbeFn, str]:
    """The registered probe of ``role`` (``version``, default the ``champion``) as a function of pooled
    hidden states, and the sha256 of its weights. A pinned version is read from the registry once."""
    from semspec.tasks.probe_registry import load_probe

    fmt = lm.format.name
    key = (pair, role, variant, lm.model_id, lm.hidden_size, lm.config.pooling, fmt, version)
    if version is None or key not in _PINNED:
        probe, ref = load_probe(
            pair,
            role,
            variant,
            lm.model_id,
            lm.hidden_size,
            version=version,
            pooling=lm.config.pooling,
            fmt=fmt,
        )
        fn = RegisteredProbe(probe, ref.sha256)
        if version is None:
            return fn, fn.sha256
        _PINNED[key] = fn
    return _PINNED[key], _PINNED[key].sha256


def card_probe_fn(folder: Path, card: ProbeCard, role: str, variant: str, lm: LM) -> tuple[ProbeFn, str]:
    """The exported probe of ``role`` in ``folder`` as a function of pooled hidden states, and the sha256
    of its weights (refused unless it fits ``lm``: model id, hidden size, pooling, format)."""
    probe, sha = load_card_probe(
        folder,
        card,
        role,
        variant,
        lm.model_id,
        lm.hidden_size,
        pooling=lm.config.pooling,
        fmt=lm.format.name,
    )
    fn = RegisteredProbe(probe, sha)
    return fn, fn.sha256


def check_probes(pair: PairConfig, variant: str, probes_dir: Path | None = None) -> None:
    """Check, before any model loads (a minute on a CPU), that SemanticSpec's probes of ``variant`` are
    there for ``pair``: both roles' registered versions (``champion``), or with ``probes_dir`` the exported
    folder's card (``check_card``: pair, model ids, pooling, formats, files). ValueError says what is
    missing."""
    if probes_dir is not None:
        check_card(read_card(probes_dir), pair, variant)
        return
    from semspec.tasks.probe_registry import registered_version

    for role in ROLES:
        registered_version(pair.name, role, variant)


def build_decoder(
    method: str,
    pair: PairConfig,
    lms: dict[str, LM],
    settings: DecodeSettings,
    variant: str = "all",
    pins: dict[str, str] | None = None,
    probes_dir: Path | None = None,
) -> Decoder:
    """A decoder for ``method``; ``semanticspec`` loads the pair's registered probes for ``variant``: the
    versions ``pins`` names (``{"<role>-<variant>": version}``, as a train run recorded them), else the
    champions, and resolves ``min_ratio: auto`` and ``min_p: auto`` to the floors their train run chose
    on validation (none for Random, which keeps the paper's rule). With ``probes_dir`` (a local folder of
    exported probes: ``semspec.models.project.probe_folder.resolve_probes`` makes one of a Hub repo id) both probes
    and the floors come from that folder and its card instead, and MLflow is not imported.
    ``MethodNotApplicable`` when the method cannot run on this pair (``specsampling`` across
    vocabularies)."""
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
    if probes_dir is not None:
        return _folder_decoder(pair, lms, settings, variant, Path(probes_dir), pins)
    from semspec.tasks.probe_registry import registered_floor

    pins = pins or {}
    version = pins.get(f"target-{variant}")
    settings = resolve_auto(settings, variant, lambda tag: registered_floor(pair.name, variant, version, tag))
    q, q_sha = probe_fn(pair.name, "draft", variant, lms["draft"], pins.get(f"draft-{variant}"))
    p, p_sha = probe_fn(pair.name, "target", variant, lms["target"], pins.get(f"target-{variant}"))
    return SemanticSpecDecoder(lms["draft"], lms["target"], q, p, settings, {"draft": q_sha, "target": p_sha})


def resolve_auto(
    settings: DecodeSettings, variant: str, read: Callable[[str], float | None], where: str = "registry"
) -> DecodeSettings:
    """``settings`` with every ``auto`` SemanticSpec reads from its probes resolved: ``min_ratio`` and
    ``min_p`` to the floors the train run chose on the validation questions, ``gamma`` to ``gamma_for``
    the probes' step acceptance on the held-out steps; ``read(name)`` gives the target probe's value of
    ``name`` (None: none). Random's probes keep the paper's rule and gamma 1."""
    random = split_probe_key(variant)[0] == "random"
    for name in ("min_ratio", "min_p"):
        if getattr(settings, name) == FLOOR_AUTO:
            floor = None if random else read(name)
            log.info(
                "semanticspec-%s: %s auto -> %s (chosen on the validation questions; %s)",
                variant,
                name,
                floor,
                where,
            )
            settings = replace(settings, **{name: floor})
    if settings.gamma == GAMMA_AUTO:
        rate = None if random else read("accept_rate")
        if rate is None and not random:
            log.warning(
                "semanticspec-%s: gamma auto -> 1: its probes carry no held-out acceptance (trained before "
                "it was recorded): retrain them, or set evaluate.decode.gamma to a count",
                variant,
            )
        gamma = gamma_for(rate)
        log.info(
            "semanticspec-%s: gamma auto -> %d (step acceptance %s on held-out steps; %s)",
            variant,
            gamma,
            rate,
            where,
        )
        settings = replace(settings, gamma=gamma)
    return settings


def _folder_decoder(
    pair: PairConfig,
    lms: dict[str, LM],
    settings: DecodeSettings,
    variant: str,
    folder: Path,
    pins: dict[str, str] | None,
) -> Decoder:
    """SemanticSpec with the probes of an exported folder; ``auto`` floors from its card."""
    if pins:
        raise ValueError(
            f"pins {pins} name registry versions, and probes_dir {folder} names exported probes: pass one"
        )
    card = read_card(folder)
    check_card(card, pair, variant, check_format=False)  # the formats: against the loaded models below
    settings = resolve_auto(settings, variant, lambda name: card.floor(variant, name), f"card in {folder}")
    q, q_sha = card_probe_fn(folder, card, "draft", variant, lms["draft"])
    p, p_sha = card_probe_fn(folder, card, "target", variant, lms["target"])
    return SemanticSpecDecoder(lms["draft"], lms["target"], q, p, settings, {"draft": q_sha, "target": p_sha})
