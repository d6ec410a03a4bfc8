// MPS kernels of hebrus::gdn_gates and hebrus::gdn_gated_rms_norm (issue 37): glue for
// mps_kernels/gdn_fused.metal. Every decision (checks, kernel, buffers, parameter block, dispatch) is
// hebrus::glue::gdn_gates / gdn_gated_rms_norm (hebrus_glue.h, also run by the Linux emulator); this
// file only encodes it.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> gdn_gates_mps(const Tensor& a, const Tensor& b, const Tensor& A_log,
                                         const Tensor& dt_bias) {
  const hebrus::glue::Call call = hebrus::glue::gdn_gates(a, b, A_log, dt_bias, c10::DeviceType::MPS);
  encode("gdn_gates", call);
  return {call.outputs[0], call.outputs[1]};
}

Tensor gdn_gated_rms_norm_mps(const Tensor& x, const Tensor& gate, const Tensor& weight, double eps,
                              c10::string_view activation) {
  const hebrus::glue::Call call = hebrus::glue::gdn_gated_rms_norm(x, gate, weight, eps, activation,
                                                                   c10::DeviceType::MPS);
  encode("gdn_gated_rms_norm", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("gdn_gates", &hebrus::mps::gdn_gates_mps);
  m.impl("gdn_gated_rms_norm", &hebrus::mps::gdn_gated_rms_norm_mps);
}
