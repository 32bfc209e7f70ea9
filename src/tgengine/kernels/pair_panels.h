// Linear products on bf16 weights packed as *pair panels*, the layout AVX-512 BF16's
// vdpbf16ps reads: 16 output rows side by side (one 512-bit register of float32 sums), each
// row's weights in pairs of consecutive inputs, [ceil(n / 16)][ceil(k / 2)][16][2]
// (kernels.pack_pair_panels). One blocking for every variant: 8 rows of x by 2 panels (32
// outputs) a block, or, for one or two rows, those rows by 4 panels (64 outputs), the sums in
// float32, each output rounded once. A variant is a Micro with
//   template <int R, int NP> static void run(const uint16_t* x, int64_t k, const uint16_t* panels,
//                                            int64_t panel_stride, float (*acc)[kAccCols],
//                                            const uint16_t* ahead);
// that writes, for R rows of x and NP panels, the sum of every pair (x[2j], x[2j + 1]) times
// the panels' pair j to acc[r][16 * p + lane] (the rest of acc is not read), the odd product
// first (as vdpbf16ps does), and may ask for the panels at ahead (null: none) to be brought
// into the caches meanwhile. acc starts uninitialised: zeroing its 2 KiB for every block
// (a memset call) cost 2-3 % of a 32-row decode step's products on a Zen 4 VM.
// pair_panels.cpp holds the portable one, pair_panels_avx512.cpp the AVX-512 BF16 one.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

#include "simd.h"
#include "simd512.h"

namespace tg_pairs {

using tg::from_float;
using tg::to_float;

constexpr int64_t kPanel = 16;  // outputs per panel
constexpr int kRows = 8;        // rows of x per block
constexpr int kPanels = 2;      // panels per block (32 outputs: 2 x 16 float32 sums a row)
constexpr int64_t kChunk = 64;  // rows of x a pass over the weight serves (x stays in L2)
// One or two rows of x (a decode step of one or two sequences) take 4 panels a block, each
// thread a contiguous share of the panels: a longer run of weights to stream per block. Each
// output's sum keeps its order: the same bits as in a batch. On a Zen 4 VM (`bench step`, one
// sequence, old and new alternating twice) a decode step's products took 11.8 / 10.0 -> 9.8 /
// 9.8 ms at two threads and 14.4 / 12.8 -> 12.3 / 12.6 at one.
constexpr int kWideRows = 2;
constexpr int kWidePanels = 4;
constexpr int kAccCols = kWidePanels * 16;  // float32 sums a row of a block holds

inline int64_t panel_stride(int64_t k) { return (k + 1) / 2 * 2 * kPanel; }

// A process-wide switch of kernels the CPU may lack (tg_use_avx512_bf16, tg_use_amx): on = -1
// asks, 0 or 1 sets it (1 only where has); it starts on where has, unless the environment
// variable env is "0".
inline int use_switch(std::atomic<int>& use, int on, bool has, const char* env) {
  if (on >= 0) {
    use = on && has;
  } else if (use.load() < 0) {
    const char* value = std::getenv(env);
    use = has && !(value && std::strcmp(value, "0") == 0);
  }
  return use.load();
}

template <class Micro, int R>
void block_rows(const uint16_t* x, int64_t k, const uint16_t* panels, int64_t stride, int np,
                float (*acc)[kAccCols], const uint16_t* ahead) {
  if constexpr (R <= kWideRows) {
    switch (np) {
      case 4: return Micro::template run<R, 4>(x, k, panels, stride, acc, ahead);
      case 3: return Micro::template run<R, 3>(x, k, panels, stride, acc, ahead);
      default: break;
    }
  }
  if (np == 2)
    Micro::template run<R, 2>(x, k, panels, stride, acc, ahead);
  else
    Micro::template run<R, 1>(x, k, panels, stride, acc, ahead);
}

template <class Micro>
void block(const uint16_t* x, int rows, int64_t k, const uint16_t* panels, int64_t stride,
           int np, float (*acc)[kAccCols], const uint16_t* ahead) {
  switch (rows) {
    case 1: block_rows<Micro, 1>(x, k, panels, stride, np, acc, ahead); break;
    case 2: block_rows<Micro, 2>(x, k, panels, stride, np, acc, ahead); break;
    case 3: block_rows<Micro, 3>(x, k, panels, stride, np, acc, ahead); break;
    case 4: block_rows<Micro, 4>(x, k, panels, stride, np, acc, ahead); break;
    case 5: block_rows<Micro, 5>(x, k, panels, stride, np, acc, ahead); break;
    case 6: block_rows<Micro, 6>(x, k, panels, stride, np, acc, ahead); break;
    case 7: block_rows<Micro, 7>(x, k, panels, stride, np, acc, ahead); break;
    default: block_rows<Micro, 8>(x, k, panels, stride, np, acc, ahead); break;
  }
}

// Rows row0 .. row0 + rows - 1, columns col .. col + cols - 1 of out ([m, n], bf16 or
// float32) from a block's float32 sums (W of them a row), plus the bias: each output rounded
// once. Whole 16-column parts go 16 at a time where the library is built for AVX-512: the same
// sums and roundings.
template <int W>
inline void store_block(const float (*acc)[W], int rows, int64_t cols, const uint16_t* bias,
                        int64_t col, int64_t row0, int64_t n, void* out, int float_output) {
  int64_t c0 = 0;
#if defined(__AVX512F__)
  for (; c0 + 16 <= cols; c0 += 16) {
    const __m512 b = bias ? tg::widen16(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(bias + col + c0)))
                          : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      const int64_t at = (row0 + r) * n + col + c0;
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc[r] + c0), b);
      if (float_output)
        _mm512_storeu_ps(static_cast<float*>(out) + at, v);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at),
                            tg::bf16_bits16(v));
    }
  }
#endif
  for (int r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < cols; ++c) {
      const float v = acc[r][c] + (bias ? to_float(bias[col + c]) : 0.0f);
      const int64_t at = (row0 + r) * n + col + c;
      if (float_output)
        static_cast<float*>(out)[at] = v;
      else
        from_float(v, static_cast<uint16_t*>(out) + at);
    }
  }
}

// out[m, n] = x[m, k] @ W.T (+ bias), W packed as pair panels; out bf16 or float32.
// Threads split the columns: each reads its panels once per chunk of kChunk rows, from
// memory for the first block of rows, from L1 for the others (a block of two panels of
// k = 576 is 36 KiB). The first block and the one after it (whose panels come from L1,
// memory idle) ask for the next column block's panels (the thread's next, under a static
// schedule), so that memory's latency hides behind them. Measured on Zen 5 against no
// prefetch, weights from memory: 1.4x at 8 rows, 1.1-1.4x at 32; asked in the last block
// of 8 instead, 0.75x at 2,000 rows. Asking in the first block too, against the second
// alone (a decode step's products, 30 layers, weights from memory, alternated in one
// process): 16 rows 13.6 -> 11.1 ms at one thread, 8.3 -> 6.8 at two; 32 rows 21.5 ->
// 19.4 and 12.2 -> 11.1; 64 rows -7 %, 300 rows -2 %, 1 row the same.
template <class Micro>
int pair_linear(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panels, int64_t n,
                const uint16_t* bias, void* out, int float_output, int threads) {
  if (m < 0 || k < 1 || n < 1) return 2;
  if (m == 0) return 0;
  const int64_t stride = panel_stride(k), num_panels = (n + kPanel - 1) / kPanel;
  if (m <= kWideRows) {  // each thread its share of the panels, kWidePanels a block
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t first = num_panels * t / nt, last = num_panels * (t + 1) / nt;
      for (int64_t p0 = first; p0 < last; p0 += kWidePanels) {
        const int np = static_cast<int>(std::min<int64_t>(kWidePanels, last - p0));
        const uint16_t* ps = panels + p0 * stride;
        const int64_t col = p0 * kPanel, cols = std::min<int64_t>(np * kPanel, n - col);
        alignas(64) float acc[kWideRows][kAccCols];
        const uint16_t* next = p0 + kWidePanels < last ? ps + kWidePanels * stride : nullptr;
        if (m == 1)
          block_rows<Micro, 1>(x, k, ps, stride, np, acc, next);
        else
          block_rows<Micro, 2>(x, k, ps, stride, np, acc, next);
        store_block(acc, static_cast<int>(m), cols, bias, col, 0, n, out, float_output);
      }
    }
    return 0;
  }
  const int64_t col_blocks = (num_panels + kPanels - 1) / kPanels;
#pragma omp parallel num_threads(threads)
  for (int64_t c0 = 0; c0 < m; c0 += kChunk) {
    const int64_t chunk_end = std::min<int64_t>(m, c0 + kChunk);
#pragma omp for schedule(static)
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t p0 = cb * kPanels;
      const int np = static_cast<int>(std::min<int64_t>(kPanels, num_panels - p0));
      const uint16_t* ps = panels + p0 * stride;
      const int64_t col = p0 * kPanel, cols = std::min<int64_t>(np * kPanel, n - col);
      for (int64_t r0 = c0; r0 < chunk_end; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, chunk_end - r0));
        alignas(64) float acc[kRows][kAccCols];
        const bool ahead = r0 <= c0 + kRows && cb + 1 < col_blocks;  // blocks 1 and 2
        block<Micro>(x + r0 * k, rows, k, ps, stride, np, acc, ahead ? ps + kPanels * stride : nullptr);
        store_block(acc, rows, cols, bias, col, r0, n, out, float_output);
      }
    }
  }
  return 0;
}

// The pair (x[2j], x[2j + 1]) of a row as one 32-bit word; past an odd k the second is 0.
inline uint32_t x_pair(const uint16_t* row, int64_t k, int64_t j) {
  const uint32_t lo = row[2 * j];
  const uint32_t hi = 2 * j + 1 < k ? row[2 * j + 1] : 0;
  return lo | (hi << 16);
}

}  // namespace tg_pairs
