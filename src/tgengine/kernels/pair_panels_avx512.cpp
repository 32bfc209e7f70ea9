// The AVX-512 BF16 variant of pair_panels.h's products: each vdpbf16ps adds 16 lanes' pair
// products (32 multiply-adds) of one row of x and one panel. Built with -mavx512f
// -mavx512bw -mavx512bf16 (kernels/__init__.py) whatever the CPU; called only where
// tg_cpu_has_avx512_bf16() says the CPU has them (kernels.pair_panel_variants).
#include "pair_panels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

struct Avx512Bf16 {
  template <int R, int NP>
  static void run(const uint16_t* x, int64_t k, const uint16_t* panels, int64_t stride,
                  float (*acc)[tg_pairs::kAccCols], const uint16_t* ahead) {
    __m512 sums[R][NP];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) sums[r][p] = _mm512_setzero_ps();
    const int64_t pairs = (k + 1) / 2, whole = k / 2;  // pairs, those without padding
    for (int64_t j = 0; j < pairs; ++j) {
      __m512bh w[NP];
      for (int p = 0; p < NP; ++p) {
        const int64_t at = p * stride + j * 2 * tg_pairs::kPanel;  // 64 bytes: one line
        w[p] = (__m512bh)_mm512_loadu_si512(panels + at);
        if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T1);
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        if (j < whole)
          std::memcpy(&pair, x + r * k + 2 * j, sizeof pair);  // one broadcast load
        else
          pair = static_cast<int32_t>(tg_pairs::x_pair(x + r * k, k, j));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int p = 0; p < NP; ++p) sums[r][p] = _mm512_dpbf16_ps(sums[r][p], xv, w[p]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) _mm512_storeu_ps(acc[r] + p * tg_pairs::kPanel, sums[r][p]);
  }
};

}  // namespace

extern "C" int tg_pair_panel_linear_avx512(const void* x, int64_t m, int64_t k,
                                           const void* panels, int64_t n, const void* bias,
                                           void* out, int float_output, int threads) {
  return tg_pairs::pair_linear<Avx512Bf16>(
      static_cast<const uint16_t*>(x), m, k, static_cast<const uint16_t*>(panels), n,
      static_cast<const uint16_t*>(bias), out, float_output, threads);
}

#else  // a compiler without AVX-512 BF16

extern "C" int tg_pair_panel_linear_avx512(const void*, int64_t, int64_t, const void*, int64_t,
                                           const void*, void*, int, int) {
  return 3;
}

#endif
