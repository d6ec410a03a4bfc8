#pragma once
// hebrus::quantized_linear's CPU kernel (csrc/cpu/moe_kernels.cpp), for the CPU kernels that run it as a module's
// QuantizedLinear does: x [T, in] times the transpose of W [out, in] quantized (hebrus_torch/moe/quantize.py)
// -> [T, out] in x's dtype, each output the kernel's folded dot product rounded once.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hebrus {

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                const at::Tensor& biases, int64_t group_size, int64_t bits);

}  // namespace hebrus
