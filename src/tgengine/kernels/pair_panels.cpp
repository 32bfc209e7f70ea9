// The portable variant of pair_panels.h's products: plain float32 math in the order
// vdpbf16ps takes (per lane: the odd product, then the even one), on any CPU. The twin the
// AVX-512 BF16 variant (pair_panels_avx512.cpp) is tested against where it cannot run.
#include "pair_panels.h"

#include <atomic>

namespace {

using tg::to_float;

struct Portable {
  template <int R, int NP>
  static void run(const uint16_t* x, int64_t k, const uint16_t* panels, int64_t stride,
                  float (*acc)[tg_pairs::kAccCols], const uint16_t* /*ahead: no prefetching here*/) {
    const int64_t pairs = (k + 1) / 2;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP * tg_pairs::kPanel; ++c) acc[r][c] = 0.0f;
    for (int64_t j = 0; j < pairs; ++j) {
      for (int r = 0; r < R; ++r) {
        const uint32_t pair = tg_pairs::x_pair(x + r * k, k, j);
        const float x0 = to_float(static_cast<uint16_t>(pair & 0xffff));
        const float x1 = to_float(static_cast<uint16_t>(pair >> 16));
        for (int p = 0; p < NP; ++p) {
          const uint16_t* w = panels + p * stride + j * 2 * tg_pairs::kPanel;
          float* a = acc[r] + p * tg_pairs::kPanel;
          for (int lane = 0; lane < tg_pairs::kPanel; ++lane) {
            // Both products are exact in float32 (8-bit significands): one rounding each add.
            float sum = a[lane] + x1 * to_float(w[2 * lane + 1]);
            a[lane] = sum + x0 * to_float(w[2 * lane]);
          }
        }
      }
    }
  }
};

}  // namespace

extern "C" int tg_pair_panel_linear(const void* x, int64_t m, int64_t k, const void* panels,
                                    int64_t n, const void* bias, void* out, int float_output,
                                    int threads) {
  return tg_pairs::pair_linear<Portable>(
      static_cast<const uint16_t*>(x), m, k, static_cast<const uint16_t*>(panels), n,
      static_cast<const uint16_t*>(bias), out, float_output, threads);
}

// Whether this CPU runs pair_panels_avx512.cpp's variant (its instructions would fault
// elsewhere): asked here, in code built without them.
extern "C" int tg_cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return 0;
#endif
}

// Whether the AVX-512 BF16 variants run: the attention (tg_paged_decode asks for every bf16
// call) and, through Python's kernels.avx512_bf16(), which form Gemm packs bf16 weights in.
// on = -1 asks; 0 or 1 sets it (1 only where the CPU has the instructions), for
// comparisons and tests. Starts on where the CPU has them, unless TGENGINE_AVX512_BF16=0.
extern "C" int tg_use_avx512_bf16(int on) {
  static std::atomic<int> use{-1};
  return tg_pairs::use_switch(use, on, tg_cpu_has_avx512_bf16() == 1, "TGENGINE_AVX512_BF16");
}
