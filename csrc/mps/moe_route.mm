// MPS kernel of hebrus::moe_route (issue 37): glue for mps_kernels/moe_route.metal. Every decision (checks,
// kernel, buffers, parameter block, dispatch) is hebrus::glue::moe_route (hebrus_glue.h, also run by the Linux
// emulator); this file only encodes it.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

#include <optional>
#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> moe_route_mps(const Tensor& router_logits, const std::optional<Tensor>& shared_gate_logits,
                                         int64_t top_k, bool norm_topk_prob) {
  const hebrus::glue::Call call =
      hebrus::glue::moe_route(router_logits, shared_gate_logits, top_k, norm_topk_prob, c10::DeviceType::MPS);
  encode("moe_route", call);
  return {call.outputs[0], call.outputs[1]};
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("moe_route", &hebrus::mps::moe_route_mps);
}
