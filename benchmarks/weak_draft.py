"""The weak-draft evidence: can probes trained on both models' steps make SemanticSpec correct a weak draft?

    python benchmarks/weak_draft.py [--pair smollm-qwen] [--profile weakdraft] [--skip-eval | --eval-only]
                                    [--set section.key=value ... --name NAME] [--examples own both]
                                    [--floor] [--min-p] [--handover N] [--token-p P]

Runs the probe pipeline on ``--pair`` with ``--profile`` into ``data/<pair>-<profile>/`` (ingest, sample,
cross, cluster: each resumes after a crash), trains the probes with ``train.examples`` own and both on
25%, 50% and 100% of the training questions (the learning curve of the routing metrics; only the 100% runs
register), then evaluates each probe set (``semspec evaluate``, resumable per problem) into
``eval/<pair>-<profile>/<examples>/`` (``target`` and ``draft`` read no probe: their rows are decoded once
and shared); ``--floor`` also evaluates the last set's ``all`` variant with ``evaluate.decode.min_ratio=auto``
(the floor on p/q its train run chose on validation) into ``<examples>+floor/``, and ``--min-p`` with
``evaluate.decode.min_p=auto`` (the target's rule, accept iff p >= the floor on p chosen likewise) into
``<examples>+p/``; ``--handover N`` evaluates its ``all`` and ``random`` variants with
``evaluate.decode.max_rejections=N`` (after N rejected steps in an answer the target writes the rest) into
``<examples>+hN/``; ``--token-p P`` evaluates them with ``evaluate.decode.min_token_p=P`` (the target's token
check: a step the probes accept is rejected when the target gives one of its tokens a probability below
P) into ``<examples>+tP/``, and with ``--handover N`` under both into ``<examples>+tP+hN/``. A step already done
is skipped when run again; ``--eval-only`` goes straight to the evaluations (they need the registered
probes, not the samples). Prints the learning curve, the evaluations' table and, per step position in
the answers, SemanticSpec's acceptance, p and q (``by_depth``). Each model's format is
in the tables' notes. ``--set`` overrides params for every command (a smaller run: ``--set ingest.max_questions=24 --name q24``); ``--name`` then
keeps its outputs apart, in ``<pair>-<profile>-<name>`` folders.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from math import nan
from pathlib import Path
from typing import Any

FRACTIONS = (0.25, 0.5, 1.0)
EXAMPLES = ("own", "both")


def semspec(*args: str) -> None:
    """Run one ``semspec`` command (the stage CLI), failing loudly."""
    cmd = [str(Path(sys.executable).with_name("semspec")), *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm-qwen")
    ap.add_argument("--profile", default="weakdraft")
    ap.add_argument("--skip-eval", action="store_true", help="stop after the learning curve")
    ap.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate the probe sets this run trained and registered (their samples are not needed)",
    )
    ap.add_argument(
        "--set", action="append", default=[], dest="sets", help="a param override, section.key=value"
    )
    ap.add_argument("--name", default="", help="suffix of the output folders (required with --set)")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also evaluate the last probe set's all variant with evaluate.decode.min_ratio=auto (the floor on "
        "p/q its train run chose on validation), as the probe set '<examples>+floor'",
    )
    ap.add_argument(
        "--min-p",
        action="store_true",
        help="also evaluate the last probe set's all variant with evaluate.decode.min_p=auto (the target's rule: "
        "accept iff p >= the floor its train run chose on validation), as the probe set '<examples>+p'",
    )
    ap.add_argument(
        "--handover",
        type=int,
        metavar="N",
        help="also evaluate the last probe set's all and random variants with evaluate.decode.max_rejections=N "
        "(after N rejected steps in an answer the target writes the rest), as the probe set '<examples>+hN'",
    )
    ap.add_argument(
        "--examples",
        nargs="+",
        choices=EXAMPLES,
        default=list(EXAMPLES),
        help="the train.examples settings to train and evaluate (default: own and both, to compare them)",
    )
    ap.add_argument(
        "--token-p",
        type=float,
        metavar="P",
        help="also evaluate the last probe set's all and random variants with evaluate.decode.min_token_p=P (the "
        "target's token check), as '<examples>+tP', and with --handover also under both, as '+tP+hN'",
    )
    a = ap.parse_args()
    if a.token_p is not None and not 0 < a.token_p < 1:
        ap.error("--token-p takes a probability in (0, 1)")
    if a.handover is not None and a.handover < 0:
        ap.error("--handover takes a count of rejected steps >= 0")
    if a.sets and not a.name:
        ap.error("--set changes what is computed: name the run with --name so its outputs stay apart")
    common = ["--pair", a.pair, "--profile", a.profile, *(x for o in a.sets for x in ("--set", o))]
    run = "-".join(filter(None, (a.pair, a.profile, a.name)))
    data, reports = Path("data") / run, Path("reports") / run
    if not a.eval_only:
        probe_pipeline(common, data, reports, a.examples)
    if not a.skip_eval:
        rules = [rule for rule, on in ((FLOOR, a.floor), (MIN_P, a.min_p)) if on]
        rules += [] if a.handover is None else [f"{HANDOVER}{a.handover}"]
        if a.token_p is not None:  # the token check alone, and with the rejection budget
            rules += [
                f"{TOKENS}{a.token_p:g}",
                *(f"{TOKENS}{a.token_p:g}{r}" for r in rules if HANDOVER in r),
            ]
        evaluate(common, data, reports, Path("eval") / run, a.examples, rules)


def probe_pipeline(common: list[str], data: Path, reports: Path, settings: list[str]) -> None:
    """ingest, sample, cross and cluster (each resumes), then the probes of both ``train.examples``
    settings (``settings``: own, both or the two) on each share of the training questions; prints the
    learning curve of the routing metrics."""
    prefixes, samples, cross, labels = (
        data / "prefixes.parquet",
        data / "samples",
        data / "cross",
        data / "labels",
    )
    if not prefixes.is_file():
        semspec("ingest", *common, "--out", str(prefixes))
    semspec("sample", *common, "--prefixes", str(prefixes), "--out", str(samples))
    semspec("cross", *common, "--prefixes", str(prefixes), "--samples", str(samples), "--out", str(cross))
    semspec("cluster", *common, "--samples", str(samples), "--prefixes", str(prefixes), "--out", str(labels))
    curve = {}
    for examples in settings:
        for frac in FRACTIONS:
            name = f"{examples}-{frac:g}"
            metrics = reports / f"train-{name}.json"
            if not metrics.is_file():
                semspec(
                    "train", *common,
                    "--set", f"train.examples={examples}",
                    "--set", f"train.train_fraction={frac}",
                    "--set", f"train.register={'true' if frac == 1.0 else 'false'}",
                    "--samples", str(samples), "--cross", str(cross), "--labels", str(labels),
                    "--out", str(data / f"probes-{name}"), "--metrics", str(metrics),
                    "--plots", str(reports / f"calibration-{name}"),
                )  # fmt: skip
            curve[examples, frac] = json.loads(metrics.read_text()).get("_routing", {})
    print_curve(curve)


FLOOR, MIN_P = "+floor", "+p"  # suffixes of a probe set evaluated under a floor chosen on validation
# suffix -> its setting
RULES = {FLOOR: "evaluate.decode.min_ratio=auto", MIN_P: "evaluate.decode.min_p=auto"}
# +hN: under evaluate.decode.max_rejections=N, with Random beside all (does the probe matter?)
HANDOVER = "+h"
TOKENS = "+t"  # +tP: under evaluate.decode.min_token_p=P (the target's token check), with Random beside all


def rule_settings(rule: str) -> list[str]:
    """The ``--set`` options of a probe set's rule suffix: ``+floor``, ``+p``, ``+hN``, ``+tP`` or several
    of them (``+t0.01+h1``). ``all`` alone is evaluated under a floor, ``all`` and Random under the others."""
    sets, variants = [], FLOOR_VARIANTS
    for part in (f"+{x}" for x in rule.split("+")[1:]):
        value = part[len(HANDOVER) :]
        if part.startswith(HANDOVER) and value.isdigit():
            sets.append(f"evaluate.decode.max_rejections={value}")
        elif part.startswith(TOKENS) and _is_probability(value):
            sets.append(f"evaluate.decode.min_token_p={value}")
        else:
            sets.append(RULES[part])
            continue
        variants = "[all,random]"
    return [x for setting in (*sets, f"evaluate.probe_variants={variants}") for x in ("--set", setting)]


def _is_probability(text: str) -> bool:
    try:
        return 0 < float(text) < 1
    except ValueError:
        return False


def evaluate(
    common: list[str], data: Path, reports: Path, evals: Path, settings: list[str], rules: Sequence[str] = ()
) -> None:
    """Each probe set (the 100% runs of ``settings``; for each of ``rules`` (``FLOOR``, ``MIN_P``) also the
    last one's ``all`` variant under that floor chosen on validation) evaluated with the profile's
    settings (resumes per problem); prints the evidence table and plots pass@1 against machine time."""
    sets = [*settings, *(settings[-1] + rule for rule in rules)]
    for n, name in enumerate(sets):
        if n:
            share_baselines(evals / sets[0], evals / name)
        examples, _, rule = name.partition("+")
        extra = rule_settings(f"+{rule}") if rule else []
        semspec(
            "evaluate", *common, *extra,
            "--probes", str(data / f"probes-{examples}-1"),
            "--out", str(evals / name), "--plots", str(reports / f"eval-{name}"),
            "--metrics", str(reports / f"eval-{name}.json"),
        )  # fmt: skip
    table = {name: evidence(evals / name) for name in sets}
    print_evidence(table, json.loads((evals / sets[0] / "metrics.json").read_text())["_models"])
    print_depths({name: by_depth(evals / name) for name in sets})
    print_kept({name: by_kept(evals / name) for name in sets})
    plot_evidence(table, reports / "pass_vs_latency.png")


FLOOR_VARIANTS = "[all]"  # evaluated under the floor: the headline variant (Random keeps the paper's rule)


BASELINES = ("target", "draft")  # methods that read no probe: the same rows whichever probe set is evaluated


def share_baselines(done: Path, todo: Path) -> None:
    """Append the probe-free methods' rows of one evaluation that the next lacks (by problem, seed and run
    key) to the next's files, so they are decoded once: the evaluation resumes rows with its own run key and
    decodes again any other."""
    for path in done.glob("*/*.jsonl"):
        if path.stem not in BASELINES:
            continue
        dest = todo / path.parent.name / path.name
        have = (
            {_row_id(line) for line in dest.read_text(encoding="utf-8").splitlines()}
            if dest.exists()
            else set()
        )
        new = [line for line in path.read_text(encoding="utf-8").splitlines() if _row_id(line) not in have]
        if new:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in new))


def _row_id(line: str) -> tuple[Any, ...]:
    """(problem, seed, run key) of a row of an evaluation's jsonl file."""
    r = json.loads(line)
    return r.get("question_id"), r.get("seed"), r.get("run_key")


def print_curve(curve: dict) -> None:
    """Routing metrics on the test questions' draft steps, per examples setting, share of the training
    questions and variant."""
    print(
        f"{'examples':8s} {'train':>6s} {'variant':8s} {'true acc':>9s} {'false acc':>10s} {'AUROC':>7s} {'n':>5s}"
        f" {'AUROC p':>8s} {'min ratio':>9s} {'true acc':>9s} {'false acc':>10s}"
        f" {'min p':>6s} {'true acc':>9s} {'false acc':>10s}  (at min ratio; at min p, the target's rule)"
    )
    oracle = None  # true shares in place of the probes: the same for every run, printed once
    for (examples, frac), routing in curve.items():
        for variant, m in routing.items():
            if variant == "oracle":
                oracle = m
            else:
                _curve_line(examples, f"{frac:6.0%}", variant, m)
    if oracle:
        _curve_line("(every", "run)", "oracle", oracle)


def _curve_line(examples: str, train: str, variant: str, m: dict) -> None:
    print(
        f"{examples:8s} {train:>6s} {variant:8s} {m['true_accept']:9.3f} {m['false_accept']:10.3f} "
        f"{m['auroc']:7.3f} {m['n_shared'] + m['n_not_shared']:5d} {m.get('auroc_p', nan):8.3f}"
        f" {m.get('min_ratio', nan):9.3f} {m.get('true_accept_at_min_ratio', nan):9.3f}"
        f" {m.get('false_accept_at_min_ratio', nan):10.3f} {m.get('min_p', nan):6.3f}"
        f" {m.get('true_accept_at_min_p', nan):9.3f} {m.get('false_accept_at_min_p', nan):10.3f}"
    )


def evidence(folder: Path) -> dict[str, dict[str, Any]]:
    """Per method label of one evaluation (every benchmark pooled, each problem once): pass@1 and its 95%
    interval, the paired differences to ``target`` and to ``draft`` with theirs, the speed-up by latency
    against the target of the same run, the target's share of tokens and the step acceptance."""
    from semspec.tasks.evaluate.stats import summarize_rows

    rows: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*/*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            rows.setdefault(path.stem, []).append(
                {**r, "question_id": f"{path.parent.name}/{r['question_id']}"}
            )
    return {
        label: summarize_rows(mine, rows.get("target"), rows.get("draft")) for label, mine in rows.items()
    }


def _ci(v: list[float] | None, sign: str = "+") -> str:
    return "" if not v else f"[{v[0]:{sign}.2f}, {v[1]:{sign}.2f}]"


def print_evidence(table: dict[str, dict[str, dict[str, Any]]], models: Any) -> None:
    """One line per probe set and method."""
    print(f"models: {json.dumps(models)}")
    head = f"{'probes':11s} {'method':22s} {'n':>3s} {'pass@1':>6s} {'95% CI':>14s} {'vs target':>9s} {'95% CI':>16s}"
    print(head + f" {'vs draft':>8s} {'95% CI':>16s} {'speed-up':>8s} {'target share':>12s} {'accept':>6s}")
    for examples, methods in table.items():
        for label, m in sorted(methods.items()):
            ci = m.get("pass@1_ci95")
            acc = m.get("step_acceptance")
            print(
                f"{examples:11s} {label:22s} {m['n']:3d} {m['pass@1']:6.3f} {_ci(ci, ''):>14s} "
                f"{m.get('delta_vs_target') or 0:+9.3f} {_ci(m.get('delta_vs_target_ci95')):>16s} "
                f"{m.get('delta_vs_draft') or 0:+8.3f} {_ci(m.get('delta_vs_draft_ci95')):>16s} "
                f"{m.get('speedup_latency') or 0:7.2f}x {m['target_share']:12.2f} "
                f"{'' if acc is None else f'{acc:.2f}':>6s}"
            )


DEPTHS = ((0, 0), (1, 1), (2, 2), (3, 5), (6, 9), (10, None))  # step positions in an answer, bins


def by_depth(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Per SemanticSpec label of one evaluation, per bin of step positions (``DEPTHS``; 0: an answer's
    first step): the draft steps judged, the share accepted, the medians of p and q and the share with
    p/q >= 1 (which the rule a = min(1, p/q) always accepts). Where the routing metrics (steps sampled
    after the training contexts) and a decode part, this shows at which depth."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*/semanticspec-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            steps = [s for s in json.loads(line).get("steps", []) if s.get("p") is not None]
            for pos, step in enumerate(steps):
                out.setdefault(path.stem, []).append({**step, "pos": pos})
    table = {}
    for label, steps in out.items():
        table[label] = []
        for lo, hi in DEPTHS:
            got = [s for s in steps if s["pos"] >= lo and (hi is None or s["pos"] <= hi)]
            if got:
                table[label].append(
                    {
                        "depth": f"{lo}" if lo == hi else f"{lo}-{'' if hi is None else hi}",
                        "n": len(got),
                        "accepted": statistics.mean(s["author"] == "draft" for s in got),
                        "p": statistics.median(s["p"] for s in got),
                        "q": statistics.median(s["q"] for s in got),
                        "ratio_ge_1": statistics.mean(s["p"] >= s["q"] for s in got),
                    }
                )
    return table


def print_depths(tables: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """``by_depth`` of each probe set: one line per method and bin of step positions."""
    print(
        f"{'probes':11s} {'method':22s} {'step':>5s} {'n':>5s} {'accepted':>8s} {'median p':>8s} {'median q':>8s} {'p >= q':>6s}"
    )
    for examples, table in tables.items():
        for label, bins in sorted(table.items()):
            for b in bins:
                print(
                    f"{examples:11s} {label:22s} {b['depth']:>5s} {b['n']:5d} {b['accepted']:8.2f} "
                    f"{b['p']:8.3f} {b['q']:8.3f} {b['ratio_ge_1']:6.2f}"
                )


KEPT = ("no step", "one step or more", "every step")  # what the draft kept of an answer


def by_kept(folder: Path) -> dict[str, dict[str, dict[str, int]]]:
    """Per SemanticSpec label of one evaluation, its answers grouped by what the draft kept of them (no
    step: the target wrote it from the first judged step; one step or more, with a rejection; every
    step, no rejection): answers, correct, and the target's correct answers to the same problems (its
    rows in the same folder). Shows whether accepted draft steps cost the answers."""
    target = {}
    for path in folder.glob("*/target.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            target[path.parent.name, r["question_id"], r.get("seed")] = bool(r.get("correct"))
    table: dict[str, dict[str, dict[str, int]]] = {}
    for path in sorted(folder.glob("*/semanticspec-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            judged = [s["author"] for s in r.get("steps", []) if s.get("p") is not None]
            kept, rejected = judged.count("draft"), judged.count("target")
            group = KEPT[2] if not rejected else KEPT[0] if not kept else KEPT[1]
            cell = table.setdefault(path.stem, {}).setdefault(group, {"n": 0, "correct": 0, "target": 0})
            cell["n"] += 1
            cell["correct"] += bool(r.get("correct"))
            cell["target"] += target.get((path.parent.name, r["question_id"], r.get("seed")), False)
    return table


def print_kept(tables: dict[str, dict[str, dict[str, dict[str, int]]]]) -> None:
    """``by_kept`` of each probe set: one line per method and what the draft kept."""
    print(
        f"{'probes':11s} {'method':22s} {'the draft kept':18s} {'answers':>7s} {'correct':>7s} {'target correct':>14s}"
    )
    for examples, table in tables.items():
        for label, groups in sorted(table.items()):
            for group in KEPT:
                if group in groups:
                    g = groups[group]
                    print(
                        f"{examples:11s} {label:22s} {group:18s} {g['n']:7d} {g['correct']:7d} {g['target']:14d}"
                    )


def plot_evidence(table: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """pass@1 against mean latency per problem: one point per method and probe set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for examples, marker in zip(table, "os^D", strict=False):  # a marker per probe set
        for label, m in sorted(table[examples].items()):
            ax.scatter(m["cost_s"], m["pass@1"], marker=marker, s=50, label=f"{label} ({examples} probes)")
    ax.set(xlabel="machine time per problem (s)", ylabel="pass@1", title="weak draft: pass@1 vs latency")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
