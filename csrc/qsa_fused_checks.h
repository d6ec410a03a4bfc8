#pragma once
// Metadata checks of the fused QSA-layer ops (issue 37: qsa_token_cells, qsa_plan_one_row, qsa_claim_cells, rms_norm_rope,
// sigmoid_gate), shared by the
// CPU kernels (csrc/cpu/qsa_kernels.cpp) and the MPS glue, in the order and with the messages of
// hebrus_torch/_validate.py's functions of the same names.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

#include "hebrus_check.h"
#include "op_checks.h"

namespace hebrus {

// ---- qsa_token_cells ---------------------------------------------------------------------------------

struct QsaTokenCellsSizes {
  int64_t tq = 0, top_k = 0, cells = 0, r = 0, width = 0;
};

inline QsaTokenCellsSizes check_qsa_token_cells_args(const at::Tensor& selected, const at::Tensor& nvis,
                                                     const at::Tensor& first, const at::Tensor& cells, int64_t r) {
  const char* op = "qsa_token_cells";
  check_kinds(op, {{"selected", &selected, 2, at::kInt}, {"nvis", &nvis, 1, at::kLong},
                   {"first", &first, 1, at::kLong}, {"cells", &cells, 1, at::kInt}});
  QsaTokenCellsSizes sz;
  sz.tq = selected.size(0);
  sz.top_k = selected.size(1);
  sz.cells = cells.size(0);
  sz.r = r;
  HEBRUS_CHECK(nvis.size(0) == sz.tq && first.size(0) == sz.tq, HebrusError, "hebrus::", op,
               ": nvis and first must have Tq = ", sz.tq, " entries, got ", nvis.size(0), " and ", first.size(0));
  HEBRUS_CHECK(r >= 1 && r <= (int64_t{1} << 20), HebrusError, "hebrus::", op, ": r must be in [1, 1048576], got ", r);
  HEBRUS_CHECK(sz.top_k <= (int64_t{1} << 31) / r, HebrusError, "hebrus::", op,
               ": top_k * r must stay below 2^31, got top_k = ", sz.top_k, " and r = ", r);
  sz.width = sz.top_k * r + r - 1;
  return sz;
}

// ---- qsa_plan_one_row ----------------------------------------------------------------------------------

struct QsaPlanOneRowSizes {
  int64_t tokens = 0, nvis = 0, groups = 0, capacity = 0;
};

inline QsaPlanOneRowSizes check_qsa_plan_one_row_args(const at::Tensor& cell_pos, const at::Tensor& run_cells,
                                                      const at::Tensor& run_groups, const at::Tensor& cells,
                                                      int64_t p0, int64_t start, int64_t r) {
  const char* op = "qsa_plan_one_row";
  check_kinds(op, {{"cell_pos", &cell_pos, 1, at::kLong}, {"run_cells", &run_cells, 1, at::kLong},
                   {"run_groups", &run_groups, 1, at::kLong}, {"cells", &cells, 1, at::kLong}});
  QsaPlanOneRowSizes sz;
  sz.tokens = cells.size(0);
  sz.capacity = cell_pos.size(0);
  HEBRUS_CHECK(sz.tokens >= 1, HebrusError, "hebrus::", op, ": the chunk must have at least one cell");
  HEBRUS_CHECK(r >= 1 && r <= (int64_t{1} << 20), HebrusError, "hebrus::", op, ": r must be in [1, 1048576], got ", r);
  HEBRUS_CHECK(p0 >= 0 && start >= p0, HebrusError, "hebrus::", op, ": need 0 <= p0 <= start, got p0 = ", p0,
               " and start = ", start);
  HEBRUS_CHECK(start - p0 <= run_cells.size(0) - sz.tokens, HebrusError, "hebrus::", op, ": the chunk's ",
               sz.tokens, " positions from ", start, " pass the run's ", run_cells.size(0), " cells from ", p0);
  sz.nvis = start - p0 + sz.tokens;
  sz.groups = sz.nvis / r;
  HEBRUS_CHECK(sz.groups <= run_groups.size(0), HebrusError, "hebrus::", op, ": the run's ", sz.nvis,
               " visible positions make ", sz.groups, " groups but run_groups has ", run_groups.size(0));
  HEBRUS_CHECK(sz.capacity <= (int64_t{1} << 31) - 1, HebrusError, "hebrus::", op,
               ": cell_pos must have fewer than 2^31 cells, got ", sz.capacity);
  return sz;
}

// ---- qsa_claim_cells -----------------------------------------------------------------------------------

struct QsaClaimCellsSizes {
  int64_t rows = 0, tokens = 0, layers = 0, capacity = 0;
};

inline QsaClaimCellsSizes check_qsa_claim_cells_args(const at::Tensor& cell_ref, const at::Tensor& cell_pos,
                                                     const at::Tensor& unwritten, const at::Tensor& freed,
                                                     int64_t start, c10::IntArrayRef starts,
                                                     c10::IntArrayRef counts) {
  const char* op = "qsa_claim_cells";
  check_kinds(op, {{"cell_ref", &cell_ref, 1, at::kInt}, {"cell_pos", &cell_pos, 1, at::kLong},
                   {"unwritten", &unwritten, 2, at::kBool}, {"freed", &freed, 1, at::kBool}});
  QsaClaimCellsSizes sz;
  sz.capacity = cell_ref.size(0);
  sz.layers = unwritten.size(0);
  HEBRUS_CHECK(cell_pos.size(0) == sz.capacity && unwritten.size(1) == sz.capacity && freed.size(0) == sz.capacity,
               HebrusError, "hebrus::", op, ": cell_pos, unwritten and freed must cover cell_ref's C = ", sz.capacity,
               " cells, got ", cell_pos.size(0), ", ", unwritten.size(1), " and ", freed.size(0));
  HEBRUS_CHECK(starts.size() == counts.size(), HebrusError, "hebrus::", op, ": ", starts.size(), " starts but ",
               counts.size(), " counts");
  sz.rows = static_cast<int64_t>(counts.size());
  for (int64_t i = 0; i < sz.rows; ++i) {
    HEBRUS_CHECK(counts[i] >= 0 && counts[i] <= sz.capacity, HebrusError, "hebrus::", op, ": counts[", i, "] = ",
                 counts[i], " is outside [0, ", sz.capacity, "]");
    HEBRUS_CHECK(counts[i] == 0 || (starts[i] >= 0 && starts[i] <= std::numeric_limits<int64_t>::max() - counts[i] + 1),
                 HebrusError, "hebrus::", op, ": row ", i, "'s ", counts[i], " positions from ", starts[i],
                 " are outside [0, 2^63)");
    sz.tokens += counts[i];
  }
  HEBRUS_CHECK(sz.tokens >= 1 && start >= 0 && start <= sz.capacity - sz.tokens, HebrusError, "hebrus::", op,
               ": the ", sz.tokens, " cells from ", start, " must be at least one and lie in [0, ", sz.capacity, ")");
  HEBRUS_CHECK(sz.tokens < (int64_t{1} << 31), HebrusError, "hebrus::", op, ": at most 2^31 - 1 cells at once, got ",
               sz.tokens);
  return sz;
}

// ---- rms_norm_rope -------------------------------------------------------------------------------------

struct RmsNormRopeSizes {
  int64_t tokens = 0, heads = 0, dim = 0, rot = 0;
};

inline RmsNormRopeSizes check_rms_norm_rope_args(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                 const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "rms_norm_rope";
  check_kinds(op, {{"x", &x, 3, kAnyFloat}, {"weight", &weight, 1, kAnyFloat}, {"cos", &cos, 2, kAnyFloat},
                   {"sin", &sin, 2, kAnyFloat}});
  check_same_dtype(op, cos, "cos", x, "x");
  check_same_dtype(op, sin, "sin", x, "x");
  RmsNormRopeSizes sz;
  sz.tokens = x.size(0);
  sz.heads = x.size(1);
  sz.dim = x.size(2);
  sz.rot = cos.size(1);
  HEBRUS_CHECK(weight.size(0) == sz.dim, HebrusError, "hebrus::", op, ": weight must have D = ", sz.dim,
               " entries, got ", weight.size(0));
  HEBRUS_CHECK(cos.size(0) == sz.tokens && sin.sizes() == cos.sizes(), HebrusError, "hebrus::", op,
               ": cos and sin must both have shape (T, R) with T = ", sz.tokens, ", got ", shape_str(cos.sizes()),
               " and ", shape_str(sin.sizes()));
  HEBRUS_CHECK(sz.rot % 2 == 0 && sz.rot <= sz.dim, HebrusError, "hebrus::", op,
               ": the rotary dims R must be even and at most D = ", sz.dim, ", got ", sz.rot);
  HEBRUS_CHECK(eps >= 0, HebrusError, "hebrus::", op, ": eps must be >= 0, got ", eps);
  return sz;
}

// ---- sigmoid_gate --------------------------------------------------------------------------------------

struct SigmoidGateSizes {
  int64_t tokens = 0, heads = 0, dim = 0;
};

inline SigmoidGateSizes check_sigmoid_gate_args(const at::Tensor& x, const at::Tensor& gate) {
  const char* op = "sigmoid_gate";
  check_kinds(op, {{"x", &x, 3, kAnyFloat}, {"gate", &gate, 3, kAnyFloat}});
  check_same_dtype(op, gate, "gate", x, "x");
  HEBRUS_CHECK(gate.sizes() == x.sizes(), HebrusError, "hebrus::", op, ": gate must have x's shape ",
               shape_str(x.sizes()), ", got ", shape_str(gate.sizes()));
  return {x.size(0), x.size(1), x.size(2)};
}

}  // namespace hebrus
