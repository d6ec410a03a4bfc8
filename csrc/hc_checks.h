#pragma once
// Metadata checks of the fused hyper-connection ops (issue 37), shared by the CPU kernels
// (csrc/cpu/hc_kernels.cpp) and the MPS glue, in the order and with the messages of
// hebrus_torch/_validate.py's hc_* functions.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "hebrus_check.h"
#include "moe_checks.h"
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

// The pre-mix ops' streams (h [T, D], already checked 2-D float): hc_count divides D, norm_weight has D entries.
inline HcPremixSizes check_hc_streams(const char* op, const at::Tensor& h, const at::Tensor& norm_weight,
                                      int64_t hc_count) {
  HcPremixSizes sz;
  sz.rows = h.size(0);
  sz.dim = h.size(1);
  sz.hc = hc_count;
  HEBRUS_CHECK(hc_count >= 1 && sz.dim % hc_count == 0, HebrusError, "hebrus::", op,
               ": hc_count must be >= 1 and divide D = ", sz.dim, ", got ", hc_count);
  sz.hidden = sz.dim / hc_count;
  HEBRUS_CHECK(norm_weight.size(0) == sz.dim, HebrusError, "hebrus::", op, ": norm_weight must have D = ", sz.dim,
               " entries, got ", norm_weight.size(0));
  return sz;
}

inline HcPremixSizes check_hc_premix_args(const at::Tensor& h, const at::Tensor& norm_weight, const at::Tensor& down,
                                          const at::Tensor& up, const c10::optional<at::Tensor>& inject,
                                          int64_t hc_count, double eps) {
  const char* op = "hc_premix";
  check_kinds(op, {{"h", &h, 2, kAnyFloat}, {"norm_weight", &norm_weight, 1, kAnyFloat}, {"down", &down, 2, kAnyFloat},
                   {"up", &up, 2, kAnyFloat}});
  HcPremixSizes sz = check_hc_streams(op, h, norm_weight, hc_count);
  sz.has_inject = inject.has_value() && inject->defined();
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

// One affine-quantized projection of hc_premix_quantized, W [out, in]: <name>_q [out, in * bits / 32] int32,
// <name>_scales / <name>_biases [out, in / group_size] of h's dtype. out_rows < 0: any out >= 1 (returned).
struct HcQuantProjection {
  const char* name;
  const at::Tensor *q, *scales, *biases;
};

inline int64_t check_hc_quant_projection(const char* op, const HcQuantProjection& w, const at::Tensor& h, int64_t in,
                                         int64_t out_rows, const char* out_name, int64_t group_size, int64_t bits) {
  const std::string q = std::string(w.name) + "_q";
  const std::pair<std::string, const at::Tensor*> params[] = {{std::string(w.name) + "_scales", w.scales},
                                                              {std::string(w.name) + "_biases", w.biases}};
  check_kinds(op, {{q.c_str(), w.q, 2, at::kInt}});
  for (const auto& [name, t] : params) {
    check_dims(op, *t, 2, name.c_str());
    check_same_dtype(op, *t, name.c_str(), h, "h");
  }
  HEBRUS_CHECK(in % group_size == 0, HebrusError, "hebrus::", op, ": ", w.name, "'s input dimension ", in,
               " must be a multiple of group_size ", group_size);
  const int64_t out = w.q->size(0);
  HEBRUS_CHECK((out_rows < 0 ? out >= 1 : out == out_rows) && w.q->size(1) * (32 / bits) == in, HebrusError,
               "hebrus::", op, ": ", q, " must be [", out_name, ", ", in, " * bits / 32 = ", in * bits / 32,
               "], got shape ", shape_str(w.q->sizes()));
  for (const auto& [name, t] : params) {
    HEBRUS_CHECK(t->size(0) == out && t->size(1) == in / group_size, HebrusError, "hebrus::", op, ": ", name,
                 " must be [", out, ", ", in / group_size, "], got shape ", shape_str(t->sizes()));
  }
  return out;
}

// hebrus::hc_premix_quantized: hc_premix with down [R, D], up [D, R] and inject [hc, D] (all three of inject's
// tensors or none) affine-quantized with one group_size and bits. Same order and messages as
// hebrus_torch/_validate.py's hc_premix_quantized.
inline HcPremixSizes check_hc_premix_quantized_args(
    const at::Tensor& h, const at::Tensor& norm_weight, const HcQuantProjection& down, const HcQuantProjection& up,
    const c10::optional<HcQuantProjection>& inject, int64_t hc_count, double eps, int64_t group_size, int64_t bits) {
  const char* op = "hc_premix_quantized";
  check_quant_options(op, group_size, bits);
  check_kinds(op, {{"h", &h, 2, kAnyFloat}, {"norm_weight", &norm_weight, 1, kAnyFloat}});
  HcPremixSizes sz = check_hc_streams(op, h, norm_weight, hc_count);
  sz.has_inject = inject.has_value();
  const std::string dim = "D = " + std::to_string(sz.dim);
  sz.rank = check_hc_quant_projection(op, down, h, sz.dim, -1, "R >= 1", group_size, bits);
  check_hc_quant_projection(op, up, h, sz.rank, sz.dim, dim.c_str(), group_size, bits);
  if (sz.has_inject) {
    const std::string hc = "hc_count = " + std::to_string(hc_count);
    check_hc_quant_projection(op, *inject, h, sz.dim, hc_count, hc.c_str(), group_size, bits);
  }
  HEBRUS_CHECK(eps >= 0, HebrusError, "hebrus::", op, ": eps must be >= 0, got ", eps);
  return sz;
}

// inject_q / inject_scales / inject_biases of hc_premix_quantized: all three given, or none.
inline c10::optional<HcQuantProjection> hc_quant_inject(const c10::optional<at::Tensor>& q,
                                                        const c10::optional<at::Tensor>& scales,
                                                        const c10::optional<at::Tensor>& biases) {
  const auto given = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  HEBRUS_CHECK(given(q) == given(scales) && given(q) == given(biases), HebrusError,
               "hebrus::hc_premix_quantized: inject_q, inject_scales and inject_biases must be given together");
  if (!given(q)) return c10::nullopt;
  return HcQuantProjection{"inject", &*q, &*scales, &*biases};
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
