// MPS kernel of hebrus::qsa_token_cells (issue 37): glue for mps_kernels/qsa_token_cells.metal. Every
// decision (checks, kernel, buffers, parameter block, dispatch) is hebrus::glue::qsa_token_cells
// (hebrus_glue.h, also run by the Linux emulator); this file only encodes it. Value errors come back
// asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> qsa_token_cells_mps(const Tensor& selected, const Tensor& nvis, const Tensor& first,
                                               const Tensor& cells, int64_t r) {
  const hebrus::glue::Call call =
      hebrus::glue::qsa_token_cells(selected, nvis, first, cells, r, c10::DeviceType::MPS);
  encode("qsa_token_cells", call);
  return {call.outputs[0], call.outputs[1]};
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("qsa_token_cells", &hebrus::mps::qsa_token_cells_mps);
}
