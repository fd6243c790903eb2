"""A weight-only int8 matrix product for CPU, compiled once on the machine at hand.

``y = (x @ q.T) * scale`` for x (M, K) in bfloat16 or float32, q (N, K) int8 and scale (N,) in x's dtype,
the contract of ``torch.ops.aten._weight_int8pack_mm``. PyTorch's CPU kernel for that op converts each
int8 weight to bfloat16 and is bound by that conversion, not by memory (its vectorized path is AVX-512
only). Decoding one token reads every weight once, so that kernel sets the decode time. This one widens
16 int8 weights to float32 per instruction (8 in its AVX2 build) and accumulates in float32, on weights
``pack`` lays out in blocks of 8 output channels: each block is one sequential stream, its 8 dot
products share every load of x, and two rows of x (AVX-512; one in the AVX2 build) share every weight
load, the next rows finding the block still in cache. Measurements: ``docs/formats.md``.

It is built from the C++ source below with the system's C++ compiler (``$CXX``, else ``g++`` or ``c++``)
into ``kernels/`` of the cache folder (``$SEMSPEC_CACHE_DIR``, default ``~/.cache/semspec``), keyed by
the source and flags, written atomically, loaded with ctypes; OpenMP threads come from the runtime torch
already loaded (one ``libgomp.so.1``, so the two share a thread pool), as many as
``torch.get_num_threads()``. Where the CPU
lacks AVX2/FMA, no compiler is found or the build fails, ``int8_mm`` returns None (logged once) and
quantized layers keep PyTorch's layout and op: only speed is lost. ``SEMSPEC_INT8_KERNEL`` picks the
build (``auto``, the best the CPU runs; ``avx2`` to measure that build on an AVX-512 CPU) or turns it off
(``0``, to compare); it is read when a model is quantized (a layer packs its weights only for the kernel)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from semspec.models.settings import settings

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# instruction sets the source is built for, best first: compiler flags and the /proc/cpuinfo flags they need
ISAS = {
    "AVX512": (("-mavx512f", "-mavx2", "-mfma"), frozenset({"avx512f", "avx2", "fma"})),
    "AVX2": (("-mavx2", "-mfma"), frozenset({"avx2", "fma"})),
}
PACK = (8, 16)  # the kernel's weight layout: blocks of 8 output channels, chunks of 16 inputs (PJ, PC)

# what every semspec CPU kernel starts with: bfloat16 conversions and the vector type of the build
PRELUDE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
#ifdef __AVX512F__  // 16 float32 lanes
typedef __m512 vec;
enum { LANES = 16 };
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vfloor(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vec vzero_below(vec x, float t, vec y) {  // y where x >= t, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GE_OQ), y);
}
static inline vec load_bf16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vec load_w(const int8_t* p) {  // 16 int8 weights -> 16 float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else  // AVX2: 8 float32 lanes
typedef __m256 vec;
enum { LANES = 8 };
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline float hsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vfloor(vec x) { return _mm256_floor_ps(x); }
static inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vec vzero_below(vec x, float t, vec y) {  // y where x >= t, else 0
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_GE_OQ), y);
}
static inline vec load_bf16(const uint16_t* p) {  // 8 bfloat16 -> 8 float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vec load_w(const int8_t* p) {  // 8 int8 weights -> 8 float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif
"""

SOURCE = (
    PRELUDE
    + r"""

// Packed weights: output channels in blocks of PJ, each block stored as K / PC chunks of PC inputs per
// channel ([N / PJ][K / PC][PJ][PC]), so a block's PJ dot products read one sequential stream. Read as
// plain rows, each thread would follow PJ streams (or one per output) with x reloaded for every row:
// measured on a 2-core AVX512 EPYC, one call of the 1.5B's layers read 14-20 GB/s that way, 23-29 packed.
enum { PJ = 8, PC = 16 };
#ifdef __AVX512F__
enum { PR = 2 };  // rows of x per pass over a block (PR * PJ accumulators: 16 of the 32 vector registers)
#else
enum { PR = 1 };  // 8 of the 16
#endif

// out[r * PJ + j] = dot(x[r, :], channel j of the packed block w) for R rows of x (R, K) float32. Each
// channel sums in the same order whatever R is, so a row's result does not depend on its batch.
template <int R>
static inline void dot_block(const float* x, int64_t K, const int8_t* w, float* out) {
  vec acc[R][PJ];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < PJ; ++j) acc[r][j] = vzero();
  for (int64_t k = 0; k < K; k += PC, w += PJ * PC) {
    for (int c = 0; c < PC; c += LANES) {
      vec xv[R];
      for (int r = 0; r < R; ++r) xv[r] = vload(x + r * K + k + c);
      for (int j = 0; j < PJ; ++j) {
        const vec wv = load_w(w + j * PC + c);
        for (int r = 0; r < R; ++r) acc[r][j] = vfma(wv, xv[r], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < PJ; ++j) out[r * PJ + j] = hsum(acc[r][j]);
}

// y (M, N) = (xf (M, K) @ q^T) * scale (N,) for packed q; store(y, index, value) writes one output
template <typename Scale, typename Store>
static void int8_mm(const float* xf, int64_t M, int64_t K, const int8_t* q, Scale scale, int64_t N,
                    Store store, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < N / PJ; ++b) {
    const int8_t* w = q + b * PJ * K;
    float out[PR * PJ];
    for (int64_t r = 0; r < M; r += PR) {
      const int rows = M - r < PR ? 1 : PR;  // the block stays in cache for the next rows
      if (rows == PR) dot_block<PR>(xf + r * K, K, w, out);
      else dot_block<1>(xf + r * K, K, w, out);
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < PJ; ++j) store((r + i) * N + b * PJ + j, out[i * PJ + j] * scale(b * PJ + j));
    }
  }
}

extern "C" void semspec_int8_mm_bf16(const uint16_t* x, int64_t M, int64_t K, const int8_t* q,
                                     const uint16_t* scales, int64_t N, uint16_t* y, int threads) {
  float* xf = (float*)malloc(sizeof(float) * M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(x[i]);
  int8_mm(xf, M, K, q, [=](int64_t n) { return bf16_to_f32(scales[n]); }, N,
          [=](int64_t i, float v) { y[i] = f32_to_bf16(v); }, threads);
  free(xf);
}

extern "C" void semspec_int8_mm_f32(const float* x, int64_t M, int64_t K, const int8_t* q,
                                    const float* scales, int64_t N, float* y, int threads) {
  int8_mm(x, M, K, q, [=](int64_t n) { return scales[n]; }, N, [=](int64_t i, float v) { y[i] = v; },
          threads);
}
"""
)

_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
_ARGS += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``g++`` or ``c++`` on the PATH."""
    return settings().cxx or shutil.which("g++") or shutil.which("c++")


def isa(flags: frozenset[str], wanted: str = "auto") -> str | None:
    """The best instruction set in ``ISAS`` that CPU ``flags`` allow (``wanted``: ``auto`` or one name of
    ``ISAS``, e.g. AVX2 on an AVX512 CPU to measure that build), or None."""
    names = list(ISAS) if wanted == "auto" else [wanted.upper()]
    if any(n not in ISAS for n in names):
        raise ValueError(
            f"SEMSPEC_INT8_KERNEL must be 0, auto or one of {[n.lower() for n in ISAS]}, got {wanted!r}"
        )
    return next((n for n in names if ISAS[n][1] <= flags), None)


def build(
    cxx: str,
    folder: Path,
    target: str = "AVX2",
    name: str = "int8_mm",
    source: str = SOURCE,
    isa_flags: tuple[str, ...] | None = None,
) -> Path:
    """Compile ``source`` (default: this kernel's) for instruction set ``target`` (a name in ``ISAS``, or
    any name with its compiler flags in ``isa_flags``) with ``cxx`` into ``folder`` as library ``name``
    (once: the file name carries a hash of the source, the flags and the compiler) and return the
    library's path. Raises ``RuntimeError`` with the compiler's message when the build fails."""
    flags = (*FLAGS, *(ISAS[target][0] if isa_flags is None else isa_flags))
    key = hashlib.sha256("\n".join((source, *flags, cxx)).encode()).hexdigest()[:16]
    lib = folder / f"{name}-{target.lower()}-{key}.so"
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = Path(tmp) / f"{name}.cpp", Path(tmp) / lib.name
        src.write_text(source)
        done = subprocess.run([cxx, *flags, str(src), "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build the {name} kernel:\n{done.stderr.strip()[-2000:]}")
        out.replace(lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


def _bind(lib: Path) -> dict[torch.dtype, Callable]:
    dll = ctypes.CDLL(str(lib))
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
    from semspec.models.formats import cpu_info  # the CPU flags are read once, there

    wanted = settings().int8_kernel
    if wanted == "0":
        return None
    target, cxx = isa(cpu_info().flags, wanted), compiler()
    if target is None or cxx is None:
        needs = "AVX2/FMA" if wanted == "auto" else f"what the {wanted} build needs"
        why = f"the CPU lacks {needs}" if target is None else "no C++ compiler ($CXX, g++, c++)"
        log.warning("int8 kernel off (%s): PyTorch's _weight_int8pack_mm decodes, slower", why)
        return None
    try:
        fns = _bind(build(cxx, settings().cache_dir / "kernels", target))
    except (RuntimeError, OSError) as err:
        log.warning("int8 kernel off: %s; PyTorch's _weight_int8pack_mm decodes, slower", err)
        return None

    return _Kernel(fns, target)


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
