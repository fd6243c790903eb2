"""What a pair's probes were trained from: the config and source-data hashes tagged on every registered
version, so a retrain can tell that they are out of date."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from semspec.models.cpu.formats import resolve_format
from semspec.tasks.ingest import source_fingerprint
from semspec.tasks.io import config_hash

# What does not change what a probe learns (execution details, where a file lives, free text); left out
# of the config fingerprint.
_NOT_FINGERPRINTED = {
    "data_dir",
    "on_error",
    "executor",
    "actors_per_role",
    "batch_prefixes",
    "register",
    "where",
    "description",
}


def _fingerprinted(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _fingerprinted(v) for k, v in obj.items() if k not in _NOT_FINGERPRINTED}
    return obj


FINGERPRINT_REASONS = {"config_hash": "config changed", "source_hash": "data changed"}


def pipeline_fingerprint(params: Any, pair: Any) -> dict[str, str]:
    """What a pair's probes were trained from, as version tags: ``config_hash`` over the pair file, the
    format each model resolves to on this machine (``dtype: auto`` picks per CPU, and probes are per
    format) and the ingest/sample/cluster/train params, ``source_hash`` over the ingested source data."""
    sections = {name: asdict(getattr(params, name)) for name in ("ingest", "sample", "cluster", "train")}
    formats = {
        r: resolve_format(s.dtype, s.device).name for r, s in (("draft", pair.draft), ("target", pair.target))
    }
    return {
        "config_hash": config_hash(_fingerprinted({"pair": asdict(pair), "formats": formats, **sections})),
        "source_hash": source_fingerprint(params.ingest),
    }
