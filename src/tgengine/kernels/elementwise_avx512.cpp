// elementwise.cpp's bfloat16 kernels 16 lanes at a time in 512-bit registers: residual add +
// RMSNorm, rotary embedding + KV store, gate activation * up. The same operations in the
// same order as the 8-lane forms (the norm's sum of squares still added 8 lanes at a time,
// its other work and the rest element by element), so the same bits: a test compares them.
// At a decode step's sizes (32 rows of 576 or 1536) the 8-lane forms were bound by the
// bf16 conversions (each rounding to bf16 a dozen 256-bit operations), not by memory.
// Built with -mavx512f -mavx512bw (kernels/__init__.py) on any machine, run only where the
// CPU has AVX-512 BF16 and the switch is on: elementwise.cpp's entry points ask
// tg_use_avx512_bf16 first, and take their own path where these refuse (return nonzero).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "simd512.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#include <immintrin.h>

namespace {

using tg::exp16;
using tg::round_to;
using tg::to_float;

constexpr int64_t kParallelMin = 1 << 15;  // elementwise.cpp's: below it one thread is quicker
// The norm's own: a 32-row decode step's norm (576 wide) took 10.3 us on one thread and 5.7
// on two, 16 rows 5.3 and 4.4, 8 rows 3.2 and 3.4 (Zen 4 VM, avx512_bf16, medians of 2,000).
constexpr int64_t kNormParallelMin = 1 << 13;

inline __m512 load16(const uint16_t* p) {
  return tg::widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// v rounded to bfloat16, kept as float32: tg::round8's.
inline __m512 round16(__m512 v) { return _mm512_castsi512_ps(tg::round_bits16(v)); }

inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), tg::bf16_bits16(v));
}

// ---- residual add + RMSNorm (elementwise.cpp's add_rms_norm_row) -------------------------
void add_rms_norm_row(const uint16_t* x, uint16_t* residual, const uint16_t* weight,
                      int64_t size, float eps, bool unit_offset, uint16_t* out) {
  const uint16_t* src = residual ? residual : x;
  __m256 sq = _mm256_setzero_ps();
  float tail_sq = 0.f;
  const int64_t size8 = size - size % 8, size16 = size - size % 16;
  for (int64_t i = 0; i < size16; i += 16) {
    __m512 v = load16(x + i);
    if (residual) {
      v = round16(_mm512_add_ps(load16(residual + i), v));
      store16(residual + i, v);
    }
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    sq = _mm256_fmadd_ps(lo, lo, sq);  // the 8-lane form's sums, in its order
    sq = _mm256_fmadd_ps(hi, hi, sq);
  }
  for (int64_t i = size16; i < size8; i += 8) {
    __m256 v = tg::load8(x + i);
    if (residual) {
      v = tg::round8<uint16_t>(_mm256_add_ps(tg::load8(residual + i), v));
      tg::store8(residual + i, v);
    }
    sq = _mm256_fmadd_ps(v, v, sq);
  }
  for (int64_t i = size8; i < size; ++i) {
    float v = to_float(x[i]);
    if (residual) {
      v = round_to<uint16_t>(to_float(residual[i]) + v);
      tg::from_float(v, residual + i);
    }
    tail_sq += v * v;
  }
  const float inv = 1.f / std::sqrt((tg::hsum8(sq) + tail_sq) / static_cast<float>(size) + eps);
  const __m512 inv16 = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < size16; i += 16) {
    const __m512 v = _mm512_mul_ps(load16(src + i), inv16);
    const __m512 w = load16(weight + i);
    store16(out + i, unit_offset ? _mm512_mul_ps(v, _mm512_add_ps(one, w))
                                 : _mm512_mul_ps(round16(v), w));
  }
  const __m256 inv8 = _mm256_set1_ps(inv), one8 = _mm256_set1_ps(1.f);
  for (int64_t i = size16; i < size8; i += 8) {
    const __m256 v = _mm256_mul_ps(tg::load8(src + i), inv8);
    const __m256 w = tg::load8(weight + i);
    tg::store8(out + i, unit_offset ? _mm256_mul_ps(v, _mm256_add_ps(one8, w))
                                    : _mm256_mul_ps(tg::round8<uint16_t>(v), w));
  }
  for (int64_t i = size8; i < size; ++i) {
    const float v = to_float(src[i]) * inv, w = to_float(weight[i]);
    tg::from_float(unit_offset ? v * (1.f + w) : round_to<uint16_t>(v) * w, out + i);
  }
}

// ---- rotary embedding (elementwise.cpp's rotate, for halves of a multiple of 16) ----------
void rotate(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 x1 = load16(x + j), x2 = load16(x + half + j);
    const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
    const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(x1, load16(cos + j))),
                                    round16(_mm512_mul_ps(neg_x2, load16(sin + j))));
    const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(x2, load16(cos + half + j))),
                                    round16(_mm512_mul_ps(x1, load16(sin + half + j))));
    store16(x + j, lo);
    store16(x + half + j, hi);
  }
}

// ---- gate activation * up (elementwise.cpp's act_mul; tg::activate, simd.h) -----------
using tg::activate;
using tg::activate8;
using tg::kGeluBeta;
using tg::kGeluKappa;
using tg::kGeluTanh;
using tg::kSilu;

template <int Act>
inline __m512 activate16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  __m512 t = x;  // silu: exp(-x)
  if constexpr (Act == kGeluTanh) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    t = _mm512_mul_ps(_mm512_set1_ps(2.f * kGeluBeta),
                      _mm512_fmadd_ps(_mm512_set1_ps(kGeluKappa), cube, x));
  }
  return _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), t))));
}

template <int Act>
void act_mul(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out, int threads) {
  const int64_t inter8 = inter - inter % 8, inter16 = inter - inter % 16;
#pragma omp parallel for num_threads(threads) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gate = gate_up + r * 2 * inter;
    const uint16_t* up = gate + inter;
    uint16_t* o = out + r * inter;
    for (int64_t i = 0; i < inter16; i += 16)
      store16(o + i, _mm512_mul_ps(round16(activate16<Act>(load16(gate + i))), load16(up + i)));
    for (int64_t i = inter16; i < inter8; i += 8)
      tg::store8(o + i, _mm256_mul_ps(tg::round8<uint16_t>(activate8<Act>(tg::load8(gate + i))),
                                      tg::load8(up + i)));
    for (int64_t i = inter8; i < inter; ++i)
      tg::from_float(round_to<uint16_t>(activate<Act>(to_float(gate[i]))) * to_float(up[i]),
                     o + i);
  }
}

}  // namespace

// tg_add_rms_norm's arguments for bfloat16 (elementwise.cpp checks them first): 0.
extern "C" int tg_add_rms_norm_bf16_avx512(void* x, void* residual, const void* weight,
                                           int64_t rows, int64_t size, float eps,
                                           int unit_offset, void* out, int threads) {
  auto* xs = static_cast<uint16_t*>(x);
  auto* res = static_cast<uint16_t*>(residual);
  auto* o = static_cast<uint16_t*>(out);
  const auto* w = static_cast<const uint16_t*>(weight);
#pragma omp parallel for num_threads(threads) if (rows * size >= kNormParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    add_rms_norm_row(xs + r * size, res ? res + r * size : nullptr, w, size, eps,
                     unit_offset != 0, o + r * size);
  return 0;
}

// tg_rope_store_kv's arguments for bfloat16: 0, or 1 (refused: nothing written) where half the
// rotated dims are not a multiple of 16 or the arguments are not ones it accepts.
extern "C" int tg_rope_store_kv_bf16_avx512(void* qkv, int64_t rows, int64_t num_heads,
                                            int64_t num_kv_heads, int64_t head_dim,
                                            const void* cos, const void* sin, int64_t rot_dim,
                                            void* cache, int64_t slots,
                                            const int64_t* slot_mapping, int threads) {
  if (rot_dim % 32 != 0 || rot_dim > head_dim) return 1;
  for (int64_t r = 0; r < rows; ++r)
    if (slot_mapping[r] < 0 || slot_mapping[r] >= slots) return 1;
  auto* rows_in = static_cast<uint16_t*>(qkv);
  auto* kv = static_cast<uint16_t*>(cache);
  const auto* c = static_cast<const uint16_t*>(cos);
  const auto* s = static_cast<const uint16_t*>(sin);
  const int64_t row_size = (num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel for num_threads(threads) if (rows * row_size >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* row = rows_in + r * row_size;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h)
      rotate(row + h * head_dim, c + r * rot_dim, s + r * rot_dim, rot_dim);
    const int64_t slot = slot_mapping[r];
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const uint16_t* k = row + (num_heads + h) * head_dim;
      const uint16_t* v = row + (num_heads + num_kv_heads + h) * head_dim;
      std::memcpy(kv + (h * slots + slot) * head_dim, k, head_dim * sizeof(uint16_t));
      std::memcpy(kv + ((num_kv_heads + h) * slots + slot) * head_dim, v,
                  head_dim * sizeof(uint16_t));
    }
  }
  return 0;
}

// tg_act_mul's arguments for bfloat16 (elementwise.cpp checks them first): 0.
extern "C" int tg_act_mul_bf16_avx512(int act, const void* gate_up, int64_t rows, int64_t inter,
                                      void* out, int threads) {
  const auto* in = static_cast<const uint16_t*>(gate_up);
  auto* o = static_cast<uint16_t*>(out);
  if (act == kSilu) {
    act_mul<kSilu>(in, rows, inter, o, threads);
  } else {
    act_mul<kGeluTanh>(in, rows, inter, o, threads);
  }
  return 0;
}

#else  // a compiler without AVX-512

extern "C" int tg_add_rms_norm_bf16_avx512(void*, void*, const void*, int64_t, int64_t, float,
                                           int, void*, int) {
  return 3;
}
extern "C" int tg_rope_store_kv_bf16_avx512(void*, int64_t, int64_t, int64_t, int64_t,
                                            const void*, const void*, int64_t, void*, int64_t,
                                            const int64_t*, int) {
  return 3;
}
extern "C" int tg_act_mul_bf16_avx512(int, const void*, int64_t, int64_t, void*, int) {
  return 3;
}

#endif
