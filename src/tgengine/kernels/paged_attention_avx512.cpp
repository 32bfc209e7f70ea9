// Decode attention on a bf16 paged KV cache with AVX-512 BF16: paged_attention.cpp's
// computation (same layout, same arguments), 16 positions at a time.
//   scores:  q . k * scale with vdpbf16ps (bf16 products, exact in float32, summed in
//            float32), where the AVX2 form scales q first; two positions' rows share a
//            register (a half each), so that 16 positions' partial sums take 8 registers
//            and a cheaper transposed sum (hsum_pairs) than one register each;
//   softmax: float32, 16-wide exp (exp16: paged_attention.cpp's exp8, 16 lanes); the weights
//            exp(score - max) rounded to bf16, as the torch path rounds its probabilities,
//            and normalised by their (rounded) sum at the end;
//   values:  two positions at a time with vdpbf16ps: their value rows interleaved (bf16
//            pairs) times their weights' pair, into every query head's float32 sums (held
//            in registers, a block of the head's outputs at a time), put back in order once.
// The reads, not the arithmetic, bound it at 32 sequences (contexts from DRAM, in 2 KB blocks
// anywhere: one core reads such a pattern at 22-25 GB/s, not its 40 of one stream), so it keeps
// the memory busy: each tile of the score pass fetches its value rows too, for the values'
// pass to find them in cache, and the items go in runs of consecutive ones, a few a thread
// (tg_decode::for_each_item_in_runs), each fetching the next item's keys before its softmax
// and during its values' pass. The requests are spread through the arithmetic, a few rows
// at each step, not asked a tile at a time: a burst of 64 lines fills the core's few L1 miss
// buffers and stalls the sums behind it until the memory answers (Intel Xeon VM, amx, 32
// sequences, 30 layers' cache from memory, 1 / 2 threads: 40.2 / 20.5 -> 34.0 / 17.4 ms; a
// loop that only reads the same bytes takes 29 / 13.8). Built with -mavx512f -mavx512bw
// -mavx512bf16 on any machine (kernels/__init__.py), run only where the CPU has them:
// tg_paged_decode asks tg_use_avx512_bf16 first. Handles head dims that are multiples of 32
// and groups of up to 8 query heads; 1 (refused) otherwise, and tg_paged_decode takes its
// own path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_decode_items.h"
#include "simd.h"
#include "simd512.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int64_t kTile = 16;   // positions per tile of scores
constexpr int64_t kAhead = 32;  // positions read ahead (blocks lie anywhere in the cache)
constexpr int kAccRegisters = 24;  // float32 sums a block of the values' pass may hold
// Tiles of the next item's keys fetched before an item's softmax, the rest during its values'
// pass (32 sequences, one thread: none 12.3-12.9 ms, 2-8 11.6-12.5, 16-32 12.4-13.9).
constexpr int kEarlyTiles = 4;

using tg::bf16_bits16;
using tg::exp16;
using tg::widen16;

// A key row's 16-bf16 pieces j of positions a and b side by side: [a's | b's].
inline __m512bh pair_piece(const uint16_t* a, const uint16_t* b, int j) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * j));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * j));
  return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Lane p of the result: the sum of the 8 lanes of positions p's half of v: v[m] holds
// position m's partial sums in lanes 0-7 and position m + 8's in lanes 8-15.
inline __m512 hsum_pairs(const __m512* v) {
  __m512 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // element e of 128-bit lane L: v[4i + e]'s lane L summed
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  // 128-bit lanes: positions 0-3, 8-11, 4-7, 12-15; then in order.
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                 _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  return _mm512_shuffle_f32x4(w, w, 0xD8);
}

template <int D>
inline void prefetch_row(const uint16_t* row) {
  for (int c = 0; c < D * 2; c += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + c, TG_DECODE_PREFETCH_HINT);
}

// Fetches rows of an item's keys ahead of its turn, a few at a time, in order: the values'
// pass of one item reads its rows from cache (the scores' pass fetched them), so the memory
// reads the next item's keys meanwhile.
template <int D>
struct RowFetcher {
  const uint16_t* base = nullptr;
  const int64_t* table = nullptr;
  int64_t block = 0, slot = 0, left = 0, block_size = 1, block_stride = 0;

  void fetch_rows(int rows) {
    for (int p = 0; p < rows && left > 0; ++p, --left) {
      prefetch_row<D>(base + table[block] * block_stride + slot * D);
      if (++slot == block_size) slot = 0, ++block;
    }
  }
};

struct Scratch {
  std::vector<int64_t> offsets;  // each position's row in the cache (padded with the last)
  std::vector<float> scores;     // [groups][positions padded to 16]
  std::vector<uint16_t> weights;  // [groups][positions padded to 16]: exp(score - max), bf16
  // Whose positions offsets holds: a sequence's KV heads come one after another in a run.
  const int64_t* table = nullptr;
  int64_t start = -1, len = -1;
};

// scores[g][i] = q[g] . key[i] * scale for the tile's 16 positions; best[g] their max. Each
// tile's value rows are fetched too, for the values' pass to find them in cache.
template <int D, int G>
void score_keys(const uint16_t* q, const uint16_t* keys, const uint16_t* values,
                const int64_t* offsets, int64_t n16, float scale, float* scores, __m512* best) {
  constexpr int P = D / 16;  // 16-bf16 pieces of a row
  __m512bh qq[G][P];         // [piece j | piece j]
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < P; ++j) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * D + 16 * j));
      qq[g][j] = (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
    }
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n16; i += kTile) {
    __m512 v[G][8];
    for (int m = 0; m < 8; ++m) {
      prefetch_row<D>(keys + offsets[i + kAhead + m]);
      prefetch_row<D>(keys + offsets[i + kAhead + m + 8]);
      prefetch_row<D>(values + offsets[i + m]);
      prefetch_row<D>(values + offsets[i + m + 8]);
      const uint16_t* a = keys + offsets[i + m];
      const uint16_t* b = keys + offsets[i + m + 8];
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int j = 0; j < P; ++j) {
        const __m512bh k = pair_piece(a, b, j);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], qq[g][j], k);
      }
      for (int g = 0; g < G; ++g) v[g][m] = acc[g];
    }
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_mul_ps(hsum_pairs(v[g]), scales);
      _mm512_storeu_ps(scores + g * n16 + i, s);
      best[g] = _mm512_max_ps(best[g], s);  // padding repeats a real score: harmless
    }
  }
}

// acc[g] = sum over positions of weights[g][i] * value[i], two positions at a time with
// vdpbf16ps (their value rows interleaved, their weights a bf16 pair), NC chunks of 32 of
// every head's outputs at a time, in registers. acc's order within each chunk of 32 is
// unpacklo/hi's: put_outputs puts it back.
template <int D, int G, int NC>
void sum_values_blocked(const uint16_t* values, const int64_t* offsets, int64_t n,
                        int64_t n16, const uint16_t* weights, float* acc,
                        RowFetcher<D>& next_keys) {
  static_assert((D / 32) % NC == 0 && 2 * G * NC <= kAccRegisters, "blocks tile the head");
  for (int c0 = 0; c0 < D / 32; c0 += NC) {
    __m512 a[G][2 * NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 2 * NC; ++c) a[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 2) {  // an odd n's last pair: a padding row, weight 0
      if (c0 == 0) {  // two rows of each, every pair of positions
        prefetch_row<D>(values + offsets[i + kAhead]);
        prefetch_row<D>(values + offsets[i + kAhead + 1]);
        next_keys.fetch_rows(2);
      }
      const uint16_t* r0 = values + offsets[i] + 32 * c0;
      const uint16_t* r1 = values + offsets[i + 1] + 32 * c0;
      __m512bh w[G];
      for (int g = 0; g < G; ++g) {
        int32_t pair;
        std::memcpy(&pair, weights + g * n16 + i, sizeof pair);
        w[g] = (__m512bh)_mm512_set1_epi32(pair);
      }
      for (int c = 0; c < NC; ++c) {
        const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        for (int g = 0; g < G; ++g) {
          a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], w[g], lo);
          a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], w[g], hi);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(acc + g * D + 16 * (2 * c0 + c), a[g][c]);
  }
}

// 32-bf16 chunks per register block of the values' pass: the most that fit for G heads.
constexpr int chunk_block(int chunks, int groups) {
  for (int nc : {8, 4, 2})
    if (chunks % nc == 0 && 2 * groups * nc <= kAccRegisters) return nc;
  return 1;
}

// out[g] = acc[g] * inv[g] as bf16, each chunk of 32 back in order: 16-lane halves lo and hi
// hold outputs (8k + e) and (8k + 4 + e) in lane 4k + e (unpacklo/hi's order).
template <int D, int G>
void put_outputs(const float* acc, const float* inv, uint16_t* out) {
  for (int g = 0; g < G; ++g) {
    const __m512 scale = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < D / 32; ++c) {
      const __m512 lo = _mm512_loadu_ps(acc + g * D + 32 * c);
      const __m512 hi = _mm512_loadu_ps(acc + g * D + 32 * c + 16);
      const __m512 first = _mm512_shuffle_f32x4(lo, hi, 0x44), second = _mm512_shuffle_f32x4(lo, hi, 0xEE);
      __m256i* o = reinterpret_cast<__m256i*>(out + g * D + 32 * c);
      _mm256_storeu_si256(o, bf16_bits16(_mm512_mul_ps(_mm512_shuffle_f32x4(first, first, 0xD8), scale)));
      _mm256_storeu_si256(o + 1, bf16_bits16(_mm512_mul_ps(_mm512_shuffle_f32x4(second, second, 0xD8), scale)));
    }
  }
}

template <int D, int G>
void attend(const uint16_t* q, const uint16_t* keys, const uint16_t* values,
            const int64_t* table, int64_t start, int64_t len, int64_t block_size,
            int64_t block_stride, float scale, uint16_t* out, const tg_decode::Item* next,
            Scratch& s) {
  const int64_t n = len - start, n16 = (n + kTile - 1) / kTile * kTile;
  s.scores.resize(static_cast<size_t>(G * n16));
  s.weights.resize(static_cast<size_t>(G * n16));
  if (table != s.table || start != s.start || len != s.len) {
    s.offsets.resize(static_cast<size_t>(n16));
    for (int64_t i = 0, block = start / block_size, slot = start % block_size; i < n; ++i) {
      s.offsets[i] = table[block] * block_stride + slot * D;
      if (++slot == block_size) slot = 0, ++block;
    }
    for (int64_t i = n; i < n16; ++i) s.offsets[i] = s.offsets[n - 1];  // padding: a real row
    s.offsets.resize(static_cast<size_t>(n16 + kAhead + kTile), s.offsets[n - 1]);  // read-ahead
    s.table = table, s.start = start, s.len = len;
  }
  __m512 best[G];
  for (int g = 0; g < G; ++g) best[g] = _mm512_set1_ps(-INFINITY);
  score_keys<D, G>(q, keys, values, s.offsets.data(), n16, scale, s.scores.data(), best);
  RowFetcher<D> next_keys;  // the memory's work while the softmax runs, and the values'
  if (next)
    next_keys = RowFetcher<D>{static_cast<const uint16_t*>(next->keys), next->table,
                              next->start / block_size, next->start % block_size,
                              next->len - next->start, block_size, block_stride};
  next_keys.fetch_rows(kEarlyTiles * kTile);
  // Weights exp(score - max) rounded to bf16 (as the torch path rounds its probabilities),
  // zero past the context; their sum, of the rounded weights, normalises the output.
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float inv[G];
  for (int g = 0; g < G; ++g) {
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best[g]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n16; i += kTile) {
      const __mmask16 valid = _mm512_cmp_ps_mask(
          _mm512_add_ps(_mm512_set1_ps(float(i)), iota), _mm512_set1_ps(float(n)), _CMP_LT_OQ);
      const __m512 e = _mm512_maskz_mov_ps(
          valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(&s.scores[g * n16 + i]), top)));
      const __m256i w = bf16_bits16(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&s.weights[g * n16 + i]), w);
      sum = _mm512_add_ps(sum, widen16(w));
    }
    const float total = _mm512_reduce_add_ps(sum);
    inv[g] = total > 0.f ? 1.f / total : 0.f;
  }
  alignas(64) float acc[G * D];
  sum_values_blocked<D, G, chunk_block(D / 32, G)>(values, s.offsets.data(), n, n16,
                                                   s.weights.data(), acc, next_keys);
  put_outputs<D, G>(acc, inv, out);
}

template <int D>
int run(const uint16_t* q, const uint16_t* cache, const int64_t* tables, const int64_t* lens,
        uint16_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
        int64_t num_blocks, int64_t block_size, int64_t table_width, int64_t window,
        float scale, int threads) {
  const int64_t groups = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  switch (groups) {
#define TG_GROUP(G)                                                                         \
  case G:                                                                                   \
    return tg_decode::for_each_item_in_runs<uint16_t, D, Scratch>(                          \
        cache, tables, lens, out, num_seqs, num_heads, num_kv_heads, num_blocks, block_size, \
        table_width, window, threads,                                                       \
        [&](Scratch& scratch, const tg_decode::Item& it, const tg_decode::Item* next) {     \
          attend<D, G>(q + it.offset, static_cast<const uint16_t*>(it.keys),                \
                       static_cast<const uint16_t*>(it.values), it.table, it.start, it.len, \
                       block_size, block_size * D, scale, out + it.offset, next, scratch);  \
        });
    TG_GROUP(1) TG_GROUP(2) TG_GROUP(3) TG_GROUP(4) TG_GROUP(5) TG_GROUP(6) TG_GROUP(7) TG_GROUP(8)
#undef TG_GROUP
    default:
      return 1;
  }
}

}  // namespace

// tg_paged_decode's arguments, for a bf16 cache; 0, or nonzero for a shape it does not
// handle (a head dim not a multiple of 32, more than 8 query heads a KV head).
extern "C" int tg_paged_decode_bf16_avx512(const void* q, const void* cache,
                                           const int64_t* tables, const int64_t* lens,
                                           void* out, int64_t num_seqs, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t num_blocks,
                                           int64_t block_size, int64_t head_dim,
                                           int64_t table_width, int64_t window, float scale,
                                           int threads) {
  switch (head_dim) {
#define TG_HEAD_DIM(DIM)                                                                    \
  case DIM:                                                                                 \
    return run<DIM>(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(cache),  \
                    tables, lens, static_cast<uint16_t*>(out), num_seqs, num_heads,        \
                    num_kv_heads, num_blocks, block_size, table_width, window, scale,      \
                    threads);
    TG_HEAD_DIM(32) TG_HEAD_DIM(64) TG_HEAD_DIM(96) TG_HEAD_DIM(128) TG_HEAD_DIM(256)
#undef TG_HEAD_DIM
    default:
      return 2;
  }
}

#else  // a compiler without AVX-512 BF16

extern "C" int tg_paged_decode_bf16_avx512(const void*, const void*, const int64_t*,
                                           const int64_t*, void*, int64_t, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                           int) {
  return 3;
}

#endif
