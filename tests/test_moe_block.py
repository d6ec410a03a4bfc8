"""Qwen4Exp's MoE block through hebrus::moe_experts (issue 36): the engine's packed_moe and the drop-in's
patched experts against transformers' own block, and the module path for blocks the op does not cover."""

from __future__ import annotations

import pytest
import torch

from hf_models import modeling as M, random_model  # noqa: E402  (skips without transformers)
from hebrus_torch.integrations import transformers as htx
from hebrus_torch.moe import block


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def calls(monkeypatch):
    """How many times the engine's path called the op."""
    seen = []

    def counting(*args):
        seen.append(args[0].shape[0])
        return real(*args)

    real = block.moe_experts
    monkeypatch.setattr(block, "moe_experts", counting)
    return seen


def mlp_and_rows(dtype=torch.float32, rows=7, seed=0):
    model = random_model(seed, dtype=dtype, num_experts=8, num_experts_per_tok=3)
    mlp = model.model.language_model.layers[0].mlp if hasattr(model.model, "language_model") else \
        model.model.layers[0].mlp
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return model, mlp, x


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_packed_moe_matches_the_block(dtype, calls):
    _, mlp, x = mlp_and_rows(dtype)
    assert type(mlp) is M.Qwen4ExpTextSparseMoeBlock
    with torch.inference_mode():
        want = mlp(x[None])[0]
        got = block.packed_moe(mlp, x)
    assert calls == [7]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_packed_moe_rows_are_batch_independent(calls):
    _, mlp, x = mlp_and_rows(torch.bfloat16, rows=9)
    with torch.inference_mode():
        whole = block.packed_moe(mlp, x)
        for t in (0, 4, 8):
            assert torch.equal(block.packed_moe(mlp, x[t:t + 1])[0], whole[t])


def test_hooked_or_foreign_modules_run_as_module_calls(calls):
    _, mlp, x = mlp_and_rows()
    seen = []
    handle = mlp.experts.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    with torch.inference_mode():
        want = mlp(x[None])[0]
        got = block.packed_moe(mlp, x)
    handle.remove()
    assert calls == [] and len(seen) == 2            # the hook saw both calls: the module path ran
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

    class UserExperts(M.Qwen4ExpTextExperts):     # a user's own experts module (e.g. a quantized one)
        pass

    user = UserExperts(mlp.experts.config)
    user.load_state_dict(mlp.experts.state_dict())
    mlp.experts = user
    with torch.inference_mode():
        torch.testing.assert_close(block.packed_moe(mlp, x), want, atol=1e-6, rtol=1e-6)
    assert calls == []
    assert block.experts_unsupported(user, x) == "not_transformers_experts"


def test_unsupported_reasons():
    _, mlp, x = mlp_and_rows()
    experts = mlp.experts
    assert block.experts_unsupported(experts, x) == "autograd"          # its parameters require grad
    with torch.no_grad():
        assert block.experts_unsupported(experts, x) is None
        assert block.experts_unsupported(experts, x.double()) == "dtype"
        experts.has_bias = True
        assert block.experts_unsupported(experts, x) == "expert_layout"


def test_dropin_runs_the_op_and_reverts():
    model = random_model(2)
    ids = torch.randint(4, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    htx.revert(model)
    with torch.no_grad():
        ref = model(ids).logits
    htx.apply(model)
    htx.reset_stats()
    try:
        with torch.no_grad():
            got = model(ids).logits
        stats = htx.stats()
    finally:
        htx.revert(model)
    layers = model.config.num_hidden_layers
    assert stats.get("moe_experts_calls") == layers, stats
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    experts = [m for m in model.modules() if type(m) is M.Qwen4ExpTextExperts]
    assert experts and all("forward" not in m.__dict__ for m in experts)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_dropin_under_autograd_runs_transformers():
    model = random_model(3)
    ids = torch.randint(4, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    htx.apply(model)
    htx.reset_stats()
    try:
        model(ids).logits.sum().backward()
        stats = htx.stats()
    finally:
        htx.revert(model)
    assert "moe_experts_calls" not in stats and stats.get("moe_experts_skipped:autograd", 0) > 0, stats
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts.gate_up_proj" in n)


def test_engine_runs_every_moe_layer_through_the_op(calls):
    """The engine's packed forward: one op call per MoE layer and step, greedy tokens as transformers'."""
    from hebrus_torch.engine import Engine, EngineConfig

    model = random_model(4)
    prompt = [5, 9, 14, 22, 7, 30, 11, 8, 41, 17, 12, 6, 19, 27]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    # (native_layers=False: the native decoder layers call the op from C++, past the counting wrapper; their tokens
    # are checked too)
    for native in (False, True):
        engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=8, block_size=4,
                                            native_layers=native))
        engine.add_request(prompt, request_id="a", max_new_tokens=5)
        engine.run()
        assert engine.requests["a"].generated == want
        if not native:
            layers = model.config.num_hidden_layers
            assert len(calls) % layers == 0 and len(calls) >= layers * 6    # 2 prefill chunks + 4 decode steps


def test_emulated_mps_step_has_one_moe_dispatch_per_layer_and_no_sync():
    """On (emulated) MPS a MoE layer is the router, the shared expert and one hebrus::moe_experts dispatch:
    no host wait, and the same dispatches whatever the experts hit (transformers' grouped_mm path reads the
    group offsets on the host and runs one mm per expert hit)."""
    from hebrus_torch._emulate import emulate
    from hebrus_torch.engine import Engine, EngineConfig
    from hebrus_torch.engine.step_counts import PARTS, count_step

    model = random_model(5)
    layers = model.config.num_hidden_layers
    moe = PARTS["moe"]
    with emulate("mps") as dev:
        engine = Engine(model.to(dev), EngineConfig(capacity_tokens=256, max_sequences=4, max_batch_tokens=64,
                                                    block_size=4))
        for i, prompt in enumerate(([5, 9, 14, 22, 7, 30], [11, 8, 41], [17, 12, 6, 19, 27, 33, 40])):
            engine.add_request(prompt, request_id=str(i), max_new_tokens=4)
        steps = [count_step(engine) for _ in range(3)]             # the prefill, then two decode steps
    for counts in steps:
        ops = counts.ops[moe]
        assert ops["hebrus.moe_experts"] == layers, (dict(ops), counts.fallbacks)
        assert not any("grouped_mm" in name for name in ops), dict(ops)
        assert not any(part == moe for part, _what, _site in counts.sync_sites), counts.sync_sites
        assert counts.fallbacks[(moe, "moe_experts")] == 0
    assert steps[1].ops[moe] == steps[2].ops[moe]                   # decode: other experts, same dispatches
