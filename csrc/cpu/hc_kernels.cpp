// CPU kernels of the fused hyper-connection ops (issue 37). hc_rms_norm runs the ATen sequence of
// transformers' Qwen4ExpTextRMSNorm, hc_premix that of Qwen4ExpTextGatedResidual (hc_premix_quantized:
// with QuantizedLinear projections) and hc_post_combine the decoder layer's injection
// (hebrus_torch/reference/hc.py) in C++: the module's bits, without the Python and dispatcher round trips
// of their ops; on MPS each op is one Metal launch
// (mps_kernels/hc_rms_norm.metal, hc_premix.metal, hc_post_combine.metal).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../hc_checks.h"
#include "../op_checks.h"
#include "quantized_linear.h"

namespace hebrus {
namespace {

at::Tensor hc_rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t group_size, double eps) {
  check_on_device("hc_rms_norm", c10::DeviceType::CPU, {{"x", &x}, {"weight", &weight}});
  const HcRmsNormSizes sz = check_hc_rms_norm_args(x, weight, group_size, eps);
  const at::Tensor xf = x.to(at::kFloat).reshape({sz.rows, sz.dim / sz.group, sz.group});
  const at::Tensor inv = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true).add(eps));
  const at::Tensor out = xf.mul(inv).flatten(-2);
  return out.mul(weight.to(at::kFloat).add(1.0)).to(x.scalar_type()).view(x.sizes());
}

enum class HcProjection { kDown, kUp, kInject };

// The pre-mix after its checks, each projection `project(x, which)` (a dense or a quantized linear): the module's
// sequence, so hc_premix and hc_premix_quantized give premix_by_modules' bits for their kinds of projection.
template <typename Project>
std::tuple<at::Tensor, at::Tensor> premix_sequence(const at::Tensor& h, const at::Tensor& norm_weight,
                                                   const HcPremixSizes& sz, int64_t hc_count, double eps,
                                                   bool has_inject, Project project) {
  const at::Tensor normed = hc_rms_norm_cpu(h, norm_weight, sz.hidden, eps);
  const at::Tensor low = at::silu(project(normed, HcProjection::kDown).div(hc_count));
  const at::Tensor weight = at::sigmoid(project(low, HcProjection::kUp)).unflatten(-1, {sz.hc, sz.hidden});
  const at::Tensor mixed = weight.mul(normed.unflatten(-1, {sz.hc, sz.hidden})).mean(-2);
  at::Tensor injection = has_inject ? at::sigmoid(project(normed, HcProjection::kInject).div(hc_count)).mul(2)
                                    : at::empty({sz.rows, 0}, h.options());
  return {mixed, injection};
}

// Qwen4ExpTextGatedResidual.forward's ATen sequence (the projections are F.linear of plain nn.Linear
// weights without bias, as the module's own calls): the module's bits, in one dispatch.
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
    return at::linear(x, which == HcProjection::kDown ? down : which == HcProjection::kUp ? up : *inject);
  });
}

// hc_premix's sequence with each projection a QuantizedLinear call (hebrus::quantized_linear's CPU kernel):
// premix_by_modules' bits for a module whose projections are QuantizedLinear (hebrus_torch/hc/premix.py).
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

// The decoder layer's post-combine, hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2): the
// module's bits (each product rounded to the dtype, then the sum).
at::Tensor hc_post_combine_cpu(const at::Tensor& hyper, const at::Tensor& out, const at::Tensor& inject) {
  check_on_device("hc_post_combine", c10::DeviceType::CPU, {{"hyper", &hyper}, {"out", &out}, {"inject", &inject}});
  check_hc_post_combine_args(hyper, out, inject);
  return hyper.add(out.unsqueeze(-2).mul(inject.unsqueeze(-1)).flatten(-2));
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("hc_rms_norm", &hebrus::hc_rms_norm_cpu);
  m.impl("hc_premix", &hebrus::hc_premix_cpu);
  m.impl("hc_premix_quantized", &hebrus::hc_premix_quantized_cpu);
  m.impl("hc_post_combine", &hebrus::hc_post_combine_cpu);
}
