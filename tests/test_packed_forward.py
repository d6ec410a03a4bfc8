"""Qwen4Exp's packed forward (hebrus_torch.models.qwen4_exp) and the runner's boundary: a sequence given two
rows of one step is refused with nothing changed; the pieces the drop-in shares compute transformers' own;
``ChunkStep.linear_attention`` is a deprecated alias of the forward's GDN layer."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_models import modeling, tiny_indexer_config  # noqa: E402  (skips without transformers)
from tolerance import near  # noqa: E402

import hebrus_torch as ht
from hebrus_torch import model_cache
from hebrus_torch.engine import Engine, EngineConfig
from hebrus_torch.errors import HebrusError
from hebrus_torch.models.qwen4_exp import PackedQwen4Exp
from hebrus_torch.models.qwen4_exp.attention import (attention_projections, gated_output, index_keys,
                                                      index_queries_and_keys)
from hebrus_torch.models.qwen4_exp.gdn import packed_gated_delta_net


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_indexer_config(layer_types=["linear_attention", "indexed_attention"], ple_layer_ids=[1])
    model = modeling.Qwen4ExpForCausalLM(config).eval()
    with torch.no_grad():  # transformers zero-initialises norms and the PLE conv: give every path a say
        for name, p in model.named_parameters():
            if "conv1d" in name or "norm" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_a_sequence_given_two_rows_is_refused_and_nothing_changes(model):
    """Batch.pack keyed by sequence kept one row of a sequence listed twice while the runner counted both rows'
    tokens (issue 33): the step ran on the wrong rows. Now a DuplicateSequenceError naming it, before anything."""
    engine = Engine(model, EngineConfig(capacity_tokens=128, max_sequences=3))
    a, b = engine.cache.new_sequence(), engine.cache.new_sequence()
    engine.runner.execute([a, b], [[5, 6, 7], [8, 9]], [True, True], [0, 0])
    before = engine.cache.digest()
    with pytest.raises(HebrusError, match=r"appears twice in one batch") as info:
        engine.runner.execute([a, b, a], [[10, 11], [12], [13]], [True, True, True], [3, 2, 5])
    assert isinstance(info.value, model_cache.DuplicateSequenceError)
    assert str(a) in str(info.value) and "rows 0 and 2" in str(info.value)
    assert engine.cache.digest() == before
    twin = copy.deepcopy(engine)        # the step still runs, as if the refused one never came
    want = twin.runner.execute([a, b], [[10, 11], [12]], [True, True], [3, 2])
    got = engine.runner.execute([a, b], [[10, 11], [12]], [True, True], [3, 2])
    assert torch.equal(got, want)


def test_a_transaction_refuses_a_batch_listing_a_sequence_twice(model):
    cache = ht.ModelCache.from_transformers(model, capacity_tokens=64, max_sequences=2, with_kv=True)
    a = cache.new_sequence()
    batch = ht.Batch([a, a], torch.tensor([5, 6]), torch.tensor([0, 1, 2], dtype=torch.int32), [None, None])
    before = cache.digest()
    with pytest.raises(model_cache.DuplicateSequenceError, match=r"ModelCache: a sequence appears twice"):
        with cache.transaction(batch):
            pass
    assert cache.digest() == before


def test_linear_attention_is_a_deprecated_alias_of_the_forwards_gdn_layer(model):
    layer = model.model.layers[0]
    x = torch.randn(5, model.config.hidden_size)
    outs, digests = [], []
    for alias in (False, True):
        cache = ht.ModelCache.from_transformers(model, capacity_tokens=64, max_sequences=2, with_kv=True)
        seqs = [cache.new_sequence(), cache.new_sequence()]
        with torch.no_grad(), cache.transaction(ht.Batch.from_rows(seqs, [[5, 6, 7], [8, 9]])) as step:
            if alias:
                with pytest.warns(DeprecationWarning, match="packed_gated_delta_net"):
                    outs.append(step.linear_attention(0, layer.linear_attn, x))
            else:
                outs.append(packed_gated_delta_net(step, 0, layer.linear_attn, x))
        digests.append(cache.digest())
    assert torch.equal(outs[0], outs[1]) and digests[0] == digests[1]


def test_the_forward_refuses_a_gdn_holder_of_other_heads(model):
    cache = ht.ModelCache.from_transformers(model, capacity_tokens=64, max_sequences=2, with_kv=True)
    other = modeling.Qwen4ExpForCausalLM(tiny_indexer_config(linear_num_value_heads=4))
    with pytest.raises(HebrusError, match=r"decoder layer 0's linear attention .*module.num_v_heads is 4"):
        PackedQwen4Exp(other.model, cache)


def test_index_keys_alone_are_the_projection_s_key_columns(model):
    """index_keys (the MTP block's K/V write: no queries) gives index_queries_and_keys' raw keys, to rounding for a
    plain Linear (its key rows alone) and bitwise through any other module (the whole projection, sliced)."""
    indexer = model.model.layers[1].self_attn.indexer
    x = torch.randn(5, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(x[None], torch.arange(5).view(1, 1, -1).expand(3, 1, -1))
    with torch.no_grad():
        _, raw = index_queries_and_keys(indexer, x, cos[0], sin[0], modeling.apply_rotary_pos_emb)
        keys = index_keys(indexer, x)
        assert keys.shape == raw.shape
        torch.testing.assert_close(keys, raw, atol=1e-6, rtol=1e-6)
        handle = indexer.index_qk_proj.register_forward_hook(lambda mod, args, out: out)   # (not a plain Linear now)
        try:
            assert torch.equal(index_keys(indexer, x), raw)
        finally:
            handle.remove()
        proj = indexer.index_qk_proj                # a forward of the instance's own is called, not bypassed
        proj.forward = lambda inp: torch.nn.functional.linear(inp, proj.weight) * 2
        try:
            assert torch.equal(index_keys(indexer, x), proj(x)[..., -raw.shape[-1]:].reshape(raw.shape))
        finally:
            del proj.forward


def test_shared_projections_are_transformers_own(model):
    """What the drop-in and the engine share, on [B, T, ...] (the drop-in) and [T, ...] (the engine), against
    transformers' attention and indexer forwards: bitwise where the modules run, within the fused ops' tolerance
    where the norms run as hebrus::hc_rms_norm / rms_norm_rope (tests/tolerance.py)."""
    attn = model.model.layers[1].self_attn
    x = torch.randn(2, 6, model.config.hidden_size)
    positions = torch.arange(6).view(1, 1, -1).expand(3, 2, -1)
    cos, sin = model.model.rotary_emb(x, positions)
    rope = modeling.apply_rotary_pos_emb
    with torch.no_grad():
        q_index, raw = index_queries_and_keys(attn.indexer, x, cos, sin, rope)
        qk = attn.indexer.index_qk_proj(x)
        d = attn.indexer.index_head_dim
        want_q = rope(attn.indexer.q_layernorm(qk[..., :-d].reshape(2, 6, -1, d)), cos=cos, sin=sin, unsqueeze_dim=2)
        assert near(q_index, want_q) and torch.equal(raw, qk[..., -d:])
        packed_q, packed_raw = index_queries_and_keys(attn.indexer, x[1], cos[1], sin[1], rope)
        # The module on the same 6 rows bit for bit; the 12-row product's rows within the tolerance (BLAS picks its
        # kernel by the row count, SPEC §8: equal on the Xeon's MKL, not on a Zen 3's).
        assert torch.equal(packed_raw, attn.indexer.index_qk_proj(x[1])[..., -d:])
        assert near(packed_q, q_index[1]) and near(packed_raw, raw[1])

        q, k, v, gate = attention_projections(attn, x)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        mask = torch.zeros(2, 1, 6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), torch.finfo().min)
        interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                                   modeling.eager_attention_forward)
        dense, _ = interface(attn, q, k, v.transpose(1, 2), mask, scaling=attn.scaling)
        want, _ = attn(x, (cos, sin), mask)       # 6 tokens, within the budget: each query attends to its history
        assert near(gated_output(attn, dense, gate), want)
