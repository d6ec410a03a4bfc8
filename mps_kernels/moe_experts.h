#pragma once
// What the moe_experts kernels (moe_experts.metal, moe_experts_quantized.metal) share: the CPU kernels'
// silu, the rounding to the storage type, the half-SIMD-group reduction in the CPU kernels' order, and the
// sum over each row's slots (instantiated in moe_experts.metal; the quantized op launches it from there).
#include "hebrus_metal_common.h"

// exp(x) of the CPU kernels' silu (hebrus_simd.h exp_silu), operation for operation.
inline float hebrus_moe_exp_silu(float x) {
  const float log2e = 1.44269504088896341f;
  const float ln2_hi = 0.693359375f;
  const float ln2_lo = -2.12194440e-4f;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const uint minus_87_5 = 0xC2AF0000u;
  const uint bits_89 = 0x42B20000u;
  const uint sign = 0x80000000u;
  const uint b = as_type<uint>(x);
  const uint neg_capped = b < minus_87_5 ? b : minus_87_5;
  const uint flipped = neg_capped ^ sign;
  const uint capped = flipped < (bits_89 ^ sign) ? flipped : (bits_89 ^ sign);
  const float xc = as_type<float>(capped ^ sign);
  const float t = fma(xc, log2e, magic);
  const float n = t - magic;
  const uint ni = as_type<uint>(t) - as_type<uint>(magic);
  const float r = fma(n, -ln2_lo, fma(n, -ln2_hi, xc));
  float y = 1.9875691500e-4f;
  y = fma(y, r, 1.3981999507e-3f);
  y = fma(y, r, 8.3334519073e-3f);
  y = fma(y, r, 4.1665795894e-2f);
  y = fma(y, r, 1.6666665459e-1f);
  y = fma(y, r, 5.0000001201e-1f);
  const float e = fma(y, r * r, r) + 1.0f;
  return (e * as_type<float>((ni + 126u) << 23)) * 2.0f;
}

inline float hebrus_moe_silu(float x) { return x / (1.0f + hebrus_moe_exp_silu(-x)); }

// v rounded to T and widened back.
template <typename T>
inline float hebrus_moe_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// The sum of the 16 lane partials of a half SIMD-group, at its lane 0, in reduce_lanes' order. Every lane
// of the SIMD-group calls it (uniform control flow at the shuffles).
inline float hebrus_moe_reduce(float v) {
  v = v + simd_shuffle_down(v, ushort(8));
  v = v + simd_shuffle_down(v, ushort(4));
  v = v + simd_shuffle_down(v, ushort(2));
  return v + simd_shuffle_down(v, ushort(1));
}

// The sum launch: one thread per (row, d): out = round(((0 + ywt[t, 0]) + ywt[t, 1]) + ...), slot order.
template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_SUM_TG)]] void moe_experts_sum(
    device const float* ywt [[buffer(0)]],     // [T * k, H]
    device T* out [[buffer(1)]],               // [T, H]
    device HebrusErrorMessages* err [[buffer(2)]],
    constant MoeExpertsParams& p [[buffer(3)]],
    uint tid [[thread_position_in_grid]]) {
  const long t = long(tid) / p.hidden, d = long(tid) % p.hidden;
  if (t >= p.rows) {
    return;
  }
  float s = 0.0f;
  for (long j = 0; j < p.top_k; ++j) {
    s = s + ywt[(t * p.top_k + j) * p.hidden + d];
  }
  out[t * p.hidden + d] = static_cast<T>(s);
}

