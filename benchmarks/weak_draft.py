"""The weak-draft evidence: can probes trained on both models' steps make SemanticSpec correct a weak draft?

    python benchmarks/weak_draft.py [--pair smollm-qwen] [--profile weakdraft] [--skip-eval]

Runs the probe pipeline on ``--pair`` with ``--profile`` into ``data/<pair>-<profile>/`` (ingest, sample,
cross, cluster: each resumes after a crash), trains the probes with ``train.examples`` own and both on
25%, 50% and 100% of the training questions (the learning curve of the routing metrics; only the 100% runs
register), then evaluates each probe set (``semspec evaluate``, resumable per problem) into
``eval/<pair>-<profile>/<examples>/``. A step already done is skipped when run again. Prints the learning
curve and both evaluations' tables. Each model's format is in the tables' notes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

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
    a = ap.parse_args()
    common = ["--pair", a.pair, "--profile", a.profile]
    data, reports = Path("data") / f"{a.pair}-{a.profile}", Path("reports") / f"{a.pair}-{a.profile}"
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
    for examples in EXAMPLES:
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
    if a.skip_eval:
        return
    for examples in EXAMPLES:
        out = Path("eval") / f"{a.pair}-{a.profile}" / examples
        semspec(
            "evaluate", *common,
            "--probes", str(data / f"probes-{examples}-1"),
            "--out", str(out), "--plots", str(reports / f"eval-{examples}"),
            "--metrics", str(reports / f"eval-{examples}.json"),
        )  # fmt: skip


def print_curve(curve: dict) -> None:
    """Routing metrics on the test questions' draft steps, per examples setting, share of the training
    questions and variant."""
    print(
        f"{'examples':8s} {'train':>6s} {'variant':8s} {'true acc':>9s} {'false acc':>10s} {'AUROC':>7s} {'n':>5s}"
    )
    for (examples, frac), routing in curve.items():
        for variant, m in routing.items():
            print(
                f"{examples:8s} {frac:6.0%} {variant:8s} {m['true_accept']:9.3f} {m['false_accept']:10.3f} "
                f"{m['auroc']:7.3f} {m['n_shared'] + m['n_not_shared']:5d}"
            )


if __name__ == "__main__":
    main()
