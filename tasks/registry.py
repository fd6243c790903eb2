"""MLflow experiment setup, probe registration and loading (with the model-fit check)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from models.spec import project_root

log = logging.getLogger(__name__)

ALIAS = "champion"


def experiment_name(pair: str) -> str:
    """One MLflow experiment per model pair."""
    return f"semspec-{pair}"


def registered_name(pair: str, role: str, variant: str) -> str:
    """Registry name of a probe."""
    return f"semspec-{pair}-{role}-{variant}"


def artifact_root() -> Path:
    """Where run artifacts go (``SEMSPEC_MLFLOW_ARTIFACTS``, default ``<project>/mlartifacts``)."""
    return Path(os.environ.get("SEMSPEC_MLFLOW_ARTIFACTS", project_root() / "mlartifacts")).resolve()


def setup_experiment(pair: str) -> str:
    """Create (once) and activate the pair's experiment; returns its id."""
    import mlflow

    name = experiment_name(pair)
    exp = mlflow.get_experiment_by_name(name)
    if exp is None:
        exp_id = mlflow.create_experiment(name, artifact_location=(artifact_root() / name).as_uri())
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def register_probe(
    probe: nn.Module,
    pair: str,
    role: str,
    variant: str,
    data: Any,
    hashes: dict[str, str],
    commit: str,
    extra_tags: dict[str, str] | None = None,
) -> str:
    """Log ``probe`` to the active run, register it, tag the version and point ``champion`` at it.

    ``extra_tags`` (e.g. the pipeline fingerprint) are added to the version's tags."""
    import mlflow
    import torch

    name = registered_name(pair, role, variant)
    shape = (1, data.num_layers, data.hidden_size) if variant == "mix" else (1, data.hidden_size)
    info = mlflow.pytorch.log_model(
        probe,
        name="probe",
        serialization_format="pickle",  # the default pt2 export fixes the batch size and cannot hold RandomProbe
        registered_model_name=name,
        input_example=np.zeros(shape, dtype=np.float32),
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "lightning"],
    )
    version = str(info.registered_model_version)
    client = mlflow.MlflowClient()
    tags = {
        "model_id": data.model_id,
        "hidden_size": str(data.hidden_size),
        "feature": variant,
        "pair": pair,
        "role": role,
        "git_commit": commit,
        "data_hash": hashes["samples"],
        "labels_hash": hashes["labels"],
        **(extra_tags or {}),
    }
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)
    client.set_registered_model_alias(name, ALIAS, version)
    return version


def load_probe(
    pair: str, role: str, variant: str, model_id: str, hidden_size: int, alias: str = ALIAS
) -> nn.Module:
    """The registered probe ``semspec-<pair>-<role>-<variant>@alias``, after checking that it was trained
    on the hidden states of ``model_id`` with ``hidden_size`` (a mismatch is a clear error)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    name = registered_name(pair, role, variant)
    client = mlflow.MlflowClient()
    try:
        mv = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        raise ValueError(
            f"no registered probe {name}@{alias} in {mlflow.get_tracking_uri()}: train it with "
            f"`semspec train --pair {pair}` (or `dvc repro train`)"
        ) from None
    tags = mv.tags or {}
    if tags.get("model_id") != model_id:
        raise ValueError(
            f"probe {name} v{mv.version} was trained on {tags.get('model_id')!r}, not on {model_id!r}"
        )
    if tags.get("hidden_size") != str(hidden_size):
        raise ValueError(
            f"probe {name} v{mv.version} expects hidden size {tags.get('hidden_size')}, "
            f"the model has {hidden_size}"
        )
    probe = mlflow.pytorch.load_model(f"models:/{name}@{alias}", map_location="cpu")
    return probe.eval()


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
    """What a pair's probes were trained from, as version tags: ``config_hash`` over the pair file and
    the ingest/sample/cluster/train params, ``source_hash`` over the ingested source data."""
    from dataclasses import asdict

    from tasks.ingest import source_fingerprint
    from tasks.io import config_hash

    sections = {name: asdict(getattr(params, name)) for name in ("ingest", "sample", "cluster", "train")}
    return {
        "config_hash": config_hash(_fingerprinted({"pair": asdict(pair), **sections})),
        "source_hash": source_fingerprint(params.ingest),
    }


def champion_status(pair: str, roles: list[str], variants: list[str], expected: dict[str, str]) -> str | None:
    """None when every ``champion`` probe of the pair exists and carries the ``expected`` tags; else why
    the pair needs training ("no champion probe ...", "config changed ...", "data changed ...")."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    for role in roles:
        for variant in variants:
            name = registered_name(pair, role, variant)
            try:
                mv = client.get_model_version_by_alias(name, ALIAS)
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
    from models.spec import list_pairs, load_pair
    from models.weights import unavailable_reason

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
