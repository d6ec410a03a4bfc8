// C ABI over mps_kernels/hebrus_launch.h for tests of the launch plans alone (hebrus_emu.plan /
// kernel_name). The ops themselves run through the glue (csrc/mps/hebrus_glue.h, glue_abi.cpp),
// which calls these same plan functions. Built and loaded by hebrus_emu.plan_library().
#include <cstring>

#include "hebrus_launch.h"

namespace {
struct EmuPlan {
  uint64_t threads;
  uint64_t group;
  uint64_t params_size;
  unsigned char params[256];
  char variant[32];
  char error[256];
};

template <class Plan>
int fill(const Plan& plan, const void* params, size_t size, const char* variant, EmuPlan* out) {
  std::memset(out, 0, sizeof(*out));
  static_assert(sizeof(out->params) >= 128, "params buffer");
  out->threads = plan.dispatch.threads;
  out->group = plan.dispatch.group;
  out->params_size = size;
  std::memcpy(out->params, params, size);
  std::strncpy(out->variant, variant, sizeof(out->variant) - 1);
  if (plan.error) std::strncpy(out->error, plan.error, sizeof(out->error) - 1);
  return plan.error ? 1 : 0;
}
}  // namespace

extern "C" {
__attribute__((visibility("default"))) int hebrus_emu_kernel_name(const char* op, const char* variant,
                                                                  const char* type, char* out, int len) {
  const std::string name = hebrus::metal::kernel_name(op, variant, type);
  std::strncpy(out, name.c_str(), len - 1);
  out[len - 1] = '\0';
  return 0;
}

__attribute__((visibility("default"))) int hebrus_emu_plan_ple_conv(int64_t tokens, int64_t channels, int64_t width,
                                                                    int64_t batch, int64_t dilation, int32_t silu,
                                                                    EmuPlan* out) {
  const auto plan = hebrus::metal::plan_ple_conv(tokens, channels, width, batch, dilation, silu != 0);
  return fill(plan, &plan.params, sizeof(plan.params), "", out);
}

__attribute__((visibility("default"))) int hebrus_emu_plan_ple_ngram_ids(int64_t tokens, int64_t batch, int64_t ngram,
                                                                         int64_t heads, int64_t eos, int64_t vocab,
                                                                         EmuPlan* out) {
  const auto plan = hebrus::metal::plan_ple_ngram_ids(tokens, batch, ngram, heads, eos, vocab);
  return fill(plan, &plan.params, sizeof(plan.params), "", out);
}

__attribute__((visibility("default"))) int hebrus_emu_plan_qsa_pool(int64_t cells, int64_t dim, int64_t groups,
                                                                    int64_t group_size, int64_t rot_half, double eps,
                                                                    EmuPlan* out) {
  const auto plan = hebrus::metal::plan_qsa_pool(cells, dim, groups, group_size, rot_half, eps);
  return fill(plan, &plan.params, sizeof(plan.params), "", out);
}

__attribute__((visibility("default"))) int hebrus_emu_plan_qsa_select(int64_t queries, int64_t query_heads,
                                                                      int64_t dim, int64_t rows, int64_t batch,
                                                                      int64_t max_groups, int64_t top_k,
                                                                      EmuPlan* out) {
  const auto plan = hebrus::metal::plan_qsa_select(queries, query_heads, dim, rows, batch, max_groups, top_k);
  return fill(plan, &plan.params, sizeof(plan.params), plan.variant, out);
}

__attribute__((visibility("default"))) int hebrus_emu_plan_qsa_attention(int64_t queries, int64_t query_heads,
                                                                         int64_t kv_heads, int64_t head_dim,
                                                                         int64_t value_dim, int64_t cells,
                                                                         int64_t width, int64_t k_stride0,
                                                                         int64_t k_stride1, int64_t v_stride0,
                                                                         int64_t v_stride1, double scale, EmuPlan* out) {
  const auto plan = hebrus::metal::plan_qsa_attention(queries, query_heads, kv_heads, head_dim, value_dim, cells,
                                                      width, k_stride0, k_stride1, v_stride0, v_stride1, scale);
  return fill(plan, &plan.params, sizeof(plan.params), plan.variant, out);
}

}
