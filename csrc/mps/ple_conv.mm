// MPS kernel of hebrus::ple_conv (SPEC section 2): glue for mps_kernels/ple_conv.metal.
// Checks metadata as the CPU kernel does, launches with hebrus::metal::plan_ple_conv (the grid the
// Linux emulator also runs), then reads the error slots back: bad cu_seqlens raise the CPU
// kernel's message and nothing is returned.
#include "hebrus_mps.h"
#include "op_checks.h"

#include <c10/util/string_view.h>
#include <torch/library.h>

#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> ple_conv_mps(const Tensor& x_in, const Tensor& weight_in, const Tensor& cu_in,
                                        const Tensor& state_in, int64_t dilation, c10::string_view activation) {
  const char* op = "ple_conv";
  check_on_mps(op, {{"x", &x_in}, {"weight", &weight_in}, {"cu_seqlens", &cu_in}, {"state", &state_in}});
  const PleConvSizes sz = check_ple_conv_args(x_in, weight_in, cu_in, state_in, dilation, activation);
  const int64_t batch = sz.batch, total = sz.total, channels = sz.channels, width = sz.width;
  const bool silu = sz.silu;
  const auto dtype = x_in.scalar_type();
  const char* type = metal_type(op, dtype);

  if (batch == 0 || channels == 0) {  // no thread would look at cu_seqlens: check it here
    check_cu_values(op, cu_in, total);
    return {at::empty_like(x_in, at::MemoryFormat::Contiguous), state_in.clone(at::MemoryFormat::Contiguous)};
  }
  const auto plan = hebrus::metal::plan_ple_conv(total, channels, width, batch, dilation, silu);
  check_plan(op, plan.error);

  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), cu = cu_in.contiguous();
  const Tensor state = state_in.contiguous();
  Tensor y = at::empty_like(x);
  Tensor new_state = at::empty_like(state);
  Tensor err = error_slots(x);
  const auto fn = kernel(op, "ple_conv", hebrus::metal::kernel_name(op, "", type), plan.dispatch.group);
  launch(fn, {&x, &weight, &cu, &state, &y, &new_state, &err}, plan.params, plan.dispatch);

  if (read_error_slots(err).index[HEBRUS_ERR_CONV_CU_ROW] >= 0) {
    check_cu_values(op, cu, total);
    TORCH_INTERNAL_ASSERT(false, "hebrus::ple_conv: the kernel rejected cu_seqlens the host check accepts");
  }
  return {y, new_state};
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("ple_conv", &hebrus::mps::ple_conv_mps);
}
