// The per-layer element-wise work of a decoder, one pass each, in place where it can be:
// residual add + RMSNorm, rotary embedding + storing keys and values in the paged cache,
// and the MLP's gate activation times up. Each rounds where torch's half-precision ops round
// (every op's result to the tensor's dtype), so it agrees with the torch path it replaces
// (models/layers.py, rope.py, attention.write_kv) to the last bit but for the order of a
// sum and the last bit of exp. bfloat16 and float16 only; AVX2 + FMA + F16C. Compiled with
// the other kernels by tgengine.models.kernels.
#include <cmath>
#include <cstdint>

#include "simd.h"

// The 512-bit forms of the bfloat16 kernels (elementwise_avx512.cpp; the same bits), and
// whether they run (pair_panels.cpp: where the CPU has AVX-512 BF16 and the switch is on).
extern "C" {
int tg_use_avx512_bf16(int on);
int tg_add_rms_norm_bf16_avx512(void* x, void* residual, const void* weight, int64_t rows,
                                int64_t size, float eps, int unit_offset, void* out, int threads);
int tg_rope_store_kv_bf16_avx512(void* qkv, int64_t rows, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, const void* cos,
                                 const void* sin, int64_t rot_dim, void* cache, int64_t slots,
                                 const int64_t* slot_mapping, int threads);
int tg_act_mul_bf16_avx512(int act, const void* gate_up, int64_t rows, int64_t inter, void* out,
                           int threads);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

using tg::load8;
using tg::round8;
using tg::round_to;
using tg::store8;
using tg::exp8;
using tg::to_float;
using tg::activate;
using tg::activate8;
using tg::kGeluTanh;
using tg::kSilu;

constexpr int64_t kParallelMin = 1 << 15;  // elements below which one thread is quicker

// ---- residual add + RMSNorm ------------------------------------------------------------
// residual (if any) += x, rounded; out = norm(residual or x) * weight, as layers.RMSNorm:
// plain: round(round(v * inv) * w); unit_offset (Gemma): round(v * inv * (1 + w)).
template <typename T>
void add_rms_norm_row(const T* x, T* residual, const T* weight, int64_t size, float eps,
                      bool unit_offset, T* out) {
  const T* src = residual ? residual : x;
  __m256 sq = _mm256_setzero_ps();
  float tail_sq = 0.f;
  const int64_t size8 = size - size % 8;
  for (int64_t i = 0; i < size8; i += 8) {
    __m256 v = load8(x + i);
    if (residual) {
      v = round8<T>(_mm256_add_ps(load8(residual + i), v));
      store8(residual + i, v);
    }
    sq = _mm256_fmadd_ps(v, v, sq);
  }
  for (int64_t i = size8; i < size; ++i) {
    float v = to_float(x[i]);
    if (residual) {
      v = round_to<T>(to_float(residual[i]) + v);
      tg::from_float(v, residual + i);
    }
    tail_sq += v * v;
  }
  const float inv = 1.f / std::sqrt((tg::hsum8(sq) + tail_sq) / static_cast<float>(size) + eps);
  const __m256 inv8 = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < size8; i += 8) {
    const __m256 v = _mm256_mul_ps(load8(src + i), inv8);
    const __m256 w = load8(weight + i);
    store8(out + i, unit_offset ? _mm256_mul_ps(v, _mm256_add_ps(one, w))
                                : _mm256_mul_ps(round8<T>(v), w));
  }
  for (int64_t i = size8; i < size; ++i) {
    const float v = to_float(src[i]) * inv, w = to_float(weight[i]);
    tg::from_float(unit_offset ? v * (1.f + w) : round_to<T>(v) * w, out + i);
  }
}

template <typename T>
int add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int64_t size, float eps,
                 bool unit_offset, T* out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * size >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r)
    add_rms_norm_row(x + r * size, residual ? residual + r * size : nullptr, weight, size, eps,
                     unit_offset, out + r * size);
  return 0;
}

// ---- rotary embedding + KV store ---------------------------------------------------------
// One head's first rot_dim dimensions, rotate-half convention, as rope.apply_rotary:
// out = round(round(x * cos) + round(rotate_half(x) * sin)).
template <typename T>
void rotate(T* x, const T* cos, const T* sin, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  int64_t j = 0;
  if (half % 8 == 0) {
    for (; j < half; j += 8) {
      const __m256 x1 = load8(x + j), x2 = load8(x + half + j);
      const __m256 neg_x2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
      const __m256 lo = _mm256_add_ps(round8<T>(_mm256_mul_ps(x1, load8(cos + j))),
                                      round8<T>(_mm256_mul_ps(neg_x2, load8(sin + j))));
      const __m256 hi = _mm256_add_ps(round8<T>(_mm256_mul_ps(x2, load8(cos + half + j))),
                                      round8<T>(_mm256_mul_ps(x1, load8(sin + half + j))));
      store8(x + j, lo);
      store8(x + half + j, hi);
    }
  }
  for (; j < half; ++j) {
    const float x1 = to_float(x[j]), x2 = to_float(x[half + j]);
    const float lo = round_to<T>(x1 * to_float(cos[j])) + round_to<T>(-x2 * to_float(sin[j]));
    const float hi =
        round_to<T>(x2 * to_float(cos[half + j])) + round_to<T>(x1 * to_float(sin[half + j]));
    tg::from_float(lo, x + j);
    tg::from_float(hi, x + half + j);
  }
}

// qkv [rows][num_heads + 2 * num_kv_heads][head_dim] (queries, keys, values): queries and
// keys rotated in place, then keys and values copied to their slots of cache
// [2][num_kv_heads][slots][head_dim].
template <typename T>
int rope_store_kv(T* qkv, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, const T* cos, const T* sin, int64_t rot_dim, T* cache,
                  int64_t slots, const int64_t* slot_mapping, int threads) {
  if (rot_dim % 2 != 0 || rot_dim > head_dim) return 4;
  for (int64_t r = 0; r < rows; ++r)
    if (slot_mapping[r] < 0 || slot_mapping[r] >= slots) return 5;
  const int64_t row_size = (num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel for num_threads(threads) if (rows * row_size >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    T* row = qkv + r * row_size;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h)
      rotate(row + h * head_dim, cos + r * rot_dim, sin + r * rot_dim, rot_dim);
    const int64_t slot = slot_mapping[r];
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const T* k = row + (num_heads + h) * head_dim;
      const T* v = row + (num_heads + num_kv_heads + h) * head_dim;
      std::memcpy(cache + (h * slots + slot) * head_dim, k, head_dim * sizeof(T));
      std::memcpy(cache + ((num_kv_heads + h) * slots + slot) * head_dim, v,
                  head_dim * sizeof(T));
    }
  }
  return 0;
}

// ---- gate activation * up (tg::activate8, simd.h) ---------------------------------------
// out [rows][inter] = round(round(act(gate)) * up), gate_up [rows][2 * inter] = [gate | up].
template <typename T, int Act>
int act_mul(const T* gate_up, int64_t rows, int64_t inter, T* out, int threads) {
  const int64_t inter8 = inter - inter % 8;
#pragma omp parallel for num_threads(threads) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
    for (int64_t i = 0; i < inter8; i += 8)
      store8(o + i, _mm256_mul_ps(round8<T>(activate8<Act>(load8(gate + i))), load8(up + i)));
    for (int64_t i = inter8; i < inter; ++i)
      tg::from_float(round_to<T>(activate<Act>(to_float(gate[i]))) * to_float(up[i]), o + i);
  }
  return 0;
}

constexpr int kBf16 = 1;
constexpr int kF16 = 2;

}  // namespace

// dtype: 1 bfloat16, 2 float16. Each returns 0, or nonzero where it refuses (the caller then
// takes the torch path).
extern "C" int tg_add_rms_norm(int dtype, void* x, void* residual, const void* weight,
                               int64_t rows, int64_t size, float eps, int unit_offset,
                               void* out, int threads) {
  if (rows < 0 || size <= 0 || threads < 1) return 1;
  if (dtype == kBf16 && tg_use_avx512_bf16(-1))
    return tg_add_rms_norm_bf16_avx512(x, residual, weight, rows, size, eps, unit_offset, out,
                                       threads);
  if (dtype == kBf16)
    return add_rms_norm(static_cast<uint16_t*>(x), static_cast<uint16_t*>(residual),
                        static_cast<const uint16_t*>(weight), rows, size, eps, unit_offset != 0,
                        static_cast<uint16_t*>(out), threads);
  if (dtype == kF16)
    return add_rms_norm(static_cast<_Float16*>(x), static_cast<_Float16*>(residual),
                        static_cast<const _Float16*>(weight), rows, size, eps, unit_offset != 0,
                        static_cast<_Float16*>(out), threads);
  return 2;
}

extern "C" int tg_rope_store_kv(int dtype, void* qkv, int64_t rows, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, const void* cos,
                                const void* sin, int64_t rot_dim, void* cache, int64_t slots,
                                const int64_t* slot_mapping, int threads) {
  if (rows < 0 || num_heads < 0 || num_kv_heads <= 0 || head_dim <= 0 || threads < 1) return 1;
  if (dtype == kBf16 && tg_use_avx512_bf16(-1) &&
      tg_rope_store_kv_bf16_avx512(qkv, rows, num_heads, num_kv_heads, head_dim, cos, sin,
                                   rot_dim, cache, slots, slot_mapping, threads) == 0)
    return 0;
  if (dtype == kBf16)
    return rope_store_kv(static_cast<uint16_t*>(qkv), rows, num_heads, num_kv_heads, head_dim,
                         static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin),
                         rot_dim, static_cast<uint16_t*>(cache), slots, slot_mapping, threads);
  if (dtype == kF16)
    return rope_store_kv(static_cast<_Float16*>(qkv), rows, num_heads, num_kv_heads, head_dim,
                         static_cast<const _Float16*>(cos), static_cast<const _Float16*>(sin),
                         rot_dim, static_cast<_Float16*>(cache), slots, slot_mapping, threads);
  return 2;
}

// act: 0 silu, 1 gelu (tanh approximation).
extern "C" int tg_act_mul(int dtype, int act, const void* gate_up, int64_t rows, int64_t inter,
                          void* out, int threads) {
  if (rows < 0 || inter <= 0 || threads < 1 || (act != kSilu && act != kGeluTanh)) return 1;
  if (dtype == kBf16 && tg_use_avx512_bf16(-1))
    return tg_act_mul_bf16_avx512(act, gate_up, rows, inter, out, threads);
  if (dtype == kBf16) {
    const auto* in = static_cast<const uint16_t*>(gate_up);
    auto* o = static_cast<uint16_t*>(out);
    return act == kSilu ? act_mul<uint16_t, kSilu>(in, rows, inter, o, threads)
                        : act_mul<uint16_t, kGeluTanh>(in, rows, inter, o, threads);
  }
  if (dtype == kF16) {
    const auto* in = static_cast<const _Float16*>(gate_up);
    auto* o = static_cast<_Float16*>(out);
    return act == kSilu ? act_mul<_Float16, kSilu>(in, rows, inter, o, threads)
                        : act_mul<_Float16, kGeluTanh>(in, rows, inter, o, threads);
  }
  return 2;
}

#else  // no AVX2/FMA/F16C: the torch paths run instead (tg_half_linear_available says 0)

extern "C" int tg_add_rms_norm(int, void*, void*, const void*, int64_t, int64_t, float, int,
                               void*, int) {
  return 3;
}
extern "C" int tg_rope_store_kv(int, void*, int64_t, int64_t, int64_t, int64_t, const void*,
                                const void*, int64_t, void*, int64_t, const int64_t*, int) {
  return 3;
}
extern "C" int tg_act_mul(int, int, const void*, int64_t, int64_t, void*, int) { return 3; }

#endif
