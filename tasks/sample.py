"""Stage ``sample``: N continuations per prefix and role, with pooled hidden states, via Ray actors.

Each actor holds one model replica and takes batches of prefixes; the driver writes one shard per
batch atomically, so re-running after a crash samples only the prefixes with no complete shard.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from semspec.models import cpu
from semspec.models import lm as lm_module
from semspec.models.cpu.formats import resolve_format
from semspec.models.lm import LM, Pooled, load_lm
from semspec.models.lm.pair import ModelConfig, PairConfig
from semspec.models.spec import steps
from semspec.tasks.config import Params, SampleConfig
from semspec.tasks.io import (
    ensure_manifest,
    file_md5,
    fixed_list,
    shard_name,
    shard_paths,
    source_md5,
    write_parquet_atomic,
)
from semspec.tasks.ray_utils import get_result, init_ray, restartable

log = logging.getLogger(__name__)


def sample_seed(seed: int, role: str, prefix_id: str) -> int:
    """Per-prefix seed: a prefix's draws do not depend on which prefixes share its shard. (Its tokens may
    still, rarely: a shard's contexts are padded to one width and padding rounds bfloat16 differently.
    Shards are fixed groups, ``groups``, so a resumed run writes what an unbroken one does.)"""
    return int(hashlib.sha1(f"{seed}:{role}:{prefix_id}".encode()).hexdigest()[:15], 16)


@dataclass
class _Row:
    """One step and its features, as a shard row holds it."""

    prefix_id: str
    question_id: str
    sample_idx: int
    text: str
    num_tokens: int  # in the reading model's tokenizer
    finish_reason: str
    pooled: Pooled


def sample_rows(lm: LM, role: str, prefixes: list[dict[str, Any]], cfg: SampleConfig) -> pa.Table:
    """Sample ``cfg.n`` steps for each prefix row, all the prefixes' rows in one batched loop -> one table
    (the shard of these prefixes)."""
    contexts = [lm.format_prompt(row["question"]) + row["context"] for row in prefixes]
    seeds = [sample_seed(cfg.seed, role, row["prefix_id"]) for row in prefixes]
    per_prefix = lm.generate_steps(contexts, cfg.n, cfg.temperature, cfg.top_p, cfg.max_step_tokens, seeds)
    rows = [
        _Row(row["prefix_id"], row["question_id"], i, s.text, s.num_tokens, s.finish_reason, s.pooled)
        for row, samples in zip(prefixes, per_prefix, strict=True)
        for i, s in enumerate(samples)
    ]
    return shard_table(lm, role, role, rows, cfg.store_layers)


def read_rows(lm: LM, role: str, prefixes: list[dict[str, Any]], cfg: SampleConfig) -> pa.Table:
    """The other model's steps read by this one -> one table: for each prefix row (with its ``steps``:
    the author's ``sample_idx``, ``text``, ``finish_reason`` and ``author``), the context is prefilled
    once and every non-empty step after it in one padded prefill, pooled as a verifier pools a proposed
    step (``LM.score_steps``, the call the decoders make). Empty steps have nothing to read: no row."""
    rows, author = [], None
    for row in prefixes:
        steps = [st for st in row["steps"] if st["text"]]
        if not steps:
            continue
        author = steps[0]["author"]
        state = lm.prefill(lm.format_prompt(row["question"]) + row["context"])
        scores = lm.score_steps([state.clone() for _ in steps], [st["text"] for st in steps])
        rows += [
            _Row(
                row["prefix_id"],
                row["question_id"],
                st["sample_idx"],
                st["text"],
                len(sc.token_ids),
                st["finish_reason"],
                sc.pooled,
            )
            for st, sc in zip(steps, scores, strict=True)
        ]
    return shard_table(lm, role, author or role, rows, cfg.store_layers)


def shard_table(lm: LM, role: str, author: str, rows: list[_Row], store_layers: bool) -> pa.Table:
    """Rows of ``role``'s features over steps ``author`` wrote, as a shard (the artifact schema)."""
    n, d = len(rows), lm.hidden_size
    cols = {
        "prefix_id": pa.array([r.prefix_id for r in rows], pa.string()),
        "question_id": pa.array([r.question_id for r in rows], pa.string()),
        "role": pa.array([role] * n, pa.string()),  # whose hidden states
        "author": pa.array([author] * n, pa.string()),  # who wrote the text
        "model_id": pa.array([lm.model_id] * n, pa.string()),
        "format": pa.array(
            [lm.format.name] * n, pa.string()
        ),  # what the model ran in (probes are per format)
        "sample_idx": pa.array([r.sample_idx for r in rows], pa.int32()),
        "text": pa.array([r.text for r in rows], pa.string()),
        "num_tokens": pa.array([r.num_tokens for r in rows], pa.int32()),
        "finish_reason": pa.array([r.finish_reason for r in rows], pa.string()),
        "h_last": fixed_list(_stack([r.pooled.h_last for r in rows], d), pa.float32()),  # (N, D)
        "h_mean": fixed_list(_stack([r.pooled.h_mean for r in rows], d), pa.float32()),  # (N, D)
    }
    if store_layers:
        layers = _stack([r.pooled.h_layers.reshape(-1) for r in rows], (lm.num_layers + 1) * d)
        cols["h_layers"] = fixed_list(layers.astype(np.float16), pa.float16())  # (N, (L+1)*D)
    return pa.table(cols)


def _stack(vectors: list[torch.Tensor], width: int) -> np.ndarray:
    """(N, width) float32 from N vectors (an empty (0, width) when there are none)."""
    if not vectors:
        return np.zeros((0, width), dtype=np.float32)
    return np.stack([v.numpy() for v in vectors]).astype(np.float32)


class SamplerActor:
    """Holds one model replica (created as a Ray actor, or in-process by the local executor)."""

    def __init__(self, model_cfg: ModelConfig, threads: int | None = None, lm: LM | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.lm = lm or load_lm(model_cfg)

    def set_threads(self, threads: int) -> None:
        """Use ``threads`` intra-op threads from the next call on (rebalanced when other actors finish)."""
        torch.set_num_threads(threads)

    def sample(self, role: str, prefixes: list[dict[str, Any]], cfg: SampleConfig) -> pa.Table:
        """One batch of prefixes -> its shard."""
        return sample_rows(self.lm, role, prefixes, cfg)

    def read(self, role: str, prefixes: list[dict[str, Any]], cfg: SampleConfig) -> pa.Table:
        """One batch of prefixes with the other model's steps -> the shard of this model's features."""
        return read_rows(self.lm, role, prefixes, cfg)


def done_prefixes(folder: Path) -> set[str]:
    """Prefix ids that already have a complete shard in ``folder``."""
    done: set[str] = set()
    for p in shard_paths(folder):
        done.update(pq.read_table(p, columns=["prefix_id"]).column("prefix_id").to_pylist())
    return done


def groups(rows: list[dict[str, Any]], size: int, done: set[str]) -> Iterator[list[dict[str, Any]]]:
    """The shards still to write: consecutive groups of ``size`` prefixes of the whole list, less the
    prefixes ``done`` (a shard is written whole, so a group is all done or all to do, unless an older
    run grouped them otherwise), so that a resumed run batches each prefix as an unbroken one."""
    for i in range(0, len(rows), size):
        if todo := [r for r in rows[i : i + size] if r["prefix_id"] not in done]:
            yield todo


def run_sample(
    cfg: SampleConfig,
    pair: PairConfig,
    prefixes_path: Path,
    out_dir: Path,
    lms: dict[str, LM] | None = None,
) -> dict[str, Path]:
    """Sample every prefix for every role into ``out_dir/<role>/part-*.parquet``; resumes.

    ``lms`` gives already-loaded models to the local executor (tests, notebooks).
    """
    prefixes = pq.read_table(prefixes_path).to_pylist()
    if not prefixes:
        raise ValueError(f"{prefixes_path} has no prefixes")
    folders: dict[str, Path] = {}
    work: list[tuple[str, list[dict[str, Any]]]] = []
    for role in cfg.roles:
        model_cfg = pair.role(role)
        folder = out_dir / role
        manifest = {
            "pair": pair.name,
            "model_id": model_cfg.model_id,
            # shards of another format are redone, and shards of other feature code
            "format": resolve_format(model_cfg.dtype, model_cfg.device).name,
            "code_md5": source_md5(lm_module, cpu, steps),
            "model": asdict(model_cfg),
            "sample": asdict(cfg),
            "prefixes_md5": file_md5(Path(prefixes_path)),
        }
        manifest["sample"].pop("executor")
        manifest["sample"].pop("actors_per_role")
        manifest["sample"].pop("batch_prefixes")
        resumed = ensure_manifest(folder, manifest)
        done = done_prefixes(folder) if resumed else set()
        todo = [r for r in prefixes if r["prefix_id"] not in done]
        log.info(
            "sample[%s]: %d prefixes, %d already sampled, %d to do", role, len(prefixes), len(done), len(todo)
        )
        work.extend((role, b) for b in groups(prefixes, cfg.batch_prefixes, done))
        folders[role] = folder
    total = sum(len(b) for _, b in work)
    if total:
        run_jobs(cfg, pair, work, folders, total, lms or {})
    for role, folder in folders.items():
        _check_complete(folder, {r["prefix_id"] for r in prefixes}, cfg.n, role)
    return folders


def _write(folder: Path, batch: list[dict[str, Any]], table: pa.Table) -> None:
    write_parquet_atomic(table, folder / shard_name([r["prefix_id"] for r in batch]))


class _Progress:
    """prefixes done / total, samples per second, ETA."""

    def __init__(self, total: int, n: int, desc: str = "sample") -> None:
        self.bar = tqdm(total=total, desc=desc, unit="prefix")
        self.n, self.t0, self.samples = n, time.perf_counter(), 0

    def update(self, prefixes: int) -> None:
        self.samples += prefixes * self.n
        self.bar.update(prefixes)
        self.bar.set_postfix(samples_per_s=f"{self.samples / (time.perf_counter() - self.t0):.2f}")

    def close(self) -> None:
        self.bar.close()


def run_jobs(cfg, pair, work, folders, total, lms, job: str = "sample") -> None:
    """Run ``job`` (a ``SamplerActor`` method: ``sample`` or ``read``) on every (role, batch) of ``work``,
    one model replica per role (Ray actors, or in-process with ``executor: local``), writing each batch's
    shard into ``folders[role]`` as it comes back."""
    runner = _run_local if cfg.executor == "local" else _run_ray
    runner(cfg, pair, work, folders, total, lms, job)


def _run_local(cfg, pair, work, folders, total, lms, job) -> None:
    actors: dict[str, SamplerActor] = {}
    prog = _Progress(total, cfg.n, job)
    try:
        for role, batch in work:
            if role not in actors:
                actors[role] = SamplerActor(pair.role(role), lm=lms.get(role))
            _write(folders[role], batch, getattr(actors[role], job)(role, batch, cfg))
            prog.update(len(batch))
    finally:
        prog.close()


def _run_ray(cfg, pair, work, folders, total, lms, job) -> None:
    import ray  # only the ray executor needs it (a slow import); ray_utils imports it lazily too

    init_ray()
    roles = sorted({r for r, _ in work})
    n_actors = len(roles) * cfg.actors_per_role
    total_cpus = int(ray.available_resources().get("CPU", os.cpu_count() or 1))
    cpus = max(1, total_cpus // n_actors)
    remote_cls = ray.remote(SamplerActor)
    pools: dict[str, list] = {}
    for role in roles:
        model_cfg = pair.role(role)
        opts = restartable(num_cpus=cpus, num_gpus=1 if model_cfg.uses_cuda else 0)
        pools[role] = [remote_cls.options(**opts).remote(model_cfg, cpus) for _ in range(cfg.actors_per_role)]
    queue = {role: [b for r, b in work if r == role] for role in roles}
    idle = {role: list(pools[role]) for role in roles}
    pending: dict[Any, tuple[str, Any, list]] = {}
    prog = _Progress(total, cfg.n, job)
    try:
        while pending or any(queue.values()):
            for role in roles:  # keep every actor busy with one batch
                while idle[role] and queue[role]:
                    actor, batch = idle[role].pop(), queue[role].pop(0)
                    pending[getattr(actor, job).remote(role, batch, cfg)] = (role, actor, batch)
            ready, _ = ray.wait(list(pending), num_returns=1)
            role, actor, batch = pending.pop(ready[0])
            ids = ", ".join(r["prefix_id"] for r in batch)
            _write(folders[role], batch, get_result(ready[0], f"{job}[{role}] of prefixes {ids}"))
            prog.update(len(batch))
            idle[role].append(actor)
            if role in pools and not queue[role] and not any(r == role for r, _, _ in pending.values()):
                # this role is done: free its replicas and give their cores to the others
                for a in pools.pop(role):
                    ray.kill(a)
                idle[role] = []
                live = [a for actors in pools.values() for a in actors]
                for a in live:
                    a.set_threads.remote(max(1, total_cpus // len(live)))
    finally:
        prog.close()
        for actors in pools.values():
            for a in actors:
                ray.kill(a)


def _check_complete(folder: Path, expected: set[str], n: int, role: str) -> None:
    """Exactly ``n`` rows per expected prefix, no duplicate (prefix_id, sample_idx)."""
    tbl = pa.concat_tables(
        [pq.read_table(p, columns=["prefix_id", "sample_idx"]) for p in shard_paths(folder)]
    )
    pids = tbl.column("prefix_id").to_pylist()
    keys = set(zip(pids, tbl.column("sample_idx").to_pylist(), strict=True))
    if len(keys) != len(pids):
        raise RuntimeError(f"sample[{role}]: duplicate rows in {folder}")
    missing = expected - set(pids)
    if missing or len(pids) != n * len(expected):
        raise RuntimeError(
            f"sample[{role}]: {len(missing)} prefixes missing, {len(pids)} rows for "
            f"{len(expected)} prefixes x {n} in {folder}"
        )


def stage(*, params: Params, pair: PairConfig, prefixes: Path, out: Path) -> str:
    """Stage sample (the CLI's and dvc.yaml's entry): N steps per prefix and role -> ``out/<role>``."""
    folders = run_sample(params.sample, pair, prefixes, out)
    return "wrote " + ", ".join(str(f) for f in folders.values())
