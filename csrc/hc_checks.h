#pragma once
// Metadata checks of the fused hyper-connection ops (issue 37), shared by the CPU kernels
// (csrc/cpu/hc_kernels.cpp) and the MPS glue, in the order and with the messages of
// hebrus_torch/_validate.py's hc_* functions.
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>

#include "hebrus_check.h"
#include "op_checks.h"

namespace hebrus {

struct HcRmsNormSizes {
  int64_t rows = 0, dim = 0, group = 0;
};

inline HcRmsNormSizes check_hc_rms_norm_args(const at::Tensor& x, const at::Tensor& weight, int64_t group_size,
                                             double eps) {
  const char* op = "hc_rms_norm";
  HEBRUS_CHECK(x.dim() >= 1, HebrusError, "hebrus::", op, ": x must be at least 1-D, got shape ",
               shape_str(x.sizes()));
  check_float(op, x, "x");
  check_kinds(op, {{"weight", &weight, 1, kAnyFloat}});
  HcRmsNormSizes sz;
  sz.dim = x.size(-1);
  sz.rows = sz.dim > 0 ? x.numel() / sz.dim : 0;
  sz.group = group_size;
  HEBRUS_CHECK(weight.size(0) == sz.dim, HebrusError, "hebrus::", op, ": weight must have D = ", sz.dim,
               " entries, got ", weight.size(0));
  HEBRUS_CHECK(group_size >= 1 && sz.dim % group_size == 0, HebrusError, "hebrus::", op,
               ": group_size must be >= 1 and divide D = ", sz.dim, ", got ", group_size);
  HEBRUS_CHECK(eps >= 0, HebrusError, "hebrus::", op, ": eps must be >= 0, got ", eps);
  return sz;
}

}  // namespace hebrus
