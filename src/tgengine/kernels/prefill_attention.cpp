// Prefill attention that reads the paged KV cache in place: one sequence's span of n query
// positions, the last n of its context_len keys (a prompt, a prompt chunk, or a prompt after
// a prefix-cache hit), causal, with an optional sliding window. Compiled with the other
// kernels (see kernels/__init__.py); the torch path in models/attention.py (SDPA) computes
// the same thing and is the fallback.
//
// Layout as paged_attention.cpp: cache [2][num_kv_heads][num_blocks][block_size][head_dim];
// q and out are [n][num_heads][head_dim] rows of the given strides (elements), the query
// heads that share a KV head consecutive.
//
// Shaped like a GEMM rather than like torch's flash kernel, whose per-block overheads keep it
// near 25 GFLOP/s on head_dim 64: first every key of a KV head is widened to float32 once,
// transposed in tiles of 32 keys ([tile][d][32]), and every value widened ([position][d]).
// Then one work item is (KV head, 16 query positions): its rows (position x query head of the
// group) are scored against a key tile with a 6 x 16 register-blocked product, soft-maxed
// online (running max and sum per row, as flash attention does), and the values added with
// a 6 x 16 product too. Tiles entirely hidden by the causal mask or the window are skipped.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace {

constexpr int kKeys = 32;       // keys per tile (a multiple of 16)
constexpr int kPositions = 16;  // query positions per work item
constexpr int kBlock = 6;       // rows per register block

// Every key of one KV head as [tile][D][kKeys] and every value as [position][D], float32;
// positions past len are zero.
template <typename T, int D>
void widen_head(const T* keys, const T* values, const int64_t* table, int64_t len,
                int64_t block_size, int64_t tile, float* key_tiles, float* value_rows) {
  float* kt = key_tiles + tile * D * kKeys;
  for (int p = 0; p < kKeys; ++p) {
    const int64_t pos = tile * kKeys + p;
    float* v = value_rows + pos * D;
    if (pos >= len) {
      for (int d = 0; d < D; ++d) kt[d * kKeys + p] = 0.f;
      for (int d = 0; d < D; ++d) v[d] = 0.f;
      continue;
    }
    const int64_t row = table[pos / block_size] * block_size * D + (pos % block_size) * D;
    for (int d = 0; d < D; d += 8) {
      alignas(32) float k8[8];
      _mm256_store_ps(k8, tg::load8(keys + row + d));
      for (int i = 0; i < 8; ++i) kt[(d + i) * kKeys + p] = k8[i];
      _mm256_storeu_ps(v + d, tg::load8(values + row + d));
    }
  }
}

// s[r][0..16) = q[r] . keys (16 of a tile's columns), for R <= 6 rows.
template <int D, int R>
inline void score_block(const float* q, const float* kt, float* s) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(kt + d * kKeys), k1 = _mm256_load_ps(kt + d * kKeys + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(s + r * kKeys, acc[r][0]);
    _mm256_store_ps(s + r * kKeys + 8, acc[r][1]);
  }
}

// o[r][c..c+16) += p[r] . values[.][c..c+16), for R <= 6 rows and the tile's kKeys keys.
template <int D, int R>
inline void add_values_block(const float* p, const float* v, float* o, int c) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_load_ps(o + r * D + c);
    acc[r][1] = _mm256_load_ps(o + r * D + c + 8);
  }
  for (int j = 0; j < kKeys; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * D + c), v1 = _mm256_loadu_ps(v + j * D + c + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * kKeys + j);
      acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(o + r * D + c, acc[r][0]);
    _mm256_store_ps(o + r * D + c + 8, acc[r][1]);
  }
}

// f(r, R) for each block of rows [r, r + R) of `rows`: blocks of kBlock, then the rest; R is a
// std::integral_constant, so each block size is its own register-blocked instantiation.
template <typename F>
inline void for_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + kBlock <= rows; r += kBlock) f(r, std::integral_constant<int, kBlock>{});
  switch (rows - r) {
    case 5: f(r, std::integral_constant<int, 5>{}); break;
    case 4: f(r, std::integral_constant<int, 4>{}); break;
    case 3: f(r, std::integral_constant<int, 3>{}); break;
    case 2: f(r, std::integral_constant<int, 2>{}); break;
    case 1: f(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

#if defined(__AVX512F__)
// Where the library is built for AVX-512 (-march=native on such a CPU), the two products above
// 32 lanes at a time in two 512-bit registers instead of four 256-bit ones: the same sums in
// the same order (each lane's FMAs run over d, or j, as above), so the same bits.
constexpr bool kWide = true;

// s[r][0..32) = q[r] . keys (a whole tile), for R <= 6 rows.
template <int D, int R>
inline void score_block_wide(const float* q, const float* kt, float* s) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeys), k1 = _mm512_loadu_ps(kt + d * kKeys + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * D + d]);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * kKeys, acc[r][0]);
    _mm512_storeu_ps(s + r * kKeys + 16, acc[r][1]);
  }
}

// o[r][c..c+32) += p[r] . values[.][c..c+32), for R <= 6 rows and the tile's kKeys keys.
template <int D, int R>
inline void add_values_block_wide(const float* p, const float* v, float* o, int c) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_loadu_ps(o + r * D + c);
    acc[r][1] = _mm512_loadu_ps(o + r * D + c + 16);
  }
  for (int j = 0; j < kKeys; ++j) {
    const __m512 v0 = _mm512_loadu_ps(v + j * D + c), v1 = _mm512_loadu_ps(v + j * D + c + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * kKeys + j]);
      acc[r][0] = _mm512_fmadd_ps(w, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(o + r * D + c, acc[r][0]);
    _mm512_storeu_ps(o + r * D + c + 16, acc[r][1]);
  }
}
#else
constexpr bool kWide = false;
template <int D, int R>
inline void score_block_wide(const float*, const float*, float*) {}
template <int D, int R>
inline void add_values_block_wide(const float*, const float*, float*, int) {}
#endif

template <int D>
void scores(int rows, const float* q, const float* kt, float* s) {
  if constexpr (kWide) {
    for_row_blocks(rows, [&](int r, auto block) {
      score_block_wide<D, decltype(block)::value>(q + r * D, kt, s + r * kKeys);
    });
    return;
  }
  for (int c = 0; c < kKeys; c += 16)
    for_row_blocks(rows, [&](int r, auto block) {
      score_block<D, decltype(block)::value>(q + r * D, kt + c, s + r * kKeys + c);
    });
}

template <int D>
void add_values(int rows, const float* p, const float* v, float* o) {
  if constexpr (kWide && D % 32 == 0) {
    for (int c = 0; c < D; c += 32)
      for_row_blocks(rows, [&](int r, auto block) {
        add_values_block_wide<D, decltype(block)::value>(p + r * kKeys, v, o + r * D, c);
      });
    return;
  }
  for (int c = 0; c < D; c += 16)
    for_row_blocks(rows, [&](int r, auto block) {
      add_values_block<D, decltype(block)::value>(p + r * kKeys, v, o + r * D, c);
    });
}

// One work item: query positions [i0, i1) of KV head `head`, rows ordered (position, group).
template <typename T, int D>
void attend_item(const T* q, int64_t q_stride, T* out, int64_t out_stride, int64_t head,
                 int groups, int64_t i0, int64_t i1, int64_t n, int64_t len, int64_t window,
                 float scale, const float* key_tiles, const float* value_rows, float* qf,
                 float* of, float* s, float* best, float* total) {
  const int rows = static_cast<int>(i1 - i0) * groups;
  const int64_t first_pos = len - n + i0, last_pos = len - n + i1 - 1;  // of the queries
  for (int64_t i = i0; i < i1; ++i)
    for (int g = 0; g < groups; ++g) {
      const T* src = q + i * q_stride + (head * groups + g) * D;
      float* dst = qf + ((i - i0) * groups + g) * D;
      for (int d = 0; d < D; d += 8)
        _mm256_store_ps(dst + d, _mm256_mul_ps(tg::load8(src + d), _mm256_set1_ps(scale)));
    }
  std::fill(of, of + rows * D, 0.f);
  std::fill(best, best + rows, -INFINITY);
  std::fill(total, total + rows, 0.f);
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t tile = first_key / kKeys; tile <= last_pos / kKeys; ++tile) {
    const int64_t k0 = tile * kKeys;
    const float* kt = key_tiles + tile * D * kKeys;
    const float* v = value_rows + k0 * D;
    scores<D>(rows, qf, kt, s);
    // Keys past a row's position, or before its window, are hidden in this tile.
    const bool masked = k0 + kKeys - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
    for (int r = 0; r < rows; ++r) {
      float* row = s + r * kKeys;
      __m256 x[kKeys / 8];
      for (int c = 0; c < kKeys / 8; ++c) x[c] = _mm256_load_ps(row + 8 * c);
      if (masked) {
        const int64_t pos = first_pos + r / groups;
        const int64_t lo = window > 0 ? pos - window + 1 : 0;
        for (int c = 0; c < kKeys / 8; ++c) {
          const __m256 key = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(k0 + 8 * c)), iota);
          const __m256 seen = _mm256_and_ps(
              _mm256_cmp_ps(key, _mm256_set1_ps(static_cast<float>(pos)), _CMP_LE_OQ),
              _mm256_cmp_ps(key, _mm256_set1_ps(static_cast<float>(lo)), _CMP_GE_OQ));
          x[c] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x[c], seen);
        }
      }
      __m256 top8 = x[0];
      for (int c = 1; c < kKeys / 8; ++c) top8 = _mm256_max_ps(top8, x[c]);
      const float top = std::max(best[r], tg::hmax8(top8));
      if (top == -INFINITY) {  // nothing visible to this row in this tile
        for (int c = 0; c < kKeys / 8; ++c) _mm256_store_ps(row + 8 * c, _mm256_setzero_ps());
        continue;
      }
      const __m256 shift = _mm256_set1_ps(top);
      __m256 sum = _mm256_setzero_ps();
      for (int c = 0; c < kKeys / 8; ++c) {
        __m256 kept = tg::exp8(_mm256_sub_ps(x[c], shift));
        if (masked)  // exp8 clamps its argument: a hidden key's exp(-inf) must be zeroed here
          kept = _mm256_and_ps(kept, _mm256_cmp_ps(x[c], _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
        _mm256_store_ps(row + 8 * c, kept);
        sum = _mm256_add_ps(sum, kept);
      }
      if (top != best[r]) {
        const float alpha = best[r] == -INFINITY ? 0.f : std::exp(best[r] - top);
        total[r] *= alpha;
        const __m256 a = _mm256_set1_ps(alpha);
        float* o = of + r * D;
        for (int d = 0; d < D; d += 8) _mm256_store_ps(o + d, _mm256_mul_ps(_mm256_load_ps(o + d), a));
        best[r] = top;
      }
      total[r] += tg::hsum8(sum);
    }
    add_values<D>(rows, s, v, of);
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r / groups;
    const int g = r % groups;
    T* dst = out + i * out_stride + (head * groups + g) * D;
    const __m256 inv = _mm256_set1_ps(total[r] > 0.f ? 1.f / total[r] : 0.f);
    for (int d = 0; d < D; d += 8)
      tg::store8(dst + d, _mm256_mul_ps(_mm256_load_ps(of + r * D + d), inv));
  }
}

template <typename T, int D>
int run(const T* q, int64_t q_stride, const T* cache, const int64_t* table, T* out,
        int64_t out_stride, int64_t n, int64_t len, int64_t num_heads, int64_t num_kv_heads,
        int64_t num_blocks, int64_t block_size, int64_t window, float scale, int threads) {
  const int groups = static_cast<int>(num_heads / num_kv_heads);
  if (groups < 1 || groups > 8 || groups * num_kv_heads != num_heads) return 1;
  if (n < 1 || n > len) return 4;
  const int64_t head_stride = num_blocks * block_size * D;
  const int64_t values_offset = num_kv_heads * head_stride;
  const int64_t tiles = (len + kKeys - 1) / kKeys;
  const int64_t per_head = tiles * kKeys * D;  // floats of one head's keys (and of its values)
  // Per call, not kept: a long context widens to tens of MB (every element is written below).
  std::unique_ptr<float[]> widened(new float[2 * num_kv_heads * per_head + 8]);
  // 32-byte aligned start: the tiles' rows are read with aligned loads.
  float* base = widened.get();
  base += (8 - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % 8) % 8;
  const int64_t spans = (n + kPositions - 1) / kPositions;
  const int64_t items = num_kv_heads * spans;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < num_kv_heads * tiles; ++job) {
      const int64_t head = job / tiles, tile = job % tiles;
      const T* keys = cache + head * head_stride;
      widen_head<T, D>(keys, keys + values_offset, table, len, block_size, tile,
                       base + head * per_head, base + (num_kv_heads + head) * per_head);
    }
    const int max_rows = kPositions * groups;
    std::vector<float> scratch(static_cast<size_t>(max_rows * (2 * D + kKeys + 2) + 8));
    float* qf = scratch.data();
    qf += (8 - (reinterpret_cast<uintptr_t>(qf) / sizeof(float)) % 8) % 8;
    float* of = qf + max_rows * D;
    float* s = of + max_rows * D;
    float* best = s + max_rows * kKeys;
    float* total = best + max_rows;
    // The last positions see the most keys: they go first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t span = spans - 1 - item / num_kv_heads, head = item % num_kv_heads;
      const int64_t i0 = span * kPositions, i1 = std::min(n, i0 + kPositions);
      attend_item<T, D>(q, q_stride, out, out_stride, head, groups, i0, i1, n, len, window, scale,
                        base + head * per_head, base + (num_kv_heads + head) * per_head, qf, of,
                        s, best, total);
    }
  }
  return 0;
}

template <typename T>
int dispatch(const void* q, int64_t q_stride, const void* cache, const int64_t* table, void* out,
             int64_t out_stride, int64_t n, int64_t len, int64_t num_heads, int64_t num_kv_heads,
             int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t window,
             float scale, int threads) {
#define TG_HEAD_DIM(DIM)                                                                       \
  case DIM:                                                                                    \
    return run<T, DIM>(static_cast<const T*>(q), q_stride, static_cast<const T*>(cache), table, \
                       static_cast<T*>(out), out_stride, n, len, num_heads, num_kv_heads,       \
                       num_blocks, block_size, window, scale, threads);
  switch (head_dim) {
    TG_HEAD_DIMS(TG_HEAD_DIM)
    default:
      return 2;
  }
#undef TG_HEAD_DIM
}

}  // namespace
#endif

extern "C" int tg_use_amx(int on);          // pair_panels_amx.cpp
extern "C" int tg_use_avx512_bf16(int on);  // pair_panels.cpp
// prefill_attention_bf16.cpp: bf16 on AMX tiles, and in AVX-512 BF16 dot products.
extern "C" int tg_paged_prefill_amx(const void* q, int64_t q_stride, const void* cache,
                                    const int64_t* table, void* out, int64_t out_stride,
                                    int64_t n, int64_t len, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                                    int64_t head_dim, int64_t window, float scale, int threads);
extern "C" int tg_paged_prefill_bf16(const void* q, int64_t q_stride, const void* cache,
                                     const int64_t* table, void* out, int64_t out_stride,
                                     int64_t n, int64_t len, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t num_blocks,
                                     int64_t block_size, int64_t head_dim, int64_t window,
                                     float scale, int threads);

// dtype: 1 bfloat16, 2 float16 (float32 stays on torch's path). Returns 0, or nonzero for what
// it does not handle (then the caller uses the torch path): 1 head layout, 2 head_dim, 3 dtype
// or no AVX2, 4 lengths.
extern "C" int tg_paged_prefill(int dtype, const void* q, int64_t q_stride, const void* cache,
                                const int64_t* table, void* out, int64_t out_stride, int64_t n,
                                int64_t len, int64_t num_heads, int64_t num_kv_heads,
                                int64_t num_blocks, int64_t block_size, int64_t head_dim,
                                int64_t window, float scale, int threads) {
  if (dtype == 1 && tg_use_amx(-1) == 1) {  // bf16 on AMX tiles (prefill_attention_bf16.cpp)
    const int status =
        tg_paged_prefill_amx(q, q_stride, cache, table, out, out_stride, n, len, num_heads,
                             num_kv_heads, num_blocks, block_size, head_dim, window, scale,
                             threads);
    if (status != 3) return status;
  }
  if (dtype == 1 && tg_use_avx512_bf16(-1) == 1) {  // bf16 in vdpbf16ps (the same file)
    const int status =
        tg_paged_prefill_bf16(q, q_stride, cache, table, out, out_stride, n, len, num_heads,
                              num_kv_heads, num_blocks, block_size, head_dim, window, scale,
                              threads);
    if (status != 3) return status;
  }
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  switch (dtype) {
    case 1:
      return dispatch<uint16_t>(q, q_stride, cache, table, out, out_stride, n, len, num_heads,
                                num_kv_heads, num_blocks, block_size, head_dim, window, scale,
                                threads);
    case 2:
      return dispatch<_Float16>(q, q_stride, cache, table, out, out_stride, n, len, num_heads,
                                num_kv_heads, num_blocks, block_size, head_dim, window, scale,
                                threads);
    default:
      return 3;
  }
#else
  (void)dtype, (void)q, (void)q_stride, (void)cache, (void)table, (void)out, (void)out_stride;
  (void)n, (void)len, (void)num_heads, (void)num_kv_heads, (void)num_blocks, (void)block_size;
  (void)head_dim, (void)window, (void)scale, (void)threads;
  return 3;
#endif
}
