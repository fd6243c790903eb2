"""Ship a pair's champion probes with semspec: ``probes/<pair>/``, what ``scripts/setup`` imports.

    python benchmarks/ship_probes.py [--pair qwen-coder] [--profile release] [--run DIR] [--out DIR]

Exports the registry's champions of every variant (``semspec probes export``), stores their weights as
float16 (``tasks/probe_checks.to_float16``), and recomputes the routing metrics of each variant on the
run's held-out test questions (``--run``, default ``data/<pair>-<profile>``: the samples, cross features
and joint labels the champions were trained on; validation and test questions split as the profile's
train stage split them) with the float32 and the float16 weights side by side: shipping refuses a
variant whose true- or false-accept rate or AUROC moved by more than 0.005. Then it writes the checks
CI replays (``write_checks``), prints each variant's AUROC minus Random's with a 95% interval over the
test questions (``gaps_to_random``) and the folder's size (at most 30 MB).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from semspec.models.project.probe_folder import SHIPPED_DIR, read_card
from semspec.models.spec.names import ROLES
from semspec.models.spec.probe import load_probe_folder
from semspec.tasks.config import load_params
from semspec.tasks.probe_checks import to_float16, write_checks
from semspec.tasks.probe_export import export_probes
from semspec.tasks.train.data import load_joint_probe_data, load_routing_data, split_by_question
from semspec.tasks.train.fit import predict
from semspec.tasks.train.metrics import auroc_gap, routing_table

MOVED = 0.005  # the most float16 may move a routing rate or AUROC
COMPARED = ("true_accept", "false_accept", "auroc")
LIMIT_MB = 30


def held_out(run: Path, params) -> tuple[set[str], set[str]]:
    """The (test, validation) questions held out from both roles' probes, split as train splits them."""
    cfg, tests, vals = params.train, [], []
    for role in ROLES:
        data = load_joint_probe_data(
            role, run / "samples", run / "cross", run / "labels" / "joint.parquet", ["last"]
        )
        masks = split_by_question(data.question_id, cfg.val_fraction, cfg.test_fraction, cfg.seed)
        tests.append(set(data.question_id[masks["test"]].tolist()))
        vals.append(set(data.question_id[masks["val"]].tolist()))
    return set.intersection(*tests), set.intersection(*vals)


def routing_of(folder: Path, data, test: set[str], val: set[str]) -> dict[str, dict[str, float]]:
    card = read_card(folder)
    probes = {
        v: {r: load_probe_folder(folder / card.probe(v, r).path, card.probe(v, r).sha256) for r in ROLES}
        for v in card.variants
    }
    return routing_table(data, probes, test, val)


def _probes(folder: Path, variants: list[str], role: str) -> dict:
    card = read_card(folder)
    return {
        v: load_probe_folder(folder / card.probe(v, role).path, card.probe(v, role).sha256) for v in variants
    }


def gaps_to_random(folder: Path, run: Path, routing, test: set[str]) -> dict[str, dict[str, dict]]:
    """Each variant's held-out AUROC minus Random's, with a 95% interval over test questions: per role
    for 'in the largest cluster' (the probe's own task), and for routing (p/q against 'the target shares
    the draft's step')."""
    variants = [v for v in read_card(folder).variants if "@" not in v]
    out: dict[str, dict[str, dict]] = {}
    for role in ROLES:
        data = load_joint_probe_data(
            role, run / "samples", run / "cross", run / "labels" / "joint.parquet", variants
        )
        te = np.isin(data.question_id, sorted(test))
        pred = {v: predict(pr, data.x[v][te]) for v, pr in _probes(folder, variants, role).items()}
        out[role] = {
            v: auroc_gap(data.in_largest[te], pred[v], pred["random"], data.question_id[te])
            for v in variants
            if v != "random"
        }
    te = np.isin(routing.question_id, sorted(test))
    target, draft = _probes(folder, variants, "target"), _probes(folder, variants, "draft")
    ratio = {
        v: predict(target[v], routing.p_x[v][te]) / np.maximum(predict(draft[v], routing.q_x[v][te]), 1e-9)
        for v in variants
    }
    shared = routing.share_target[te] > 0
    out["routing"] = {
        v: auroc_gap(shared, ratio[v], ratio["random"], routing.question_id[te])
        for v in variants
        if v != "random"
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="qwen-coder")
    ap.add_argument("--profile", default="release")
    ap.add_argument("--run", type=Path, help="the run's data folder (default data/<pair>-<profile>)")
    ap.add_argument("--out", type=Path, help=f"where to ship (default {SHIPPED_DIR}/<pair>)")
    a = ap.parse_args()
    params = load_params(profile=a.profile)
    run = a.run or Path("data") / f"{a.pair}-{a.profile}"
    out = a.out or Path(SHIPPED_DIR) / a.pair
    with tempfile.TemporaryDirectory() as tmp:
        full, half = Path(tmp) / "float32", Path(tmp) / "float16"
        export_probes(a.pair, full)
        shutil.copytree(full, half)
        to_float16(half)
        variants = [v for v in read_card(full).variants if "@" not in v]
        data = load_routing_data(run / "samples", run / "cross", run / "labels" / "joint.parquet", variants)
        test, val = held_out(run, params)
        before, after = routing_of(full, data, test, val), routing_of(half, data, test, val)
        print(f"{'variant':8s} " + " ".join(f"{k + ' fp32/fp16':>26s}" for k in COMPARED))
        moved = []
        for v in variants:
            pairs = [(before[v][k], after[v][k]) for k in COMPARED]
            print(f"{v:8s} " + " ".join(f"{x:12.4f} / {y:11.4f}" for x, y in pairs))
            moved += [f"{v} {k}" for k, (x, y) in zip(COMPARED, pairs, strict=True) if abs(x - y) > MOVED]
        if moved:
            sys.exit(f"float16 moved {', '.join(moved)} by more than {MOVED}: not shipped")
        checks = write_checks(half, data, test)
        print("AUROC minus Random's on the test questions (95% interval, resampling questions):")
        for what, rows in gaps_to_random(half, run, data, test).items():
            for v, g in rows.items():
                print(
                    f"  {what:8s} {v:6s} {g['gap']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}] ({g['groups']} questions)"
                )
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(half, out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    for v, steps in checks.items():
        print(
            f"check {v}: " + "; ".join(f"shared={s['shared']} p={s['p']:.3f} q={s['q']:.3f}" for s in steps)
        )
    print(f"shipped {', '.join(read_card(out).variants)} to {out}: {size:.1f} MB (limit {LIMIT_MB})")
    if size > LIMIT_MB:
        sys.exit(f"{out} is {size:.1f} MB, over {LIMIT_MB} MB")


if __name__ == "__main__":
    main()
