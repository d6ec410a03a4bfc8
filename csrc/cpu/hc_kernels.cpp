// CPU kernels of the fused hyper-connection ops (issue 37). hc_rms_norm runs the ATen sequence of
// transformers' Qwen4ExpTextRMSNorm (hebrus_torch/reference/hc.py) in C++: the module's bits, without
// the Python and dispatcher round trips of its nine ops; on MPS the same op is one Metal launch
// (mps_kernels/hc_rms_norm.metal).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../hc_checks.h"
#include "../op_checks.h"

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

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("hc_rms_norm", &hebrus::hc_rms_norm_cpu);
}
