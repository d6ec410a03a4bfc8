// MPS kernel of hebrus::qsa_pool (SPEC section 3): glue for mps_kernels/qsa_pool.metal.
// The hole check runs inside the kernel (every group's members must hold consecutive positions
// from group_pos); the kernel records the first broken member in an error slot, and this glue
// reads the slots back after the stream finishes and raises HoleError (or HebrusError for a cell
// index out of range) with the reference's message, before anything is returned: a failing call
// publishes nothing.
#include "hebrus_mps.h"
#include "op_checks.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor qsa_pool_mps(const Tensor& keys_in, const Tensor& cell_pos_in, const Tensor& group_cells_in,
                    const Tensor& group_pos_in, const Tensor& norm_weight_in, double eps, const Tensor& inv_freq_in) {
  const char* op = "qsa_pool";
  check_on_mps(op, {{"keys", &keys_in}, {"cell_pos", &cell_pos_in}, {"group_cells", &group_cells_in},
                    {"group_pos", &group_pos_in}, {"norm_weight", &norm_weight_in}, {"inv_freq", &inv_freq_in}});
  const QsaPoolSizes sz =
      check_qsa_pool_args(keys_in, cell_pos_in, group_cells_in, group_pos_in, norm_weight_in, eps, inv_freq_in);
  const int64_t cells = sz.cells, dim = sz.dim, groups = sz.groups, r = sz.r, half = sz.half;
  const char* type = metal_type(op, keys_in.scalar_type());

  if (groups == 0) return at::empty({0, dim}, keys_in.options());
  const auto plan = hebrus::metal::plan_qsa_pool(cells, dim, groups, r, half, eps);
  check_plan(op, plan.error);

  const Tensor keys = keys_in.contiguous(), cell_pos = cell_pos_in.contiguous();
  const Tensor group_cells = group_cells_in.contiguous(), group_pos = group_pos_in.contiguous();
  const Tensor weight = norm_weight_in.to(at::kFloat).contiguous();  // exact; the kernel reads fp32 (1 + w)
  const Tensor inv_freq = inv_freq_in.contiguous();
  Tensor pooled = at::empty({groups, dim}, keys.options());
  Tensor err = error_slots(keys);
  const auto fn = kernel(op, "qsa_pool", hebrus::metal::kernel_name(op, "", type), plan.dispatch.group);
  launch(fn, {&keys, &cell_pos, &group_cells, &group_pos, &weight, &inv_freq, &pooled, &err}, plan.params,
         plan.dispatch);

  const ErrorSlots e = read_error_slots(err);
  if (const int64_t k = e.index[HEBRUS_ERR_POOL_CELL]; k >= 0) {
    HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_pool: group ", k / r, " cell ", k % r, " = ",
                 group_cells[k / r][k % r].item<int32_t>(), " is outside [0, ", cells, ")");
  }
  if (const int64_t k = e.index[HEBRUS_ERR_POOL_HOLE]; k >= 0) {
    const int64_t g = k / r, i = k % r;
    const int64_t first = group_pos[g].item<int64_t>();
    const int64_t got = cell_pos[group_cells[g][i].item<int32_t>()].item<int64_t>();
    const auto required = static_cast<int64_t>(static_cast<uint64_t>(first) + static_cast<uint64_t>(i));
    HEBRUS_CHECK(false, HoleError, "hebrus::qsa_pool: group ", g, " starting at position ", first, " has position ",
                 got, " in member ", i, " where ", required, " is required (a hole inside the run is not padding)");
  }
  return pooled;
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("qsa_pool", &hebrus::mps::qsa_pool_mps);
}
