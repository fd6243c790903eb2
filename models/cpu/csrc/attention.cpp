// semspec's decode attention: one query per row against its cached keys and values (attention.py).
#include "simd.h"

#include <math.h>
#include <vector>

// exp(x) in float32 (Cephes' expf: a degree-5 polynomial on [-ln2/2, ln2/2] times 2^n, within 2 ulp);
// inputs below -87.3 (a masked score) give exactly 0
static inline vec vexp(vec x) {
  const vec x0 = x;
  x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
  const vec n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfnma(n, vset1(0.693359375f), x);
  x = vfnma(n, vset1(-2.12194440e-4f), x);
  vec y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vadd(vfma(y, vmul(x, x), x), vset1(1.f));
  return vzero_below(x0, -87.3f, vmul(y, vpow2i(n)));
}

static inline vec load_act(const float* p) { return vload(p); }
static inline vec load_act(const uint16_t* p) { return load_bf16(p); }
static inline float get_act(const float* p) { return *p; }
static inline float get_act(const uint16_t* p) { return bf16_to_f32(*p); }
static inline void put_act(float* p, float v) { *p = v; }
static inline void put_act(uint16_t* p, float v) { *p = f32_to_bf16(v); }

// out (B, H, D) = softmax(q k^T * scale) v for one query per row: q (B, H, D) contiguous; k, v (B, KV, T, D)
// with element strides ks, vs = (batch, head, position) and D contiguous; head h reads key/value head
// h / (H / KV); mask (B, T) bytes, 1 = attend (or null: every position)
template <typename A>
static void attend(const A* q, const A* k, const A* v, const int64_t* ks, const int64_t* vs,
                   const uint8_t* mask, A* out, int64_t B, int64_t H, int64_t KV, int64_t T, int64_t D,
                   float scale, int threads) {
  const int64_t group = H / KV;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s(T), qf(D), acc(D);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, kvh = (bh % H) / group;
      const A* kb = k + b * ks[0] + kvh * ks[1];
      const A* vb = v + b * vs[0] + kvh * vs[1];
      const uint8_t* mb = mask ? mask + b * T : nullptr;
      for (int64_t d = 0; d < D; ++d) qf[d] = get_act(q + bh * D + d) * scale;
      float mx = -INFINITY;
      for (int64_t t = 0; t < T; ++t) {
        if (mb && !mb[t]) { s[t] = -INFINITY; continue; }
        const A* kr = kb + t * ks[2];
        vec a = vzero();
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) a = vfma(load_act(kr + d), vload(qf.data() + d), a);
        float x = hsum(a);
        for (; d < D; ++d) x += get_act(kr + d) * qf[d];
        s[t] = x;
        mx = x > mx ? x : mx;
      }
      float* o = acc.data();
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      float sum = 0.f;
      if (mx != -INFINITY) {
        const vec m = vset1(mx);
        vec sums = vzero();
        int64_t t = 0;
        for (; t + LANES <= T; t += LANES) {
          const vec e = vexp(vsub(vload(s.data() + t), m));
          vstore(s.data() + t, e);
          sums = vadd(sums, e);
        }
        sum = hsum(sums);
        for (; t < T; ++t) {
          const float e = s[t] == -INFINITY ? 0.f : expf(s[t] - mx);
          s[t] = e;
          sum += e;
        }
        for (int64_t t = 0; t < T; ++t) {
          if (s[t] == 0.f) continue;
          const A* vr = vb + t * vs[2];
          const vec w = vset1(s[t]);
          int64_t d = 0;
          for (; d + LANES <= D; d += LANES) vstore(o + d, vfma(w, load_act(vr + d), vload(o + d)));
          for (; d < D; ++d) o[d] += s[t] * get_act(vr + d);
        }
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that attends nowhere gets zeros
      for (int64_t d = 0; d < D; ++d) put_act(out + bh * D + d, o[d] * inv);
    }
  }
}

#define ATTEND(NAME, A)                                                                             \
  extern "C" void NAME(const A* q, const A* k, const A* v, const int64_t* ks, const int64_t* vs,    \
                       const uint8_t* mask, A* out, int64_t B, int64_t H, int64_t KV, int64_t T,     \
                       int64_t D, float scale, int threads) {                                        \
    attend(q, k, v, ks, vs, mask, out, B, H, KV, T, D, scale, threads);                             \
  }
ATTEND(semspec_attend_bf16, uint16_t)
ATTEND(semspec_attend_f32, float)
