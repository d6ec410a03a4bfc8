"""Size limits of the native kernels, for Python: what the drop-in checks to fall back instead of raising.

C++ and Metal read the same numbers from ``mps_kernels/hebrus_params.h`` (the ``HEBRUS_*_MAX_*``
defines); ``tests/test_kernel_limits.py`` reads that header and checks it agrees with this module. The
reference implementation (devices without a native kernel) has no such limits.
"""

from __future__ import annotations

CPU_MAX_HEAD_DIM = 256      # qsa_pool, qsa_select: D              (HEBRUS_CPU_MAX_HEAD_DIM)
CPU_MAX_QUERY_HEADS = 64    # qsa_select: Hq                       (HEBRUS_CPU_MAX_QUERY_HEADS)
CPU_MAX_TOP_K = 4096        # qsa_select: top_k                    (HEBRUS_CPU_MAX_TOP_K)
MPS_MAX_KEEP = 2048         # qsa_select: min(top_k, maxG)         (HEBRUS_MPS_MAX_KEEP)
MPS_ATTN_MAX_DIM = 256      # qsa_attention: max(Dh, Dv)           (HEBRUS_MPS_ATTN_MAX_DIM)
MPS_GDN_MAX_KEY_DIM = 256   # gdn_delta_rule(_slots): Dk           (HEBRUS_MPS_GDN_MAX_KEY_DIM)
MPS_GDN_CHUNK_MAX_KEY_DIM = 128   # gdn_chunk_delta_rule_slots: Dk       (HEBRUS_MPS_GDN_CHUNK_MAX_KEY_DIM)

# Per device type: the indexer sizes ("dim": D, "heads": Hq, "top_k") past which qsa_select refuses.
INDEXER_LIMITS: dict[str, dict[str, int]] = {
    "cpu": {"dim": CPU_MAX_HEAD_DIM, "heads": CPU_MAX_QUERY_HEADS, "top_k": CPU_MAX_TOP_K},
    "mps": {"top_k": MPS_MAX_KEEP},
}
# Per device type: the attention head dim past which qsa_attention refuses.
ATTENTION_HEAD_DIM_LIMITS: dict[str, int] = {"mps": MPS_ATTN_MAX_DIM}
