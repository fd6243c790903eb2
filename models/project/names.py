"""The pipeline's names: DVC stages, the flow's smoke step, and the MLflow names of a pair's experiment, its
registered probes and their alias. A probe key ``<variant>@<domain>`` (``semspec.models.spec.names``) is
registered as ``semspec-<pair>-<role>-<variant>-<domain>``."""

from __future__ import annotations

from semspec.models.spec.names import split_probe_key

STAGES = ("ingest", "sample", "cross", "cluster", "train", "evaluate")  # dvc.yaml's stages, in order
SMOKE_STAGE = "decode"  # the flow's last step: decode one question with the registered probes
CHAMPION = "champion"  # registry alias of the probe version that decoding loads


def experiment_name(pair: str) -> str:
    """One MLflow experiment per model pair."""
    return f"semspec-{pair}"


def registered_name(pair: str, role: str, variant: str) -> str:
    """Registry name of a probe: ``semspec-<pair>-<role>-<variant>``, ``-<domain>`` appended for a probe
    key ``<variant>@<domain>``."""
    v, domain = split_probe_key(variant)
    return f"semspec-{pair}-{role}-{v}" + (f"-{domain}" if domain else "")
