"""Stage ``cross``: each model reads the other model's sampled steps.

At decode time the target's probe scores the target's hidden states over a step the *draft* wrote; a
probe trained only on the target's own samples never sees such a step. This stage makes those examples:
for every prefix the target prefills each of the draft's samples after the same context (its own prompt
format and tokenizer), and the draft each of the target's, pooled exactly as a verifier pools a proposed
step (``LM.score_steps``). Shards go to ``<out>/<reader>/part-*.parquet`` with the sample schema plus
``author`` (who wrote the text; the sample stage's own rows say their own role), one shard per batch of
prefixes, written atomically: after a crash only the prefixes without a shard are read again, and shards
made from other samples, by another model, format or feature code are dropped. The replicas are the
sample stage's (Ray actors, or in-process).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from semspec.models import cpu
from semspec.models import lm as lm_module
from semspec.models.cpu.formats import resolve_format
from semspec.models.lm import LM
from semspec.models.lm.pair import PairConfig
from semspec.models.spec import steps
from semspec.models.spec.names import ROLES
from semspec.tasks.config import Params, SampleConfig
from semspec.tasks.io import content_md5, ensure_manifest, file_md5, read_shards, source_md5
from semspec.tasks.sample import done_prefixes, groups, run_jobs

log = logging.getLogger(__name__)


def other(role: str) -> str:
    """The other role of the pair."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return "target" if role == "draft" else "draft"


def author_steps(samples_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """prefix_id -> the steps one role sampled there (sample_idx, text, finish_reason, author), in order."""
    table = read_shards(samples_dir, columns=["prefix_id", "role", "sample_idx", "text", "finish_reason"])
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(table.to_pylist(), key=lambda r: (r["prefix_id"], r["sample_idx"])):
        out.setdefault(r["prefix_id"], []).append(
            {
                "sample_idx": r["sample_idx"],
                "text": r["text"],
                "finish_reason": r["finish_reason"],
                "author": r["role"],
            }
        )
    return out


def run_cross(
    cfg: SampleConfig,
    pair: PairConfig,
    prefixes_path: Path,
    samples_dir: Path,
    out_dir: Path,
    lms: dict[str, LM] | None = None,
) -> dict[str, Path]:
    """For each role of ``cfg.roles`` whose other role was sampled, that role's features over the other's
    steps into ``out_dir/<role>/``; resumes. ``lms`` gives loaded models to the local executor."""
    prefixes = {r["prefix_id"]: r for r in pq.read_table(prefixes_path).to_pylist()}
    if not prefixes:
        raise ValueError(f"{prefixes_path} has no prefixes")
    folders: dict[str, Path] = {}
    work: list[tuple[str, list[dict[str, Any]]]] = []
    for role in cfg.roles:
        source = samples_dir / other(role)
        if not source.is_dir():
            raise ValueError(
                f"cross[{role}] reads the {other(role)}'s samples, and {source} does not exist: run the "
                f"sample stage for both roles first (sample.roles: [draft, target])"
            )
        model_cfg = pair.role(role)
        folder = out_dir / role
        manifest = {
            "pair": pair.name,
            "model_id": model_cfg.model_id,
            "model": asdict(model_cfg),
            "format": resolve_format(model_cfg.dtype, model_cfg.device).name,
            "code_md5": source_md5(lm_module, cpu, steps),
            "store_layers": cfg.store_layers,
            "samples_md5": content_md5(source),
            "prefixes_md5": file_md5(Path(prefixes_path)),
        }
        done = done_prefixes(folder) if ensure_manifest(folder, manifest) else set()
        steps_by_prefix = author_steps(source)
        readable = [
            {**prefixes[pid], "steps": st}
            for pid, st in sorted(steps_by_prefix.items())
            if any(s["text"] for s in st)
        ]
        todo = list(groups(readable, cfg.batch_prefixes, done))
        log.info(
            "cross[%s]: reads the %s's steps of %d prefixes, %d already read, %d to do",
            role,
            other(role),
            len(steps_by_prefix),
            len(done),
            sum(map(len, todo)),
        )
        work.extend((role, b) for b in todo)
        folders[role] = folder
    total = sum(len(b) for _, b in work)
    if total:
        run_jobs(cfg, pair, work, folders, total, lms or {}, job="read")
    for role, folder in folders.items():
        _check_complete(folder, samples_dir / other(role), role)
    return folders


def _check_complete(folder: Path, source: Path, role: str) -> None:
    """One row per non-empty step of the other role, none twice."""
    want = {
        (r["prefix_id"], r["sample_idx"])
        for r in read_shards(source, columns=["prefix_id", "sample_idx", "text"]).to_pylist()
        if r["text"]
    }
    got = read_shards(folder, columns=["prefix_id", "sample_idx"]).to_pylist() if want else []
    keys = {(r["prefix_id"], r["sample_idx"]) for r in got}
    if len(keys) != len(got):
        raise RuntimeError(f"cross[{role}]: duplicate rows in {folder}")
    if keys != want:
        raise RuntimeError(
            f"cross[{role}]: {len(want - keys)} steps of the {other(role)} not read, {len(keys - want)} "
            f"rows without a step in {folder}"
        )


def stage(*, params: Params, pair: PairConfig, prefixes: Path, samples: Path, out: Path) -> str:
    """Stage cross (the CLI's and dvc.yaml's entry): each role's features over the other's samples."""
    folders = run_cross(params.sample, pair, prefixes, samples, out)
    return "wrote " + ", ".join(str(f) for f in folders.values())
