// Decode attention that reads the paged KV cache in place (no gather), one query token per
// sequence. Compiled once per machine by tgengine.models.kernels (g++ -O3 -march=native
// -fopenmp) and called through ctypes; the plain-torch path in models/attention.py computes
// the same thing and is the fallback.
//
// Layout (KVCache.layer_heads): cache [2][num_kv_heads][num_blocks][block_size][head_dim],
// keys at index 0, values at 1. q and out are [num_seqs][num_heads][head_dim]; the
// num_heads / num_kv_heads query heads that share a KV head are consecutive. For each
// (sequence, kv head) the scores of its query heads are computed over the visible keys
// [start, context_len), soft-maxed in float32, and the values summed in float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_decode_items.h"
#include "simd.h"

extern "C" int tg_use_avx512_bf16(int on);  // pair_panels.cpp
extern "C" int tg_paged_decode_bf16_avx512(const void* q, const void* cache,
                                           const int64_t* tables, const int64_t* lens,
                                           void* out, int64_t num_seqs, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t num_blocks,
                                           int64_t block_size, int64_t head_dim,
                                           int64_t table_width, int64_t window, float scale,
                                           int threads);

namespace {

using tg::from_float;
using tg::to_float;

template <typename T, int D>
void attend_one(const T* q, const T* keys, const T* values, const int64_t* table,
                int64_t start, int64_t len, int64_t block_size, int64_t block_stride, int groups,
                float scale, T* out, std::vector<float>& scores) {
  const int64_t n = len - start;
  scores.resize(static_cast<size_t>(groups) * n);
  float qf[8][D];
  for (int g = 0; g < groups; ++g)
    for (int d = 0; d < D; ++d) qf[g][d] = to_float(q[g * D + d]) * scale;
  float best[8];
  for (int g = 0; g < groups; ++g) best[g] = -INFINITY;
  for (int64_t pos = start; pos < len; ++pos) {
    const T* k = keys + table[pos / block_size] * block_stride + (pos % block_size) * D;
    float kf[D];
    for (int d = 0; d < D; ++d) kf[d] = to_float(k[d]);
    for (int g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += qf[g][d] * kf[d];
      scores[g * n + (pos - start)] = s;
      best[g] = s > best[g] ? s : best[g];
    }
  }
  float acc[8][D];
  float total[8];
  for (int g = 0; g < groups; ++g) {
    float sum = 0.f;
    float* row = scores.data() + g * n;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = std::exp(row[i] - best[g]);
      sum += row[i];
    }
    total[g] = sum;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  for (int64_t pos = start; pos < len; ++pos) {
    const T* v = values + table[pos / block_size] * block_stride + (pos % block_size) * D;
    float vf[D];
    for (int d = 0; d < D; ++d) vf[d] = to_float(v[d]);
    for (int g = 0; g < groups; ++g) {
      const float p = scores[g * n + (pos - start)];
      for (int d = 0; d < D; ++d) acc[g][d] += p * vf[d];
    }
  }
  for (int g = 0; g < groups; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    for (int d = 0; d < D; ++d) from_float(acc[g][d] * inv, out + g * D + d);
  }
}


#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Half-precision caches on AVX2: the same computation, eight positions at a time; eight scores
// come out of one transposed sum (tg::hsum8x8's lane order), and the softmax's exp is 8-wide
// (tg::exp8, within an ulp or so of std::exp). Each pass over the keys (then the values)
// keeps a block of partial sums for every query head of the group in registers, so that a
// key or value row is widened once and read by all of them: the kernel was bound by its own
// loads and stores, not by memory (one sequence's cache in L2 ran no faster than 32 in
// DRAM). With many heads in a group and a short head there are too few registers for a
// useful block, and each tile of rows is widened into L1 for the heads to read instead.
// Both forms sum in the same order, so they agree bit for bit.
struct Scratch {
  std::vector<int64_t> offsets;  // each position's row in the cache
  std::vector<float> scores;     // [groups][positions, padded to 8]
  std::vector<float> acc;        // [groups][D]
};

template <typename T, int D>
void widen_rows(const T* base, const int64_t* offsets, float (*rows)[D]) {
  for (int p = 0; p < 8; ++p)
    for (int c = 0; c < D; c += 8) _mm256_store_ps(rows[p] + c, tg::load8(base + offsets[p] + c));
}

// Positions read ahead: a sequence's blocks lie anywhere in the cache, so the hardware
// prefetcher loses the stream at every block boundary; the kernel asks for the rows it will
// read a few tiles later itself.
constexpr int64_t kAhead = 16;

template <typename T, int D>
inline void prefetch_rows(const T* base, const int64_t* offsets) {
  for (int p = 0; p < 8; ++p)
    for (int c = 0; c < D * static_cast<int>(sizeof(T)); c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + offsets[p]) + c, TG_DECODE_PREFETCH_HINT);
}

// Partial sums (accumulators) a register block may hold: 16 AVX registers, less the operands.
constexpr int kBlockRegisters = 12;

// Whether the register-blocked passes pay for a group of this many heads of dimension D
// (measured on Zen 3: 1.1-2.4x where they are used, 0.5-0.95x where they are not).
template <int D>
constexpr bool blocked(int groups) {
  return D >= 80 || groups <= (D == 64 ? 6 : 3);
}

// Lane i < P of the result: the sum of a[i]'s lanes, added in tg::hsum8x8's order.
template <int P>
inline __m128 hsum4(const __m256* a) {
  const __m256 v1 = P > 1 ? a[1] : a[0], v2 = P > 2 ? a[2] : a[0], v3 = P > 3 ? a[3] : a[0];
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores, P positions at a time: G x P partial sums over the head's chunks.
template <typename T, int D, int G, int P>
void score_keys_blocked(const T* keys, const int64_t* offsets, int64_t n8, const float (*qf)[D],
                        float* scores, __m256* best) {
  static_assert(8 % P == 0 && G * P <= kBlockRegisters, "a block of positions in registers");
  for (int64_t i = 0; i < n8; i += 8) {
    prefetch_rows<T, D>(keys, offsets + i + kAhead);
    alignas(32) float tile[G][8];
    for (int p0 = 0; p0 < 8; p0 += P) {
      __m256 a[G][P];
      for (int g = 0; g < G; ++g)
        for (int p = 0; p < P; ++p) a[g][p] = _mm256_setzero_ps();
      for (int c = 0; c < D; c += 8) {
        for (int p = 0; p < P; ++p) {
          const __m256 k = tg::load8(keys + offsets[i + p0 + p] + c);
          for (int g = 0; g < G; ++g)
            a[g][p] = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + c), k, a[g][p]);
        }
      }
      alignas(16) float sums[4];
      for (int g = 0; g < G; ++g) {
        _mm_store_ps(sums, hsum4<P>(a[g]));
        for (int p = 0; p < P; ++p) tile[g][p0 + p] = sums[p];
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 v = _mm256_load_ps(tile[g]);
      _mm256_storeu_ps(scores + g * n8 + i, v);
      best[g] = _mm256_max_ps(best[g], v);
    }
  }
}

// Scores, each tile of keys widened into L1 first.
template <typename T, int D>
void score_keys_tiles(const T* keys, const int64_t* offsets, int64_t n8, const float (*qf)[D],
                      int groups, float* scores, __m256* best) {
  alignas(32) float rows[8][D];
  for (int64_t i = 0; i < n8; i += 8) {
    prefetch_rows<T, D>(keys, offsets + i + kAhead);
    widen_rows<T, D>(keys, offsets + i, rows);
    for (int g = 0; g < groups; ++g) {
      __m256 acc[8];
      for (int p = 0; p < 8; ++p) acc[p] = _mm256_setzero_ps();
      for (int c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_load_ps(qf[g] + c);
        for (int p = 0; p < 8; ++p) acc[p] = _mm256_fmadd_ps(qv, _mm256_load_ps(rows[p] + c), acc[p]);
      }
      const __m256 v = tg::hsum8x8(acc);
      _mm256_storeu_ps(scores + g * n8 + i, v);
      best[g] = _mm256_max_ps(best[g], v);  // padding repeats a real score: harmless
    }
  }
}

// The weighted sum of the values, NC chunks of 8 of every head's output at a time.
template <typename T, int D, int G, int NC>
void sum_values_blocked(const T* values, const int64_t* offsets, int64_t n8,
                        const float* weights, float* acc) {
  static_assert((D / 8) % NC == 0 && G * NC <= kBlockRegisters, "chunk blocks tile the head");
  for (int c0 = 0; c0 < D / 8; c0 += NC) {
    __m256 a[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) a[g][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; ++i) {
      if (c0 == 0 && i % 8 == 0) prefetch_rows<T, D>(values, offsets + i + kAhead);
      const T* row = values + offsets[i] + 8 * c0;
      __m256 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(weights + g * n8 + i);
      for (int c = 0; c < NC; ++c) {
        const __m256 v = tg::load8(row + 8 * c);
        for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(w[g], v, a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + g * D + 8 * (c0 + c), a[g][c]);
  }
}

// The weighted sum of the values, each tile widened into L1 first.
template <typename T, int D>
void sum_values_tiles(const T* values, const int64_t* offsets, int64_t n8, const float* weights,
                      int groups, float* acc_out) {
  alignas(32) float rows[8][D];
  std::fill(acc_out, acc_out + groups * D, 0.f);
  for (int64_t i = 0; i < n8; i += 8) {
    prefetch_rows<T, D>(values, offsets + i + kAhead);
    widen_rows<T, D>(values, offsets + i, rows);
    for (int g = 0; g < groups; ++g) {
      const float* weight = weights + g * n8 + i;
      float* acc = acc_out + g * D;
      // Up to 8 vectors of the output in registers, one independent sum each.
      for (int c0 = 0; c0 < D / 8; c0 += 8) {
        const int width = std::min(8, D / 8 - c0);
        __m256 a[8];
        for (int c = 0; c < width; ++c) a[c] = _mm256_loadu_ps(acc + 8 * (c0 + c));
        for (int p = 0; p < 8; ++p) {
          const __m256 w = _mm256_broadcast_ss(weight + p);
          for (int c = 0; c < width; ++c)
            a[c] = _mm256_fmadd_ps(w, _mm256_load_ps(rows[p] + 8 * (c0 + c)), a[c]);
        }
        for (int c = 0; c < width; ++c) _mm256_storeu_ps(acc + 8 * (c0 + c), a[c]);
      }
    }
  }
}

// Chunks of 8 per register block of the values' pass: the most that fit for G heads.
constexpr int chunk_block(int chunks, int groups) {
  for (int nc : {8, 4, 2})
    if (chunks % nc == 0 && groups * nc <= kBlockRegisters) return nc;
  return 1;
}

template <typename T, int D>
void score_keys(const T* keys, const int64_t* offsets, int64_t n8, const float (*qf)[D],
                int groups, float* scores, __m256* best) {
  if (!blocked<D>(groups)) return score_keys_tiles<T, D>(keys, offsets, n8, qf, groups, scores, best);
  switch (groups) {
#define TG_GROUP(G)                                                                  \
  case G:                                                                            \
    return score_keys_blocked<T, D, G, (G <= 3 ? 4 : G <= 6 ? 2 : 1)>(keys, offsets, n8, qf, \
                                                                       scores, best);
    TG_GROUP(1) TG_GROUP(2) TG_GROUP(3) TG_GROUP(4) TG_GROUP(5) TG_GROUP(6) TG_GROUP(7) TG_GROUP(8)
#undef TG_GROUP
  }
}

template <typename T, int D>
void sum_values(const T* values, const int64_t* offsets, int64_t n8, const float* weights,
                int groups, float* acc) {
  if (!blocked<D>(groups)) return sum_values_tiles<T, D>(values, offsets, n8, weights, groups, acc);
  switch (groups) {
#define TG_GROUP(G)                                                                        \
  case G:                                                                                  \
    return sum_values_blocked<T, D, G, chunk_block(D / 8, G)>(values, offsets, n8, weights, \
                                                              acc);
    TG_GROUP(1) TG_GROUP(2) TG_GROUP(3) TG_GROUP(4) TG_GROUP(5) TG_GROUP(6) TG_GROUP(7) TG_GROUP(8)
#undef TG_GROUP
  }
}

template <typename T, int D>
void attend_tiles(const T* q, const T* keys, const T* values, const int64_t* table,
                  int64_t start, int64_t len, int64_t block_size, int64_t block_stride,
                  int groups, float scale, T* out, Scratch& s) {
  static_assert(D % 8 == 0, "head dims are multiples of 8");
  const int64_t n = len - start, n8 = (n + 7) / 8 * 8;
  s.offsets.resize(static_cast<size_t>(n8));
  s.scores.resize(static_cast<size_t>(groups * n8));
  s.acc.resize(static_cast<size_t>(groups * D));
  // Each position's row, walking the table block by block (no division per position).
  for (int64_t i = 0, block = start / block_size, slot = start % block_size; i < n; ++i) {
    s.offsets[i] = table[block] * block_stride + slot * D;
    if (++slot == block_size) slot = 0, ++block;
  }
  for (int64_t i = n; i < n8; ++i) s.offsets[i] = s.offsets[n - 1];  // padding: a real row
  s.offsets.resize(static_cast<size_t>(n8 + kAhead), s.offsets[n - 1]);  // read-ahead past the end
  alignas(32) float qf[8][D];
  for (int g = 0; g < groups; ++g)
    for (int d = 0; d < D; ++d) qf[g][d] = to_float(q[g * D + d]) * scale;
  __m256 best[8];
  for (int g = 0; g < groups; ++g) best[g] = _mm256_set1_ps(-INFINITY);
  score_keys<T, D>(keys, s.offsets.data(), n8, qf, groups, s.scores.data(), best);
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  float total[8];
  for (int g = 0; g < groups; ++g) {
    const __m256 top = _mm256_set1_ps(tg::hmax8(best[g]));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      float* row = &s.scores[g * n8 + i];
      const __m256 valid = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps(float(i)), iota),
                                         _mm256_set1_ps(float(n)), _CMP_LT_OQ);
      const __m256 e = _mm256_and_ps(tg::exp8(_mm256_sub_ps(_mm256_loadu_ps(row), top)), valid);
      _mm256_storeu_ps(row, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[g] = tg::hsum8(sum);
  }
  sum_values<T, D>(values, s.offsets.data(), n8, s.scores.data(), groups, s.acc.data());
  for (int g = 0; g < groups; ++g) {
    const __m256 inv = _mm256_set1_ps(total[g] > 0.f ? 1.f / total[g] : 0.f);
    for (int c = 0; c < D; c += 8)
      tg::store8(out + g * D + c, _mm256_mul_ps(_mm256_loadu_ps(&s.acc[g * D + c]), inv));
  }
}
#endif

// Each thread's scratch: attend_one's scores, and attend_tiles' buffers where it builds.
struct Scratches {
  std::vector<float> scores;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  Scratch tiles;
#endif
};

template <typename T, int D>
int run(const T* q, const T* cache, const int64_t* tables, const int64_t* lens, T* out,
        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
        int64_t block_size, int64_t table_width, int64_t window, float scale, int threads) {
  const int groups = static_cast<int>(num_heads / num_kv_heads);
  const int64_t block_stride = block_size * D;
  return tg_decode::for_each_item<T, D, Scratches>(
      cache, tables, lens, out, num_seqs, num_heads, num_kv_heads, num_blocks, block_size,
      table_width, window, threads, [&](Scratches& s, const tg_decode::Item& it) {
        const T* keys = static_cast<const T*>(it.keys);
        const T* values = static_cast<const T*>(it.values);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if constexpr (!std::is_same_v<T, float>) {
          attend_tiles<T, D>(q + it.offset, keys, values, it.table, it.start, it.len,
                             block_size, block_stride, groups, scale, out + it.offset, s.tiles);
          return;
        }
#endif
        attend_one<T, D>(q + it.offset, keys, values, it.table, it.start, it.len, block_size,
                         block_stride, groups, scale, out + it.offset, s.scores);
      });
}

template <typename T>
int dispatch(const void* q, const void* cache, const int64_t* tables, const int64_t* lens,
             void* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
             int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t table_width,
             int64_t window, float scale, int threads) {
#define TG_HEAD_DIM(DIM)                                                                      \
  case DIM:                                                                                   \
    return run<T, DIM>(static_cast<const T*>(q), static_cast<const T*>(cache), tables, lens, \
                       static_cast<T*>(out), num_seqs, num_heads, num_kv_heads, num_blocks,   \
                       block_size, table_width, window, scale, threads);
  switch (head_dim) {
    TG_HEAD_DIMS(TG_HEAD_DIM)
    default:
      return 2;
  }
#undef TG_HEAD_DIM
}

}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0, or nonzero for a shape it does not
// handle (then the caller uses the torch path).
extern "C" int tg_paged_decode(int dtype, const void* q, const void* cache, const int64_t* tables,
                               const int64_t* lens, void* out, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                               int64_t block_size, int64_t head_dim, int64_t table_width,
                               int64_t window, float scale, int threads) {
  switch (dtype) {
    case 0:
      return dispatch<float>(q, cache, tables, lens, out, num_seqs, num_heads, num_kv_heads,
                             num_blocks, block_size, head_dim, table_width, window, scale,
                             threads);
    case 1:
      // AVX-512 BF16 where the CPU has it (paged_attention_avx512.cpp), for the shapes it takes.
      if (tg_use_avx512_bf16(-1) &&
          tg_paged_decode_bf16_avx512(q, cache, tables, lens, out, num_seqs, num_heads,
                                      num_kv_heads, num_blocks, block_size, head_dim,
                                      table_width, window, scale, threads) == 0)
        return 0;
      return dispatch<uint16_t>(q, cache, tables, lens, out, num_seqs, num_heads, num_kv_heads,
                                num_blocks, block_size, head_dim, table_width, window, scale,
                                threads);
    case 2:
      return dispatch<_Float16>(q, cache, tables, lens, out, num_seqs, num_heads, num_kv_heads,
                                num_blocks, block_size, head_dim, table_width, window, scale,
                                threads);
    default:
      return 3;
  }
}
