// MPS kernels of hebrus::moe_experts_quantized and hebrus::quantized_linear: glue for
// mps_kernels/moe_experts_quantized.metal (and the sum kernel of moe_experts.metal). Every decision is
// hebrus::glue::moe_experts_quantized / quantized_linear (hebrus_glue.h, also run by the Linux emulator); this
// file only encodes it. Bad expert ids come back through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor moe_experts_quantized_mps(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                                 const Tensor& gate_up_q, const Tensor& gate_up_scales, const Tensor& gate_up_biases,
                                 const Tensor& down_q, const Tensor& down_scales, const Tensor& down_biases,
                                 int64_t group_size, int64_t bits) {
  const hebrus::glue::Call call = hebrus::glue::moe_experts_quantized(
      x, topk_ids, topk_weights, gate_up_q, gate_up_scales, gate_up_biases, down_q, down_scales, down_biases,
      group_size, bits, c10::DeviceType::MPS);
  encode("moe_experts_quantized", call);
  return call.outputs[0];
}

Tensor quantized_linear_mps(const Tensor& x, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                            int64_t group_size, int64_t bits) {
  const hebrus::glue::Call call =
      hebrus::glue::quantized_linear(x, wq, scales, biases, group_size, bits, c10::DeviceType::MPS);
  encode("quantized_linear", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("moe_experts_quantized", &hebrus::mps::moe_experts_quantized_mps);
  m.impl("quantized_linear", &hebrus::mps::quantized_linear_mps);
}
