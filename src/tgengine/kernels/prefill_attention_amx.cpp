// Prefill attention on AMX tiles, for a bf16 cache: prefill_attention.cpp's work (one span of
// a sequence's n query positions, the last n of its len keys, causal, an optional sliding
// window, read from the paged cache in place), its two products on tiles instead of float32
// FMAs. tg_paged_prefill calls it where the AMX kernels are on (tg_use_amx) and takes the
// AVX2 / AVX-512 kernel where it answers 3. Built with -mamx-tile -mamx-bf16 -mavx512bf16
// whatever the CPU (kernels/__init__.py).
//
// First each KV head's keys and values are laid out, a block of 32 keys at a time, as the
// tiles read them: keys as two B tiles a 32 dims (pairs of dims down, 16 keys across), values
// as one B tile a 16 dims (pairs of keys down, 16 dims across). Then one work item is (KV
// head, 16 query positions), its rows (position x query head of the group) zero-padded to
// whole tiles of 16: for each block of 32 keys, the scores (one A tile of queries by two key
// tiles), soft-maxed online in float32 16 lanes at a time (running max and sum per row, the
// probabilities rounded to bf16 for the second product, as torch's flash kernel does), then
// probabilities times values, added into the rows' float32 output. Blocks entirely hidden by
// the causal mask or the window are skipped.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "amx.h"
#include "simd.h"
#include "simd512.h"

extern "C" int tg_cpu_has_amx();  // pair_panels_amx.cpp

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace {

constexpr int kKeys = 32;        // keys a block: one tile of probabilities (16 pairs)
constexpr int kPositions = 16;   // query positions per work item
constexpr int kTile = 16;        // rows of a tile, float32 columns of a sums tile
constexpr int64_t kTileElems = 512;  // bf16 values in a tile of 16 rows of 64 bytes
constexpr int kMaxRows = kPositions * 8;  // 8 query heads a KV head at most

// The dims of a key padded to whole tile steps of 32, the steps, and a block's bf16 values.
template <int D>
struct Shape {
  static constexpr int padded = (D + 31) / 32 * 32, steps = padded / 32;
  static constexpr int64_t keys = 2 * steps * kTileElems;  // [half][step][pair][key][2]
  static constexpr int64_t values = D / 16 * kTileElems;   // [16 dims][pair of keys][dim][2]
};

// Block blk of one KV head's keys and values as the tiles read them; keys past len are zero.
template <int D>
void pack_block(const uint16_t* keys, const uint16_t* values, const int64_t* table,
                int64_t len, int64_t block_size, int64_t blk, uint16_t* kt, uint16_t* vt) {
  using S = Shape<D>;
  for (int p = 0; p < kKeys; ++p) {
    const int64_t pos = blk * kKeys + p;
    const uint16_t *krow = nullptr, *vrow = nullptr;
    if (pos < len) {
      const int64_t at = table[pos / block_size] * block_size * D + (pos % block_size) * D;
      krow = keys + at;
      vrow = values + at;
    }
    const int half = p / kTile, key = p % kTile;
    for (int d = 0; d < S::padded; d += 2) {
      uint16_t* dst = kt + ((half * S::steps + d / 32) * kTile + (d % 32) / 2) * 32 + 2 * key;
      dst[0] = krow && d < D ? krow[d] : 0;
      dst[1] = krow && d < D ? krow[d + 1] : 0;  // D is even
    }
    const int pair = p / 2, odd = p % 2;
    for (int d = 0; d < D; ++d)
      vt[((d / 16) * kTile + pair) * 32 + 2 * (d % 16) + odd] = vrow ? vrow[d] : 0;
  }
}

// One thread's rows of a work item: queries (bf16, padded), scores, probabilities, outputs.
template <int D>
struct Rows {
  alignas(64) uint16_t q[kMaxRows * Shape<D>::padded];
  alignas(64) float scores[kMaxRows * kKeys];
  alignas(64) uint16_t probs[kMaxRows * kKeys];
  alignas(64) float out[kMaxRows * D];
  alignas(64) float sums[kTile * 32];
  float best[kMaxRows], total[kMaxRows];
};

// scores[r][0..32) = q[r] . the block's 32 keys, for the rows of row tiles [0, tiles).
template <int D>
void score_tiles(Rows<D>& w, int tiles, const uint16_t* kt) {
  using S = Shape<D>;
  for (int a = 0; a < tiles; ++a) {
    _tile_zero(0);
    _tile_zero(1);
    for (int s = 0; s < S::steps; ++s) {
      _tile_loadd(2, w.q + a * kTile * S::padded + s * 32, S::padded * 2);
      _tile_loadd(3, kt + s * kTileElems, 64);
      _tile_loadd(4, kt + (S::steps + s) * kTileElems, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, w.scores + a * kTile * kKeys, kKeys * 4);
    _tile_stored(1, w.scores + a * kTile * kKeys + kTile, kKeys * 4);
  }
}

// out[r] += probs[r] . the block's values, for rows [0, rows) (row tiles [0, tiles)).
template <int D>
void add_value_tiles(Rows<D>& w, int rows, int tiles, const uint16_t* vt) {
  constexpr int cols = D / 16;
  for (int a = 0; a < tiles; ++a) {
    _tile_loadd(2, w.probs + a * kTile * kKeys, kKeys * 2);
    for (int c = 0; c < cols; c += 2) {
      const bool two = c + 1 < cols;
      _tile_zero(0);
      _tile_loadd(3, vt + c * kTileElems, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_stored(0, w.sums, 32 * 4);
      if (two) {
        _tile_zero(1);
        _tile_loadd(4, vt + (c + 1) * kTileElems, 64);
        _tile_dpbf16ps(1, 2, 4);
        _tile_stored(1, w.sums + kTile, 32 * 4);
      }
      for (int r = 0; r < kTile && a * kTile + r < rows; ++r) {
        float* o = w.out + (a * kTile + r) * D + c * 16;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_loadu_ps(w.sums + r * 32)));
        if (two)
          _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16),
                                                 _mm512_loadu_ps(w.sums + r * 32 + 16)));
      }
    }
  }
}

// Row r's scores of the block at k0 scaled, hidden keys masked (position pos, window lo),
// soft-maxed online into its bf16 probabilities; its output rescaled where its max moved.
template <int D>
void softmax_row(Rows<D>& w, int r, int64_t k0, int64_t pos, int64_t lo, bool masked,
                 float scale) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 x[2];
  __mmask16 seen[2] = {0xffff, 0xffff};
  for (int h = 0; h < 2; ++h) {
    x[h] = _mm512_mul_ps(_mm512_loadu_ps(w.scores + r * kKeys + h * kTile), _mm512_set1_ps(scale));
    if (masked) {
      const __m512i key = _mm512_add_epi32(
          _mm512_set1_epi32(static_cast<int>(k0 + h * kTile)),
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      seen[h] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos))) &
                _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo)));
      x[h] = _mm512_mask_blend_ps(seen[h], neg_inf, x[h]);
    }
  }
  const float top = std::max(w.best[r], _mm512_reduce_max_ps(_mm512_max_ps(x[0], x[1])));
  uint16_t* probs = w.probs + r * kKeys;
  if (top == -INFINITY) {  // nothing visible to this row yet
    _mm512_storeu_si512(probs, _mm512_setzero_si512());
    return;
  }
  __m512 e[2];
  for (int h = 0; h < 2; ++h)  // exp16 clamps its argument: hidden keys are zeroed here
    e[h] = _mm512_maskz_mov_ps(seen[h], tg::exp16(_mm512_sub_ps(x[h], _mm512_set1_ps(top))));
  _mm512_storeu_si512(probs, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  if (top != w.best[r]) {
    const float alpha = w.best[r] == -INFINITY ? 0.f : std::exp(w.best[r] - top);
    w.total[r] *= alpha;
    float* o = w.out + r * D;
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(alpha)));
    w.best[r] = top;
  }
  w.total[r] += _mm512_reduce_add_ps(_mm512_add_ps(e[0], e[1]));
}

// One work item: query positions [i0, i1) of KV head `head`, rows ordered (position, group).
template <int D>
void attend_item(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride,
                 int64_t head, int groups, int64_t i0, int64_t i1, int64_t n, int64_t len,
                 int64_t window, float scale, const uint16_t* kt, const uint16_t* vt,
                 Rows<D>& w) {
  using S = Shape<D>;
  const int rows = static_cast<int>(i1 - i0) * groups, tiles = (rows + kTile - 1) / kTile;
  const int64_t first_pos = len - n + i0, last_pos = len - n + i1 - 1;  // of the queries
  std::fill(w.q, w.q + tiles * kTile * S::padded, uint16_t{0});
  for (int r = 0; r < rows; ++r) {
    const uint16_t* src = q + (i0 + r / groups) * q_stride + (head * groups + r % groups) * D;
    std::copy(src, src + D, w.q + r * S::padded);
  }
  std::fill(w.probs, w.probs + tiles * kTile * kKeys, uint16_t{0});  // padding rows stay 0
  std::fill(w.out, w.out + rows * D, 0.f);
  std::fill(w.best, w.best + rows, -INFINITY);
  std::fill(w.total, w.total + rows, 0.f);
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t blk = first_key / kKeys; blk <= last_pos / kKeys; ++blk) {
    const int64_t k0 = blk * kKeys;
    score_tiles<D>(w, tiles, kt + blk * S::keys);
    // Keys past a row's position, or before its window, are hidden in this block.
    const bool masked = k0 + kKeys - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
    for (int r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / groups;
      softmax_row<D>(w, r, k0, pos, window > 0 ? pos - window + 1 : 0, masked, scale);
    }
    add_value_tiles<D>(w, rows, tiles, vt + blk * S::values);
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* dst = out + (i0 + r / groups) * out_stride + (head * groups + r % groups) * D;
    const float inv = w.total[r] > 0.f ? 1.f / w.total[r] : 0.f;
    for (int d = 0; d < D; ++d) tg::from_float(w.out[r * D + d] * inv, dst + d);
  }
}

template <int D>
int run(const uint16_t* q, int64_t q_stride, const uint16_t* cache, const int64_t* table,
        uint16_t* out, int64_t out_stride, int64_t n, int64_t len, int64_t num_heads,
        int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t window,
        float scale, int threads) {
  using S = Shape<D>;
  const int groups = static_cast<int>(num_heads / num_kv_heads);
  if (groups < 1 || groups > 8 || groups * num_kv_heads != num_heads) return 1;
  if (n < 1 || n > len) return 4;
  const int64_t head_stride = num_blocks * block_size * D;
  const int64_t values_offset = num_kv_heads * head_stride;
  const int64_t blocks = (len + kKeys - 1) / kKeys;
  // Per call, not kept: every element is written below.
  std::unique_ptr<uint16_t[]> keys(new uint16_t[num_kv_heads * blocks * S::keys]);
  std::unique_ptr<uint16_t[]> values(new uint16_t[num_kv_heads * blocks * S::values]);
  const int64_t spans = (n + kPositions - 1) / kPositions;
  const int64_t items = num_kv_heads * spans;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < num_kv_heads * blocks; ++job) {
      const int64_t head = job / blocks, blk = job % blocks;
      const uint16_t* head_keys = cache + head * head_stride;
      pack_block<D>(head_keys, head_keys + values_offset, table, len, block_size, blk,
                    keys.get() + job * S::keys, values.get() + job * S::values);
    }
    std::unique_ptr<Rows<D>> w(new Rows<D>);
    tg::configure_tiles({kTile, kTile, kTile, kTile, kTile, 0, 0, 0});
    // The last positions see the most keys: they go first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t span = spans - 1 - item / num_kv_heads, head = item % num_kv_heads;
      const int64_t i0 = span * kPositions, i1 = std::min(n, i0 + kPositions);
      attend_item<D>(q, q_stride, out, out_stride, head, groups, i0, i1, n, len, window, scale,
                     keys.get() + head * blocks * S::keys,
                     values.get() + head * blocks * S::values, *w);
    }
    _tile_release();
  }
  return 0;
}

}  // namespace

// As tg_paged_prefill for a bf16 cache (its statuses), on AMX tiles; 3 where the CPU has no
// AMX or this build lacks it.
extern "C" int tg_paged_prefill_amx(const void* q, int64_t q_stride, const void* cache,
                                    const int64_t* table, void* out, int64_t out_stride,
                                    int64_t n, int64_t len, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                                    int64_t head_dim, int64_t window, float scale, int threads) {
  if (!tg_cpu_has_amx()) return 3;
#define TG_HEAD_DIM(DIM)                                                                      \
  case DIM:                                                                                   \
    return run<DIM>(static_cast<const uint16_t*>(q), q_stride,                                \
                    static_cast<const uint16_t*>(cache), table, static_cast<uint16_t*>(out), \
                    out_stride, n, len, num_heads, num_kv_heads, num_blocks, block_size,      \
                    window, scale, threads);
  switch (head_dim) {
    TG_HEAD_DIMS(TG_HEAD_DIM)
    default:
      return 2;
  }
#undef TG_HEAD_DIM
}

#else  // a compiler without AMX

extern "C" int tg_paged_prefill_amx(const void*, int64_t, const void*, const int64_t*, void*,
                                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                    int64_t, int64_t, int64_t, float, int) {
  return 3;
}

#endif
