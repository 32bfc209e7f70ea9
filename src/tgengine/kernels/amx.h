// What the AMX kernels share (pair_panels_amx.cpp, prefill_attention_bf16.cpp): the tiles'
// configuration. Included by sources built with -mamx-tile -mamx-bf16 (kernels/__init__.py).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>

namespace tg {

// Configures this thread's tiles 0-7: tile t holds rows[t] rows of 64 bytes (0: unused).
// The thread keeps them until _tile_release().
inline void configure_tiles(const int (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace tg

#endif
