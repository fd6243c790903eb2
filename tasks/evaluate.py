"""Stage ``evaluate``: every decoding method on the benchmarks, graded, timed and logged to MLflow.

Per problem rows go to ``eval/<benchmark>/<method>.jsonl``; the summary (pass@1 as the mean over seeds,
latency, output tokens per second, the target's share of output tokens, step acceptance and speed-up
vs ``target`` measured in the same run) to ``eval/metrics.json``. Methods run interleaved on each
problem so that machine load affects them alike.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from models.decoding import DecodeResult, DecodeSettings
from models.grading import grade
from models.lm import LM, load_lm
from models.spec import PairConfig
from tasks.config import EvaluateConfig
from tasks.data import Problem, generate_arith, load_source
from tasks.decode import build_decoder
from tasks.io import write_json_atomic

log = logging.getLogger(__name__)


def eval_problems(name: str, count: int, seed: int, data_dir: str | None = None) -> list[Problem]:
    """``count`` problems of a benchmark (0: all), a seeded subset; ``arith`` is the generated test split."""
    if name == "arith":
        return generate_arith(count or 50, "test", seed=seed)
    problems = load_source(name, data_dir=data_dir)
    if count and count < len(problems):
        problems = random.Random(f"{seed}:{name}").sample(problems, count)
    return problems


def _decoders(
    cfg: EvaluateConfig, pair: PairConfig, lms: dict[str, LM], benchmark: str, seed: int
) -> dict[str, Any]:
    settings = DecodeSettings(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        gamma=cfg.gamma,
        min_ratio=cfg.min_ratio,
        seed=seed,
        benchmark="gpqa" if benchmark == "gpqa" else "math",
    )
    out = {}
    for label in cfg.method_labels():
        method, _, variant = label.partition("-")
        out[label] = build_decoder(method, pair, lms, settings, variant or "all")
    return out


def summarize_rows(rows: list[dict[str, Any]], base_ms_per_token: float | None) -> dict[str, Any]:
    """Metrics of one (benchmark, method) from its per-problem rows. The speed-up is the ratio of time per
    output token to the target's in the same run (outputs of different lengths stay comparable)."""
    by_seed: dict[int, list[bool]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], []).append(r["correct"])
    tokens = sum(r["output_tokens"] for r in rows)
    seconds = sum(r["latency_s"] for r in rows)
    acc = [r["acceptance_rate"] for r in rows if r["acceptance_rate"] is not None]
    latency = statistics.mean(r["latency_s"] for r in rows)
    ms_tok = 1000 * seconds / tokens if tokens else None
    return {
        "pass@1": statistics.mean(statistics.mean(v) for v in by_seed.values()),
        "latency_s": latency,
        "tps": tokens / seconds if seconds else 0.0,
        "target_share": statistics.mean(r["target_share"] for r in rows),
        "step_acceptance": statistics.mean(acc) if acc else None,
        "speedup_vs_target": (base_ms_per_token / ms_tok) if base_ms_per_token and ms_tok else None,
        "ms_per_token": ms_tok,
        "n": len(rows),
    }


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
        "tps": res.tokens_per_second,
        "target_share": res.target_share,
        "acceptance_rate": res.acceptance_rate,
        "prefill_per_output_token": res.prefill_per_output_token,
        "timings": vars(res.timings),
        "finish_reason": res.finish_reason,
        "steps": [
            {"author": s.author, "p": s.p, "q": s.q, "u": s.u, "target_tokens": s.target_tokens}
            for s in res.steps
        ],
        "extra": res.extra,
    }


def run_evaluate(
    cfg: EvaluateConfig,
    pair: PairConfig,
    out_dir: Path,
    plots_dir: Path | None = None,
    lms: dict[str, LM] | None = None,
    data_dir: str | None = None,
    log_mlflow: bool = True,
) -> dict[str, Any]:
    """Evaluate every method on every configured benchmark; returns ``{benchmark: {method: metrics}}``."""
    lms = lms or {r: load_lm(pair.role(r)) for r in ("draft", "target")}
    labels = cfg.method_labels()
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    problems, skipped = {}, {}
    for b, n in cfg.benchmarks.items():
        try:
            problems[b] = eval_problems(b, n, cfg.subset_seed, data_dir)
        except ValueError as e:  # a benchmark that is neither local nor reachable: say so, evaluate the rest
            log.warning("evaluate: skipping %s: %s", b, e)
            skipped[b] = str(e)
    if not problems:
        raise ValueError(f"no benchmark could be loaded: {skipped}")
    total = sum(len(p) for p in problems.values()) * len(cfg.seeds) * len(labels)
    for bench in problems:  # rows are appended as each decode finishes: a crash keeps what was done
        (out_dir / bench).mkdir(parents=True, exist_ok=True)
        for label in labels:
            (out_dir / bench / f"{label}.jsonl").unlink(missing_ok=True)
    with tqdm(total=total, desc="evaluate", unit="decode") as bar:
        for bench, probs in problems.items():
            for seed in cfg.seeds:
                decs = _decoders(cfg, pair, lms, bench, seed)
                for i, prob in enumerate(probs):
                    order = labels[i % len(labels) :] + labels[: i % len(labels)]  # rotate who goes first
                    for label in order:
                        res = decs[label].decode(prob.question)
                        pred, ok = grade(bench, prob.answer, res.text)
                        row = problem_row(prob, seed, label, res, pred, ok)
                        rows.setdefault((bench, label), []).append(row)
                        with open(out_dir / bench / f"{label}.jsonl", "a", encoding="utf-8") as f:
                            f.write(json.dumps(row, default=str) + "\n")
                        bar.update(1)
    metrics: dict[str, Any] = {}
    for bench in problems:
        base = rows.get((bench, "target"))
        base_tokens = sum(r["output_tokens"] for r in base) if base else 0
        base_ms = 1000 * sum(r["latency_s"] for r in base) / base_tokens if base_tokens else None
        metrics[bench] = {label: summarize_rows(rows[(bench, label)], base_ms) for label in labels}
    if skipped:
        metrics["_skipped"] = skipped
    write_json_atomic(metrics, out_dir / "metrics.json")
    if plots_dir is not None:
        write_plots(metrics, rows, plots_dir)
    if log_mlflow:
        log_to_mlflow(cfg, pair, metrics, plots_dir)
    return metrics


def write_plots(
    metrics: dict[str, Any], rows: dict[tuple[str, str], list[dict]], plots_dir: Path
) -> list[Path]:
    """pass@1 vs latency per benchmark (the paper's Figure 3), TPS per method, acceptance vs p/q."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    metrics = {b: ms for b, ms in metrics.items() if not b.startswith("_")}
    for bench, ms in metrics.items():
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for label, m in ms.items():
            ax.scatter(m["latency_s"], m["pass@1"], s=40, label=label)
        ax.set(
            xlabel="latency per problem (s)",
            ylabel="pass@1",
            ylim=(-0.05, 1.05),
            title=f"{bench}: accuracy vs latency",
        )
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        paths.append(plots_dir / f"pass_vs_latency-{bench}.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
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
    fig.tight_layout()
    paths.append(plots_dir / "tps.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
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
    fig.tight_layout()
    paths.append(plots_dir / "acceptance_vs_ratio.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def log_to_mlflow(
    cfg: EvaluateConfig, pair: PairConfig, metrics: dict[str, Any], plots_dir: Path | None
) -> None:
    """One MLflow run per method (probe variant as a param), metrics per benchmark as ``<bench>_<metric>``."""
    import mlflow

    from tasks.registry import setup_experiment

    setup_experiment(pair.name)
    for label in cfg.method_labels():
        method, _, variant = label.partition("-")
        tags = {"stage": "evaluate", "pair": pair.name, "method": method, "variant": variant or "none"}
        with mlflow.start_run(run_name=f"eval-{label}", tags=tags):
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
                }
            )
            for bench, ms in metrics.items():
                if bench.startswith("_"):
                    continue
                m = ms[label]
                mlflow.log_metrics(
                    {
                        f"{bench}_{k.replace('@', '_at_')}": float(v)
                        for k, v in m.items()
                        if isinstance(v, int | float)
                    }
                )
            if plots_dir is not None and plots_dir.is_dir():
                for p in plots_dir.glob("*.png"):
                    mlflow.log_artifact(str(p), "plots")
