"""MLflow I/O: the pair's experiment, registering a probe and loading it back (with the model-fit check)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.exceptions import MlflowException
from torch import nn

from semspec.models.names import CHAMPION, PROBE_ARTIFACT, experiment_name, registered_name
from semspec.models.settings import settings

log = logging.getLogger(__name__)


def artifact_root() -> Path:
    """Where run artifacts go (``SEMSPEC_MLFLOW_ARTIFACTS``, default ``<project>/mlartifacts``)."""
    return settings().mlflow_artifacts


def setup_experiment(pair: str) -> str:
    """Create (once) and activate the pair's experiment; returns its id."""
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
    name = registered_name(pair, role, variant)
    shape = (1, data.num_layers, data.hidden_size) if variant == "mix" else (1, data.hidden_size)
    info = mlflow.pytorch.log_model(
        probe,
        name=PROBE_ARTIFACT,
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
    client.set_registered_model_alias(name, CHAMPION, version)
    return version


def load_probe(
    pair: str, role: str, variant: str, model_id: str, hidden_size: int, alias: str = CHAMPION
) -> nn.Module:
    """The registered probe ``semspec-<pair>-<role>-<variant>@alias``, after checking that it was trained
    on the hidden states of ``model_id`` with ``hidden_size`` (a mismatch is a clear error)."""
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
