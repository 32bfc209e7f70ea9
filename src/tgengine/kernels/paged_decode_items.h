// The work items of one decode attention call, for each of its forms (paged_attention.cpp,
// paged_attention_avx512.cpp): one item a (sequence, KV head) pair, spread over the threads
// (contexts differ in length: dynamically, for_each_item, or in runs of consecutive items of
// about equal positions, for_each_item_in_runs, which tells each item the next),
// each given the keys it sees — [start, len), the last `window` of them where a window is
// set — and where its query heads sit in q and out. A sequence with no context gets zeros.
// Plain C++ and OpenMP: it builds with either form's flags.
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

// The hint with which either form asks for the rows it reads ahead. Where the library is built
// for AVX-512, into L2 (T1), not L1: a request into L1 holds one of the core's few L1 miss
// buffers (about 24 on Zen 4) for the whole trip to memory, which caps the reads near 13 GB/s,
// while L2 keeps many more in flight. On a Zen 4 VM (32 sequences, 30 layers' cache from
// memory, one thread), per position and KV head with each sequence's blocks in order /
// anywhere: the bf16 kernel T0 25 / 35-39 ns (no prefetch at all: 26 / 37), T1 14-15 / 17-18
// (a loop that only reads the same bytes: 12-15); an fp16 cache (the AVX2 form) 28.6 / 44 ->
// 26-27 / 29-30. On Zen 5 the two hints measured the same (benchmarks history, fifteenth
// round). AVX2 builds keep T0, what they were measured with.
#if defined(__AVX512F__)
#define TG_DECODE_PREFETCH_HINT _MM_HINT_T1
#else
#define TG_DECODE_PREFETCH_HINT _MM_HINT_T0
#endif

namespace tg_decode {

struct Item {
  const void* keys;      // the KV head's keys in the cache (its values follow at values)
  const void* values;
  const int64_t* table;  // the sequence's block table
  int64_t start, len;    // the visible positions [start, len)
  int64_t offset;        // of its first query head in q and out
};

// Item i of a call: (sequence i / num_kv_heads, KV head i % num_kv_heads).
struct Items {
  const void* cache;
  const int64_t *tables, *lens;
  int64_t num_heads, num_kv_heads, groups, table_width, window, head_stride, values_offset;
  int64_t head_dim;

  template <typename T>
  Item at(int64_t i) const {
    const int64_t seq = i / num_kv_heads, head = i % num_kv_heads;
    const int64_t len = lens[seq];
    const int64_t offset = (seq * num_heads + head * groups) * head_dim;
    const T* keys = static_cast<const T*>(cache) + head * head_stride;
    const int64_t start = window > 0 && len > window ? len - window : 0;
    return Item{keys, keys + values_offset, tables + seq * table_width, start, len, offset};
  }
};

// The items, or 1 where the query heads do not split evenly over the KV heads (or more than
// 8 share one): then *items is untouched.
template <int D>
int make_items(const void* cache, const int64_t* tables, const int64_t* lens, int64_t num_heads,
               int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
               int64_t table_width, int64_t window, Items* items) {
  const int64_t groups = num_heads / num_kv_heads;
  if (groups > 8 || groups * num_kv_heads != num_heads) return 1;
  const int64_t head_stride = num_blocks * block_size * D;
  *items = Items{cache, tables, lens, num_heads, num_kv_heads, groups, table_width, window,
                 head_stride, num_kv_heads * head_stride, D};
  return 0;
}

// attend(scratch, item) for every item with a context, one Scratch per thread; 1 where the
// query heads do not split evenly over the KV heads (or more than 8 share one), else 0.
template <typename T, int D, typename Scratch, typename Attend>
int for_each_item(const T* cache, const int64_t* tables, const int64_t* lens, T* out,
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                  int64_t block_size, int64_t table_width, int64_t window, int threads,
                  Attend&& attend) {
  Items items;
  if (make_items<D>(cache, tables, lens, num_heads, num_kv_heads, num_blocks, block_size,
                    table_width, window, &items))
    return 1;
  const int64_t count = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      const Item it = items.at<T>(i);
      if (it.len <= 0) {
        for (int64_t j = 0; j < items.groups * D; ++j) tg::from_float(0.f, out + it.offset + j);
        continue;
      }
      attend(scratch, it);
    }
  }
  return 0;
}

constexpr int64_t kRunsPerThread = 4;

// for_each_item's work in runs of consecutive items of about the same number of positions,
// kRunsPerThread a thread, each run on one thread (so that it knows which item comes next):
// attend(scratch, item, next) with next the run's next item with a context, or null.
template <typename T, int D, typename Scratch, typename Attend>
int for_each_item_in_runs(const T* cache, const int64_t* tables, const int64_t* lens, T* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t num_blocks, int64_t block_size, int64_t table_width,
                          int64_t window, int threads, Attend&& attend) {
  Items items;
  if (make_items<D>(cache, tables, lens, num_heads, num_kv_heads, num_blocks, block_size,
                    table_width, window, &items))
    return 1;
  const int64_t count = num_seqs * num_kv_heads;
  // Each item's cost: its positions, and a few tiles' worth for its setup.
  auto cost = [&](int64_t seq) {
    const int64_t len = lens[seq], start = window > 0 && len > window ? len - window : 0;
    return (len > 0 ? len - start : 0) + 64;
  };
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += cost(s) * num_kv_heads;
  // A few runs a thread, taken dynamically: a thread the OS holds back (a busy core) leaves
  // its other runs to the rest.
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(threads * kRunsPerThread, count));
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < runs; ++r) {
      // Run r: the items whose positions before them, of the total, fall in [r, r + 1) / runs.
      int64_t first = -1, last = -1, before = 0;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t owner = before * runs / total;
        if (owner > r) break;
        if (owner == r) {
          if (first < 0) first = i;
          last = i + 1;
        }
        before += cost(i / num_kv_heads);
      }
      for (int64_t i = first; first >= 0 && i < last; ++i) {
        const Item it = items.at<T>(i);
        if (it.len <= 0) {
          for (int64_t j = 0; j < items.groups * D; ++j) tg::from_float(0.f, out + it.offset + j);
          continue;
        }
        int64_t n = i + 1;
        while (n < last && lens[n / num_kv_heads] <= 0) ++n;
        const Item next = items.at<T>(n < last ? n : i);
        attend(scratch, it, n < last ? &next : nullptr);
      }
    }
  }
  return 0;
}

}  // namespace tg_decode
