// MPS kernel of hebrus::moe_shared_expert (issue 37): glue for mps_kernels/moe_shared_expert.metal. Every decision
// (checks, kernels, buffers, parameter block, dispatches) is hebrus::glue::moe_shared_expert (hebrus_glue.h, also
// run by the Linux emulator); this file only encodes it.
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

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("moe_shared_expert", &hebrus::mps::moe_shared_expert_mps);
}
