// MPS kernels of hebrus::hc_premix, hebrus::hc_premix_quantized and hebrus::hc_post_combine (issue 37): glue for
// mps_kernels/hc_premix.metal. Every decision (checks, kernels, buffers, parameter blocks, dispatches) is
// hebrus::glue::hc_premix / hc_post_combine (hebrus_glue.h, also run by the Linux emulator); this file
// only encodes it.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> hc_premix_mps(const Tensor& h, const Tensor& norm_weight, const Tensor& down,
                                         const Tensor& up, const c10::optional<Tensor>& inject, int64_t hc_count,
                                         double eps) {
  const hebrus::glue::Call call =
      hebrus::glue::hc_premix(h, norm_weight, down, up, inject, hc_count, eps, c10::DeviceType::MPS);
  encode("hc_premix", call);
  return {call.outputs[0], call.outputs[1]};
}

std::tuple<Tensor, Tensor> hc_premix_quantized_mps(
    const Tensor& h, const Tensor& norm_weight, const Tensor& down_q, const Tensor& down_scales,
    const Tensor& down_biases, const Tensor& up_q, const Tensor& up_scales, const Tensor& up_biases,
    const c10::optional<Tensor>& inject_q, const c10::optional<Tensor>& inject_scales,
    const c10::optional<Tensor>& inject_biases, int64_t hc_count, double eps, int64_t group_size, int64_t bits) {
  const hebrus::glue::Call call = hebrus::glue::hc_premix_quantized(
      h, norm_weight, down_q, down_scales, down_biases, up_q, up_scales, up_biases, inject_q, inject_scales,
      inject_biases, hc_count, eps, group_size, bits, c10::DeviceType::MPS);
  encode("hc_premix_quantized", call);
  return {call.outputs[0], call.outputs[1]};
}

Tensor hc_post_combine_mps(const Tensor& hyper, const Tensor& out, const Tensor& inject) {
  const hebrus::glue::Call call = hebrus::glue::hc_post_combine(hyper, out, inject, c10::DeviceType::MPS);
  encode("hc_post_combine", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("hc_premix", &hebrus::mps::hc_premix_mps);
  m.impl("hc_premix_quantized", &hebrus::mps::hc_premix_quantized_mps);
  m.impl("hc_post_combine", &hebrus::mps::hc_post_combine_mps);
}
