"""Pooling study: ``predict`` vs ``tokens`` hidden-state pooling, trained on the same samples and labels.

The pair's ``pooling`` setting chooses the positions a step's hidden states are averaged over
(``models/lm/``): ``predict`` (the last context position and every step token but the last, the
default) or ``tokens`` (the step's own tokens, the paper's wording). This study takes a finished
pipeline's samples and labels (``data/<pair>``), prefills every labelled step after its prefix once per
role, pools the same forward both ways, and trains the same probe on each feature set over several
train/val/test splits by question (seeds 0..S-1). Only the features differ, so the paired per-split
difference of the test metrics says which pooling the probes learn better from.

It also checks that the re-pooled ``predict`` features match the ones sampling stored (cosine), i.e.
that prefill and generation pool alike on this pair.

Usage (after ``scripts/demo`` or ``dvc repro``, from the project's venv):
    python benchmarks/pooling.py [--pair qwen-coder] [--data data/qwen-coder] [--splits 8]
        [--variants all last] [--roles draft target]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from scipy.stats import ttest_rel
from tqdm.auto import tqdm

from semspec.models.lm import LM, Pooled, load_lm
from semspec.models.project.pairs import load_pair
from semspec.tasks.config import load_params
from semspec.tasks.io import column_matrix, read_shards
from semspec.tasks.train.data import ProbeData, split_by_question
from semspec.tasks.train.fit import fit_probe, predict
from semspec.tasks.train.metrics import probe_metrics

POOLINGS = ("predict", "tokens")
METRICS = ("mse", "auroc", "spearman")


def repool(lm: LM, prefixes: dict[str, dict], steps: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    """Prefill each ``(prefix_id, step text)`` after its prefix (one padded forward per prefix) and pool
    it both ways -> ``{pooling: (N, L+1, D) float32}``, rows in the order of ``steps``."""
    out: dict[str, list[np.ndarray]] = {p: [None] * len(steps) for p in POOLINGS}
    by_prefix: dict[str, list[int]] = {}
    for i, (pid, _) in enumerate(steps):
        by_prefix.setdefault(pid, []).append(i)
    for pid, rows in tqdm(by_prefix.items(), desc=f"prefill {lm.model_id}", unit="prefix"):
        row = prefixes[pid]
        base = lm.prefill(lm.format_prompt(row["question"]) + row["context"])
        scores = lm.score_steps([base.clone() for _ in rows], [steps[i][1] for i in rows])
        for i, sc in zip(rows, scores, strict=True):
            # (k, L+1, D): outputs at the last context position and every step token but the last
            at_predict = sc.pred_hidden
            # (k, L+1, D): outputs at the step's own tokens (the last one is the new state's)
            at_tokens = torch.cat([sc.pred_hidden[1:], sc.state.hidden[None]])
            out["predict"][i] = at_predict.float().mean(0).numpy()
            out["tokens"][i] = at_tokens.float().mean(0).numpy()
    return {p: np.stack(v) for p, v in out.items()}


def feature(layers: np.ndarray, variant: str) -> np.ndarray:
    """(N, L+1, D) pooled layers -> the probe variant's input (N, D), as ``Pooled`` makes it for sampling."""
    return np.stack([Pooled(torch.from_numpy(m)).feature(variant).numpy() for m in layers])


def role_data(lm: LM, data_dir: Path, role: str, variants: list[str]) -> tuple[dict[str, ProbeData], float]:
    """Per pooling, the role's labelled rows with re-pooled features; and the median cosine between the
    re-pooled ``predict`` h_mean and the one sampling stored (the median: a sampled step whose text
    tokenizes otherwise when read back, e.g. ``\n`` ``\n`` sampled where the tokenizer has ``\n\n``,
    pools other positions)."""
    prefixes = {r["prefix_id"]: r for r in pq.read_table(data_dir / "prefixes.parquet").to_pylist()}
    samples = read_shards(data_dir / "samples" / role)
    labels = pq.read_table(data_dir / "labels" / f"{role}.parquet").to_pylist()
    if not labels:
        raise ValueError(f"{data_dir}/labels/{role}.parquet has no labelled samples")
    keys = list(
        zip(samples.column("prefix_id").to_pylist(), samples.column("sample_idx").to_pylist(), strict=True)
    )
    index = {k: i for i, k in enumerate(keys)}
    rows = np.array([index[(r["prefix_id"], r["sample_idx"])] for r in labels])
    texts = samples.column("text").to_pylist()
    steps = [(keys[i][0], texts[i]) for i in rows]
    pooled = repool(lm, prefixes, steps)
    stored = column_matrix(samples, "h_mean")[rows]  # (N, D) as sampling pooled it
    mine = feature(pooled["predict"], "all")
    cos = float(
        np.median(
            (stored * mine).sum(1) / (np.linalg.norm(stored, axis=1) * np.linalg.norm(mine, axis=1) + 1e-12)
        )
    )
    qids = np.array(samples.column("question_id").to_pylist())[rows]
    common = {
        "y": np.array([r["semantic_prob"] for r in labels], dtype=np.float32),
        "in_largest": np.array([r["in_largest"] for r in labels], dtype=bool),
        "question_id": qids,
        "domain": np.array([r.get("domain") or "unknown" for r in labels]),
        "model_id": lm.model_id,
        "hidden_size": lm.hidden_size,
        "num_layers": 0,
    }
    data = {p: ProbeData(x={v: feature(pooled[p], v) for v in variants}, **common) for p in POOLINGS}
    return data, cos


def study(data: dict[str, ProbeData], role: str, variants: list[str], cfg, splits: int) -> dict:
    """Test metrics ``{variant: {pooling: {metric: [per split]}}}`` over ``splits`` splits by question."""
    res = {v: {p: {m: [] for m in METRICS} for p in POOLINGS} for v in variants}
    any_data = data["predict"]
    for s in tqdm(range(splits), desc=f"train {role}", unit="split"):
        masks = split_by_question(any_data.question_id, cfg.val_fraction, cfg.test_fraction, seed=s)
        te = masks["test"]
        for v in variants:
            for p in POOLINGS:
                probe = fit_probe(data[p], v, role, masks, replace(cfg, seed=s))
                m = probe_metrics(predict(probe, data[p].x[v][te]), data[p].y[te], data[p].in_largest[te])
                for k in METRICS:
                    res[v][p][k].append(m[k])
    return res


def report(role: str, lm: LM, cos: float, n: int, res: dict) -> None:
    """One line per (variant, metric): mean ± sd per pooling, the paired difference and its t-test p."""
    print(
        f"\n{role} {lm.model_id} ({lm.dtype_name}): {n} labelled steps; re-pooled vs stored h_mean cos (median) {cos:.4f}"
    )
    print(f"  {'variant':8} {'metric':9} {'predict':>16} {'tokens':>16} {'tokens - predict':>18} {'p':>6}")
    for v, by_pool in res.items():
        for k in METRICS:
            a, b = np.array(by_pool["predict"][k]), np.array(by_pool["tokens"][k])
            ok = ~(np.isnan(a) | np.isnan(b))
            d = b[ok] - a[ok]
            p = ttest_rel(b[ok], a[ok]).pvalue if ok.sum() > 1 and d.std() > 0 else float("nan")
            print(
                f"  {v:8} {k:9} {np.nanmean(a):8.4f} ± {np.nanstd(a):.4f} {np.nanmean(b):8.4f} ± "
                f"{np.nanstd(b):.4f} {d.mean():+9.4f} ± {d.std():.4f} {p:6.3f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None, help="default: params.yaml's pair")
    ap.add_argument("--data", type=Path, default=None, help="default: data/<pair>")
    ap.add_argument("--splits", type=int, default=8)
    # mix reads every layer and needs the layer count: not in this study
    ap.add_argument("--variants", nargs="+", default=["all", "last"], choices=["all", "last"])
    ap.add_argument("--roles", nargs="+", default=["draft", "target"], choices=["draft", "target"])
    a = ap.parse_args()
    if a.splits < 2:
        raise SystemExit("--splits must be at least 2 (a paired difference needs two)")
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("lightning.pytorch", "lightning.fabric"):  # "GPU available" and tips, per fit
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning's own deprecation, per fit
    params = load_params()
    pair = load_pair(a.pair or params.pair, split_strategy=params.split_strategy)
    data_dir = a.data or Path("data") / pair.name
    if not (data_dir / "labels").is_dir():
        raise SystemExit(f"{data_dir}/labels not found: run the pipeline first (scripts/demo or dvc repro)")
    variants = a.variants
    t0 = time.perf_counter()
    print(
        f"pooling study on pair {pair.name} ({data_dir}), {a.splits} splits by question, train params of "
        f"profile {params.profile}"
    )
    for role in a.roles:
        lm = load_lm(pair.role(role))
        data, cos = role_data(lm, data_dir, role, variants)
        res = study(data, role, variants, params.train, a.splits)
        report(role, lm, cos, len(data["predict"].y), res)
        del lm
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
