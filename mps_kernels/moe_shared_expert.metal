// hebrus::moe_shared_expert and moe_shared_expert_quantized on Apple GPUs (issue 37): a MoE block's shared
// expert (transformers' Qwen4ExpTextMLP) times its sigmoid gate, added to the routed experts' output
// (hebrus_torch/reference/moe.py is the spec). Two launches (hebrus_launch.h), nothing read on the host:
//   act:  half a SIMD-group (16 lanes) per (row t, intermediate output i): the gate_proj and up_proj dot
//         products of row t, a = round(round(silu(round(g))) * round(u)), into an fp32 scratch act [T, I];
//   down: half a SIMD-group per (row t, hidden output d): y = round(down_proj[d] . act[t]),
//         out = round(routed[t, d] + round(y * gate[t])).
// The roundings (to T) are where the modules round (bf16 linears, silu, the products, the add). The two
// bodies are templates over the projections' row reader (MLX-style): dense rows (moe_shared_expert; each dot
// product summed as moe_experts.metal sums it: lane l over inputs l, l + 16, ..., then the halves' pairwise
// shuffles) or affine-quantized rows (moe_shared_expert_quantized, variants q4 / q8: quantized_linear's
// group fold, HebrusMoeQuantRows). silu is the CPU kernels' (moe_experts.h), so a row's output depends only
// on its own inputs.
#include "moe_experts.h"

// The rows of a dense matrix W [rows, cols] of T: dot(r, v, l) is lane l's part of W[r] . v (inputs l, l + 16,
// ... in ascending order, zero past cols).
template <typename T>
struct HebrusMoeDenseRows {
  device const T* w;
  long cols;

  template <typename V>
  float dot(long r, device const V* v, long l) const {
    const long padded = (cols + HEBRUS_MOE_LANES - 1) / HEBRUS_MOE_LANES * HEBRUS_MOE_LANES;
    device const T* wr = w + r * cols;
    float acc = 0.0f;
    for (long d = l; d < padded; d += HEBRUS_MOE_LANES) {
      const bool in = d < cols;
      acc = acc + (in ? static_cast<float>(wr[d]) : 0.0f) * (in ? static_cast<float>(v[d]) : 0.0f);
    }
    return acc;
  }
};

// The act launch's body: act[row, i] for the thread's (row, i), gate and up rows read through R.
template <typename T, typename R>
inline void hebrus_moe_shared_act(device const T* x, R gate_rows, R up_rows, device float* act,
                                  constant MoeSharedParams& p, uint tid, uint lane) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long row = item / p.inter, i = item % p.inter;
  const bool valid = row < p.rows;
  device const T* xr = x + (valid ? row : 0) * p.hidden;
  const float g = hebrus_moe_reduce(valid ? gate_rows.dot(i, xr, l) : 0.0f);
  const float u = hebrus_moe_reduce(valid ? up_rows.dot(i, xr, l) : 0.0f);
  if (valid && l == 0) {
    const float silu_g = hebrus_moe_round<T>(hebrus_moe_silu(hebrus_moe_round<T>(g)));
    act[row * p.inter + i] = hebrus_moe_round<T>(silu_g * hebrus_moe_round<T>(u));
  }
}

// The down launch's body: out[row, d] for the thread's (row, d), down rows read through R.
template <typename T, typename R>
inline void hebrus_moe_shared_down(R down_rows, device const float* act, device const T* gate,
                                   device const T* routed, device T* out, constant MoeSharedParams& p, uint tid,
                                   uint lane) {
  const long item = long(tid) / HEBRUS_MOE_LANES;
  const long l = long(lane % HEBRUS_MOE_LANES);
  const long row = item / p.hidden, d = item % p.hidden;
  const bool valid = row < p.rows;
  const float y = hebrus_moe_reduce(valid ? down_rows.dot(d, act + row * p.inter, l) : 0.0f);
  if (valid && l == 0) {
    const float gated = hebrus_moe_round<T>(hebrus_moe_round<T>(y) * static_cast<float>(gate[row * p.gate_stride]));
    out[row * p.hidden + d] = static_cast<T>(static_cast<float>(routed[row * p.hidden + d]) + gated);
  }
}

// ---- moe_shared_expert: dense projections ------------------------------------------------------------------

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
  hebrus_moe_shared_act<T>(x, HebrusMoeDenseRows<T>{gate_proj, p.hidden}, HebrusMoeDenseRows<T>{up_proj, p.hidden},
                           act, p, tid, lane);
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
  hebrus_moe_shared_down<T>(HebrusMoeDenseRows<T>{down_proj, p.inter}, act, gate, routed, out, p, tid, lane);
}

// ---- moe_shared_expert_quantized: affine-quantized projections (variants q4 / q8) --------------------------

template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_shared_expert_quantized_act(
    device const T* x [[buffer(0)]],                 // [T, H]
    device const uint* gate_proj_q [[buffer(1)]],    // [I, H * BITS / 32]
    device const T* gate_proj_scales [[buffer(2)]],  // [I, H / group]
    device const T* gate_proj_biases [[buffer(3)]],  // [I, H / group]
    device const uint* up_proj_q [[buffer(4)]],      // [I, H * BITS / 32]
    device const T* up_proj_scales [[buffer(5)]],    // [I, H / group]
    device const T* up_proj_biases [[buffer(6)]],    // [I, H / group]
    device float* act [[buffer(7)]],                 // [T, I]
    device HebrusErrorMessages* err [[buffer(8)]],   // (bound as in every launch; no value to check)
    constant MoeSharedParams& p [[buffer(9)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  using Rows = HebrusMoeQuantRows<BITS, T>;
  hebrus_moe_shared_act<T>(x, Rows{gate_proj_q, gate_proj_scales, gate_proj_biases, p.hidden, p.group_size},
                           Rows{up_proj_q, up_proj_scales, up_proj_biases, p.hidden, p.group_size}, act, p, tid,
                           lane);
}

template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_TG)]] void moe_shared_expert_quantized_down(
    device const uint* down_proj_q [[buffer(0)]],    // [H, I * BITS / 32]
    device const T* down_proj_scales [[buffer(1)]],  // [H, I / group]
    device const T* down_proj_biases [[buffer(2)]],  // [H, I / group]
    device const float* act [[buffer(3)]],           // [T, I]
    device const T* gate [[buffer(4)]],              // [T, 1], rows p.gate_stride apart
    device const T* routed [[buffer(5)]],            // [T, H]
    device T* out [[buffer(6)]],                     // [T, H]
    device HebrusErrorMessages* err [[buffer(7)]],   // (bound as in every launch)
    constant MoeSharedParams& p [[buffer(8)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  hebrus_moe_shared_down<T>(
      HebrusMoeQuantRows<BITS, T>{down_proj_q, down_proj_scales, down_proj_biases, p.inter, p.group_size}, act, gate,
      routed, out, p, tid, lane);
}

HEBRUS_INSTANTIATE(moe_shared_expert_act, float, float)
HEBRUS_INSTANTIATE(moe_shared_expert_act, half, half)
HEBRUS_INSTANTIATE(moe_shared_expert_down, float, float)
HEBRUS_INSTANTIATE(moe_shared_expert_down, half, half)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_act, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_act, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_act, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_act, q8, half, 8, half)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_down, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_down, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_down, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_down, q8, half, 8, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(moe_shared_expert_act, bfloat, bfloat)
HEBRUS_INSTANTIATE(moe_shared_expert_down, bfloat, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_act, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_act, q8, bfloat, 8, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_down, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(moe_shared_expert_quantized_down, q8, bfloat, 8, bfloat)
#endif
