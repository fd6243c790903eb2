// The decode layer over int4 weights: the int4 kernel (its AVX512_BF16 or AVX2 build), its products, the layer.
// The products over int4 weights: qlinear (one projection, bias and bfloat16 rounding as a
// QuantLinear) and gate_up (RMSNorm's output -> bf16(SiLU(gate) * up), the two products fused per block).
#include "int4.cpp"

#include <math.h>
#include <vector>

static inline float rb(float v) { return bf16_to_f32(f32_to_bf16(v)); }  // a bfloat16 op's rounding

// y (M, N), bfloat16 values in float32 = bf16(bf16(x (M, K) @ w^T) + bias), as a QuantLinear computes it
static void qlinear(const float* x, int64_t M, int64_t K, const void* q, const uint16_t* sz,
                    const uint16_t* bias, int64_t N, float* y, int threads) {
  const Int4Input in(x, M, K);
  int4_product(in, M, K, (const uint8_t*)q, sz, N,
          [=](int64_t i, float v) { y[i] = bias ? rb(rb(v) + bf16_to_f32(bias[i % N])) : rb(v); }, threads);
}

static void gate_up(const float* px, int64_t M, int64_t H, const void* gw, const uint16_t* gs,
                    const void* uw, const uint16_t* us, int64_t I, float* pa, int threads) {
  const Int4Input in(px, M, H);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < I / BLOCK; ++b) {  // one packed block of gate and of up channels
    float g[RMAX * BLOCK], u[RMAX * BLOCK];
    for (int64_t r = 0; r < M; r += RMAX) {
      const int64_t rows = M - r < RMAX ? M - r : RMAX;
      block_rows(in, r, rows, H, (const uint8_t*)gw, gs, b, g);
      block_rows(in, r, rows, H, (const uint8_t*)uw, us, b, u);
      for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < BLOCK; ++c) {
          const float gv = rb(g[i * BLOCK + c]), uv = rb(u[i * BLOCK + c]);
          pa[(r + i) * I + b * BLOCK + c] = rb(rb(gv / (1.f + expf(-gv))) * uv);
        }
    }
  }
}

#include "layer.h"
