// MPS kernels of hebrus::moe_shared_expert and moe_shared_expert_quantized (issue 37): glue for
// mps_kernels/moe_shared_expert.metal. Every decision (checks, kernels, buffers, parameter block, dispatches) is
// hebrus::glue::moe_shared_expert / moe_shared_expert_quantized (hebrus_glue.h, also run by the Linux emulator);
// this file only encodes it.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor moe_shared_expert_mps(const Tensor& x, const Tensor& routed, const Tensor& gate_proj, const Tensor& up_proj,
                             const Tensor& down_proj, const Tensor& gate) {
  const hebrus::glue::Call call =
      hebrus::glue::moe_shared_expert(x, routed, gate_proj, up_proj, down_proj, gate, c10::DeviceType::MPS);
  encode("moe_shared_expert", call);
  return call.outputs[0];
}

Tensor moe_shared_expert_quantized_mps(const Tensor& x, const Tensor& routed, const Tensor& gate_proj_q,
                                       const Tensor& gate_proj_scales, const Tensor& gate_proj_biases,
                                       const Tensor& up_proj_q, const Tensor& up_proj_scales,
                                       const Tensor& up_proj_biases, const Tensor& down_proj_q,
                                       const Tensor& down_proj_scales, const Tensor& down_proj_biases,
                                       const Tensor& gate, int64_t group_size, int64_t bits) {
  const hebrus::glue::Call call = hebrus::glue::moe_shared_expert_quantized(
      x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q, up_proj_scales, up_proj_biases,
      down_proj_q, down_proj_scales, down_proj_biases, gate, group_size, bits, c10::DeviceType::MPS);
  encode("moe_shared_expert_quantized", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("moe_shared_expert", &hebrus::mps::moe_shared_expert_mps);
  m.impl("moe_shared_expert_quantized", &hebrus::mps::moe_shared_expert_quantized_mps);
}
