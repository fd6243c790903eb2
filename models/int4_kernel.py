"""A weight-only int4 matrix product for CPUs with native bfloat16 (AVX512_BF16), compiled once here.

``y = x @ w.T`` for x (M, K) bfloat16 and int4 weights ``w = (q - 8) * scale + zero`` with q in [0, 15]
and one bfloat16 scale and zero per output channel and group of 32 inputs: the int4 format's weights
(``formats.quantize_int4``), the contract of ``torch.ops.aten._weight_int4pack_mm_for_cpu``. PyTorch's
CPU kernel for that op is bound by its instructions, not by memory: it takes about as long as semspec's
int8 kernel for half the bytes (``docs/formats.md``). This one makes every weight a bfloat16 number with two integer instructions
per 64 weights (a nibble OR-ed into the bit pattern of 128.0 is 128 + q, exactly) and multiplies them
by x with ``vdpbf16ps`` (products exact in float32, sums in float32), on weights ``pack`` lays out in
blocks of 16 output channels, one channel per float32 lane, so no horizontal sums are needed. Per group
it adds ``scale * (sum (128 + q) x) + (zero - 136 * scale) * sum x``: the same weights as the dense copy,
up to float32 summation order.

Built like the int8 kernel (``int8_kernel.build``: the system's C++ compiler, once per source and flags,
into the cache folder); where the CPU lacks AVX512_BF16 or the build fails, ``int4_mm`` returns None and
int4 layers keep PyTorch's op. ``SEMSPEC_INT8_KERNEL=0`` turns it off too (one switch for semspec's
kernels)."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from semspec.models import int8_kernel
from semspec.models.settings import settings

log = logging.getLogger(__name__)

GROUP = 32  # input channels per scale and zero
BLOCK = 16  # output channels per packed block (one per float32 lane of a 512-bit vector)
ISA = "AVX512_BF16"
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
MAX_ROWS = 4  # rows of x per pass over a block (2 accumulators each)

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GROUP = 32, BLOCK = 16, CHUNKS = GROUP / 4, RMAX = 4, PREFETCH = 2048 };

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One block of 16 output channels for R rows of x (R, K) bfloat16. q: the block's nibbles, per group 8
// chunks of 32 bytes, byte 2c + j of chunk u holding channel c's inputs 4u + j (low nibble) and 4u + 2 + j
// (high nibble); sz: per group 16 scales then 16 zeros (bfloat16); xsum (R, G): each group's sum of x.
template <int R>
static inline void block(const uint16_t* x, int64_t K, const uint8_t* q, const uint16_t* sz,
                         const float* xsum, int64_t G, float* out) {
  const __m512i low = _mm512_set1_epi16(0x000f), one28 = _mm512_set1_epi16(0x4300);  // 0x4300: 128.0
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, q += GROUP * BLOCK / 2, sz += 2 * BLOCK) {
    // independent sums: one chain of vdpbf16ps would wait on its latency; few rows give few chains
    constexpr int NC = R == 1 ? 4 : (R == 2 ? 2 : 1);
    __m512 a[R][NC];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NC; ++i) a[r][i] = _mm512_setzero_ps();
    for (int u = 0; u < CHUNKS; ++u) {
      // 2 KB ahead, a cache line per 2 chunks: on a 2-core Sapphire Rapids-class Xeon the hardware
      // prefetcher alone streamed ~8 GB/s into this loop (0.72 ms per 1536 -> 8960 call), with it 0.35
      if ((u & 1) == 0) _mm_prefetch((const char*)(q + 32 * u + PREFETCH), _MM_HINT_T0);
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + 32 * u)));  // 32 bytes
      // 128 + q as bfloat16: (w & 0xf) | 0x4300 and (w >> 4) | 0x4300
      const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, low, one28, 0xEA);  // (a & b) | c
      const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), one28);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * K + g * GROUP + 4 * u;
        int32_t p0, p1;
        memcpy(&p0, xr, 4);
        memcpy(&p1, xr + 2, 4);
        const int i = NC == 4 ? 2 * (u & 1) : 0, j = NC == 1 ? i : i + 1;
        a[r][i] = _mm512_dpbf16_ps(a[r][i], lo, (__m512bh)_mm512_set1_epi32(p0));
        a[r][j] = _mm512_dpbf16_ps(a[r][j], hi, (__m512bh)_mm512_set1_epi32(p1));
      }
    }
    _mm_prefetch((const char*)sz + PREFETCH / 4, _MM_HINT_T0);  // scales advance 64 B per 256 B of q
    const __m512 s = load_bf16x16(sz), z = load_bf16x16(sz + BLOCK);
    const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), s, z);  // zero - (128 + 8) * scale
    for (int r = 0; r < R; ++r) {
      __m512 sum = a[r][0];
      for (int i = 1; i < NC; ++i) sum = _mm512_add_ps(sum, a[r][i]);
      acc[r] = _mm512_fmadd_ps(s, sum, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * BLOCK, acc[r]);
}

// each row's sum over each group of x (M, K) bfloat16 -> xsum (M, K / GROUP)
static void group_sums(const uint16_t* x, int64_t M, int64_t K, float* xsum) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int k = 0; k < GROUP; ++k) s += bf16_to_f32(x[r * K + g * GROUP + k]);
      xsum[r * G + g] = s;
    }
}

// out (rows, BLOCK) = rows of x (M, K) from r times block b of packed weights (q, sz), rows <= RMAX
static inline void block_rows(const uint16_t* x, int64_t r, int64_t rows, int64_t K, const uint8_t* q,
                              const uint16_t* sz, const float* xsum, int64_t b, float* out) {
  const int64_t G = K / GROUP;
  const uint8_t* qb = q + b * K * BLOCK / 2;
  const uint16_t* szb = sz + b * G * 2 * BLOCK;
  const uint16_t* xr = x + r * K;
  const float* sr = xsum + r * G;
  switch (rows) {
    case 1: block<1>(xr, K, qb, szb, sr, G, out); break;
    case 2: block<2>(xr, K, qb, szb, sr, G, out); break;
    case 3: block<3>(xr, K, qb, szb, sr, G, out); break;
    default: block<4>(xr, K, qb, szb, sr, G, out); break;
  }
}

// y (M, N) = x (M, K) @ w^T for packed int4 w, x bfloat16 with its group sums; store(y index, value)
template <typename Store>
static void int4_mm(const uint16_t* x, const float* xsum, int64_t M, int64_t K, const uint8_t* q,
                    const uint16_t* sz, int64_t N, Store store, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < N / BLOCK; ++b) {
    float out[RMAX * BLOCK];
    for (int64_t r = 0; r < M; r += RMAX) {
      const int64_t rows = M - r < RMAX ? M - r : RMAX;
      block_rows(x, r, rows, K, q, sz, xsum, b, out);
      for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < BLOCK; ++c) store((r + i) * N + b * BLOCK + c, out[i * BLOCK + c]);
    }
  }
}

extern "C" void semspec_int4_mm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint8_t* q,
                                     const uint16_t* sz, int64_t N, uint16_t* y, int threads) {
  float* xsum = (float*)malloc(sizeof(float) * M * (K / GROUP));
  group_sums(x, M, K, xsum);
  int4_mm(x, xsum, M, K, q, sz, N, [=](int64_t i, float v) { y[i] = f32_to_bf16(v); }, threads);
  free(xsum);
}
"""

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


def describe() -> str:
    """Which kernel decodes int4 here, for a person reading a figure."""
    if int4_mm() is None:
        return "int4 calls: PyTorch's _weight_int4pack_mm_for_cpu"
    return f"int4 calls: semspec's int4 kernel ({ISA}, packed weights)"


class _Kernel:
    """The built kernel: ``kernel(x, nibbles, scales_zeros)`` for ``pack``'s tensors."""

    def __init__(self, fn: ctypes._CFuncPtr) -> None:
        self.fn, self.isa = fn, ISA

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
    """The kernel, or None where it is off (``SEMSPEC_INT8_KERNEL=0``), the CPU lacks AVX512_BF16 or no
    compiler builds it (then PyTorch's ``_weight_int4pack_mm_for_cpu`` serves). Built once per process."""
    from semspec.models.formats import cpu_info  # the CPU flags are read once, there

    if settings().int8_kernel == "0" or not CPU_FLAGS.issubset(cpu_info().flags):
        return None
    cxx = int8_kernel.compiler()
    if cxx is None:
        log.warning("int4 kernel off (no C++ compiler): PyTorch's int4 op decodes, slower")
        return None
    try:
        lib = int8_kernel.build(cxx, settings().cache_dir / "kernels", ISA, "int4_mm", SOURCE, FLAGS)
        dll = ctypes.CDLL(str(lib))
    except (RuntimeError, OSError) as err:
        log.warning("int4 kernel off: %s; PyTorch's int4 op decodes, slower", err)
        return None
    fn = dll.semspec_int4_mm_bf16
    fn.argtypes, fn.restype = _ARGS, None
    return _Kernel(fn)
