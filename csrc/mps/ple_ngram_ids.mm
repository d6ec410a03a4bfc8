// MPS kernel of hebrus::ple_ngram_ids: glue for mps_kernels/ple_ngram_ids.metal. Every decision (checks, kernel, buffers,
// parameter block, dispatch) is hebrus::glue::ple_ngram_ids (hebrus_glue.h, also run by the Linux emulator);
// this file only encodes it. Value errors come back asynchronously through PyTorch's MPS error buffer.
#include "hebrus_glue.h"
#include "hebrus_mps.h"

#include <torch/library.h>

#include <tuple>

namespace hebrus::mps {
namespace {

std::tuple<Tensor, Tensor> ple_ngram_ids_mps(const Tensor& tokens, const Tensor& cu_seqlens, const Tensor& history,
                                             const Tensor& multipliers, const Tensor& vocab_sizes, const Tensor& offsets,
                                             int64_t eos, int64_t vocab) {
  const hebrus::glue::Call call = hebrus::glue::ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab, c10::DeviceType::MPS);
  encode("ple_ngram_ids", call);
  return {call.outputs[0], call.outputs[1]};
}

}  // namespace
}  // namespace hebrus::mps

TORCH_LIBRARY_IMPL(hebrus, MPS, m) {
  m.impl("ple_ngram_ids", &hebrus::mps::ple_ngram_ids_mps);
}
