// MPS kernel of hebrus::ple_ngram_ids (SPEC section 2): glue for mps_kernels/ple_ngram_ids.metal.
// Metadata checks as the CPU kernel; values (cu_seqlens, token and history ids, vocab sizes) are
// checked by the kernel and raised here, in the CPU kernel's order, after the launch.
#include "hebrus_mps.h"
#include "op_checks.h"

#include <torch/library.h>

#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> ple_ngram_ids_mps(const Tensor& tokens_in, const Tensor& cu_in, const Tensor& history_in,
                                             const Tensor& multipliers_in, const Tensor& vocab_sizes_in,
                                             const Tensor& offsets_in, int64_t eos, int64_t vocab) {
  const char* op = "ple_ngram_ids";
  check_on_mps(op, {{"tokens", &tokens_in}, {"cu_seqlens", &cu_in}, {"history", &history_in},
                    {"multipliers", &multipliers_in}, {"vocab_sizes", &vocab_sizes_in}, {"offsets", &offsets_in}});
  const PleNgramIdsSizes sz =
      check_ple_ngram_ids_args(tokens_in, cu_in, history_in, multipliers_in, vocab_sizes_in, offsets_in, eos, vocab);
  const int64_t batch = sz.batch, n = sz.n, ctx = sz.ctx, heads = sz.heads, total = sz.total;

  if (batch == 0) {  // no row threads: check cu_seqlens here (T must be 0)
    check_cu_values(op, cu_in, total);
    return {at::empty({0, heads}, tokens_in.options()), history_in.clone(at::MemoryFormat::Contiguous)};
  }
  const auto plan = hebrus::metal::plan_ple_ngram_ids(total, batch, n, heads, eos, vocab);
  check_plan(op, plan.error);

  const Tensor tokens = tokens_in.contiguous(), cu = cu_in.contiguous(), history = history_in.contiguous();
  const Tensor multipliers = multipliers_in.contiguous(), vocab_sizes = vocab_sizes_in.contiguous();
  const Tensor offsets = offsets_in.contiguous();
  Tensor row_ids = at::empty({total, heads}, tokens.options());
  Tensor new_history = at::empty_like(history);
  Tensor err = error_slots(tokens);
  const auto fn = kernel(op, "ple_ngram_ids", hebrus::metal::kernel_name(op, "", "long"), plan.dispatch.group);
  launch(fn, {&tokens, &cu, &history, &multipliers, &vocab_sizes, &offsets, &row_ids, &new_history, &err},
         plan.params, plan.dispatch);

  const ErrorSlots e = read_error_slots(err);
  if (e.any()) {
    if (e.index[HEBRUS_ERR_NGRAM_CU_ROW] >= 0) {
      check_cu_values(op, cu, total);
      TORCH_INTERNAL_ASSERT(false, "hebrus::ple_ngram_ids: the kernel rejected cu_seqlens the host check accepts");
    }
    if (const int64_t t = e.index[HEBRUS_ERR_NGRAM_TOKEN]; t >= 0) {
      HEBRUS_CHECK(false, HebrusError, "hebrus::", op, ": tokens[", t, "] = ", tokens[t].item<int64_t>(),
                   " is outside [0, vocab=", vocab, ")");
    }
    if (const int64_t i = e.index[HEBRUS_ERR_NGRAM_HISTORY]; i >= 0) {
      HEBRUS_CHECK(false, HebrusError, "hebrus::", op, ": history[", i / ctx, ", ", i % ctx, "] = ",
                   history[i / ctx][i % ctx].item<int64_t>(), " is outside [0, vocab=", vocab, ") and is not eos");
    }
    const int64_t h = e.index[HEBRUS_ERR_NGRAM_VOCAB_SIZE];
    HEBRUS_CHECK(false, HebrusError, "hebrus::", op, ": vocab_sizes[", h, "] must be positive, got ",
                 vocab_sizes[h].item<int64_t>());
  }
  return {row_ids, new_history};
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("ple_ngram_ids", &hebrus::mps::ple_ngram_ids_mps);
}
