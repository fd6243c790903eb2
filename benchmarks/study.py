"""The accuracy study: the paper's Table 1 on a CPU, in one resumable command.

    python benchmarks/study.py [--pair qwen-coder] [--budget N | --budget-sample N] [--llamacpp BIN]
                               [--problems N [--token-problems M]] [--floors 0.5 1 1.5 2]

1. **The budget** (skipped with ``--budget``): the target alone, greedy, on the study's problems under a
   budget far above what it needs (``--profile budget``); ``budget_90`` of its metrics is the least budget
   at which 90% of its answers end by themselves, the budget every method then gets. With
   ``--budget-sample N``, on a seeded random N of them (each benchmark in proportion): the target alone
   on every problem at a large budget takes about as long as one method of the study.
2. **The study**: ``--profile study`` (every method on the same problems, greedy) at that budget, with
   llama.cpp's target on the same GGUF file where ``--llamacpp`` names a ``llama-server`` (or its folder).
   With ``--problems N``, on a seeded random N of the study's problems (each benchmark in proportion);
   with ``--token-problems M`` too, the token-level methods (``specsampling``, llama.cpp) on a random M
   of those (the seeded samples nest) and the others on all N: the reduced form for a CPU where the whole
   set does not fit. The target runs on all N; its rows serve both runs.
3. **The operating curve**: SemanticSpec ``all`` at each ``--floors`` value of ``min_ratio`` (a step is
   accepted when ``u < min(1, p/q)`` and ``p/q`` reaches the floor), each into its own folder; the
   target's rows of step 2 are shared, not decoded again.

Each evaluation resumes per problem (run it again after a kill). Writes ``eval/<pair>-study/`` (rows),
``reports/<pair>-study/``: ``study.md`` (the table, the curve, the CPU, formats, problem counts and
budget), ``metrics.json`` and ``pareto.png`` (``benchmarks/figure.py``: pass@1 against time per problem,
every method, the curve's points beside them).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: ``benchmarks`` importable

from benchmarks.weak_draft import semspec, share_baselines

log = logging.getLogger("semspec.benchmarks.study")

OVERALL = "_overall"
CURVE = "semanticspec-all"  # the method the operating curve moves
LLAMACPP = "llamacpp"
STEP_METHODS = ["target", "draft", "specreason", "semanticspec"]  # with the single-model baselines


def read_budget(metrics: dict[str, Any]) -> int:
    """The budget run's ``budget_90`` of the target over every benchmark; ``ValueError`` when fewer than
    90% of its answers ended within the run's budget (say how to get one)."""
    budget = metrics.get(OVERALL, {}).get("target", {}).get("budget_90")
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(
            "the budget run's target did not finish 90% of its answers within its budget: rerun it with a "
            "larger one (--set evaluate.decode.max_new_tokens=N) or pass --budget N"
        )
    return budget


def sample_sets(profile: str, n: int) -> list[str]:
    """The ``--set`` that evaluates about ``n`` of ``profile``'s problems: a seeded random subset of each
    benchmark, in proportion to its size (each keeps at least one)."""
    from semspec.tasks.config import load_params
    from semspec.tasks.evaluate.problems import eval_problems

    cfg = load_params(profile=profile).evaluate
    sizes = {
        b: len(eval_problems(b, count, cfg.subset_seed, None, cfg.levels))
        for b, count in cfg.benchmarks.items()
    }
    total = sum(sizes.values())
    if not 0 < n < total:
        raise ValueError(f"--budget-sample takes a count between 1 and the {total} problems of the study")
    picked = {b: max(1, round(n * size / total)) for b, size in sizes.items()}
    return ["evaluate.benchmarks={" + ", ".join(f"{b}: {k}" for b, k in picked.items()) + "}"]


def evaluate(pair: str, profile: str, out: Path, reports: Path, name: str, sets: list[str]) -> dict:
    """One ``semspec evaluate`` (resumes per problem) into ``out``; its summary."""
    metrics = reports / f"{name}.json"
    opts = [x for s in sets for x in ("--set", s)]
    semspec(
        "evaluate", "--pair", pair, "--profile", profile, *opts,
        "--out", str(out), "--metrics", str(metrics), "--plots", str(reports / f"plots-{name}"),
    )  # fmt: skip
    return json.loads(metrics.read_text())


def curve_points(runs: dict[float, dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per floor: SemanticSpec ``all``'s overall pass@1 (interval), time per problem, speed-up
    against the target, step acceptance and its paired difference to the target."""
    points = []
    for floor, metrics in sorted(runs.items()):
        m = metrics.get(OVERALL, {}).get(CURVE)
        if m is None:
            continue
        points.append(
            {
                "min_ratio": floor,
                **{k: m.get(k) for k in ("pass@1", "pass@1_ci95", "cost_s", "speedup_latency")},
                **{k: m.get(k) for k in ("step_acceptance", "delta_vs_target", "delta_vs_target_ci95")},
            }
        )
    return points


def with_curve(metrics: dict[str, Any], runs: dict[float, dict[str, Any]]) -> dict[str, Any]:
    """The study's summary with each floor's SemanticSpec ``all`` beside its methods (``all, min_ratio F``),
    for the figure."""
    overall = dict(metrics.get(OVERALL, {}))
    for floor, run in sorted(runs.items()):
        if (m := run.get(OVERALL, {}).get(CURVE)) is not None:
            overall[f"{CURVE}, min_ratio {floor:g}"] = m
    return {**metrics, OVERALL: overall}


COLUMNS = [  # (header, key, format)
    ("pass@1", "pass@1", "{:.3f}"),
    ("95% CI", "pass@1_ci95", "[{:.3f}, {:.3f}]"),
    ("vs target", "delta_vs_target", "{:+.3f}"),
    ("(95%)", "delta_vs_target_ci95", "[{:+.3f}, {:+.3f}]"),
    ("vs draft", "delta_vs_draft", "{:+.3f}"),
    ("(95%)", "delta_vs_draft_ci95", "[{:+.3f}, {:+.3f}]"),
    ("s/problem", "cost_s", "{:.1f}"),
    ("x target", "speedup_latency", "{:.2f}"),
    ("x llama.cpp", "speedup_vs_llamacpp", "{:.2f}"),
    ("target share", "target_share", "{:.2f}"),
    ("step acc", "step_acceptance", "{:.2f}"),
    ("= draft's answer", "same_answer_as_draft", "{:.2f}"),
    ("= target's answer", "same_answer_as_target", "{:.2f}"),
    ("cut", "cut", "{:.2f}"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    return fmt.format(*value) if isinstance(value, list | tuple) else fmt.format(value)


def with_llamacpp(overall: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each method's speed-up against llama.cpp's target (its time per problem over the method's, the
    same problems), where the study ran llama.cpp."""
    base = overall.get(LLAMACPP, {}).get("cost_s")
    return {
        label: m
        if "speedup_vs_llamacpp" in m
        else {**m, "speedup_vs_llamacpp": base / m["cost_s"] if base and m.get("cost_s") else None}
        for label, m in overall.items()
    }


def with_token_run(metrics: dict[str, Any], token: dict[str, Any], labels: list[str]) -> dict[str, Any]:
    """The study's summary with the token-level methods (``labels``) taken from their run on a subset of
    the study's problems (``token``, where the target ran too). Speed-ups against llama.cpp go through the
    target: a method's speed-up against our target (paired, on its problems) times our target's against
    llama.cpp's on the subset, so no ratio compares different problems."""
    overall = dict(metrics.get(OVERALL, {}))
    sub = token.get(OVERALL, {})
    for label in labels:
        if label in sub:
            overall[label] = sub[label]
    target, llama = sub.get("target", {}).get("cost_s"), sub.get(LLAMACPP, {}).get("cost_s")
    if target and llama:
        overall = {
            label: {**m, "speedup_vs_llamacpp": m["speedup_latency"] * llama / target}
            if m.get("speedup_latency")
            else m
            for label, m in overall.items()
        }
    return {**metrics, OVERALL: overall}


def table(overall: dict[str, dict[str, Any]]) -> str:
    """The study's table (markdown), one row per method, in the evaluation's order."""
    head = "| method | " + " | ".join(h for h, _, _ in COLUMNS) + " |"
    rows = [head, "|---" * (len(COLUMNS) + 1) + "|"]
    for label, m in with_llamacpp(overall).items():
        rows.append(f"| {label} | " + " | ".join(_cell(m.get(k), f) for _, k, f in COLUMNS) + " |")
    return "\n".join(rows)


def curve_table(points: list[dict[str, Any]]) -> str:
    """The operating curve (markdown): SemanticSpec ``all`` per floor on p/q."""
    rows = [
        "| min_ratio | pass@1 | 95% CI | vs target | (95%) | s/problem | x target | step acc |",
        "|---" * 8 + "|",
    ]
    for p in points:
        cells = [
            f"{p['min_ratio']:g}",
            _cell(p["pass@1"], "{:.3f}"),
            _cell(p["pass@1_ci95"], "[{:.3f}, {:.3f}]"),
            _cell(p["delta_vs_target"], "{:+.3f}"),
            _cell(p["delta_vs_target_ci95"], "[{:+.3f}, {:+.3f}]"),
            _cell(p["cost_s"], "{:.1f}"),
            _cell(p["speedup_latency"], "{:.2f}"),
            _cell(p["step_acceptance"], "{:.2f}"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def report(metrics: dict[str, Any], points: list[dict[str, Any]], budget: int, cpu: str) -> str:
    """``study.md``: what ran where (CPU, formats, problems, budget), the table and the curve."""
    models = metrics.get("_models", {})
    formats = "; ".join(f"{r}: {d.get('model_id')} ({d.get('dtype')})" for r, d in models.items())
    counts = ", ".join(
        f"{b}: {next(iter(m.values())).get('n')}"
        for b, m in metrics.items()
        if not b.startswith("_") and isinstance(m, dict) and m
    )
    return "\n\n".join(
        [
            "# The accuracy study",
            f"CPU: {cpu}. Models: {formats}. Problems: {counts}. Budget: {budget} new tokens, greedy.",
            table(metrics.get(OVERALL, {})),
            "## The operating curve (SemanticSpec `all`, floor on p/q)",
            curve_table(points),
        ]
    )


def cpu_name() -> str:
    """torch's CPU capability and the AMX / VNNI / bfloat16 flags, named beside every figure."""
    import torch

    flags = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(next(ln for ln in text.splitlines() if ln.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pass
    shown = sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512_vnni", "avx_vnni")))
    return f"{torch.backends.cpu.get_cpu_capability()} ({', '.join(shown) or 'no AMX/VNNI/bf16 flags'})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen-coder")
    ap.add_argument(
        "--budget", type=int, default=None, help="skip the budget run: give every method N tokens"
    )
    ap.add_argument(
        "--budget-sample", type=int, default=None,
        help="measure the budget on a random N of the study's problems (in proportion per benchmark)",
    )  # fmt: skip
    ap.add_argument(
        "--problems", type=int, default=None, help="a random N of the study's problems (every method)"
    )
    ap.add_argument(
        "--token-problems", type=int, default=None,
        help="the token-level methods (specsampling, llama.cpp) on a random N of those problems only",
    )  # fmt: skip
    ap.add_argument("--llamacpp", default=None, help="llama-server (or its folder): llama.cpp's target too")
    ap.add_argument("--floors", type=float, nargs="*", default=[0.5, 1.0, 1.5, 2.0], help="min_ratio values")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if a.budget is not None and a.budget < 1:
        ap.error("--budget takes a token count >= 1")
    if a.token_problems is not None and not 0 < a.token_problems < (a.problems or 10**9):
        ap.error("--token-problems takes a count >= 1 and below --problems")
    run = f"{a.pair}-study"
    rows, reports = Path("eval") / run, Path("reports") / run
    budget = a.budget
    if budget is None:
        sets = sample_sets("budget", a.budget_sample) if a.budget_sample else []
        name = f"budget-{a.budget_sample}" if a.budget_sample else "budget"
        budget = read_budget(
            evaluate(a.pair, "budget", Path("eval") / f"{a.pair}-{name}", reports, name, sets)
        )
    log.info("study: every method gets %d new tokens", budget)
    sets = [
        f"evaluate.decode.max_new_tokens={budget}",
        *(sample_sets("study", a.problems) if a.problems else []),
    ]
    token = ["specsampling", *([LLAMACPP] if a.llamacpp else [])]
    llama = [f"evaluate.llamacpp_bin={a.llamacpp}"] if a.llamacpp else []
    if a.token_problems:  # the token-level methods apart, on a subset (the samples nest: the same seed)
        metrics = evaluate(
            a.pair, "study", rows / "main", reports, "metrics",
            [*sets, f"evaluate.methods=[{','.join(STEP_METHODS)}]"],
        )  # fmt: skip
        subset = [sets[0], *sample_sets("study", a.token_problems), *llama]
        subset += [
            f"evaluate.methods=[target,{','.join(token)}]"
        ]  # the target's rows resume: not decoded again
        metrics = with_token_run(
            metrics, evaluate(a.pair, "study", rows / "main", reports, "token", subset), token
        )
    else:
        methods = [*STEP_METHODS, *token]
        metrics = evaluate(
            a.pair,
            "study",
            rows / "main",
            reports,
            "metrics",
            [*sets, *llama, f"evaluate.methods=[{','.join(methods)}]"],
        )
    runs = {}
    for floor in a.floors:
        out = rows / f"floor-{floor:g}"
        share_baselines(rows / "main", out)  # the target's rows: decoded once
        runs[floor] = evaluate(
            a.pair, "study", out, reports, f"floor-{floor:g}",
            [*sets, "evaluate.methods=[target,semanticspec]", "evaluate.probe_variants=[all]",
             f"evaluate.decode.min_ratio={floor:g}"],
        )  # fmt: skip
    points = curve_points(runs)
    cpu = cpu_name()
    (reports / "study.md").write_text(report(metrics, points, budget, cpu) + "\n")
    (reports / "curve.json").write_text(json.dumps(points, indent=1))
    figure = reports / "figure.json"  # the study's methods and the curve's points, as one summary
    figure.write_text(json.dumps(with_curve(metrics, runs)))
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("figure.py")), "--metrics", str(figure),
         "--out", str(reports / "pareto.png"), "--cpu", cpu],
        check=True,
    )  # fmt: skip
    print((reports / "study.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
