// Writing rows of a bf16 weight into its pair panels in place ([ceil(n / 16)][pairs][16][2],
// pair_panels.h), so that a weight update or a wakeup packs straight from the tensors it is
// given: no plain copy of the whole weight, no padded one, no transposed one. Each thread
// takes whole panels; within one, 16 pairs of its 16 rows at a time, a 16 x 16 transpose of
// 32-bit words, so that each 64-byte line of the panel is written whole, once.
// It also says whether any value was not finite (a NaN or an infinity: exponent all ones),
// which the update checks anyway, while the values pass through registers.
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "simd512.h"
#define TG_TRANSPOSE_512 1
#endif

namespace {

constexpr int64_t kPanel = 16;

inline bool finite(uint32_t pair) {
  const uint32_t exp = 0x7f807f80u;
  const uint32_t e = pair & exp;
  return (e & 0x7f80u) != 0x7f80u && (e & 0x7f800000u) != 0x7f800000u;
}

#ifdef TG_TRANSPOSE_512
// A full tile, 16 rows by 16 pairs, in 512-bit registers: rows loaded, transposed
// (tg::transpose16x16_epi32), each pair column stored whole. Returns false when some
// value is not finite.
inline bool tile_16x16(const uint16_t* src, int64_t stride, uint32_t* dst) {
  __m512i r[16];
  __mmask32 bad = 0;
  const __m512i exp = _mm512_set1_epi16(0x7f80);
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm512_loadu_si512(src + i * stride);
    bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(r[i], exp), exp);
  }
  tg::transpose16x16_epi32(r);
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * 16, r[j]);
  return bad == 0;
}

// tile_16x16 backwards: 16 pair columns of the panel (64-byte lines) in, transposed, 16 rows
// of 16 pairs out.
inline void untile_16x16(const uint32_t* src, uint16_t* dst, int64_t stride) {
  __m512i r[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(src + j * 16);
  tg::transpose16x16_epi32(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * stride, r[i]);
}
#endif

// Whether rows x cols of a weight (row r at r * stride) fit panels of `pairs` pairs a row.
inline bool fits(int64_t rows, int64_t cols, int64_t row0, int64_t pairs, int64_t stride) {
  return rows >= 0 && cols >= 1 && row0 >= 0 && pairs >= (cols + 1) / 2 && stride >= cols;
}

// For the walk's calls: not inlined into OpenMP's outlined loop, the write ran 1.2x slower.
#define TG_INLINED __attribute__((always_inline))

// The walk both directions share, whole panels to each thread: for the panel rows row0 ..
// row0 + rows - 1 (rows > 0), tile(p, lo, n, j0, w) for each block of panel p's rows lo .. lo
// + n - 1 by the pairs j0 .. j0 + w - 1 (w <= 16) of the cols / 2 whole ones, then, for an
// odd cols, last(p, lo, hi) for the last column of rows lo .. hi - 1. Returns the OR of their
// answers.
template <class Tile, class Last>
int for_each_tile(int64_t row0, int64_t rows, int64_t cols, int threads, Tile tile, Last last) {
  const int64_t full = cols / 2, first = row0 / kPanel, end = (row0 + rows - 1) / kPanel;
  int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
  for (int64_t p = first; p <= end; ++p) {
    const int64_t lo = std::max(row0, p * kPanel), hi = std::min(row0 + rows, (p + 1) * kPanel);
    for (int64_t j0 = 0; j0 < full; j0 += kPanel)
      bad |= tile(p, lo, hi - lo, j0, std::min(kPanel, full - j0));
    if (cols % 2) bad |= last(p, lo, hi);
  }
  return bad;
}

}  // namespace

// src: rows x cols bf16, row r at src + r * src_stride (elements); written as the panel rows
// row0 .. row0 + rows - 1 of panels, whose pair count is pairs (>= ceil(cols / 2)). Past an
// odd cols the last pair's second value is written 0. Other rows are left as they are.
// Returns 0, 1 when some value was not finite (everything is written all the same), 2 for
// shapes that do not fit.
extern "C" int tg_pair_panel_write_rows(const void* src_, int64_t rows, int64_t cols,
                                        int64_t src_stride, void* panels_, int64_t pairs,
                                        int64_t row0, int threads) {
  if (!fits(rows, cols, row0, pairs, src_stride)) return 2;
  if (rows == 0) return 0;
  const auto* src = static_cast<const uint16_t*>(src_);
  auto* panels = static_cast<uint32_t*>(panels_);
  const auto tile = [&](int64_t p, int64_t lo, int64_t n, int64_t j0, int64_t w) TG_INLINED -> int {
    uint32_t* panel = panels + p * pairs * kPanel;
    const uint16_t* in = src + (lo - row0) * src_stride + 2 * j0;
#ifdef TG_TRANSPOSE_512
    if (n == kPanel && w == kPanel) return !tile_16x16(in, src_stride, panel + j0 * kPanel);
#endif
    // n rows by w pairs, read row by row, written pair by pair (a transpose)
    alignas(64) uint32_t t[kPanel][kPanel];
    for (int64_t i = 0; i < n; ++i) std::memcpy(t[i], in + i * src_stride, w * sizeof(uint32_t));
    uint32_t ok = 1;
    for (int64_t j = 0; j < w; ++j) {
      uint32_t* d = panel + (j0 + j) * kPanel + lo % kPanel;
      for (int64_t i = 0; i < n; ++i) {
        d[i] = t[i][j];
        ok &= finite(t[i][j]);
      }
    }
    return !ok;
  };
  const auto last = [&](int64_t p, int64_t lo, int64_t hi) TG_INLINED -> int {
    uint32_t* panel = panels + p * pairs * kPanel;
    int bad = 0;
    for (int64_t r = lo; r < hi; ++r) {
      const uint32_t pair = src[(r - row0) * src_stride + cols - 1];
      panel[cols / 2 * kPanel + r % kPanel] = pair;
      bad |= !finite(pair);
    }
    return bad;
  };
  return for_each_tile(row0, rows, cols, threads, tile, last);
}

// The weight's first rows (rows x cols bf16, contiguous, into dst) out of its pair panels
// (pairs a panel row, as tg_pair_panel_write_rows takes them), exactly: the same tiles as the
// write, read instead. Returns 0, or 2 for shapes that do not fit.
extern "C" int tg_pair_panel_read_rows(const void* panels_, int64_t pairs, int64_t rows,
                                       int64_t cols, void* dst_, int threads) {
  if (!fits(rows, cols, 0, pairs, cols)) return 2;
  if (rows == 0) return 0;
  const auto* panels = static_cast<const uint32_t*>(panels_);
  auto* dst = static_cast<uint16_t*>(dst_);
  const auto tile = [&](int64_t p, int64_t lo, int64_t n, int64_t j0, int64_t w) TG_INLINED -> int {
    const uint32_t* panel = panels + p * pairs * kPanel;
    uint16_t* out = dst + lo * cols + 2 * j0;
#ifdef TG_TRANSPOSE_512
    if (n == kPanel && w == kPanel) {
      untile_16x16(panel + j0 * kPanel, out, cols);
      return 0;
    }
#endif
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < w; ++j) {
        const uint32_t pair = panel[(j0 + j) * kPanel + lo % kPanel + i];
        std::memcpy(out + i * cols + 2 * j, &pair, sizeof pair);
      }
    return 0;
  };
  const auto last = [&](int64_t p, int64_t lo, int64_t hi) TG_INLINED -> int {
    const uint32_t* panel = panels + p * pairs * kPanel;
    for (int64_t r = lo; r < hi; ++r)
      dst[r * cols + cols - 1] = static_cast<uint16_t>(panel[cols / 2 * kPanel + r % kPanel]);
    return 0;
  };
  return for_each_tile(0, rows, cols, threads, tile, last);
}

// Rows ids[0 .. n - 1] of the weight (an embedding lookup on a tied head's panels) into dst
// (n x cols bf16, contiguous), exactly. A row is one column of its panel: the word at the same
// place of each consecutive 64-byte line, pairs lines in a row, which the hardware reads ahead
// on its own; torch's indexing of the same four-dimensional view took ~45 us for 32 rows in
// cache, ~450 from memory (the Intel Xeon VM of docs/benchmarks.md). Returns 0, 1 when some
// id is not in [0, rows) (nothing is written then), 2 for shapes that do not fit.
extern "C" int tg_pair_panel_gather_rows(const void* panels_, int64_t pairs, int64_t rows,
                                         const int64_t* ids, int64_t n, int64_t cols,
                                         void* dst_, int threads) {
  if (!fits(n, cols, 0, pairs, cols) || rows < 0) return 2;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return 1;
  const auto* panels = static_cast<const uint32_t*>(panels_);
  auto* dst = static_cast<uint16_t*>(dst_);
  const int64_t full = cols / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * cols >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t* column = panels + ids[i] / kPanel * pairs * kPanel + ids[i] % kPanel;
    uint16_t* out = dst + i * cols;
    for (int64_t j = 0; j < full; ++j) std::memcpy(out + 2 * j, column + j * kPanel, 4);
    if (cols % 2) out[cols - 1] = static_cast<uint16_t>(column[full * kPanel]);
  }
  return 0;
}
