// MPS kernel of hebrus::hc_rms_norm (issue 37): glue for mps_kernels/hc_rms_norm.metal. Every decision
// (checks, kernel, buffers, parameter block, dispatch) is hebrus::glue::hc_rms_norm (hebrus_glue.h, also
// run by the Linux emulator); this file only encodes it.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor hc_rms_norm_mps(const Tensor& x, const Tensor& weight, int64_t group_size, double eps) {
  const hebrus::glue::Call call = hebrus::glue::hc_rms_norm(x, weight, group_size, eps, c10::DeviceType::MPS);
  encode("hc_rms_norm", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("hc_rms_norm", &hebrus::mps::hc_rms_norm_mps);
}
