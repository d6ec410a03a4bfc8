// hebrus::moe_experts on Apple GPUs: the routed experts of a MoE block over packed rows (issue 36;
// hebrus_torch/reference/moe.py is the spec, csrc/cpu/moe_kernels.cpp the CPU kernel whose bits these
// kernels reproduce).
//
// Three launches (hebrus_launch.h), a fixed count whatever the experts hit, nothing read on the host:
//   act:  half a SIMD-group (16 lanes) per (pair p = t * k + j, intermediate output i): the gate and
//         up dot products of row t with expert e = topk_ids[p], a = round(round(silu(g)) * u), into an
//         fp32 scratch act [pairs, I]. Decode reads each hit expert's rows once per pair: a gather GEMV.
//   down: half a SIMD-group per (pair, hidden output d): y = round(down[e, d] . act[p]) times the
//         router weight (rounded to x's dtype where topk_weights has it), into ywt [pairs, H] fp32.
//   sum:  one thread per (row, d): out = round(((0 + ywt[t, 0]) + ywt[t, 1]) + ...), slot order.
// Every dot product is summed as the CPU kernel sums it (hebrus_simd.h): lane l of the half adds the
// products of inputs d = l, l + 16, ... in ascending d (zero-padded to a multiple of 16), then the
// halves' lanes combine pairwise (l + 8, + 4, + 2, + 1) through shuffles, not simd_sum (whose tree is
// the hardware's). silu is the CPU kernels' (Cephes exp with fused multiply-adds on the clamped bit
// pattern). So a row's output depends only on its own inputs, and equals the CPU kernel's bits where
// the GPU's division and conversions round as IEEE says (they do in the emulator).
// An expert id outside [0, E) is reported through the stream's error buffer by the act item (p, 0);
// that pair's items write nothing.
#include "moe_experts.h"

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_act(
    device const T* x [[buffer(0)]],           // [T, H]
    device const long* ids [[buffer(1)]],      // [T * k]
    device const T* gate_up [[buffer(2)]],     // [E, 2I, H]
    device float* act [[buffer(3)]],           // [T * k, I]
    device HebrusErrorMessages* err [[buffer(4)]],  // the stream's error buffer
    constant MoeExpertsParams& p [[buffer(5)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long pair = item / p.inter, i = item % p.inter;
  bool valid = pair < p.pairs;
  const long e = valid ? ids[pair] : 0;
  if (valid && (e < 0 || e >= p.experts)) {
    if (i == 0 && l == 0) {
      HEBRUS_REPORT_ERROR(err, "moe_experts", "hebrus::moe_experts: topk_ids[", pair / p.top_k, ", ",
                          pair % p.top_k, "] = ", e, " is not an expert id in [0, E=", p.experts, ")");
    }
    valid = false;
  }
  float g = 0.0f, u = 0.0f;
  if (valid) {
    const long H = p.hidden, padded = (H + HEBRUS_MOE_LANES - 1) / HEBRUS_MOE_LANES * HEBRUS_MOE_LANES;
    device const T* xr = x + (pair / p.top_k) * H;
    device const T* wg = gate_up + (e * 2 * p.inter + i) * H;
    device const T* wu = wg + p.inter * H;
    for (long d = l; d < padded; d += HEBRUS_MOE_LANES) {
      const bool in = d < H;
      const float xv = in ? static_cast<float>(xr[d]) : 0.0f;
      const float a = in ? static_cast<float>(wg[d]) : 0.0f;
      const float b = in ? static_cast<float>(wu[d]) : 0.0f;
      g = g + a * xv;
      u = u + b * xv;
    }
  }
  g = hebrus_moe_reduce(g);
  u = hebrus_moe_reduce(u);
  if (valid && l == 0) {
    act[pair * p.inter + i] = hebrus_moe_act_value<T>(g, u);
  }
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_down(
    device const long* ids [[buffer(0)]],      // [T * k]
    device const float* weights [[buffer(1)]], // [T * k], topk_weights as fp32
    device const T* down [[buffer(2)]],        // [E, H, I]
    device const float* act [[buffer(3)]],     // [T * k, I]
    device float* ywt [[buffer(4)]],           // [T * k, H]
    device HebrusErrorMessages* err [[buffer(5)]],  // (bound as in every launch; act reports bad ids)
    constant MoeExpertsParams& p [[buffer(6)]],
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
    const long I = p.inter, padded = (I + HEBRUS_MOE_LANES - 1) / HEBRUS_MOE_LANES * HEBRUS_MOE_LANES;
    device const T* w = down + (e * p.hidden + d) * I;
    device const float* a = act + pair * I;
    for (long c = l; c < padded; c += HEBRUS_MOE_LANES) {
      const bool in = c < I;
      y = y + (in ? static_cast<float>(w[c]) : 0.0f) * (in ? a[c] : 0.0f);
    }
  }
  y = hebrus_moe_reduce(y);
  if (valid && l == 0) {
    ywt[pair * p.hidden + d] = hebrus_moe_weighted<T>(y, weights[pair], p.round_product);
  }
}

// ---- the grouped (prefill) path ------------------------------------------------------------------------

// route: one threadgroup lists each expert's pairs in ascending pair order (order[pairs]) and cuts each list
// into tiles of at most HEBRUS_MOE_TILE_ROWS pairs (tiles[0] = count, then (expert, begin, end) per tile,
// experts ascending). Thread tid owns the experts [E * tid / TG, E * (tid + 1) / TG): it counts their pairs,
// the threads' totals are summed in threadgroup memory, then it writes their lists and tiles from its
// offsets. O(E * pairs) reads in all, no atomics, so the table is the same under any thread timing. Pairs
// whose id is outside [0, E) are in no list; they are reported here (the op named by group_size: 0 for
// moe_experts) and nothing is computed for them.
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_ROUTE_TG)]] void moe_experts_route(
    device const long* ids [[buffer(0)]],      // [T * k]
    device long* order [[buffer(1)]],          // [T * k]: the pairs by expert
    device long* tiles [[buffer(2)]],          // [1 + 3 * max_tiles]
    device HebrusErrorMessages* err [[buffer(3)]],
    constant MoeExpertsParams& p [[buffer(4)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup long pair_total[HEBRUS_MOE_ROUTE_TG];
  threadgroup long tile_total[HEBRUS_MOE_ROUTE_TG];
  const long E = p.experts, R = HEBRUS_MOE_TILE_ROWS;
  const long e0 = E * long(tid) / HEBRUS_MOE_ROUTE_TG, e1 = E * (long(tid) + 1) / HEBRUS_MOE_ROUTE_TG;
  for (long q = long(tid); q < p.pairs; q += HEBRUS_MOE_ROUTE_TG) {
    const long e = ids[q];
    if (e < 0 || e >= E) {
      HEBRUS_CSTR op = p.group_size == 0 ? "moe_experts" : "moe_experts_quantized";
      HEBRUS_REPORT_ERROR(err, op, "hebrus::", op, ": topk_ids[", q / p.top_k, ", ", q % p.top_k, "] = ", e,
                          " is not an expert id in [0, E=", E, ")");
    }
  }
  long np = 0, nt = 0;
  for (long e = e0; e < e1; ++e) {
    long n = 0;
    for (long q = 0; q < p.pairs; ++q) {
      n += ids[q] == e ? 1 : 0;
    }
    np += n;
    nt += (n + R - 1) / R;
  }
  pair_total[tid] = np;
  tile_total[tid] = nt;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  long pb = 0, tb = 0;
  for (uint j = 0; j < tid; ++j) {
    pb += pair_total[j];
    tb += tile_total[j];
  }
  for (long e = e0; e < e1; ++e) {
    long n = 0;
    for (long q = 0; q < p.pairs; ++q) {
      if (ids[q] == e) {
        order[pb + n] = q;
        ++n;
      }
    }
    for (long m = 0; m < n; m += R) {
      tiles[1 + 3 * tb] = e;
      tiles[2 + 3 * tb] = pb + m;
      tiles[3 + 3 * tb] = pb + (m + R < n ? m + R : n);
      ++tb;
    }
    pb += n;
  }
  if (tid == HEBRUS_MOE_ROUTE_TG - 1) {
    tiles[0] = tb;
  }
}

// act, grouped: one threadgroup per (tile, block of 16 intermediate outputs); the tile's x rows and the
// expert's gate and up rows staged HEBRUS_MOE_TILE_K inputs at a time (zero past H, up to H rounded up to 16
// as the decode kernel pads), each cell's lanes summing as the decode kernel's (moe_experts.h).
template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_act_grouped(
    device const T* x [[buffer(0)]],           // [T, H]
    device const long* order [[buffer(1)]],    // [T * k]: route's lists
    device const long* tiles [[buffer(2)]],    // route's tiles
    device const T* gate_up [[buffer(3)]],     // [E, 2I, H]
    device float* act [[buffer(4)]],           // [T * k, I]
    device HebrusErrorMessages* err [[buffer(5)]],  // (bound as in every launch; route reports bad ids)
    constant MoeExpertsParams& p [[buffer(6)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float xs_mem[HEBRUS_MOE_TILE_ROWS * HEBRUS_MOE_TILE_K];
  threadgroup T ws_mem[2 * HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K];  // gate rows, then up rows
  threadgroup long pairs_mem[HEBRUS_MOE_TILE_ROWS];
  threadgroup float* xs = xs_mem;
  threadgroup T* ws = ws_mem;
  threadgroup long* pairs_tg = pairs_mem;
  const long H = p.hidden, I = p.inter;
  const long blocks = (I + HEBRUS_MOE_TILE_COLS - 1) / HEBRUS_MOE_TILE_COLS;
  const long o0 = (long(tg) % blocks) * HEBRUS_MOE_TILE_COLS;
  long e = 0;
  if (!hebrus_moe_tile_pairs(tiles, order, long(tg) / blocks, pairs_tg, e, tid)) {
    return;
  }
  const uint l = tid % HEBRUS_MOE_LANES, cell = tid / HEBRUS_MOE_LANES, r = cell % HEBRUS_MOE_TILE_ROWS;
  const long c0 = long(cell / HEBRUS_MOE_TILE_ROWS) * HEBRUS_MOE_CELL_COLS;
  const long padded = (H + HEBRUS_MOE_LANES - 1) / HEBRUS_MOE_LANES * HEBRUS_MOE_LANES;
  float g[HEBRUS_MOE_CELL_COLS], u[HEBRUS_MOE_CELL_COLS];
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    g[j] = 0.0f;
    u[j] = 0.0f;
  }
  for (long k0 = 0; k0 < padded; k0 += HEBRUS_MOE_TILE_K) {
    hebrus_moe_stage_rows(xs, x, pairs_tg, p.top_k, H, k0, tid);
    hebrus_moe_stage_weights(ws, gate_up, e * 2 * I, o0, I, H, k0, tid);
    hebrus_moe_stage_weights(ws + HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K, gate_up, e * 2 * I + I, o0, I, H, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const long len = hebrus_min(HEBRUS_MOE_TILE_K, padded - k0);
    threadgroup const float* xrow = xs + r * HEBRUS_MOE_TILE_K;
    hebrus_moe_tile_dots<T>(g, ws + c0 * HEBRUS_MOE_TILE_K, xrow, len, l);
    hebrus_moe_tile_dots<T>(u, ws + (HEBRUS_MOE_TILE_COLS + c0) * HEBRUS_MOE_TILE_K, xrow, len, l);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step restages
  }
  const long pair = pairs_tg[r];
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    const float gj = hebrus_moe_reduce(g[j]), uj = hebrus_moe_reduce(u[j]);
    const long i = o0 + c0 + j;
    if (l == 0 && pair >= 0 && i < I) {
      act[pair * I + i] = hebrus_moe_act_value<T>(gj, uj);
    }
  }
}

// down, grouped: one threadgroup per (tile, block of 16 hidden outputs); the tile's act rows and the
// expert's down rows staged as in act_grouped (zero past I, up to I rounded up to 16).
template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_experts_down_grouped(
    device const long* order [[buffer(0)]],    // [T * k]: route's lists
    device const long* tiles [[buffer(1)]],    // route's tiles
    device const float* weights [[buffer(2)]], // [T * k], topk_weights as fp32
    device const T* down [[buffer(3)]],        // [E, H, I]
    device const float* act [[buffer(4)]],     // [T * k, I]
    device float* ywt [[buffer(5)]],           // [T * k, H]
    device HebrusErrorMessages* err [[buffer(6)]],  // (bound as in every launch; route reports bad ids)
    constant MoeExpertsParams& p [[buffer(7)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float as_mem[HEBRUS_MOE_TILE_ROWS * HEBRUS_MOE_TILE_K];
  threadgroup T ws_mem[HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K];
  threadgroup long pairs_mem[HEBRUS_MOE_TILE_ROWS];
  threadgroup float* as = as_mem;
  threadgroup T* ws = ws_mem;
  threadgroup long* pairs_tg = pairs_mem;
  const long H = p.hidden, I = p.inter;
  const long blocks = (H + HEBRUS_MOE_TILE_COLS - 1) / HEBRUS_MOE_TILE_COLS;
  const long o0 = (long(tg) % blocks) * HEBRUS_MOE_TILE_COLS;
  long e = 0;
  if (!hebrus_moe_tile_pairs(tiles, order, long(tg) / blocks, pairs_tg, e, tid)) {
    return;
  }
  const uint l = tid % HEBRUS_MOE_LANES, cell = tid / HEBRUS_MOE_LANES, r = cell % HEBRUS_MOE_TILE_ROWS;
  const long c0 = long(cell / HEBRUS_MOE_TILE_ROWS) * HEBRUS_MOE_CELL_COLS;
  const long padded = (I + HEBRUS_MOE_LANES - 1) / HEBRUS_MOE_LANES * HEBRUS_MOE_LANES;
  float y[HEBRUS_MOE_CELL_COLS];
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    y[j] = 0.0f;
  }
  for (long k0 = 0; k0 < padded; k0 += HEBRUS_MOE_TILE_K) {
    hebrus_moe_stage_rows(as, act, pairs_tg, 1, I, k0, tid);
    hebrus_moe_stage_weights(ws, down, e * H, o0, H, I, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    hebrus_moe_tile_dots<T>(y, ws + c0 * HEBRUS_MOE_TILE_K, as + r * HEBRUS_MOE_TILE_K,
                         hebrus_min(HEBRUS_MOE_TILE_K, padded - k0), l);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const long pair = pairs_tg[r];
  for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
    const float yj = hebrus_moe_reduce(y[j]);
    const long d = o0 + c0 + j;
    if (l == 0 && pair >= 0 && d < H) {
      ywt[pair * H + d] = hebrus_moe_weighted<T>(yj, weights[pair], p.round_product);
    }
  }
}

HEBRUS_INSTANTIATE(moe_experts_act_grouped, float, float)
HEBRUS_INSTANTIATE(moe_experts_act_grouped, half, half)
HEBRUS_INSTANTIATE(moe_experts_down_grouped, float, float)
HEBRUS_INSTANTIATE(moe_experts_down_grouped, half, half)
HEBRUS_INSTANTIATE(moe_experts_act, float, float)
HEBRUS_INSTANTIATE(moe_experts_act, half, half)
HEBRUS_INSTANTIATE(moe_experts_down, float, float)
HEBRUS_INSTANTIATE(moe_experts_down, half, half)
HEBRUS_INSTANTIATE(moe_experts_sum, float, float)
HEBRUS_INSTANTIATE(moe_experts_sum, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(moe_experts_act, bfloat, bfloat)
HEBRUS_INSTANTIATE(moe_experts_down, bfloat, bfloat)
HEBRUS_INSTANTIATE(moe_experts_sum, bfloat, bfloat)
HEBRUS_INSTANTIATE(moe_experts_act_grouped, bfloat, bfloat)
HEBRUS_INSTANTIATE(moe_experts_down_grouped, bfloat, bfloat)
#endif
