// The one place every hebrus op schema is declared. Device files only add TORCH_LIBRARY_IMPL blocks.
// Importing hebrus_torch._C (an empty module) runs these static registrars.
#include <Python.h>
#include <torch/library.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(hebrus, m) {
  // PLE (SPEC §2): hashed n-gram row ids with the frozen EOS history rule.
  m.def(
      "ple_ngram_ids(Tensor tokens, Tensor cu_seqlens, Tensor history, Tensor multipliers, "
      "Tensor vocab_sizes, Tensor offsets, int eos, int vocab) -> (Tensor, Tensor)");
  // PLE (SPEC §2): depthwise causal dilated conv over packed rows with carried input tails.
  m.def(
      "ple_conv(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
      "str activation) -> (Tensor, Tensor)");
  // ple_conv into caller-owned buffers y [T, C] and new_state [B, L, C] (not in the SPEC: the
  // out-variant a prefill loop uses to reuse its output memory).
  m.def(
      "ple_conv_into(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
      "str activation, Tensor(a!) y, Tensor(b!) new_state) -> ()");
  // QSA (SPEC §3): pooled, normed, roped key per 4-token group; fails on a hole.
  m.def(
      "qsa_pool(Tensor keys, Tensor cell_pos, Tensor group_cells, Tensor group_pos, "
      "Tensor norm_weight, float eps, Tensor inv_freq) -> Tensor");
  // QSA (SPEC §3): per-query top-k groups, ascending, -1 padded.
  m.def(
      "qsa_select(Tensor q, Tensor pooled, Tensor seq_groups, Tensor q_row, Tensor q_groups, "
      "int top_k) -> Tensor");
  // QSA attention (issue 6): softmax(scale q.k) v per query over exactly its selected cells.
  m.def("qsa_attention(Tensor q, Tensor k, Tensor v, Tensor token_cells, float scale) -> Tensor");
}
