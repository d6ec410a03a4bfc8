// hebrus::hc_premix and hebrus::hc_post_combine on Apple GPUs (issue 37): the hyper-connections of a
// Qwen4Exp decoder layer (transformers' Qwen4ExpTextGatedResidual and the layer's injection;
// hebrus_torch/reference/hc.py is the spec). D = hc * hidden features per row, R = down's rows, I = hc
// inject weights (0 where the module has no block_inject_weight).
//
// hc_premix, two launches (hebrus_launch.h), a fixed count whatever T:
//   low: one SIMD-group per (row t, output o), o in [0, R + I). Per stream c, the lanes sum the squares
//        of h[t, c*hidden ...] (simd_sum), inv_c = rsqrt(sum / hidden + eps), and add to their partial
//        dot the products of row o of down (o < R) or of inject (o >= R) with
//        normed = round((h * inv_c) * (1 + w)); simd_sum adds the lanes' partials. Then
//        o < R:  low[t, o] = round(silu(round(round(dot) / hc)))              (fp32 scratch [T, R])
//        o >= R: weights[t, o - R] = round(2 * round(sigmoid(round(round(dot) / hc))))
//        and the SIMD-group of o = 0 stores inv [T, hc] (fp32 scratch) for the mix launch.
//   mix: one thread per (row t, feature k < hidden): per stream c in order, u = up[c*hidden + k] . low[t]
//        (fp32, ascending R), the product round(round(sigmoid(round(u))) * normed[t, c*hidden + k]) added
//        to an fp32 sum; mixed[t, k] = round(sum / hc).
// hc_post_combine, one launch: one thread per output feature,
//        result[t, c*hidden + k] = round(hyper[t, c*hidden + k] + round(out[t, k] * inject[t, c])).
// round() is to T (h's dtype) wherever the module's op rounds, so the pre-mix differs from the module's
// bits only by the order of the dot products' sums and the platform's exp / rsqrt, and the
// post-combine equals the CPU kernel's bits. A row's outputs depend only on that row. No value to
// check: the error buffer is bound but unused.
#include "hebrus_metal_common.h"

// v rounded to T and widened back.
template <typename T>
inline float hc_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline float hc_sigmoid(float x) { return 1.0f / (1.0f + precise::exp(-x)); }

// hc_norm's output at feature j of a row hr, rounded to T as the module's norm returns it.
template <typename T>
inline float hc_normed(device const T* hr, device const float* w, long j, float inv) {
  return hc_round<T>((static_cast<float>(hr[j]) * inv) * (1.0f + w[j]));
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_HC_PREMIX_TG)]] void hc_premix_low(
    device const T* h [[buffer(0)]],                // [T, D]
    device const float* norm_weight [[buffer(1)]],  // [D], as fp32
    device const T* down [[buffer(2)]],             // [R, D]
    device const T* inject [[buffer(3)]],           // [I, D] (down again where I = 0: never read)
    device float* inv [[buffer(4)]],                // [T, hc] scratch
    device float* low [[buffer(5)]],                // [T, R] scratch
    device T* weights [[buffer(6)]],                // [T, I] (a 1-entry scratch where I = 0: never written)
    device HebrusErrorMessages* err [[buffer(7)]],  // the stream's error buffer (no value to check)
    constant HcPremixParams& p [[buffer(8)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long outs = p.rank + p.injects;
  const long item = long(tid) / HEBRUS_SIMD_WIDTH;
  if (item >= p.rows * outs) {
    return;  // whole SIMD-groups only: the grid is a multiple of 32 threads
  }
  const long t = item / outs, o = item % outs;
  const long dim = p.hc * p.hidden;
  device const T* hr = h + t * dim;
  device const T* wr = o < p.rank ? down + o * dim : inject + (o - p.rank) * dim;
  float dot = 0.0f;
  for (long c = 0; c < p.hc; ++c) {
    float sum_sq = 0.0f;
    for (long i = long(lane); i < p.hidden; i += HEBRUS_SIMD_WIDTH) {
      const float v = static_cast<float>(hr[c * p.hidden + i]);
      sum_sq = sum_sq + v * v;
    }
    const float inv_c = precise::rsqrt(simd_sum(sum_sq) / float(p.hidden) + p.eps);
    if (o == 0 && lane == 0) {
      inv[t * p.hc + c] = inv_c;
    }
    for (long i = long(lane); i < p.hidden; i += HEBRUS_SIMD_WIDTH) {
      const long j = c * p.hidden + i;
      dot = dot + static_cast<float>(wr[j]) * hc_normed(hr, norm_weight, j, inv_c);
    }
  }
  dot = simd_sum(dot);
  if (lane != 0) {
    return;
  }
  const float scaled = hc_round<T>(hc_round<T>(dot) / float(p.hc));
  if (o < p.rank) {
    low[t * p.rank + o] = hc_round<T>(scaled / (1.0f + precise::exp(-scaled)));  // silu, as torch's
  } else {
    weights[t * p.injects + (o - p.rank)] = static_cast<T>(2.0f * hc_round<T>(hc_sigmoid(scaled)));
  }
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_HC_PREMIX_TG)]] void hc_premix_mix(
    device const T* h [[buffer(0)]],                // [T, D]
    device const float* norm_weight [[buffer(1)]],  // [D], as fp32
    device const T* up [[buffer(2)]],               // [D, R]
    device const float* inv [[buffer(3)]],          // [T, hc], from the low launch
    device const float* low [[buffer(4)]],          // [T, R], from the low launch
    device T* mixed [[buffer(5)]],                  // [T, hidden]
    device HebrusErrorMessages* err [[buffer(6)]],  // the stream's error buffer (no value to check)
    constant HcPremixParams& p [[buffer(7)]],
    uint tid [[thread_position_in_grid]]) {
  if (long(tid) >= p.rows * p.hidden) {
    return;
  }
  const long t = long(tid) / p.hidden, k = long(tid) % p.hidden;
  device const T* hr = h + t * p.hc * p.hidden;
  device const float* lr = low + t * p.rank;
  float sum = 0.0f;
  for (long c = 0; c < p.hc; ++c) {
    const long j = c * p.hidden + k;
    device const T* ur = up + j * p.rank;
    float u = 0.0f;
    for (long r = 0; r < p.rank; ++r) {
      u = u + static_cast<float>(ur[r]) * lr[r];
    }
    const float w = hc_round<T>(hc_sigmoid(hc_round<T>(u)));
    sum = sum + hc_round<T>(w * hc_normed(hr, norm_weight, j, inv[t * p.hc + c]));
  }
  mixed[t * p.hidden + k] = static_cast<T>(sum / float(p.hc));
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_HC_COMBINE_TG)]] void hc_post_combine(
    device const T* hyper [[buffer(0)]],            // [T, hc * hidden]
    device const T* out [[buffer(1)]],              // [T, hidden]
    device const T* inject [[buffer(2)]],           // [T, hc]
    device T* result [[buffer(3)]],                 // [T, hc * hidden]
    device HebrusErrorMessages* err [[buffer(4)]],  // the stream's error buffer (no value to check)
    constant HcPostCombineParams& p [[buffer(5)]],
    uint tid [[thread_position_in_grid]]) {
  const long dim = p.hc * p.hidden;
  if (long(tid) >= p.rows * dim) {
    return;
  }
  const long t = long(tid) / dim, c = (long(tid) % dim) / p.hidden, k = long(tid) % p.hidden;
  const float product =
      hc_round<T>(static_cast<float>(out[t * p.hidden + k]) * static_cast<float>(inject[t * p.hc + c]));
  result[tid] = static_cast<T>(static_cast<float>(hyper[tid]) + product);
}

HEBRUS_INSTANTIATE(hc_premix_low, float, float)
HEBRUS_INSTANTIATE(hc_premix_low, half, half)
HEBRUS_INSTANTIATE(hc_premix_mix, float, float)
HEBRUS_INSTANTIATE(hc_premix_mix, half, half)
HEBRUS_INSTANTIATE(hc_post_combine, float, float)
HEBRUS_INSTANTIATE(hc_post_combine, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(hc_premix_low, bfloat, bfloat)
HEBRUS_INSTANTIATE(hc_premix_mix, bfloat, bfloat)
HEBRUS_INSTANTIATE(hc_post_combine, bfloat, bfloat)
#endif
