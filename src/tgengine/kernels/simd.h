// What the kernels of tgengine.models.kernels share: bfloat16 / float16 <-> float32 as torch
// converts them (round to nearest even), scalar and 8 at a time, and 8-wide float math
// (AVX2 + FMA + F16C). Types: float, uint16_t for bfloat16 (its bits) and _Float16.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __F16C__
#include <immintrin.h>
#endif

// The head dims the attention kernels are instantiated for (kernels/__init__.py's _HEAD_DIMS):
// X(dim) for each.
#define TG_HEAD_DIMS(X) X(32) X(64) X(80) X(96) X(128) X(256)

namespace tg {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// float16 through F16C's conversions where built with them: with native float16 arithmetic
// (-march=native on a CPU with AVX512-FP16), GCC 12 may drop a float -> _Float16 -> float
// round trip of plain casts (excess precision), and round_to<_Float16> with it.
inline float to_float(_Float16 x) {
#ifdef __F16C__
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(x);
#endif
}

inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *out = 0x7fc0;
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}
inline void from_float(float x, _Float16* out) {
#ifdef __F16C__
  const uint16_t bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(out, &bits, sizeof bits);
#else
  *out = static_cast<_Float16>(x);
#endif
}

// x rounded to T and widened back: what torch's T arithmetic keeps of a float result.
template <typename T>
inline float round_to(float x) {
  T t;
  from_float(x, &t);
  return to_float(t);
}

// Gate activations (elementwise kernels): silu(x) = x / (1 + exp(-x)); gelu_tanh(x) =
// x / 2 * (1 + tanh(y)), y = b (x + k x^3), computed as x / (1 + exp(-2y)), the same value
// without torch's cancellation in 1 + tanh(y) where y << 0 (there torch's own result is off
// by up to a few units in its last place).
constexpr int kSilu = 0;
constexpr int kGeluTanh = 1;
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

template <int Act>
inline float activate(float x) {
  if constexpr (Act == kSilu) {
    return x / (1.f + std::exp(-x));
  } else {
    return x / (1.f + std::exp(-2.f * kGeluBeta * (x + kGeluKappa * x * x * x)));
  }
}

}  // namespace tg

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace tg {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const _Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 8 floats' bfloat16 bits (round to nearest even; NaN stays a quiet NaN), in 8 lanes.
inline __m128i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  rounded = _mm256_srli_epi32(rounded, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(v));
}
inline void store8(_Float16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to T and widened back, 8 at a time.
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, _Float16>) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8 sums of 8 vectors: lane i of the result is the sum of v[i]'s lanes.
inline __m256 hsum8x8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp(x) to about one ulp of float32 (Cephes' expf: range reduction by ln 2, degree-5
// polynomial), 8 at a time.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

// The gate activation of 8 lanes (activate's, with exp8).
template <int Act>
inline __m256 activate8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  __m256 t = x;  // silu: exp(-x)
  if constexpr (Act == kGeluTanh) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    t = _mm256_mul_ps(_mm256_set1_ps(2.f * kGeluBeta),
                      _mm256_fmadd_ps(_mm256_set1_ps(kGeluKappa), cube, x));
  }
  return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), t))));
}

}  // namespace tg

#endif
