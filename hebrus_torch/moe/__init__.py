"""The routed experts of a MoE block as one op (issue 36): ``checks`` (metadata checks shared by the fake and
the reference), ``ops`` (the typed wrapper :func:`moe_experts` and its fake impl, imported by
``hebrus_torch``), ``block`` (a transformers Qwen4Exp MoE block over packed rows through the op)."""
