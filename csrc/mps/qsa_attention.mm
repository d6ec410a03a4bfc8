// MPS kernel of hebrus::qsa_attention (issue 6): glue for mps_kernels/qsa_attention.metal.
// Metadata checks in the order and with the messages of the CPU kernel (hebrus_torch/_validate.py).
// The launch plan picks the kernel variant from rep = Hq / Hkv and max(Dh, Dv) (heads per pass 1, 2,
// 4 or 8; head dims up to 64, 128 or 256) and refuses head dims above 256 with a clear error. The
// value checks of the reference (an entry >= cells, a query with no entry >= 0) run inside the
// kernel and come back through the error slots, raised here with the reference's messages before
// anything is returned. Shapes where no kernel thread would look at token_cells (Hq = 0, Dv = 0 or
// no cells) are checked on a host copy instead.
// K and V are read in place through the element strides of their first two dims (only their last dim
// must be contiguous, as for the CPU kernel): the views of a cache row that callers pass
// ([Hkv, cells, D] transposed to [cells, Hkv, D]) are not copied, so a call reads only the selected
// cells. q and token_cells are small and made contiguous; out is contiguous.
#include "hebrus_mps.h"
#include "op_checks.h"

#include <torch/library.h>

#include <cmath>

namespace hebrus::mps {
namespace {

// Both always throw.
void raise_bad_cell(int64_t t, int64_t i, int64_t value, int64_t cells) {
  HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_attention: query ", t, " selects cell ", value, " (token_cells[", t,
               ", ", i, "]), outside [0, cells=", cells, "); negative entries are padding");
}

void raise_empty_query(int64_t t) {
  HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_attention: query ", t, " selects no cell (every entry of token_cells[",
               t, "] is negative padding); attention over an empty selection is undefined");
}

// The reference's value checks on a host copy: the first entry >= cells in row-major order, then
// the first query without any entry >= 0.
void check_token_cells_on_host(const Tensor& token_cells, int64_t cells) {
  const Tensor host = token_cells.to(at::kCPU).contiguous();
  const int32_t* p = host.data_ptr<int32_t>();
  const int64_t tq = host.size(0), width = host.size(1);
  for (int64_t e = 0; e < tq * width; ++e) {
    if (p[e] >= cells) raise_bad_cell(e / width, e % width, p[e], cells);
  }
  for (int64_t t = 0; t < tq; ++t) {
    bool any = false;
    for (int64_t i = 0; i < width && !any; ++i) any = p[t * width + i] >= 0;
    if (!any) raise_empty_query(t);
  }
}

Tensor qsa_attention_mps(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& token_cells_in,
                         double scale) {
  const char* op = "qsa_attention";
  check_on_mps(op, {{"q", &q_in}, {"k", &k_in}, {"v", &v_in}, {"token_cells", &token_cells_in}});
  const QsaAttentionSizes sz = check_qsa_attention_args(q_in, k_in, v_in, token_cells_in, scale);
  const auto dtype = q_in.scalar_type();
  const int64_t tq = sz.tq, hq = sz.hq, dh = sz.dh, cells = sz.cells, hkv = sz.hkv, dv = sz.dv, width = sz.width;
  const char* type = metal_type(op, dtype);

  if (tq == 0) return at::empty({0, hq, dv}, q_in.options());
  if (hq == 0 || dv == 0 || cells == 0) {  // no kernel thread would read token_cells
    check_token_cells_on_host(token_cells_in, cells);
    return at::empty({tq, hq, dv}, q_in.options());
  }
  const Tensor k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);  // views stay views
  const auto plan = hebrus::metal::plan_qsa_attention(tq, hq, hkv, dh, dv, cells, width, k.stride(0), k.stride(1),
                                                      v.stride(0), v.stride(1), scale);
  check_plan(op, plan.error);

  const Tensor q = q_in.contiguous();
  const Tensor token_cells = token_cells_in.contiguous();
  Tensor out = at::empty({tq, hq, dv}, q.options());
  Tensor err = error_slots(q);
  const auto fn = kernel(op, "qsa_attention", hebrus::metal::kernel_name(op, plan.variant, type), plan.dispatch.group);
  launch(fn, {&q, &k, &v, &token_cells, &out, &err}, plan.params, plan.dispatch);

  const ErrorSlots e = read_error_slots(err);
  if (const int64_t flat = e.index[HEBRUS_ERR_ATTN_CELL]; flat >= 0) {
    const int64_t t = flat / width, i = flat % width;
    raise_bad_cell(t, i, token_cells[t][i].item<int32_t>(), cells);
  }
  if (const int64_t t = e.index[HEBRUS_ERR_ATTN_EMPTY]; t >= 0) raise_empty_query(t);
  return out;
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("qsa_attention", &hebrus::mps::qsa_attention_mps);
}
