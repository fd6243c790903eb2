"""Stage ``evaluate``: every decoding method on the benchmarks, graded, timed and logged to MLflow.

Per problem rows go to ``eval/<benchmark>/<method>.jsonl``; the summary to ``eval/metrics.json``: pass@1
(mean over seeds) with a 95% bootstrap interval and the paired difference to ``target`` on the same
problems, latency, output tokens per second, the target's share of output tokens, step acceptance, and
two speed-ups against ``target`` measured in the same run: ``speedup_latency`` (mean latency per problem,
the paper's definition) and ``speedup_per_token`` (time per output token). Methods run interleaved on each
problem so that machine load affects them alike. A method that cannot run on the pair (``specsampling``
across two vocabularies) is listed under ``_skipped_methods`` with the reason.

The stage resumes per problem: a row already in ``<method>.jsonl`` with the same run key (evaluation
settings, pair file, probe versions) is kept and not decoded again; rows with another key are dropped.

This module holds the stage and the run; beside it: ``problems`` (which problems are decoded), ``workers``
(where: one replica of the pair per worker, in-process or Ray actors), ``runs`` (run keys and resuming),
``stats`` (the per-problem rows and the summary's statistics), ``plots`` and ``tracking`` (MLflow).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from semspec.models.lm import LM
from semspec.models.lm.pair import PairConfig
from semspec.models.spec.grading import grade
from semspec.models.spec.names import PROBE_METHOD
from semspec.models.spec.results import DecodeResult
from semspec.tasks.config import EvaluateConfig, Params
from semspec.tasks.data import Problem
from semspec.tasks.evaluate.plots import write_plots
from semspec.tasks.evaluate.problems import load_problems
from semspec.tasks.evaluate.runs import RUN_KEY, evaluation_identity, resume_rows, run_key
from semspec.tasks.evaluate.stats import overall_metrics, problem_row, summarize_rows
from semspec.tasks.evaluate.tracking import LiveRuns, log_to_mlflow
from semspec.tasks.evaluate.workers import Pool, Turn, make_pool
from semspec.tasks.io import write_json_atomic
from semspec.tasks.probe_registry import check_tracking, read_pointers

log = logging.getLogger(__name__)


def run_evaluate(
    cfg: EvaluateConfig,
    pair: PairConfig,
    out_dir: Path,
    plots_dir: Path | None = None,
    lms: dict[str, LM] | None = None,
    data_dir: str | None = None,
    log_mlflow: bool = True,
    pins: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Evaluate every method on every configured benchmark; returns ``{benchmark: {method: metrics}}``
    (plus ``_skipped`` benchmarks, ``_skipped_methods`` and ``_models``). SemanticSpec uses the probe
    versions ``pins`` names (see ``build_decoder``), else the champions. Resumes per problem (see the
    module notes)."""
    problems, skipped = load_problems(cfg, data_dir)
    pool = make_pool(cfg, pair, pins, lms)
    try:
        # 1. what the decoders are: methods that cannot run on this pair are skipped with the reason
        plan = pool.plan(next(iter(problems)))
        for r, d in plan["models"].items():
            log.info("evaluate: %s %s (%s, %s): %s", r, d["model_id"], d["dtype"], d["device"], d["why"])
        not_run = plan["not_run"]
        for label, why in not_run.items():
            log.warning("evaluate: skipping %s: %s", label, why)
        labels = [x for x in cfg.method_labels() if x not in not_run]
        formats = {r: d["dtype"] for r, d in plan["models"].items()}
        keys = {label: run_key(cfg, pair, label, plan["identity"][label], formats) for label in labels}
        # 2. decode what is not on disk yet with the same settings (resume), its MLflow runs open meanwhile
        live = LiveRuns.open(cfg, pair, labels, plan["models"], pins) if log_mlflow else None
        try:
            rows = _decode_missing(cfg, problems, labels, keys, out_dir, pool, live)
        except BaseException:
            if live is not None:
                live.fail()
            raise
    finally:
        pool.close()
    # 3. keep only the rows of this run's problems (a smaller run must not count an earlier, larger one's)
    wanted = {(b, p.question_id, s) for b, ps in problems.items() for p in ps for s in cfg.seeds}
    rows = {k: [r for r in rs if (k[0], r["question_id"], r["seed"]) in wanted] for k, rs in rows.items()}
    metrics: dict[str, Any] = {
        bench: {
            label: summarize_rows(rows[bench, label], rows.get((bench, "target")), rows.get((bench, "draft")))
            for label in labels
        }
        for bench in problems
    }
    metrics["_overall"] = overall_metrics(rows, labels, list(problems))
    if skipped:
        metrics["_skipped"] = skipped
    if not_run:
        metrics["_skipped_methods"] = not_run
    metrics["_models"] = plan["models"]
    write_json_atomic(metrics, out_dir / "metrics.json")
    if plots_dir is not None:
        write_plots(metrics, rows, plots_dir)
    if live is not None:
        log_to_mlflow(cfg, pair, metrics, plots_dir, labels, pins, live)
    return metrics


def _decode_missing(
    cfg: EvaluateConfig,
    problems: dict[str, list[Problem]],
    labels: list[str],
    keys: dict[str, str],
    out_dir: Path,
    pool: Pool,
    live: LiveRuns | None = None,
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Rows per (benchmark, label): those on disk with this run's key, plus every missing problem decoded
    now by the pool and appended to its file as it finishes (by this process only: no duplicates); each
    finished problem also shows in its method's MLflow run (``live``)."""
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for bench in problems:
        (out_dir / bench).mkdir(parents=True, exist_ok=True)
        for label in labels:
            rows[bench, label] = resume_rows(out_dir / bench / f"{label}.jsonl", keys[label])
    done = {(b, r["method"], r["question_id"], r["seed"]) for (b, _), rs in rows.items() for r in rs}
    chunk = 4 * cfg.batch_size  # problems per turn of a method: enough queue to keep its batch full
    turns = []
    for bench, probs in problems.items():
        for seed in cfg.seeds:
            for n, i in enumerate(range(0, len(probs), chunk)):
                for label in labels[n % len(labels) :] + labels[: n % len(labels)]:  # rotate who goes first
                    todo = [
                        p for p in probs[i : i + chunk] if (bench, label, p.question_id, seed) not in done
                    ]
                    if todo:
                        turns.append(Turn(bench, seed, label, todo))
    total = sum(len(probs) for probs in problems.values()) * len(cfg.seeds) * len(labels)
    with tqdm(
        total=total, initial=total - sum(len(t.problems) for t in turns), desc="evaluate", unit="decode"
    ) as bar:

        def keep(turn: Turn, i: int, res: DecodeResult) -> None:
            prob = turn.problems[i]
            pred, ok = grade(turn.bench, prob.answer, res.text)
            row = {**problem_row(prob, turn.seed, turn.label, res, pred, ok), "run_key": keys[turn.label]}
            row["batch_size"] = cfg.batch_size
            rows[turn.bench, turn.label].append(row)
            with open(out_dir / turn.bench / f"{turn.label}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row, default=str) + "\n")  # appended as it finishes: a crash keeps it
            bar.update(1)
            if live is not None:
                live.problem_done(turn.label, ok)

        pool.run(turns, keep)
    return rows


def stage(
    *, params: Params, pair: PairConfig, probes: Path, out: Path, plots: Path, metrics: Path
) -> dict[str, Any]:
    """Stage evaluate (the CLI's and dvc.yaml's entry): every method on the benchmarks, SemanticSpec with
    the probe versions the train stage recorded in ``probes``; the summary is also copied to ``metrics``
    (the file DVC tracks). Returns the metrics."""
    check_tracking()  # the probes come from the registry and the results go to MLflow
    pins = read_pointers(probes) if PROBE_METHOD in params.evaluate.methods else None
    res = run_evaluate(params.evaluate, pair, out, plots, data_dir=params.ingest.data_dir, pins=pins)
    # written only once every row is in: what `pairs status` compares to tell a finished evaluation
    write_json_atomic({**res, RUN_KEY: evaluation_identity(params, pair, pins)}, metrics)
    return res
