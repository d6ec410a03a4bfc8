// MPS kernel of hebrus::gdn_chunk_delta_rule_slots: glue for mps_kernels/gdn_chunk_delta_rule.metal. Every decision
// (checks, kernel, buffers, parameter block, dispatch) is hebrus::glue::gdn_chunk_delta_rule_slots (hebrus_glue.h, also
// run by the Linux emulator); this file only encodes it. The kernel updates state_pool in place; value errors
// (cu_seqlens, start_pos, slots) come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor gdn_chunk_delta_rule_slots_mps(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                      const Tensor& beta, const Tensor& cu_seqlens, const Tensor& start_pos,
                                      Tensor& state_pool, const Tensor& slots, double scale, bool use_qk_l2norm) {
  const hebrus::glue::Call call = hebrus::glue::gdn_chunk_delta_rule_slots(
      q, k, v, g, beta, cu_seqlens, start_pos, state_pool, slots, scale, use_qk_l2norm, c10::DeviceType::MPS);
  encode("gdn_chunk_delta_rule_slots", call);
  return hebrus::glue::gdn_result(call, v);
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("gdn_chunk_delta_rule_slots", &hebrus::mps::gdn_chunk_delta_rule_slots_mps);
}
