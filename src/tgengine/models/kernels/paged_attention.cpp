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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "half.h"

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

template <typename T, int D>
int run(const T* q, const T* cache, const int64_t* tables, const int64_t* lens, T* out,
        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
        int64_t block_size, int64_t table_width, int64_t window, float scale, int threads) {
  const int groups = static_cast<int>(num_heads / num_kv_heads);
  if (groups > 8 || groups * num_kv_heads != num_heads) return 1;
  const int64_t block_stride = block_size * D;
  const int64_t head_stride = num_blocks * block_stride;
  const int64_t values_offset = num_kv_heads * head_stride;
  const int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t seq = item / num_kv_heads, head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t start = window > 0 && len > window ? len - window : 0;
      const int64_t offset = (seq * num_heads + head * groups) * D;
      if (len <= 0) {
        for (int64_t i = 0; i < groups * D; ++i) from_float(0.f, out + offset + i);
        continue;
      }
      const T* keys = cache + head * head_stride;
      attend_one<T, D>(q + offset, keys, keys + values_offset, tables + seq * table_width,
                       start, len, block_size, block_stride, groups, scale, out + offset,
                       scores);
    }
  }
  return 0;
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
    TG_HEAD_DIM(32)
    TG_HEAD_DIM(64)
    TG_HEAD_DIM(80)
    TG_HEAD_DIM(96)
    TG_HEAD_DIM(128)
    TG_HEAD_DIM(256)
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
