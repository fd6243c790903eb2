"""MLflow for the train stage: each probe's nested run and registry version (``track_probe``), the routing
metrics on the runs and the chosen floors on the versions, the stage's outputs, and the probes kept while
MLflow was unreachable: written to ``pending.json`` (``write_pending``) and registered later without
retraining (``register_pending``, ``semspec register``)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from torch import nn

from semspec.models.spec.names import ROLES
from semspec.models.spec.probe import save_probe
from semspec.tasks.io import close_figure, save_figure_atomic, write_json_atomic
from semspec.tasks.probe_registry import (
    ACCEPT_RATE_TAG,
    MIN_JUDGED_STEPS,
    MIN_P_TAG,
    MIN_RATIO_TAG,
    POINTERS_FILE,
    TRACKING_ERRORS,
    ProbeRef,
    check_tracking,
    load_probe,
    promote,
    register_probe,
    routing_score,
    setup_experiment,
)
from semspec.tasks.train.plots import variant_figure
from semspec.tasks.train.trained import KeptProbe, Trained, TrainRun

log = logging.getLogger(__name__)

# the routing metrics logged on each probe run, beside its MSE
ROUTING_LOGGED = (
    "true_accept", "false_accept", "accept_rate", "auroc", "auroc_p", "min_ratio", "true_accept_at_min_ratio",
    "false_accept_at_min_ratio", "min_p", "true_accept_at_min_p", "false_accept_at_min_p",
)  # fmt: skip
PENDING_FILE = "pending.json"  # in the train out folder: probes trained but not registered yet
PENDING_DIR = "pending"  # their weights, one folder per probe
TRAIN_PARENT = "train-summary"  # the stage tag of the run that groups one train stage's probe runs


def _log_and_register(kept: KeptProbe, pair: str, register: bool) -> ProbeRef:
    """In the active (probe) run: the test metrics and the calibration plot; then the probe in
    ``kept.folder`` is stored as run artifacts and registered (``register``: as a new version, which
    ``promote_trained`` makes champion once the run's routing metrics are known)."""
    mlflow.log_metrics(kept.metrics)
    if Path(kept.plot).is_file():
        mlflow.log_artifact(kept.plot)
    return register_probe(
        Path(kept.folder),
        pair,
        kept.role,
        kept.key,
        kept.version_tags,
        register,
        kept.description,
        champion=False,
    )


def promote_trained(
    pair: str,
    pointers: dict[str, dict[str, Any]],
    routing: dict[str, dict[str, float]] | None,
    mode: str,
    champions: dict[str, dict[str, float]] | None = None,
) -> dict[str, bool]:
    """Make each variant's newly registered probes (``pointers``: ``<role>-<key>`` -> ProbeRef fields)
        champion when they route better on the held-out questions than the current champion (``promote``;
        ``mode`` ``always``: whatever their score). ``champions``: the current champions' routing metrics on
        the same held-out steps, where they could be read (``champion_probes``): scores from different test
        steps are not comparable, and a small run's few steps can score high by chance (a run with fewer than
    ``MIN_JUDGED_STEPS`` of either kind replaces only a champion without a score). A key without
        routing metrics (a per-domain probe, a run without joint labels) is judged by no score. Returns
        key -> whether it became champion."""
    keys = sorted({k.split("-", 1)[1] for k in pointers})
    out = {}
    for key in keys:
        versions = {
            role: str(ref["version"])
            for role in ROLES
            if (ref := pointers.get(f"{role}-{key}")) is not None and ref.get("version") is not None
        }
        if versions:
            mine, against = (routing or {}).get(key), (champions or {}).get(key)
            judged = (
                bool(mine) and min(mine.get("n_shared", 0), mine.get("n_not_shared", 0)) >= MIN_JUDGED_STEPS
            )
            out[key] = promote(
                pair, key, versions, routing_score(mine), force=mode == "always",
                against=None if against is None else routing_score(against), judged=judged,
            )  # fmt: skip
    return out


def champion_probes(trained: dict[tuple[str, str], Trained], variant: str) -> dict[str, nn.Module] | None:
    """The registry's current champion probes of ``variant`` (role -> probe), loaded only where they read
    the hidden states these probes were trained on (the same model, width, pooling and format:
    ``load_probe`` checks); None where there is no champion or it reads other features."""
    out = {}
    for role in ROLES:
        t = trained[role, variant]
        try:
            out[role], _ = load_probe(
                t.run.pair.name, role, variant, t.data.model_id, t.data.hidden_size,
                pooling=t.run.pair.pooling, fmt=t.data.format,
            )  # fmt: skip
        except (ValueError, *TRACKING_ERRORS) as e:
            log.info("train: the %s champion is not compared on these steps: %s", variant, e)
            return None
    return out


def track_probe(t: Trained) -> tuple[dict[str, float], ProbeRef]:
    """The probe in its own nested MLflow run: its params, the per-epoch MSE while it fits, its test
    metrics and calibration plot; stored as run artifacts and registered. Returns its test metrics and
    where it is stored."""
    with mlflow.start_run(run_name=f"probe-{t.role}-{t.key}", tags=t.run_tags(), nested=True) as active:
        t.run_id = active.info.run_id
        mlflow.log_params(t.params())
        t.fit(log_epochs=True)
        choice = getattr(t.probe, "choice", None)
        if choice is not None:  # the shape kept (validation MSE) and every candidate fitted
            mlflow.log_params({f"chosen_{k}": choice[k] for k in ("hidden", "weight_decay", "epochs")})
            mlflow.log_dict(choice, "search.json")
        with tempfile.TemporaryDirectory(prefix="semspec-probe-") as tmp:
            save_probe(t.probe, Path(tmp))
            ref = _log_and_register(t.record(Path(tmp)), t.run.pair.name, t.run.cfg.register)
    metrics = dict(t.metrics)
    if ref.version is not None:
        metrics["registered_version"] = int(ref.version)
    return metrics, ref


def register_pending(out_dir: Path, register: bool = True) -> dict[str, Any]:
    """Register the probes a train run kept in ``out_dir`` while MLflow was unreachable (no retraining):
    each gets its MLflow run (params, test metrics, calibration plot) and registry version as if it had
    been registered then; then the stage's outputs (test metrics, ``probes.json``) are written and the
    local copies removed. Returns the test metrics."""
    path = out_dir / PENDING_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: no probe is waiting to be registered")
    record = json.loads(path.read_text(encoding="utf-8"))
    check_tracking()
    pair, pointers, metrics = record["pair"], dict(record["registered"]), record["metrics"]
    setup_experiment(pair)
    with mlflow.start_run(
        run_name=f"train-{pair}-registered-later", tags={"stage": TRAIN_PARENT, "pair": pair}
    ):
        for kept in (KeptProbe(**p) for p in record["pending"]):
            with mlflow.start_run(run_name=kept.run_name, tags=kept.run_tags, nested=True):
                mlflow.log_params(kept.params)
                ref = _log_and_register(kept, pair, register)
            pointers[f"{kept.role}-{kept.key}"] = asdict(ref)
            if ref.version is not None:
                metrics[kept.role][kept.key]["registered_version"] = int(ref.version)
        promote_trained(pair, pointers, metrics.get("_routing"), record["params"].get("promote", "better"))
        fig = variant_figure(metrics, pair)
        save_figure_atomic(fig, Path(record["plots_dir"]) / "probe-variants.png")
        mlflow.log_figure(fig, "probe-variants.png")
        close_figure(fig)
    write_outputs(
        metrics,
        Path(record["metrics_path"]),
        {**{k: record[k] for k in ("params", "roles")}, "probes": pointers},
        out_dir,
    )
    shutil.rmtree(out_dir / PENDING_DIR, ignore_errors=True)
    path.unlink()
    log.info("registered %d kept probe(s) of %s", len(record["pending"]), pair)
    return metrics


def write_outputs(
    metrics: dict[str, Any], metrics_path: Path, pointers: dict[str, Any], out_dir: Path
) -> None:
    """Write the test metrics and the registered probes' pointers (the train stage's outputs)."""
    write_json_atomic(metrics, metrics_path)
    write_json_atomic(pointers, out_dir / POINTERS_FILE)


def write_pending(
    run: TrainRun,
    roles: list[str],
    pointers: dict[str, dict[str, Any]],
    kept: list[KeptProbe],
    metrics: dict[str, Any],
    metrics_path: Path,
    out_dir: Path,
) -> None:
    """Write ``out_dir/pending.json``: what ``register_pending`` needs to register the ``kept`` probes
    later and then write the stage's outputs (the probes registered before, every probe's test metrics)."""
    write_json_atomic(
        {
            "pair": run.pair.name,
            "params": asdict(run.cfg),
            "roles": roles,
            "registered": pointers,
            "pending": [asdict(k) for k in kept],
            "metrics": metrics,
            "metrics_path": str(metrics_path),
            "plots_dir": str(run.plots_dir),
        },
        out_dir / PENDING_FILE,
    )


def log_routing(routing: dict[str, dict[str, float]], trained: dict[tuple[str, str], Trained]) -> None:
    """Routing metrics on both probe runs of each variant (beside their MSE in the compare view) and every
    variant's, the oracle's included, on the parent train run."""
    client = mlflow.MlflowClient()
    for (_, key), t in trained.items():
        m = routing.get(key)
        if m is not None and t.run_id is not None:
            for name in ROUTING_LOGGED:
                if np.isfinite(m.get(name, float("nan"))):
                    client.log_metric(t.run_id, f"routing_{name}", m[name])
    mlflow.log_metrics(
        {f"routing_{v}_{k}": x for v, m in routing.items() for k, x in m.items() if np.isfinite(x)}
    )


def tag_floors(routing: dict[str, dict[str, float]], pointers: dict[str, dict[str, Any]]) -> None:
    """Tag both registered probes of each trained variant with the ``min_ratio`` and ``min_p`` chosen on
    the validation questions and the pair's step acceptance on the held-out steps (``evaluate.decode``'s
    ``min_ratio: auto``, ``min_p: auto`` and ``gamma: auto`` read them back at decode time; Random keeps the paper's
    rule and is not tagged)."""
    client = mlflow.MlflowClient()
    for variant, m in routing.items():
        if variant == "random":  # keys: plain variants, and the oracle (no probes, so no pointers)
            continue
        for tag in (MIN_RATIO_TAG, MIN_P_TAG, ACCEPT_RATE_TAG):
            floor = m.get(tag)
            if floor is None or not np.isfinite(floor):
                continue
            for role in ROLES:
                ref = pointers.get(f"{role}-{variant}")
                if ref is not None and ref.get("version") is not None:
                    client.set_model_version_tag(ref["name"], ref["version"], tag, f"{floor:.6g}")
