#pragma once
// Metadata checks of the gated-delta-net layer's fused gate and output-norm ops (issue 37):
// hebrus::gdn_gates and hebrus::gdn_gated_rms_norm, shared by the CPU kernels (csrc/cpu/gdn_kernels.cpp)
// and the MPS glue (csrc/mps/hebrus_glue.h), in the order and with the messages of
// hebrus_torch/_validate.py's gdn_gates / gdn_gated_rms_norm. Plain C++, header-only.
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <string>
#include <utility>

#include "hebrus_check.h"
#include "op_checks.h"

namespace hebrus {


struct GdnRowsSizes {
  int64_t rows = 0, dim = 0;  // x [..., D]: rows = numel / D
};

// a, b [..., Hv] (one dtype), A_log and dt_bias [Hv] (any float dtype).
inline GdnRowsSizes check_gdn_gates_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                         const at::Tensor& dt_bias) {
  const char* op = "gdn_gates";
  HEBRUS_CHECK(a.dim() >= 1, HebrusError, "hebrus::", op, ": a must be at least 1-D, got shape ",
               shape_str(a.sizes()));
  check_float(op, a, "a");
  check_same_dtype(op, b, "b", a, "a");
  HEBRUS_CHECK(b.sizes() == a.sizes(), HebrusError, "hebrus::", op, ": b must have a's shape ", shape_str(a.sizes()),
               ", got ", shape_str(b.sizes()));
  check_kinds(op, {{"A_log", &A_log, 1, kAnyFloat}, {"dt_bias", &dt_bias, 1, kAnyFloat}});
  GdnRowsSizes sz;
  sz.dim = a.size(-1);
  sz.rows = sz.dim > 0 ? a.numel() / sz.dim : 0;
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"A_log", &A_log}, {"dt_bias", &dt_bias}})
    HEBRUS_CHECK(t->size(0) == sz.dim, HebrusError, "hebrus::", op, ": ", name, " must have Hv = ", sz.dim,
                 " entries, got ", t->size(0));
  return sz;
}

// x, gate [..., D] (one dtype, one shape), weight [D] (any float dtype), eps >= 0, activation silu or sigmoid.
inline GdnRowsSizes check_gdn_gated_rms_norm_args(const at::Tensor& x, const at::Tensor& gate,
                                                  const at::Tensor& weight, double eps,
                                                  c10::string_view activation) {
  const char* op = "gdn_gated_rms_norm";
  HEBRUS_CHECK(x.dim() >= 1, HebrusError, "hebrus::", op, ": x must be at least 1-D, got shape ",
               shape_str(x.sizes()));
  check_float(op, x, "x");
  check_same_dtype(op, gate, "gate", x, "x");
  HEBRUS_CHECK(gate.sizes() == x.sizes(), HebrusError, "hebrus::", op, ": gate must have x's shape ",
               shape_str(x.sizes()), ", got ", shape_str(gate.sizes()));
  check_kinds(op, {{"weight", &weight, 1, kAnyFloat}});
  GdnRowsSizes sz;
  sz.dim = x.size(-1);
  sz.rows = sz.dim > 0 ? x.numel() / sz.dim : 0;
  HEBRUS_CHECK(weight.size(0) == sz.dim, HebrusError, "hebrus::", op, ": weight must have D = ", sz.dim,
               " entries, got ", weight.size(0));
  HEBRUS_CHECK(eps >= 0, HebrusError, "hebrus::", op, ": eps must be >= 0, got ", eps);
  HEBRUS_CHECK(activation == "silu" || activation == "sigmoid", HebrusError, "hebrus::", op,
               ": activation must be 'silu' or 'sigmoid', got '", std::string(activation), "'");
  return sz;
}

}  // namespace hebrus
