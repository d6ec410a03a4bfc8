// MPS kernels of hebrus::gdn_delta_rule and hebrus::gdn_delta_rule_slots: glue for
// mps_kernels/gdn_delta_rule.metal. Every decision (checks, kernel variant, buffers, parameter block,
// dispatch) is hebrus::glue::gdn_delta_rule / gdn_delta_rule_slots (hebrus_glue.h, also run by the Linux
// emulator); this file only encodes it. The kernels update the state (pool) in place; value errors
// (cu_seqlens, slots) come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor gdn_delta_rule_mps(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& cu_seqlens, Tensor& state, double scale, bool use_qk_l2norm) {
  const hebrus::glue::Call call = hebrus::glue::gdn_delta_rule(q, k, v, g, beta, cu_seqlens, state, scale,
                                                               use_qk_l2norm, c10::DeviceType::MPS);
  encode("gdn_delta_rule", call);
  return hebrus::glue::gdn_result(call, v);
}

Tensor gdn_delta_rule_slots_mps(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                const Tensor& cu_seqlens, Tensor& state_pool, const Tensor& slots, double scale,
                                bool use_qk_l2norm) {
  const hebrus::glue::Call call = hebrus::glue::gdn_delta_rule_slots(q, k, v, g, beta, cu_seqlens, state_pool, slots,
                                                                     scale, use_qk_l2norm, c10::DeviceType::MPS);
  encode("gdn_delta_rule_slots", call);
  return hebrus::glue::gdn_result(call, v);
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("gdn_delta_rule", &hebrus::mps::gdn_delta_rule_mps);
  m.impl("gdn_delta_rule_slots", &hebrus::mps::gdn_delta_rule_slots_mps);
}
