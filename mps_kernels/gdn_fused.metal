// hebrus::gdn_gates and hebrus::gdn_gated_rms_norm on Apple GPUs (issue 37): the gated-delta-net layer's
// gates and its gated output norm, one launch each (hebrus_torch/reference/gdn.py is the spec,
// transformers' Qwen4ExpTextGatedDeltaNet and Qwen4ExpTextRMSNormGated the model).
//
// gdn_gates: one thread per (row, value head) of a, b [rows, Hv]:
//   g    = -exp(A_log[h]) * (max(x, 0) + log(1 + exp(-|x|))),  x = a + dt_bias[h]      (fp32)
//   beta = 1 / (1 + exp(-b)) in fp32, rounded to T, stored as fp32 (what the delta rule reads)
// gdn_gated_rms_norm: one SIMD-group (32 lanes) per row of x [rows, D], 8 per threadgroup; the last
// threadgroup may hold fewer SIMD-groups, never a partial one. Each lane sums the squares of features
// lane, lane + 32, ... in fp32, simd_sum adds the lanes; every lane then writes its features as the
// module orders them: n = T(x * rsqrt(sum / D + eps)); p = w * n in fp32, rounded to T where the
// module's product has x's dtype; out = T(p * act(gate)), act silu (g / (1 + exp(-g))) or sigmoid.
// A lane reads only the features it writes: no barrier.
#include "hebrus_metal_common.h"

// Entry i of a parameter vector of dtype `dtype` (0 float, 1 half, 2 bfloat), as fp32 (exact). A
// bfloat's bits are the upper half of the fp32's, so no bfloat type is needed.
inline float gdn_param(device const uchar* p, int dtype, long i) {
  if (dtype == 1) {
    return float(((device const half*)p)[i]);
  }
  if (dtype == 2) {
    return as_type<float>(uint(((device const ushort*)p)[i]) << 16);
  }
  return ((device const float*)p)[i];
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_GDN_GATES_TG)]] void gdn_gates(
    device const T* a [[buffer(0)]],              // [rows, Hv]
    device const T* b [[buffer(1)]],              // [rows, Hv]
    device const uchar* A_log [[buffer(2)]],      // [Hv], its own dtype
    device const uchar* dt_bias [[buffer(3)]],    // [Hv], its own dtype
    device float* g [[buffer(4)]],                // [rows, Hv]
    device float* beta [[buffer(5)]],             // [rows, Hv]
    device HebrusErrorMessages* err [[buffer(6)]],  // the stream's error buffer (no value to check)
    constant GdnGatesParams& p [[buffer(7)]],
    uint tid [[thread_position_in_grid]]) {
  const long i = long(tid);
  if (i >= p.rows * p.heads) {
    return;
  }
  const long h = i % p.heads;
  const float x = static_cast<float>(a[i]) + gdn_param(dt_bias, p.dt_bias_dtype, h);
  const float softplus = max(x, 0.0f) + precise::log(1.0f + precise::exp(-abs(x)));
  g[i] = -precise::exp(gdn_param(A_log, p.a_log_dtype, h)) * softplus;
  const float s = 1.0f / (1.0f + precise::exp(-static_cast<float>(b[i])));
  beta[i] = static_cast<float>(static_cast<T>(s));
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_GDN_NORM_TG)]] void gdn_gated_rms_norm(
    device const T* x [[buffer(0)]],              // [rows, D]
    device const T* gate [[buffer(1)]],           // [rows, D]
    device const uchar* weight [[buffer(2)]],     // [D], its own dtype
    device T* out [[buffer(3)]],                  // [rows, D]
    device HebrusErrorMessages* err [[buffer(4)]],  // the stream's error buffer (no value to check)
    constant GdnGatedNormParams& p [[buffer(5)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long row = long(tid) / HEBRUS_SIMD_WIDTH;
  if (row >= p.rows) {
    return;  // whole SIMD-groups only: the grid is a multiple of 32 threads
  }
  const long first = row * p.dim;
  float sum_sq = 0.0f;
  for (long i = long(lane); i < p.dim; i += HEBRUS_SIMD_WIDTH) {
    const float v = static_cast<float>(x[first + i]);
    sum_sq = sum_sq + v * v;
  }
  const float inv = precise::rsqrt(simd_sum(sum_sq) / float(p.dim) + p.eps);
  for (long i = long(lane); i < p.dim; i += HEBRUS_SIMD_WIDTH) {
    const float n = static_cast<float>(static_cast<T>(static_cast<float>(x[first + i]) * inv));
    float prod = gdn_param(weight, p.weight_dtype, i) * n;
    if (p.round_product != 0) {
      prod = static_cast<float>(static_cast<T>(prod));
    }
    const float gv = static_cast<float>(gate[first + i]);
    const float act = p.sigmoid != 0 ? 1.0f / (1.0f + precise::exp(-gv)) : gv / (1.0f + precise::exp(-gv));
    out[first + i] = static_cast<T>(prod * act);
  }
}

HEBRUS_INSTANTIATE(gdn_gates, float, float)
HEBRUS_INSTANTIATE(gdn_gates, half, half)
HEBRUS_INSTANTIATE(gdn_gated_rms_norm, float, float)
HEBRUS_INSTANTIATE(gdn_gated_rms_norm, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(gdn_gates, bfloat, bfloat)
HEBRUS_INSTANTIATE(gdn_gated_rms_norm, bfloat, bfloat)
#endif
