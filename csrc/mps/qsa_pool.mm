// MPS kernel of hebrus::qsa_pool (SPEC section 3): glue for mps_kernels/qsa_pool.metal.
// The hole check runs inside the kernel (every group's members must hold consecutive positions
// from group_pos); the kernel records the first broken member in an error slot, and this glue
// reads the slots back after the stream finishes and raises HoleError (or HebrusError for a cell
// index out of range) with the reference's message, before anything is returned: a failing call
// publishes nothing.
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor qsa_pool_mps(const Tensor& keys_in, const Tensor& cell_pos_in, const Tensor& group_cells_in,
                    const Tensor& group_pos_in, const Tensor& norm_weight_in, double eps, const Tensor& inv_freq_in) {
  const char* op = "qsa_pool";
  check_on_mps(op, {{"keys", &keys_in}, {"cell_pos", &cell_pos_in}, {"group_cells", &group_cells_in},
                    {"group_pos", &group_pos_in}, {"norm_weight", &norm_weight_in}, {"inv_freq", &inv_freq_in}});
  check_dims(op, keys_in, 2, "keys");
  check_float(op, keys_in, "keys");
  check_dims(op, cell_pos_in, 1, "cell_pos");
  check_dtype(op, cell_pos_in, at::kLong, "cell_pos");
  check_dims(op, group_cells_in, 2, "group_cells");
  check_dtype(op, group_cells_in, at::kInt, "group_cells");
  check_dims(op, group_pos_in, 1, "group_pos");
  check_dtype(op, group_pos_in, at::kLong, "group_pos");
  check_dims(op, norm_weight_in, 1, "norm_weight");
  check_float(op, norm_weight_in, "norm_weight");
  check_dims(op, inv_freq_in, 1, "inv_freq");
  check_dtype(op, inv_freq_in, at::kFloat, "inv_freq");
  const int64_t cells = keys_in.size(0), dim = keys_in.size(1);
  const int64_t groups = group_cells_in.size(0), r = group_cells_in.size(1), half = inv_freq_in.size(0);
  HEBRUS_CHECK(cell_pos_in.size(0) == cells, HebrusError, "hebrus::qsa_pool: cell_pos must have one entry per cell (",
               cells, "), got ", cell_pos_in.size(0));
  HEBRUS_CHECK(r >= 1, HebrusError, "hebrus::qsa_pool: group_cells must have r >= 1 columns");
  HEBRUS_CHECK(group_pos_in.size(0) == groups, HebrusError,
               "hebrus::qsa_pool: group_pos must have one entry per group (", groups, "), got ", group_pos_in.size(0));
  HEBRUS_CHECK(norm_weight_in.size(0) == dim, HebrusError, "hebrus::qsa_pool: norm_weight must have D = ", dim,
               " entries, got ", norm_weight_in.size(0));
  HEBRUS_CHECK(2 * half <= dim, HebrusError, "hebrus::qsa_pool: rotary dims 2*", half, " exceed head dim ", dim);
  HEBRUS_CHECK(eps >= 0, HebrusError, "hebrus::qsa_pool: eps must be >= 0, got ", eps);
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
