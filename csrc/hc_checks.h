#pragma once
// Metadata checks of the fused hyper-connection ops (issue 37), shared by the CPU kernels
// (csrc/cpu/hc_kernels.cpp) and the MPS glue, in the order and with the messages of
// hebrus_torch/_validate.py's hc_* functions.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

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

struct HcPremixSizes {
  int64_t rows = 0, dim = 0, hidden = 0, hc = 0, rank = 0;
  bool has_inject = false;
};

inline HcPremixSizes check_hc_premix_args(const at::Tensor& h, const at::Tensor& norm_weight, const at::Tensor& down,
                                          const at::Tensor& up, const c10::optional<at::Tensor>& inject,
                                          int64_t hc_count, double eps) {
  const char* op = "hc_premix";
  check_kinds(op, {{"h", &h, 2, kAnyFloat}, {"norm_weight", &norm_weight, 1, kAnyFloat}, {"down", &down, 2, kAnyFloat},
                   {"up", &up, 2, kAnyFloat}});
  HcPremixSizes sz;
  sz.rows = h.size(0);
  sz.dim = h.size(1);
  sz.hc = hc_count;
  sz.has_inject = inject.has_value() && inject->defined();
  HEBRUS_CHECK(hc_count >= 1 && sz.dim % hc_count == 0, HebrusError, "hebrus::", op,
               ": hc_count must be >= 1 and divide D = ", sz.dim, ", got ", hc_count);
  sz.hidden = sz.dim / hc_count;
  HEBRUS_CHECK(norm_weight.size(0) == sz.dim, HebrusError, "hebrus::", op, ": norm_weight must have D = ", sz.dim,
               " entries, got ", norm_weight.size(0));
  check_same_dtype(op, down, "down", h, "h");
  check_same_dtype(op, up, "up", h, "h");
  sz.rank = down.size(0);
  HEBRUS_CHECK(sz.rank >= 1 && down.size(1) == sz.dim, HebrusError, "hebrus::", op, ": down must be [R >= 1, D = ",
               sz.dim, "], got shape ", shape_str(down.sizes()));
  HEBRUS_CHECK(up.size(0) == sz.dim && up.size(1) == sz.rank, HebrusError, "hebrus::", op, ": up must be [D = ",
               sz.dim, ", R = ", sz.rank, "], got shape ", shape_str(up.sizes()));
  if (sz.has_inject) {
    check_kinds(op, {{"inject", &*inject, 2, kAnyFloat}});
    check_same_dtype(op, *inject, "inject", h, "h");
    HEBRUS_CHECK(inject->size(0) == hc_count && inject->size(1) == sz.dim, HebrusError, "hebrus::", op,
                 ": inject must be [hc_count = ", hc_count, ", D = ", sz.dim, "], got shape ",
                 shape_str(inject->sizes()));
  }
  HEBRUS_CHECK(eps >= 0, HebrusError, "hebrus::", op, ": eps must be >= 0, got ", eps);
  return sz;
}

struct HcPostCombineSizes {
  int64_t rows = 0, hidden = 0, hc = 0;
};

inline HcPostCombineSizes check_hc_post_combine_args(const at::Tensor& hyper, const at::Tensor& out,
                                                     const at::Tensor& inject) {
  const char* op = "hc_post_combine";
  check_kinds(op, {{"hyper", &hyper, 2, kAnyFloat}, {"out", &out, 2, kAnyFloat}, {"inject", &inject, 2, kAnyFloat}});
  check_same_dtype(op, out, "out", hyper, "hyper");
  check_same_dtype(op, inject, "inject", hyper, "hyper");
  HcPostCombineSizes sz;
  sz.rows = hyper.size(0);
  sz.hidden = out.size(1);
  sz.hc = inject.size(1);
  HEBRUS_CHECK(out.size(0) == sz.rows && inject.size(0) == sz.rows, HebrusError, "hebrus::", op,
               ": hyper, out and inject must have the same rows, got ", sz.rows, ", ", out.size(0), " and ",
               inject.size(0));
  HEBRUS_CHECK(hyper.size(1) == sz.hc * sz.hidden, HebrusError, "hebrus::", op, ": hyper must have hc * hidden = ",
               sz.hc, " * ", sz.hidden, " features, got ", hyper.size(1));
  return sz;
}

}  // namespace hebrus
