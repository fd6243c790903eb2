"""Stage ``cluster``: group each prefix's samples by meaning -> semantic-probability labels.

What a label is, and the judge that computes it, are in ``semspec.tasks.labelling``. This module groups the
samples by prefix (and both models' samples of a prefix together, when both were sampled), hands batches of
prefixes to the judge in Ray actors (GPU when the model config says cuda) or in-process, keeps each labelled batch
as a part so that a rerun resumes, and joins the parts into one parquet file per role.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from semspec.models.lm.pair import PairConfig
from semspec.models.spec.judges import Judge
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
from semspec.tasks.labelling import JOINT_SCHEMA, LABEL_SCHEMA, JudgeActor
from semspec.tasks.ray_utils import get_result, init_ray, restartable

log = logging.getLogger(__name__)

JOINT = "joint"  # labels/joint.parquet: both models' samples of a prefix clustered together


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


def _labels_local(cfg, judge_cfg, work, total, judge, write: PartWriter) -> None:
    actor = JudgeActor(judge_cfg, judge)
    with tqdm(total=total, desc="cluster", unit="prefix") as bar:
        for role, batch in _batches(work, cfg.batch_prefixes):
            write(role, batch, actor.label(batch, cfg))
            bar.update(len(batch))


def _labels_ray(cfg, judge_cfg, work, total, judge, write: PartWriter) -> None:
    import ray  # only the ray executor needs it (a slow import); ray_utils imports it lazily too

    init_ray()
    opts = restartable(num_cpus=1, num_gpus=1 if judge_cfg.device.startswith("cuda") else 0)
    actor = ray.remote(JudgeActor).options(**opts).remote(judge_cfg)
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
