"""The project's vocabulary: every name that more than one module spells is defined here, once.

Method names, probe variants, pipeline stages, the ``semanticspec-<variant>`` label that evaluation and
the bench print, and the MLflow names of a pair's experiment, its registered probes and their alias.
"""

from __future__ import annotations

METHODS = ("target", "draft", "semanticspec", "specsampling", "assisted", "specreason")
PROBE_METHOD = "semanticspec"  # the method that reads the registered probes
PROBE_VARIANTS = ("random", "last", "all", "mix")  # random: the paper's baseline probe
ROLES = ("draft", "target")
STAGES = ("ingest", "sample", "cluster", "train", "evaluate")  # dvc.yaml's stages, in order
SMOKE_STAGE = "decode"  # the flow's last step: decode one question with the registered probes
CHAMPION = "champion"  # registry alias of the probe version that decoding loads


def method_label(method: str, variant: str | None = None) -> str:
    """The label of one decoder: ``semanticspec-<variant>`` for SemanticSpec, else the method name."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if method != PROBE_METHOD:
        return method
    if variant not in PROBE_VARIANTS:
        raise ValueError(f"unknown probe variant {variant!r}; expected one of {PROBE_VARIANTS}")
    return f"{method}-{variant}"


def parse_label(label: str) -> tuple[str, str | None]:
    """``(method, variant)`` of a label made by ``method_label`` (``variant`` is None without probes)."""
    method, _, variant = label.partition("-")
    method_label(method, variant or None)  # raises on anything method_label would not make
    return method, variant or None


def experiment_name(pair: str) -> str:
    """One MLflow experiment per model pair."""
    return f"semspec-{pair}"


def registered_name(pair: str, role: str, variant: str) -> str:
    """Registry name of a probe."""
    return f"semspec-{pair}-{role}-{variant}"
