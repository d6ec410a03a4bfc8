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
#include "moe_experts.h"

// The code of value d of a quantized row, as a float.
template <int BITS>
inline float hebrus_moe_code(device const uint* codes, long d) {
  const long per_word = 32 / BITS;
  const uint q = (codes[d / per_word] >> uint((d % per_word) * BITS)) & ((1u << BITS) - 1u);
  return float(q);
}

// acc + (qx * s + xs * b): one group of a folded dot product (s, b the group's scale and bias).
template <typename T>
inline float hebrus_moe_fold(float acc, float qx, float xs, device const T* scales, device const T* biases, long g) {
  return acc + (qx * static_cast<float>(scales[g]) + xs * static_cast<float>(biases[g]));
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
        qg = qg + hebrus_moe_code<BITS>(gate_up_q + gate_row * words, d) * xv;
        qu = qu + hebrus_moe_code<BITS>(gate_up_q + up_row * words, d) * xv;
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
    const float gr = hebrus_moe_round<T>(g), ur = hebrus_moe_round<T>(u);
    act[pair * p.inter + i] = hebrus_moe_round<T>(hebrus_moe_round<T>(hebrus_moe_silu(gr)) * ur);
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
        qx = qx + hebrus_moe_code<BITS>(down_q + row * words, c) * a[c];
        xs = xs + a[c];
      }
      y = hebrus_moe_fold(y, qx, xs, down_scales + row * groups, down_biases + row * groups, g0 / p.group_size);
    }
  }
  y = hebrus_moe_reduce(y);
  if (valid && l == 0) {
    const float prod = hebrus_moe_round<T>(y) * weights[pair];
    ywt[pair * p.hidden + d] = p.round_product != 0 ? hebrus_moe_round<T>(prod) : prod;
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
  float acc = 0.0f;
  if (valid) {
    const long words = p.in * BITS / 32, groups = p.in / p.group_size;
    device const T* xr = x + t * p.in;
    for (long g0 = 0; g0 < p.in; g0 += p.group_size) {
      float qx = 0.0f, xs = 0.0f;
      for (long d = g0 + l; d < g0 + p.group_size; d += HEBRUS_MOE_LANES) {
        const float xv = static_cast<float>(xr[d]);
        qx = qx + hebrus_moe_code<BITS>(wq + o * words, d) * xv;
        xs = xs + xv;
      }
      acc = hebrus_moe_fold(acc, qx, xs, scales + o * groups, biases + o * groups, g0 / p.group_size);
    }
  }
  acc = hebrus_moe_reduce(acc);
  if (valid && l == 0) {
    out[t * p.out + o] = static_cast<T>(acc);
  }
}

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
#endif
