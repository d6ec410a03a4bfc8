"""Continuous batching on the state holders (SPEC §8): the engine against per-prompt ``generate``.

Model-level invariants run on random tiny Qwen4Exp configs of several shapes, fp32:
- greedy tokens equal ``model.generate`` on each prompt alone (unpatched and patched), for prompts
  shorter and longer than the indexer budget and with EOS inside prompts; logits within fp32 tolerance;
- with row-invariant dense layers (SPEC §8's BLAS caveat), the same requests under every token budget,
  request cap, arrival order and with prefix sharing on and off give the same tokens and, after each
  prompt, bitwise the same hebrus-owned state (``digest(seq)`` of every holder);
- a fault injected at any step rolls it back bitwise and the engine then completes every request with
  the tokens it would have produced; bad requests fail alone; cancelling frees capacity exactly.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from hf_models import modeling, tiny_indexer_config  # noqa: E402  (skips without transformers)

import hebrus_torch as ht
from hebrus_torch.hc import premix as hc_premix_module
from hebrus_torch.moe import block as moe_block_module
from hebrus_torch.models.qwen4_exp.native import NativeLayers
from hebrus_torch.engine import BadRequestError, Engine, EngineConfig, RequestStatus, SamplingParams

EOS = 3
BUDGET = 8          # indexer_budget of the tiny configs: prompts over 8 + r - 1 = 11 tokens really select

SHAPES = {
    "lin-idx": dict(),
    "idx-lin-idx-lin": dict(layer_types=["indexed_attention", "linear_attention", "indexed_attention",
                                         "linear_attention"], num_hidden_layers=4, ple_layer_ids=[2, 4],
                            hc_count=3, num_attention_heads=4, num_key_value_heads=2),
    "lin-lin-idx": dict(layer_types=["linear_attention", "linear_attention", "indexed_attention"],
                        num_hidden_layers=3, ple_layer_ids=[1, 2], linear_num_key_heads=1,
                        linear_num_value_heads=2, partial_rotary_factor=0.5),
}


def make_model(shape: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    overrides = dict(SHAPES[shape])
    if "partial_rotary_factor" in overrides:
        overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": overrides.pop("partial_rotary_factor")}
    model = modeling.Qwen4ExpForCausalLM(tiny_indexer_config(**overrides)).eval()
    with torch.no_grad():  # transformers zero-initialises norms and the PLE conv: give every path a say
        for name, p in model.named_parameters():
            if "conv1d" in name or "norm" in name:
                p.normal_(0, 0.3)
    return model


def eager_experts(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' eager MoE (per-expert ``F.linear``, which ``row_invariant`` makes row-wise) instead of
    its grouped/batched matmuls, whose rows depend on how many tokens an expert got."""
    model.set_experts_implementation("eager")
    return model


def prompts_for(seed: int, lengths=(3, 9, 17, 30, 1, 12)) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        p = [rng.randrange(4, 50) for _ in range(n)]
        if n > 6:
            p[n // 2] = EOS       # an EOS inside the prompt
        out.append(p)
    return out


def reference_tokens(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    gen = out[0, len(prompt):].tolist()
    if EOS in gen:
        gen = gen[:gen.index(EOS) + 1]
    return gen


def run_engine(model, prompts, max_new_tokens=6, order=None, **config) -> tuple[dict, dict]:
    cfg = dict(capacity_tokens=1024, max_sequences=8, max_batch_tokens=16, block_size=4)
    cfg.update(config)
    engine = Engine(model, EngineConfig(**cfg))
    states = {}
    engine.on_prompt_done = lambda req: states.__setitem__(
        req.request_id, tuple(h.digest(req.seq) for h in engine.cache.holders))
    order = order if order is not None else range(len(prompts))
    for i in order:
        engine.add_request(prompts[i], request_id=f"r{i}", max_new_tokens=max_new_tokens, eos_token_id=EOS)
    try:
        engine.run()
    finally:
        engine.close()          # (its PLE prefetch worker, where it has one, stops here, not at collection)
    tokens = {rid: req.generated for rid, req in engine.requests.items()}
    assert all(req.status is RequestStatus.FINISHED for req in engine.requests.values())
    return tokens, states


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


@pytest.fixture
def row_invariant(monkeypatch):
    """Every dense layer (and the fused hyper-connection pre-mix and shared expert, whose CPU kernels call ATen's
    mm) computes each row on its own, so no output row depends on how many rows share the call (SPEC §8: BLAS
    picks its kernel by the row count); so do the activations whose CPU
    kernels give other bits to an element by where it sits in a vector (sigmoid, SiLU, softplus:
    vectorised body and scalar tail differ). Models used with it run their experts eagerly
    (``eager_experts``): one ``F.linear`` per expert over the tokens routed to it."""
    linear = torch.nn.functional.linear

    def rowwise(x, weight, bias=None):
        if x.dim() == 0 or x.numel() == 0:
            return linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        rows = [linear(flat[i:i + 1], weight, bias) for i in range(flat.shape[0])]
        return torch.cat(rows).reshape(*x.shape[:-1], -1)

    def rowwise_unary(fn):
        def apply(x, *args, **kwargs):
            kwargs.pop("inplace", None)
            if x.dim() == 0 or x.numel() == 0:
                return fn(x, *args, **kwargs)
            flat = x.reshape(-1, x.shape[-1])
            return torch.cat([fn(flat[i:i + 1].clone(), *args, **kwargs) for i in range(flat.shape[0])]
                             ).reshape(x.shape)
        return apply

    # The native decoder layers call ATen's linear and the hebrus ops from C++, past these patches: off here (the
    # native path's own bits are the Python path's: tests/test_native_layers.py).
    monkeypatch.setattr(NativeLayers, "calls", lambda self, h: None)
    monkeypatch.setattr(torch.nn.functional, "linear", rowwise)
    for owner, name in ((torch, "sigmoid"), (torch.nn.functional, "sigmoid"), (torch.nn.functional, "silu"),
                        (torch.nn.functional, "softplus"), (torch.Tensor, "sigmoid")):
        monkeypatch.setattr(owner, name, rowwise_unary(getattr(owner, name)))
    # The fused hyper-connection pre-mixes and the MoE's fused shared expert run their projections inside their CPU
    # kernels (ATen's mm or quantized_linear): they are run row by row here, as F.linear is. Their norms, gates and
    # activations, and those of the other fused ops (gdn_gates, gdn_gated_rms_norm, rms_norm_rope, sigmoid_gate, the
    # shared gate of moe_route), are hebrus's own row arithmetic, row-invariant by construction: those run as they
    # are, so these tests check that too.
    # (owner, op, the positions of its per-row arguments: h; x, routed and the gate)
    for owner, name, per_row in ((hc_premix_module, "hc_premix", (0,)), (hc_premix_module, "hc_premix_quantized", (0,)),
                                 (moe_block_module, "moe_shared_expert", (0, 1, 5)),
                                 (moe_block_module, "moe_shared_expert_quantized", (0, 1, 11))):
        fused = getattr(owner, name)

        def fused_rowwise(*args, _fused=fused, _per_row=per_row):
            x = args[0]
            if x.dim() != 2 or x.shape[0] <= 1:
                return _fused(*args)
            rows = [_fused(*(a[r:r + 1] if i in _per_row else a for i, a in enumerate(args)))
                    for r in range(x.shape[0])]
            if isinstance(rows[0], tuple):
                return tuple(torch.cat(parts) for parts in zip(*rows))
            return torch.cat(rows)

        monkeypatch.setattr(owner, name, fused_rowwise)


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_tokens_equal_generate_on_each_prompt_alone(shape):
    model = make_model(shape)
    prompts = prompts_for(1)
    tokens, _ = run_engine(model, prompts)
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == reference_tokens(model, p, 6), (shape, i, len(p))


def test_greedy_tokens_equal_patched_generate():
    model = make_model("lin-idx", seed=2)
    prompts = prompts_for(2)
    from hebrus_torch.integrations import transformers as htx
    htx.apply(model)
    try:
        tokens, _ = run_engine(model, prompts, max_batch_tokens=7)
        for i, p in enumerate(prompts):
            assert tokens[f"r{i}"] == reference_tokens(model, p, 6)
    finally:
        htx.revert(model)


def test_engine_on_device_equals_generate_there(device):
    """The engine with the model on ``device`` (cpu here; mps on the macOS workflow, where the hebrus
    ops run their Metal kernels): greedy tokens equal ``generate`` on that device, prompt by prompt,
    with one mixed step's logits checked against the model's own forward there."""
    from transformers import DynamicCache

    model = make_model("idx-lin-idx-lin", seed=5).to(device)
    prompts = prompts_for(5)
    engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=4, max_batch_tokens=7, block_size=4))
    seqs = [engine.cache.new_sequence() for _ in range(2)]
    logits = engine.runner.execute(seqs, [prompts[3][:13], prompts[2]], [True, True], [0, 0])
    assert logits.device.type == device
    for row, p in zip(logits, (prompts[3][:13], prompts[2])):
        ref = model(torch.tensor([p], device=device), past_key_values=DynamicCache(config=model.config)).logits[0, -1]
        torch.testing.assert_close(row, ref.float(), atol=1e-4, rtol=1e-4)
    for s in seqs:
        engine.cache.free(s)
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=5, eos_token_id=EOS)
    engine.run()
    for i, p in enumerate(prompts):
        out = model.generate(torch.tensor([p], device=device), max_new_tokens=5, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
        want = out[0, len(p):].tolist()
        want = want[:want.index(EOS) + 1] if EOS in want else want
        assert engine.requests[f"r{i}"].generated == want, (device, i, len(p))


@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin"])
def test_packed_step_logits_match_the_models_forward(shape):
    """One packed step mixing a prefill chunk, a first chunk and decodes vs each sequence's own forward."""
    from transformers import DynamicCache

    model = make_model(shape, seed=3)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, max_batch_tokens=None))
    prompts = prompts_for(3, lengths=(20, 5, 13))
    seqs = [engine.cache.new_sequence() for _ in prompts]
    # Step 1: the first 9 / 5 / 9 tokens; step 2: the rest of the first and third, one more of the second.
    first = [p[:9] for p in prompts]
    engine.runner.execute(seqs, first, [False] * 3, [0, 0, 0])
    nxt = [prompts[0][9:], [7], prompts[2][9:]]
    logits = engine.runner.execute(seqs, nxt, [True] * 3, [len(f) for f in first])
    for i, (a, b) in enumerate(zip(first, nxt)):
        ref = model(torch.tensor([a + b]), past_key_values=DynamicCache(config=model.config)).logits[0, -1]
        torch.testing.assert_close(logits[i], ref.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_step_logits_equal_the_forward_within_1e_6_once_indexer_ties_break_alike(shape, monkeypatch):
    """The near-tie drift of issue 28 (engine vs the model's forward on a 16-token context: up to 1.0e-3 here,
    5.3e-4 in the issue) is the indexer's exact score ties, nothing else: ``relu`` makes every group whose
    dot products are all negative score exactly 0, and the hebrus selection breaks ties by the lower group
    index (SPEC §3, kept deliberately: deterministic across devices and shapes) where transformers'
    ``scores.topk`` takes, on this CPU, the higher ones. With transformers' top-k made to break ties the
    same way, the engine's logits are the forward's within 1e-6 (measured: at most 3.7e-8, the PLE conv's
    and the GDN recurrence's rounding); a larger gap with transformers' own top-k only where it saw a tie."""
    from transformers import DynamicCache

    topk = torch.Tensor.topk
    ties = []

    def lower_index_topk(self, k, dim=-1, largest=True, sorted=True):
        if self.dim() != 1 or not largest:
            return topk(self, k, dim, largest, sorted)
        values, indices = torch.sort(self, descending=True, stable=True)
        return torch.return_types.topk((values[:k], indices[:k]))

    def watching_topk(self, k, dim=-1, largest=True, sorted=True):
        if self.dim() == 1 and self.numel() > k:
            top = topk(self, k + 1).values
            ties.append(bool(top[k - 1] == top[k]))
        return topk(self, k, dim, largest, sorted)

    def forward(model, prompt, method):
        monkeypatch.setattr(torch.Tensor, "topk", method)
        try:
            with torch.no_grad():
                return model(torch.tensor([prompt]), past_key_values=DynamicCache(config=model.config)).logits[0, -1]
        finally:
            monkeypatch.setattr(torch.Tensor, "topk", topk)

    for seed in range(6):
        model = make_model(shape, seed=seed)
        rng = random.Random(seed)
        for n in (16, 30):
            prompt = [rng.randrange(4, 50) for _ in range(n)]
            engine = Engine(model, EngineConfig(capacity_tokens=64, max_sequences=2))
            logits = engine.runner.execute([engine.cache.new_sequence()], [prompt], [True], [0])[0]
            aligned = forward(model, prompt, lower_index_topk)
            assert (logits - aligned).abs().max().item() <= 1e-6, (shape, seed, n)
            ties.clear()
            own = forward(model, prompt, watching_topk)
            if (logits - own).abs().max().item() > 1e-6:
                assert any(ties), (shape, seed, n)


# ------------------------------------------------------------------------------------------ invariance
@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin"])
def test_tokens_and_state_after_prompt_do_not_depend_on_cut_cap_order_or_sharing(shape, row_invariant):
    model = eager_experts(make_model(shape, seed=4))
    base = prompts_for(4, lengths=(14, 6, 21, 2))
    shared = base[2][:12]
    prompts = base + [shared + [9, 8, 7], shared + [9, 8, 7, 6, 5]]   # two that share 12 tokens (3 blocks)
    ref_tokens, ref_states = run_engine(model, prompts, max_batch_tokens=None, allow_block_sharing=False)
    settings = [dict(max_batch_tokens=1), dict(max_batch_tokens=7), dict(max_batch_tokens=16),
                dict(max_batch_tokens=64), dict(max_batch_tokens=7, max_requests_per_batch=2),
                dict(max_batch_tokens=16, order=[5, 3, 1, 0, 4, 2]), dict(max_batch_tokens=7, allow_block_sharing=True)]
    for s in settings:
        tokens, states = run_engine(model, prompts, **s)
        assert tokens == ref_tokens, s
        assert states == ref_states, s


def test_prefix_sharing_prefills_the_shared_part_once(row_invariant):
    model = eager_experts(make_model("lin-idx", seed=5))
    shared = prompts_for(5, lengths=(16,))[0]
    prompts = [shared + [10 + i, 20 + i, 30] for i in range(4)]
    on = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=8, max_batch_tokens=64, block_size=4))
    off = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=8, max_batch_tokens=64, block_size=4,
                                     allow_block_sharing=False))
    for engine in (on, off):
        for i, p in enumerate(prompts):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=4, eos_token_id=-1)
        engine.run()
    assert {r: q.generated for r, q in on.requests.items()} == {r: q.generated for r, q in off.requests.items()}
    assert off.counters.prefill_tokens == sum(len(p) for p in prompts)
    assert on.counters.prefix_hit_tokens == 3 * 16
    assert on.counters.prefill_tokens == 16 + sum(len(p) - 16 for p in prompts)


def test_a_one_token_difference_is_never_shared():
    model = make_model("lin-idx", seed=6)
    a = prompts_for(6, lengths=(16,))[0]
    b = list(a)
    b[13] = (b[13] + 1) % 46 + 4
    engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=4, max_batch_tokens=64, block_size=4))
    engine.add_request(a, request_id="a", max_new_tokens=2, eos_token_id=-1)
    engine.run()
    engine.add_request(a + [5], request_id="a2", max_new_tokens=2, eos_token_id=-1)  # a is freed: nothing kept
    engine.add_request(b + [5], request_id="b", max_new_tokens=2, eos_token_id=-1)
    engine.run()
    assert engine.requests["b"].prefix_hit_tokens <= 12
    assert engine.requests["b"].generated == reference_tokens(model, b + [5], 2)[:2]


# ------------------------------------------------------------------------------------------ faults
def inject_fault(engine: Engine, target: str, k: int, monkeypatch) -> dict:
    """Make the k-th call of ``target`` raise: a holder operation ("ple_conv", "qsa_select", "delta_rule"), the PLE
    conv after its op wrote the tails ("ple_conv_written"), a native GDN layer after it wrote its pools
    ("native_gdn_layer"), a native indexed-attention layer bound ahead after it wrote the QSA cache's planes
    ("native_attention_layer"), or the cache's bookkeeping of the step's indexed layers once it is written (settled
    before the first layer: "native_attention_settled"), or the engine's step hook ("hook"); every execute that fails
    must leave the cache's digest as it was (rolled back bitwise). Returns the call counter ``{"n": calls so far}``."""
    calls = {"n": 0}

    def fault(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == k:
            raise RuntimeError(f"injected fault at call {k}")

    if target == "hook":
        engine._fault_hook = lambda plan: fault()
    elif target == "native_attention_settled":
        # after the cache's bookkeeping of the step's indexed layers (its flag writes, by range where the chunk's cells
        # were taken at the head, are undone too)
        qsa = engine.cache.qsa
        settle = qsa.settle_step_plan

        def faulty_settle(plan, layers, _orig=settle):
            out = _orig(plan, layers)
            fault()
            return out
        monkeypatch.setattr(qsa, "settle_step_plan", faulty_settle)
    elif target in ("native_gdn_layer", "native_attention_layer"):
        # in the layer's call bound by ChunkStep.gdn_layer_call / qsa_layer_call, after hebrus::decode_gdn_layer wrote
        # the pools / hebrus::decode_attention_layer wrote the QSA cache's planes (its bookkeeping already settled)
        from hebrus_torch.model_cache import ChunkStep

        name = "gdn_layer_call" if target == "native_gdn_layer" else "qsa_layer_call"
        original = getattr(ChunkStep, name)

        def faulty_call(step, *args, _orig=original):
            bound = _orig(step, *args)
            if bound is not None:
                op = bound.op

                def failing(*args):
                    out = op(*args)
                    fault()
                    return out
                bound.op = failing
            return bound
        monkeypatch.setattr(ChunkStep, name, faulty_call)
    elif target in ("ple_conv", "ple_conv_written"):
        # the PLE conv, made in the layer (PLEState.conv) or ahead of the first layer (PLEState.conv_call): before its
        # op, or after the op wrote the tails
        ple = engine.cache.ple
        conv, conv_call = ple.conv, ple.conv_call

        def faulty(op):
            def call(*args, **kwargs):
                if target == "ple_conv":
                    fault()
                    return op(*args, **kwargs)
                out = op(*args, **kwargs)
                fault()
                return out
            return call

        def faulty_call(*args, **kwargs):
            made = conv_call(*args, **kwargs)
            return None if made is None else faulty(made)
        monkeypatch.setattr(ple, "conv", faulty(conv))
        monkeypatch.setattr(ple, "conv_call", faulty_call)
    else:
        holder = {"qsa_select": engine.cache.qsa, "delta_rule": engine.cache.gdn}[target]
        name = {"qsa_select": "plan", "delta_rule": "delta_rule"}[target]
        original = getattr(holder, name)

        def faulty(*args, _orig=original, **kwargs):
            fault()
            return _orig(*args, **kwargs)
        monkeypatch.setattr(holder, name, faulty)
    execute = engine.runner.execute

    def checked(*args, _exec=execute):
        before = engine.cache.digest()
        try:
            return _exec(*args)
        except RuntimeError:
            assert engine.cache.digest() == before      # rolled back bitwise
            raise
    engine.runner.execute = checked
    return calls


@pytest.mark.parametrize("target", ["ple_conv", "ple_conv_written", "qsa_select", "delta_rule", "native_gdn_layer",
                                    "native_attention_layer", "native_attention_settled", "hook"])
def test_a_fault_at_any_step_rolls_back_and_the_engine_completes_every_request(target, monkeypatch):
    model = make_model("lin-idx", seed=7)
    prompts = prompts_for(7, lengths=(10, 4, 15))
    clean, _ = run_engine(model, prompts, max_batch_tokens=7)
    for k in range(1, 12, 3):
        # (GDNState.delta_rule and QSACache.plan run where the layer is not one native call)
        engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=8, max_batch_tokens=7, block_size=4,
                                            native_layers=target not in ("delta_rule", "qsa_select")))
        calls = inject_fault(engine, target, k, monkeypatch)
        for i, p in enumerate(prompts):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=EOS)
        engine.run()
        assert calls["n"] >= k
        assert engine.counters.retried_steps == 1
        assert {r: q.generated for r, q in engine.requests.items()} == clean, (target, k)


def test_a_step_that_keeps_failing_fails_its_requests_and_the_engine_goes_on():
    model = make_model("lin-idx", seed=8)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, max_batch_tokens=64))
    engine.add_request([5, 6, 7], request_id="doomed", max_new_tokens=3, eos_token_id=-1)
    engine._fault_hook = lambda plan: (_ for _ in ()).throw(RuntimeError("persistent"))
    engine.step()
    assert engine.requests["doomed"].status is RequestStatus.FAILED
    assert "persistent" in engine.requests["doomed"].error
    engine._fault_hook = None
    engine.add_request([5, 6, 7], request_id="next", max_new_tokens=3, eos_token_id=-1)
    engine.run()
    assert engine.requests["next"].generated == reference_tokens(model, [5, 6, 7], 3)[:3]
    engine.clear_prefix_cache()
    assert engine.cache.slots.live_handles() == []


# ------------------------------------------------------------------------------------------ requests
@pytest.mark.parametrize("bad, match", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[1, 50]), "outside the vocabulary"),
    (dict(prompt=[1, -1]), "outside the vocabulary"),
    (dict(prompt=list(range(4, 40)) * 10), "does not fit"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_requests_are_refused_with_a_clear_error(bad, match):
    model = make_model("lin-idx")
    engine = Engine(model, EngineConfig(capacity_tokens=64, max_sequences=2))
    args = dict(prompt=[5, 6], max_new_tokens=2)
    args.update(bad)
    with pytest.raises(BadRequestError, match=match):
        engine.add_request(args.pop("prompt"), **args)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompt", ["123", b"12", [5.9, 7.2], [5, 6.0], torch.tensor([5.5, 6.7]),
                                    torch.tensor([[5, 6]]), torch.tensor([True, False]), [True, 5], [5, None],
                                    ["5", "6"], {5: 1}, 7, [torch.tensor(5.5)]],
                         ids=lambda p: repr(p)[:24])
def test_a_prompt_that_is_not_integer_token_ids_is_refused_not_converted(prompt):
    """``int(t)`` used to turn ``"123"`` into [1, 2, 3], [5.9, 7.2] into [5, 7] and a float tensor into its
    truncation; a prompt must be a sequence or a 1-D tensor of integers."""
    engine = Engine(make_model("lin-idx"), EngineConfig(capacity_tokens=64, max_sequences=2))
    with pytest.raises(BadRequestError, match="the prompt"):
        engine.add_request(prompt, max_new_tokens=2)
    assert not engine.has_unfinished() and not engine.requests


def test_integer_prompts_of_every_kind_are_taken_as_they_are():
    np = pytest.importorskip("numpy")
    engine = Engine(make_model("lin-idx"), EngineConfig(capacity_tokens=64, max_sequences=8))
    kinds = [[5, 6, 7], (5, 6, 7), range(5, 8), torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7], dtype=torch.int32),
             np.array([5, 6, 7]), [np.int64(5), 6, torch.tensor(7)]]
    for i, prompt in enumerate(kinds):
        engine.add_request(prompt, request_id=f"r{i}", max_new_tokens=1, eos_token_id=torch.tensor([3]))
    assert all(r.prompt == [5, 6, 7] and type(r.prompt[0]) is int for r in engine.requests.values())
    with pytest.raises(BadRequestError, match="eos_token_id"):
        engine.add_request([5], max_new_tokens=1, eos_token_id=[3.5])


@pytest.mark.parametrize("kwargs, match", [(dict(temperature=0.0, do_sample=True), "temperature"),
                                           (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
                                           (dict(repetition_penalty=0.0), "repetition_penalty")])
def test_bad_sampling_values_are_refused(kwargs, match):
    with pytest.raises(BadRequestError, match=match):
        SamplingParams(**kwargs)


def test_cancel_frees_capacity_exactly_and_changes_no_other_tokens():
    model = make_model("lin-idx", seed=9)
    prompts = prompts_for(9, lengths=(10, 14, 5))
    clean, _ = run_engine(model, prompts[:1] + prompts[2:], max_batch_tokens=7)
    engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=8, max_batch_tokens=7, block_size=4,
                                        prefix_cache_tokens=0))
    free0, slots0 = engine._free_cells(), len(engine.cache.slots.live_handles())
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=EOS)
    engine.step()
    engine.step()                              # r1 is part-way through its prompt
    assert 0 < engine.requests["r1"].num_computed < len(prompts[1])
    engine.cancel("r1")
    engine.run()
    assert engine.requests["r1"].status is RequestStatus.CANCELLED
    assert engine._free_cells() == free0 and len(engine.cache.slots.live_handles()) == slots0
    assert engine.requests["r0"].generated == clean["r0"] and engine.requests["r2"].generated == clean["r1"]


def test_a_full_cache_preempts_the_newest_and_recomputes_it():
    model = make_model("lin-idx", seed=10)
    prompts = prompts_for(10, lengths=(12, 12, 12))
    engine = Engine(model, EngineConfig(capacity_tokens=40, max_sequences=4, max_batch_tokens=64))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=-1)
    engine.run()
    assert engine.counters.preemptions >= 1
    for i, p in enumerate(prompts):
        out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert engine.requests[f"r{i}"].generated == out[0, len(p):].tolist()


@pytest.mark.parametrize("penalty", [1.0, 3.0])
def test_greedy_tokens_with_a_repetition_penalty_equal_generate(penalty):
    """The repetition penalty reads each request's whole history (its prompt and its tokens so far; the sampler gets
    it only where a request's settings read it): greedy tokens with ``repetition_penalty`` equal transformers'
    ``generate`` with the same penalty, a batch of requests at once; with a strong penalty, some of them are not
    the plain greedy tokens (the history changes them)."""
    model = make_model("lin-idx", seed=12)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 10, 9, 11]]
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, max_batch_tokens=64))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=8, eos_token_id=-1,
                           sampling=SamplingParams(repetition_penalty=penalty))
    with torch.inference_mode():
        engine.run()
    changed = []
    for i, p in enumerate(prompts):
        want = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, repetition_penalty=penalty,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert engine.requests[f"r{i}"].generated == want, i
        plain = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()
        changed.append(want != plain)
    assert any(changed) == (penalty != 1.0)


def test_seeded_sampling_does_not_depend_on_the_batch(row_invariant):
    model = eager_experts(make_model("lin-idx", seed=11))
    prompts = prompts_for(11, lengths=(5, 9, 13))
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=7,
                            logprobs=True)

    def run(order, budget):
        engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=4, max_batch_tokens=budget))
        for i in order:
            engine.add_request(prompts[i], request_id=f"r{i}", max_new_tokens=8, sampling=params, eos_token_id=-1)
        engine.run()
        return {r: (q.generated, len(q.logprobs)) for r, q in engine.requests.items()}

    a, b = run([0, 1, 2], 64), run([2, 0, 1], 5)
    assert a == b
    assert all(n == 8 for _, n in a.values())


# ------------------------------------------------------------------------------------------ progress
def _drive(engine, max_steps: int, seconds: float, arrivals=()) -> int:
    """Step until nothing is left, within ``max_steps`` steps and ``seconds``; ``arrivals``: (step, fn) pairs
    run before that step. Returns the steps taken (the test fails if work is left at a bound)."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    deadline, steps = time.monotonic() + seconds, 0
    while engine.has_unfinished() or arrivals:
        while arrivals and arrivals[0][0] <= steps:
            arrivals.pop(0)[1]()
        assert steps < max_steps and time.monotonic() < deadline, (
            f"no end after {steps} steps: " + ", ".join(f"{r.request_id} {r.status.value} {r.num_computed}/"
                                                        f"{r.num_tokens}" for r in engine.scheduler.requests()))
        engine.step()
        steps += 1
    return steps


def test_kept_prefixes_yield_to_a_running_prefill():
    """Four finished requests' kept state holds the cells a lone 200-token prompt still needs part-way through
    its prefill: the kept state is evicted for it (it used to stop at the free cells, the engine spinning)."""
    model = make_model("lin-idx", seed=14)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=8, max_batch_tokens=64, block_size=16,
                                        prefix_cache_tokens=200))
    rng = random.Random(14)
    for i in range(4):
        engine.add_request([rng.randrange(4, 50) for _ in range(40)], request_id=f"k{i}", max_new_tokens=8,
                           eos_token_id=-1)
    engine.run()
    assert len(engine.kept_sequences()) == 4 and engine._free_cells() < 200
    big = [rng.randrange(4, 50) for _ in range(200)]
    engine.add_request(big, request_id="big", max_new_tokens=4, eos_token_id=-1)
    _drive(engine, max_steps=20, seconds=60)
    assert engine.requests["big"].status is RequestStatus.FINISHED
    assert engine.requests["big"].generated == reference_tokens(model, big, 4)[:4]
    assert engine.counters.prefix_evictions >= 1


def test_two_prefills_that_together_overfill_the_cache_do_not_deadlock():
    """Two prompts of 47 and 30 tokens in 48 cells, cut at 5-token blocks under a 16-token budget: the second
    used to be admitted beside the first and take the cells the first's prompt still needed, both stopping
    part-way with no cell free. Admission now counts the rest of the running prompts (and a step where no
    running request could go on would preempt the newest): both finish, the first first."""
    model = make_model("lin-idx", seed=15)
    engine = Engine(model, EngineConfig(capacity_tokens=48, max_sequences=4, max_batch_tokens=16, block_size=5,
                                        prefix_cache_tokens=0))
    a, b = prompts_for(15, lengths=(47, 30))
    engine.add_request(a, request_id="a", max_new_tokens=1, eos_token_id=-1)
    engine.add_request(b, request_id="b", max_new_tokens=3, eos_token_id=-1)
    _drive(engine, max_steps=60, seconds=60)
    for rid, p, n in (("a", a, 1), ("b", b, 3)):
        assert engine.requests[rid].status is RequestStatus.FINISHED
        assert engine.requests[rid].generated == reference_tokens(model, p, n)[:n]
    assert engine.requests["a"].finished_time < engine.requests["b"].finished_time


def test_the_scheduler_preempts_the_newest_when_no_running_request_can_go_on():
    """A table: two running prefills, no free cell, no decode; the newest is preempted and its cells go to the
    oldest. A lone running request with no cell is never preempted (the plan is empty: the engine fails it)."""
    from hebrus_torch.engine.requests import Request
    from hebrus_torch.engine.scheduler import Scheduler

    def running(sched, rid, prompt_len, computed, arrival):
        req = Request(rid, list(range(4, 4 + prompt_len)), 4)
        req.num_computed, req.arrival, req.status = computed, arrival, RequestStatus.PREFILLING
        sched.running.append(req)
        return req

    sched = Scheduler(max_batch_tokens=16, max_requests_per_batch=None, max_sequences=4)
    old, new = running(sched, "old", 40, 30, 0), running(sched, "new", 30, 18, 1)
    released = []
    plan = sched.schedule(0, release=released.append)
    assert plan.preempted == [new] == released and new.num_computed == 0 and list(sched.waiting) == [new]
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(old, 10)]
    lone = Scheduler(max_batch_tokens=16, max_requests_per_batch=None, max_sequences=4)
    running(lone, "only", 40, 30, 0)
    plan = lone.schedule(0)
    assert not plan and not plan.preempted and len(lone.running) == 1


def test_a_request_that_cannot_progress_fails_with_a_capacity_error_instead_of_spinning():
    """Cells held outside the engine's requests (a sequence of the cache the user made): a request that needs
    more than are free fails alone, naming why, and the next one that fits runs."""
    model = make_model("lin-idx", seed=16)
    engine = Engine(model, EngineConfig(capacity_tokens=64, max_sequences=4, max_batch_tokens=16, block_size=4))
    held = engine.cache.new_sequence()
    engine.runner.execute([held], [list(range(4, 44))], [False], [0])     # 40 cells held: 24 free
    engine.add_request(list(range(4, 34)), request_id="big", max_new_tokens=2, eos_token_id=-1)
    _drive(engine, max_steps=10, seconds=30)
    req = engine.requests["big"]
    assert req.status is RequestStatus.FAILED
    assert req.error.startswith("CapacityError") and "cannot progress" in req.error and "24 of its" in req.error, req.error
    engine.add_request([5, 6, 7], request_id="small", max_new_tokens=3, eos_token_id=-1)
    _drive(engine, max_steps=10, seconds=30)
    assert engine.requests["small"].generated == reference_tokens(model, [5, 6, 7], 3)[:3]
    engine.clear_prefix_cache()
    engine.cache.free(held)
    assert engine._free_cells() == 64 and engine.cache.slots.live_handles() == []


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_on_tiny_capacities_always_end(seed):
    """Seeded random workloads on capacities of 16 to 64 cells (prompts up to the capacity, outputs up to it,
    shared prefixes, kept state, late arrivals, cancels, sometimes cells held outside): every request ends,
    within a bounded number of steps, finished, cancelled, or failed with a CapacityError only when cells
    were held outside; every cell comes back."""
    model = make_model("lin-idx", seed=17)
    rng = random.Random(seed)
    cap = rng.randrange(16, 65)
    engine = Engine(model, EngineConfig(capacity_tokens=cap, max_sequences=rng.randrange(1, 5),
                                        max_batch_tokens=rng.choice([None, 1, 4, 8, 16]),
                                        block_size=rng.choice([2, 4, 8]), allow_block_sharing=rng.random() < 0.8,
                                        prefix_cache_tokens=rng.choice([None, 0, cap // 4, cap])))
    base = [rng.randrange(4, 50) for _ in range(cap)]

    def add():
        n = rng.randrange(1, cap)
        prompt = base[:n] if rng.random() < 0.5 else [rng.randrange(4, 50) for _ in range(n)]
        return engine.add_request(prompt, max_new_tokens=rng.randrange(1, min(cap, 12)), eos_token_id=-1)

    held = None
    if seed % 4 == 3:               # cells held outside the engine's requests
        held = engine.cache.new_sequence()
        engine.runner.execute([held], [base[:cap // 3]], [False], [0])
    for _ in range(rng.randrange(2, 6)):
        add()
    arrivals = [(rng.randrange(1, 30), add) for _ in range(rng.randrange(0, 4))]
    arrivals.append((rng.randrange(1, 20), lambda: engine.cancel(rng.choice(sorted(engine.requests)))))
    steps = _drive(engine, max_steps=400, seconds=120, arrivals=arrivals)
    assert steps < 400
    for req in engine.requests.values():
        assert req.status.is_done
        if req.status is RequestStatus.FAILED:
            assert held is not None and req.error.startswith("CapacityError"), req.error
    engine.clear_prefix_cache()
    if held is not None:
        engine.cache.free(held)
    assert engine._free_cells() == cap and engine.cache.slots.live_handles() == []


# ------------------------------------------------------------------------------------------ transformers' API
def test_generate_batch_after_apply_runs_on_the_engine_and_bad_requests_fail_alone():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus as TfStatus

    from hebrus_torch.engine.manager import HebrusBatchingManager
    from hebrus_torch.integrations import transformers as htx

    model = make_model("lin-idx", seed=12)
    prompts = prompts_for(12, lengths=(5, 13, 30))
    bad = [[], [1, 50], "123"]
    htx.apply(model)
    try:
        assert isinstance(model.init_continuous_batching(), HebrusBatchingManager)
        gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        out = model.generate_batch(prompts[:2] + bad + prompts[2:], gc,
                                   continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=16,
                                                                                       page_size=4))
        assert list(out) == [f"req_{i}" for i in range(6)]                   # input order
        assert all(isinstance(o, GenerationOutput) for o in out.values())
        good = [out["req_0"], out["req_1"], out["req_5"]]
        for o, p in zip(good, prompts):
            assert o.status == TfStatus.FINISHED and o.error is None
            assert o.prompt_ids == p and o.generated_tokens == reference_tokens(model, p, 5)
        assert out["req_2"].status == TfStatus.FAILED and "empty" in out["req_2"].error
        assert out["req_3"].status == TfStatus.FAILED and "vocabulary" in out["req_3"].error
        assert out["req_4"].status == TfStatus.FAILED and "integer token ids" in out["req_4"].error
        assert out["req_4"].prompt_ids == []          # not [1, 2, 3]
    finally:
        htx.revert(model)
    assert "init_continuous_batching" not in model.__dict__


def _generate_batch_within(model, prompts, gc, cb_config, seconds: float, monkeypatch) -> dict:
    """``model.generate_batch`` with a watchdog: past ``seconds`` the manager is stopped hard (its requests
    fail, so generate_batch returns) and the test fails naming what was left."""
    import threading

    from hebrus_torch.engine.manager import HebrusBatchingManager

    managers = []
    init = HebrusBatchingManager.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        managers.append(self)
    monkeypatch.setattr(HebrusBatchingManager, "__init__", recording)
    done, timed_out = threading.Event(), []

    def watchdog():
        if not done.wait(seconds):
            timed_out.append(True)
            for m in managers:
                m.stop(block=False, hard_stop=True)
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        out = model.generate_batch(prompts, gc, continuous_batching_config=cb_config)
    finally:
        done.set()
    assert not timed_out, f"generate_batch did not return in {seconds}s"
    return out


def test_generate_batch_with_kept_state_filling_the_cache_returns(monkeypatch):
    """The issue's case: prompts of 230, 230 and 900 tokens in 1,024 cells, the first two kept after they
    finish (half the capacity): the third used to stop part-way and generate_batch never returned."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.requests import RequestStatus as TfStatus

    from hebrus_torch.integrations import transformers as htx

    model = make_model("lin-idx", seed=18)
    rng = random.Random(18)
    prompts = [[rng.randrange(4, 50) for _ in range(n)] for n in (230, 230, 900)]
    htx.apply(model)
    try:
        gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = _generate_batch_within(model, prompts, gc, ContinuousBatchingConfig(
            max_batch_tokens=256, num_blocks=16, page_size=64, max_requests_per_batch=2), 120, monkeypatch)
        assert [o.status for o in out.values()] == [TfStatus.FINISHED] * 3, [o.error for o in out.values()]
        assert [len(o.generated_tokens) for o in out.values()] == [4, 4, 4]
    finally:
        htx.revert(model)


@pytest.mark.parametrize("seed", range(4))
def test_generate_batch_on_random_workloads_on_tiny_capacities_returns(seed, monkeypatch):
    """Random prompts up to the capacity on caches of 32 to 96 cells through transformers' generate_batch, the
    last one nearly the whole cache: it returns in bounded time with every request finished."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.requests import RequestStatus as TfStatus

    from hebrus_torch.integrations import transformers as htx

    model = make_model("lin-idx", seed=19)
    rng = random.Random(seed)
    page = rng.choice([4, 8])
    cap = page * rng.randrange(32 // page, 96 // page + 1)
    base = [rng.randrange(4, 50) for _ in range(cap)]
    lengths = [rng.randrange(1, cap - 8) for _ in range(rng.randrange(2, 7))] + [cap - rng.randrange(9, 12)]
    prompts = [base[:n] if rng.random() < 0.5 else [rng.randrange(4, 50) for _ in range(n)] for n in lengths]
    htx.apply(model)
    try:
        gc = GenerationConfig(max_new_tokens=rng.randrange(1, 8), do_sample=False, eos_token_id=None, pad_token_id=0)
        out = _generate_batch_within(model, prompts, gc, ContinuousBatchingConfig(
            max_batch_tokens=rng.choice([4, 16, 64]), num_blocks=cap // page, page_size=page,
            max_requests_per_batch=rng.randrange(1, 5)), 60, monkeypatch)
        assert len(out) == len(prompts)
        assert all(o.status == TfStatus.FINISHED for o in out.values()), [o.error for o in out.values()]
    finally:
        htx.revert(model)


def greedy_manager(seed: int, max_batch_tokens: int):
    """(model, a HebrusBatchingManager over it: 6 greedy tokens per request, no EOS, 256 cells, 4 slots)."""
    from transformers import GenerationConfig

    from hebrus_torch.engine.manager import HebrusBatchingManager

    model = make_model("lin-idx", seed=seed)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model, HebrusBatchingManager(model, gc, engine_config=EngineConfig(
        capacity_tokens=256, max_sequences=4, max_batch_tokens=max_batch_tokens))


def test_manager_streams_cancels_and_stops():
    model, manager = greedy_manager(13, max_batch_tokens=8)
    manager.start()
    try:
        assert manager.is_running()
        rid = manager.add_request([5, 6, 7, 8], streaming=True)
        seen = [o.generated_tokens for o in manager.request_id_iter(rid)]
        assert [len(s) for s in seen] == list(range(1, 7))
        full = [5, 6, 7, 8]
        assert seen[-1] == model.generate(torch.tensor([full]), max_new_tokens=6, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
        long = manager.add_request(list(range(4, 44)), max_new_tokens=50)
        manager.cancel_request(long)
        result = None
        for _ in range(100):
            result = manager.get_result(request_id=long, timeout=0.2)
            if result is not None:
                break
        assert result is not None and result.error == "cancelled"
    finally:
        manager.stop(block=True, timeout=30)
    assert not manager.is_running()
