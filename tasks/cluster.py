"""Stage ``cluster``: group each prefix's samples by meaning -> semantic-probability labels.

A sample's label is ``|its cluster| / n_valid``. Empty samples, and steps longer than the judge's
window, are invalid: counted per prefix (``n_invalid``) and not labelled. ``n_truncated`` counts the
samples whose question/prefix context was cut (from its start) so that the judge saw the step whole. Samples cut by the step budget are labelled like any other
(``cluster.label_length_cut``, default on): the decoders cut steps at the same budget and the probes
score those steps too, so they must see such steps in training. The judge runs in Ray actors (GPU when
the spec says cuda).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from semspec.models.judges import Judge, load_judge, semantic_entropy
from semspec.models.pair import JudgeSpec, PairConfig
from semspec.tasks.config import ClusterConfig, Params
from semspec.tasks.io import read_shards, write_parquet_atomic
from semspec.tasks.ray_utils import init_ray

log = logging.getLogger(__name__)

LABEL_SCHEMA = pa.schema(
    [
        ("prefix_id", pa.string()),
        ("question_id", pa.string()),
        ("domain", pa.string()),
        ("role", pa.string()),
        ("sample_idx", pa.int32()),
        ("cluster_id", pa.int32()),
        ("cluster_size", pa.int32()),
        ("n_valid", pa.int32()),
        ("n_invalid", pa.int32()),
        ("n_truncated", pa.int32()),
        ("semantic_prob", pa.float32()),
        ("semantic_entropy", pa.float32()),
        ("in_largest", pa.bool_()),
    ]
)


def is_valid(text: str, finish_reason: str, label_length_cut: bool = True) -> bool:
    """A sample counts when it has content (and, unless ``label_length_cut``, was not cut by the budget)."""
    return bool(text.strip()) and (label_length_cut or finish_reason != "length")


def inject_noise(cluster_ids: list[int], fraction: float, rng: random.Random) -> list[int]:
    """Move ``fraction`` of the samples to a cluster other than their own (a new one when only one
    cluster exists) — the paper's robustness study."""
    ids = list(cluster_ids)
    k = round(fraction * len(ids))
    if k == 0:
        return ids
    clusters = sorted(set(ids))
    for i in rng.sample(range(len(ids)), k):
        others = [c for c in clusters if c != ids[i]]
        ids[i] = rng.choice(others) if others else max(clusters) + 1
    return ids


def label_prefix(
    judge: Judge, group: dict[str, Any], cfg: ClusterConfig, premise: str = ""
) -> list[dict[str, Any]]:
    """Labels for the samples of one prefix (``group``: lists of sample_idx, text, finish_reason)."""
    valid = [
        i
        for i, (t, f) in enumerate(zip(group["text"], group["finish_reason"], strict=True))
        if is_valid(t, f, cfg.label_length_cut)
    ]
    if not valid:
        return []
    found = judge.cluster([group["text"][i] for i in valid], premise if cfg.with_question else "")
    # a step longer than the judge's window is not judged: invalid, like an empty one
    fits = [(i, c) for i, c in zip(valid, found.ids, strict=True) if c is not None]
    valid, ids = [i for i, _ in fits], [c for _, c in fits]
    n_invalid = len(group["text"]) - len(valid)
    if not valid:
        return []
    if cfg.noise:
        ids = inject_noise(ids, cfg.noise, random.Random(f"{cfg.seed}:{group['prefix_id']}"))
    sizes = Counter(ids)
    largest = max(sizes.values())
    ent = semantic_entropy(ids)
    return [
        {
            "prefix_id": group["prefix_id"],
            "question_id": group["question_id"],
            "domain": group.get("domain", "unknown"),
            "role": group["role"],
            "sample_idx": group["sample_idx"][i],
            "cluster_id": c,
            "cluster_size": sizes[c],
            "n_valid": len(valid),
            "n_invalid": n_invalid,
            "n_truncated": found.truncated,
            "semantic_prob": sizes[c] / len(valid),
            "semantic_entropy": ent,
            "in_largest": sizes[c] == largest,
        }
        for i, c in zip(valid, ids, strict=True)
    ]


class JudgeActor:
    """Holds one judge (a Ray actor, or in-process for the local executor)."""

    def __init__(self, spec: JudgeSpec | None = None, judge: Judge | None = None) -> None:
        if judge is None and spec is None:
            raise ValueError("JudgeActor needs a spec or a judge")
        self.judge = judge or load_judge(spec)

    def label(self, groups: list[dict[str, Any]], cfg: ClusterConfig) -> list[dict[str, Any]]:
        """Labels for a batch of prefixes."""
        return [r for g in groups for r in label_prefix(self.judge, g, cfg, g.get("premise", ""))]


def group_samples(samples: pa.Table, prefixes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per prefix with its samples' fields, in sample order, and its question's domain."""
    cols = samples.select(
        ["prefix_id", "question_id", "role", "sample_idx", "text", "finish_reason"]
    ).to_pylist()
    groups: dict[str, dict[str, Any]] = {}
    for r in sorted(cols, key=lambda r: (r["prefix_id"], r["sample_idx"])):
        g = groups.setdefault(
            r["prefix_id"],
            {
                "prefix_id": r["prefix_id"],
                "question_id": r["question_id"],
                "role": r["role"],
                "sample_idx": [],
                "text": [],
                "finish_reason": [],
            },
        )
        for k in ("sample_idx", "text", "finish_reason"):
            g[k].append(r[k])
        p = prefixes.get(r["prefix_id"])
        if p is not None:
            g["premise"] = f"{p['question']}\n{p['context']}"
            g["domain"] = p["domain"]  # for per-domain probes (train.domains)
    return list(groups.values())


def run_cluster(
    cfg: ClusterConfig,
    pair: PairConfig,
    samples_dir: Path,
    out_dir: Path,
    prefixes_path: Path | None = None,
    judge: Judge | None = None,
) -> dict[str, Path]:
    """Write ``out_dir/<role>.parquet`` for every role sampled in ``samples_dir``."""
    prefixes = {}
    if prefixes_path is not None:
        prefixes = {r["prefix_id"]: r for r in pq.read_table(prefixes_path).to_pylist()}
    roles = sorted(p.name for p in samples_dir.iterdir() if p.is_dir()) if samples_dir.is_dir() else []
    if not roles:
        raise ValueError(f"no sample folders in {samples_dir}: run the sample stage first")
    work = {role: group_samples(read_shards(samples_dir / role), prefixes) for role in roles}
    total = sum(len(g) for g in work.values())
    label_fn = _labels_local if cfg.executor == "local" or judge is not None else _labels_ray
    labels = label_fn(cfg, pair.judge, work, total, judge)
    out = {}
    for role in roles:
        rows = sorted(labels[role], key=lambda r: (r["prefix_id"], r["sample_idx"]))
        n_inv = sum(len(g["text"]) for g in work[role]) - len(rows)
        log.info(
            "cluster[%s]: %d labelled samples over %d prefixes, %d invalid",
            role,
            len(rows),
            len({r["prefix_id"] for r in rows}),
            n_inv,
        )
        out[role] = write_parquet_atomic(
            pa.Table.from_pylist(rows, schema=LABEL_SCHEMA), out_dir / f"{role}.parquet"
        )
    return out


def _labels_local(cfg, spec, work, total, judge) -> dict[str, list[dict[str, Any]]]:
    actor = JudgeActor(spec, judge)
    out = {}
    with tqdm(total=total, desc="cluster", unit="prefix") as bar:
        for role, groups in work.items():
            out[role] = []
            for i in range(0, len(groups), cfg.batch_prefixes):
                batch = groups[i : i + cfg.batch_prefixes]
                out[role].extend(actor.label(batch, cfg))
                bar.update(len(batch))
    return out


def _labels_ray(cfg, spec, work, total, judge) -> dict[str, list[dict[str, Any]]]:
    import ray  # only the ray executor needs it (a slow import); ray_utils imports it lazily too

    init_ray()
    actor = (
        ray.remote(JudgeActor)
        .options(num_cpus=1, num_gpus=1 if spec.device.startswith("cuda") else 0)
        .remote(spec)
    )
    futures = {}
    for role, groups in work.items():
        for i in range(0, len(groups), cfg.batch_prefixes):
            batch = groups[i : i + cfg.batch_prefixes]
            futures[actor.label.remote(batch, cfg)] = (role, len(batch))
    out: dict[str, list[dict[str, Any]]] = {role: [] for role in work}
    try:
        with tqdm(total=total, desc="cluster", unit="prefix") as bar:
            pending = list(futures)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                role, n = futures[ready[0]]
                out[role].extend(ray.get(ready[0]))
                bar.update(n)
    finally:
        ray.kill(actor)
    return out


def stage(*, params: Params, pair: PairConfig, samples: Path, prefixes: Path, out: Path) -> str:
    """Stage cluster (the CLI's and dvc.yaml's entry): samples -> ``out/<role>.parquet`` labels."""
    paths = run_cluster(params.cluster, pair, samples, out, prefixes)
    return "wrote " + ", ".join(str(f) for f in paths.values())
