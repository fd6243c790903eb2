// semspec's weight-only int8 matrix product: y (M, N) = (x (M, K) @ q^T) * scale (N,), on weights packed
// by int8_kernel.pack(). Built for AVX-512 or AVX2 (simd.h).
#include "simd.h"

// Packed weights: output channels in blocks of PJ, each block stored as K / PC chunks of PC inputs per
// channel ([N / PJ][K / PC][PJ][PC]), so a block's PJ dot products read one sequential stream. Read as
// plain rows, each thread would follow PJ streams (or one per output) with x reloaded for every row,
// reading the weights well below the memory bandwidth (figures per CPU kind: docs/formats.md).
enum { PJ = 8, PC = 16 };
#ifdef __AVX512F__
enum { PR = 2 };  // rows of x per streaming pass over a block (PR * PJ accumulators: 16 of the 32 vector registers)
enum { TR = 3, TJ = 8 };  // a many-row tile: 3 rows by 8 channels (24 accumulators, 3 rows of x, 1 weight)
#else
enum { PR = 1 };  // 8 of the 16
enum { TR = 3, TJ = 4 };  // 3 rows by 4 channels: 12 accumulators, 3 rows of x and 1 weight fill the 16
#endif
// Calls of TILE_MIN rows or more run tiles: each int8 weight vector, widened to float32 once, serves TR rows
// (streaming widens it once per row, which bounds many-row calls by the widening, not by the FMAs)
enum { TILE_MIN = TR };

// out[r * PJ + j0 + j] = dot(x[r, :], channel j0 + j of the packed block w) for R rows of x (R, K) float32
// and J channels from j0. Every (row, channel) sums in one accumulator, lane by lane over the chunks, then
// across its lanes: the same order whatever R, J and j0 are, so a row's result does not depend on its
// batch, nor on whether its call streamed or ran tiles.
template <int R, int J>
static inline void dot_tile(const float* x, int64_t K, const int8_t* w, int j0, float* out) {
  vec acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = vzero();
  for (int64_t k = 0; k < K; k += PC, w += PJ * PC) {
    for (int c = 0; c < PC; c += LANES) {
      vec xv[R];
      for (int r = 0; r < R; ++r) xv[r] = vload(x + r * K + k + c);
      for (int j = 0; j < J; ++j) {
        const vec wv = load_w(w + (j0 + j) * PC + c);
        for (int r = 0; r < R; ++r) acc[r][j] = vfma(wv, xv[r], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) out[r * PJ + j0 + j] = hsum(acc[r][j]);
}

// out (R, PJ) = R rows of x times every channel of block w, in tiles of TJ channels
template <int R>
static inline void tile_block(const float* x, int64_t K, const int8_t* w, float* out) {
  for (int j0 = 0; j0 < PJ; j0 += TJ) dot_tile<R, TJ>(x, K, w, j0, out);
}

// Many-row calls take x in chunks of rows that stay in a core's L2 (CHUNK_BYTES, at least TR rows): every
// block of weights runs over one chunk before the next chunk starts, so x comes from memory once per call
// and the weights once per chunk (a few MB per call), where running every row over each block would read
// all of x again for each of the N / PJ blocks (GBs per call for a prompt of a few hundred rows).
enum { CHUNK_BYTES = 512 * 1024 };

// y (M, N) = (xf (M, K) @ q^T) * scale (N,) for packed q; store(y, index, value) writes one output. Each
// thread takes blocks of PJ channels: fewer than TILE_MIN rows stream each block (PR rows per pass), more
// run tiles of TR rows over it, chunk by chunk of rows, the block then coming from cache. No call makes a
// dense copy of the weights.
template <typename Scale, typename Store>
static void int8_mm(const float* xf, int64_t M, int64_t K, const int8_t* q, Scale scale, int64_t N,
                    Store store, int threads) {
  const int64_t fit = CHUNK_BYTES / (int64_t)(sizeof(float) * K) / TR * TR;
  const int64_t chunk = M < TILE_MIN ? M : (fit > TR ? fit : TR);
#pragma omp parallel num_threads(threads)
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t r1 = M - r0 < chunk ? M : r0 + chunk;
#pragma omp for schedule(static) nowait
    for (int64_t b = 0; b < N / PJ; ++b) {
      const int8_t* w = q + b * PJ * K;
      float out[(TR > (int)PR ? TR : (int)PR) * PJ];
      for (int64_t r = r0; r < r1;) {
        int rows;
        if (M >= TILE_MIN && r1 - r >= TR) {
          rows = TR;
          tile_block<TR>(xf + r * K, K, w, out);
        } else {
          rows = r1 - r < PR ? 1 : PR;
          if (rows == PR) dot_tile<PR, PJ>(xf + r * K, K, w, 0, out);
          else dot_tile<1, PJ>(xf + r * K, K, w, 0, out);
        }
        for (int i = 0; i < rows; ++i)
          for (int j = 0; j < PJ; ++j) store((r + i) * N + b * PJ + j, out[i * PJ + j] * scale(b * PJ + j));
        r += rows;
      }
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
