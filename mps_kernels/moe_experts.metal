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
    const float gr = hebrus_moe_round<T>(g), ur = hebrus_moe_round<T>(u);
    act[pair * p.inter + i] = hebrus_moe_round<T>(hebrus_moe_round<T>(hebrus_moe_silu(gr)) * ur);
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
    const float prod = hebrus_moe_round<T>(y) * weights[pair];
    ywt[pair * p.hidden + d] = p.round_product != 0 ? hebrus_moe_round<T>(prod) : prod;
  }
}

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
#endif
