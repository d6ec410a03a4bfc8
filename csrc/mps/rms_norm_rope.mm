// MPS kernel of hebrus::rms_norm_rope (issue 37): glue for mps_kernels/rms_norm_rope.metal. Every decision
// (checks, kernel, buffers, parameter block, dispatch) is hebrus::glue::rms_norm_rope (hebrus_glue.h, also
// run by the Linux emulator); this file only encodes it.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor rms_norm_rope_mps(const Tensor& x, const Tensor& weight, double eps, const Tensor& cos, const Tensor& sin) {
  const hebrus::glue::Call call = hebrus::glue::rms_norm_rope(x, weight, eps, cos, sin, c10::DeviceType::MPS);
  encode("rms_norm_rope", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("rms_norm_rope", &hebrus::mps::rms_norm_rope_mps);
}
