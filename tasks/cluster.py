"""Stage ``cluster``: group each prefix's samples by meaning -> semantic-probability labels.

A sample's label is ``|its cluster| / n_valid``. Empty samples, and steps longer than the judge's
window, are invalid: counted per prefix (``n_invalid``) and not labelled. ``n_truncated`` counts the
samples whose question/prefix context was cut (from its start) so that the judge saw the step whole. Samples cut by the step budget are labelled like any other
(``cluster.label_length_cut``, default on): the decoders cut steps at the same budget and the probes
score those steps too, so they must see such steps in training. The judge runs in Ray actors (GPU when
the spec says cuda).
"""

from __future__ import annotations

import functools
import json
import logging
import random
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from semspec.models.lm.pair import JudgeSpec, PairConfig
from semspec.models.spec.judges import Judge, load_judge, semantic_entropy
from semspec.models.spec.names import ROLES
from semspec.tasks.config import ClusterConfig, Params
from semspec.tasks.io import (
    content_md5,
    ensure_manifest,
    file_md5,
    read_shards,
    shard_name,
    shard_paths,
    write_parquet_atomic,
)
from semspec.tasks.ray_utils import get_result, init_ray, restartable

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


JOINT = "joint"  # labels/joint.parquet: both models' samples of a prefix clustered together
JOINT_SCHEMA = pa.schema(
    [
        ("prefix_id", pa.string()),
        ("question_id", pa.string()),
        ("domain", pa.string()),
        ("author", pa.string()),  # which model wrote the text
        ("sample_idx", pa.int32()),
        ("cluster_id", pa.int32()),
        ("n_valid_draft", pa.int32()),
        ("n_valid_target", pa.int32()),
        # the share of each model's valid samples in this text's cluster: p(Sem(s) | C, M), for every text
        # whoever wrote it; null when that model has no valid sample at this prefix
        ("share_draft", pa.float32()),
        ("share_target", pa.float32()),
        ("largest_draft", pa.bool_()),  # the text's cluster holds the most of the draft's samples
        ("largest_target", pa.bool_()),
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


def label_joint(
    judge: Judge, groups: dict[str, dict[str, Any]], cfg: ClusterConfig, premise: str = ""
) -> list[dict[str, Any]]:
    """Joint labels of one prefix: the valid samples of both models (``groups``: role -> that role's group
    as ``group_samples`` makes it) clustered in one judge call; every text gets, for each model, the share
    of that model's valid samples in its cluster (null for a model with no valid sample here)."""
    texts, who = [], []
    for role in ROLES:
        g = groups.get(role)
        if g is None:
            continue
        for i, (t, f) in enumerate(zip(g["text"], g["finish_reason"], strict=True)):
            if is_valid(t, f, cfg.label_length_cut):
                texts.append(t)
                who.append((role, g["sample_idx"][i]))
    if not texts:
        return []
    found = judge.cluster(texts, premise if cfg.with_question else "")
    kept = [(w, c) for w, c in zip(who, found.ids, strict=True) if c is not None]  # too long: unjudged
    if cfg.noise:
        first = next(iter(groups.values()))["prefix_id"]
        ids = inject_noise([c for _, c in kept], cfg.noise, random.Random(f"{cfg.seed}:joint:{first}"))
        kept = [(w, c) for (w, _), c in zip(kept, ids, strict=True)]
    counts = {role: Counter(c for (r, _), c in kept if r == role) for role in ROLES}
    n_valid = {role: sum(counts[role].values()) for role in ROLES}
    top = {role: max(counts[role].values(), default=0) for role in ROLES}
    g0 = next(iter(groups.values()))
    return [
        {
            "prefix_id": g0["prefix_id"],
            "question_id": g0["question_id"],
            "domain": g0.get("domain", "unknown"),
            "author": role,
            "sample_idx": idx,
            "cluster_id": c,
            "n_valid_draft": n_valid["draft"],
            "n_valid_target": n_valid["target"],
            **{f"share_{m}": counts[m][c] / n_valid[m] if n_valid[m] else None for m in ROLES},
            **{f"largest_{m}": bool(n_valid[m]) and counts[m][c] == top[m] for m in ROLES},
        }
        for (role, idx), c in kept
    ]


class JudgeActor:
    """Holds one judge (a Ray actor, or in-process for the local executor)."""

    def __init__(self, spec: JudgeSpec | None = None, judge: Judge | None = None) -> None:
        if judge is None and spec is None:
            raise ValueError("JudgeActor needs a spec or a judge")
        self.judge = judge or load_judge(spec)

    def label(self, groups: list[dict[str, Any]], cfg: ClusterConfig) -> list[dict[str, Any]]:
        """Labels for a batch of prefixes (one role's groups, or joint groups: ``{"roles": {...}}``)."""
        out = []
        for g in groups:
            if "roles" in g:
                out += label_joint(self.judge, g["roles"], cfg, g.get("premise", ""))
            else:
                out += label_prefix(self.judge, g, cfg, g.get("premise", ""))
        return out


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


PARTS = ".parts"  # labels of finished batches while the stage runs (removed when it completes)


def run_cluster(
    cfg: ClusterConfig,
    pair: PairConfig,
    samples_dir: Path,
    out_dir: Path,
    prefixes_path: Path | None = None,
    judge: Judge | None = None,
) -> dict[str, Path]:
    """Write ``out_dir/<role>.parquet`` for every role sampled in ``samples_dir`` and, when both were,
    ``out_dir/joint.parquet`` (``label_joint``: both models' samples of a prefix clustered together); resumes.

    Each batch of prefixes is written to ``out_dir/.parts/<role>/`` as it is labelled, so a rerun after a
    crash labels only the prefixes without a part (parts made with other settings or samples are dropped).
    """
    prefixes = {}
    if prefixes_path is not None:
        prefixes = {r["prefix_id"]: r for r in pq.read_table(prefixes_path).to_pylist()}
    roles = sorted(p.name for p in samples_dir.iterdir() if p.is_dir()) if samples_dir.is_dir() else []
    if not roles:
        raise ValueError(f"no sample folders in {samples_dir}: run the sample stage first")
    work = {role: group_samples(read_shards(samples_dir / role), prefixes) for role in roles}
    if set(ROLES) <= set(roles):  # both models sampled: their samples clustered together too
        work[JOINT] = joint_groups(work)
    parts = out_dir / PARTS
    settings = asdict(cfg)
    for k in ("executor", "batch_prefixes"):  # how the work is spread does not change a label
        settings.pop(k)
    manifest = {
        "cluster": settings,
        "judge": asdict(pair.judge),
        "samples_md5": {role: content_md5(samples_dir / role) for role in roles},
        "prefixes_md5": file_md5(Path(prefixes_path)) if prefixes_path is not None else None,
    }
    done = {kind: set() for kind in work}
    if ensure_manifest(parts, manifest):
        done = {kind: labelled_prefixes(parts / kind) for kind in work}
    todo = {role: [g for g in groups if g["prefix_id"] not in done[role]] for role, groups in work.items()}
    total = sum(len(g) for g in todo.values())
    log.info(
        "cluster: %d prefixes, %d already labelled, %d to do",
        sum(len(g) for g in work.values()),
        sum(len(d) for d in done.values()),
        total,
    )
    if total:
        label_fn = _labels_local if cfg.executor == "local" or judge is not None else _labels_ray
        label_fn(cfg, pair.judge, todo, total, judge, functools.partial(_write_part, parts))
    out = {}
    for kind in work:
        out[kind] = _finish_role(parts / kind, work[kind], out_dir / f"{kind}.parquet")
    for stale in out_dir.glob("*.parquet"):  # a role no longer sampled
        if stale.stem not in work:
            stale.unlink()
    shutil.rmtree(parts)
    return out


def joint_groups(work: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One joint group per prefix that both roles sampled: ``{"prefix_id", "roles": {role: group}}``."""
    by_prefix: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        for g in work[role]:
            j = by_prefix.setdefault(g["prefix_id"], {"prefix_id": g["prefix_id"], "roles": {}})
            j["roles"][role] = g
            if "premise" in g:
                j["premise"] = g["premise"]
    return [by_prefix[k] for k in sorted(by_prefix)]


def labelled_prefixes(folder: Path) -> set[str]:
    """Prefix ids whose labels are in a finished part of ``folder`` (a part lists its prefixes in its
    metadata: a prefix with no valid sample has no rows but is done)."""
    done: set[str] = set()
    for p in shard_paths(folder):
        done.update(json.loads(pq.read_schema(p).metadata[b"prefix_ids"]))
    return done


def _schema(kind: str) -> pa.Schema:
    return JOINT_SCHEMA if kind == JOINT else LABEL_SCHEMA


def _key(kind: str, row: dict[str, Any]) -> tuple:
    """What identifies a label row: (prefix, sample), and the author in joint labels."""
    return (row["prefix_id"], row.get("author", ""), row["sample_idx"])


def _write_part(parts: Path, role: str, groups: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    ids = [g["prefix_id"] for g in groups]
    table = pa.Table.from_pylist(rows, schema=_schema(role))
    table = table.replace_schema_metadata({"prefix_ids": json.dumps(ids)})
    write_parquet_atomic(table, parts / role / shard_name(ids))


def _finish_role(folder: Path, groups: list[dict[str, Any]], path: Path) -> Path:
    """Join a role's parts into ``path``, sorted; every prefix labelled once, no duplicate rows."""
    role = path.stem
    missing = {g["prefix_id"] for g in groups} - labelled_prefixes(folder)
    if missing:
        raise RuntimeError(f"cluster[{role}]: {len(missing)} prefixes have no labels in {folder}")
    tables = [pq.read_table(p).replace_schema_metadata(None) for p in shard_paths(folder)]
    rows = pa.concat_tables(tables).to_pylist() if tables else []
    rows.sort(key=lambda r: _key(role, r))
    if len({_key(role, r) for r in rows}) != len(rows):
        raise RuntimeError(f"cluster[{role}]: duplicate labels in {folder}")
    texts = [t for g in groups for gg in g.get("roles", {role: g}).values() for t in gg["text"]]
    n_inv = len(texts) - len(rows)
    log.info(
        "cluster[%s]: %d labelled samples over %d prefixes, %d invalid",
        role,
        len(rows),
        len({r["prefix_id"] for r in rows}),
        n_inv,
    )
    return write_parquet_atomic(pa.Table.from_pylist(rows, schema=_schema(role)), path)


PartWriter = Callable[[str, list[dict[str, Any]], list[dict[str, Any]]], None]


def _batches(work: dict[str, list[dict[str, Any]]], size: int) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    for role, groups in work.items():
        for i in range(0, len(groups), size):
            yield role, groups[i : i + size]


def _labels_local(cfg, spec, work, total, judge, write: PartWriter) -> None:
    actor = JudgeActor(spec, judge)
    with tqdm(total=total, desc="cluster", unit="prefix") as bar:
        for role, batch in _batches(work, cfg.batch_prefixes):
            write(role, batch, actor.label(batch, cfg))
            bar.update(len(batch))


def _labels_ray(cfg, spec, work, total, judge, write: PartWriter) -> None:
    import ray  # only the ray executor needs it (a slow import); ray_utils imports it lazily too

    init_ray()
    opts = restartable(num_cpus=1, num_gpus=1 if spec.device.startswith("cuda") else 0)
    actor = ray.remote(JudgeActor).options(**opts).remote(spec)
    futures = {
        actor.label.remote(batch, cfg): (role, batch) for role, batch in _batches(work, cfg.batch_prefixes)
    }
    try:
        with tqdm(total=total, desc="cluster", unit="prefix") as bar:
            pending = list(futures)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                role, batch = futures[ready[0]]
                ids = ", ".join(g["prefix_id"] for g in batch)
                write(role, batch, get_result(ready[0], f"cluster[{role}] of prefixes {ids}"))
                bar.update(len(batch))
    finally:
        ray.kill(actor)


def stage(*, params: Params, pair: PairConfig, samples: Path, prefixes: Path, out: Path) -> str:
    """Stage cluster (the CLI's and dvc.yaml's entry): samples -> ``out/<role>.parquet`` labels."""
    paths = run_cluster(params.cluster, pair, samples, out, prefixes)
    return "wrote " + ", ".join(str(f) for f in paths.values())
