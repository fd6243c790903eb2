"""semspec's weight-only int4 matrix product for CPUs, built on first use: an AVX512_BF16 build and an AVX2
build of the same packed weights.

``y = x @ w.T`` for x (M, K) bfloat16 and int4 weights ``w = (q - 8) * scale + zero`` with q in [0, 15]
and one bfloat16 scale and zero per output channel and group of 32 inputs: the int4 format's weights
(``formats.quantize_int4``), the contract of ``torch.ops.aten._weight_int4pack_mm_for_cpu``. PyTorch's
CPU kernel for that op is bound by its instructions, not by memory: it takes about as long as semspec's
int8 kernel for half the bytes (``docs/formats.md``). ``pack`` lays the weights out in blocks of 16
output channels, one channel per lane, so no horizontal sums are needed. Sources: ``csrc/int4.cpp``.

* **AVX512_BF16** (``csrc/int4_bf16.h``): every weight becomes a bfloat16 number with two integer
  instructions per 64 weights (a nibble OR-ed into the bit pattern of 128.0 is 128 + q, exactly),
  multiplied by x with ``vdpbf16ps`` (products exact in float32). Per group it adds ``scale * (sum (128 +
  q) x) + (zero - 136 * scale) * sum x``: the same weights as the dense copy, up to float32 summation
  order.
* **AVX2** (``csrc/int4_avx2.h``; CPUs without AVX-512, or ``SEMSPEC_KERNELS=avx2``): as llama.cpp does
  there, x is quantized per row and group of 32 to int8 (``quantize_activations``) and the products are
  integer (``vpmaddubsw``: 7 instructions per 64 weights and row, where dequantizing to float32 takes
  about 30), scaled per group in float32: exact for those int8 activations up to float32 summation.

Calls of up to 3 rows (decoding) stream each weight once, at the memory bandwidth. Calls of 4 rows or more
(a prompt, a step's verification, a batch) run register tiles of 8 rows that reuse each unpacked weight
vector across the rows: no dense copy of the weights, no dequantization per call (``formats``).

Built and loaded by ``build.load_best`` (the best build the CPU runs, or the one ``SEMSPEC_KERNELS``
names); where none runs or builds, ``int4_mm`` returns None and int4 layers keep PyTorch's op."""

from __future__ import annotations

import ctypes
import functools

import torch

from semspec.models.cpu import build

GROUP = 32  # input channels per scale and zero
BLOCK = 16  # output channels per packed block (one per lane)
ISA = "AVX512_BF16"  # its bfloat16 build (models/cpu/build.py)
ISAS = (ISA, "AVX2")  # the builds, best first
CPU_FLAGS = build.ISAS[ISA][1]  # what the bfloat16 build needs
GEMM_ROWS = 4  # calls of this many rows or more run the kernel's tiles (many rows: no dense copy needed)

SOURCE = "int4.cpp"  # in csrc/

_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
_ARGS += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]


def packable(n: int, k: int) -> bool:
    """Whether an (N, K) int4 weight fits the kernel's layout (N a multiple of 16, K of 32)."""
    return n % BLOCK == 0 and k % GROUP == 0


def pack(q: torch.Tensor, scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of int4 weights: ``q`` (N, K) values in [0, 15] and ``scale_zero`` (K / 32, N,
    2) (``formats.quantize_int4``) -> nibbles (N / 16, K / 32, 8, 32) uint8 and (N / 16, K / 32, 2, 16)
    bfloat16 scales and zeros. Raises ``ValueError`` for a shape that does not fit (see ``packable``)."""
    n, k = q.shape
    if not packable(n, k):
        raise ValueError(f"an int4 weight of shape {(n, k)} cannot be packed: N must divide by 16, K by 32")
    g = k // GROUP
    # (block, c, group, u, half, j): input 32 * group + 4u + 2 * half + j of channel 16 * block + c
    parts = q.to(torch.uint8).reshape(n // BLOCK, BLOCK, g, GROUP // 4, 2, 2).permute(0, 2, 3, 4, 1, 5)
    nibbles = parts[:, :, :, 0] | (parts[:, :, :, 1] << 4)  # (N/16, G, 8, 16, 2): byte 2c + j
    sz = scale_zero.to(torch.bfloat16).reshape(g, n // BLOCK, BLOCK, 2).permute(1, 0, 3, 2)
    return nibbles.reshape(n // BLOCK, g, GROUP // 4, 2 * BLOCK).contiguous(), sz.contiguous()


def unpack(nibbles: torch.Tensor, sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack``'s inverse: -> q (N, K) int32 in [0, 15] and (K / 32, N, 2) scales and zeros (bfloat16)."""
    nb, g = nibbles.shape[:2]
    parts = nibbles.reshape(nb, g, GROUP // 4, BLOCK, 2)  # (block, group, u, c, j)
    both = torch.stack([parts & 0x0F, parts >> 4], dim=3)  # (block, group, u, half, c, j)
    q = both.permute(0, 4, 1, 2, 3, 5).reshape(nb * BLOCK, g * GROUP).to(torch.int32)
    return q, sz.permute(1, 0, 3, 2).reshape(g, nb * BLOCK, 2)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the AVX2 build reads it, float32: per row and group of 32, ``d = max|x| / 127`` and
    ``round_half_even(x * (1 / d)) * d`` (llama.cpp's Q8 activations), each step in float32 as the kernel
    does it. Tests compare that build with the product of these and the int4 weights."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)  # (M, G, 32)
    d = g.abs().amax(-1) / 127  # (M, G)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(g * inv[..., None]) * d[..., None]).reshape(m, k)


def describe() -> str:
    """Which kernel decodes int4 here, for a person reading a figure."""
    kernel = int4_mm()
    if kernel is None:
        return "int4 calls: PyTorch's _weight_int4pack_mm_for_cpu"
    how = "" if kernel.isa == ISA else ", int8 activations per 32"
    return f"int4 calls: semspec's int4 kernel ({kernel.isa}{how}, packed weights)"


class _Kernel:
    """The built kernel: ``kernel(x, nibbles, scales_zeros)`` for ``pack``'s tensors; ``isa`` names the
    build (``AVX512_BF16`` or ``AVX2``)."""

    def __init__(self, fn: ctypes._CFuncPtr, isa: str) -> None:
        self.fn, self.isa = fn, isa

    def __call__(self, x: torch.Tensor, nibbles: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """``x (M, K) @ w.T`` -> (M, N) bfloat16, for x bfloat16 and contiguous on the CPU."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or nibbles.dim() != 4 or nibbles.shape[1] * GROUP != k:
            raise ValueError(
                f"the int4 kernel takes bfloat16 x and weights from pack() for K={k}, got {x.dtype} and "
                f"shape {tuple(nibbles.shape)}"
            )
        n = nibbles.shape[0] * BLOCK
        y = torch.empty(m, n, dtype=torch.bfloat16)  # (M, N)
        self.fn(
            x.data_ptr(), m, k, nibbles.data_ptr(), sz.data_ptr(), n, y.data_ptr(), torch.get_num_threads()
        )
        return y


@functools.cache
def int4_mm() -> _Kernel | None:
    """The kernel's best build here (AVX512_BF16, else AVX2), or None where it is off
    (``SEMSPEC_KERNELS=off``), the CPU lacks AVX2/FMA or no compiler builds it (then PyTorch's
    ``_weight_int4pack_mm_for_cpu`` serves). Built once per process."""
    # no warning where the CPU lacks AVX2: the int8 kernel says so, and int4 runs PyTorch's op
    got = build.load_best("int4_mm", SOURCE, ISAS, "int4", "PyTorch's int4 op decodes", warn_missing=False)
    if got is None:
        return None
    fn = got[0].semspec_int4_mm_bf16
    fn.argtypes, fn.restype = _ARGS, None
    return _Kernel(fn, got[1])
