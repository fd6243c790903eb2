"""Human-readable results of a pair: metric tables, MLflow run links, the service URLs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

import mlflow

from semspec.flows.env import service_urls
from semspec.flows.stages import stage_files
from semspec.models.project.names import experiment_name

log = logging.getLogger(__name__)


def metrics_table(res: dict) -> str:
    """Test metrics of every (role, variant) as a markdown table."""
    cols = ["mse", "mae", "spearman", "brier", "ece", "auroc", "n"]
    lines = ["| role | variant | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for role, variants in res.items():
        if role.startswith("_"):
            continue
        for v, m in variants.items():
            cells = [f"{m[c]:.4f}" if isinstance(m[c], float) else str(m[c]) for c in cols]
            lines.append(f"| {role} | {v} | " + " | ".join(cells) + " |")
    if res.get("_routing"):
        lines += ["", routing_table_md(res["_routing"])]
    return "\n".join(lines)


def _cell(x: float | int) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def routing_table_md(routing: dict) -> str:
    """Routing metrics per probe variant (and the oracle): does min(1, p/q) accept the draft steps the
    target shares, and refuse the others? With the floor on p/q chosen on validation steps, and its test
    rates (nan: not chosen), and likewise the floor of the target's rule (accept iff p >= min_p)."""
    cols = ["true_accept", "false_accept", "auroc", "auroc_p", "n_shared", "n_not_shared", "min_ratio"]
    cols += ["true_accept_at_min_ratio", "false_accept_at_min_ratio"]
    cols += ["min_p", "true_accept_at_min_p", "false_accept_at_min_p"]
    lines = [
        "| routing (test draft steps) | " + " | ".join(cols) + " |",
        "|" + "---|" * (len(cols) + 1),
    ]
    for name, m in routing.items():
        cells = [_cell(m.get(c, float("nan"))) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


EVAL_COLUMNS = [
    "pass@1",
    "pass@1_ci95",
    "delta_vs_target_ci95",
    "delta_vs_draft_ci95",
    "same_answer_as_target",
    "same_answer_as_draft",
    "cut",
    "budget_90",
    "latency_s",
    "cost_s",
    "tps",
    "target_share",
    "step_acceptance",
    "speedup_latency",
    "speedup_per_token",
    "n",
]


def _cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, list):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def eval_table(res: dict) -> str:
    """Evaluation metrics as a markdown table (one row per benchmark and method), then each model's dtype
    and what was skipped. ``speedup_latency`` is the paper's speed-up (mean latency per problem vs target)."""
    cols = EVAL_COLUMNS
    lines = ["| benchmark | method | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
    notes = []
    for bench, ms in res.items():
        if bench == "_models":
            notes.append(
                "models: "
                + ", ".join(f"{r} {m['model_id']} ({m['dtype']}, {m['device']})" for r, m in ms.items())
            )
            notes += [f"format: {r}: {m['why']}" for r, m in ms.items() if m.get("why")]
        elif bench == "_run":  # provenance of the finished evaluation, not a table row
            continue
        elif bench.startswith("_") and bench != "_overall":
            notes += [f"{bench.strip('_').replace('_', ' ')}: {b}: {why}" for b, why in ms.items()]
        else:
            name = "all (by problem)" if bench == "_overall" else bench
            for m, v in ms.items():
                lines.append(f"| {name} | {m} | " + " | ".join(_cell(v.get(c)) for c in cols) + " |")
    return "\n".join(lines + [""] * bool(notes) + notes)


def stage_metrics(stage: str, pair: str, profile: str, root: Path | None = None) -> dict[str, Any] | None:
    """The metrics JSON that ``dvc.yaml`` declares for ``stage`` (None when it has not run yet)."""
    for path in stage_files(stage, "metrics", pair, profile, root):
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    return None


def mlflow_runs(pair: str) -> list[dict[str, str]]:
    """The latest finished MLflow run of each probe and evaluation method of ``pair`` with its UI link,
    probes first: ``[{"name", "stage", "url"}]``."""
    exp = mlflow.get_experiment_by_name(experiment_name(pair))
    if exp is None:
        return []
    runs = mlflow.search_runs(
        experiment_ids=[exp.experiment_id],
        filter_string="attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        output_format="list",
    )
    latest: dict[str, dict[str, str]] = {}
    for r in runs:
        name = r.info.run_name or r.info.run_id
        latest.setdefault(
            name,
            {
                "name": name,
                "stage": r.data.tags.get("stage", ""),
                "url": mlflow_ui_link(f"experiments/{exp.experiment_id}/runs/{r.info.run_id}"),
            },
        )
    return sorted(latest.values(), key=lambda x: (x["stage"] != "train", x["name"]))


def compare_url(pair: str) -> str | None:
    """MLflow UI link comparing the latest finished probe of each role and variant (Random, last, all,
    mix side by side, same metric names), None before any probe was trained."""
    exp = mlflow.get_experiment_by_name(experiment_name(pair))
    if exp is None:
        return None
    runs = mlflow.search_runs(
        experiment_ids=[exp.experiment_id],
        filter_string="attributes.status = 'FINISHED' and tags.stage = 'train'",
        order_by=["attributes.start_time DESC"],
        output_format="list",
    )
    latest: dict[str, str] = {}
    for r in runs:
        latest.setdefault(r.info.run_name or r.info.run_id, r.info.run_id)
    if not latest:
        return None
    ids = json.dumps([latest[k] for k in sorted(latest)], separators=(",", ":"))
    return mlflow_ui_link(
        "compare-runs", f"runs={quote(ids)}&experiments={quote(json.dumps([exp.experiment_id]))}"
    )


def experiment_url(pair: str) -> str | None:
    """MLflow UI link to the pair's experiment, opening on its runs (None before anything was logged)."""
    exp = mlflow.get_experiment_by_name(experiment_name(pair))
    return mlflow_ui_link(f"experiments/{exp.experiment_id}") if exp else None


# MLflow 3's UI opens in its GenAI view (an empty traces "Overview") unless told otherwise; the URL
# parameter wins over the browser's remembered choice, so every link we print opens on runs and models
ML_VIEW = "workflowType=machine_learning"


def mlflow_ui_link(route: str, query: str = "") -> str:
    """A link to ``route`` of the MLflow UI (``experiments/1``, ``compare-runs``) in its model-training view."""
    return f"{service_urls()['mlflow']}/#/{route}?{query + '&' if query else ''}{ML_VIEW}"


def pair_report(pair: str, profile: str, root: Path | None = None) -> str:
    """Markdown: the probes' test metrics and the evaluation metrics of ``pair``, as the stages left them."""
    parts = [f"# semspec: {pair} ({profile} profile)"]
    train = stage_metrics("train", pair, profile, root)
    parts += [
        "## Probe test metrics (held-out questions)",
        metrics_table(train) if train else "_not trained yet_",
    ]
    ev = stage_metrics("evaluate", pair, profile, root)
    parts += ["## Evaluation", eval_table(ev) if ev else "_not evaluated yet_"]
    return "\n\n".join(parts)
