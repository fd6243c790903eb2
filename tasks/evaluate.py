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
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.entities import Metric
from mlflow.tracking.context.registry import resolve_tags
from scipy.stats import bootstrap
from tqdm.auto import tqdm

from semspec.models.decoding import DecodeResult, MethodNotApplicable, decode_all
from semspec.models.grading import grade
from semspec.models.lm import LM, load_lm
from semspec.models.names import PROBE_METHOD, ROLES, parse_label
from semspec.models.pair import PairConfig
from semspec.tasks.config import EvaluateConfig, Params
from semspec.tasks.data import Problem, generate_arith, load_source
from semspec.tasks.decoders import build_decoder, decode_settings
from semspec.tasks.fingerprint import pipeline_fingerprint
from semspec.tasks.io import (
    atomic_path,
    close_figure,
    config_hash,
    git_commit,
    save_figure_atomic,
    write_json_atomic,
)
from semspec.tasks.probe_registry import (
    TRACKING_ERRORS,
    check_tracking,
    read_pointers,
    setup_experiment,
)
from semspec.tasks.ray_utils import get_result, init_ray, restartable

log = logging.getLogger(__name__)


def eval_problems(
    name: str, count: int, seed: int, data_dir: str | None = None, levels: list[int] | None = None
) -> list[Problem]:
    """``count`` problems of a benchmark (0: all), a seeded subset; ``arith`` is the generated test split.
    ``levels`` keeps only problems of those difficulty levels where a benchmark has levels (MATH-500)."""
    if name == "arith":
        return generate_arith(count or 50, "test", seed=seed)
    problems = load_source(name, data_dir=data_dir)
    if levels and any(p.meta.get("level") is not None for p in problems):
        problems = [p for p in problems if _level(p.meta.get("level")) in levels]
    if count and count < len(problems):
        problems = random.Random(f"{seed}:{name}").sample(problems, count)
    return problems


def _level(v: object) -> int | None:
    """A level as an int (MATH-500 stores 3 or "Level 3")."""
    digits = "".join(c for c in str(v) if c.isdigit())
    return int(digits) if digits else None


def _decoders(
    cfg: EvaluateConfig,
    pair: PairConfig,
    lms: dict[str, LM],
    benchmark: str,
    seed: int,
    pins: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The decoders of every method label, and the labels that cannot run on this pair with the reason."""
    settings = decode_settings(cfg, seed=seed, benchmark="gpqa" if benchmark == "gpqa" else "math")
    out, skipped = {}, {}
    for label in cfg.method_labels():
        method, variant = parse_label(label)
        try:
            out[label] = build_decoder(method, pair, lms, settings, variant or "all", pins)
        except MethodNotApplicable as e:
            skipped[label] = str(e)
    return out, skipped


def bootstrap_pass(
    correct: list[bool], base: list[bool] | None = None, n_resamples: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """95% percentile-bootstrap interval of pass@1 over problems and, with ``base`` (the target's grades on
    the same problems, in the same order), of the paired difference ``pass@1 - base pass@1``.
    Intervals need at least two problems (None otherwise)."""
    a = np.asarray(correct, dtype=float)
    out: dict[str, Any] = {"pass@1_ci95": None}
    if base is not None:
        b = np.asarray(base, dtype=float)
        if b.shape != a.shape:
            raise ValueError(f"paired bootstrap needs grades on the same problems: {a.shape} vs {b.shape}")
        out.update(delta_vs_target=float(a.mean() - b.mean()) if len(a) else None, delta_vs_target_ci95=None)
    if len(a) < 2:
        return out
    kw = {
        "n_resamples": n_resamples,
        "method": "percentile",
        "vectorized": True,
        "rng": np.random.default_rng(seed),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all-equal grades: a degenerate (zero-width) interval is the answer
        ci = bootstrap((a,), np.mean, **kw).confidence_interval
        out["pass@1_ci95"] = [float(ci.low), float(ci.high)]
        if base is not None:
            diff = bootstrap((a, b), lambda x, y, axis: np.mean(x - y, axis=axis), paired=True, **kw)
            out["delta_vs_target_ci95"] = [
                float(diff.confidence_interval.low),
                float(diff.confidence_interval.high),
            ]
    return out


def summarize_rows(
    rows: list[dict[str, Any]], base_rows: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Metrics of one (benchmark, method) from its per-problem rows, against ``base_rows`` (the target's rows
    of the same run) where given. Speed-ups and the paired pass@1 difference use only the problems (question,
    seed) both have: ``speedup_latency`` = the target's mean time per problem / this method's (the paper's
    speed-up), ``speedup_per_token`` = the target's time per output token / this method's (fair when
    outputs differ in length). A problem's time is its ``cost_s``: its latency when decoded alone, its
    share of the batch's time when batched, so batched and one-at-a-time methods compare fairly;
    ``latency_s`` (join to last step) is reported beside it."""

    by_seed: dict[int, list[bool]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], []).append(r["correct"])
    tokens = sum(r["output_tokens"] for r in rows)
    seconds = sum(_cost(r) for r in rows)
    acc = [r["acceptance_rate"] for r in rows if r["acceptance_rate"] is not None]
    out = {
        "pass@1": statistics.mean(statistics.mean(v) for v in by_seed.values()),
        "latency_s": statistics.mean(r["latency_s"] for r in rows),
        "cost_s": statistics.mean(_cost(r) for r in rows),
        "tps": tokens / seconds if seconds else 0.0,
        "target_share": statistics.mean(r["target_share"] for r in rows),
        "step_acceptance": statistics.mean(acc) if acc else None,
        "speedup_latency": None,
        "speedup_per_token": None,
        "ms_per_token": 1000 * seconds / tokens if tokens else None,
        "n": len(rows),
    }
    base = {(r["question_id"], r["seed"]): r for r in base_rows or []}
    both = [(r, base[k]) for r in rows if (k := (r["question_id"], r["seed"])) in base]
    if base_rows is None or not both:
        out.update(bootstrap_pass([r["correct"] for r in rows]))
        return out
    mine, theirs = [m for m, _ in both], [t for _, t in both]
    out.update(bootstrap_pass([r["correct"] for r in mine], [r["correct"] for r in theirs]))
    out["speedup_latency"] = _ratio(sum(_cost(r) for r in theirs), sum(_cost(r) for r in mine))
    out["speedup_per_token"] = _ratio(_per_token(theirs), _per_token(mine))
    return out


def overall_metrics(
    rows: dict[tuple[str, str], list[dict[str, Any]]], labels: list[str], benches: list[str]
) -> dict[str, Any]:
    """Every benchmark together, per method: each problem counts once (pass@1 weighted by problems), and
    the speed-ups compare with the target on the same problems."""

    def pooled(label: str) -> list[dict[str, Any]]:
        return [
            {**r, "question_id": f"{bench}/{r['question_id']}"}
            for bench in benches
            for r in rows.get((bench, label), [])
        ]

    base = pooled("target") if "target" in labels else None
    return {label: summarize_rows(pooled(label), base) for label in labels if pooled(label)}


def _cost(r: dict[str, Any]) -> float:
    """A problem's machine time (rows written before costs were recorded: their latency)."""
    return r.get("cost_s", r["latency_s"])


def _per_token(rows: list[dict[str, Any]]) -> float | None:
    tokens = sum(r["output_tokens"] for r in rows)
    return sum(_cost(r) for r in rows) / tokens if tokens else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def problem_row(
    prob: Problem, seed: int, label: str, res: DecodeResult, pred: str | None, ok: bool
) -> dict[str, Any]:
    """One per-problem record: the answer, its grade, speed figures and the step trace."""
    return {
        "question_id": prob.question_id,
        "seed": seed,
        "method": label,
        "answer": pred,
        "gold": prob.answer,
        "correct": ok,
        "output_tokens": res.output_tokens,
        "latency_s": res.timings.total,
        "cost_s": res.timings.share or res.timings.total,
        "tps": res.tokens_per_second,
        "target_share": res.target_share,
        "acceptance_rate": res.acceptance_rate,
        "prefill_per_output_token": res.prefill_per_output_token,
        "timings": vars(res.timings),
        "finish_reason": res.finish_reason,
        "text": res.text,
        "steps": [
            {"author": s.author, "p": s.p, "q": s.q, "u": s.u, "target_tokens": s.target_tokens}
            for s in res.steps
        ],
        "extra": res.extra,
    }


_SELECTION = (
    "benchmarks",
    "methods",
    "probe_variants",
    "seeds",
    "subset_seed",
    "levels",
)  # which rows, not how


def run_key(
    cfg: EvaluateConfig, pair: PairConfig, label: str, identity: Any, formats: dict[str, str] | None = None
) -> str:
    """What a per-problem row depends on besides its problem and seed: the decoding settings, the pair file,
    the formats its models run in here (``auto`` resolves per machine) and, for SemanticSpec, its
    ``run_identity`` (probe versions, salvage). Rows with another key are stale
    and decoded again. The number of actors is not part of it (a row does not depend on which replica
    decoded it); the batch size is (latencies do). The probe domain is in SemanticSpec's label and its
    probes' identity, not in the key of the other methods' rows."""
    settings = {
        k: v
        for k, v in asdict(cfg).items()
        if k not in ("benchmarks", "methods", "probe_variants", "seeds", "actors", "probe_domain")
    }
    spec = {k: v for k, v in asdict(pair).items() if k != "description"}
    return config_hash(
        {
            "evaluate": settings,
            "pair": spec,
            "label": label,
            "probes": identity,
            **({"formats": formats} if formats else {}),
        }
    )


def _resume(path: Path, key: str) -> list[dict[str, Any]]:
    """The rows of ``path`` made with ``key``; the file is rewritten (atomically) without the others."""
    if not path.is_file():
        return []
    rows, stale = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a crash
            stale += 1
            continue
        if row.get("run_key") == key:
            rows.append(row)
        else:
            stale += 1
    if stale:
        log.info("evaluate: %s: dropping %d rows of other settings (or cut by a crash)", path, stale)
        with atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows), encoding="utf-8")
    return rows


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
    problems, skipped = _load_problems(cfg, data_dir)
    pool = _pool(cfg, pair, pins, lms)
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
        bench: {label: summarize_rows(rows[bench, label], rows.get((bench, "target"))) for label in labels}
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


def _load_problems(
    cfg: EvaluateConfig, data_dir: str | None
) -> tuple[dict[str, list[Problem]], dict[str, str]]:
    """The problems of every benchmark that can be loaded, and the others with the reason."""
    problems, skipped = {}, {}
    for b, n in cfg.benchmarks.items():
        try:
            problems[b] = eval_problems(b, n, cfg.subset_seed, data_dir, cfg.levels)
        except ValueError as e:  # a benchmark that is neither local nor reachable: say so, evaluate the rest
            log.warning("evaluate: skipping %s: %s", b, e)
            skipped[b] = str(e)
    if not problems:
        raise ValueError(f"no benchmark could be loaded: {skipped}")
    return problems, skipped


def _decode_missing(
    cfg: EvaluateConfig,
    problems: dict[str, list[Problem]],
    labels: list[str],
    keys: dict[str, str],
    out_dir: Path,
    pool: _LocalPool | _RayPool,
    live: LiveRuns | None = None,
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Rows per (benchmark, label): those on disk with this run's key, plus every missing problem decoded
    now by the pool and appended to its file as it finishes (by this process only: no duplicates); each
    finished problem also shows in its method's MLflow run (``live``)."""
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for bench in problems:
        (out_dir / bench).mkdir(parents=True, exist_ok=True)
        for label in labels:
            rows[bench, label] = _resume(out_dir / bench / f"{label}.jsonl", keys[label])
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


@dataclass
class Turn:
    """Problems of one benchmark and seed for one method, decoded in one batched call."""

    bench: str
    seed: int
    label: str
    problems: list[Problem]


class EvalWorker:
    """One replica of the pair and its decoders (in-process, or a Ray actor)."""

    def __init__(
        self,
        cfg: EvaluateConfig,
        pair: PairConfig,
        pins: dict[str, str] | None,
        lms: dict[str, LM] | None = None,
        threads: int | None = None,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.cfg, self.pair, self.pins = cfg, pair, pins
        self.lms = lms or {r: load_lm(pair.role(r)) for r in ROLES}
        self._built: dict[tuple[str, int], tuple[dict[str, Any], dict[str, str]]] = {}

    def decoders(self, bench: str, seed: int) -> tuple[dict[str, Any], dict[str, str]]:
        """The decoders of (benchmark, seed), built once."""
        if (bench, seed) not in self._built:
            self._built[bench, seed] = _decoders(self.cfg, self.pair, self.lms, bench, seed, self.pins)
        return self._built[bench, seed]

    def plan(self, bench: str) -> dict[str, Any]:
        """The models (id, dtype, device), the labels that cannot run with why, each label's run identity
        (the same for every benchmark: ``bench`` is where the decoders are built first)."""
        decoders, not_run = self.decoders(bench, self.cfg.seeds[0])
        identity = {label: getattr(dec, "run_identity", None) for label, dec in decoders.items()}
        return {
            "models": {r: lm.describe() for r, lm in self.lms.items()},
            "not_run": not_run,
            "identity": identity,
        }

    def decode(
        self, turn: Turn, on_result: Callable[[int, DecodeResult], None] | None = None
    ) -> list[DecodeResult]:
        """Decode a turn's problems (batched where the method can be)."""
        decoder = self.decoders(turn.bench, turn.seed)[0][turn.label]
        return decode_all(decoder, [p.question for p in turn.problems], self.cfg.batch_size, on_result)


class _LocalPool:
    """One in-process worker; rows are kept as each problem finishes."""

    def __init__(self, worker: EvalWorker) -> None:
        self.worker = worker

    def plan(self, bench: str) -> dict[str, Any]:
        return self.worker.plan(bench)

    def run(self, turns: list[Turn], keep: Callable[[Turn, int, DecodeResult], None]) -> None:
        for turn in turns:
            self.worker.decode(turn, functools.partial(keep, turn))

    def close(self) -> None:
        pass


class _RayPool:
    """Ray actors, each a worker with its share of the cores (or one GPU); turns go to whichever actor is
    free, and each turn's rows are kept by the driver when it returns."""

    def __init__(self, cfg: EvaluateConfig, pair: PairConfig, pins: dict[str, str] | None, n: int) -> None:
        import ray  # only the Ray pool needs it (a slow import)

        init_ray()
        self.ray = ray
        cuda = any(pair.role(r).uses_cuda for r in ROLES)
        cpus = max(1, int(ray.available_resources().get("CPU", os.cpu_count() or 1)) // n)
        opts = restartable(num_cpus=cpus, num_gpus=1 if cuda else 0)
        remote = ray.remote(EvalWorker)
        self.actors = [remote.options(**opts).remote(cfg, pair, pins, None, cpus) for _ in range(n)]
        log.info("evaluate: %d Ray actors, %d CPUs%s each", n, cpus, " and one GPU" if cuda else "")

    def plan(self, bench: str) -> dict[str, Any]:
        return self.ray.get(self.actors[0].plan.remote(bench))

    def run(self, turns: list[Turn], keep: Callable[[Turn, int, DecodeResult], None]) -> None:
        queue, idle, pending = list(turns), list(self.actors), {}
        while queue or pending:
            while idle and queue:
                actor, turn = idle.pop(), queue.pop(0)
                pending[actor.decode.remote(turn)] = (actor, turn)
            ready, _ = self.ray.wait(list(pending), num_returns=1)
            actor, turn = pending.pop(ready[0])
            ids = ", ".join(p.question_id for p in turn.problems)
            what = f"evaluate[{turn.bench}/{turn.label}, seed {turn.seed}] of problems {ids}"
            for i, res in enumerate(get_result(ready[0], what)):
                keep(turn, i, res)
            idle.append(actor)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)


def _pool(
    cfg: EvaluateConfig, pair: PairConfig, pins: dict[str, str] | None, lms: dict[str, LM] | None
) -> _LocalPool | _RayPool:
    """Where problems are decoded: Ray actors (``evaluate.actors``, or one per GPU for a cuda pair), else
    in this process (given ``lms`` always run here)."""
    n = cfg.actors
    if n is None and any(pair.role(r).uses_cuda for r in ROLES):
        n = torch.cuda.device_count() or None
    if lms is not None or not n:
        return _LocalPool(EvalWorker(cfg, pair, pins, lms))
    return _RayPool(cfg, pair, pins, n)


def write_plots(
    metrics: dict[str, Any], rows: dict[tuple[str, str], list[dict]], plots_dir: Path
) -> list[Path]:
    """pass@1 vs latency per benchmark (the paper's Figure 3), TPS per method, acceptance vs p/q."""
    import matplotlib  # imported here: the headless backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    metrics = {b: ms for b, ms in metrics.items() if not b.startswith("_")}
    figures = {f"pass_vs_latency-{bench}": _pass_vs_latency(plt, bench, ms) for bench, ms in metrics.items()}
    figures["tps"] = _throughput(plt, metrics)
    figures["acceptance_vs_ratio"] = _acceptance_vs_ratio(plt, rows)
    paths = []
    for name, fig in figures.items():
        fig.tight_layout()
        paths.append(save_figure_atomic(fig, plots_dir / f"{name}.png"))
        close_figure(fig)
    return paths


# one fixed colour per method in every chart, whichever methods a run has
METHOD_COLOURS = {
    "target": "black",
    "draft": "tab:gray",
    "specsampling": "tab:orange",
    "assisted": "tab:brown",
    "specreason": "tab:purple",
    "semanticspec-random": "tab:red",
    "semanticspec-last": "tab:cyan",
    "semanticspec-all": "tab:blue",
    "semanticspec-mix": "tab:green",
}


def method_style(label: str) -> dict[str, str]:
    """Colour (by method and probe variant) and marker (triangle for one domain's probes) of a label."""
    base, _, domain = label.partition("@")
    return {"color": METHOD_COLOURS.get(base, "tab:olive"), "marker": "^" if domain else "o"}


def _pass_vs_latency(plt: Any, bench: str, ms: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, m in ms.items():
        ax.scatter(m["latency_s"], m["pass@1"], s=40, label=label, **method_style(label))
    ax.set(
        xlabel="latency per problem (s)",
        ylabel="pass@1",
        ylim=(-0.05, 1.05),
        title=f"{bench}: accuracy vs latency",
    )
    ax.legend(fontsize=7, loc="best")
    return fig


def _throughput(plt: Any, metrics: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = sorted({label for ms in metrics.values() for label in ms})
    for j, bench in enumerate(metrics):
        ax.bar(
            [i + 0.8 * j / len(metrics) for i in range(len(labels))],
            [metrics[bench].get(label, {}).get("tps", 0) for label in labels],
            width=0.8 / len(metrics),
            label=bench,
        )
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="output tokens / s", title="throughput per method")
    ax.legend(fontsize=7)
    return fig


def _acceptance_vs_ratio(plt: Any, rows: dict[tuple[str, str], list[dict]]) -> Any:
    ratios = [
        (min(s["p"] / s["q"], 3.0) if s["q"] else 3.0, s["author"] == "draft")
        for rs in rows.values()
        for r in rs
        for s in r["steps"]
        if s["p"] is not None and s["q"] is not None
    ]
    fig, ax = plt.subplots(figsize=(5, 4))
    if ratios:
        ax.hist([r for r, a in ratios if a], bins=20, range=(0, 3), alpha=0.7, label="accepted")
        ax.hist(
            [r for r, a in ratios if not a], bins=20, range=(0, 3), alpha=0.7, label="rewritten by target"
        )
        ax.legend()
    ax.set(xlabel="p / q (clipped at 3)", ylabel="steps", title="acceptance vs probe ratio")
    return fig


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
    method, _, variant = label.partition("-")
    tags = {"stage": "evaluate", "pair": pair.name, "method": method, "variant": variant or "none"}
    tags |= {"git_commit": git_commit(), "config_hash": config_hash(asdict(cfg))}
    tags |= {f"{r}_model_id": d["model_id"] for r, d in models.items()}
    if variant:
        tags |= {f"{r}_probe_version": (pins or {}).get(f"{r}-{variant}", "champion") for r in ROLES}
    if method in ("target", "draft", "specsampling", "assisted"):
        tags["absent_metrics"] = "step_acceptance: this method verifies no draft steps"
    return tags


def _log_method(cfg: EvaluateConfig, label: str, metrics: dict[str, Any]) -> None:
    """The active (method) run's params and final metrics."""
    method, _, variant = label.partition("-")
    mlflow.log_params(
        {
            "method": method,
            "probe_variant": variant or "none",
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "gamma": cfg.gamma,
            "min_ratio": cfg.min_ratio,
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
        for name in ("pass@1_ci95", "delta_vs_target_ci95"):
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


RUN_KEY = "_run"  # in the stage's metrics file: what the finished evaluation was run on


def evaluation_identity(params: Params, pair: PairConfig, pins: dict[str, str] | None) -> dict[str, Any]:
    """What a finished evaluation of ``pair`` depends on: the probes' fingerprint (pair file, data,
    pipeline params), the evaluation settings and the probe versions it loaded."""
    return {
        **pipeline_fingerprint(params, pair),
        "evaluate_hash": config_hash(asdict(params.evaluate)),
        "split_strategy": params.split_strategy,
        "probes": dict(sorted((pins or {}).items())),
    }
