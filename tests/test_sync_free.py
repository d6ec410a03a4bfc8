"""The sync-free forms the CUDA fallback runs (issue 19), checked on CPU against the forms they replace:
qsa_select of every query at once (reference._qsa_select_all) against the loop over sequences, and the
drop-in's sync-free indexer (indexer._indexer_sync_free, forced on CPU) against transformers' own."""

from __future__ import annotations

import pytest
import torch

from hebrus_torch import reference
from hebrus_torch._extension import has_native_kernel


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_select_all_queries_at_once_equals_the_loop(seed, top_k):
    gen = torch.Generator().manual_seed(seed)
    rows_n, max_g, dim, hq = (1, 3)[seed % 2], 11, (16, 20)[seed % 2], 2
    pooled = torch.randn(40, dim, generator=gen)
    pooled[5] = pooled[7]                                                 # exact ties
    pooled[9] = 0.0
    seq_groups = torch.randint(0, 40, (rows_n, max_g), generator=gen, dtype=torch.int32)
    seq_groups[-1, 8:] = -1                                               # past the end of the last row
    tq = 9
    q = torch.randn(tq, hq, dim, generator=gen)
    q[0] = 0.0                                                            # every score 0: ties throughout
    q_row = torch.randint(0, rows_n, (tq,), generator=gen, dtype=torch.int32)
    limit = torch.where(q_row == rows_n - 1, 8, max_g)
    q_groups = (torch.rand(tq, generator=gen) * (limit + 1)).floor().to(torch.int32)
    q_groups[1] = 0
    want = reference.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)          # CPU: the loop
    out = torch.full((tq, top_k), -1, dtype=torch.int32)
    got = reference._qsa_select_all(q, pooled, seq_groups, q_row.long(), q_groups.long(), top_k, out)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_scores_per_query_keys_equal_shared_keys():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 3, 40, generator=gen)
    keys = torch.randn(7, 40, generator=gen)
    shared = reference.qsa_scores(q, keys)
    per_query = reference.qsa_scores(q, keys.expand(5, 7, 40))
    assert torch.equal(shared, per_query)
    assert torch.equal(reference.qsa_scores(q[2:3], keys[4:6]), shared[2:3, 4:6])      # batch-invariant


@pytest.mark.parametrize("shape", [(1, 1, 3, 8), (3, 5, 3, 8), (2, 7, 4, 2), (2, 1, 2, 3)])
def test_ngram_ids_rows_equal_the_op(shape):
    batch, length, n, heads = shape
    gen = torch.Generator().manual_seed(length)
    ctx = n - 1
    tok = torch.randint(0, 50, (batch, length), generator=gen)
    tok[tok % 7 == 0] = 2                                                # eos inside the rows
    hist = torch.randint(0, 50, (batch, ctx), generator=gen)
    hist[0, 0] = 2
    mult = torch.randint(1, 1 << 40, (n,), generator=gen) * 2 + 1
    sizes = torch.randint(100, 900, (ctx * heads,), generator=gen)
    offs = torch.cumsum(sizes, 0) - sizes
    cu = torch.arange(batch + 1, dtype=torch.int32) * length
    want, _ = reference.ple_ngram_ids(tok.reshape(-1), cu, hist, mult, sizes, offs, 2, 50)
    got = reference.ple_ngram_ids_rows(tok, hist, mult, sizes, offs, 2, 50)
    assert torch.equal(got, want.view(batch, length, -1))
    bad = tok.clone()
    bad[-1, -1] = 50
    with pytest.raises(Exception, match="outside"):
        reference.ple_ngram_ids_rows(bad, hist, mult, sizes, offs, 2, 50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 16, 4, 1), (3, 5, 8, 4, 3), (2, 9, 4, 3, 2), (2, 2, 5, 1, 1)])
@pytest.mark.parametrize("activation", ["silu", "none"])
def test_conv_rows_equal_the_op(dtype, shape, activation):
    batch, length, channels, width, dilation = shape
    gen = torch.Generator().manual_seed(length * width)
    x = torch.randn(batch, length, channels, generator=gen).to(dtype)
    w = torch.randn(channels, width, generator=gen).to(dtype)
    state = torch.randn(batch, channels, (width - 1) * dilation, generator=gen).to(dtype).transpose(1, 2)
    cu = torch.arange(batch + 1, dtype=torch.int32) * length
    want, _ = reference.ple_conv(x.reshape(-1, channels), w, cu, state.contiguous(), dilation, activation)
    got = reference.ple_conv_rows(x, w, state, dilation, activation)          # a strided state, as the cache's
    assert torch.equal(got, want.view(batch, length, channels))


# ------------------------------------------------------------------------------------------------
# The drop-in's sync-free indexer, forced on CPU.

transformers = pytest.importorskip("transformers", reason="needs transformers==5.23.0 (pip install -e .[hf])")

from hebrus_torch.integrations import transformers as htx  # noqa: E402
from hebrus_torch.integrations.qwen4_exp import indexer as indexer_mod  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from hf_models import random_model  # noqa: E402
from test_transformers_dropin import ATOL, assert_same, both, tokens  # noqa: E402


@pytest.fixture
def sync_free(monkeypatch):
    """Every call with at most 4 queries takes the sync-free indexer, on CPU too."""
    calls = []

    def forced(device, batch, length, kv, dim):
        calls.append(length)
        return length <= 4
    monkeypatch.setattr(indexer_mod, "_sync_free", forced)
    return calls


@pytest.mark.hf
def test_sync_free_greedy_decode_equals_transformers(sync_free):
    model = random_model(0, device="cpu")
    prompt = tokens(1, 30, seed=3, eos_at=[(0, 12)])
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref, got, stats, rm, gm = both(model, lambda: model.generate(prompt, **kw))
    assert torch.equal(got, ref)
    assert_same(rm, gm)
    assert stats.get("qsa_sync_free", 0) == 2 * 15 and stats.get("sparse_attention_calls", 0) > 0, stats
    assert not any(k.startswith("qsa_fallback") for k in stats), stats


@pytest.mark.hf
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sync_free_left_padded_decode_and_chunks(sync_free, attn):
    """Left padding (queries that see nothing), 1- to 3-token steps, both attention forms."""
    model = random_model(2, device="cpu", attn_implementation=attn)
    ids = tokens(2, 44, seed=24)
    mask = torch.ones_like(ids)
    ids[1, :13], mask[1, :13] = 0, 0

    def run():
        cache = DynamicCache(config=model.config)
        out = [model(ids[:, :2], attention_mask=mask[:, :2], past_key_values=cache, use_cache=True).logits]
        t = 2
        for step in [3, 1, 2] * 6 + [1] * 4 + [2]:
            out.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], past_key_values=cache,
                             use_cache=True).logits)
            t += step
        assert t == 44
        return torch.cat(out, 1)

    ref, got, stats, rm, gm = both(model, run)
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert stats.get("qsa_sync_free", 0) > 0, stats
    if has_native_kernel("qsa_attention", "cpu"):     # (a build without the extension attends over the mask)
        assert stats.get("sparse_attention_calls", 0) > 0, stats


@pytest.mark.hf
def test_sync_free_hole_is_transformers_rule_without_fallback(sync_free):
    """A hole inside a choosing query's visible run: transformers' rule (groups of consecutive visible
    keys) with no fallback; on_hole="raise" fails closed (on CPU, at once)."""
    model = random_model(0, device="cpu", attn_implementation="eager")
    ids = tokens(1, 40, seed=10)
    mask = torch.tril(torch.ones(40, 40, dtype=torch.bool))
    mask[20:, 9] = False
    mask4 = torch.where(mask, 0.0, torch.finfo(torch.float32).min)[None, None]

    def run(prefill=36):
        cache = DynamicCache(config=model.config)
        out = [model(ids[:, :prefill], attention_mask={"indexed_attention": mask4[:, :, :prefill, :prefill],
                                                      "linear_attention": None},
                     past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, 40):
            out.append(model(ids[:, t:t + 1], attention_mask={"indexed_attention": mask4[:, :, t:t + 1, :t + 1],
                                                             "linear_attention": None},
                             past_key_values=cache, use_cache=True).logits)
        return torch.cat(out, 1)

    ref, got, stats, rm, gm = both(model, run)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_same(rm, gm)
    assert stats.get("qsa_sync_free", 0) == 2 * 4, stats
    assert not any(k.startswith("qsa_fallback") and k != "qsa_fallback:hole" for k in stats), stats
    with pytest.raises(RuntimeError, match="hole"):                      # the decode step at query 20
        both(model, lambda: run(prefill=19), on_hole="raise")


@pytest.mark.hf
def test_ple_rows_form_decode_equals_transformers(sync_free, monkeypatch):
    """The PLE rows form (the CUDA path: no native kernel), forced on CPU, through prefill and decode."""
    from hebrus_torch.integrations.qwen4_exp import ple as ple_mod

    monkeypatch.setattr(ple_mod, "_rows_form", lambda op, device: not torch.compiler.is_compiling())
    calls = []
    for name in ("ple_conv_rows", "ple_ngram_ids_rows"):
        def spy(*args, _f=getattr(reference, name), _n=name):
            calls.append(_n)
            return _f(*args)
        monkeypatch.setattr(reference, name, spy)
    model = random_model(0, device="cpu")
    prompt = tokens(1, 30, seed=3, eos_at=[(0, 12)])
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    ref, got, stats, rm, gm = both(model, lambda: model.generate(prompt, **kw))
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=ATOL, rtol=ATOL)
    assert stats.get("ple_conv", 0) > 0 and stats.get("ple_ngram", 0) > 0, stats
    assert not any(k.startswith("ple_fallback") for k in stats), stats
    assert calls.count("ple_conv_rows") == stats["ple_conv"] and "ple_ngram_ids_rows" in calls, (calls, stats)


def _selection_inputs(batch, length, kv, seed, float_mask):
    """Inputs of indexer.sync_free_mask: left padding in row 1, a hole in row 0, positions with an offset."""
    gen = torch.Generator().manual_seed(seed)
    hq, dim, rot = 2, 16, 8
    q = torch.randn(batch, length, hq, dim, generator=gen)
    keys = torch.randn(batch, kv, dim, generator=gen)
    visible = torch.ones(batch, length, kv, dtype=torch.bool)
    visible &= torch.arange(kv) <= (kv - length + torch.arange(length))[:, None]      # causal
    if batch > 1:
        visible[1, :, :3] = False                                                     # left padding
    visible[0, :, kv // 2] = False                                                    # a hole
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min) if float_mask else visible
    freqs = (torch.arange(kv) + 5.0)[:, None] * (1.0 / 10000 ** (torch.arange(0, rot, 2) / rot))
    emb = torch.cat((freqs, freqs), -1).expand(batch, kv, rot)
    return q, keys, mask, emb.cos(), emb.sin(), torch.randn(dim, generator=gen) * 0.1


@pytest.mark.hf
@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("bucket", [7, 16, 256])
@pytest.mark.parametrize("batch,length,kv", [(1, 1, 30), (2, 1, 41), (2, 3, 10), (1, 2, 64)])
def test_padded_static_call_equals_the_call(batch, length, kv, bucket, float_mask, monkeypatch):
    """cuda_graphs.StaticCall with the indexer's padding (what a CUDA graph replays: the key dimension padded
    to a bucket, the extra mask columns masked out) gives the unpadded call's selection mask bitwise, also
    after a longer call of the same bucket left stale columns behind."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    from hebrus_torch.integrations.qwen4_exp import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "BUCKET", bucket)
    spec = indexer_mod.SyncFreeSpec(ratio=4, top_k=3, width=4 * 3 + 3, eps=1e-6, raise_on_hole=False,
                                    rope=apply_rotary_pos_emb)
    args = _selection_inputs(batch, length, kv, kv, float_mask)
    want = indexer_mod.sync_free_mask(spec, *args)
    assert want.shape == (batch, 1, length, kv) and want.any()
    size = cuda_graphs.padded_keys(kv)
    assert size >= kv and size % bucket == 0
    call = cuda_graphs.StaticCall(indexer_mod.sync_free_mask, spec, args, indexer_mod._key_padding(kv, args[2].dtype))
    call.fill(args)
    assert torch.equal(call.compute()[..., :kv], want)
    if size > kv:
        longer = _selection_inputs(batch, length, size, 99, float_mask)
        call.fill(longer)
        assert torch.equal(call.compute(), indexer_mod.sync_free_mask(spec, *longer))
        call.fill(args)
        assert torch.equal(call.compute()[..., :kv], want)


@pytest.mark.parametrize("captured", [True, False])
def test_a_call_is_counted_as_graphed_only_when_its_graph_replays(captured, monkeypatch):
    """Issue 27: ``qsa_cuda_graph`` / ``ple_cuda_graph`` counted a call whose capture failed (it then ran
    eagerly). The CUDA parts are stubbed so that the bookkeeping runs on CPU."""
    import types
    import warnings

    from hebrus_torch.integrations.qwen4_exp import cuda_graphs
    from hebrus_torch.integrations.qwen4_exp.stats import _STATS

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(cuda_graphs, "_failed", False)
    monkeypatch.setattr(cuda_graphs, "_graphs", type(cuda_graphs._graphs)())

    def capture(self):
        if not captured:
            raise cuda_graphs.CaptureError("stubbed capture failure")
        self.out = self.compute()
        self.graph = types.SimpleNamespace(replay=lambda: self.out.copy_(self.compute()))

    monkeypatch.setattr(cuda_graphs.StaticCall, "capture", capture)

    def double(spec, x):
        return x * 2

    monkeypatch.setitem(_STATS, "test_graphed", 0)
    x = torch.arange(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(2):
            assert torch.equal(cuda_graphs.replay(double, None, [x], counter="test_graphed"), x * 2)
    assert _STATS["test_graphed"] == (2 if captured else 0)
    del _STATS["test_graphed"]
    # the drop-in's PLE call site counts through replay
    from hebrus_torch.integrations.qwen4_exp import ple

    monkeypatch.setattr(cuda_graphs, "usable", lambda *tensors: True)
    monkeypatch.setattr(cuda_graphs, "_failed", False)
    before = _STATS["ple_cuda_graph"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert torch.equal(ple._maybe_graphed(double, "spec", (x,), 1), x * 2)
    assert _STATS["ple_cuda_graph"] - before == (1 if captured else 0)
