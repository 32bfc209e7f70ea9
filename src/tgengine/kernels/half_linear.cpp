// Linear products with half-precision weights (bfloat16 or float16) on CPUs without native
// half-precision products (AVX2 + FMA, and AVX-512 without BF16): out = x @ w.T (+ bias).
// The weight is read as it is stored and widened to float32 in registers, so nothing is
// copied, and one pass over the weight serves MR rows of x at once. Compiled with
// paged_attention.cpp by tgengine.models.kernels; gemm.py's torch paths are the reference.
//
// x [m][k] and out [m][n] are in the weight's dtype, w is [n][k] (torch's Linear layout),
// bias [n] or null. Accumulation is in float32; the output is rounded once, as torch does.
// Panels may also hold int8 weights, each output row scaled by its own float32 factor
// (weight-only quantization): x and out stay in bf16/fp16, the sums are scaled once.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace {

constexpr int kBf16 = 1;
constexpr int kF16 = 2;

inline float half_to_float(uint16_t h, int dtype) {
  if (dtype == kF16) return _cvtsh_ss(h);
  return tg::to_float(h);
}

inline uint16_t float_to_half(float x, int dtype) {
  if (dtype == kF16) return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  uint16_t bits;  // bfloat16: round to nearest even, as torch does
  tg::from_float(x, &bits);
  return bits;
}

// An output element: rounded to the weight's dtype, and stored in it or (the logits) widened
// back to float32, the value the half-precision product's .float() would give.
inline void put(uint16_t* out, float v, int dtype) { *out = float_to_half(v, dtype); }
inline void put(float* out, float v, int dtype) {
  *out = half_to_float(float_to_half(v, dtype), dtype);
}

// Eight outputs at once, rounded as ``put`` rounds each (the same round-to-nearest-even).
template <int Dtype>
inline void put8(uint16_t* out, __m256 v) {
  __m128i bits;
  if constexpr (Dtype == kF16) {
    bits = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  } else {
    bits = tg::bf16_bits8(v);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bits);
}
template <int Dtype>
inline void put8(float* out, __m256 v) {
  if constexpr (Dtype == kF16) {
    _mm256_storeu_ps(out, tg::round8<_Float16>(v));
  } else {
    _mm256_storeu_ps(out, tg::round8<uint16_t>(v));
  }
}

// Out[c] = v[c] + bias[c] (bias may be null) for 8 * count columns from n0, rounded.
template <int Dtype, typename Out>
inline void put_columns(Out* out, const __m256* v, int count, const float* bias, int64_t n0) {
  for (int j = 0; j < count; ++j) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + n0 + 8 * j) : _mm256_setzero_ps();
    put8<Dtype>(out + n0 + 8 * j, _mm256_add_ps(v[j], b));
  }
}

template <int Dtype>
inline __m256 widen8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (Dtype == kF16) {
    return _mm256_cvtph_ps(h);
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
// Eight int8 weights as floats (their row scales are applied to the sums, not here).
template <int Dtype>
inline __m256 widen8(const int8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

// The sums of int8 panels times their rows' scales (half-precision panels: as they are);
// ``scales`` is padded to whole panels.
template <typename W>
inline __m256 scaled(__m256 sums, const float* scales, int64_t n0) {
  if constexpr (std::is_same_v<W, int8_t>) {
    return _mm256_mul_ps(sums, _mm256_loadu_ps(scales + n0));
  } else {
    return sums;
  }
}

// x and the bias widened to float32 once per product (they are small; the weight is not).
template <int Dtype>
struct Widened {
  std::vector<float> x, bias;
  Widened(const uint16_t* xh, int64_t x_size, const uint16_t* bias_h, int64_t n)
      : x(static_cast<size_t>(x_size)), bias(bias_h ? static_cast<size_t>(n) : 0) {
    for (int64_t i = 0; i < x_size; ++i) x[i] = half_to_float(xh[i], Dtype);
    for (size_t i = 0; i < bias.size(); ++i) bias[i] = half_to_float(bias_h[i], Dtype);
  }
  const float* bias_or_null() const { return bias.empty() ? nullptr : bias.data(); }
};

// acc[r][c] = x[r] . w[c] over k (a multiple of 8) for MR rows of x and NR rows of w.
template <int Dtype, int MR, int NR>
inline void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k,
                 float* sums) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = widen8<Dtype>(w + c * ldw + i);
    for (int r = 0; r < MR; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) sums[r * NR + c] = tg::hsum8(acc[r][c]);
}

template <int Dtype, int MR, int NR>
void rows_block(const float* x, int64_t m0, int64_t m1, const uint16_t* w, int64_t n0,
                int64_t k, const float* bias, uint16_t* out, int64_t n) {
  float sums[MR * NR];
  for (int64_t m = m0; m < m1; m += MR) {
    tile<Dtype, MR, NR>(x + m * k, k, w + n0 * k, k, k, sums);
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) {
        float v = sums[r * NR + c] + (bias ? bias[n0 + c] : 0.f);
        out[(m + r) * n + n0 + c] = float_to_half(v, Dtype);
      }
  }
}

// The same as the tiles, one output at a time: for the rows and columns the tiles leave.
template <int Dtype>
void scalar_block(const float* x, int64_t m0, int64_t m1, const uint16_t* w, int64_t n0,
                  int64_t n1, int64_t k, const float* bias, uint16_t* out, int64_t n) {
  const int64_t k8 = k - k % 8;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t c = n0; c < n1; ++c) {
      float s = 0.f;
      if (k8) {
        float sums[1];
        tile<Dtype, 1, 1>(x + m * k, k, w + c * k, k, k8, sums);
        s = sums[0];
      }
      for (int64_t i = k8; i < k; ++i) s += x[m * k + i] * half_to_float(w[c * k + i], Dtype);
      out[m * n + c] = float_to_half(s + (bias ? bias[c] : 0.f), Dtype);
    }
}

// Every output column tile of NR weight rows, in parallel; MR = 4, 2, then 1 rows of x.
template <int Dtype, int NR>
void tiles(const float* x, int64_t m, int64_t k, const uint16_t* w, int64_t n, const float* b,
           uint16_t* out, int threads) {
  const int64_t n_tiles = n / NR;
  const int64_t m4 = m - m % 4, m2 = m - m % 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < n_tiles; ++t) {
    const int64_t n0 = t * NR;
    if (m4) rows_block<Dtype, 4, NR>(x, 0, m4, w, n0, k, b, out, n);
    if (m2 > m4) rows_block<Dtype, 2, NR>(x, m4, m2, w, n0, k, b, out, n);
    if (m > m2) rows_block<Dtype, 1, NR>(x, m2, m, w, n0, k, b, out, n);
  }
  scalar_block<Dtype>(x, 0, m, w, n_tiles * NR, n, k, b, out, n);
}

template <int Dtype>
void linear(const uint16_t* xh, int64_t m, int64_t k, const uint16_t* w, int64_t n,
            const uint16_t* bias_h, uint16_t* out, int threads) {
  const Widened<Dtype> in(xh, m * k, bias_h, n);
  const float* b = in.bias_or_null();
  if (k % 8 != 0) {  // the tiles step k by 8 (hidden sizes are multiples of 8)
    scalar_block<Dtype>(in.x.data(), 0, m, w, 0, n, k, b, out, n);
  } else if (m == 1) {  // memory-bound: more weight rows in flight
    tiles<Dtype, 4>(in.x.data(), m, k, w, n, b, out, threads);
  } else {  // 4 x 3 accumulators + 3 weight vectors + 1 of x: the 16 AVX registers
    tiles<Dtype, 3>(in.x.data(), m, k, w, n, b, out, threads);
  }
}

// ---- Panels: the weight packed once into [n / 16][k][16] (16 output rows side by side), so
// one k step is two 8-wide vectors of w, and each row of x is broadcast: MR x 16 outputs in
// 2 * MR accumulators, the register blocking of a float32 GEMM with the weight widened as it
// is loaded. Every row count runs on it, from one-row decode to prefill.
constexpr int kPanel = 16;
constexpr int64_t kBlockBytes = 192 * 1024;  // widened rows of x per block (see block_rows)

// One row of x against the panel's 16 columns, when the tile has that row.
#define TG_PANEL_ROW(R)                                              \
  if constexpr (MR > R) {                                            \
    const __m256 xv = _mm256_broadcast_ss(x + R * k + i);            \
    a##R##0 = _mm256_fmadd_ps(xv, w0, a##R##0);                      \
    a##R##1 = _mm256_fmadd_ps(xv, w1, a##R##1);                      \
  }

template <int Dtype, int MR, typename W, typename Out>
inline void panel_tile(const float* x, int64_t k, const W* panel, const W* ahead,
                       const float* scales, const float* bias, int64_t n0, int64_t n, Out* out) {
  static_assert(1 <= MR && MR <= 6, "6 x 2 accumulators fill the 16 AVX registers");
  // Named accumulators, not an array: GCC keeps an array in memory and stores it every step.
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t i = 0; i < k; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + i * kPanel), _MM_HINT_T0);
    const __m256 w0 = widen8<Dtype>(panel + i * kPanel);
    const __m256 w1 = widen8<Dtype>(panel + i * kPanel + 8);
    TG_PANEL_ROW(0)
    TG_PANEL_ROW(1)
    TG_PANEL_ROW(2)
    TG_PANEL_ROW(3)
    TG_PANEL_ROW(4)
    TG_PANEL_ROW(5)
  }
  alignas(32) float rows[6][kPanel];
  __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2; ++j) acc[r][j] = scaled<W>(acc[r][j], scales, n0 + 8 * j);
  const int64_t width = n - n0 < kPanel ? n - n0 : kPanel;
  if (width == kPanel) {
    for (int r = 0; r < MR; ++r) put_columns<Dtype>(out + r * n, acc[r], 2, bias, n0);
    return;
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(rows[r], acc[r][0]);
    _mm256_store_ps(rows[r] + 8, acc[r][1]);
  }
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < width; ++c)
      put(out + r * n + n0 + c, rows[r][c] + (bias ? bias[n0 + c] : 0.f), Dtype);
}
#undef TG_PANEL_ROW

// One row of x (decode of one sequence) against two neighbouring panels: memory-bound, and
// one core keeps more of memory busy reading two streams than one (measured: ~1.2x), each
// prefetched 1 KiB ahead; two k steps in flight per column (even and odd k summed apart and
// added at the end, so the order of the sums differs from panel_tile's).
template <int Dtype, typename W, typename Out>
inline void panel_pair_row(const float* x, int64_t k, const W* first, int panels,
                           const float* scales, const float* bias, int64_t n0, int64_t n,
                           Out* out) {
  constexpr int64_t ahead = 1024 / sizeof(W);  // weights 1 KiB ahead
  const W* second = panels == 2 ? first + k * kPanel : first;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0,
         d1 = a0;
  int64_t i = 0;
  for (; i + 2 <= k; i += 2) {
    const W* p = first + i * kPanel;
    const W* q = second + i * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + ahead), _MM_HINT_T0);
    const __m256 x0 = _mm256_broadcast_ss(x + i), x1 = _mm256_broadcast_ss(x + i + 1);
    a0 = _mm256_fmadd_ps(x0, widen8<Dtype>(p), a0);
    a1 = _mm256_fmadd_ps(x0, widen8<Dtype>(p + 8), a1);
    b0 = _mm256_fmadd_ps(x1, widen8<Dtype>(p + 16), b0);
    b1 = _mm256_fmadd_ps(x1, widen8<Dtype>(p + 24), b1);
    c0 = _mm256_fmadd_ps(x0, widen8<Dtype>(q), c0);
    c1 = _mm256_fmadd_ps(x0, widen8<Dtype>(q + 8), c1);
    d0 = _mm256_fmadd_ps(x1, widen8<Dtype>(q + 16), d0);
    d1 = _mm256_fmadd_ps(x1, widen8<Dtype>(q + 24), d1);
  }
  if (i < k) {
    const __m256 xv = _mm256_broadcast_ss(x + i);
    a0 = _mm256_fmadd_ps(xv, widen8<Dtype>(first + i * kPanel), a0);
    a1 = _mm256_fmadd_ps(xv, widen8<Dtype>(first + i * kPanel + 8), a1);
    c0 = _mm256_fmadd_ps(xv, widen8<Dtype>(second + i * kPanel), c0);
    c1 = _mm256_fmadd_ps(xv, widen8<Dtype>(second + i * kPanel + 8), c1);
  }
  const __m256 sums[4] = {scaled<W>(_mm256_add_ps(a0, b0), scales, n0),
                          scaled<W>(_mm256_add_ps(a1, b1), scales, n0 + 8),
                          scaled<W>(_mm256_add_ps(c0, d0), scales, n0 + kPanel),
                          scaled<W>(_mm256_add_ps(c1, d1), scales, n0 + kPanel + 8)};
  const int64_t width = n - n0 < panels * kPanel ? n - n0 : panels * kPanel;
  if (width == panels * kPanel) {
    put_columns<Dtype>(out, sums, 2 * panels, bias, n0);
    return;
  }
  alignas(32) float row[2 * kPanel];
  for (int j = 0; j < 4; ++j) _mm256_store_ps(row + 8 * j, sums[j]);
  for (int64_t c = 0; c < width; ++c)
    put(out + n0 + c, row[c] + (bias ? bias[n0 + c] : 0.f), Dtype);
}

// Rows of x per block of panel_linear: the block, widened to float32, stays in a core's L2
// (512 KiB on Zen 3) beside the panel it meets; a multiple of the 6-row tile.
inline int64_t block_rows(int64_t k, int64_t m) {
  const int64_t fit = kBlockBytes / (4 * k) / 6 * 6;
  const int64_t rows = fit < 6 ? 6 : fit;
  return rows < m ? rows : m;
}

// Rows [r0, r0 + count) of x against panels [p0, p1), x's block widened at xb.
template <int Dtype, typename W, typename Out>
void block_product(const float* xb, int64_t r0, int64_t count, int64_t k, const W* panels,
                   int64_t p0, int64_t p1, const float* scales, const float* b, int64_t n,
                   Out* out) {
  const int64_t count6 = count - count % 6;
  constexpr int64_t kAhead = 4096 / sizeof(W);  // 4 KiB: 1 and 2 KiB ahead measured slower
  for (int64_t p = p0; p < p1; ++p) {
    const W* panel = panels + p * k * kPanel;
    const int64_t n0 = p * kPanel;
    Out* o = out + r0 * n;
    // The first tile of a panel reads it from memory, prefetching the weights ahead (into
    // the next panel at its end); the tiles after it find the panel in cache, and prefetch
    // what they read. A decode step streams every weight from memory, and the hardware's
    // prefetch alone left the products waiting on it: at 4-24 rows, 1 KiB ahead gave
    // 7-36 %, 4 KiB more (4 rows: 24 -> 42-47 GFLOP/s on one core).
    const W* ahead = panel + kAhead;
    int64_t r = 0;
    for (; r < count6; r += 6, ahead = panel) panel_tile<Dtype, 6, W, Out>(&xb[r * k], k, panel, ahead, scales, b, n0, n, o + r * n);
    switch (count - r) {
      case 5: panel_tile<Dtype, 5, W, Out>(&xb[r * k], k, panel, ahead, scales, b, n0, n, o + r * n); break;
      case 4: panel_tile<Dtype, 4, W, Out>(&xb[r * k], k, panel, ahead, scales, b, n0, n, o + r * n); break;
      case 3: panel_tile<Dtype, 3, W, Out>(&xb[r * k], k, panel, ahead, scales, b, n0, n, o + r * n); break;
      case 2: panel_tile<Dtype, 2, W, Out>(&xb[r * k], k, panel, ahead, scales, b, n0, n, o + r * n); break;
      case 1: panel_tile<Dtype, 1, W, Out>(&xb[r * k], k, panel, ahead, scales, b, n0, n, o + r * n); break;
      default: break;
    }
  }
}

// Two or more rows. Few of them (decode, a short prompt): x widened first, then the panels
// split between the threads, one barrier. Many (a prefill chunk): each thread takes blocks
// of rows in turn, widens each into its own buffer and multiplies it by every panel: no
// barrier until the end, nothing widened twice (widening all of x on one thread first took
// 10-20 % of a 2,048-row product at 2 threads), and a thread slowed by another process
// takes fewer blocks. A block stays in L2 while the panels stream past it.
template <int Dtype, typename W, typename Out>
void panel_rows(const uint16_t* xh, int64_t m, int64_t k, const W* panels, const float* scales,
                int64_t n, const float* b, Out* out, int threads) {
  if (m == 0) return;
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const int64_t rows = block_rows(k, m);
  const int64_t blocks = (m + rows - 1) / rows;
  if (blocks < 4 * threads) {
    thread_local std::vector<float> x;  // reused by this thread's calls: at most 4 blocks a thread
    if (x.size() < static_cast<size_t>(m * k)) x.resize(m * k);
    for (int64_t e = 0; e < m * k; ++e) x[e] = half_to_float(xh[e], Dtype);
    const float* widened = x.data();  // x itself names another thread's buffer in the loop
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < num_panels; ++p)
      block_product<Dtype, W, Out>(widened, 0, m, k, panels, p, p + 1, scales, b, n, out);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<float> block;  // one block of rows, per thread
    if (block.size() < static_cast<size_t>(rows * k)) block.resize(rows * k);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t r0 = i * rows, count = r0 + rows < m ? rows : m - r0;
      const uint16_t* src = xh + r0 * k;
      for (int64_t e = 0; e < count * k; ++e) block[e] = half_to_float(src[e], Dtype);
      block_product<Dtype, W, Out>(block.data(), r0, count, k, panels, 0, num_panels, scales, b,
                                   n, out);
    }
  }
}

template <int Dtype, typename W, typename Out>
void panel_linear(const uint16_t* xh, int64_t m, int64_t k, const W* panels,
                  const float* scales, int64_t n, const uint16_t* bias_h, Out* out,
                  int threads) {
  const Widened<Dtype> in(xh, m == 1 ? k : 0, bias_h, n);
  const float* b = in.bias_or_null();
  if (m != 1) {
    panel_rows<Dtype, W, Out>(xh, m, k, panels, scales, n, b, out, threads);
    return;
  }
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const int64_t pairs = (num_panels + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t p = 2 * pair;
    const int count = p + 1 < num_panels ? 2 : 1;
    panel_pair_row<Dtype, W, Out>(in.x.data(), k, panels + p * k * kPanel, count, scales, b,
                                  p * kPanel, n, out);
  }
}

// Every product behind one signature: x, m, k, the weight (plain or panels), the int8 panels'
// row scales (else null), n, bias, out, threads.
template <typename Out>
using Product = void (*)(const uint16_t*, int64_t, int64_t, const void*, const float*, int64_t,
                         const uint16_t*, Out*, int);

template <int Dtype>
void plain_product(const uint16_t* x, int64_t m, int64_t k, const void* w, const float*,
                   int64_t n, const uint16_t* bias, uint16_t* out, int threads) {
  linear<Dtype>(x, m, k, static_cast<const uint16_t*>(w), n, bias, out, threads);
}

template <int Dtype, typename W, typename Out>
void panels_product(const uint16_t* x, int64_t m, int64_t k, const void* w, const float* scales,
                    int64_t n, const uint16_t* bias, Out* out, int threads) {
  panel_linear<Dtype, W, Out>(x, m, k, static_cast<const W*>(w), scales, n, bias, out, threads);
}

// Checks the sizes and runs the product's bf16 or fp16 instance: 0, or a refusal status.
template <typename Out>
int run_product(Product<Out> bf16, Product<Out> f16, int dtype, const void* x, int64_t m,
                int64_t k, const void* w, const float* scales, int64_t n, const void* bias,
                void* out, int threads) {
  if (m < 0 || k <= 0 || n < 0 || threads < 1) return 1;
  Product<Out> product = dtype == kBf16 ? bf16 : dtype == kF16 ? f16 : nullptr;
  if (product == nullptr) return 2;
  product(static_cast<const uint16_t*>(x), m, k, w, scales, n,
          static_cast<const uint16_t*>(bias), static_cast<Out*>(out), threads);
  return 0;
}

}  // namespace

extern "C" int tg_half_linear(int dtype, const void* x, int64_t m, int64_t k, const void* w,
                              int64_t n, const void* bias, void* out, int threads) {
  return run_product<uint16_t>(plain_product<kBf16>, plain_product<kF16>, dtype, x, m, k, w,
                               nullptr, n, bias, out, threads);
}

extern "C" int tg_panel_linear(int dtype, const void* x, int64_t m, int64_t k,
                               const void* panels, int64_t n, const void* bias, void* out,
                               int threads) {
  return run_product<uint16_t>(panels_product<kBf16, uint16_t, uint16_t>,
                               panels_product<kF16, uint16_t, uint16_t>, dtype, x, m, k, panels,
                               nullptr, n, bias, out, threads);
}

// The same product, its outputs (rounded to the weight's dtype) stored as float32: logits.
extern "C" int tg_panel_linear_f32(int dtype, const void* x, int64_t m, int64_t k,
                                   const void* panels, int64_t n, const void* bias, void* out,
                                   int threads) {
  return run_product<float>(panels_product<kBf16, uint16_t, float>,
                            panels_product<kF16, uint16_t, float>, dtype, x, m, k, panels,
                            nullptr, n, bias, out, threads);
}

// Int8 panels with their rows' float32 scales (padded to whole panels); x, bias and out in
// ``dtype``, or out in float32 (``float_output``: logits, rounded to ``dtype`` first).
extern "C" int tg_panel_linear_q8(int dtype, const void* x, int64_t m, int64_t k,
                                  const void* panels, const void* scales, int64_t n,
                                  const void* bias, void* out, int threads, int float_output) {
  const float* s = static_cast<const float*>(scales);
  if (s == nullptr) return 1;
  if (float_output) {
    return run_product<float>(panels_product<kBf16, int8_t, float>,
                              panels_product<kF16, int8_t, float>, dtype, x, m, k, panels, s, n,
                              bias, out, threads);
  }
  return run_product<uint16_t>(panels_product<kBf16, int8_t, uint16_t>,
                               panels_product<kF16, int8_t, uint16_t>, dtype, x, m, k, panels, s,
                               n, bias, out, threads);
}

extern "C" int tg_half_linear_available() { return 1; }

#else  // no AVX2/FMA/F16C: the torch paths run instead

extern "C" int tg_half_linear(int, const void*, int64_t, int64_t, const void*, int64_t,
                              const void*, void*, int) {
  return 3;
}

extern "C" int tg_panel_linear(int, const void*, int64_t, int64_t, const void*, int64_t,
                               const void*, void*, int) {
  return 3;
}

extern "C" int tg_panel_linear_f32(int, const void*, int64_t, int64_t, const void*, int64_t,
                                   const void*, void*, int) {
  return 3;
}

extern "C" int tg_panel_linear_q8(int, const void*, int64_t, int64_t, const void*, const void*,
                                  int64_t, const void*, void*, int, int) {
  return 3;
}

extern "C" int tg_half_linear_available() { return 0; }

#endif
