"""QSA: the ops (``ops``, ``attention``) and the QSACache holder, one module per concern.

``cache`` (QSACache: construction, the pooling kernel call, device moves) composes ``runs`` (the run
rules: contiguity, window starts, groups + raw tail), ``allocator``, ``pooling``, ``lifecycle``,
``planning`` (ReservedChunk, QSAPlan), ``persistence`` and ``transactions``. Import public names from
``hebrus_torch`` or ``hebrus_torch.qsa.cache``.
"""
