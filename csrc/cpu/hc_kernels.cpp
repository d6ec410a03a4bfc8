// CPU kernels of the fused hyper-connection ops (issue 37): hc_rms_norm (transformers' Qwen4ExpTextRMSNorm),
// hc_premix (Qwen4ExpTextGatedResidual; hc_premix_quantized with QuantizedLinear projections) and hc_post_combine
// (the decoder layer's injection; hebrus_torch/reference/hc.py states each formula). The norms, gates and the
// stream mix are hebrus's own row arithmetic (row_math.h: fp32, fixed orders, rounded to the dtype where the
// module's ops round), the projections ATen's mm or hebrus::quantized_linear: a handful of calls where the
// modules' sequence made 88, within a tolerance of the modules' outputs, each row's result independent of the
// other rows.
// On MPS each op is one Metal launch (mps_kernels/hc_rms_norm.metal, hc_premix.metal, hc_post_combine.metal).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../hc_checks.h"
#include "../op_checks.h"
#include "quantized_linear.h"
#include "row_math.h"
#include "dense_mm.h"

namespace hebrus {
namespace {

at::Tensor hc_rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t group_size, double eps) {
  check_on_device("hc_rms_norm", c10::DeviceType::CPU, {{"x", &x}, {"weight", &weight}});
  const HcRmsNormSizes sz = check_hc_rms_norm_args(x, weight, group_size, eps);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = empty_on_cpu(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (sz.rows == 0 || sz.dim == 0) return out;
  const at::Tensor w = float_weight(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hc_rms_norm", [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), w.data_ptr<float>(), out.data_ptr<scalar_t>(), sz.rows, sz.dim,
                        sz.group, eps);
  });
  return out;
}

enum class HcProjection { kDown, kUp, kInject };

// The pre-mix after its checks, each projection `project(x, which)` (a dense or a quantized linear) and the rest
// row by row, rounding to the dtype where the module's ops do: normed = norm(h); low = silu(project(normed, down)
// / hc); mixed = mean over the streams of sigmoid(project(low, up)) * normed (the products summed in stream order
// in fp32, then divided); injection = 2 * sigmoid(project(normed, inject) / hc).
template <typename T, typename Project>
std::tuple<at::Tensor, at::Tensor> premix_rows(const at::Tensor& h, const at::Tensor& norm_weight,
                                               const HcPremixSizes& sz, int64_t hc_count, double eps, bool has_inject,
                                               Project project) {
  const int64_t rows = sz.rows, dim = sz.dim, hidden = sz.hidden, hc = sz.hc;
  const float divisor = static_cast<float>(hc_count);
  const auto round = [](float v) { return static_cast<float>(static_cast<T>(v)); };  // to the dtype and back
  const at::Tensor hcont = h.contiguous();
  at::Tensor normed = empty_on_cpu({rows, dim}, h.options());
  const at::Tensor w = float_weight(norm_weight);
  norm_rows<T>(hcont.data_ptr<T>(), w.data_ptr<float>(), normed.data_ptr<T>(), rows, dim, hidden, eps);

  at::Tensor low = project(normed, HcProjection::kDown).contiguous();
  const int64_t rank = low.size(1);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(rank));
    for (int64_t r = r0; r < r1; ++r) {
      T* p = low.data_ptr<T>() + r * rank;
      widen_row(p, row.data(), rank);
      for (int64_t i = 0; i < rank; ++i) row[i] = round(row[i] / divisor);
      silu_row(row.data(), rank);
      narrow_row(row.data(), p, rank);
    }
  });

  const at::Tensor up = project(low, HcProjection::kUp).contiguous();
  at::Tensor mixed = empty_on_cpu({rows, hidden}, h.options());
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> gate(static_cast<size_t>(dim)), acc(static_cast<size_t>(hidden));
    for (int64_t r = r0; r < r1; ++r) {
      widen_row(up.data_ptr<T>() + r * dim, gate.data(), dim);
      sigmoid_row(gate.data(), dim);
      const T* n = normed.data_ptr<T>() + r * dim;
      for (int64_t j = 0; j < hidden; ++j) acc[j] = round(round(gate[j]) * static_cast<float>(n[j]));
      for (int64_t c = 1; c < hc; ++c)
        for (int64_t j = 0; j < hidden; ++j)
          acc[j] += round(round(gate[c * hidden + j]) * static_cast<float>(n[c * hidden + j]));
      T* m = mixed.data_ptr<T>() + r * hidden;
      for (int64_t j = 0; j < hidden; ++j) m[j] = static_cast<T>(acc[j] / divisor);
    }
  });

  if (!has_inject) return {mixed, empty_on_cpu({rows, 0}, h.options())};
  at::Tensor injection = project(normed, HcProjection::kInject).contiguous();
  const int64_t n = injection.numel();
  std::vector<float> inj(static_cast<size_t>(n));
  T* p = injection.data_ptr<T>();
  widen_row(p, inj.data(), n);
  for (int64_t i = 0; i < n; ++i) inj[i] = round(inj[i] / divisor);
  sigmoid_row(inj.data(), n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(2.f * round(inj[i]));
  return {mixed, injection};
}

template <typename Project>
std::tuple<at::Tensor, at::Tensor> premix_sequence(const at::Tensor& h, const at::Tensor& norm_weight,
                                                   const HcPremixSizes& sz, int64_t hc_count, double eps,
                                                   bool has_inject, Project project) {
  std::tuple<at::Tensor, at::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "hc_premix", [&] {
    result = premix_rows<scalar_t>(h, norm_weight, sz, hc_count, eps, has_inject, project);
  });
  return result;
}

// Qwen4ExpTextGatedResidual.forward with plain nn.Linear projections without bias (x @ W.T, ATen's mm), in one
// dispatch.
std::tuple<at::Tensor, at::Tensor> hc_premix_cpu(const at::Tensor& h, const at::Tensor& norm_weight,
                                                 const at::Tensor& down, const at::Tensor& up,
                                                 const c10::optional<at::Tensor>& inject, int64_t hc_count,
                                                 double eps) {
  const bool has_inject = inject.has_value() && inject->defined();
  check_on_device("hc_premix", c10::DeviceType::CPU, {{"h", &h}, {"norm_weight", &norm_weight}, {"down", &down},
                                                      {"up", &up}});
  if (has_inject) check_on_device("hc_premix", c10::DeviceType::CPU, {{"h", &h}, {"inject", &*inject}});
  const HcPremixSizes sz = check_hc_premix_args(h, norm_weight, down, up, inject, hc_count, eps);
  return premix_sequence(h, norm_weight, sz, hc_count, eps, has_inject, [&](const at::Tensor& x, HcProjection which) {
    return dense_mm(x, which == HcProjection::kDown ? down : which == HcProjection::kUp ? up : *inject);
  });
}

// hc_premix with each projection a QuantizedLinear call (hebrus::quantized_linear's CPU kernel), for a module
// whose projections are QuantizedLinear (hebrus_torch/hc/premix.py).
std::tuple<at::Tensor, at::Tensor> hc_premix_quantized_cpu(
    const at::Tensor& h, const at::Tensor& norm_weight, const at::Tensor& down_q, const at::Tensor& down_scales,
    const at::Tensor& down_biases, const at::Tensor& up_q, const at::Tensor& up_scales, const at::Tensor& up_biases,
    const c10::optional<at::Tensor>& inject_q, const c10::optional<at::Tensor>& inject_scales,
    const c10::optional<at::Tensor>& inject_biases, int64_t hc_count, double eps, int64_t group_size, int64_t bits) {
  const char* op = "hc_premix_quantized";
  const c10::optional<HcQuantProjection> inject = hc_quant_inject(inject_q, inject_scales, inject_biases);
  check_on_device(op, c10::DeviceType::CPU,
                  {{"h", &h}, {"norm_weight", &norm_weight}, {"down_q", &down_q}, {"down_scales", &down_scales},
                   {"down_biases", &down_biases}, {"up_q", &up_q}, {"up_scales", &up_scales},
                   {"up_biases", &up_biases}});
  if (inject.has_value()) {
    check_on_device(op, c10::DeviceType::CPU, {{"h", &h}, {"inject_q", inject->q}, {"inject_scales", inject->scales},
                                               {"inject_biases", inject->biases}});
  }
  const HcQuantProjection down{"down", &down_q, &down_scales, &down_biases}, up{"up", &up_q, &up_scales, &up_biases};
  const HcPremixSizes sz =
      check_hc_premix_quantized_args(h, norm_weight, down, up, inject, hc_count, eps, group_size, bits);
  return premix_sequence(h, norm_weight, sz, hc_count, eps, inject.has_value(),
                         [&](const at::Tensor& x, HcProjection which) {
                           const HcQuantProjection& w =
                               which == HcProjection::kDown ? down : which == HcProjection::kUp ? up : *inject;
                           return quantized_linear_cpu(x, *w.q, *w.scales, *w.biases, group_size, bits);
                         });
}

// The decoder layer's post-combine, hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2), element by
// element: the product rounded to the dtype, then the sum (the module's two ops, so its bits).
template <typename T>
void post_combine_rows(const T* hyper, const T* out, const T* inject, T* result, int64_t rows, int64_t hidden,
                       int64_t hc) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* o = out + r * hidden;
      for (int64_t c = 0; c < hc; ++c) {
        const float w = static_cast<float>(inject[r * hc + c]);
        const T* src = hyper + (r * hc + c) * hidden;
        T* dst = result + (r * hc + c) * hidden;
        for (int64_t j = 0; j < hidden; ++j) {
          const T product = static_cast<T>(static_cast<float>(o[j]) * w);
          dst[j] = static_cast<T>(static_cast<float>(src[j]) + static_cast<float>(product));
        }
      }
    }
  });
}

at::Tensor hc_post_combine_cpu(const at::Tensor& hyper, const at::Tensor& out, const at::Tensor& inject) {
  check_on_device("hc_post_combine", c10::DeviceType::CPU, {{"hyper", &hyper}, {"out", &out}, {"inject", &inject}});
  const HcPostCombineSizes sz = check_hc_post_combine_args(hyper, out, inject);
  const at::Tensor h = hyper.contiguous(), o = out.contiguous(), w = inject.contiguous();
  at::Tensor result = empty_on_cpu({sz.rows, sz.hc * sz.hidden}, hyper.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hyper.scalar_type(), "hc_post_combine", [&] {
    post_combine_rows<scalar_t>(h.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                result.data_ptr<scalar_t>(), sz.rows, sz.hidden, sz.hc);
  });
  return result;
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("hc_rms_norm", &hebrus::hc_rms_norm_cpu);
  m.impl("hc_premix", &hebrus::hc_premix_cpu);
  m.impl("hc_premix_quantized", &hebrus::hc_premix_quantized_cpu);
  m.impl("hc_post_combine", &hebrus::hc_post_combine_cpu);
}
