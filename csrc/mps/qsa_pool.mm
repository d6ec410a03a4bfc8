// MPS kernel of hebrus::qsa_pool: glue for mps_kernels/qsa_pool.metal. Every decision (checks, kernel, buffers,
// parameter block, dispatch) is hebrus::glue::qsa_pool (hebrus_glue.h, also run by the Linux emulator);
// this file only encodes it. Value errors come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor qsa_pool_mps(const Tensor& keys, const Tensor& cell_pos, const Tensor& group_cells, const Tensor& group_pos,
                    const Tensor& norm_weight, double eps, const Tensor& inv_freq) {
  const hebrus::glue::Call call = hebrus::glue::qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq, c10::DeviceType::MPS);
  encode("qsa_pool", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("qsa_pool", &hebrus::mps::qsa_pool_mps);
}
