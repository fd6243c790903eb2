// semspec's int4 matrix product y (M, N) = x (M, K) @ w^T, x bfloat16, on int4_kernel.pack()'s weights:
// the build for the instruction set the compiler targets (int4_bf16.h with AVX512_BF16, int4_avx2.h with
// AVX2), both with the same inputs (Int4Input), block_rows(), int4_product() and one C entry point.
#ifdef __AVX512BF16__
#include "int4_bf16.h"
#else
#include "int4_avx2.h"
#endif

extern "C" void semspec_int4_mm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint8_t* q,
                                     const uint16_t* sz, int64_t N, uint16_t* y, int threads) {
  const Int4Input in(x, M, K);
  int4_product(in, M, K, q, sz, N, [=](int64_t i, float v) { y[i] = f32_to_bf16(v); }, threads);
}
