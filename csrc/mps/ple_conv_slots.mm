// MPS kernel of hebrus::ple_conv_slots: glue for mps_kernels/ple_conv_slots.metal. Every decision (checks, kernel,
// buffers, parameter block, dispatch) is hebrus::glue::ple_conv_slots (hebrus_glue.h, also run by the Linux emulator);
// this file only encodes it. The kernel updates state_pool in place; value errors (cu_seqlens, slots) come back
// asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <c10/util/string_view.h>
#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor ple_conv_slots_mps(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, Tensor& state_pool,
                          const Tensor& slots, int64_t dilation, c10::string_view activation) {
  const hebrus::glue::Call call = hebrus::glue::ple_conv_slots(x, weight, cu_seqlens, state_pool, slots, dilation, activation, c10::DeviceType::MPS);
  encode("ple_conv_slots", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("ple_conv_slots", &hebrus::mps::ple_conv_slots_mps);
}
