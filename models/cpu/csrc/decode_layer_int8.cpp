// The decode layer over int8 weights: the int8 kernel, its products, the layer.
// The products over int8 weights: qlinear (one projection, bias and bfloat16 rounding as a
// QuantLinear) and gate_up (RMSNorm's output -> bf16(SiLU(gate) * up), the two products fused per block).
#include "int8.cpp"

#include <math.h>
#include <vector>

static inline float rb(float v) { return bf16_to_f32(f32_to_bf16(v)); }  // a bfloat16 op's rounding

// y (M, N), bfloat16 values in float32 = bf16(bf16(x (M, K) @ q (N, K)^T * scale) + bias), as a
// QuantLinear computes it (bias may be null)
static void qlinear(const float* x, int64_t M, int64_t K, const void* qv, const uint16_t* scales,
                    const uint16_t* bias, int64_t N, float* y, int threads) {
  int8_mm(x, M, K, (const int8_t*)qv, [=](int64_t n) { return bf16_to_f32(scales[n]); }, N,
          [=](int64_t i, float v) { y[i] = bias ? rb(rb(v) + bf16_to_f32(bias[i % N])) : rb(v); }, threads);
}

static void gate_up(const float* px, int64_t M, int64_t H, const void* gwv, const uint16_t* gs,
                    const void* uwv, const uint16_t* us, int64_t I, float* pa, int threads) {
  const int8_t* gw = (const int8_t*)gwv;
  const int8_t* uw = (const int8_t*)uwv;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < I / PJ; ++b) {  // one packed block of gate and of up channels
    float g[PJ], u[PJ];
    for (int64_t m = 0; m < M; ++m) {
      dot_tile<1, PJ>(px + m * H, H, gw + b * PJ * H, 0, g);
      dot_tile<1, PJ>(px + m * H, H, uw + b * PJ * H, 0, u);
      for (int j = 0; j < PJ; ++j) {
        const int64_t n = b * PJ + j;
        const float gv = rb(g[j] * bf16_to_f32(gs[n])), uv = rb(u[j] * bf16_to_f32(us[n]));
        pa[m * I + n] = rb(rb(gv / (1.f + expf(-gv))) * uv);
      }
    }
  }
}

#include "layer.h"
