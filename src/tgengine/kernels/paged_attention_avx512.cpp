// Decode attention on a bf16 paged KV cache with AVX-512 BF16: paged_attention.cpp's
// computation (same layout, same arguments), 16 positions at a time.
//   scores: each key row times each query head with vdpbf16ps (bf16 products, exact in
//           float32, summed in float32), 16 positions' partial sums reduced at once
//           (hsum16x16), then scaled: q . k * scale, where the AVX2 form scales q first;
//   softmax: float32, 16-wide exp (exp16: paged_attention.cpp's exp8, 16 lanes);
//   values:  each value row widened to float32 once and added, weighted, into every query
//           head's float32 sums (held in registers, a block of the head's outputs at a time).
// Built with -mavx512f -mavx512bw -mavx512bf16 on any machine (kernels/__init__.py), run
// only where the CPU has them: tg_paged_decode asks tg_use_avx512_bf16 first. Handles head
// dims that are multiples of 32 and groups of up to 8 query heads; 1 (refused) otherwise,
// and tg_paged_decode takes its own path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_decode_items.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int64_t kTile = 16;   // positions per tile of scores
constexpr int64_t kAhead = 32;  // positions read ahead (blocks lie anywhere in the cache)
constexpr int kAccRegisters = 24;  // float32 sums a block of the values' pass may hold

// exp(x) to about one ulp of float32, 16 at a time (tg::exp8's Cephes polynomial).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i scale =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(scale));
}

// Lane i of the result: the sum of v[i]'s 16 lanes.
inline __m512 hsum16x16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: 4 vectors' sums of that lane
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // across 128-bit lanes, pairwise
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// 16 bf16 as 16 float32 (exact).
inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int D>
inline void prefetch_row(const uint16_t* row) {
  for (int c = 0; c < D * 2; c += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + c, _MM_HINT_T0);
}

struct Scratch {
  std::vector<int64_t> offsets;  // each position's row in the cache (padded with the last)
  std::vector<float> scores;     // [groups][positions padded to 16]
};

// scores[g][i] = q[g] . key[i] * scale for the tile's 16 positions; best[g] their max.
template <int D>
void score_keys(const uint16_t* q, const uint16_t* keys, const int64_t* offsets, int64_t n16,
                int groups, float scale, float* scores, __m512* best) {
  constexpr int C = D / 32;  // 32 bf16 (a register) per chunk of the head
  __m512bh qv[8][C];
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n16; i += kTile) {
    for (int p = 0; p < kTile; ++p) prefetch_row<D>(keys + offsets[i + kAhead + p]);
    for (int g = 0; g < groups; ++g) {
      __m512 v[kTile];
      for (int p = 0; p < kTile; ++p) {
        const uint16_t* k = keys + offsets[i + p];
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
          a = _mm512_dpbf16_ps(a, qv[g][c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
        v[p] = a;
      }
      const __m512 s = _mm512_mul_ps(hsum16x16(v), scales);
      _mm512_storeu_ps(scores + g * n16 + i, s);
      best[g] = _mm512_max_ps(best[g], s);  // padding repeats a real score: harmless
    }
  }
}

// acc[g][d] = sum over positions of weights[g][i] * value[i][d], NC chunks of 16 outputs of
// every head at a time, in registers.
template <int D, int G, int NC>
void sum_values_blocked(const uint16_t* values, const int64_t* offsets, int64_t n,
                        int64_t n16, const float* weights, float* acc) {
  static_assert((D / 16) % NC == 0 && G * NC <= kAccRegisters, "blocks tile the head");
  for (int c0 = 0; c0 < D / 16; c0 += NC) {
    __m512 a[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      if (c0 == 0 && i % kTile == 0)
        for (int p = 0; p < kTile; ++p) prefetch_row<D>(values + offsets[i + kAhead + p]);
      const uint16_t* row = values + offsets[i] + 16 * c0;
      __m512 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(weights[g * n16 + i]);
      for (int c = 0; c < NC; ++c) {
        const __m512 v = widen16(row + 16 * c);
        for (int g = 0; g < G; ++g) a[g][c] = _mm512_fmadd_ps(w[g], v, a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + 16 * (c0 + c), a[g][c]);
  }
}

constexpr int chunk_block(int chunks, int groups) {
  for (int nc : {16, 8, 4, 2})
    if (chunks % nc == 0 && groups * nc <= kAccRegisters) return nc;
  return 1;
}

template <int D>
void sum_values(const uint16_t* values, const int64_t* offsets, int64_t n, int64_t n16,
                const float* weights, int groups, float* acc) {
  switch (groups) {
#define TG_GROUP(G)                                                                    \
  case G:                                                                              \
    return sum_values_blocked<D, G, chunk_block(D / 16, G)>(values, offsets, n, n16,   \
                                                            weights, acc);
    TG_GROUP(1) TG_GROUP(2) TG_GROUP(3) TG_GROUP(4) TG_GROUP(5) TG_GROUP(6) TG_GROUP(7) TG_GROUP(8)
#undef TG_GROUP
  }
}

template <int D>
void attend(const uint16_t* q, const uint16_t* keys, const uint16_t* values,
            const int64_t* table, int64_t start, int64_t len, int64_t block_size,
            int64_t block_stride, int groups, float scale, uint16_t* out, Scratch& s) {
  const int64_t n = len - start, n16 = (n + kTile - 1) / kTile * kTile;
  s.offsets.resize(static_cast<size_t>(n16));
  s.scores.resize(static_cast<size_t>(groups * n16));
  for (int64_t i = 0, block = start / block_size, slot = start % block_size; i < n; ++i) {
    s.offsets[i] = table[block] * block_stride + slot * D;
    if (++slot == block_size) slot = 0, ++block;
  }
  for (int64_t i = n; i < n16; ++i) s.offsets[i] = s.offsets[n - 1];  // padding: a real row
  s.offsets.resize(static_cast<size_t>(n16 + kAhead + kTile), s.offsets[n - 1]);  // read-ahead
  __m512 best[8];
  for (int g = 0; g < groups; ++g) best[g] = _mm512_set1_ps(-INFINITY);
  score_keys<D>(q, keys, s.offsets.data(), n16, groups, scale, s.scores.data(), best);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float total[8];
  for (int g = 0; g < groups; ++g) {
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best[g]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n16; i += kTile) {
      float* row = &s.scores[g * n16 + i];
      const __mmask16 valid = _mm512_cmp_ps_mask(
          _mm512_add_ps(_mm512_set1_ps(float(i)), iota), _mm512_set1_ps(float(n)), _CMP_LT_OQ);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(row), top)));
      _mm512_storeu_ps(row, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  alignas(64) float acc[8 * D];
  sum_values<D>(values, s.offsets.data(), n, n16, s.scores.data(), groups, acc);
  for (int g = 0; g < groups; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    for (int d = 0; d < D; ++d) tg::from_float(acc[g * D + d] * inv, out + g * D + d);
  }
}

template <int D>
int run(const uint16_t* q, const uint16_t* cache, const int64_t* tables, const int64_t* lens,
        uint16_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
        int64_t num_blocks, int64_t block_size, int64_t table_width, int64_t window,
        float scale, int threads) {
  const int groups = static_cast<int>(num_heads / num_kv_heads);
  return tg_decode::for_each_item<uint16_t, D, Scratch>(
      cache, tables, lens, out, num_seqs, num_heads, num_kv_heads, num_blocks, block_size,
      table_width, window, threads, [&](Scratch& scratch, const tg_decode::Item& it) {
        attend<D>(q + it.offset, static_cast<const uint16_t*>(it.keys),
                  static_cast<const uint16_t*>(it.values), it.table, it.start, it.len,
                  block_size, block_size * D, groups, scale, out + it.offset, scratch);
      });
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
