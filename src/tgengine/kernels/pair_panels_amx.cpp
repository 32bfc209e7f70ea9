// The AMX variant of pair_panels.h's products. A pair panel is already the layout an AMX
// bf16 B tile reads (pairs of inputs down, 16 outputs across, 64 bytes a row), so a tile of
// 16 pairs loads straight from the panels, 32 inputs at a time, with no repacking. A block
// is 32 rows of x (two A tiles) by 2 panels (two B tiles): 4 tiles of float32 sums, all 8
// tiles in use. The inputs past the last multiple of 32 are added with vdpbf16ps, as the
// AVX-512 BF16 variant adds them. Built with -mamx-tile -mamx-bf16 -mavx512bf16 whatever the
// CPU; run only where tg_cpu_has_amx() says the CPU has AMX and Linux lets this process use
// it (kernels.pair_panel_variants). tg_pair_panel_linear_fast takes this variant where it is
// on, the AVX-512 BF16 one elsewhere.
#include "amx.h"
#include "pair_panels.h"

#include <omp.h>

#include <cstring>
#include <memory>

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
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)  // else: no AMX build
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
  return tg_pairs::use_switch(use, on, tg_cpu_has_amx() == 1, "TGENGINE_AMX");
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kTileRows = 16;        // rows of x an A tile holds
constexpr int64_t kTileK = 32;       // inputs a tile step covers: 16 pairs, 64 bytes a row
constexpr int64_t kBlockRows = 32;   // two A tiles
constexpr int64_t kPanelBytes = 768 << 10;  // panels a pass of every row of x goes over (L2: 2 MiB)
// How far ahead of its tiles a thread asks L2 for panels, at least a column block: the tile
// loads alone, which wait for the products before them, left memory idle meanwhile.
// Measured on a 2-core Sapphire Rapids class VM (SmolLM2's 121 decode products, 32 rows,
// weights from memory, alternating): 2 threads 13.4-14.0 -> 12.2-12.4 ms, 1 thread
// 26.8-27.0 -> 25.1 (a plain read of the panels in this order: 8.9-9.3 ms at 2 threads);
// lm_head's 56 MB alone 22-23 -> 25-27 GB/s. 36-150 KB ahead: within the runs' spread.
constexpr int64_t kAheadBytes = 64 << 10;

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

// Asks L2 for a tile step's rows of two panels (2 KiB) at `ahead`, when it is not null.
inline void fetch_step(const uint16_t* ahead, int64_t s, int64_t stride) {
  if (ahead == nullptr) return;
  const char* p0 = reinterpret_cast<const char*>(ahead + s * kTileK * tg_pairs::kPanel);
  const char* p1 = p0 + stride * 2;
  for (int line = 0; line < 16; ++line) {
    _mm_prefetch(p0 + 64 * line, _MM_HINT_T1);
    _mm_prefetch(p1 + 64 * line, _MM_HINT_T1);
  }
}

// acc[r][16 p + lane] = the sums of rows 0 .. rows0 + rows1 - 1 of x with panels p < NP;
// xa holds the rows' whole tile steps as pack_rows lays them out. At each step it asks L2
// for the same step of the two panels at `ahead` (a column block further on; null: none).
template <bool Two, int NP>
void amx_block(const uint16_t* xa, int64_t steps, const uint16_t* panels, int64_t stride,
               const uint16_t* ahead, float (*acc)[32]) {
  _tile_zero(0);
  if (NP == 2) _tile_zero(1);
  if (Two) {
    _tile_zero(2);
    if (NP == 2) _tile_zero(3);
  }
  // Each tile is loaded for the next step right after its last use in this one, so that
  // the loads run while the remaining products do (tiles are not renamed: a load into a
  // tile waits for the products reading it).
  const auto a_tile = [&](int64_t s, int half) { return xa + (s * kBlockRows + half * kTileRows) * kTileK; };
  const auto b_tile = [&](int64_t s, int p) { return panels + p * stride + s * kTileK * tg_pairs::kPanel; };
  if (steps > 0) {
    _tile_loadd(4, a_tile(0, 0), 64);
    _tile_loadd(6, b_tile(0, 0), 64);
    if (NP == 2) _tile_loadd(7, b_tile(0, 1), 64);
    if (Two) _tile_loadd(5, a_tile(0, 1), 64);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const bool more = s + 1 < steps;
    fetch_step(ahead, s, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (NP == 2) _tile_dpbf16ps(1, 4, 7);
    if (more) _tile_loadd(4, a_tile(s + 1, 0), 64);
    if (Two) {
      _tile_dpbf16ps(2, 5, 6);
      if (more) _tile_loadd(6, b_tile(s + 1, 0), 64);
      if (NP == 2) _tile_dpbf16ps(3, 5, 7);
      if (more) _tile_loadd(5, a_tile(s + 1, 1), 64);
    } else if (more) {
      _tile_loadd(6, b_tile(s + 1, 0), 64);
    }
    if (NP == 2 && more) _tile_loadd(7, b_tile(s + 1, 1), 64);
  }
  constexpr int64_t acc_stride = 32 * sizeof(float);
  _tile_stored(0, acc[0], acc_stride);
  if (NP == 2) _tile_stored(1, acc[0] + tg_pairs::kPanel, acc_stride);
  if (Two) {
    _tile_stored(2, acc[kTileRows], acc_stride);
    if (NP == 2) _tile_stored(3, acc[kTileRows] + tg_pairs::kPanel, acc_stride);
  }
}

// Rows of x (at most 32) as their A tiles read them, one after another: [step][row][32],
// so that a tile loads 1 KiB in one piece.
void pack_rows(const uint16_t* x, int rows, int64_t k, uint16_t* xa) {
  for (int64_t s = 0; s < k / kTileK; ++s)
    for (int r = 0; r < rows; ++r)
      std::memcpy(xa + (s * kBlockRows + r) * kTileK, x + r * k + s * kTileK, kTileK * 2);
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

// One block of 32 rows of x (xa: pack_rows') by column block cb (2 panels), stored into out.
void amx_column_block(const uint16_t* x, const uint16_t* xa, int64_t r0, int rows, int64_t k,
                      const uint16_t* panels, int64_t stride, int64_t num_panels, int64_t cb,
                      const uint16_t* ahead, int64_t n, const uint16_t* bias, void* out,
                      int float_output, Tiles& tiles) {
  const int64_t p0 = cb * 2, steps = k / kTileK;
  const int np = static_cast<int>(std::min<int64_t>(2, num_panels - p0));
  const uint16_t* ps = panels + p0 * stride;
  const int64_t col = p0 * tg_pairs::kPanel;
  const int64_t cols = std::min<int64_t>(np * tg_pairs::kPanel, n - col);
  const int rows0 = std::min(rows, kTileRows), rows1 = rows - rows0;
  alignas(64) float acc[kBlockRows][32];
  tiles.configure(rows0, rows1);
  if (rows1 && np == 2)
    amx_block<true, 2>(xa, steps, ps, stride, ahead, acc);
  else if (rows1)
    amx_block<true, 1>(xa, steps, ps, stride, ahead, acc);
  else if (np == 2)
    amx_block<false, 2>(xa, steps, ps, stride, ahead, acc);
  else
    amx_block<false, 1>(xa, steps, ps, stride, ahead, acc);
  add_tail(x + r0 * k, rows, k, ps, stride, np, acc);
  tg_pairs::store_block(acc, rows, cols, bias, col, r0, n, out, float_output);
}

// Each thread takes a contiguous share of the column blocks, and goes through it a part of
// about kPanelBytes at a time: every block of 32 rows of x against that part, whose panels
// the first block brings from memory and the others find in L2 (a block of x is reused
// from L1 across the part's column blocks). A decode step's few rows make one block: each
// panel is read once, in order.
int amx_linear(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panels, int64_t n,
               const uint16_t* bias, void* out, int float_output, int threads) {
  if (m < 0 || k < 1 || n < 1) return 2;
  const int64_t stride = tg_pairs::panel_stride(k);
  const int64_t num_panels = (n + tg_pairs::kPanel - 1) / tg_pairs::kPanel;
  const int64_t col_blocks = (num_panels + 1) / 2;
  const int64_t part = std::max<int64_t>(1, kPanelBytes / (2 * stride * 2));  // column blocks
  const int64_t reach = (kAheadBytes + 4 * stride - 1) / (4 * stride);  // column blocks, >= 1
#pragma omp parallel num_threads(threads)
  {
    Tiles tiles;
    std::unique_ptr<uint16_t[]> xa(new uint16_t[k / kTileK * kBlockRows * kTileK + 1]);
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t first = col_blocks * me / team, last = col_blocks * (me + 1) / team;
    for (int64_t c0 = first; c0 < last; c0 += part) {
      const int64_t c1 = std::min(last, c0 + part);
      for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, m - r0));
        pack_rows(x + r0 * k, rows, k, xa.get());
        for (int64_t cb = c0; cb < c1; ++cb) {
          // The first pass over a part reads its panels from memory: it asks for the
          // thread's column block `reach` further on meanwhile (none past the thread's last).
          const int64_t further = cb + reach;
          const bool fetch = r0 == 0 && further < last && 2 * further + 1 < num_panels;
          const uint16_t* ahead = fetch ? panels + 2 * further * stride : nullptr;
          amx_column_block(x, xa.get(), r0, rows, k, panels, stride, num_panels, cb, ahead, n,
                           bias, out, float_output, tiles);
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

// The fastest variant where the AVX-512 BF16 kernels run: AMX where it is on, at every row
// count (one Sapphire Rapids class core, 1536 x 576 from cache: 1 row 67 GFLOP/s against
// vdpbf16ps' 46, 4 rows 209 against 99, 32 rows 845 against 116), AVX-512 BF16 otherwise.
extern "C" int tg_pair_panel_linear_fast(const void* x, int64_t m, int64_t k, const void* panels,
                                         int64_t n, const void* bias, void* out,
                                         int float_output, int threads) {
  if (tg_use_amx(-1) == 1) {
    const int status =
        tg_pair_panel_linear_amx(x, m, k, panels, n, bias, out, float_output, threads);
    if (status != 3) return status;
  }
  return tg_pair_panel_linear_avx512(x, m, k, panels, n, bias, out, float_output, threads);
}
