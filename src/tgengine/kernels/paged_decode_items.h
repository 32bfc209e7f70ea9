// The work items of one decode attention call, for each of its forms (paged_attention.cpp,
// paged_attention_avx512.cpp): one item a (sequence, KV head) pair, spread over the threads
// (dynamic: contexts differ in length), each given the keys it sees — [start, len), the last
// `window` of them where a window is set — and where its query heads sit in q and out. A
// sequence with no context gets zeros. Plain C++ and OpenMP: it builds with either form's flags.
#pragma once

#include <cstdint>

#include "simd.h"

namespace tg_decode {

struct Item {
  const void* keys;      // the KV head's keys in the cache (its values follow at values)
  const void* values;
  const int64_t* table;  // the sequence's block table
  int64_t start, len;    // the visible positions [start, len)
  int64_t offset;        // of its first query head in q and out
};

// attend(scratch, item) for every item with a context, one Scratch per thread; 1 where the
// query heads do not split evenly over the KV heads (or more than 8 share one), else 0.
template <typename T, int D, typename Scratch, typename Attend>
int for_each_item(const T* cache, const int64_t* tables, const int64_t* lens, T* out,
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                  int64_t block_size, int64_t table_width, int64_t window, int threads,
                  Attend&& attend) {
  const int64_t groups = num_heads / num_kv_heads;
  if (groups > 8 || groups * num_kv_heads != num_heads) return 1;
  const int64_t head_stride = num_blocks * block_size * D;
  const int64_t values_offset = num_kv_heads * head_stride;
  const int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t seq = i / num_kv_heads, head = i % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t offset = (seq * num_heads + head * groups) * D;
      if (len <= 0) {
        for (int64_t j = 0; j < groups * D; ++j) tg::from_float(0.f, out + offset + j);
        continue;
      }
      const T* keys = cache + head * head_stride;
      const int64_t start = window > 0 && len > window ? len - window : 0;
      attend(scratch, Item{keys, keys + values_offset, tables + seq * table_width, start, len,
                           offset});
    }
  }
  return 0;
}

}  // namespace tg_decode
