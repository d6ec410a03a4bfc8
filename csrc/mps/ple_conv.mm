// MPS kernel of hebrus::ple_conv: glue for mps_kernels/ple_conv.metal. Every decision (checks, kernel, buffers,
// parameter block, dispatch) is hebrus::glue::ple_conv (hebrus_glue.h, also run by the Linux emulator);
// this file only encodes it. Value errors come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <c10/util/string_view.h>
#include <torch/library.h>

#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> ple_conv_mps(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, const Tensor& state, int64_t dilation,
                                        c10::string_view activation) {
  const hebrus::glue::Call call = hebrus::glue::ple_conv(x, weight, cu_seqlens, state, dilation, activation, c10::DeviceType::MPS);
  encode("ple_conv", call);
  return {call.outputs[0], call.outputs[1]};
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("ple_conv", &hebrus::mps::ple_conv_mps);
}
