"""The CPU at hand, as the format rule and the kernel builds read it: torch's vector ISA and the
``/proc/cpuinfo`` flags, read once per process. The ground floor of ``models/cpu``: it imports nothing of
the runtime, so ``build`` (which kernel build runs) and ``formats`` (which format runs) both read it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from semspec.models.project.settings import settings

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of native bfloat16
AVX512_FLAG_PREFIXES = ("avx512", "amx")  # what an AVX2-only CPU lacks


@dataclass(frozen=True)
class CpuInfo:
    """What the format rule reads about the CPU: torch's vector ISA and the kernel's feature flags."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    flags: frozenset[str]  # /proc/cpuinfo flags (lower case)
    as_avx2: bool = False  # AVX-512 and AMX flags dropped (SEMSPEC_KERNELS=avx2)

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 matrix products run in hardware (AVX512_BF16 or AMX)."""
        return bool(self.flags & NATIVE_BF16_FLAGS)

    @property
    def amx(self) -> bool:
        """Whether the CPU has AMX's bfloat16 tiles (oneDNN's bfloat16 GEMMs run on them)."""
        return "amx_bf16" in self.flags

    def label(self) -> str:
        """E.g. ``AVX512, native bf16`` or ``AVX2, no native bf16``."""
        forced = " (seen as AVX2-only: SEMSPEC_KERNELS=avx2)" if self.as_avx2 else ""
        return f"{self.capability}, {'native bf16' if self.native_bf16 else 'no native bf16'}{forced}"


def _cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = path.read_text()
    except OSError:  # not Linux: no flags, so no native bfloat16 is assumed
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].lower().split())
    return frozenset()


def cpu_info() -> CpuInfo:
    """The CPU at hand (read once per process). Under ``SEMSPEC_KERNELS=avx2`` it is seen as an AVX2-only
    CPU: its AVX-512 and AMX flags are dropped, so the format rule and every kernel decide as they would
    there (``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2`` make PyTorch's own kernels follow:
    ``benchmarks/formats.py --as-avx2`` sets all three)."""
    return _cpu_info(settings().kernels == "avx2")


@functools.cache
def _cpu_info(as_avx2: bool) -> CpuInfo:
    flags = _cpu_flags()
    if as_avx2:
        flags = frozenset(f for f in flags if not f.startswith(AVX512_FLAG_PREFIXES))
    return CpuInfo(torch.backends.cpu.get_cpu_capability(), flags, as_avx2)
