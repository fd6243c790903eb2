// semspec's int4 matrix product for CPUs with AVX512_BF16: y (M, N) = x (M, K) @ w^T, x bfloat16, int4
// weights w = (q - 8) * scale + zero (q in [0, 15], one bfloat16 scale and zero per output channel and
// group of 32 inputs) in the layout int4_kernel.pack() writes: blocks of 16 output channels, one channel
// per float32 lane. Each weight becomes a bfloat16 number with two integer instructions per 64 weights (a
// nibble OR-ed into the bit pattern of 128.0 is 128 + q, exactly) and is multiplied by x with vdpbf16ps
// (products exact in float32); per group the sum is scaled: scale * sum((128 + q) x) + (zero - 136 scale)
// * sum(x). Few rows (decoding) stream the weights once at the memory bandwidth (block<R>); many rows (a
// prompt, a step's verification) run a register tile of 8 rows x 32 channels (tile<R, NB>) that reuses
// each dequantized weight across the rows, so no dense copy of the weights is needed for them.
#pragma once
#include <vector>

#include "simd.h"

enum { GROUP = 32, BLOCK = 16, CHUNKS = GROUP / 4, RMAX = 4, PREFETCH = 2048, TILE_ROWS = 8, GEMM_ROWS = 4 };

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
      // 2 KB ahead, a cache line per 2 chunks: on some CPUs the hardware prefetcher alone does not keep
      // this loop at the memory bandwidth (figures per CPU kind: docs/formats.md)
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

// A call's activations as the kernel reads them: x (M, K) bfloat16 and its group sums
struct Int4Input {
  std::vector<uint16_t> own;  // x rounded to bfloat16, when it came as float32
  const uint16_t* x;
  std::vector<float> sums;  // (M, K / GROUP)
  Int4Input(const uint16_t* xb, int64_t M, int64_t K) : x(xb), sums(M * (K / GROUP)) {
    group_sums(x, M, K, sums.data());
  }
  Int4Input(const float* xf, int64_t M, int64_t K) : own(M * K), x(nullptr), sums(M * (K / GROUP)) {
    for (int64_t i = 0; i < M * K; ++i) own[i] = f32_to_bf16(xf[i]);
    x = own.data();
    group_sums(x, M, K, sums.data());
  }
};

// out (rows, BLOCK) = rows of x (M, K) from r times block b of packed weights (q, sz), rows <= RMAX
static inline void block_rows(const Int4Input& in, int64_t r, int64_t rows, int64_t K, const uint8_t* q,
                              const uint16_t* sz, int64_t b, float* out) {
  const int64_t G = K / GROUP;
  const uint16_t* x = in.x;
  const float* xsum = in.sums.data();
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

static inline __m512bh bcast_pair(const uint16_t* p) {  // x[k], x[k + 1] in every 32-bit lane
  int32_t v;
  memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// acc (R, NB * 16) float32 = R rows of x (R, K) times NB consecutive blocks of packed weights, all groups.
// Per group each (row, block) sums in a register (2 R NB of them, with 2 NB dequantized weight vectors
// per 4 inputs); the scaled sum goes to acc, which stays in L1.
template <int R, int NB>
static inline void tile(const uint16_t* x, int64_t K, const uint8_t* q, const uint16_t* sz,
                        const float* xsum, int64_t G, float* acc) {
  const __m512i low = _mm512_set1_epi16(0x000f), one28 = _mm512_set1_epi16(0x4300);
  const int64_t qstride = K * BLOCK / 2, sstride = G * 2 * BLOCK;  // per block
  for (int i = 0; i < R * NB * BLOCK; i += BLOCK) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m512 a[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) a[r][b] = _mm512_setzero_ps();
    for (int u = 0; u < CHUNKS; ++u) {
      __m512bh lo[NB], hi[NB];
      for (int b = 0; b < NB; ++b) {
        const uint8_t* qu = q + b * qstride + g * GROUP * BLOCK / 2 + 32 * u;
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)qu));
        lo[b] = (__m512bh)_mm512_ternarylogic_epi32(w, low, one28, 0xEA);  // (w & 0xf) | 0x4300
        hi[b] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), one28);
      }
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * K + g * GROUP + 4 * u;
        const __m512bh x0 = bcast_pair(xr), x1 = bcast_pair(xr + 2);
        for (int b = 0; b < NB; ++b) {
          a[r][b] = _mm512_dpbf16_ps(a[r][b], lo[b], x0);
          a[r][b] = _mm512_dpbf16_ps(a[r][b], hi[b], x1);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint16_t* s16 = sz + b * sstride + g * 2 * BLOCK;
      const __m512 s = load_bf16x16(s16), z = load_bf16x16(s16 + BLOCK);
      const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), s, z);  // zero - (128 + 8) * scale
      for (int r = 0; r < R; ++r) {
        float* o = acc + (r * NB + b) * BLOCK;
        __m512 v = _mm512_fmadd_ps(s, a[r][b], _mm512_loadu_ps(o));
        v = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), v);
        _mm512_storeu_ps(o, v);
      }
    }
  }
}

template <int NB>
static inline void tile_rows(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* q, const uint16_t* sz,
                             const float* xsum, int64_t G, float* acc) {
  switch (rows) {
    case 1: tile<1, NB>(x, K, q, sz, xsum, G, acc); break;
    case 2: tile<2, NB>(x, K, q, sz, xsum, G, acc); break;
    case 3: tile<3, NB>(x, K, q, sz, xsum, G, acc); break;
    case 4: tile<4, NB>(x, K, q, sz, xsum, G, acc); break;
    case 5: tile<5, NB>(x, K, q, sz, xsum, G, acc); break;
    case 6: tile<6, NB>(x, K, q, sz, xsum, G, acc); break;
    case 7: tile<7, NB>(x, K, q, sz, xsum, G, acc); break;
    default: tile<8, NB>(x, K, q, sz, xsum, G, acc); break;
  }
}

// y (M, N) for many rows: each thread takes pairs of blocks (32 channels; the last may be one block) and
// runs every tile of up to 8 rows over them, so a pair's weights are read from memory once per call
template <typename Store>
static void int4_gemm(const Int4Input& in, int64_t M, int64_t K, const uint8_t* q, const uint16_t* sz,
                      int64_t N, Store store, int threads) {
  const uint16_t* x = in.x;
  const float* xsum = in.sums.data();
  const int64_t G = K / GROUP, blocks = N / BLOCK, pairs = (blocks + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < pairs; ++p) {
    alignas(64) float acc[TILE_ROWS * 2 * BLOCK];
    const int nb = 2 * p + 1 < blocks ? 2 : 1;
    const uint8_t* qp = q + 2 * p * K * BLOCK / 2;
    const uint16_t* sp = sz + 2 * p * G * 2 * BLOCK;
    for (int64_t r = 0; r < M; r += TILE_ROWS) {
      const int64_t rows = M - r < TILE_ROWS ? M - r : TILE_ROWS;
      if (nb == 2)
        tile_rows<2>(x + r * K, rows, K, qp, sp, xsum + r * G, G, acc);
      else
        tile_rows<1>(x + r * K, rows, K, qp, sp, xsum + r * G, G, acc);
      for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < nb * BLOCK; ++c) store((r + i) * N + 2 * p * BLOCK + c, acc[i * nb * BLOCK + c]);
    }
  }
}
