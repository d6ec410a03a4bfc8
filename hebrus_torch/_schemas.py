"""The op schemas, mirrored from csrc/library.cpp.

Used only when the compiled extension is absent (a source checkout without a build, an unsupported
platform), so that ``import hebrus_torch`` still works and every op runs its reference kernel.
tests/test_registration.py checks that these strings equal the compiled schemas.
"""

SCHEMAS = {
    "ple_ngram_ids": "ple_ngram_ids(Tensor tokens, Tensor cu_seqlens, Tensor history, Tensor multipliers, "
                     "Tensor vocab_sizes, Tensor offsets, int eos, int vocab) -> (Tensor, Tensor)",
    "ple_conv": "ple_conv(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
                "str activation) -> (Tensor, Tensor)",
    "ple_conv_into": "ple_conv_into(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
                     "str activation, Tensor(a!) y, Tensor(b!) new_state) -> ()",
    "ple_ngram_ids_slots": "ple_ngram_ids_slots(Tensor tokens, Tensor cu_seqlens, Tensor(a!) history_pool, "
                           "Tensor slots, Tensor multipliers, Tensor vocab_sizes, Tensor offsets, int eos, "
                           "int vocab) -> Tensor",
    "ple_conv_slots": "ple_conv_slots(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor(a!) state_pool, "
                      "Tensor slots, int dilation, str activation) -> Tensor",
    "qsa_pool": "qsa_pool(Tensor keys, Tensor cell_pos, Tensor group_cells, Tensor group_pos, "
                "Tensor norm_weight, float eps, Tensor inv_freq) -> Tensor",
    "qsa_select": "qsa_select(Tensor q, Tensor pooled, Tensor seq_groups, Tensor q_row, Tensor q_groups, "
                  "int top_k) -> Tensor",
    "qsa_attention": "qsa_attention(Tensor q, Tensor k, Tensor v, Tensor token_cells, float scale) -> Tensor",
    "gdn_delta_rule": "gdn_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
                      "Tensor(a!) state, float scale, bool use_qk_l2norm) -> Tensor",
    "gdn_delta_rule_slots": "gdn_delta_rule_slots(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
                            "Tensor cu_seqlens, Tensor(a!) state_pool, Tensor slots, float scale, "
                            "bool use_qk_l2norm) -> Tensor",
    "gdn_chunk_delta_rule_slots": "gdn_chunk_delta_rule_slots(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
                                  "Tensor cu_seqlens, Tensor start_pos, Tensor(a!) state_pool, Tensor slots, "
                                  "float scale, bool use_qk_l2norm) -> Tensor",
}
