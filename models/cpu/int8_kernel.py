"""A weight-only int8 matrix product for CPU, compiled once on the machine at hand.

``y = (x @ q.T) * scale`` for x (M, K) in bfloat16 or float32, q (N, K) int8 and scale (N,) in x's dtype,
the contract of ``torch.ops.aten._weight_int8pack_mm``. PyTorch's CPU kernel for that op converts each
int8 weight to bfloat16 and is bound by that conversion, not by memory (its vectorized path is AVX-512
only). Decoding one token reads every weight once, so that kernel sets the decode time. This one widens
16 int8 weights to float32 per instruction (8 in its AVX2 build) and accumulates in float32, on weights
``pack`` lays out in blocks of 8 output channels: each block is one sequential stream, its 8 dot
products share every load of x, and two rows of x (AVX-512; one in the AVX2 build) share every weight
load. Calls of 3 rows or more run register tiles (3 rows share each widened weight vector) over chunks of
rows that stay in cache, so no call needs a dense copy of the weights; every output sums in the same
order either way (a row's result does not depend on its batch). Measurements: ``docs/formats.md``.

Its source is ``csrc/int8.cpp``, built for AVX-512 or AVX2 and loaded by ``build.load`` (the
best build the CPU runs, or the one ``SEMSPEC_KERNELS`` names). Where the CPU lacks AVX2/FMA, no compiler
is found, the build fails or ``SEMSPEC_KERNELS=off``, ``int8_mm`` returns None (logged once) and
quantized layers keep PyTorch's layout and op: only speed is lost. The switch is read when a model is
quantized (a layer packs its weights only for the kernel)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from semspec.models.cpu import build

SOURCE = "int8.cpp"  # in csrc/
ISAS = ("AVX512", "AVX2")  # the builds, best first (models/cpu/build.py)
PACK = (8, 16)  # the kernel's weight layout: blocks of 8 output channels, chunks of 16 inputs (PJ, PC)

_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
_ARGS += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]


def _bind(dll: ctypes.CDLL) -> dict[torch.dtype, Callable]:
    fns = {torch.bfloat16: dll.semspec_int8_mm_bf16, torch.float32: dll.semspec_int8_mm_f32}
    for fn in fns.values():
        fn.argtypes, fn.restype = _ARGS, None
    return fns


def describe() -> str:
    """Which kernel decodes int8 here, for a person reading a figure."""
    kernel = int8_mm()
    if kernel is None:
        return "int8 calls: PyTorch's _weight_int8pack_mm"
    return f"int8 calls: semspec's int8 kernel ({kernel.isa}, packed weights)"


@functools.cache
def int8_mm() -> _Kernel | None:
    """The kernel as ``f(x (M, K), q (N, K) int8, scales (N,)) -> (M, N)`` in x's dtype (bfloat16 or
    float32; every tensor contiguous on the CPU), or None where it is off or cannot be built here (then
    PyTorch's ``_weight_int8pack_mm`` serves). Built and loaded once per process."""
    got = build.load_best("int8_mm", SOURCE, ISAS, "int8", "PyTorch's _weight_int8pack_mm decodes")
    return None if got is None else _Kernel(_bind(got[0]), got[1])


class _Kernel:
    """The built kernel: ``kernel(x, packed q, scales)``; ``isa`` names the instruction set it was built
    for."""

    def __init__(self, fns: dict[torch.dtype, Callable], isa: str) -> None:
        self.fns, self.isa = fns, isa

    def __call__(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``(x (M, K) @ unpack(q).T) * scales`` in x's dtype, for ``q`` from ``pack``."""
        m, k = x.shape
        if q.dim() != 4 or q.shape[1] * q.shape[3] != k:
            raise ValueError(
                f"the int8 kernel takes weights from pack() for K={k}, got shape {tuple(q.shape)}"
            )
        n = q.shape[0] * q.shape[2]
        y = torch.empty(m, n, dtype=x.dtype)  # (M, N)
        threads = torch.get_num_threads()
        self.fns[x.dtype](x.data_ptr(), m, k, q.data_ptr(), scales.data_ptr(), n, y.data_ptr(), threads)
        return y


def packable(n: int, k: int) -> bool:
    """Whether an (N, K) weight fits the kernel's layout (N a multiple of 8, K of 16)."""
    return n % PACK[0] == 0 and k % PACK[1] == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> (N / 8, K / 16, 8, 16): the kernel's layout, where each block of 8 output channels
    is one sequential stream. Raises ``ValueError`` for a shape that does not fit (see ``packable``)."""
    n, k = q.shape
    if not packable(n, k):
        raise ValueError(f"an int8 weight of shape {(n, k)} cannot be packed: N must divide by 8, K by 16")
    j, c = PACK
    return q.reshape(n // j, j, k // c, c).transpose(1, 2).contiguous()


def unpack(q: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: (N / 8, K / 16, 8, 16) -> (N, K), a new tensor."""
    nb, kb, j, c = q.shape
    return q.transpose(1, 2).reshape(nb * j, kb * c)
