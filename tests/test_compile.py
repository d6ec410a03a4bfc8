"""The runner's layer math stays ``torch.compile``-friendly (issue 37): one decoder layer's packed forward
(:func:`hebrus_torch.models.qwen4_exp.forward.packed_decoder_layer`: hyper-connections, the GDN through
``hebrus::ple_conv_slots`` and ``hebrus::gdn_delta_rule_slots`` on explicit state pools, the MoE through
``hebrus::moe_experts``) compiles with ``fullgraph=True`` on CPU (a graph break is an error there) and gives
the eager outputs and state. ``aot_eager`` runs dynamo, the ops' fake kernels and functionalization of the
in-place state ops without a C++ toolchain; the timing of inductor's code is benchmarks/bench_compile.py's."""

from __future__ import annotations

import pytest
import torch

from hf_models import random_model  # noqa: E402  (skips without transformers)

from bench_compile import gdn_layer_step, state_pools  # noqa: E402  (benchmarks/, on the path via hf_models)

from hebrus_torch.models.qwen4_exp.forward import packed_decoder_layer


@pytest.fixture(scope="module")
def model():
    return random_model(3)


@pytest.mark.parametrize("rows", [[1], [3, 1, 2]], ids=["decode", "mixed"])
def test_one_layer_compiles_whole_and_matches_eager(model, rows):
    layer = next(m for m in model.model.layers if m.layer_type == "linear_attention")
    gen = torch.Generator().manual_seed(len(rows) * 7 + sum(rows))
    cu = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32)
    slots = torch.tensor([2 * i + 1 for i in range(len(rows))], dtype=torch.int32)
    hc, hidden = model.config.hc_count, model.config.hidden_size
    h = torch.randn((sum(rows), hc * hidden), generator=gen)
    conv, rec = state_pools(layer, 2 * len(rows) + 2, gen)
    step = gdn_layer_step(layer, cu, slots)
    eager_pools = conv.clone(), rec.clone()
    compiled_pools = conv.clone(), rec.clone()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = step(h, *eager_pools)
            got = torch.compile(step, fullgraph=True, backend="aot_eager")(h, *compiled_pools)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(compiled_pools, eager_pools):       # the in-place state ops ran once, with the same effect
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(eager_pools[1], rec)        # (the step did update the state)


def test_a_graph_break_fails_fullgraph(model):
    """The check above can fail: a Python decision on a tensor's value inside the layer breaks the graph, and
    fullgraph=True refuses it."""
    layer = next(m for m in model.model.layers if m.layer_type == "linear_attention")
    gen = torch.Generator().manual_seed(1)
    h = torch.randn((1, model.config.hc_count * model.config.hidden_size), generator=gen)

    def step(h):
        out = packed_decoder_layer(layer, h, lambda x: x * 2 if bool(x.sum() > 0) else x, "mixer")
        return out

    torch._dynamo.reset()
    try:
        with torch.no_grad(), pytest.raises(Exception, match="(?i)graph break|data-dependent|unsupported"):
            torch.compile(step, fullgraph=True, backend="aot_eager")(h)
    finally:
        torch._dynamo.reset()
