"""Models' forwards over a ``ModelCache``: the layer math of each model family the engine runs, in one place.

- :mod:`.qwen4_exp`: Qwen4Exp (PLE, gated delta net, indexed attention with its indexer, MoE, hyper-connections)
"""
