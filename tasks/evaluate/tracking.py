"""An evaluation in MLflow: its runs are opened before decoding (live progress per method), tagged with their
provenance, and finished with every metric and the plots."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.tracking.context.registry import resolve_tags

from semspec.models.lm.pair import PairConfig
from semspec.models.spec.names import ROLES, STEP_METHODS, parse_label
from semspec.tasks.config import EvaluateConfig
from semspec.tasks.io import config_hash, git_commit
from semspec.tasks.probe_registry import TRACKING_ERRORS, setup_experiment

log = logging.getLogger(__name__)


class LiveRuns:
    """An evaluation's MLflow runs, opened before any decoding so that their duration is the evaluation's
    and each method's progress shows while it runs: a parent run (``evaluate-<pair>``, it holds the plots)
    with one nested run per method label (``eval-<label>``), tagged with their provenance (git commit,
    config hash, model ids, probe versions). Losing MLflow mid-run costs only the live progress (a warning):
    the rows are on disk and the final logging reports the error."""

    def __init__(self, parent: str, methods: dict[str, str]) -> None:
        self.parent, self.methods = parent, methods  # run ids; methods: label -> run id
        self.done = dict.fromkeys(methods, 0)
        self.correct = dict.fromkeys(methods, 0)
        self.lost = False

    @classmethod
    def open(
        cls,
        cfg: EvaluateConfig,
        pair: PairConfig,
        labels: list[str],
        models: dict[str, dict[str, str]],
        pins: dict[str, str] | None,
    ) -> LiveRuns:
        """Create the parent run and one nested run per label, all running."""
        exp_id = setup_experiment(pair.name)
        client = mlflow.MlflowClient()
        tags = {"stage": EVAL_PARENT, "pair": pair.name, "git_commit": git_commit()}
        tags["config_hash"] = config_hash(asdict(cfg))
        # resolve_tags adds what a fluent run gets by itself (the source script, user, git commit), so the
        # UI's Source and User columns are filled for these runs too
        run = client.create_run(exp_id, run_name=f"evaluate-{pair.name}", tags=resolve_tags(tags))
        parent = run.info.run_id
        methods = {
            label: client.create_run(
                exp_id,
                run_name=f"eval-{label}",
                tags=resolve_tags({**_method_tags(cfg, pair, label, models, pins), MLFLOW_PARENT: parent}),
            ).info.run_id
            for label in labels
        }
        return cls(parent, methods)

    def problem_done(self, label: str, correct: bool) -> None:
        """One more problem of ``label`` decoded and graded in this run (resumed rows are not counted): the
        count and the running pass@1 of this run's problems, live."""
        self.done[label] += 1
        self.correct[label] += bool(correct)
        if self.lost:
            return
        n = self.done[label]
        metrics = [
            Metric("problems_decoded", n, _now_ms(), n),
            Metric("pass_at_1_so_far", self.correct[label] / n, _now_ms(), n),
        ]
        try:
            mlflow.MlflowClient().log_batch(self.methods[label], metrics=metrics)
        except TRACKING_ERRORS as e:
            self.lost = True
            log.warning("evaluate: MLflow unreachable, live progress stops (the rows are kept): %s", e)

    def fail(self) -> None:
        """Mark every run failed (the evaluation stopped); best effort."""
        client = mlflow.MlflowClient()
        for run_id in [*self.methods.values(), self.parent]:
            try:
                client.set_terminated(run_id, status="FAILED")
            except TRACKING_ERRORS:
                return


MLFLOW_PARENT = "mlflow.parentRunId"  # the tag that nests a run under another in the MLflow UI


def _now_ms() -> int:
    return int(time.time() * 1000)


def log_to_mlflow(
    cfg: EvaluateConfig,
    pair: PairConfig,
    metrics: dict[str, Any],
    plots_dir: Path | None,
    labels: list[str] | None = None,
    pins: dict[str, str] | None = None,
    live: LiveRuns | None = None,
) -> None:
    """Finish the evaluation's MLflow runs (``live``, opened now when not given): the plots once on the
    parent; per method (probe variant as a param) metrics per benchmark as ``<bench>_<metric>`` and over
    all benchmarks without a prefix, each model's dtype as a param. Ending them here makes each run last
    from the first decode to now."""
    labels = labels or cfg.method_labels()
    live = live or LiveRuns.open(cfg, pair, labels, metrics.get("_models", {}), pins)
    with mlflow.start_run(run_id=live.parent):
        if plots_dir is not None and plots_dir.is_dir():
            for p in sorted(plots_dir.glob("*.png")):
                mlflow.log_artifact(str(p), "plots")  # once, on the parent run
        for label in labels:
            with mlflow.start_run(run_id=live.methods[label], nested=True):
                _log_method(cfg, label, metrics)


EVAL_PARENT = "evaluate-summary"  # the stage tag of the run that groups one evaluation's method runs


def _method_tags(
    cfg: EvaluateConfig,
    pair: PairConfig,
    label: str,
    models: dict[str, dict[str, str]],
    pins: dict[str, str] | None,
) -> dict[str, str]:
    """A method run's tags: what it is and its provenance (git commit, config hash, model ids, probes)."""
    method, variant = parse_label(label)
    tags = {"stage": "evaluate", "pair": pair.name, "method": method, "variant": variant or "none"}
    tags |= {"git_commit": git_commit(), "config_hash": config_hash(asdict(cfg))}
    tags |= {f"{r}_model_id": d["model_id"] for r, d in models.items()}
    if variant:
        tags |= {f"{r}_probe_version": (pins or {}).get(f"{r}-{variant}", "champion") for r in ROLES}
    if method not in STEP_METHODS:
        tags["absent_metrics"] = "step_acceptance: this method verifies no draft steps"
    return tags


def _log_method(cfg: EvaluateConfig, label: str, metrics: dict[str, Any]) -> None:
    """The active (method) run's params and final metrics."""
    method, variant = parse_label(label)
    mlflow.log_params(
        {
            "method": method,
            "probe_variant": variant or "none",
            **cfg.decode.configured(),
            "seeds": cfg.seeds,
            "benchmarks": cfg.benchmarks,
            **{f"{r}_dtype": d["dtype"] for r, d in metrics.get("_models", {}).items()},
            **{f"{r}_format": d.get("why", d["dtype"]) for r, d in metrics.get("_models", {}).items()},
        }
    )
    for bench, ms in metrics.items():
        if bench.startswith("_") and bench != "_overall":
            continue
        if label not in ms:
            continue
        m = dict(ms[label])
        for name in ("pass@1_ci95", "delta_vs_target_ci95", "delta_vs_draft_ci95"):
            if m.get(name):
                m[f"{name}_low"], m[f"{name}_high"] = m.pop(name)
        prefix = "" if bench == "_overall" else f"{bench}_"
        mlflow.log_metrics(
            {
                f"{prefix}{k.replace('@', '_at_')}": float(v)
                for k, v in m.items()
                if isinstance(v, int | float)
            }
        )
