"""CUDA fallback (issue 19, SPEC §4 "Errors on GPUs", §6): the reference ops that CUDA runs never
synchronize the host inside a decode step (value checks are device-side asserts), and the drop-in's
decode step adds no synchronization of its own. Run under torch.cuda.set_sync_debug_mode("error"),
which raises at any synchronizing call. Skipped without CUDA."""

import contextlib

import pytest
import torch

import hebrus_torch as ht

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def decode_inputs(dtype=torch.float32, batch=8, channels=64, pool_slots=16):
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    mult = (torch.randint(1, 1 << 40, (3,), generator=gen) * 2 + 1).to(dev)
    sizes = torch.randint(100, 900, (4,), generator=gen).to(dev)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cpu().cumsum(0)[:-1]]).to(dev)
    return dict(
        tokens=torch.randint(0, 50, (batch,), generator=gen).to(dev),
        cu=torch.arange(batch + 1, dtype=torch.int32).to(dev),
        history=torch.randint(0, 50, (batch, 2), generator=gen).to(dev),
        history_pool=torch.randint(0, 50, (pool_slots, 2), generator=gen).to(dev),
        slots=torch.randperm(pool_slots, generator=gen)[:batch].to(torch.int32).to(dev),
        mult=mult, sizes=sizes, offs=offs,
        x=torch.randn(batch, channels, generator=gen).to(dtype).to(dev),
        weight=torch.randn(channels, 4, generator=gen).to(dtype).to(dev),
        state=torch.randn(batch, 9, channels, generator=gen).to(dtype).to(dev),
        state_pool=torch.randn(pool_slots, 9, channels, generator=gen).to(dtype).to(dev),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ple_reference_ops_do_not_synchronize(dtype):
    a = decode_inputs(dtype)
    with no_host_sync():
        ids, hist = ht.ple_ngram_ids(a["tokens"], a["cu"], a["history"], a["mult"], a["sizes"], a["offs"], 2, 50)
        y, state = ht.ple_conv(a["x"], a["weight"], a["cu"], a["state"], 3, "silu")
        ids_s = ht.ple.ops.ple_ngram_ids_slots(a["tokens"], a["cu"], a["history_pool"], a["slots"], a["mult"],
                                               a["sizes"], a["offs"], 2, 50)
        y_s = ht.ple.ops.ple_conv_slots(a["x"], a["weight"], a["cu"], a["state_pool"], a["slots"], 3, "silu")
    assert ids.shape == ids_s.shape and y.shape == y_s.shape == a["x"].shape


def test_reference_conv_is_chunk_invariant_on_cuda():
    """SPEC §6: on its own device the fallback's bits do not depend on how the stream is cut."""
    a = decode_inputs(torch.float32, batch=1)
    n = 13
    x = torch.randn(n, a["x"].shape[1], device="cuda")
    one, s1 = ht.ple_conv(x, a["weight"], torch.tensor([0, n], dtype=torch.int32, device="cuda"),
                          torch.zeros(1, 9, x.shape[1], device="cuda"), 3, "silu")
    state, ys = torch.zeros(1, 9, x.shape[1], device="cuda"), []
    for t in range(n):
        y, state = ht.ple_conv(x[t:t + 1], a["weight"], torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                               state, 3, "silu")
        ys.append(y)
    assert torch.equal(torch.cat(ys), one) and torch.equal(state, s1)


def test_bad_values_are_reported_by_the_device():
    """A bad slot is not checked on the host: the device assert fires at the next synchronization."""
    import subprocess
    import sys
    code = ("import torch, hebrus_torch as ht\n"
            "x = torch.randn(2, 8, device='cuda'); w = torch.randn(8, 4, device='cuda')\n"
            "pool = torch.randn(4, 9, 8, device='cuda')\n"
            "cu = torch.tensor([0, 1, 2], dtype=torch.int32, device='cuda')\n"
            "ht.ple.ops.ple_conv_slots(x, w, cu, pool, torch.tensor([1, 1], dtype=torch.int32, device='cuda'), 3, 'silu')\n"
            "torch.cuda.synchronize()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "slots must lie in [0, S=4) and be distinct" in run.stderr, run.stderr[-2000:]


def decode_step_syncs(model):
    """The synchronizing calls of one decode step (after a prefill and one step), as
    {innermost hebrus_torch frame (prefixed "PLE " inside the drop-in's PLE forwards) or "transformers": count}, under set_sync_debug_mode("warn")."""
    import collections
    import os
    import traceback
    import warnings

    from transformers import DynamicCache

    prompt = torch.randint(4, 64, (1, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    where = collections.Counter()

    def hook(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack() if f"{os.sep}hebrus_torch{os.sep}" in f.filename]
        if not ours:
            where["transformers"] += 1
            return
        ple = any(f.filename.endswith(os.path.join("qwen4_exp", "ple.py")) for f in ours)
        where[("PLE " if ple else "") + f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno} {ours[-1].name}"] += 1

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        step = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        step = model(step, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model(step, past_key_values=cache, use_cache=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return where


def test_dropin_decode_step_ple_adds_no_sync():
    """transformers' own decode step synchronizes (its MoE routing, ~11 calls on this model), so
    set_sync_debug_mode("error") cannot run a whole step; what is checked is where the patched step's
    synchronizations come from: none from the PLE ops or the drop-in's PLE forwards."""
    hf = pytest.importorskip("hf_models")
    from hebrus_torch.integrations import transformers as dropin

    model = hf.random_model(0, device="cuda").to("cuda")
    plain = decode_step_syncs(model)
    assert set(plain) == {"transformers"}
    dropin.apply(model)
    try:
        patched = decode_step_syncs(model)
    finally:
        dropin.revert(model)
    assert patched["transformers"] <= plain["transformers"]   # the patched indexer skips two of transformers'
    assert not [k for k in patched if k.startswith("PLE ")], patched


def test_dropin_decode_step_adds_no_sync():
    """The whole patched decode step (indexer: its sync-free path, qsa_pool/qsa_select/qsa_attention's
    reference; PLE) adds no synchronization to transformers' own (issue 19)."""
    hf = pytest.importorskip("hf_models")
    from hebrus_torch.integrations import transformers as dropin

    model = hf.random_model(0, device="cuda").to("cuda")
    plain = decode_step_syncs(model)
    dropin.apply(model)
    try:
        patched = decode_step_syncs(model)
    finally:
        dropin.revert(model)
    # No synchronization from hebrus_torch at all; transformers' own are those of the unpatched step less
    # the ones of its indexer loop, which the patched step does not run (one nonzero per indexed layer).
    assert set(patched) == {"transformers"}, patched
    assert patched["transformers"] <= plain["transformers"], (patched, plain)


def test_graphed_decode_equals_eager(monkeypatch):
    """The drop-in's decode selection and PLE rows forms replayed from captured CUDA graphs (cuda_graphs:
    keys padded to a bucket, graphs evicted and captured again) give the eager path's tokens and logits,
    one replay per indexer call and per PLE call; HEBRUS_CUDA_GRAPHS=0 turns the graphs off."""
    hf = pytest.importorskip("hf_models")
    from hebrus_torch.integrations import transformers as dropin
    from hebrus_torch.integrations.qwen4_exp import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "BUCKET", 16)          # several buckets in 40 decode steps
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 2)
    model = hf.random_model(0, device="cuda").to("cuda")
    prompt = torch.randint(4, 64, (2, 30), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    dropin.apply(model)
    try:
        out = {}
        for graphs in ("1", "0"):
            monkeypatch.setenv("HEBRUS_CUDA_GRAPHS", graphs)
            cuda_graphs.clear()
            dropin.reset_stats()
            with torch.no_grad():
                out[graphs] = (model.generate(prompt, **kw), dropin.stats())
    finally:
        dropin.revert(model)
        cuda_graphs.clear()
    (got, on), (want, off) = out["1"], out["0"]
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
    assert on["qsa_cuda_graph"] == on["qsa_sync_free"] == off["qsa_sync_free"] > 0, (on, off)
    assert on["ple_cuda_graph"] == 2 * (on["ple_conv"] - 2) > 0, on       # every call but the prefill's two
    assert "qsa_cuda_graph" not in off and "ple_cuda_graph" not in off, off
