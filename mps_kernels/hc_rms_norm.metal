// hebrus::hc_rms_norm on Apple GPUs (issue 37): Qwen4Exp's RMSNorm of every row over groups of
// `group` features, the hyper-connections' hc_norm in one launch (hebrus_torch/reference/hc.py is the
// spec, transformers' Qwen4ExpTextRMSNorm the model).
//
// Thread layout (hebrus_launch.h): one SIMD-group (32 lanes) per (row, group), 8 per threadgroup; the
// last threadgroup may hold fewer SIMD-groups, never a partial one. Each lane sums the squares of the
// features lane, lane + 32, ... in fp32, simd_sum adds the lanes, and every lane writes its features
// as (x * rsqrt(sum / group + eps)) * (1 + w) in fp32, rounded to T (the module's order of products).
// A lane reads only the features it writes: no barrier.
#include "hebrus_metal_common.h"

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_HC_NORM_TG)]] void hc_rms_norm(
    device const T* x [[buffer(0)]],              // [T, D]
    device const float* weight [[buffer(1)]],     // [D], as fp32
    device T* out [[buffer(2)]],                  // [T, D]
    device HebrusErrorMessages* err [[buffer(3)]],  // the stream's error buffer (no value to check)
    constant HcRmsNormParams& p [[buffer(4)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long groups_per_row = p.dim / p.group;
  const long pair = long(tid) / HEBRUS_SIMD_WIDTH;
  if (pair >= p.rows * groups_per_row) {
    return;  // whole SIMD-groups only: the grid is a multiple of 32 threads
  }
  const long row = pair / groups_per_row;
  const long first = row * p.dim + (pair % groups_per_row) * p.group;
  const long wfirst = (pair % groups_per_row) * p.group;
  float sum_sq = 0.0f;
  for (long i = long(lane); i < p.group; i += HEBRUS_SIMD_WIDTH) {
    const float v = static_cast<float>(x[first + i]);
    sum_sq = sum_sq + v * v;
  }
  const float inv = precise::rsqrt(simd_sum(sum_sq) / float(p.group) + p.eps);
  for (long i = long(lane); i < p.group; i += HEBRUS_SIMD_WIDTH) {
    const float v = static_cast<float>(x[first + i]);
    out[first + i] = static_cast<T>((v * inv) * (1.0f + weight[wfirst + i]));
  }
}

HEBRUS_INSTANTIATE(hc_rms_norm, float, float)
HEBRUS_INSTANTIATE(hc_rms_norm, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(hc_rms_norm, bfloat, bfloat)
#endif
