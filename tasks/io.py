"""Artifact I/O: atomic Parquet writes, shard folders, stage manifests and data hashes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from semspec.models.project.pairs import project_root


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path beside ``path`` to write to; renamed onto ``path`` when the block ends, deleted when it
    fails (a full disk, a kill signal turned into an exception): ``path`` is never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: Path, option: str) -> None:
    """Fail early, before any work, when the output ``path`` (a folder, or a file when it has a suffix)
    cannot be created or written; the ValueError names the option, the path and why."""
    folder = path.parent if path.suffix else path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check.", suffix=".tmp", dir=folder)
        os.close(fd)
        Path(probe).unlink()
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write there ({e.strerror or e})") from None


def write_parquet_atomic(table: pa.Table, path: Path) -> Path:
    """Write ``table`` to ``path`` via a temp file in the same folder and an atomic rename."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path


def write_json_atomic(obj: Any, path: Path) -> Path:
    """Write JSON atomically (temp file + rename)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str), encoding="utf-8")
    return path


def save_figure_atomic(fig: Any, path: Path, dpi: int = 90) -> Path:
    """Save a matplotlib figure atomically (temp file + rename)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    return path


def close_figure(fig: Any | None) -> None:
    """Free a pyplot figure (pyplot keeps every figure it made until it is closed)."""
    if fig is not None:
        import matplotlib.pyplot as plt

        plt.close(fig)


def shard_name(prefix_ids: list[str]) -> str:
    """Deterministic shard file name for a batch of prefixes."""
    return f"part-{hashlib.sha1(','.join(sorted(prefix_ids)).encode()).hexdigest()[:16]}.parquet"


def shard_paths(folder: Path) -> list[Path]:
    """Complete shards of a folder (temp files of an interrupted write are ignored)."""
    return sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []


def read_shards(folder: Path, columns: list[str] | None = None, optional: list[str] = ()) -> pa.Table:
    """All shards of ``folder`` as one table (``columns``, plus each of ``optional`` that every shard
    has); a clear error when there are none."""
    paths = shard_paths(folder)
    if not paths:
        raise ValueError(f"no shards (part-*.parquet) in {folder}: run the stage that writes them first")
    if columns is not None and optional:
        names = [set(pq.read_schema(p).names) for p in paths]
        columns = columns + [c for c in optional if all(c in n for n in names)]
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in paths])


def fixed_list(values: np.ndarray, dtype: pa.DataType) -> pa.FixedSizeListArray:
    """(N, D) array -> a fixed-size-list column of D values per row."""
    n, d = values.shape
    flat = pa.array(values.reshape(-1), type=dtype)
    return pa.FixedSizeListArray.from_arrays(flat, d) if n else pa.array([], type=pa.list_(dtype, d))


def column_matrix(table: pa.Table, name: str, dtype=np.float32) -> np.ndarray:
    """A fixed-size-list column -> (N, D) numpy array."""
    col = table.column(name).combine_chunks()
    d = col.type.list_size
    return col.values.to_numpy(zero_copy_only=False).astype(dtype).reshape(len(col), d)


def config_hash(obj: Any) -> str:
    """Stable short hash of a JSON-able config."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def ensure_manifest(folder: Path, manifest: dict[str, Any]) -> bool:
    """Make ``folder`` belong to ``manifest`` (the settings its shards were made with).

    Returns True when existing shards can be resumed; when the folder was made with other settings
    its shards are stale and the folder is emptied.
    """
    mpath = folder / "_manifest.json"
    if mpath.is_file() and json.loads(mpath.read_text()) == json.loads(json.dumps(manifest, default=str)):
        for tmp in folder.glob(".*.tmp"):  # left by a write that was killed
            tmp.unlink(missing_ok=True)
        return True
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    write_json_atomic(manifest, mpath)
    return False


def source_md5(*modules: Any) -> str:
    """MD5 over the source files of ``modules``: what code made a stage's shards (a resumed stage must not
    mix shards of two versions of the code that computes them). A package counts with every module and
    C++ source in it and its subfolders."""
    h = hashlib.md5()
    for mod in modules:
        if hasattr(mod, "__path__"):  # a package: every source in it, in path order
            files = sorted(
                p
                for folder in mod.__path__
                for p in Path(folder).rglob("*")
                if p.suffix in (".py", ".cpp", ".h")
            )
        else:
            files = [Path(mod.__file__)]
        for path in files:
            h.update(file_md5(path).encode())
    return h.hexdigest()


def file_md5(path: Path) -> str:
    """MD5 of a file's bytes."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_hash(path: Path, lock: Path | None = None) -> str:
    """The DVC hash of an output when ``dvc.lock`` records it, else an MD5 over the files' MD5s."""
    lock = lock or Path("dvc.lock")
    if lock.is_file():
        try:
            stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
            for st in stages.values():
                for out in st.get("outs", []):
                    if (lock.parent / out.get("path", "")).resolve() == path.resolve() and out.get("md5"):
                        return f"dvc:{out['md5']}"
        except (yaml.YAMLError, AttributeError):
            pass
    return f"md5:{content_md5(path)}"


def content_md5(path: Path) -> str:
    """An MD5 over the names and MD5s of a file, or of every file under a folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.md5()
    for f in files:
        h.update(f"{f.relative_to(path.parent if path.is_file() else path)}:{file_md5(f)}".encode())
    return h.hexdigest()


def git_commit() -> str:
    """HEAD's commit, or 'unknown' outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=project_root()
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
