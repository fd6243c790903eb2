// semspec's weight-only int8 matrix product: y (M, N) = (x (M, K) @ q^T) * scale (N,), on weights packed
// by int8_kernel.pack(). Built for AVX-512 or AVX2 (simd.h).
#include "simd.h"

// Packed weights: output channels in blocks of PJ, each block stored as K / PC chunks of PC inputs per
// channel ([N / PJ][K / PC][PJ][PC]), so a block's PJ dot products read one sequential stream. Read as
// plain rows, each thread would follow PJ streams (or one per output) with x reloaded for every row,
// reading the weights well below the memory bandwidth (figures per CPU kind: docs/formats.md).
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
