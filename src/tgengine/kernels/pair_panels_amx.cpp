// The AMX variant of pair_panels.h's products. A pair panel is already the layout an AMX
// bf16 B tile reads (pairs of inputs down, 16 outputs across, 64 bytes a row), so a tile of
// 16 pairs loads straight from the panels, 32 inputs at a time, with no repacking. A block
// is 32 rows of x (two A tiles) by 2 panels (two B tiles): 4 tiles of float32 sums, all 8
// tiles in use. The inputs past the last multiple of 32 are added with vdpbf16ps, as the
// AVX-512 BF16 variant adds them. Built with -mamx-tile -mamx-bf16 -mavx512bf16 whatever the
// CPU; run only where tg_cpu_has_amx() says the CPU has AMX and Linux lets this process use
// it (kernels.pair_panel_variants). tg_pair_panel_linear_fast takes this variant from
// kAmxMinRows rows of x where it is on, and the AVX-512 BF16 one below that.
#include "amx.h"
#include "pair_panels.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

extern "C" int tg_pair_panel_linear_avx512(const void* x, int64_t m, int64_t k,
                                           const void* panels, int64_t n, const void* bias,
                                           void* out, int float_output, int threads);

// Whether the CPU has AMX tiles for bf16 (and AVX-512 BF16, which the tails use) and Linux
// grants this process the tiles' state (ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once).
extern "C" int tg_cpu_has_amx() {
#if defined(__x86_64__)
  static const int has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const bool tiles = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    const bool avx512_bf16 = (a >> 5) & 1;
    if (!tiles || !bf16 || !avx512_bf16) return 0;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 ? 1 : 0;
  }();
  return has;
#else
  return 0;
#endif
}

// Whether the AMX variant runs (tg_pair_panel_linear_fast, the one-call decode): on = -1
// asks; 0 or 1 sets it (1 only where tg_cpu_has_amx()). Starts on where the CPU has AMX,
// unless TGENGINE_AMX=0 is in the environment.
extern "C" int tg_use_amx(int on) {
  static std::atomic<int> use{-1};
  if (on >= 0) {
    use = on && tg_cpu_has_amx();
  } else if (use.load() < 0) {
    const char* env = std::getenv("TGENGINE_AMX");
    use = tg_cpu_has_amx() && !(env && std::strcmp(env, "0") == 0);
  }
  return use.load();
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kTileRows = 16;        // rows of x an A tile holds
constexpr int64_t kTileK = 32;       // inputs a tile step covers: 16 pairs, 64 bytes a row
constexpr int64_t kBlockRows = 32;   // two A tiles
constexpr int64_t kAmxChunk = 256;   // rows of x a pass over the panels serves (x in L2)

// This thread's tiles, configured for a block of rows0 + rows1 rows of x (rows1 may be 0),
// released (back to the init state) when it goes. Tiles 0-3: the sums of A tile a and panel
// p at 2a + p; 4, 5: the A tiles (rows of x); 6, 7: the B tiles (panels).
class Tiles {
 public:
  ~Tiles() {
    if (key_ >= 0) _tile_release();
  }
  void configure(int rows0, int rows1) {
    const int key = rows0 * 64 + rows1;
    if (key == key_) return;
    tg::configure_tiles({rows0, rows0, rows1, rows1, rows0, rows1, kTileRows, kTileRows});
    key_ = key;
  }

 private:
  int key_ = -1;
};

// acc[r][16 p + lane] = the sums of rows 0 .. rows0 + rows1 - 1 of x with panels p < NP.
template <bool Two, int NP>
void amx_block(const uint16_t* x, int64_t k, const uint16_t* panels, int64_t stride,
               float (*acc)[32]) {
  _tile_zero(0);
  if (NP == 2) _tile_zero(1);
  if (Two) {
    _tile_zero(2);
    if (NP == 2) _tile_zero(3);
  }
  const int64_t steps = k / kTileK, x_stride = k * 2;
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* a = x + s * kTileK;
    const uint16_t* b = panels + s * kTileK * tg_pairs::kPanel;  // 16 pairs of 32 values
    _tile_loadd(4, a, x_stride);
    _tile_loadd(6, b, 64);
    if (NP == 2) _tile_loadd(7, b + stride, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NP == 2) _tile_dpbf16ps(1, 4, 7);
    if (Two) {
      _tile_loadd(5, a + kTileRows * k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t acc_stride = 32 * sizeof(float);
  _tile_stored(0, acc[0], acc_stride);
  if (NP == 2) _tile_stored(1, acc[0] + tg_pairs::kPanel, acc_stride);
  if (Two) {
    _tile_stored(2, acc[kTileRows], acc_stride);
    if (NP == 2) _tile_stored(3, acc[kTileRows] + tg_pairs::kPanel, acc_stride);
  }
}

// The pairs past the tiles' last step, added to acc with vdpbf16ps.
void add_tail(const uint16_t* x, int rows, int64_t k, const uint16_t* panels, int64_t stride,
              int np, float (*acc)[32]) {
  const int64_t first = k / kTileK * (kTileK / 2), pairs = (k + 1) / 2;
  if (first == pairs) return;
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < np; ++p) {
      __m512 sum = _mm512_loadu_ps(acc[r] + p * tg_pairs::kPanel);
      for (int64_t j = first; j < pairs; ++j) {
        const int32_t pair = static_cast<int32_t>(tg_pairs::x_pair(x + r * k, k, j));
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panels + p * stride + j * 2 * tg_pairs::kPanel);
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(pair), w);
      }
      _mm512_storeu_ps(acc[r] + p * tg_pairs::kPanel, sum);
    }
  }
}

int amx_linear(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panels, int64_t n,
               const uint16_t* bias, void* out, int float_output, int threads) {
  if (m < 0 || k < 1 || n < 1) return 2;
  const int64_t stride = tg_pairs::panel_stride(k);
  const int64_t num_panels = (n + tg_pairs::kPanel - 1) / tg_pairs::kPanel;
  const int64_t col_blocks = (num_panels + 1) / 2;
#pragma omp parallel num_threads(threads)
  {
    Tiles tiles;
    for (int64_t c0 = 0; c0 < m; c0 += kAmxChunk) {
      const int64_t chunk_end = std::min<int64_t>(m, c0 + kAmxChunk);
#pragma omp for schedule(static)
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t p0 = cb * 2;
        const int np = static_cast<int>(std::min<int64_t>(2, num_panels - p0));
        const uint16_t* ps = panels + p0 * stride;
        const int64_t col = p0 * tg_pairs::kPanel;
        const int64_t cols = std::min<int64_t>(np * tg_pairs::kPanel, n - col);
        for (int64_t r0 = c0; r0 < chunk_end; r0 += kBlockRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, chunk_end - r0));
          const int rows0 = std::min(rows, kTileRows), rows1 = rows - rows0;
          alignas(64) float acc[kBlockRows][32];
          tiles.configure(rows0, rows1);
          if (rows1 && np == 2)
            amx_block<true, 2>(x + r0 * k, k, ps, stride, acc);
          else if (rows1)
            amx_block<true, 1>(x + r0 * k, k, ps, stride, acc);
          else if (np == 2)
            amx_block<false, 2>(x + r0 * k, k, ps, stride, acc);
          else
            amx_block<false, 1>(x + r0 * k, k, ps, stride, acc);
          add_tail(x + r0 * k, rows, k, ps, stride, np, acc);
          tg_pairs::store_block(acc, rows, cols, bias, col, r0, n, out, float_output);
        }
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" int tg_pair_panel_linear_amx(const void* x, int64_t m, int64_t k, const void* panels,
                                        int64_t n, const void* bias, void* out,
                                        int float_output, int threads) {
  if (!tg_cpu_has_amx()) return 3;
  return amx_linear(static_cast<const uint16_t*>(x), m, k,
                    static_cast<const uint16_t*>(panels), n,
                    static_cast<const uint16_t*>(bias), out, float_output, threads);
}

#else  // a compiler without AMX

extern "C" int tg_pair_panel_linear_amx(const void*, int64_t, int64_t, const void*, int64_t,
                                        const void*, void*, int, int) {
  return 3;
}

#endif

// The fastest variant for m rows of x where the AVX-512 BF16 kernels run: AMX from
// kAmxMinRows rows where it is on (below that, a tile of mostly empty rows costs what a full
// one does, and vdpbf16ps on broadcast rows does as well), AVX-512 BF16 otherwise.
extern "C" int tg_pair_panel_linear_fast(const void* x, int64_t m, int64_t k, const void* panels,
                                         int64_t n, const void* bias, void* out,
                                         int float_output, int threads) {
  constexpr int64_t kAmxMinRows = 1;
  if (m >= kAmxMinRows && tg_use_amx(-1) == 1) {
    const int status =
        tg_pair_panel_linear_amx(x, m, k, panels, n, bias, out, float_output, threads);
    if (status != 3) return status;
  }
  return tg_pair_panel_linear_avx512(x, m, k, panels, n, bias, out, float_output, threads);
}
