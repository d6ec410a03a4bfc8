// MPS kernel of hebrus::qsa_attention: glue for mps_kernels/qsa_attention.metal. Every decision (checks, kernel, buffers,
// parameter block, dispatch) is hebrus::glue::qsa_attention (hebrus_glue.h, also run by the Linux emulator);
// this file only encodes it. Value errors come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor qsa_attention_mps(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& token_cells, double scale) {
  const hebrus::glue::Call call = hebrus::glue::qsa_attention(q, k, v, token_cells, scale, c10::DeviceType::MPS);
  encode("qsa_attention", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("qsa_attention", &hebrus::mps::qsa_attention_mps);
}
