"""Retrain policy: which configured pairs lack up-to-date champion probes, and why."""

from __future__ import annotations

import logging
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from semspec.models.names import CHAMPION, registered_name
from semspec.models.project import list_pairs, load_pair
from semspec.models.weights import unavailable_reason
from semspec.tasks.fingerprint import FINGERPRINT_REASONS, pipeline_fingerprint

log = logging.getLogger(__name__)


def champion_status(pair: str, roles: list[str], variants: list[str], expected: dict[str, str]) -> str | None:
    """None when every ``champion`` probe of the pair exists and carries the ``expected`` tags; else why
    the pair needs training ("no champion probe ...", "config changed ...", "data changed ...")."""
    client = mlflow.MlflowClient()
    for role in roles:
        for variant in variants:
            name = registered_name(pair, role, variant)
            try:
                mv = client.get_model_version_by_alias(name, CHAMPION)
            except MlflowException:
                return f"no champion probe {name}"
            tags = mv.tags or {}
            for key, value in expected.items():
                if tags.get(key) != value:
                    why = FINGERPRINT_REASONS.get(key, f"{key} changed")
                    return f"{why}: {name} v{mv.version} has {key}={tags.get(key)}, now {value}"
    return None


def pair_statuses(params: Any) -> dict[str, str | None]:
    """For every pair in ``conf/pairs/``: None when its champion probes match the current pair file,
    params and data (``pipeline_fingerprint``), else why it needs training; an unreadable pair file
    gives ``"invalid: ..."`` and a pair whose models cannot be loaded here (not cached offline, no GPU)
    ``"unavailable: ..."``; both are reported, never trained."""
    out: dict[str, str | None] = {}
    for name in list_pairs():
        try:
            cfg = load_pair(name)
        except ValueError as e:
            log.error("pair %s: %s", name, e)
            out[name] = f"invalid: {e}"
            continue
        missing = [why for s in (cfg.draft, cfg.target, cfg.judge) if (why := unavailable_reason(s))]
        if missing:
            out[name] = f"unavailable: {'; '.join(missing)}"
            continue
        out[name] = champion_status(
            name, list(params.sample.roles), list(params.train.variants), pipeline_fingerprint(params, cfg)
        )
    return out
