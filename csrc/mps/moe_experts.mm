// MPS kernel of hebrus::moe_experts: glue for mps_kernels/moe_experts.metal. Every decision (checks, kernels,
// buffers, parameter block, dispatches) is hebrus::glue::moe_experts (hebrus_glue.h, also run by the Linux
// emulator); this file only encodes it. Bad expert ids come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor moe_experts_mps(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                       const Tensor& down) {
  const hebrus::glue::Call call = hebrus::glue::moe_experts(x, topk_ids, topk_weights, gate_up, down, c10::DeviceType::MPS);
  encode("moe_experts", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("moe_experts", &hebrus::mps::moe_experts_mps);
}
