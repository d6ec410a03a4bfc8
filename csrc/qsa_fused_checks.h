#pragma once
// Metadata checks of the fused QSA-layer ops (issue 37: qsa_token_cells, qsa_norm_rope), shared by the
// CPU kernels (csrc/cpu/qsa_kernels.cpp) and the MPS glue, in the order and with the messages of
// hebrus_torch/_validate.py's functions of the same names.
#include <ATen/core/Tensor.h>

#include <cstdint>

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
