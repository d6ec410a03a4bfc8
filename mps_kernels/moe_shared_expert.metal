// hebrus::moe_shared_expert on Apple GPUs (issue 37): a MoE block's shared expert (transformers'
// Qwen4ExpTextMLP) times its sigmoid gate, added to the routed experts' output (hebrus_torch/reference/moe.py
// is the spec). Two launches (hebrus_launch.h), nothing read on the host:
//   act:  half a SIMD-group (16 lanes) per (row t, intermediate output i): the gate_proj and up_proj dot
//         products of row t, a = round(round(silu(round(g))) * round(u)), into an fp32 scratch act [T, I];
//   down: half a SIMD-group per (row t, hidden output d): y = round(down_proj[d] . act[t]),
//         out = round(routed[t, d] + round(y * gate[t])).
// The roundings (to T) are where the modules round (bf16 linears, silu, the products, the add). Dot
// products are summed as moe_experts.metal sums them (lane l over inputs l, l + 16, ..., then the
// halves' pairwise shuffles), silu is the CPU kernels' (moe_experts.h), so a row's output depends only on
// its own inputs.
#include "moe_experts.h"

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_shared_expert_act(
    device const T* x [[buffer(0)]],                // [T, H]
    device const T* gate_proj [[buffer(1)]],        // [I, H]
    device const T* up_proj [[buffer(2)]],          // [I, H]
    device float* act [[buffer(3)]],                // [T, I]
    device HebrusErrorMessages* err [[buffer(4)]],  // the stream's error buffer (no value to check)
    constant MoeSharedParams& p [[buffer(5)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long row = item / p.inter, i = item % p.inter;
  const bool valid = row < p.rows;
  float g = 0.0f, u = 0.0f;
  if (valid) {
    const long H = p.hidden, padded = (H + HEBRUS_MOE_LANES - 1) / HEBRUS_MOE_LANES * HEBRUS_MOE_LANES;
    device const T* xr = x + row * H;
    device const T* wg = gate_proj + i * H;
    device const T* wu = up_proj + i * H;
    for (long d = l; d < padded; d += HEBRUS_MOE_LANES) {
      const bool in = d < H;
      const float xv = in ? static_cast<float>(xr[d]) : 0.0f;
      g = g + (in ? static_cast<float>(wg[d]) : 0.0f) * xv;
      u = u + (in ? static_cast<float>(wu[d]) : 0.0f) * xv;
    }
  }
  g = hebrus_moe_reduce(g);
  u = hebrus_moe_reduce(u);
  if (valid && l == 0) {
    const float silu_g = hebrus_moe_round<T>(hebrus_moe_silu(hebrus_moe_round<T>(g)));
    act[row * p.inter + i] = hebrus_moe_round<T>(silu_g * hebrus_moe_round<T>(u));
  }
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_shared_expert_down(
    device const T* down_proj [[buffer(0)]],        // [H, I]
    device const float* act [[buffer(1)]],          // [T, I]
    device const T* gate [[buffer(2)]],             // [T, 1], rows p.gate_stride apart
    device const T* routed [[buffer(3)]],           // [T, H]
    device T* out [[buffer(4)]],                    // [T, H]
    device HebrusErrorMessages* err [[buffer(5)]],  // (bound as in every launch)
    constant MoeSharedParams& p [[buffer(6)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long row = item / p.hidden, d = item % p.hidden;
  const bool valid = row < p.rows;
  float y = 0.0f;
  if (valid) {
    const long I = p.inter, padded = (I + HEBRUS_MOE_LANES - 1) / HEBRUS_MOE_LANES * HEBRUS_MOE_LANES;
    device const T* w = down_proj + d * I;
    device const float* a = act + row * I;
    for (long c = l; c < padded; c += HEBRUS_MOE_LANES) {
      const bool in = c < I;
      y = y + (in ? static_cast<float>(w[c]) : 0.0f) * (in ? a[c] : 0.0f);
    }
  }
  y = hebrus_moe_reduce(y);
  if (valid && l == 0) {
    const float gated = hebrus_moe_round<T>(hebrus_moe_round<T>(y) * static_cast<float>(gate[row * p.gate_stride]));
    out[row * p.hidden + d] = static_cast<T>(static_cast<float>(routed[row * p.hidden + d]) + gated);
  }
}

HEBRUS_INSTANTIATE(moe_shared_expert_act, float, float)
HEBRUS_INSTANTIATE(moe_shared_expert_act, half, half)
HEBRUS_INSTANTIATE(moe_shared_expert_down, float, float)
HEBRUS_INSTANTIATE(moe_shared_expert_down, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(moe_shared_expert_act, bfloat, bfloat)
HEBRUS_INSTANTIATE(moe_shared_expert_down, bfloat, bfloat)
#endif
