"""The transformers Qwen4Exp drop-in, by concern; :mod:`hebrus_torch.integrations.transformers` is its public face.

- :mod:`.patching`: ``apply`` / ``revert`` / ``is_applied`` (per-instance patches, hooks, validation first)
- :mod:`.ple`: the n-gram hash and the PLE conv forwards
- :mod:`.context`, :mod:`.plan`: the captured rotary positions, each query's visible run and its holes
- :mod:`.groups`: pooled groups kept on the cache layer, pooling and selection
- :mod:`.selection`: a selection as transformers' mask or as kv indices
- :mod:`.indexer`: the indexer forward (eager and torch.compile), its fallbacks
- :mod:`.attention`: attention over the selected cells (hebrus::qsa_attention)
- :mod:`.moe`: the routed experts as one hebrus::moe_experts call
- :mod:`.cuda_graphs`: the decode calls on CUDA (no native kernels) as captured CUDA graphs
- :mod:`.cache_layers`: lifecycle wrappers of transformers' indexed cache layers
- :mod:`.stats`: counters and once-per-cause fallback warnings

The projections, norms, RoPE and output gate it runs as transformers does are the engine's too
(:mod:`hebrus_torch.models.qwen4_exp.attention`).
"""
