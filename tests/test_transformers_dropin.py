"""hebrus_torch.integrations.transformers on a tiny random Qwen4ExpForCausalLM (transformers 5.23.0).

Every test runs the same inputs through the model unpatched and patched (apply/revert on one
instance) and compares: logits within fp32 tolerance, indexer selection masks and generated tokens
identical. The model (``random_model`` of benchmarks/tiny_qwen4exp.py, through tests/hf_models.py):
4 layers (linear, indexed, linear, indexed), PLE on decoder layers 0 and 2 (1-based ``ple_layer_ids`` [1, 3]) with random conv weights, indexer budget 8 /
ratio 4 (top 2 groups), so prompts of 30-60 tokens select sparsely. Its embeddings carry a shared
direction that keeps indexer scores positive: with plain random weights many scores are exactly 0
and transformers' ``torch.topk`` breaks those ties in an unspecified order (hebrus: lower group
index, SPEC §3); see test_exact_ties_pick_the_lower_group_index.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers==5.23.0 (pip install -e .[hf])")

import hebrus_torch as ht  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch._extension import has_native_kernel  # noqa: E402
from hebrus_torch.integrations import transformers as htx  # noqa: E402
from hebrus_torch.integrations.qwen4_exp import indexer as indexer_mod  # noqa: E402
from transformers.cache_utils import DynamicCache, DynamicIndexedLayer, StaticCache  # noqa: E402
from transformers.models.qwen4_exp import modeling_qwen4_exp as M  # noqa: E402

from hf_models import random_model  # noqa: E402

pytestmark = pytest.mark.hf

ATOL = 1e-5
EOS = 3


def tokens(batch: int, length: int, seed: int, eos_at=()) -> torch.Tensor:
    ids = torch.randint(4, 64, (batch, length), generator=torch.Generator().manual_seed(seed))
    for b, t in eos_at:
        ids[b, t] = EOS
    return ids


class Indexers:
    """Records every indexer output (the boolean selection masks) of a model."""

    def __init__(self, model):
        self.masks: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(lambda mod, args, out: self.masks.append(htx.selection_mask(out).cpu()))
                        for m in model.modules() if isinstance(m, M.Qwen4ExpTextQSAIndexer)]

    def take(self) -> list[torch.Tensor]:
        out, self.masks = self.masks, []
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def both(model, fn, **options):
    """fn() unpatched, then patched with apply(model, **options): (reference, patched, patched stats,
    reference masks, patched masks)."""
    rec = Indexers(model)
    try:
        htx.revert(model)
        with torch.no_grad():
            ref = fn()
        ref_masks = rec.take()
        htx.apply(model, **options)
        htx.reset_stats()
        with torch.no_grad():
            got = fn()
        stats = htx.stats()
        got_masks = rec.take()
    finally:
        htx.revert(model)
        rec.remove()
    return ref, got, stats, ref_masks, got_masks


def assert_same(ref_masks, got_masks):
    assert len(ref_masks) == len(got_masks) > 0
    for i, (a, b) in enumerate(zip(ref_masks, got_masks)):
        assert a.shape == b.shape and torch.equal(a, b), f"indexer call {i}: selection masks differ"


def assert_hebrus_path(stats, sparse=True):
    assert stats.get("qsa_hebrus", 0) > 0 and stats.get("ple_ngram", 0) > 0 and stats.get("ple_conv", 0) > 0, stats
    assert not any(k.startswith("qsa_fallback") for k in stats), stats
    if sparse:
        assert stats.get("qsa_queries_selected", 0) > 0, stats          # the budget was actually exceeded
        # attention ran as hebrus::qsa_attention (where every indexer call was sync-free, on a device without
        # a native qsa_attention, the few queries attend densely over the selection mask: issue 19)
        assert (stats.get("sparse_attention_calls", 0) > 0
                or 0 < stats.get("qsa_sync_free", 0) == stats.get("qsa_hebrus")), stats


def gradients_both(model, ids):
    """The parameters' gradients of one language-model loss, unpatched then patched: (reference, patched,
    patched stats); parameters without a gradient are left out."""
    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads()
    htx.apply(model)
    try:
        htx.reset_stats()
        got = grads()
        stats = htx.stats()
    finally:
        htx.revert(model)
    return ref, got, stats


def assert_same_gradients(ref, got):
    assert ref and ref.keys() == got.keys()
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def chunked(model, ids, sizes, attention_mask=None):
    cache = DynamicCache(config=model.config)
    out, start = [], 0
    for size in sizes:
        stop = min(ids.shape[1], start + size)
        mask = None if attention_mask is None else attention_mask[:, :stop]
        out.append(model(ids[:, start:stop], attention_mask=mask, past_key_values=cache, use_cache=True).logits)
        start = stop
        if start == ids.shape[1]:
            break
    assert start == ids.shape[1]
    return torch.cat(out, dim=1)


@pytest.fixture(params=[
    "cpu",
    pytest.param("mps", marks=[pytest.mark.mps, pytest.mark.skipif(not torch.backends.mps.is_available(),
                                                                   reason="needs an Apple GPU")]),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def device(request) -> str:
    """conftest's devices plus CUDA, where the ops run their pure-PyTorch reference."""
    return request.param


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A tiny model is thousands of tiny ops: on a shared 2-core machine 2-thread regions stall whenever
    another process holds a core (seconds per test); one thread is both faster and steadier. On CUDA,
    cuDNN's TF32 convolutions (transformers' conv1d) would differ from fp32 by ~1e-4: fp32 for both."""
    threads, tf32 = torch.get_num_threads(), torch.backends.cudnn.allow_tf32
    torch.set_num_threads(1)
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.set_num_threads(threads)
    torch.backends.cudnn.allow_tf32 = tf32


@pytest.fixture
def model(device):
    return random_model(0, device=device)


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_one_shot_prefill(device, attn):
    model = random_model(1, device=device, attn_implementation=attn)
    ids = tokens(2, 56, seed=1, eos_at=[(0, 17), (1, 30), (1, 31)]).to(device)
    ref, got, stats, rm, gm = both(model, lambda: model(ids).logits)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)
    assert stats["qsa_queries_selected"] == 2 * 2 * (56 - 11)           # 2 layers x 2 rows x queries with > 2 groups


@pytest.mark.parametrize("sizes", ["1/2/1", "random0", "random1"])
def test_chunked_prefill(model, device, sizes):
    ids = tokens(2, 44, seed=2, eos_at=[(0, 5), (0, 6), (1, 40)]).to(device)
    if sizes == "1/2/1":
        ids, plan = ids[:, :32], [1, 2, 1] * 8
    else:
        rng = random.Random(sizes)
        plan = [rng.choice([1, 2, 3, 5, 8, 13]) for _ in range(44)]
    ref, got, stats, rm, gm = both(model, lambda: chunked(model, ids, plan))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)


def test_greedy_generate_identical_tokens(model, device):
    prompt = tokens(1, 30, seed=3, eos_at=[(0, 12)]).to(device)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref, got, stats, rm, gm = both(model, lambda: model.generate(prompt, **kw))
    assert torch.equal(got, ref)
    assert got.shape[1] == 54
    assert_same(rm, gm)
    assert_hebrus_path(stats)


def test_eos_in_the_middle(model, device):
    # EOS runs of every length, at chunk boundaries too: the n-gram history and conv tail cross them.
    ids = tokens(1, 40, seed=4, eos_at=[(0, 0), (0, 9), (0, 10), (0, 20), (0, 21), (0, 22), (0, 39)]).to(device)
    ref, got, stats, rm, gm = both(
        model, lambda: torch.cat([model(ids).logits, chunked(model, ids, [9, 1, 1, 10, 2, 17])], 1))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)


def test_left_padded_batch(model, device):
    a, b = tokens(1, 46, seed=5, eos_at=[(0, 20)])[0], tokens(1, 31, seed=6)[0]
    ids = torch.zeros(2, 46, dtype=torch.long)
    mask = torch.zeros(2, 46, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 15:], mask[1, 15:] = b, 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run():
        logits = model(ids, attention_mask=mask).logits
        return logits, model.generate(ids, attention_mask=mask, **kw)

    (ref_logits, ref_tok), (got_logits, got_tok), stats, rm, gm = both(model, run)
    real = mask.bool()
    torch.testing.assert_close(got_logits[real], ref_logits[real], atol=ATOL, rtol=ATOL)
    assert torch.equal(got_tok, ref_tok)
    assert_same(rm, gm)
    assert_hebrus_path(stats)


def test_decode_pools_only_new_groups(model, device, monkeypatch):
    """Prefill pools every group once; each decode step pools only the group its token completes."""
    pooled_per_call: list[int] = []
    real_pool = ht.qsa_pool

    def counting_pool(keys, cell_pos, group_cells, *args):
        pooled_per_call.append(int(group_cells.shape[0]))
        return real_pool(keys, cell_pos, group_cells, *args)

    monkeypatch.setattr(ht, "qsa_pool", counting_pool)
    # The kept groups' path (CUDA decodes through the sync-free indexer, which pools every group: issue 19)
    monkeypatch.setattr(indexer_mod, "_sync_free", lambda *args: False)
    prompt, steps = 37, 13
    ids = tokens(2, prompt + steps, seed=7, eos_at=[(1, 25)]).to(device)

    def run():
        cache = DynamicCache(config=model.config)
        out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
        for t in range(prompt, prompt + steps):
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return torch.cat(out, 1)

    ref, got, stats, rm, gm = both(model, run)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)
    layers, rows, ratio = 2, 2, 4
    assert pooled_per_call[:layers] == [rows * (prompt // ratio)] * layers       # prefill: 9 groups per row
    decode = pooled_per_call[layers:]
    completed = [t for t in range(prompt + 1, prompt + steps + 1) if t % ratio == 0]   # steps that finish a group
    assert decode == [rows] * (layers * len(completed))
    assert stats["qsa_groups_pooled"] == layers * rows * ((prompt + steps) // ratio)


def test_cache_lifecycle_invalidates_pooled_groups(model, device):
    """reorder_cache and reset drop the groups kept on the cache layer; results stay exact."""
    ids = tokens(2, 40, seed=8).to(device)
    other = tokens(2, 40, seed=9).to(device)

    def run():
        cache = DynamicCache(config=model.config)
        out = [model(ids[:, :30], past_key_values=cache, use_cache=True).logits]
        layer = cache.layers[1]
        kept = htx._GROUPS in layer.__dict__
        cache.reorder_cache(torch.tensor([1, 0], device=device))       # rows swap: anchors (b, f) now name other keys
        dropped = htx._GROUPS not in layer.__dict__
        for t in range(30, 40):
            out.append(model(ids[:, t:t + 1].flip(0), past_key_values=cache, use_cache=True).logits)
        cache.reset()
        out.append(model(other, past_key_values=cache, use_cache=True).logits)
        return torch.cat(out, 1), (kept, dropped)

    (ref, _), (got, flags), stats, rm, gm = both(model, run)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)
    assert flags == (True, True)


@pytest.mark.parametrize("method, arg", [("crop", -3), ("batch_select_indices", [0]), ("batch_repeat_interleave", 2),
                                         ("reorder_cache", [1, 0]), ("reset", None)])
def test_every_indexed_layer_lifecycle_method_drops_groups(model, device, method, arg):
    ids = tokens(2, 30, seed=15).to(device)
    cache = DynamicCache(config=model.config)
    htx.apply(model)
    try:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        layer = cache.layers[1]
        assert isinstance(layer, DynamicIndexedLayer) and htx._GROUPS in layer.__dict__
        args = () if arg is None else (torch.tensor(arg, device=device) if isinstance(arg, list) else arg,)
        getattr(layer, method)(*args)
        assert htx._GROUPS not in layer.__dict__
    finally:
        htx.revert(model)


def test_rope_attention_scaling_falls_back(model, device):
    """qsa_pool ropes with plain cos/sin: with scaled cos/sin (yarn's attention factor) the indexer runs
    transformers' own forward, and the logits are transformers'."""
    ids = tokens(1, 24, seed=12).to(device)
    rotary = model.model.rotary_emb
    saved = rotary.attention_scaling
    rotary.attention_scaling = 0.5
    try:
        with torch.no_grad():
            ref = model(ids).logits
        htx.apply(model)
        try:
            htx.reset_stats()
            with torch.no_grad():
                got = model(ids).logits
            indexed = sum(t == "indexed_attention" for t in model.config.layer_types)
            assert htx.stats().get("qsa_fallback:attention_scaling") == indexed, htx.stats()
        finally:
            htx.revert(model)
    finally:
        rotary.attention_scaling = saved
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)


def test_apply_refuses_an_unknown_on_hole(model):
    with pytest.raises(ht.HebrusError, match="on_hole must be 'raise' or 'fallback', got 'ignore'"):
        htx.apply(model, on_hole="ignore")
    assert not any(htx._PATCH in mod.__dict__ for mod in model.modules())


def test_hole_falls_back_by_default_or_raises(model, device):
    """SPEC §7: a hole where a selection is made runs transformers' indexer by default (counted, warned once
    per cause); apply(model, on_hole="raise") fails closed instead."""
    ids = tokens(1, 40, seed=10).to(device)
    length = ids.shape[1]
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))
    mask[20:, 9] = False                                                   # position 9 missing for queries >= 20
    mask4 = torch.where(mask, 0.0, torch.finfo(torch.float32).min)[None, None]   # eager attention: float mask
    masks = {"indexed_attention": mask4, "linear_attention": None}
    htx.apply(model)
    try:
        htx.reset_stats()
        with torch.no_grad(), pytest.warns(htx.HebrusFallbackWarning, match="hole") as caught:
            got = model(ids, attention_mask=masks).logits
            model(ids, attention_mask=masks)
        assert sum(issubclass(w.category, htx.HebrusFallbackWarning) for w in caught) == 1   # once per cause
        assert htx.stats().get("qsa_fallback:hole") == 4
        htx.apply(model, on_hole="raise")
        with torch.no_grad(), pytest.raises(ht.HoleError, match=r"batch row 0, query 20: .*\[9\]"):
            model(ids, attention_mask=masks)
    finally:
        htx.revert(model)
    with torch.no_grad():
        ref = model(ids, attention_mask=masks).logits
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("on_hole", ["raise", "fallback"])
def test_holes_where_every_visible_token_is_selected_never_fail(device, on_hole):
    """transformers' model tester right-pads with torch.tril(ones(B, T)): decoding after the padding gives
    queries a hole between the prompt and the new tokens. Where such a query sees at most budget + r - 1
    tokens its selection is every visible token (grouping cannot change it): never an error, never a
    fallback, whatever on_hole says; the full row beside it (no hole) still selects sparsely."""
    model = random_model(0, device=device)
    ids = tokens(2, 20, seed=21).to(device)
    mask = torch.ones(2, 20, dtype=torch.long, device=device)
    mask[0, 5:] = 0                                                        # row 0: 5 tokens, right-padded

    def run():
        return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None,
                              pad_token_id=0)

    ref, got, stats, ref_masks, got_masks = both(model, run, on_hole=on_hole)
    assert torch.equal(got, ref)
    assert_same(ref_masks, got_masks)
    assert not any(k.startswith("qsa_fallback") for k in stats), stats
    assert stats.get("qsa_queries_selected", 0) > 0, stats                # row 1 selects
    # the decode masks do have a hole in row 0 (the test is not vacuous)
    last = ref_masks[-1][0, 0, -1]                                         # the last query of row 0: 24 keys
    assert last.shape[0] == 24 and last[:5].all() and not last[5:20].any() and last[20:].all()


def test_eos_outside_the_vocabulary(device):
    """transformers' generation tests set eos_token_id = vocab + 100000 (no token equals it): the n-gram
    hash takes it (SPEC §2) and the model runs the hebrus path, tokens identical, eager and compiled ops."""
    model = random_model(0, device=device, eos_token_id=64 + 100000)
    assert int(next(m for m in model.modules() if isinstance(m, M.Qwen4ExpTextNGramEmbedding)).eos_token_id) \
        == 64 + 100000
    ids = tokens(2, 30, seed=22).to(device)
    ref, got, stats, rm, gm = both(model, lambda: model.generate(ids, max_new_tokens=6, do_sample=False,
                                                                 eos_token_id=None, pad_token_id=0))
    assert torch.equal(got, ref)
    assert_same(rm, gm)
    assert_hebrus_path(stats)
    assert not any(k.startswith("ple_fallback") for k in stats), stats


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(device, reentrant):
    """With gradient checkpointing the decoder layers run again in backward on the same position embeddings
    (the rotary module does not): the recomputation must take the path the forward took, or the saved
    tensors differ (non-reentrant: CheckpointError). Gradients equal transformers'."""
    model = random_model(0, device=device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ref, got, stats = gradients_both(model, tokens(2, 36, seed=23).to(device))
    assert stats.get("qsa_hebrus", 0) >= 4 and stats.get("qsa_queries_selected", 0) > 0, stats   # forward + recompute
    assert not any(k.startswith("qsa_fallback") for k in stats), stats
    assert_same_gradients(ref, got)


def test_refused_model_is_left_untouched(device):
    """apply validates everything before it changes anything (SPEC §7): a model it refuses keeps no hook,
    no patch and its exact state, and runs as before."""
    model = random_model(0, device=device)
    indexers = [m for m in model.modules() if isinstance(m, M.Qwen4ExpTextQSAIndexer)]
    indexers[-1].index_head_dim = 8                                        # the last one: rotary dims 16 > 8
    ids = tokens(1, 30, seed=24).to(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    indexers[-1].index_head_dim = 32
    with torch.no_grad():
        ref = model(ids).logits
    indexers[-1].index_head_dim = 8

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    n_hooks = hooks()
    with pytest.raises(ht.HebrusError, match=r"rotary dims 16 exceed the indexer head dim 8"):
        htx.apply(model)
    assert hooks() == n_hooks
    assert not any(htx._PATCH in m.__dict__ or htx._CTX in m.__dict__ for m in model.modules())
    assert not htx.is_applied(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    indexers[-1].index_head_dim = 32                                       # what transformers' forward needs
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_multimodal_positions_fall_back(model, device):
    ids = tokens(1, 36, seed=11).to(device)
    pos = torch.arange(36, device=device)[None, None].repeat(3, 1, 1)
    pos[1, 0, 10:] += 5                                                    # an image-like grid: rows differ
    ref, got, stats, rm, gm = both(model, lambda: model(ids, position_ids=pos).logits)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert stats.get("qsa_fallback:multimodal_positions") == 2 and "qsa_hebrus" not in stats


def test_revert_restores_original_methods(model, device):
    ids = tokens(1, 40, seed=12).to(device)
    classes = (M.Qwen4ExpTextQSAIndexer, M.Qwen4ExpTextNGramEmbedding, M.Qwen4ExpTextPLELayer,
               M.Qwen4ExpTextAttention)
    modules = [m for m in model.modules() if isinstance(m, classes)]
    before = {id(m): dict(m.__dict__) for m in modules}
    hooks_before = len(model.model.rotary_emb._forward_hooks), len(model.model._forward_hooks)
    crop_before = DynamicIndexedLayer.__dict__["crop"]
    with torch.no_grad():
        ref = model(ids).logits
    assert htx.apply(model) is model
    htx.apply(model)                                                       # idempotent
    assert htx.is_applied(model)
    assert "forward" in model.model.layers[1].self_attn.indexer.__dict__
    assert "forward" in model.model.layers[1].self_attn.__dict__
    assert DynamicIndexedLayer.__dict__["crop"] is not crop_before
    htx.revert(model)
    htx.revert(model)                                                      # idempotent
    assert not htx.is_applied(model)
    for m in modules:
        assert m.__dict__.keys() == before[id(m)].keys()
        assert type(m).forward is m.forward.__func__
    assert M.Qwen4ExpTextPLELayer._short_conv is model.model.layers[0].ple._short_conv.__func__
    assert (len(model.model.rotary_emb._forward_hooks), len(model.model._forward_hooks)) == hooks_before
    assert DynamicIndexedLayer.__dict__["crop"] is crop_before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_exact_ties_pick_the_lower_group_index(device):
    """With every indexer score exactly 0 (zero query projection), transformers' torch.topk picks tied
    groups in an unspecified order; hebrus picks the lowest group indices (SPEC §3). Only then can the
    two differ: both select the same number of tokens, hebrus the first top_k groups + the tail."""
    model = random_model(0, device=device)
    indexer = model.model.layers[1].self_attn.indexer
    with torch.no_grad():
        indexer.index_qk_proj.weight[:indexer.index_n_heads * indexer.index_head_dim].zero_()
    ids = tokens(1, 30, seed=13).to(device)
    _, _, stats, rm, gm = both(model, lambda: model(ids).logits)
    ref, got = rm[0][0, 0], gm[0][0, 0]                                    # layer 1, row 0: [T, K]
    assert torch.equal(ref.sum(-1), got.sum(-1))
    for t in range(30):
        n = t + 1
        want = torch.zeros(30, dtype=torch.bool)
        want[:n] = True
        if n // 4 > 2:
            want[8:4 * (n // 4)] = False                                   # groups 0 and 1, then the raw tail
        assert torch.equal(got[t], want), t
    if device == "cpu":                    # torch.topk's CPU kernel returns other tied indices; CUDA's may not
        assert not torch.equal(ref, got)


def test_torch_compile_prefill(model, device):
    """The patched model compiles with fullgraph=True (transformers' own indexer cannot: its per-query
    loop branches on data) and matches eager on a left-padded batch. Backend aot_eager by default
    (inductor's codegen takes minutes on a small CPU); HEBRUS_COMPILE_BACKEND=inductor to use it."""
    torch._dynamo.reset()
    backend = os.environ.get("HEBRUS_COMPILE_BACKEND", "aot_eager")
    ids = tokens(2, 40, seed=14, eos_at=[(0, 11)]).to(device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids[1, :9] = 0
    real = mask.bool()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        htx.apply(model)
        try:
            eager = model(ids, attention_mask=mask).logits
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            got = compiled(ids, attention_mask=mask).logits
        finally:
            htx.revert(model)
            torch._dynamo.reset()
    torch.testing.assert_close(eager[real], ref[real], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[real], eager[real], atol=ATOL, rtol=ATOL)


def test_record_past_cache(model, device):
    """activate_past_recording keeps full conv histories (more, or after a short prefill fewer, than the
    conv needs): the patched PLE reads the same last inputs transformers does."""
    ids = tokens(1, 30, seed=16, eos_at=[(0, 1)]).to(device)

    def run():
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording()
        out, start = [], 0
        for size in (2, 5, 1, 9, 13):
            out.append(model(ids[:, start:start + size], past_key_values=cache, use_cache=True).logits)
            start += size
        return torch.cat(out, 1)

    ref, got, stats, rm, gm = both(model, run)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)


def test_main_job_model_demo(capsys):
    from hebrus_torch.__main__ import main

    assert main(["--device", "cpu", "--tokens", "64", "--prompt", "48", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "generated tokens identical" in out and "prefill 2 x 48 tokens" in out and "NOT at a score tie" not in out


def test_main_job_model_check_fails_on_one_wrong_selection(monkeypatch, capsys):
    """The model check of `python -m hebrus_torch` accepts a differing selection only at an exact or near tie
    of transformers' scores: one query given another group (far fewer than 1% of the rows) fails it."""
    from hebrus_torch.__main__ import main

    real = ht.qsa_select
    calls = [0]

    def one_wrong(q, pooled, seq_groups, q_row, q_groups, top_k):
        out = real(q, pooled, seq_groups, q_row, q_groups, top_k)
        if out.shape[0] > 20:                    # the first prefill call (not the 16-token warm-up): its last query
            calls[0] += 1
        if calls[0] == 1 and out.shape[0] > 20:
            groups = int(q_groups[-1])
            chosen = set(out[-1].tolist())
            other = next(g for g in range(groups) if g not in chosen)
            out = out.clone()
            out[-1, 0] = other
            out[-1] = out[-1].sort().values
        return out

    monkeypatch.setattr(ht, "qsa_select", one_wrong)        # the drop-in calls hebrus_torch.qsa_select
    assert main(["--device", "cpu", "--tokens", "64", "--prompt", "48", "--new-tokens", "4"]) == 1
    out = capsys.readouterr().out
    assert "1 of them NOT at a score tie" in out


def test_main_job_without_transformers(monkeypatch, capsys):
    import sys

    from hebrus_torch.__main__ import main

    monkeypatch.setitem(sys.modules, "transformers", None)             # as if it were not installed
    assert main(["--device", "cpu", "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "pip install -e .[hf]" in out and "bitwise identical" in out


def test_moved_anchor_rebuilds_groups(model, device):
    """Groups are anchored at the first visible position: when a row's run starts later (an evicted
    prefix), its groups are rebuilt from the new anchor while the other row keeps its pooled groups."""
    prompt, steps, evict = 30, 6, 6
    ids = tokens(2, prompt + steps, seed=17).to(device)
    low = torch.finfo(torch.float32).min

    def mask_for(start, stop, first_row1):
        visible = torch.ones(2, stop - start, stop, dtype=torch.bool, device=device).tril(start)
        visible[1, :, :first_row1] = False
        return {"indexed_attention": torch.where(visible, 0.0, low)[:, None], "linear_attention": None}

    def run():
        cache = DynamicCache(config=model.config)
        out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True,
                     attention_mask=mask_for(0, prompt, 0)).logits]
        for t in range(prompt, prompt + steps):
            first = 0 if t < prompt + 2 else evict
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                             attention_mask=mask_for(t, t + 1, first)).logits)
        return torch.cat(out, 1)

    ref, got, stats, rm, gm = both(model, run)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats, sparse=True)
    # Per layer: prefill 7 + 7 groups; n = 32 completes group 8 of both rows (+2); then row 1 restarts at
    # position 6: 27 // 4 = 6 groups pooled afresh (row 0 keeps its 8); n = 28 (row 1) and 36 (row 0): +1 each.
    # Where value checks are device-side (CUDA), decode takes the sync-free selection, which pools every
    # group of the call on the device and keeps none: only the prefill's groups are kept.
    if reference.checks_async(torch.device(device)):
        assert stats["qsa_groups_pooled"] == 2 * 14 and stats["qsa_sync_free"] == 2 * steps, stats
    else:
        assert stats["qsa_groups_pooled"] == 2 * (14 + 2 + 6 + 1 + 1)


def test_non_consecutive_positions_fall_back(model, device):
    """A position jump inside a group: qsa_pool refuses it (a hole in RoPE positions); transformers
    ropes the group at its first token regardless, so that call runs the original on the cached keys."""
    ids = tokens(1, 36, seed=18).to(device)
    pos = torch.arange(36, device=device)[None].clone()
    pos[:, 18:] += 1
    ref, got, stats, rm, gm = both(model, lambda: model(ids, position_ids=pos).logits)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert stats.get("qsa_fallback:positions_not_consecutive") == 2 and "qsa_hebrus" not in stats


# ----------------------------------------------------------------------------------------------
# Attention over the selection (hebrus::qsa_attention). The parity tests above already run it: every
# assert_hebrus_path(stats) with sparse=True requires stats["sparse_attention_calls"] > 0.


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sparse_attention_left_padding_rows(device, attn):
    """Left-padding queries see nothing: their attention is transformers' own (every logit compared,
    padding positions included); the real queries attend through qsa_attention, in one-shot and decode."""
    model = random_model(2, device=device, attn_implementation=attn)
    # Token seed 19 gave a near-tie that transformers' own indexer decides differently on CPU and CUDA
    # (its selection masks differ between the two devices at one decode query; hebrus's, the same
    # bits on both, agree with its CPU one); no model can match both, so this test avoids it.
    ids = tokens(2, 40, seed=24).to(device)
    mask = torch.ones_like(ids)
    ids[1, :13], mask[1, :13] = 0, 0

    def run():
        cache = DynamicCache(config=model.config)
        out = [model(ids[:, :34], attention_mask=mask[:, :34], past_key_values=cache, use_cache=True).logits]
        for t in range(34, 40):
            out.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                             use_cache=True).logits)
        return torch.cat(out, 1)

    ref, got, stats, rm, gm = both(model, run)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)
    if not reference.checks_async(torch.device(device)):
        assert stats["sparse_attention_calls"] == 2 * 7
    else:   # CUDA's sync-free decode: its few queries attend densely over the selection mask (docs/dropin.md)
        assert stats["sparse_attention_calls"] == 2 and stats["sparse_attention_skipped:dense_mask"] == 2 * 6, stats


def test_sparse_attention_skipped_when_budget_covers_the_cache(device):
    """A budget of 64 (W = 67 tokens per query) covers a 40-token cache: transformers' attention runs."""
    model = random_model(0, device=device, indexer_budget=64)
    ids = tokens(2, 40, seed=20).to(device)
    ref, got, stats, rm, gm = both(model, lambda: model(ids).logits)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert "sparse_attention_calls" not in stats and stats["sparse_attention_skipped:not_sparser"] == 2, stats


def test_sparse_attention_option_and_output_attentions(model, device):
    """apply(sparse_attention=False) keeps the masked dense attention; output_attentions takes the original
    forward (attention weights are returned, equal to transformers'); re-applying switches it back on."""
    ids = tokens(1, 36, seed=21).to(device)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
        try:
            htx.apply(model, sparse_attention=False)
            htx.reset_stats()
            off = model(ids).logits
            assert "sparse_attention_calls" not in htx.stats() and htx.stats()["sparse_attention_skipped:off"] == 2
            htx.apply(model)                                               # sparse_attention=True again
            htx.reset_stats()
            got = model(ids, output_attentions=True)
            stats = htx.stats()
            assert "sparse_attention_calls" not in stats and stats["sparse_attention_skipped:output_attentions"] == 2
            htx.reset_stats()
            on = model(ids).logits
            assert htx.stats()["sparse_attention_calls"] == 2
        finally:
            htx.revert(model)
    htx.apply(model)
    try:
        htx.reset_stats()
        grad = model(ids).logits                                           # grad enabled: transformers' attention
        assert htx.stats()["sparse_attention_skipped:autograd"] == 2 and "sparse_attention_calls" not in htx.stats()
        assert grad.requires_grad
    finally:
        htx.revert(model)
    for x in (off, got.logits, on, grad.detach()):
        torch.testing.assert_close(x, ref.logits, atol=ATOL, rtol=ATOL)
    assert len(got.attentions) == len(ref.attentions) == 2
    for a, b in zip(got.attentions, ref.attentions):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sparse_attention_layer_outputs_with_grouped_kv_heads(device, attn, monkeypatch):
    """Hq 4 over Hkv 2 and a batch of 3 with left padding: every indexed attention layer's output (not
    only the logits, which attenuate an error) matches transformers' within fp32 rounding, and the op
    reads the cache in place (views of it, never a copy)."""
    model = random_model(3, device=device, attn_implementation=attn, num_attention_heads=4,
                             num_key_value_heads=2)
    ids = tokens(3, 40, seed=22).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    outputs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: outputs.append(out[0].detach().clone()))
             for m in model.modules() if isinstance(m, M.Qwen4ExpTextAttention) and m.indexer is not None]
    reads: list[bool] = []
    op = ht.qsa_attention

    def spy(q, k, v, token_cells, scale=None):
        reads.append(k._is_view() and v._is_view() and k.shape[1] == v.shape[1] == 2)
        return op(q, k, v, token_cells, scale)

    monkeypatch.setattr(ht, "qsa_attention", spy)
    try:
        ref, got, stats, rm, gm = both(model, lambda: chunked(model, ids, [17, 9, 1, 13], attention_mask=mask))
    finally:
        for h in hooks:
            h.remove()
    assert_same(rm, gm)
    assert_hebrus_path(stats)
    assert reads and all(reads), reads
    half = len(outputs) // 2
    assert half == 2 * 4
    real = mask.bool()
    for i, (a, b) in enumerate(zip(outputs[:half], outputs[half:])):
        cols = real[:, :a.shape[1]] if a.shape[1] == real.shape[1] else real[:, -a.shape[1]:]
        scale = float(a[cols].abs().max())         # outputs are ~1e-2: a tolerance relative to their scale
        torch.testing.assert_close(b[cols], a[cols], atol=1e-5 * scale, rtol=1e-5, msg=lambda m: f"layer call {i}: {m}")
    torch.testing.assert_close(got[real], ref[real], atol=ATOL, rtol=ATOL)


def test_dynamic_rope_repools_kept_groups(device):
    """Dynamic-NTK RoPE rewrites inv_freq once decode passes max_position_embeddings: groups pooled
    before are roped with the old frequencies and are pooled again."""
    model = random_model(0, device=device, max_position_embeddings=32,
                             rope_parameters={"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0})
    prompt = tokens(1, 28, seed=3).to(device)

    def run():
        out = model.generate(prompt, past_key_values=DynamicCache(config=model.config), max_new_tokens=20,
                             do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                             output_logits=True)
        return out.sequences, torch.stack(out.logits, 1)

    (ref_ids, ref), (got_ids, got), stats, rm, gm = both(model, run)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert_hebrus_path(stats)


def test_torch_compile_with_a_static_cache(device):
    """A StaticCache has max_cache_len key columns but positions only for the tokens seen so far."""
    model = random_model(0, device=device)
    ids = tokens(1, 30, seed=3).to(device)

    def run(compile_it):
        forward = torch.compile(model, fullgraph=True, backend="aot_eager") if compile_it else model
        cache = StaticCache(config=model.config, max_cache_len=48)
        out = [forward(ids[:, :28], past_key_values=cache, use_cache=True).logits]
        for t in (28, 29):
            out.append(forward(ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                               cache_position=torch.tensor([t], device=device)).logits)
        return torch.cat(out, 1)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            ref = run(False)
            htx.apply(model)
            got = run(True)
    finally:
        htx.revert(model)
        torch._dynamo.reset()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)


def test_deep_copy_of_a_patched_model_reverts(model, device):
    ids = tokens(1, 36, seed=5).to(device)
    with torch.no_grad():
        ref = model(ids).logits
    htx.apply(model)
    try:
        twin = copy.deepcopy(model)
    finally:
        htx.revert(model)
    assert htx.is_applied(twin)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, ref, atol=ATOL, rtol=ATOL)
    htx.revert(twin)
    assert not htx.is_applied(twin)
    for mod in twin.modules():
        assert "forward" not in mod.__dict__ and "_short_conv" not in mod.__dict__, type(mod).__name__
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, ref, atol=ATOL, rtol=ATOL)


def test_backward_gets_transformers_gradients(device):
    """The ops have no backward: with a gradient wanted, the PLE conv and the attention run transformers'
    own code, so every parameter gets the gradient it gets unpatched (the indexer's selection has none)."""
    model = random_model(0, device=device)
    ref, got, stats = gradients_both(model, tokens(1, 36, seed=6).to(device))
    assert stats.get("ple_fallback:autograd", 0) > 0, stats
    assert_same_gradients(ref, got)


def test_token_ids_past_the_ple_vocab_and_float64_take_transformers_path(device):
    """Embeddings resized past the config's vocabulary: transformers hashes such ids anyway, the op refuses
    them (SPEC §2), so that call runs transformers' n-gram forward. A float64 model: the conv likewise."""
    model = random_model(0, device=device)
    model.resize_token_embeddings(72)
    ids = tokens(1, 30, seed=7).to(device)
    ids[0, 5], ids[0, 20] = 70, 66
    ref, got, stats, rm, gm = both(model, lambda: model(ids).logits)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert stats.get("ple_fallback:token_outside_vocab", 0) == 2, stats
    # Chunked: the chunk after one with such an id carries it in its n-gram history, so it too runs
    # transformers' hash; the chunks after that are back on the op.
    ref, got, stats, rm, gm = both(model, lambda: chunked(model, ids, [4, 3, 2, 21]))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert stats.get("ple_fallback:token_outside_vocab", 0) == 2 * 3 and stats.get("ple_ngram", 0) == 2, stats
    # (transformers' MoE cannot run a whole float64 model on CPU: one PLE layer in float64 instead)
    ple = next(m for m in model.modules() if isinstance(m, M.Qwen4ExpTextPLELayer)).double()
    x = torch.randn(2, 9, ple.conv1d.weight.shape[0], dtype=torch.float64, device=device)
    with torch.no_grad():
        ref = ple._short_conv(x, None)
        htx.apply(model)
        try:
            htx.reset_stats()
            got = ple._short_conv(x, None)
            assert htx.stats().get("ple_fallback:dtype", 0) == 1, htx.stats()
        finally:
            htx.revert(model)
    assert got.dtype == torch.float64 and torch.equal(got, ref)


def test_ple_conv_with_a_bias_added_after_apply_falls_back(device):
    model = random_model(0, device=device)
    ids = tokens(1, 30, seed=9).to(device)
    htx.apply(model)
    try:
        ple = next(m for m in model.modules() if isinstance(m, M.Qwen4ExpTextPLELayer))
        conv = ple.conv1d
        conv.bias = torch.nn.Parameter(torch.randn(conv.out_channels, device=device))
    finally:
        htx.revert(model)
    ref, got, stats, rm, gm = both(model, lambda: model(ids).logits)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert stats.get("ple_fallback:conv_not_plain", 0) == 1 and stats.get("ple_conv", 0) == 1, stats


@pytest.mark.parametrize("sizes", [{"indexer_head_dim": 288}, {"indexer_n_heads": 72}])
def test_indexer_beyond_the_kernel_limits_falls_back(sizes):
    """The CPU kernels take indexer head dims up to 256 and up to 64 query heads; transformers runs larger
    ones, so the drop-in runs transformers' indexer there instead of raising."""
    if not has_native_kernel("qsa_select", "cpu"):
        pytest.skip("no native CPU kernel")
    model = random_model(0, **sizes)
    ids = tokens(1, 40, seed=5)
    ref, got, stats, rm, gm = both(model, lambda: model(ids).logits)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert stats["qsa_fallback:kernel_limits"] == 2 and "qsa_hebrus" not in stats, stats


def test_the_host_check_of_group_positions_matches_qsa_pool():
    """On devices whose value checks are asynchronous the drop-in checks a group's RoPE positions on the host
    before qsa_pool (a CUDA device-side assert would leave the device unusable instead of falling back)."""
    from hebrus_torch.errors import HoleError
    from hebrus_torch.integrations.qwen4_exp.groups import _check_consecutive

    cell_pos = torch.arange(12)
    group_cells = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    _check_consecutive(cell_pos, group_cells, cell_pos[group_cells[:, 0].long()])
    jumped = cell_pos.clone()
    jumped[6:] += 1                                  # a jump inside the second group
    with pytest.raises(HoleError, match="consecutive"):
        _check_consecutive(jumped, group_cells, jumped[group_cells[:, 0].long()])
    keys = torch.randn(12, 16)
    with pytest.raises(HoleError):                   # the kernel refuses the same groups
        ht.qsa_pool(keys, jumped, group_cells, jumped[group_cells[:, 0].long()], torch.zeros(16), 1e-6,
                    torch.ones(4))
