// hebrus::moe_experts_quantized on Apple GPUs: moe_experts over affine-quantized experts (issue 36;
// hebrus_torch/reference/moe.py is the spec, csrc/cpu/moe_kernels.cpp the CPU kernel whose bits these
// kernels reproduce, hebrus_torch/moe/quantize.py the format).
//
// The launches of moe_experts.metal (act, down; the sum is moe_experts.metal's moe_experts_sum), with each
// weight read as its code q (BITS bits of an int32 word, little end first) and each group's dot product
// folded as the CPU kernel folds it: per lane, qx = sum q * x and xs = sum x over the lane's values of the
// group (ascending d), then acc = acc + (qx * s + xs * b), s and b the group's scale and bias. Variants q4 and
// q8 are the bit widths; H and I are multiples of the group size (32, 64 or 128), so no row has a tail. The
// library also holds hebrus::quantized_linear's kernel (the same fold and lane order, one launch).
#include "hebrus_quant.h"
#include "moe_experts.h"

// ---- the grouped (prefill) path: the tile machinery of moe_experts.h over codes ---------------------------

// The codes of inputs [k0, k0 + TILE_K) of weight rows base + o0 + c, c < TILE_COLS (rows of `width` values,
// width * BITS / 32 words), zero for outputs o0 + c >= count and past width.
template <int BITS>
inline void hebrus_moe_stage_codes(threadgroup uchar* dst, device const uint* codes, long base, long o0, long count,
                                   long width, long k0, uint tid) {
  const long words = width * BITS / 32;
  for (uint v = tid; v < HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K; v += HEBRUS_MOE_TG) {
    const long o = o0 + long(v / HEBRUS_MOE_TILE_K), d = k0 + long(v % HEBRUS_MOE_TILE_K);
    dst[v] = o < count && d < width ? uchar(hebrus_moe_code_bits<BITS>(codes + (base + o) * words, d)) : uchar(0);
  }
}

// Lane l's part of the cell's 8 folded dot products over one staged step [k0, k0 + len) (len a multiple of
// the group size): per group, qx[j] = sum code * x and xs = sum x over the lane's inputs in ascending order,
// then acc[j] = acc[j] + (qx[j] * s + xs * b) with weight row row0 + j's scale and bias (rows >= count are
// outputs past the end: left at 0, never written).
template <typename T>
inline void hebrus_moe_tile_qdots(thread float* acc, threadgroup const uchar* codes, threadgroup const float* xrow,
                                  long len, long k0, long group_size, device const T* scales, device const T* biases,
                                  long row0, long rows_left, long groups, uint l) {
  for (long g0 = 0; g0 < len; g0 += group_size) {
    float qx[HEBRUS_MOE_CELL_COLS];
    float xs = 0.0f;
    for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
      qx[j] = 0.0f;
    }
    for (long m = g0 + long(l); m < g0 + group_size; m += HEBRUS_MOE_LANES) {
      const float xv = xrow[m];
      for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
        qx[j] = fma(float(codes[j * HEBRUS_MOE_TILE_K + m]), xv, qx[j]);
      }
      xs = xs + xv;
    }
    const long gi = (k0 + g0) / group_size;
    for (int j = 0; j < HEBRUS_MOE_CELL_COLS && j < rows_left; ++j) {
      acc[j] = hebrus_moe_fold(acc[j], qx[j], xs, scales + (row0 + j) * groups, biases + (row0 + j) * groups, gi);
    }
  }
}

// The folded sums of a tile of rows (pairs_tg[r] / div of src, `width` inputs) against weight rows
// base + o0 + c (count rows in all): the body of act_grouped (twice), down_grouped and quantized_linear_tiled. Returns the cell's 8
// reduced sums in acc (every lane calls it: the reductions shuffle).
template <int BITS, typename T, typename S>
inline void hebrus_moe_qtile(thread float* acc, threadgroup float* xs, threadgroup uchar* cs,
                             threadgroup const long* pairs_tg, device const S* src, long div, long width,
                             device const uint* wq, device const T* scales, device const T* biases, long base,
                             long o0, long count, long group_size, uint tid) {
  const uint l = tid % HEBRUS_MOE_LANES, cell = tid / HEBRUS_MOE_LANES, r = cell % HEBRUS_MOE_TILE_ROWS;
  const long c0 = long(cell / HEBRUS_MOE_TILE_ROWS) * HEBRUS_MOE_CELL_COLS, groups = width / group_size;
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    acc[j] = 0.0f;
  }
  for (long k0 = 0; k0 < width; k0 += HEBRUS_MOE_TILE_K) {
    hebrus_moe_stage_rows(xs, src, pairs_tg, div, width, k0, tid);
    hebrus_moe_stage_codes<BITS>(cs, wq, base, o0, count, width, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    hebrus_moe_tile_qdots<T>(acc, cs + c0 * HEBRUS_MOE_TILE_K, xs + r * HEBRUS_MOE_TILE_K,
                          hebrus_min(HEBRUS_MOE_TILE_K, width - k0), k0, group_size, scales, biases, base + o0 + c0,
                          count - (o0 + c0), groups, l);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    acc[j] = hebrus_moe_reduce(acc[j]);
  }
}

// act, grouped (moe_experts.metal's moe_experts_act_grouped over codes): the gate sums, then the up sums, of
// the tile's x rows, codes staged HEBRUS_MOE_TILE_K inputs (whole groups) at a time.
template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_quantized_act_grouped(
    device const T* x [[buffer(0)]],                // [T, H]
    device const long* order [[buffer(1)]],         // [T * k]: route's lists
    device const long* tiles [[buffer(2)]],         // route's tiles
    device const uint* gate_up_q [[buffer(3)]],     // [E, 2I, H * BITS / 32]
    device const T* gate_up_scales [[buffer(4)]],   // [E, 2I, H / group]
    device const T* gate_up_biases [[buffer(5)]],   // [E, 2I, H / group]
    device float* act [[buffer(6)]],                // [T * k, I]
    device HebrusErrorMessages* err [[buffer(7)]],  // (bound as in every launch; route reports bad ids)
    constant MoeExpertsParams& p [[buffer(8)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float xs_mem[HEBRUS_MOE_TILE_ROWS * HEBRUS_MOE_TILE_K];
  threadgroup uchar cs_mem[HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K];
  threadgroup long pairs_mem[HEBRUS_MOE_TILE_ROWS];
  threadgroup float* xs = xs_mem;
  threadgroup uchar* cs = cs_mem;
  threadgroup long* pairs_tg = pairs_mem;
  const long H = p.hidden, I = p.inter;
  const long blocks = (I + HEBRUS_MOE_TILE_COLS - 1) / HEBRUS_MOE_TILE_COLS;
  const long o0 = (long(tg) % blocks) * HEBRUS_MOE_TILE_COLS;
  long e = 0;
  if (!hebrus_moe_tile_pairs(tiles, order, long(tg) / blocks, pairs_tg, e, tid)) {
    return;
  }
  float g[HEBRUS_MOE_CELL_COLS], u[HEBRUS_MOE_CELL_COLS];
  hebrus_moe_qtile<BITS>(g, xs, cs, pairs_tg, x, p.top_k, H, gate_up_q, gate_up_scales, gate_up_biases, e * 2 * I, o0,
                         I, p.group_size, tid);
  hebrus_moe_qtile<BITS>(u, xs, cs, pairs_tg, x, p.top_k, H, gate_up_q, gate_up_scales, gate_up_biases, e * 2 * I + I,
                         o0, I, p.group_size, tid);
  const uint cell = tid / HEBRUS_MOE_LANES;
  const long pair = pairs_tg[cell % HEBRUS_MOE_TILE_ROWS], c0 = long(cell / HEBRUS_MOE_TILE_ROWS) * HEBRUS_MOE_CELL_COLS;
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    const long i = o0 + c0 + j;
    if (tid % HEBRUS_MOE_LANES == 0 && pair >= 0 && i < I) {
      act[pair * I + i] = hebrus_moe_act_value<T>(g[j], u[j]);
    }
  }
}

// down, grouped: the tile's act rows against the expert's down codes.
template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_quantized_down_grouped(
    device const long* order [[buffer(0)]],         // [T * k]: route's lists
    device const long* tiles [[buffer(1)]],         // route's tiles
    device const float* weights [[buffer(2)]],      // [T * k], topk_weights as fp32
    device const uint* down_q [[buffer(3)]],        // [E, H, I * BITS / 32]
    device const T* down_scales [[buffer(4)]],      // [E, H, I / group]
    device const T* down_biases [[buffer(5)]],      // [E, H, I / group]
    device const float* act [[buffer(6)]],          // [T * k, I]
    device float* ywt [[buffer(7)]],                // [T * k, H]
    device HebrusErrorMessages* err [[buffer(8)]],  // (bound as in every launch; route reports bad ids)
    constant MoeExpertsParams& p [[buffer(9)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float xs_mem[HEBRUS_MOE_TILE_ROWS * HEBRUS_MOE_TILE_K];
  threadgroup uchar cs_mem[HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K];
  threadgroup long pairs_mem[HEBRUS_MOE_TILE_ROWS];
  threadgroup float* xs = xs_mem;
  threadgroup uchar* cs = cs_mem;
  threadgroup long* pairs_tg = pairs_mem;
  const long H = p.hidden, I = p.inter;
  const long blocks = (H + HEBRUS_MOE_TILE_COLS - 1) / HEBRUS_MOE_TILE_COLS;
  const long o0 = (long(tg) % blocks) * HEBRUS_MOE_TILE_COLS;
  long e = 0;
  if (!hebrus_moe_tile_pairs(tiles, order, long(tg) / blocks, pairs_tg, e, tid)) {
    return;
  }
  float y[HEBRUS_MOE_CELL_COLS];
  hebrus_moe_qtile<BITS>(y, xs, cs, pairs_tg, act, 1, I, down_q, down_scales, down_biases, e * H, o0, H, p.group_size,
                         tid);
  const uint cell = tid / HEBRUS_MOE_LANES;
  const long pair = pairs_tg[cell % HEBRUS_MOE_TILE_ROWS], c0 = long(cell / HEBRUS_MOE_TILE_ROWS) * HEBRUS_MOE_CELL_COLS;
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    const long d = o0 + c0 + j;
    if (tid % HEBRUS_MOE_LANES == 0 && pair >= 0 && d < H) {
      ywt[pair * H + d] = hebrus_moe_weighted<T>(y[j], weights[pair], p.round_product);
    }
  }
}

template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_quantized_act(
    device const T* x [[buffer(0)]],                // [T, H]
    device const long* ids [[buffer(1)]],           // [T * k]
    device const uint* gate_up_q [[buffer(2)]],     // [E, 2I, H * BITS / 32]
    device const T* gate_up_scales [[buffer(3)]],   // [E, 2I, H / group]
    device const T* gate_up_biases [[buffer(4)]],   // [E, 2I, H / group]
    device float* act [[buffer(5)]],                // [T * k, I]
    device HebrusErrorMessages* err [[buffer(6)]],  // the stream's error buffer
    constant MoeExpertsParams& p [[buffer(7)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long pair = item / p.inter, i = item % p.inter;
  bool valid = pair < p.pairs;
  const long e = valid ? ids[pair] : 0;
  if (valid && (e < 0 || e >= p.experts)) {
    if (i == 0 && l == 0) {
      HEBRUS_REPORT_ERROR(err, "moe_experts_quantized", "hebrus::moe_experts_quantized: topk_ids[", pair / p.top_k,
                          ", ", pair % p.top_k, "] = ", e, " is not an expert id in [0, E=", p.experts, ")");
    }
    valid = false;
  }
  float g = 0.0f, u = 0.0f;
  if (valid) {
    const long H = p.hidden, words = H * BITS / 32, groups = H / p.group_size;
    const long gate_row = e * 2 * p.inter + i, up_row = gate_row + p.inter;
    device const T* xr = x + (pair / p.top_k) * H;
    for (long g0 = 0; g0 < H; g0 += p.group_size) {
      float qg = 0.0f, qu = 0.0f, xs = 0.0f;
      for (long d = g0 + l; d < g0 + p.group_size; d += HEBRUS_MOE_LANES) {
        const float xv = static_cast<float>(xr[d]);
        qg = fma(hebrus_moe_code<BITS>(gate_up_q + gate_row * words, d), xv, qg);
        qu = fma(hebrus_moe_code<BITS>(gate_up_q + up_row * words, d), xv, qu);
        xs = xs + xv;
      }
      const long gi = g0 / p.group_size;
      g = hebrus_moe_fold(g, qg, xs, gate_up_scales + gate_row * groups, gate_up_biases + gate_row * groups, gi);
      u = hebrus_moe_fold(u, qu, xs, gate_up_scales + up_row * groups, gate_up_biases + up_row * groups, gi);
    }
  }
  g = hebrus_moe_reduce(g);
  u = hebrus_moe_reduce(u);
  if (valid && l == 0) {
    act[pair * p.inter + i] = hebrus_moe_act_value<T>(g, u);
  }
}

template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_quantized_down(
    device const long* ids [[buffer(0)]],           // [T * k]
    device const float* weights [[buffer(1)]],      // [T * k], topk_weights as fp32
    device const uint* down_q [[buffer(2)]],        // [E, H, I * BITS / 32]
    device const T* down_scales [[buffer(3)]],      // [E, H, I / group]
    device const T* down_biases [[buffer(4)]],      // [E, H, I / group]
    device const float* act [[buffer(5)]],          // [T * k, I]
    device float* ywt [[buffer(6)]],                // [T * k, H]
    device HebrusErrorMessages* err [[buffer(7)]],  // (bound as in every launch; act reports bad ids)
    constant MoeExpertsParams& p [[buffer(8)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long pair = item / p.hidden, d = item % p.hidden;
  bool valid = pair < p.pairs;
  const long e = valid ? ids[pair] : 0;
  valid = valid && e >= 0 && e < p.experts;
  float y = 0.0f;
  if (valid) {
    const long I = p.inter, row = e * p.hidden + d, words = I * BITS / 32, groups = I / p.group_size;
    device const float* a = act + pair * I;
    for (long g0 = 0; g0 < I; g0 += p.group_size) {
      float qx = 0.0f, xs = 0.0f;
      for (long c = g0 + l; c < g0 + p.group_size; c += HEBRUS_MOE_LANES) {
        qx = fma(hebrus_moe_code<BITS>(down_q + row * words, c), a[c], qx);
        xs = xs + a[c];
      }
      y = hebrus_moe_fold(y, qx, xs, down_scales + row * groups, down_biases + row * groups, g0 / p.group_size);
    }
  }
  y = hebrus_moe_reduce(y);
  if (valid && l == 0) {
    ywt[pair * p.hidden + d] = hebrus_moe_weighted<T>(y, weights[pair], p.round_product);
  }
}

// hebrus::quantized_linear: out[t, o] = round(sum_d W[o, d] x[t, d]), folded as above, each sum by half a
// SIMD-group in the CPU kernel's lane order (csrc/cpu/moe_kernels.cpp quantized_linear_cpu).
template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void quantized_linear(
    device const T* x [[buffer(0)]],                // [T, in]
    device const uint* wq [[buffer(1)]],            // [out, in * BITS / 32]
    device const T* scales [[buffer(2)]],           // [out, in / group]
    device const T* biases [[buffer(3)]],           // [out, in / group]
    device T* out [[buffer(4)]],                    // [T, out]
    device HebrusErrorMessages* err [[buffer(5)]],  // (bound as in every launch; nothing to report)
    constant QuantLinearParams& p [[buffer(6)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long t = item / p.out, o = item % p.out;
  const bool valid = t < p.rows;
  const HebrusMoeQuantRows<BITS, T> w{wq, scales, biases, p.in, p.group_size};
  const float acc = hebrus_moe_reduce(valid ? w.dot(o, x + t * p.in, l) : 0.0f);
  if (valid && l == 0) {
    out[t * p.out + o] = static_cast<T>(acc);
  }
}

// quantized_linear at many rows: one threadgroup per (tile of 8 rows, 16 outputs), the weights' codes staged
// once per tile; every sum has the one-launch kernel's bits (the same lanes, groups and fold).
template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void quantized_linear_tiled(
    device const T* x [[buffer(0)]],                // [T, in]
    device const uint* wq [[buffer(1)]],            // [out, in * BITS / 32]
    device const T* scales [[buffer(2)]],           // [out, in / group]
    device const T* biases [[buffer(3)]],           // [out, in / group]
    device T* out [[buffer(4)]],                    // [T, out]
    device HebrusErrorMessages* err [[buffer(5)]],  // (bound as in every launch; nothing to report)
    constant QuantLinearParams& p [[buffer(6)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float xs_mem[HEBRUS_MOE_TILE_ROWS * HEBRUS_MOE_TILE_K];
  threadgroup uchar cs_mem[HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K];
  threadgroup long rows_mem[HEBRUS_MOE_TILE_ROWS];
  threadgroup float* xs = xs_mem;
  threadgroup uchar* cs = cs_mem;
  threadgroup long* rows_tg = rows_mem;
  const long blocks = (p.out + HEBRUS_MOE_TILE_COLS - 1) / HEBRUS_MOE_TILE_COLS;
  const long t0 = (long(tg) / blocks) * HEBRUS_MOE_TILE_ROWS, o0 = (long(tg) % blocks) * HEBRUS_MOE_TILE_COLS;
  if (tid < HEBRUS_MOE_TILE_ROWS) {
    rows_tg[tid] = t0 + long(tid) < p.rows ? t0 + long(tid) : -1;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float acc[HEBRUS_MOE_CELL_COLS];
  hebrus_moe_qtile<BITS>(acc, xs, cs, rows_tg, x, 1, p.in, wq, scales, biases, 0, o0, p.out, p.group_size, tid);
  const uint cell = tid / HEBRUS_MOE_LANES;
  const long t = rows_tg[cell % HEBRUS_MOE_TILE_ROWS], c0 = long(cell / HEBRUS_MOE_TILE_ROWS) * HEBRUS_MOE_CELL_COLS;
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    const long o = o0 + c0 + j;
    if (tid % HEBRUS_MOE_LANES == 0 && t >= 0 && o < p.out) {
      out[t * p.out + o] = static_cast<T>(acc[j]);
    }
  }
}

HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act_grouped, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act_grouped, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act_grouped, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act_grouped, q8, half, 8, half)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down_grouped, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down_grouped, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down_grouped, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down_grouped, q8, half, 8, half)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear_tiled, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear_tiled, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear_tiled, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear_tiled, q8, half, 8, half)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act, q8, half, 8, half)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down, q8, half, 8, half)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear, q8, half, 8, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE_VARIANT(quantized_linear, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear, q8, bfloat, 8, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act, q8, bfloat, 8, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down, q8, bfloat, 8, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act_grouped, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_act_grouped, q8, bfloat, 8, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down_grouped, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_experts_quantized_down_grouped, q8, bfloat, 8, bfloat)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear_tiled, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(quantized_linear_tiled, q8, bfloat, 8, bfloat)
#endif
