// MPS kernel of hebrus::ple_ngram_ids_slots: glue for mps_kernels/ple_ngram_ids_slots.metal. Every decision (checks,
// kernel, buffers, parameter block, dispatch) is hebrus::glue::ple_ngram_ids_slots (hebrus_glue.h, also run by the Linux
// emulator); this file only encodes it. The kernel updates history_pool in place; value errors (cu_seqlens, slots, ids)
// come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

namespace hebrus::mps {
namespace {

Tensor ple_ngram_ids_slots_mps(const Tensor& tokens, const Tensor& cu_seqlens, Tensor& history_pool, const Tensor& slots,
                               const Tensor& multipliers, const Tensor& vocab_sizes, const Tensor& offsets, int64_t eos,
                               int64_t vocab) {
  const hebrus::glue::Call call = hebrus::glue::ple_ngram_ids_slots(tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes, offsets, eos, vocab, c10::DeviceType::MPS);
  encode("ple_ngram_ids_slots", call);
  return call.outputs[0];
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("ple_ngram_ids_slots", &hebrus::mps::ple_ngram_ids_slots_mps);
}
