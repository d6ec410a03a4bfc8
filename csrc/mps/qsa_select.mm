// MPS kernel of hebrus::qsa_select: glue for mps_kernels/qsa_select.metal. Every decision (checks, kernel, buffers,
// parameter block, dispatch) is hebrus::glue::qsa_select (hebrus_glue.h, also run by the Linux emulator);
// this file only encodes it. Value errors come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor qsa_select_mps(const Tensor& q, const Tensor& pooled, const Tensor& seq_groups, const Tensor& q_row,
                      const Tensor& q_groups, int64_t top_k) {
  const hebrus::glue::Call call = hebrus::glue::qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k, c10::DeviceType::MPS);
  encode("qsa_select", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("qsa_select", &hebrus::mps::qsa_select_mps);
}
