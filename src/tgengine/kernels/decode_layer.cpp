// Decoder layers of a decode step (one query row per sequence), a run of consecutive layers in
// one call: each layer's Python forward makes some nine kernel calls and as many small
// allocations, and even one call per layer cost a quarter of a one-sequence step in Python.
// Runs the same kernels, in the same order, with the same rounding (so its results are the
// unfused path's, bit for bit). Each layer:
//   h = norm(residual += x)          tg_add_rms_norm (layer 0: residual = x, no add)
//   qkv = h @ Wqkv.T (+ bias)        tg_panel_linear
//   rotate q, k; store k, v          tg_rope_store_kv
//   a = attention(q) on the cache    tg_paged_decode
//   o = a @ Wo.T; h = norm(residual += o)
//   out = (act(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T
// For the common layer only: pre-norms, no per-head q/k norm, a dense gated MLP, weights
// packed into panels (bf16/fp16, or int8 with row scales), one rank. Compiled with the other
// kernels by tgengine.models.kernels.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
int tg_add_rms_norm(int dtype, void* x, void* residual, const void* weight, int64_t rows,
                    int64_t size, float eps, int unit_offset, void* out, int threads);
int tg_panel_linear(int dtype, const void* x, int64_t m, int64_t k, const void* panels,
                    int64_t n, const void* bias, void* out, int threads);
int tg_pair_panel_linear_fast(const void* x, int64_t m, int64_t k, const void* panels,
                              int64_t n, const void* bias, void* out, int float_output,
                              int threads);
int tg_panel_linear_q8(int dtype, const void* x, int64_t m, int64_t k, const void* panels,
                       const void* scales, int64_t n, const void* bias, void* out, int threads,
                       int float_output);
int tg_rope_store_kv(int dtype, void* qkv, int64_t rows, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, const void* cos, const void* sin,
                     int64_t rot_dim, void* cache, int64_t slots, const int64_t* slot_mapping,
                     int threads);
int tg_paged_decode(int dtype, const void* q, const void* cache, const int64_t* tables,
                    const int64_t* lens, void* out, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                    int64_t head_dim, int64_t table_width, int64_t window, float scale,
                    int threads);
int tg_act_mul(int dtype, int act, const void* gate_up, int64_t rows, int64_t inter, void* out,
               int threads);
}

// Mirrored field for field by kernels/decode_layer.py's ctypes Structures.
// A layer's fixed arguments (made once per layer and weight version):
struct DecodeLayer {
  int64_t dtype, act, unit_offset, hidden, num_heads, num_kv_heads, head_dim, inter, window;
  int64_t layer;  // its index in the KV cache
  int64_t rope;   // which of the step's cos/sin it rotates with
  int64_t plan;   // which of the step's block tables it attends with (one per window)
  int64_t pairs;  // 1: the panels are bf16 pair panels (AVX-512 BF16, pair_panels.h)
  float eps, scale;
  const void *input_norm, *post_norm;
  const void *qkv_panels, *qkv_bias, *o_panels, *gate_up_panels, *down_panels;
  const void *qkv_scales, *o_scales, *gate_up_scales, *down_scales;  // int8 panels' (or null)
};

constexpr int kKinds = 4;  // RoPEs and block-table plans a step may hold

// The step's arguments, shared by its layers:
struct DecodeStep {
  int64_t threads, rows, num_blocks, block_size;
  int64_t layer_stride;  // elements from one layer's cache to the next
  void* cache;           // layer 0's [2][num_kv_heads][num_blocks * block_size][head_dim]
  const int64_t* slot_mapping;
  const void* cos[kKinds];  // [rows, rot_dim[i]] each
  const void* sin[kKinds];
  const int64_t* tables[kKinds];  // [rows, table_width[i]]
  const int64_t* lens[kKinds];    // [rows]
  int64_t rot_dim[kKinds];
  int64_t table_width[kKinds];
  // Null, or where the call adds the nanoseconds of its products [0] and attention [1]
  // (rotary, KV store, attention): a bench's profile (tgengine.models.step_timers).
  int64_t* spent_ns;
};

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Adds the time from its construction to its end to spent[part], when profiling.
struct Timed {
  int64_t* spent;
  int part;
  int64_t start;
  Timed(int64_t* spent_ns, int which) : spent(spent_ns), part(which), start(spent ? now_ns() : 0) {}
  ~Timed() {
    if (spent) spent[part] += now_ns() - start;
  }
};

// A product on half-precision panels, on int8 ones where they have scales, or on bf16 pair
// panels (a layer made only where the CPU runs them: fused_decode).
int panel_product(const DecodeLayer* L, const DecodeStep* S, int dtype, const void* x,
                  int64_t m, int64_t k, const void* panels, const void* scales, int64_t n,
                  const void* bias, void* out, int threads) {
  Timed timed(S->spent_ns, 0);
  if (L->pairs) return tg_pair_panel_linear_fast(x, m, k, panels, n, bias, out, 0, threads);
  if (scales) return tg_panel_linear_q8(dtype, x, m, k, panels, scales, n, bias, out, threads, 0);
  return tg_panel_linear(dtype, x, m, k, panels, n, bias, out, threads);
}

// Rotate q and k, store k and v in the layer's cache, attend with the queries.
int attend(const DecodeLayer* L, const DecodeStep* S, void* qkv, void* q, void* cache,
           void* attn) {
  Timed timed(S->spent_ns, 1);
  const int dtype = static_cast<int>(L->dtype), threads = static_cast<int>(S->threads);
  const int64_t rows = S->rows, d = L->head_dim;
  const int64_t q_size = L->num_heads * d, qkv_size = (L->num_heads + 2 * L->num_kv_heads) * d;
  const size_t elem = 2;  // bf16 / fp16
  int status = tg_rope_store_kv(dtype, qkv, rows, L->num_heads, L->num_kv_heads, d,
                                S->cos[L->rope], S->sin[L->rope], S->rot_dim[L->rope], cache,
                                S->num_blocks * S->block_size, S->slot_mapping, threads);
  if (status) return 300 + status;
  for (int64_t r = 0; r < rows; ++r)  // the queries of each row, contiguous
    std::memcpy(static_cast<char*>(q) + r * q_size * elem,
                static_cast<char*>(qkv) + r * qkv_size * elem, q_size * elem);
  status = tg_paged_decode(dtype, q, cache, S->tables[L->plan], S->lens[L->plan], attn, rows,
                           L->num_heads, L->num_kv_heads, S->num_blocks, S->block_size, d,
                           S->table_width[L->plan], L->window, L->scale, threads);
  return status ? 400 + status : 0;
}

// A layer's intermediate results, allocated once per call and shared by its layers (grown
// for a wider layer): allocating and zeroing them for every layer cost ~9 MB of memset a
// step at 24 rows, on one core while the other waited.
struct Buffers {
  std::vector<char> h, qkv, q, attn, o, gate_up, inner;
};

char* at_least(std::vector<char>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// One layer: reads x (and residual: null means x is the residual stream, the first layer),
// adds into the stream, writes the MLP's output to out (which may be x: read first).
int decode_layer(const DecodeLayer* L, const DecodeStep* S, void* x, void* residual_in,
                 void* out, Buffers& b) {
  const int dtype = static_cast<int>(L->dtype), threads = static_cast<int>(S->threads);
  const int64_t rows = S->rows, hidden = L->hidden, d = L->head_dim;
  if (L->rope < 0 || L->rope >= kKinds || L->plan < 0 || L->plan >= kKinds) return 1;
  const int64_t q_size = L->num_heads * d, qkv_size = (L->num_heads + 2 * L->num_kv_heads) * d;
  const size_t elem = 2;  // bf16 / fp16
  void* cache = static_cast<char*>(S->cache) + L->layer * S->layer_stride * elem;
  char* h = at_least(b.h, rows * hidden * elem);
  char* qkv = at_least(b.qkv, rows * qkv_size * elem);
  char* q = at_least(b.q, rows * q_size * elem);
  char* attn = at_least(b.attn, rows * q_size * elem);
  char* o = at_least(b.o, rows * hidden * elem);
  char* gate_up = at_least(b.gate_up, rows * 2 * L->inter * elem);
  char* inner = at_least(b.inner, rows * L->inter * elem);
  // Layer 0 only norms its input, which is then the residual stream the later add writes.
  int status = tg_add_rms_norm(dtype, x, residual_in, L->input_norm, rows, hidden, L->eps,
                               L->unit_offset, h, threads);
  void* residual = residual_in ? residual_in : x;
  if (status) return 100 + status;
  status = panel_product(L, S, dtype, h, rows, hidden, L->qkv_panels, L->qkv_scales, qkv_size,
                         L->qkv_bias, qkv, threads);
  if (status) return 200 + status;
  status = attend(L, S, qkv, q, cache, attn);
  if (status) return status;
  status = panel_product(L, S, dtype, attn, rows, q_size, L->o_panels, L->o_scales, hidden,
                         nullptr, o, threads);
  if (status) return 500 + status;
  status = tg_add_rms_norm(dtype, o, residual, L->post_norm, rows, hidden, L->eps,
                           L->unit_offset, h, threads);
  if (status) return 600 + status;
  status = panel_product(L, S, dtype, h, rows, hidden, L->gate_up_panels, L->gate_up_scales,
                         2 * L->inter, nullptr, gate_up, threads);
  if (status) return 700 + status;
  status = tg_act_mul(dtype, static_cast<int>(L->act), gate_up, rows, L->inter,
                      inner, threads);
  if (status) return 800 + status;
  status = panel_product(L, S, dtype, inner, rows, L->inter, L->down_panels, L->down_scales,
                         hidden, nullptr, out, threads);
  return status ? 900 + status : 0;
}

}  // namespace

// ``count`` consecutive layers: the first reads x and residual (null: x is the residual
// stream, written in place), each next one the output of the one before; every layer's
// output goes to out (separate from x). 0, or 1000 * (layer + 1) + the failing kernel's code.
extern "C" int tg_decode_layers(const DecodeLayer* const* layers, int64_t count,
                                const DecodeStep* step, void* x, void* residual, void* out) {
  if (count < 1 || x == out) return 1;
  void* stream = residual ? residual : x;
  Buffers buffers;
  for (int64_t i = 0; i < count; ++i) {
    const int status = i == 0 ? decode_layer(layers[0], step, x, residual, out, buffers)
                              : decode_layer(layers[i], step, out, stream, out, buffers);
    if (status) return static_cast<int>(1000 * (i + 1) + status);
  }
  return 0;
}

// The work of one layer between its products, for a layer whose products run outside this
// library (weights in oneDNN's layout, or plain ones: torch makes those products), so that
// a decode step of such layers makes four products and these four calls a layer instead of
// the layer's Python forward. Same kernels and order as that forward, so the same bits.
//   stage 0: out = norm(residual += in) with the input norm (residual null: norm(in) only)
//   stage 1: in = qkv [rows, qkv]: rotate, store k and v, attend; out = attention [rows, q]
//   stage 2: out = norm(residual += in) with the post-attention norm
//   stage 3: in = gate_up [rows, 2 * inter]; out = act(gate) * up [rows, inter]
// 0, or stage * 1000 + the failing kernel's code.
extern "C" int tg_decode_glue(const DecodeLayer* L, const DecodeStep* S, int stage, void* in,
                              void* residual, void* out) {
  const int dtype = static_cast<int>(L->dtype), threads = static_cast<int>(S->threads);
  const int64_t rows = S->rows;
  if (L->rope < 0 || L->rope >= kKinds || L->plan < 0 || L->plan >= kKinds) return 1;
  int status = 2;
  switch (stage) {
    case 0:
    case 2:
      status = tg_add_rms_norm(dtype, in, residual, stage == 0 ? L->input_norm : L->post_norm,
                               rows, L->hidden, L->eps, L->unit_offset, out, threads);
      break;
    case 1: {
      thread_local std::vector<char> q;  // the queries, contiguous (a layer's, reused)
      const size_t elem = 2;             // bf16 / fp16
      char* queries = at_least(q, rows * L->num_heads * L->head_dim * elem);
      void* cache = static_cast<char*>(S->cache) + L->layer * S->layer_stride * elem;
      status = attend(L, S, in, queries, cache, out);
      break;
    }
    case 3:
      status = tg_act_mul(dtype, static_cast<int>(L->act), in, rows, L->inter, out, threads);
      break;
    default:
      return 3;
  }
  return status ? static_cast<int>(1000 * stage + status) : 0;
}
