// What every semspec CPU kernel starts with: bfloat16 conversions and the float32 vector type of the
// build (16 lanes with AVX-512, 8 with AVX2), so one source serves every instruction set.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
#ifdef __AVX512F__  // 16 float32 lanes
typedef __m512 vec;
enum { LANES = 16 };
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vfloor(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vec vzero_below(vec x, float t, vec y) {  // y where x >= t, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GE_OQ), y);
}
static inline vec load_bf16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vec load_w(const int8_t* p) {  // 16 int8 weights -> 16 float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else  // AVX2: 8 float32 lanes
typedef __m256 vec;
enum { LANES = 8 };
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline float hsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vfloor(vec x) { return _mm256_floor_ps(x); }
static inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vec vzero_below(vec x, float t, vec y) {  // y where x >= t, else 0
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_GE_OQ), y);
}
static inline vec load_bf16(const uint16_t* p) {  // 8 bfloat16 -> 8 float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vec load_w(const int8_t* p) {  // 8 int8 weights -> 8 float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif
