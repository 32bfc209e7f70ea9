// Prefill attention for a bf16 cache with bf16 products: prefill_attention.cpp's work (one
// span of a sequence's n query positions, the last n of its len keys, causal, an optional
// sliding window, read from the paged cache in place), its two products on AMX tiles
// (tg_paged_prefill_amx) or in AVX-512 BF16 dot products, vdpbf16ps (tg_paged_prefill_bf16),
// instead of float32 FMAs. tg_paged_prefill calls the first where the AMX kernels are on
// (tg_use_amx), else the second where the AVX-512 BF16 ones are (tg_use_avx512_bf16), and takes
// the float32 kernel where they answer 3. Built with -mavx512bf16 (and -mamx-tile -mamx-bf16
// where the compiler has them) whatever the CPU (kernels/__init__.py).
//
// First each KV head's keys and values are laid out, a block of 32 keys at a time, as the
// tiles read them: keys as two B tiles a 32 dims (pairs of dims down, 16 keys across), values
// as one B tile a 16 dims (pairs of keys down, 16 dims across); a row of such a tile is one
// 512-bit register of 16 pairs, which is what vdpbf16ps takes too. Then one work item is (KV
// head, 16 query positions), its rows (position x query head of the group) zero-padded to
// whole tiles of 16: for each block of 32 keys, the scores (the queries by the two key tiles),
// soft-maxed online in float32 16 lanes at a time (running max and sum per row, the
// probabilities rounded to bf16 for the second product, as torch's flash kernel does), then
// probabilities times values, added into the rows' float32 output. Blocks entirely hidden by
// the causal mask or the window are skipped. The two forms sum in different orders (a tile's
// dot products are the hardware's; vdpbf16ps adds each pair in turn), so their bits differ.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"
#include "simd.h"
#include "simd512.h"

extern "C" int tg_cpu_has_amx();          // pair_panels_amx.cpp
extern "C" int tg_cpu_has_avx512_bf16();  // pair_panels.cpp

#if defined(__AVX512BF16__)
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
// Keys: for each 16 keys and 32 dims, their 16 x 16 pairs transposed in registers; values: the
// pairs of keys' 16 dims at a time interleaved.
template <int D>
void pack_block(const uint16_t* keys, const uint16_t* values, const int64_t* table,
                int64_t len, int64_t block_size, int64_t blk, uint16_t* kt, uint16_t* vt) {
  using S = Shape<D>;
  const uint16_t *krows[kKeys], *vrows[kKeys];  // null past len
  for (int p = 0; p < kKeys; ++p) {
    const int64_t pos = blk * kKeys + p;
    const int64_t at = pos < len ? table[pos / block_size] * block_size * D + (pos % block_size) * D : -1;
    krows[p] = at < 0 ? nullptr : keys + at;
    vrows[p] = at < 0 ? nullptr : values + at;
  }
  for (int half = 0; half < 2; ++half)
    for (int s = 0; s < S::steps; ++s) {
      const int dims = std::min(32, D - 32 * s);  // 32, or the rest of D (even) past it zero
      const __mmask32 held = dims == 32 ? ~__mmask32{0} : (__mmask32{1} << dims) - 1;
      __m512i r[kTile];
      for (int i = 0; i < kTile; ++i) {
        const uint16_t* row = krows[half * kTile + i];
        r[i] = row ? _mm512_maskz_loadu_epi16(held, row + 32 * s) : _mm512_setzero_si512();
      }
      tg::transpose16x16_epi32(r);
      uint16_t* dst = kt + (half * S::steps + s) * kTileElems;
      for (int j = 0; j < kTile; ++j) _mm512_storeu_si512(dst + j * 32, r[j]);
    }
  const __m512i zero = _mm512_setzero_si512();
  for (int pair = 0; pair < kTile; ++pair) {
    const uint16_t *even = vrows[2 * pair], *odd = vrows[2 * pair + 1];
    for (int c = 0; c < D / 16; ++c) {
      const __m512i lo = even ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(even + 16 * c)))
                              : zero;
      const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                   reinterpret_cast<const __m256i*>(odd + 16 * c)))
                             : zero;
      _mm512_storeu_si512(vt + (c * kTile + pair) * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The two products on AMX tiles.
struct Tiles {
  static void begin() { tg::configure_tiles({kTile, kTile, kTile, kTile, kTile, 0, 0, 0}); }
  static void end() { _tile_release(); }

  // scores[r][0..32) = q[r] . the block's 32 keys, for the rows of row tiles [0, tiles).
  template <int D>
  static void scores(Rows<D>& w, int /*rows*/, int tiles, const uint16_t* kt) {
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
  static void add_values(Rows<D>& w, int rows, int tiles, const uint16_t* vt) {
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
};
#endif

// The pair (the bf16 at p and the one after it) as one 32-bit word, in all 16 lanes.
inline __m512bh pair_everywhere(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// The two products in AVX-512 BF16 dot products: a row of a key or value tile is a register
// of 16 lanes' pairs, and each vdpbf16ps adds one pair of a query (or of probabilities) times
// it into 16 float32 sums. Rows in blocks of R, their sums kept in registers.
struct Dots {
  static void begin() {}
  static void end() {}

  // scores[r][0..32) for rows [r0, r0 + R).
  template <int D, int R>
  static void score_rows(Rows<D>& w, int r0, const uint16_t* kt) {
    using S = Shape<D>;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int s = 0; s < S::steps; ++s)
      for (int j = 0; j < kTile; ++j) {  // the pair of dims (32 s + 2 j, + 1)
        const int64_t at = (s * kTile + j) * 32;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + at);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + S::steps * kTileElems + at);
        for (int r = 0; r < R; ++r) {
          const __m512bh q = pair_everywhere(w.q + (r0 + r) * S::padded + 32 * s + 2 * j);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q, k0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q, k1);
        }
      }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(w.scores + (r0 + r) * kKeys, acc[r][0]);
      _mm512_storeu_ps(w.scores + (r0 + r) * kKeys + kTile, acc[r][1]);
    }
  }

  template <int D>
  static void scores(Rows<D>& w, int rows, int /*tiles*/, const uint16_t* kt) {
    constexpr int R = 6;
    int r = 0;
    for (; r + R <= rows; r += R) score_rows<D, R>(w, r, kt);
    for (; r < rows; ++r) score_rows<D, 1>(w, r, kt);
  }

  // out[r][16 c0, 16 (c0 + C)) += probs[r] . the block's values, for rows [r0, r0 + R).
  template <int D, int R, int C>
  static void add_value_rows(Rows<D>& w, int r0, int c0, const uint16_t* vt) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(w.out + (r0 + r) * D + (c0 + c) * 16);
    for (int j = 0; j < kTile; ++j) {  // the pair of keys (2 j, 2 j + 1)
      __m512bh v[C];
      for (int c = 0; c < C; ++c)
        v[c] = (__m512bh)_mm512_loadu_si512(vt + ((c0 + c) * kTile + j) * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh p = pair_everywhere(w.probs + (r0 + r) * kKeys + 2 * j);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(w.out + (r0 + r) * D + (c0 + c) * 16, acc[r][c]);
  }

  // Each block of rows over the dims' 16-wide groups, up to 4 at a time (R x 4 sums).
  template <int D, int R>
  static void add_value_cols(Rows<D>& w, int r0, const uint16_t* vt) {
    constexpr int cols = D / 16;
    int c = 0;
    for (; c + 4 <= cols; c += 4) add_value_rows<D, R, 4>(w, r0, c, vt);
    switch (cols - c) {
      case 3: add_value_rows<D, R, 3>(w, r0, c, vt); break;
      case 2: add_value_rows<D, R, 2>(w, r0, c, vt); break;
      case 1: add_value_rows<D, R, 1>(w, r0, c, vt); break;
      default: break;
    }
  }

  template <int D>
  static void add_values(Rows<D>& w, int rows, int /*tiles*/, const uint16_t* vt) {
    constexpr int R = 4;
    int r = 0;
    for (; r + R <= rows; r += R) add_value_cols<D, R>(w, r, vt);
    for (; r < rows; ++r) add_value_cols<D, 1>(w, r, vt);
  }
};

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
template <class P, int D>
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
    P::template scores<D>(w, rows, tiles, kt + blk * S::keys);
    // Keys past a row's position, or before its window, are hidden in this block.
    const bool masked = k0 + kKeys - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
    for (int r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / groups;
      softmax_row<D>(w, r, k0, pos, window > 0 ? pos - window + 1 : 0, masked, scale);
    }
    P::template add_values<D>(w, rows, tiles, vt + blk * S::values);
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* dst = out + (i0 + r / groups) * out_stride + (head * groups + r % groups) * D;
    const __m512 inv = _mm512_set1_ps(w.total[r] > 0.f ? 1.f / w.total[r] : 0.f);
    for (int d = 0; d < D; d += 16)  // tg::from_float's rounding
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          tg::bf16_bits16(_mm512_mul_ps(_mm512_loadu_ps(w.out + r * D + d), inv)));
  }
}

template <class P, int D>
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
    P::begin();
    // The last positions see the most keys: they go first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t span = spans - 1 - item / num_kv_heads, head = item % num_kv_heads;
      const int64_t i0 = span * kPositions, i1 = std::min(n, i0 + kPositions);
      attend_item<P, D>(q, q_stride, out, out_stride, head, groups, i0, i1, n, len, window, scale,
                     keys.get() + head * blocks * S::keys,
                     values.get() + head * blocks * S::values, *w);
    }
    P::end();
  }
  return 0;
}

// run<P, D> for the call's head_dim (2 where none is built).
template <class P>
int dispatch(const void* q, int64_t q_stride, const void* cache, const int64_t* table,
             void* out, int64_t out_stride, int64_t n, int64_t len, int64_t num_heads,
             int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
             int64_t window, float scale, int threads) {
#define TG_HEAD_DIM(DIM)                                                                     \
  case DIM:                                                                                  \
    return run<P, DIM>(static_cast<const uint16_t*>(q), q_stride,                            \
                       static_cast<const uint16_t*>(cache), table,                           \
                       static_cast<uint16_t*>(out), out_stride, n, len, num_heads,            \
                       num_kv_heads, num_blocks, block_size, window, scale, threads);
  switch (head_dim) {
    TG_HEAD_DIMS(TG_HEAD_DIM)
    default:
      return 2;
  }
#undef TG_HEAD_DIM
}

}  // namespace
#endif

#define TG_PREFILL_ARGS                                                                     \
  const void *q, int64_t q_stride, const void *cache, const int64_t *table, void *out,        \
      int64_t out_stride, int64_t n, int64_t len, int64_t num_heads, int64_t num_kv_heads,   \
      int64_t num_blocks, int64_t block_size, int64_t head_dim, int64_t window, float scale, \
      int threads
#define TG_PREFILL_PASS                                                                   \
  q, q_stride, cache, table, out, out_stride, n, len, num_heads, num_kv_heads, num_blocks, \
      block_size, head_dim, window, scale, threads

// 3: this form does not run here (the CPU or the build lacks it); takes the call's arguments.
template <class... Args>
int unavailable(const Args&...) {
  return 3;
}

// As tg_paged_prefill for a bf16 cache (its statuses), on AMX tiles; 3 where the CPU has no
// AMX or this build lacks it.
extern "C" int tg_paged_prefill_amx(TG_PREFILL_ARGS) {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tg_cpu_has_amx()) return dispatch<Tiles>(TG_PREFILL_PASS);
#endif
  return unavailable(TG_PREFILL_PASS);
}

// The same in AVX-512 BF16 dot products; 3 where the CPU has no AVX-512 BF16.
extern "C" int tg_paged_prefill_bf16(TG_PREFILL_ARGS) {
#if defined(__AVX512BF16__)
  if (tg_cpu_has_avx512_bf16()) return dispatch<Dots>(TG_PREFILL_PASS);
#endif
  return unavailable(TG_PREFILL_PASS);
}
