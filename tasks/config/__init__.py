"""Typed stage configuration, parsed once from ``params.yaml`` (+ a profile + overrides).

Precedence, lowest first: dataclass defaults < ``params.yaml`` < ``conf/profiles/<profile>.yaml``
< ``--set key=value`` overrides. The ``demo`` profile is CPU-sized; ``paper`` uses the paper's sizes.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from semspec.models.lm.pair import from_mapping
from semspec.models.project.pairs import project_root
from semspec.models.spec.steps import check_strategy
from semspec.tasks.config.sections import (
    ClusterConfig,
    EvaluateConfig,
    IngestConfig,
    RetrainConfig,
    SampleConfig,
    TrainConfig,
)


@dataclass
class Params:
    """Everything the pipeline reads, for one run."""

    pair: str = "embedded"
    profile: str = "demo"
    split_strategy: str = "paragraph"  # what a step is, for every stage (models/spec/steps.py)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for logging)."""
        return asdict(self)


_SECTIONS = {
    "ingest": IngestConfig,
    "sample": SampleConfig,
    "cluster": ClusterConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "retrain": RetrainConfig,
}


SUBSECTIONS = ("decode",)  # a section's keys that group settings: a profile overlays them key by key


def _merge(base: dict, over: dict) -> dict:
    """A profile over params.yaml: stage sections merge key by key (and ``evaluate.decode`` within), but a
    setting's value is replaced whole, dicts included (a profile's ``benchmarks: {arith: 2}`` means only
    arith, not arith added to the base's benchmarks)."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            section = out[k]  # a section: its settings replace the base's, its subsections merge alike
            for key, value in copy.deepcopy(v).items():
                nested = key in SUBSECTIONS and isinstance(value, dict) and isinstance(section.get(key), dict)
                section[key] = {**section[key], **value} if nested else value
        else:
            out[k] = copy.deepcopy(v)
    return out


def _set(d: dict, dotted: str) -> None:
    key, sep, raw = dotted.partition("=")
    if not sep or not key:
        raise ValueError(f"override {dotted!r} must look like section.key=value")
    node = d
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = yaml.safe_load(raw)


def profiles_dir() -> Path:
    """Folder of the profile overlays."""
    return project_root() / "conf" / "profiles"


def read_params_file(path: Path) -> dict[str, Any]:
    """The raw mapping of a ``params.yaml`` (empty when the file does not exist)."""
    if not path.is_file():
        return {}
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


def load_params(
    path: str | Path | None = None, profile: str | None = None, overrides: list[str] | None = None
) -> Params:
    """Parse ``params.yaml``, overlay the profile, apply ``section.key=value`` overrides, validate."""
    p = Path(path) if path else project_root() / "params.yaml"
    if path and not p.is_file():
        raise ValueError(f"params file {p} not found")
    raw = read_params_file(p)
    prof = profile or raw.get("profile") or "demo"
    prof_file = profiles_dir() / f"{prof}.yaml"
    if not prof_file.is_file():
        known = sorted(f.stem for f in profiles_dir().glob("*.yaml"))
        raise ValueError(f"unknown profile {prof!r}; available: {', '.join(known)}")
    merged = _merge(raw, yaml.safe_load(prof_file.read_text(encoding="utf-8")) or {})
    merged["profile"] = prof
    for o in overrides or []:
        _set(merged, o)
    if "split_strategy" in (merged.get("ingest") or {}):
        raise ValueError(
            f"{p}: ingest.split_strategy moved to the top level (`split_strategy: sentence`): every stage "
            f"reads it"
        )
    unknown = sorted(set(merged) - set(_SECTIONS) - {"pair", "profile", "split_strategy"})
    if unknown:
        raise ValueError(f"{p}: unknown top-level key(s) {unknown}")
    sections = {k: from_mapping(cls, merged.get(k) or {}, k) for k, cls in _SECTIONS.items()}
    split = check_strategy(str(merged.get("split_strategy", "paragraph")))
    return Params(pair=str(merged.get("pair", "embedded")), profile=prof, split_strategy=split, **sections)
