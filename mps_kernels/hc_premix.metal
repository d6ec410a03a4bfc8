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
//
// hebrus::hc_premix_quantized (variants q4 / q8): the same two launches with down, up and inject
// affine-quantized (hebrus_quant.h; one bits / group_size for the three). The kernels' bodies are
// templated over how a weight row is read, MLX-style: HcDenseRows (the dense op) or HcQuantRows, whose
// dot products fold each group as quantized_linear does, s * sum(q x) + b * sum(x) (per lane in low,
// where a group that straddles two streams is folded once per stream's part; sequentially in mix).
#include "hebrus_quant.h"

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

// The rows of a dense weight W [rows, cols] of T.
template <typename T>
struct HcDenseRows {
  device const T* w;
  long cols;

  // acc plus this lane's products of row r with the normed values j in [begin, end), lane-strided.
  float lanes(float acc, long r, long begin, long end, uint lane, device const T* hr, device const float* nw,
              float inv) const {
    device const T* wr = w + r * cols;
    for (long j = begin + long(lane); j < end; j += HEBRUS_SIMD_WIDTH) {
      acc = acc + static_cast<float>(wr[j]) * hc_normed(hr, nw, j, inv);
    }
    return acc;
  }

  // row r . x (fp32, ascending columns).
  float dot(long r, device const float* x) const {
    device const T* wr = w + r * cols;
    float u = 0.0f;
    for (long c = 0; c < cols; ++c) {
      u = u + static_cast<float>(wr[c]) * x[c];
    }
    return u;
  }
};

// The rows of an affine-quantized W [rows, cols]: codes [rows, cols * BITS / 32], scales and biases
// [rows, cols / group_size] of T.
template <typename T, int BITS>
struct HcQuantRows {
  device const uint* codes;
  device const T* scales;
  device const T* biases;
  long cols, group_size;

  // As HcDenseRows::lanes, each group's part of [begin, end) folded on its own: acc + (qx * s + xs * b).
  float lanes(float acc, long r, long begin, long end, uint lane, device const T* hr, device const float* nw,
              float inv) const {
    device const uint* cr = codes + r * (cols * BITS / 32);
    const long groups = cols / group_size;
    for (long g0 = begin - begin % group_size; g0 < end; g0 += group_size) {
      const long first = hebrus_max(g0, begin), last = hebrus_min(g0 + group_size, end);
      float qx = 0.0f, xs = 0.0f;
      for (long j = first + long(lane); j < last; j += HEBRUS_SIMD_WIDTH) {
        const float x = hc_normed(hr, nw, j, inv);
        qx = fma(hebrus_moe_code<BITS>(cr, j), x, qx);
        xs = xs + x;
      }
      acc = hebrus_moe_fold(acc, qx, xs, scales + r * groups, biases + r * groups, g0 / group_size);
    }
    return acc;
  }

  // row r . x, folded per group (ascending columns within a group, groups in order).
  float dot(long r, device const float* x) const {
    device const uint* cr = codes + r * (cols * BITS / 32);
    const long groups = cols / group_size;
    float u = 0.0f;
    for (long g0 = 0; g0 < cols; g0 += group_size) {
      float qx = 0.0f, xs = 0.0f;
      for (long c = g0; c < g0 + group_size; ++c) {
        qx = fma(hebrus_moe_code<BITS>(cr, c), x[c], qx);
        xs = xs + x[c];
      }
      u = hebrus_moe_fold(u, qx, xs, scales + r * groups, biases + r * groups, g0 / group_size);
    }
    return u;
  }
};

// The low launch's work for one thread (whole SIMD-groups per (row, output)), down and inject read by Rows.
template <typename T, typename Rows>
inline void hc_premix_low_body(device const T* h, device const float* norm_weight, Rows down, Rows inject,
                               device float* inv, device float* low, device T* weights, constant HcPremixParams& p,
                               uint tid, uint lane) {
  const long outs = p.rank + p.injects;
  const long item = long(tid) / HEBRUS_SIMD_WIDTH;
  if (item >= p.rows * outs) {
    return;  // whole SIMD-groups only: the grid is a multiple of 32 threads
  }
  const long t = item / outs, o = item % outs;
  const long dim = p.hc * p.hidden;
  device const T* hr = h + t * dim;
  const Rows rows = o < p.rank ? down : inject;
  const long r = o < p.rank ? o : o - p.rank;
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
    dot = rows.lanes(dot, r, c * p.hidden, (c + 1) * p.hidden, lane, hr, norm_weight, inv_c);
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
  const long dim = p.hc * p.hidden;
  hc_premix_low_body(h, norm_weight, HcDenseRows<T>{down, dim}, HcDenseRows<T>{inject, dim}, inv, low, weights, p,
                     tid, lane);
}

template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_HC_PREMIX_TG)]] void hc_premix_quantized_low(
    device const T* h [[buffer(0)]],                // [T, D]
    device const float* norm_weight [[buffer(1)]],  // [D], as fp32
    device const uint* down_q [[buffer(2)]],        // [R, D * BITS / 32]
    device const T* down_scales [[buffer(3)]],      // [R, D / group]
    device const T* down_biases [[buffer(4)]],      // [R, D / group]
    device const uint* inject_q [[buffer(5)]],      // [I, D * BITS / 32] (down's where I = 0: never read)
    device const T* inject_scales [[buffer(6)]],    // [I, D / group]
    device const T* inject_biases [[buffer(7)]],    // [I, D / group]
    device float* inv [[buffer(8)]],                // [T, hc] scratch
    device float* low [[buffer(9)]],                // [T, R] scratch
    device T* weights [[buffer(10)]],               // [T, I] (a 1-entry scratch where I = 0: never written)
    device HebrusErrorMessages* err [[buffer(11)]],  // the stream's error buffer (no value to check)
    constant HcPremixParams& p [[buffer(12)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long dim = p.hc * p.hidden, group = long(p.group_size);
  hc_premix_low_body(h, norm_weight, HcQuantRows<T, BITS>{down_q, down_scales, down_biases, dim, group},
                     HcQuantRows<T, BITS>{inject_q, inject_scales, inject_biases, dim, group}, inv, low, weights, p,
                     tid, lane);
}

// The mix launch's work for one thread (row t, feature k), up read by Rows.
template <typename T, typename Rows>
inline void hc_premix_mix_body(device const T* h, device const float* norm_weight, Rows up, device const float* inv,
                               device const float* low, device T* mixed, constant HcPremixParams& p, uint tid) {
  if (long(tid) >= p.rows * p.hidden) {
    return;
  }
  const long t = long(tid) / p.hidden, k = long(tid) % p.hidden;
  device const T* hr = h + t * p.hc * p.hidden;
  device const float* lr = low + t * p.rank;
  float sum = 0.0f;
  for (long c = 0; c < p.hc; ++c) {
    const long j = c * p.hidden + k;
    const float u = up.dot(j, lr);
    const float w = hc_round<T>(hc_sigmoid(hc_round<T>(u)));
    sum = sum + hc_round<T>(w * hc_normed(hr, norm_weight, j, inv[t * p.hc + c]));
  }
  mixed[t * p.hidden + k] = static_cast<T>(sum / float(p.hc));
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
  hc_premix_mix_body(h, norm_weight, HcDenseRows<T>{up, p.rank}, inv, low, mixed, p, tid);
}

template <int BITS, typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_HC_PREMIX_TG)]] void hc_premix_quantized_mix(
    device const T* h [[buffer(0)]],                // [T, D]
    device const float* norm_weight [[buffer(1)]],  // [D], as fp32
    device const uint* up_q [[buffer(2)]],          // [D, R * BITS / 32]
    device const T* up_scales [[buffer(3)]],        // [D, R / group]
    device const T* up_biases [[buffer(4)]],        // [D, R / group]
    device const float* inv [[buffer(5)]],          // [T, hc], from the low launch
    device const float* low [[buffer(6)]],          // [T, R], from the low launch
    device T* mixed [[buffer(7)]],                  // [T, hidden]
    device HebrusErrorMessages* err [[buffer(8)]],  // the stream's error buffer (no value to check)
    constant HcPremixParams& p [[buffer(9)]],
    uint tid [[thread_position_in_grid]]) {
  hc_premix_mix_body(h, norm_weight, HcQuantRows<T, BITS>{up_q, up_scales, up_biases, p.rank, long(p.group_size)}, inv,
                     low, mixed, p, tid);
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
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_low, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_low, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_low, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_low, q8, half, 8, half)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_mix, q4, float, 4, float)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_mix, q8, float, 8, float)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_mix, q4, half, 4, half)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_mix, q8, half, 8, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(hc_premix_low, bfloat, bfloat)
HEBRUS_INSTANTIATE(hc_premix_mix, bfloat, bfloat)
HEBRUS_INSTANTIATE(hc_post_combine, bfloat, bfloat)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_low, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_low, q8, bfloat, 8, bfloat)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_mix, q4, bfloat, 4, bfloat)
HEBRUS_INSTANTIATE_VARIANT(hc_premix_quantized_mix, q8, bfloat, 8, bfloat)
#endif
