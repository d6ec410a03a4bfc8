#pragma once
// The affine-quantized weight format's reads (hebrus_torch/moe/quantize.py), shared by the kernels that take
// quantized weights (moe_experts_quantized.metal, moe_shared_expert.metal through moe_experts.h, hc_premix.metal's
// quantized pre-mix): a value's code and one group's fold into a dot product.
#include "hebrus_metal_common.h"

// The code of value d of a quantized row.
template <int BITS>
inline uint hebrus_moe_code_bits(device const uint* codes, long d) {
  const long per_word = 32 / BITS;
  return (codes[d / per_word] >> uint((d % per_word) * BITS)) & ((1u << BITS) - 1u);
}

// The code of value d of a quantized row, as a float.
template <int BITS>
inline float hebrus_moe_code(device const uint* codes, long d) {
  return float(hebrus_moe_code_bits<BITS>(codes, d));
}

// acc + (qx * s + xs * b): one group of a folded dot product (s, b the group's scale and bias).
template <typename T>
inline float hebrus_moe_fold(float acc, float qx, float xs, device const T* scales, device const T* biases, long g) {
  return acc + (qx * static_cast<float>(scales[g]) + xs * static_cast<float>(biases[g]));
}
