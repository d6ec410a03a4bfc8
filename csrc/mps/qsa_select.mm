// MPS kernel of hebrus::qsa_select (SPEC section 3): glue for mps_kernels/qsa_select.metal.
// The launch plan picks the kernel variant from min(top_k, maxG) (k512: 4 queries per
// threadgroup; k2048: 1); larger selections are refused with a clear error. q and pooled of
// different dtypes are both widened to fp32, which is exact. Bad q_row / q_groups / seq_groups
// entries are found by the kernel and raised here with the reference's messages.
#include "hebrus_mps.h"
#include "op_checks.h"

#include <torch/library.h>

#include <algorithm>

namespace hebrus::mps {
namespace {

Tensor qsa_select_mps(const Tensor& q_in, const Tensor& pooled_in, const Tensor& seq_groups_in, const Tensor& q_row_in,
                      const Tensor& q_groups_in, int64_t top_k) {
  const char* op = "qsa_select";
  check_on_mps(op, {{"q", &q_in}, {"pooled", &pooled_in}, {"seq_groups", &seq_groups_in}, {"q_row", &q_row_in},
                    {"q_groups", &q_groups_in}});
  const QsaSelectSizes sz = check_qsa_select_args(q_in, pooled_in, seq_groups_in, q_row_in, q_groups_in, top_k);
  const int64_t tq = sz.tq, hq = sz.hq, dim = sz.dim, rows = sz.rows, batch = sz.batch, max_groups = sz.max_groups;

  if (tq == 0) return at::full({0, top_k}, -1, q_in.options().dtype(at::kInt));
  const bool same = q_in.scalar_type() == pooled_in.scalar_type();
  const Tensor q = same ? q_in.contiguous() : q_in.to(at::kFloat).contiguous();
  const Tensor pooled = same ? pooled_in.contiguous() : pooled_in.to(at::kFloat).contiguous();
  const char* type = metal_type(op, q.scalar_type());
  const auto plan = hebrus::metal::plan_qsa_select(tq, hq, dim, rows, batch, max_groups, top_k);
  check_plan(op, plan.error);

  const Tensor seq_groups = seq_groups_in.contiguous(), q_row = q_row_in.contiguous();
  const Tensor q_groups = q_groups_in.contiguous();
  Tensor selected = at::empty({tq, top_k}, q.options().dtype(at::kInt));
  Tensor err = error_slots(q);
  const auto fn = kernel(op, "qsa_select", hebrus::metal::kernel_name(op, plan.variant, type), plan.dispatch.group);
  launch(fn, {&q, &pooled, &seq_groups, &q_row, &q_groups, &selected, &err}, plan.params, plan.dispatch);

  const ErrorSlots e = read_error_slots(err);
  if (const int64_t t = e.index[HEBRUS_ERR_SELECT_ROW]; t >= 0) {
    HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_select: q_row[", t, "] = ", q_row[t].item<int32_t>(),
                 " is outside [0, B=", batch, ")");
  }
  if (const int64_t t = e.index[HEBRUS_ERR_SELECT_GROUPS]; t >= 0) {
    HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_select: q_groups[", t, "] = ", q_groups[t].item<int32_t>(),
                 " is outside [0, maxG=", max_groups, "]");
  }
  if (const int64_t row = e.index[HEBRUS_ERR_SELECT_SEQ_GROUPS]; row >= 0) {
    // Name the first bad entry among the groups the row's queries see, as the reference does.
    const Tensor rows_host = q_row.to(at::kCPU), groups_host = q_groups.to(at::kCPU);
    const int32_t* rh = rows_host.data_ptr<int32_t>();
    const int32_t* gh = groups_host.data_ptr<int32_t>();
    int64_t needed = 0;
    for (int64_t t = 0; t < tq; ++t) {
      if (rh[t] == row) needed = std::max<int64_t>(needed, gh[t]);
    }
    const Tensor entries = seq_groups[row].slice(0, 0, needed).to(at::kCPU);
    const int32_t* p = entries.data_ptr<int32_t>();
    int64_t g = 0;
    while (g < needed && p[g] >= 0 && p[g] < rows) ++g;
    HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_select: seq_groups[", row, ", ", g, "] = ",
                 g < needed ? p[g] : -1, " is outside [0, rows=", rows, "); the first ", needed, " groups of row ",
                 row, " are visible to its queries");
  }
  return selected;
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("qsa_select", &hebrus::mps::qsa_select_mps);
}
