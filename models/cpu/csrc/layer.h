// A Llama or Qwen2 decoder layer's decoding call in two C calls (decode_layer.py), over the products
// qlinear() and gate_up() that the including file defines for its weights' bits.
#pragma once
// transformers' RMSNorm of bfloat16 rows: weight * bf16(x * rsqrt(mean(x^2) + eps)), rounded
static void rms_norm(const float* x, int64_t M, int64_t H, const uint16_t* w, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * H;
    double ss = 0.0;
    for (int64_t i = 0; i < H; ++i) ss += (double)(r[i] * r[i]);
    const float inv = 1.f / sqrtf((float)(ss / (double)H) + eps);
    for (int64_t i = 0; i < H; ++i) out[m * H + i] = rb(bf16_to_f32(w[i]) * rb(r[i] * inv));
  }
}

// rotary positions in place on t (M, heads * D): bf16(bf16(t * cos) + bf16(rotate_half(t) * sin)), with
// cos and sin (M, D) in bfloat16 (transformers' apply_rotary_pos_emb)
static void rope(float* t, int64_t M, int64_t heads, int64_t D, const uint16_t* cos, const uint16_t* sin) {
  std::vector<float> tmp(D);
  const int64_t half = D / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = t + (m * heads + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -v[d + half] : v[d - half];
        tmp[d] = rb(rb(v[d] * bf16_to_f32(cos[m * D + d])) + rb(rot * bf16_to_f32(sin[m * D + d])));
      }
      memcpy(v, tmp.data(), sizeof(float) * D);
    }
}

// x (M, H) -> q (M, n[0]), k (M, n[1]), v (M, n[2]) in bfloat16: RMSNorm, the three products, rotary
// positions on q and k (head dim D)
extern "C" void semspec_layer_in(const uint16_t* x, int64_t M, int64_t H, const uint16_t* norm, float eps,
                                 const void* const* w, const uint16_t* const* s, const uint16_t* const* b,
                                 const int64_t* n, const uint16_t* cos, const uint16_t* sin, int64_t D,
                                 uint16_t* const* out, int threads) {
  std::vector<float> xf(M * H), xn(M * H);
  for (int64_t i = 0; i < M * H; ++i) xf[i] = bf16_to_f32(x[i]);
  rms_norm(xf.data(), M, H, norm, eps, xn.data());
  for (int j = 0; j < 3; ++j) {
    std::vector<float> y(M * n[j]);
    qlinear(xn.data(), M, H, w[j], s[j], b[j], n[j], y.data(), threads);
    if (j < 2) rope(y.data(), M, n[j] / D, D, cos, sin);
    for (int64_t i = 0; i < M * n[j]; ++i) out[j][i] = f32_to_bf16(y[i]);
  }
}

// attention output a (M, A) and the layer's input x (M, H) -> the layer's output (M, H): the output
// product, the residual, RMSNorm, SiLU(gate) * up (I wide), the down product, the residual
extern "C" void semspec_layer_out(const uint16_t* a, const uint16_t* x, int64_t M, int64_t H, int64_t A,
                                  const void* ow, const uint16_t* os, const uint16_t* norm, float eps,
                                  const void* gw, const uint16_t* gs, const void* uw, const uint16_t* us,
                                  int64_t I, const void* dw, const uint16_t* ds, uint16_t* out,
                                  int threads) {
  std::vector<float> af(M * A), o(M * H), xn(M * H), act(M * I), d(M * H);
  for (int64_t i = 0; i < M * A; ++i) af[i] = bf16_to_f32(a[i]);
  qlinear(af.data(), M, A, ow, os, nullptr, H, o.data(), threads);
  for (int64_t i = 0; i < M * H; ++i) o[i] = rb(bf16_to_f32(x[i]) + o[i]);  // the residual stream
  rms_norm(o.data(), M, H, norm, eps, xn.data());
  gate_up(xn.data(), M, H, gw, gs, uw, us, I, act.data(), threads);
  qlinear(act.data(), M, I, dw, ds, nullptr, H, d.data(), threads);
  for (int64_t i = 0; i < M * H; ++i) out[i] = f32_to_bf16(o[i] + d[i]);
}
