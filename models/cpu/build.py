"""Building and loading semspec's CPU kernels: one function for every kernel and instruction set.

The kernels are C++ sources in ``csrc/`` (``simd.h`` holds what they share: bfloat16 conversions and the
float32 vector type of the build). ``load`` compiles one of them with the system's C++ compiler (``$CXX``,
else ``g++`` or ``c++``) for an instruction set, into ``kernels/`` of the cache folder
(``$SEMSPEC_CACHE_DIR``, default ``~/.cache/semspec``), and loads it with ctypes. A build is keyed by
every source in ``csrc/``, the flags and the compiler's identity (its path and ``--version``), written
under a temporary name and renamed when whole; a new build removes the older ones of the same kernel and
instruction set. OpenMP threads come from the runtime torch already loaded (one ``libgomp.so.1``, so the
kernels and torch share a thread pool).

``SEMSPEC_KERNELS`` is the one switch: ``auto`` (default, the best build the CPU runs), ``avx512`` or
``avx2`` (that build, e.g. AVX2 on an AVX-512 CPU to measure or test it; every kernel has an AVX2 build)
or ``off`` (PyTorch's ops and SDPA everywhere). Calls into the kernels go through
``ops`` (torch operators that check shapes, dtypes and layouts first).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from semspec.models.cpu import cpuinfo
from semspec.models.project.settings import settings

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# instruction sets, best first: the compiler flags and the /proc/cpuinfo flags each needs
ISAS = {
    "AVX512_BF16": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    ),
    "AVX512": (("-mavx512f", "-mavx2", "-mfma"), frozenset({"avx512f", "avx2", "fma"})),
    "AVX2": (("-mavx2", "-mfma"), frozenset({"avx2", "fma"})),
}
SWITCH = {"auto": None, "avx512": ("AVX512_BF16", "AVX512"), "avx2": ("AVX2",), "off": ()}


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``g++`` or ``c++`` on the PATH."""
    return settings().cxx or shutil.which("g++") or shutil.which("c++")


@functools.cache
def _compiler_id(cxx: str) -> str:
    """``cxx --version``'s first line: a new compiler makes new builds."""
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (done.stdout.splitlines() or ["unknown"])[0]


def sources_digest() -> str:
    """SHA-256 over every file in ``csrc/`` (names and bytes): any change there makes new builds."""
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def isa(flags: frozenset[str], among: tuple[str, ...] = tuple(ISAS)) -> str | None:
    """The best instruction set of ``among`` that ``SEMSPEC_KERNELS`` allows and CPU ``flags`` have, or
    None (the kernel is off)."""
    allowed = SWITCH[settings().kernels]
    names = [n for n in among if allowed is None or n in allowed]
    return next((n for n in names if ISAS[n][1] <= flags), None)


def cpu_lacks() -> str:
    """Why ``isa`` found no build, for a warning: the CPU lacks AVX2/FMA, or what the switch's build needs."""
    wanted = settings().kernels
    return "the CPU lacks AVX2/FMA" if wanted == "auto" else f"the CPU lacks what the {wanted} build needs"


def build(cxx: str, folder: Path, target: str, name: str, source: str) -> Path:
    """Compile ``csrc/<source>`` for instruction set ``target`` (a name in ``ISAS``) with ``cxx`` into
    ``folder`` as library ``name`` (once per key: the sources, the flags, the compiler) and return its
    path. Raises ``RuntimeError`` with the compiler's message when the build fails."""
    flags = (*FLAGS, *ISAS[target][0])
    key_text = "\n".join((sources_digest(), source, *flags, cxx, _compiler_id(cxx)))
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    stem = f"{name}-{target.lower()}"
    lib = folder / f"{stem}-{key}.so"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(folder)
    if lib.is_file() and _recorded(lib):
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *flags, "-I", str(CSRC), str(CSRC / source), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build the {name} kernel:\n{done.stderr.strip()[-2000:]}")
        out.chmod(0o700)
        digest = _sha256(out)
        out.replace(lib)  # atomic: a concurrent build of the same key writes the same bytes
        _record(lib, digest)
    for stale in folder.glob(f"{stem}-*.so"):
        if stale != lib:
            stale.unlink(missing_ok=True)
            _digest_path(stale).unlink(missing_ok=True)
    return lib


def check_private(path: Path) -> None:
    """``path`` must be this user's and writable by no one else: a kernel library is code this process
    runs, so a cache another user could write to is code execution. RuntimeError says what to fix."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"{path} is {'not yours' if st.st_uid != os.getuid() else 'writable by others'}: the kernel cache "
            f"must be private (chmod go-w, or point SEMSPEC_CACHE_DIR at a folder of your own)"
        )


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(lib: Path, digest: str) -> None:
    """Write the library's sha256 beside it (owner-only), read back before every load."""
    side = _digest_path(lib)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(digest)
    tmp.chmod(0o600)
    tmp.replace(side)


def _recorded(lib: Path) -> bool:
    """Whether ``lib`` is private and has the sha256 recorded when it was built; a library that fails
    either is deleted (it is built again)."""
    side = _digest_path(lib)
    try:
        check_private(lib)
        check_private(side)
        ok = side.read_text().strip() == _sha256(lib)
    except (OSError, RuntimeError):
        ok = False
    if not ok:
        log.warning(
            "kernel library %s is not the one built here (owner, permissions or hash): rebuilding", lib
        )
        lib.unlink(missing_ok=True)
        side.unlink(missing_ok=True)
    return ok


def load_best(
    name: str, source: str, among: tuple[str, ...], what: str, instead: str, warn_missing: bool = True
) -> tuple[ctypes.CDLL, str] | None:
    """Kernel ``name`` built for the best instruction set of ``among`` that ``SEMSPEC_KERNELS`` allows
    and this CPU runs, loaded: (library, instruction set). None where none fits (a warning that ``what``
    is off and ``instead`` runs, with ``warn_missing`` and the switch not ``off``) or it cannot be built."""
    target = isa(cpuinfo.cpu_info().flags, among)
    if target is None:
        if warn_missing and settings().kernels != "off":
            log.warning("%s kernel off (%s): %s, slower", what, cpu_lacks(), instead)
        return None
    dll = load(name, source, target, what, instead)
    return None if dll is None else (dll, target)


def load(name: str, source: str, target: str, what: str, instead: str) -> ctypes.CDLL | None:
    """Build (where needed) and load kernel ``name`` from ``csrc/<source>`` for ``target``; None where no
    compiler is found or the build fails, with a warning that the ``what`` kernel is off and ``instead``
    runs (e.g. ``int4``, ``PyTorch's int4 op decodes``)."""
    cxx = compiler()
    if cxx is None:
        log.warning("%s kernel off (no C++ compiler: $CXX, g++, c++): %s, slower", what, instead)
        return None
    folder = settings().cache_dir / "kernels"
    try:
        try:
            return ctypes.CDLL(str(build(cxx, folder, target, name, source)))
        except OSError:  # removed meanwhile by another checkout's newer build: build it again, once
            return ctypes.CDLL(str(build(cxx, folder, target, name, source)))
    except (RuntimeError, OSError) as err:
        log.warning("%s kernel off: %s; %s, slower", what, err, instead)
        return None
