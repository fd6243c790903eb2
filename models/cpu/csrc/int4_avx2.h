// semspec's int4 matrix product for AVX2 CPUs (no AVX-512, no native bfloat16): y (M, N) = x (M, K) @ w^T
// on the same packed int4 weights as the AVX512_BF16 build (int4_kernel.pack(): blocks of 16 output
// channels, per group of 32 inputs 8 chunks of 32 bytes, byte 2c + j of chunk u holding channel c's inputs
// 4u + j (low nibble) and 4u + 2 + j (high nibble); per group 16 bfloat16 scales, then 16 zeros).
//
// As llama.cpp does on AVX2, the activations are quantized per row and group of 32 to int8 (d = max|x| /
// 127, xq = round(x / d)) and each product is integer: a chunk's low and high nibbles are two vectors of
// 32 unsigned bytes whose byte pairs (2c, 2c + 1) are one channel's two inputs, so vpmaddubsw with the
// row's two int8 inputs broadcast gives each channel's two products summed, one int16 lane per channel:
// 7 instructions per 64 weights and row, where dequantizing to float32 takes about 30. Four chunks sum in
// int16 (at most 4 * 2 * 2 * 15 * 127 = 30480), then in float32: per group scale * d * sum(q xq) +
// (zero - 8 scale) * d * sum(xq). The result is exact for the int8 activations up to float32 summation.
//
// Each block of 16 channels runs tiles of up to 3 rows (decoding: the weights streamed once per call) or 8
// (a prompt, a step's verification: each chunk's nibbles split once for 8 rows, the block then in cache).
#pragma once
#include <math.h>

#include <vector>

#include "simd.h"

enum { GROUP = 32, BLOCK = 16, CHUNKS = GROUP / 4, RMAX = 3, PREFETCH = 2048, TILE_ROWS = 8, GEMM_ROWS = 4 };

// A call's activations as the kernel reads them: per row and group of 32, int8 values xq, their scale d
// and d * sum(xq) (what the zero term multiplies)
struct Int4Input {
  std::vector<int8_t> q;  // (M, K)
  std::vector<float> d, sums;  // (M, K / GROUP)
  Int4Input(const float* xf, int64_t M, int64_t K) : q(M * K), d(M * (K / GROUP)), sums(M * (K / GROUP)) {
    quantize(xf, M, K);
  }
  Int4Input(const uint16_t* xb, int64_t M, int64_t K) : q(M * K), d(M * (K / GROUP)), sums(M * (K / GROUP)) {
    std::vector<float> xf(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(xb[i]);
    quantize(xf.data(), M, K);
  }

 private:
  // d = max|x| / 127 and xq = round-half-even(x * (1 / d)), in float32 (int4_kernel.quantize_activations
  // computes the same in torch)
  void quantize(const float* x, int64_t M, int64_t K) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < M * K / GROUP; ++i) {
      const float* xg = x + i * GROUP;
      __m256 m = _mm256_setzero_ps();
      for (int k = 0; k < GROUP; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + k)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h), di = amax / 127.0f, inv = di > 0.0f ? 1.0f / di : 0.0f;
      int32_t total = 0;
      for (int k = 0; k < GROUP; k += 8) {
        const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + k), _mm256_set1_ps(inv)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i iv = _mm256_cvtps_epi32(v);  // within [-127, 127]
        alignas(32) int32_t lanes[8];
        _mm256_store_si256((__m256i*)lanes, iv);
        for (int j = 0; j < 8; ++j) {
          q[i * GROUP + k + j] = (int8_t)lanes[j];
          total += lanes[j];
        }
      }
      d[i] = di;
      sums[i] = di * (float)total;
    }
  }
};

// the int16 lanes of a (one per channel, 16 channels) as two float32 vectors, channels 0-7 and 8-15
static inline void widen(__m256i a, __m256& lo, __m256& hi) {
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
}

// xq[k], xq[k + 1] in every int16 lane
static inline __m256i pair(const int8_t* p) {
  int16_t v;
  memcpy(&v, p, 2);
  return _mm256_set1_epi16(v);
}

// one chunk's products for one row: each channel's sum over the chunk's 4 inputs, in its int16 lane
static inline __m256i chunk_dot(__m256i lo, __m256i hi, const int8_t* xq) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, pair(xq)), _mm256_maddubs_epi16(hi, pair(xq + 2)));
}

// the per-channel scale s and zero term m = zero - 8 s of one group, channels 0-7 and 8-15
struct GroupScales {
  __m256 s0, s1, m0, m1;
  explicit GroupScales(const uint16_t* sz) {
    s0 = load_bf16(sz), s1 = load_bf16(sz + 8);
    m0 = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s0, load_bf16(sz + BLOCK));
    m1 = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s1, load_bf16(sz + BLOCK + 8));
  }
};

// acc (R, 16) float32 = R rows (from row0) times one block of packed weights, all groups: per chunk the
// nibbles are split once and multiplied by every row; each row's int16 sums go to acc (in L1) per 4 chunks
template <int R>
static inline void tile(const Int4Input& in, int64_t row0, int64_t K, const uint8_t* q, const uint16_t* sz,
                        float* acc) {
  const int64_t G = K / GROUP;
  const __m256i nib = _mm256_set1_epi8(0x0f);
  for (int i = 0; i < R * BLOCK; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
  for (int64_t g = 0; g < G; ++g, q += GROUP * BLOCK / 2, sz += 2 * BLOCK) {
    const GroupScales sc(sz);
    for (int half = 0; half < 2; ++half) {
      __m256i a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_si256();
      for (int u = 4 * half; u < 4 * half + 4; ++u) {
        // 2 KB ahead, a cache line per 2 chunks (decoding streams the weights)
        if ((u & 1) == 0) _mm_prefetch((const char*)(q + 32 * u + PREFETCH), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256((const __m256i*)(q + 32 * u));
        const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
        for (int r = 0; r < R; ++r)
          a[r] = _mm256_add_epi16(a[r], chunk_dot(lo, hi, in.q.data() + (row0 + r) * K + g * GROUP + 4 * u));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 sd = _mm256_set1_ps(in.d[(row0 + r) * G + g]);
        __m256 f0, f1;
        widen(a[r], f0, f1);
        float* o = acc + r * BLOCK;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_mul_ps(sc.s0, sd), f0, _mm256_loadu_ps(o)));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_mul_ps(sc.s1, sd), f1, _mm256_loadu_ps(o + 8)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_set1_ps(in.sums[(row0 + r) * G + g]);
      float* o = acc + r * BLOCK;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(sc.m0, xs, _mm256_loadu_ps(o)));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(sc.m1, xs, _mm256_loadu_ps(o + 8)));
    }
  }
}

static inline void tile_rows(const Int4Input& in, int64_t row0, int64_t rows, int64_t K, const uint8_t* q,
                             const uint16_t* sz, float* acc) {
  switch (rows) {
    case 1: tile<1>(in, row0, K, q, sz, acc); break;
    case 2: tile<2>(in, row0, K, q, sz, acc); break;
    case 3: tile<3>(in, row0, K, q, sz, acc); break;
    case 4: tile<4>(in, row0, K, q, sz, acc); break;
    case 5: tile<5>(in, row0, K, q, sz, acc); break;
    case 6: tile<6>(in, row0, K, q, sz, acc); break;
    case 7: tile<7>(in, row0, K, q, sz, acc); break;
    default: tile<8>(in, row0, K, q, sz, acc); break;
  }
}

// out (rows, BLOCK) = rows r.. of the input times block b of packed weights (q, sz), rows <= RMAX
static inline void block_rows(const Int4Input& in, int64_t r, int64_t rows, int64_t K, const uint8_t* q,
                              const uint16_t* sz, int64_t b, float* out) {
  const int64_t G = K / GROUP;
  const uint8_t* qb = q + b * K * BLOCK / 2;
  const uint16_t* szb = sz + b * G * 2 * BLOCK;
  tile_rows(in, r, rows, K, qb, szb, out);
}

// y (M, N) for many rows: each thread takes blocks and runs every tile of up to 8 rows over each, so a
// block's weights are read from memory once per call (then from cache)
template <typename Store>
static void int4_gemm(const Int4Input& in, int64_t M, int64_t K, const uint8_t* q, const uint16_t* sz,
                      int64_t N, Store store, int threads) {
  const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < N / BLOCK; ++b) {
    alignas(32) float acc[TILE_ROWS * BLOCK];
    const uint8_t* qb = q + b * K * BLOCK / 2;
    const uint16_t* szb = sz + b * G * 2 * BLOCK;
    for (int64_t r = 0; r < M; r += TILE_ROWS) {
      const int64_t rows = M - r < TILE_ROWS ? M - r : TILE_ROWS;
      tile_rows(in, r, rows, K, qb, szb, acc);
      for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < BLOCK; ++c) store((r + i) * N + b * BLOCK + c, acc[i * BLOCK + c]);
    }
  }
}
