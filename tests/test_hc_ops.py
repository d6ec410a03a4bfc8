"""The fused hyper-connection ops (issue 37). hebrus::hc_rms_norm: Qwen4Exp's RMSNorm of every row in one
dispatch; hebrus::hc_premix: the whole pre-mix of a Qwen4ExpTextGatedResidual (norm, low-rank down / up,
SiLU, sigmoid, stream mix, inject weights); hebrus::hc_post_combine: the decoder layer's injection of a
sublayer's output into the streams. On CPU each matches transformers' own modules within a tolerance (every
dtype: tests/tolerance.py; hc_post_combine bit for bit), hc_rms_norm's and hc_post_combine's rows are independent of
each other, bad metadata is refused with a HebrusError, opcheck (schema, fake, autograd registration) passes, and
they compile in a full graph. The packed forward's
hyper_premix / post_combine give the modules' own outputs, fused where the modules are stock and as
module calls where they are not (a hooked or wrapped projection)."""

from __future__ import annotations

import pytest
import torch

from hf_models import modeling, tiny_config
from tolerance import near

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.hc import hyper_premix, post_combine
from hebrus_torch.hc import premix as premix_module
from hebrus_torch.hc.premix import fused_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rms_module(dim, group, dtype, seed=0, eps=1e-6):
    norm = modeling.Qwen4ExpTextRMSNorm(dim, group_size=group, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim,group", [(7, 4 * 48, 48), (5, 64, None), (1, 4 * 320, 320), (33, 12, 3)])
def test_cpu_kernel_matches_the_modules(dtype, rows, dim, group):
    norm = rms_module(dim, group, dtype, seed=dim)
    x = (torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    with torch.no_grad():
        want = norm(x)
        got = hebrus_torch.hc_rms_norm(x, norm.weight, group or dim, norm.eps)
        assert near(got, want)
        assert torch.equal(reference.hc_rms_norm(x, norm.weight, group or dim, norm.eps), want)
        assert torch.equal(fused_norm(norm, x), got)


def test_rows_are_independent():
    norm = rms_module(96, 24, torch.bfloat16, seed=2)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    together = hebrus_torch.hc_rms_norm(x, norm.weight, 24, 1e-6)
    for row in (0, 4, 8):
        assert torch.equal(hebrus_torch.hc_rms_norm(x[row:row + 1], norm.weight, 24, 1e-6)[0], together[row])


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x, w[:-1], 16, 1e-6), "weight must have D = 64 entries, got 63"),
    (lambda x, w: (x, w, 24, 1e-6), "group_size must be >= 1 and divide D = 64, got 24"),
    (lambda x, w: (x, w, 0, 1e-6), "group_size must be >= 1"),
    (lambda x, w: (x, w, 16, -1.0), "eps must be >= 0, got -1"),
    (lambda x, w: (x.long(), w, 16, 1e-6), "x must have dtype"),
    (lambda x, w: (x[0, 0], w, 16, 1e-6), r"x must be at least 1-D, got shape \(\)"),
    (lambda x, w: (x, w.int(), 16, 1e-6), "weight must have dtype"),
])
def test_bad_metadata_raises_and_changes_nothing(bad, match):
    x, w = torch.randn(3, 64), torch.randn(64)
    x0, w0 = x.clone(), w.clone()
    for fn in (hebrus_torch.hc_rms_norm, reference.hc_rms_norm):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(x, w))
    assert torch.equal(x, x0) and torch.equal(w, w0)


def test_opcheck():
    x, w = torch.randn(5, 64), torch.randn(64)
    torch.library.opcheck(torch.ops.hebrus.hc_rms_norm.default, (x, w, 16, 1e-6))
    torch.library.opcheck(torch.ops.hebrus.hc_rms_norm.default, (x.to(torch.bfloat16), w, 64, 1e-5))


def test_compile_fullgraph():
    x, w = torch.randn(5, 64), torch.randn(64)
    fn = torch.compile(hebrus_torch.hc_rms_norm, fullgraph=True, backend="eager")
    assert torch.equal(fn(x, w, 16, 1e-6), hebrus_torch.hc_rms_norm(x, w, 16, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("combine", [True, False])
def test_hyper_premix_gives_the_modules_output(dtype, combine):
    config = tiny_config(hc_count=4, hc_lowrank=8, hidden_size=32)
    hc = modeling.Qwen4ExpTextGatedResidual(config, use_combine=combine)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in hc.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    hc = hc.to(dtype)
    h = torch.randn(6, 4 * 32, generator=gen).to(dtype)
    with torch.no_grad():
        want, got = hc(h), hyper_premix(hc, h)
    want, got = (want, got) if combine else ((want,), (got,))
    assert len(want) == len(got) and all(near(b, a) for a, b in zip(want, got))


def test_a_wrapped_norm_runs_as_itself():
    norm = rms_module(64, 16, torch.float32)
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    x = torch.randn(3, 64)
    assert torch.equal(fused_norm(norm, x), seen[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_of_heads_matches_the_module(dtype):
    """q [T, H, D] cut from a wider projection (a non-contiguous view), as attention's q_norm sees it."""
    norm = rms_module(16, None, dtype, seed=6)
    q = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(1)).to(dtype)[..., :16]
    with torch.no_grad():
        assert near(fused_norm(norm, q), norm(q))


# ---- hc_premix, hc_post_combine ---------------------------------------------------------------------------

def gated_residual(dtype, combine=True, hc_count=4, lowrank=8, hidden=32, seed=9):
    config = tiny_config(hc_count=hc_count, hc_lowrank=lowrank, hidden_size=hidden)
    hc = modeling.Qwen4ExpTextGatedResidual(config, use_combine=combine)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hc.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return hc.to(dtype)


def premix_args(hc):
    inject = hc.block_inject_weight.weight if hc.block_inject_weight is not None else None
    return (hc.hc_norm.weight, hc.input_mix_weight_down.weight, hc.input_mix_weight_up.weight, inject, hc.hc_count,
            hc.hc_norm.eps)


def streams(rows, hc, dtype, seed=3):
    return (torch.randn(rows, hc.hc_count * hc.hidden_size, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize("rows,hc_count,lowrank,hidden", [(6, 4, 8, 32), (1, 4, 20, 40), (13, 3, 5, 24), (2, 2, 4, 16)])
def test_premix_cpu_kernel_matches_the_modules(dtype, combine, rows, hc_count, lowrank, hidden):
    hc = gated_residual(dtype, combine, hc_count, lowrank, hidden, seed=rows + lowrank)
    h = streams(rows, hc, dtype)
    with torch.no_grad():
        want = hc(h)
        mixed, weights = hebrus_torch.hc_premix(h, *premix_args(hc))
        ref_mixed, ref_weights = reference.hc_premix(h, *premix_args(hc))
    want_mixed = want[0] if combine else want
    assert near(mixed, want_mixed) and torch.equal(ref_mixed, want_mixed)
    if combine:
        assert near(weights, want[2]) and torch.equal(ref_weights, want[2])
    else:
        assert weights.shape == ref_weights.shape == (rows, 0)
    assert mixed.dtype == weights.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_post_combine_gives_the_layers_bits(dtype):
    gen = torch.Generator().manual_seed(5)
    hyper = torch.randn(7, 4 * 24, generator=gen).to(dtype)
    out, inject = torch.randn(7, 24, generator=gen).to(dtype), (torch.rand(7, 4, generator=gen) * 2).to(dtype)
    want = hyper + (out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
    for got in (hebrus_torch.hc_post_combine(hyper, out, inject), reference.hc_post_combine(hyper, out, inject),
                post_combine(hyper, out, inject)):
        assert torch.equal(got, want)


def test_post_combine_rows_are_independent():
    """(The pre-mix's CPU kernel calls ATen's linear, as the modules do: its rows are as independent as BLAS
    makes them, SPEC §8; the engine's row_invariant fixture runs it row by row, tests/test_engine.py.)"""
    hc = gated_residual(torch.bfloat16, seed=4)
    h = streams(9, hc, torch.bfloat16, seed=8)
    weights = hebrus_torch.hc_premix(h, *premix_args(hc))[1]
    out = torch.randn(9, hc.hidden_size).to(torch.bfloat16)
    combined = hebrus_torch.hc_post_combine(h, out, weights)
    for row in (0, 4, 8):
        c1 = hebrus_torch.hc_post_combine(h[row:row + 1], out[row:row + 1], weights[row:row + 1])
        assert torch.equal(c1[0], combined[row])


def _premix_inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen), torch.randn(5, 64, generator=gen),
            torch.randn(64, 5, generator=gen), torch.randn(4, 64, generator=gen))


@pytest.mark.parametrize("bad,match", [
    (lambda h, w, d, u, i: (h, w, d, u, i, 3, 1e-6), "hc_count must be >= 1 and divide D = 64, got 3"),
    (lambda h, w, d, u, i: (h, w, d, u, i, 0, 1e-6), "hc_count must be >= 1"),
    (lambda h, w, d, u, i: (h, w[:-1], d, u, i, 4, 1e-6), "norm_weight must have D = 64 entries, got 63"),
    (lambda h, w, d, u, i: (h, w, d.double(), u, i, 4, 1e-6), "down must have dtype"),
    (lambda h, w, d, u, i: (h, w, d.half(), u, i, 4, 1e-6), "down dtype torch.float16 must match h dtype torch.float32"),
    (lambda h, w, d, u, i: (h, w, d[:, :-1], u, i, 4, 1e-6), r"down must be \[R >= 1, D = 64\], got shape \(5, 63\)"),
    (lambda h, w, d, u, i: (h, w, d, u[:, :-1], i, 4, 1e-6), r"up must be \[D = 64, R = 5\], got shape \(64, 4\)"),
    (lambda h, w, d, u, i: (h, w, d, u, i[:-1], 4, 1e-6), r"inject must be \[hc_count = 4, D = 64\], got shape \(3, 64\)"),
    (lambda h, w, d, u, i: (h, w, d, u, i.bfloat16(), 4, 1e-6), "inject dtype torch.bfloat16 must match h dtype"),
    (lambda h, w, d, u, i: (h, w, d, u, i, 4, -1.0), "eps must be >= 0, got -1"),
    (lambda h, w, d, u, i: (h[0], w, d, u, i, 4, 1e-6), r"h must be 2-D, got shape \(64,\)"),
    (lambda h, w, d, u, i: (h.long(), w, d, u, i, 4, 1e-6), "h must have dtype"),
])
def test_premix_bad_metadata_raises_and_changes_nothing(bad, match):
    args = _premix_inputs()
    before = [t.clone() for t in args]
    for fn in (hebrus_torch.hc_premix, reference.hc_premix):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(*args))
    assert all(torch.equal(a, b) for a, b in zip(args, before))


@pytest.mark.parametrize("bad,match", [
    (lambda h, o, i: (h, o[:-1], i), "hyper, out and inject must have the same rows, got 3, 2 and 3"),
    (lambda h, o, i: (h, o[:, :-1], i), "hyper must have hc \\* hidden = 4 \\* 15 features, got 64"),
    (lambda h, o, i: (h, o.half(), i), "out dtype torch.float16 must match hyper dtype torch.float32"),
    (lambda h, o, i: (h, o, i.bfloat16()), "inject dtype torch.bfloat16 must match hyper dtype torch.float32"),
    (lambda h, o, i: (h, o, i[0]), r"inject must be 2-D, got shape \(4,\)"),
])
def test_post_combine_bad_metadata_raises(bad, match):
    args = (torch.randn(3, 64), torch.randn(3, 16), torch.randn(3, 4))
    for fn in (hebrus_torch.hc_post_combine, reference.hc_post_combine):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(*args))


def test_premix_and_post_combine_opcheck():
    h, w, d, u, i = _premix_inputs()
    torch.library.opcheck(torch.ops.hebrus.hc_premix.default, (h, w, d, u, i, 4, 1e-6))
    torch.library.opcheck(torch.ops.hebrus.hc_premix.default, (h, w, d, u, None, 2, 1e-6))
    b = [t.to(torch.bfloat16) for t in (h, d, u, i)]
    torch.library.opcheck(torch.ops.hebrus.hc_premix.default, (b[0], w, b[1], b[2], b[3], 4, 1e-5))
    torch.library.opcheck(torch.ops.hebrus.hc_post_combine.default, (h, torch.randn(3, 16), torch.randn(3, 4)))


def test_premix_and_post_combine_compile_fullgraph():
    hc = gated_residual(torch.float32)
    h = streams(5, hc, torch.float32)

    def layer_hc(h, out):
        x, hyper, inject = hyper_premix(hc, h)
        return post_combine(hyper, out + x, inject)

    out = torch.randn(5, hc.hidden_size)
    fn = torch.compile(layer_hc, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(fn(h, out), layer_hc(h, out))


def _count_premix_calls(monkeypatch):
    calls = []
    real = premix_module.hc_premix
    monkeypatch.setattr(premix_module, "hc_premix", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_hyper_premix_is_one_fused_op_of_a_stock_module(monkeypatch, dtype):
    calls = _count_premix_calls(monkeypatch)
    hc = gated_residual(dtype)
    h = streams(4, hc, dtype)
    with torch.no_grad():
        want, got = hc(h), hyper_premix(hc, h)
    assert calls == [1] and all(near(b, a) for a, b in zip(want, got))


@pytest.mark.parametrize("wrap", ["hook", "bias", "subclass", "instance forward", "global hook"])
def test_a_wrapped_projection_runs_as_a_module_call(monkeypatch, wrap):
    """A user's wrapped projection (LoRA-style subclass, a hook, a bias, a forward replaced on the instance) is
    called, not bypassed; with a global forward hook every module of the pre-mix is called (the hook sees what the
    module call shows it)."""
    calls = _count_premix_calls(monkeypatch)
    hc = gated_residual(torch.float32)
    seen = []
    if wrap == "hook":
        hc.input_mix_weight_up.register_forward_hook(lambda mod, args, out: seen.append(1))
    elif wrap == "instance forward":
        down = hc.input_mix_weight_down
        down.forward = lambda x: seen.append(1) or torch.nn.functional.linear(x, down.weight) * 0.5
    elif wrap == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: seen.append(type(mod).__name__))
    elif wrap == "bias":
        hc.input_mix_weight_down.bias = torch.nn.Parameter(torch.randn(hc.input_mix_weight_down.out_features))
    else:
        class Scaled(torch.nn.Linear):
            def forward(self, x):
                seen.append(1)
                return super().forward(x) * 0.5

        old = hc.block_inject_weight
        hc.block_inject_weight = Scaled(old.in_features, old.out_features, bias=False)
        hc.block_inject_weight.weight = old.weight
    h = streams(3, hc, torch.float32)
    try:
        with torch.no_grad():
            want, got = hc(h), hyper_premix(hc, h)
    finally:
        if wrap == "global hook":
            handle.remove()
    assert calls == [] and all(near(b, a) for a, b in zip(want, got))
    if wrap == "global hook":
        assert len(seen) % 2 == 0 and seen[:len(seen) // 2] == seen[len(seen) // 2:] \
            and "Linear" in seen and type(hc).__name__ in seen
    else:
        assert seen == ([] if wrap == "bias" else [1, 1])
