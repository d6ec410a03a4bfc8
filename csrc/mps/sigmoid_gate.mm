// MPS kernel of hebrus::sigmoid_gate (issue 37): glue for mps_kernels/sigmoid_gate.metal. Every decision
// (checks, kernel, buffers, parameter block, dispatch) is hebrus::glue::sigmoid_gate (hebrus_glue.h, also
// run by the Linux emulator); this file only encodes it.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor sigmoid_gate_mps(const Tensor& x, const Tensor& gate) {
  const hebrus::glue::Call call = hebrus::glue::sigmoid_gate(x, gate, c10::DeviceType::MPS);
  encode("sigmoid_gate", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("sigmoid_gate", &hebrus::mps::sigmoid_gate_mps);
}
