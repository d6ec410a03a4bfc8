"""Pure-PyTorch reference implementations of every hebrus op: the executable form of SPEC.md.

They run on any device, are vectorised over tokens, queries and sequences (the only Python loops
are over sequences or fixed-size query blocks, never over tokens; qsa_select's scores also loop
over the 16-dim chunks of D and over the heads, to fix their summation order), and are registered
as the kernel of every device that has no native one (``hebrus_torch._op_registry``). fp32
accumulation throughout.

One module per op family; every name is re-exported here (``from hebrus_torch import reference``,
``reference.qsa_select(...)``):

- :mod:`.checks`: the value checks they share (raise at once on CPU, device-side asserts elsewhere);
- :mod:`.ple`: ``ple_ngram_ids``, ``ple_conv``, ``ple_conv_into`` and the PLE slot forms;
- :mod:`.uniform_rows`: the drop-in's fast paths of the PLE ops on rows of equal length (not ops);
- :mod:`.qsa`: ``qsa_pool``, ``qsa_select`` and its fixed-order scores, ``qsa_token_cells`` and
  ``qsa_plan_one_row`` and ``qsa_claim_cells`` (the host's selection rows of a one-row chunk, a chunk's cells
  taken at the allocator's head) (issue 37);
- :mod:`.attention`: ``qsa_attention``, ``rms_norm_rope`` and ``sigmoid_gate`` (issue 37);
- :mod:`.gdn`: ``gdn_delta_rule``, its slot form and the chunked slot form; the fused gates and output
  norm ``gdn_gates``, ``gdn_gated_rms_norm`` (issue 37);
- :mod:`.moe`: ``moe_experts`` (the routed experts of a MoE block) and ``moe_experts_quantized``, ``quantized_linear``,
  ``moe_route`` (the block's router after its linear and the shared expert's gate), ``moe_shared_expert``
  (the shared expert added to the routed output) and ``moe_shared_expert_quantized`` (the same over quantized
  projections): issue 37;
- :mod:`.hc`: ``hc_rms_norm`` (Qwen4Exp's grouped RMSNorm), ``hc_premix`` (``hc_premix_quantized`` with its
  projections quantized) and ``hc_post_combine`` (the hyper-connections' pre-mix and post-combine), fused: issue 37;
- :mod:`.decode`: ``decode_gdn_layer``, ``decode_moe_tail``, ``decode_attention_head``, ``decode_attention_tail``,
  ``decode_attention_layer`` and ``decode_ple_gate``, the native decoder-layer calls as the ops they are made of,
  and ``dense_projection``, one of their projections (issue 37).
"""

from .attention import check_token_cells_values, qsa_attention, rms_norm_rope, sigmoid_gate
from .checks import assert_values, check_cu_seqlens_values, check_slot_values, checks_async
from .decode import (decode_attention_head, decode_attention_layer, decode_attention_tail, decode_gdn_layer,
                     decode_moe_tail, decode_ple_gate, dense_projection)
from .gdn import gdn_chunk_delta_rule_slots, gdn_delta_rule, gdn_delta_rule_slots, gdn_gated_rms_norm, gdn_gates
from .hc import hc_post_combine, hc_premix, hc_premix_quantized, hc_rms_norm
from .moe import (moe_experts, moe_experts_quantized, moe_route, moe_shared_expert, moe_shared_expert_quantized,
                  quantized_linear)
from .ple import (_silu, ple_conv, ple_conv_into, ple_conv_into_via, ple_conv_slots, ple_ngram_ids,
                  ple_ngram_ids_slots)
from .qsa import (_qsa_select_all, check_groups_contiguous, qsa_claim_cells, qsa_plan_one_row, qsa_pool, qsa_scores,
                  qsa_select, qsa_token_cells, rotate_half)
from .uniform_rows import ple_conv_rows, ple_ngram_ids_rows

__all__ = ["ple_ngram_ids", "ple_conv", "ple_conv_into", "ple_ngram_ids_slots", "ple_conv_slots", "qsa_pool",
           "qsa_select", "qsa_attention", "gdn_delta_rule", "gdn_delta_rule_slots", "gdn_chunk_delta_rule_slots",
           "moe_experts", "moe_experts_quantized", "quantized_linear", "check_cu_seqlens_values", "check_slot_values", "checks_async", "assert_values",
           "check_groups_contiguous", "check_token_cells_values", "ple_conv_into_via", "ple_conv_rows",
           "ple_ngram_ids_rows", "qsa_scores", "rotate_half", "hc_rms_norm", "gdn_gates",
           "gdn_gated_rms_norm", "hc_premix", "hc_premix_quantized", "hc_post_combine", "qsa_token_cells",
           "qsa_plan_one_row", "qsa_claim_cells", "rms_norm_rope",
           "sigmoid_gate", "moe_route",
           "moe_shared_expert", "moe_shared_expert_quantized", "decode_moe_tail", "decode_gdn_layer",
           "decode_attention_head", "decode_attention_tail", "decode_attention_layer", "decode_ple_gate",
           "dense_projection"]

# (_silu and _qsa_select_all: private, re-exported for the tests and benchmarks that call them as
# reference._silu / reference._qsa_select_all.)
