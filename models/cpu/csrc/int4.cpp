// semspec's int4 matrix product y (M, N) = x (M, K) @ w^T, x bfloat16, on int4_kernel.pack()'s weights:
// the build for the instruction set the compiler targets (int4_bf16.h with AVX512_BF16, int4_avx2.h with
// AVX2), both with the same inputs (Int4Input), block_rows() and int4_gemm(); the drivers below and the C
// entry point are shared.
#ifdef __AVX512BF16__
#include "int4_bf16.h"
#else
#include "int4_avx2.h"
#endif

// y (M, N) = x @ w^T for few rows: each thread streams its blocks of 16 channels once, every row of the call
// against each (block_rows, up to RMAX rows at a time); store(y index, value)
template <typename Store>
static void int4_mm(const Int4Input& in, int64_t M, int64_t K, const uint8_t* q, const uint16_t* sz, int64_t N,
                    Store store, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < N / BLOCK; ++b) {
    float out[RMAX * BLOCK];
    for (int64_t r = 0; r < M; r += RMAX) {
      const int64_t rows = M - r < RMAX ? M - r : RMAX;
      block_rows(in, r, rows, K, q, sz, b, out);
      for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < BLOCK; ++c) store((r + i) * N + b * BLOCK + c, out[i * BLOCK + c]);
    }
  }
}

// y (M, N) = x @ w^T: calls of fewer than GEMM_ROWS rows stream the weights (int4_mm); more run the build's
// tiles (int4_gemm), faster from GEMM_ROWS rows on
template <typename Store>
static void int4_product(const Int4Input& in, int64_t M, int64_t K, const uint8_t* q, const uint16_t* sz,
                         int64_t N, Store store, int threads) {
  if (M < GEMM_ROWS)
    int4_mm(in, M, K, q, sz, N, store, threads);
  else
    int4_gemm(in, M, K, q, sz, N, store, threads);
}

extern "C" void semspec_int4_mm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint8_t* q,
                                     const uint16_t* sz, int64_t N, uint16_t* y, int threads) {
  const Int4Input in(x, M, K);
  int4_product(in, M, K, q, sz, N, [=](int64_t i, float v) { y[i] = f32_to_bf16(v); }, threads);
}
