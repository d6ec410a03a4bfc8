"""hebrus::hc_rms_norm (issue 37): Qwen4Exp's RMSNorm of every row in one dispatch. On CPU it gives
transformers' Qwen4ExpTextRMSNorm's bits (grouped as the hyper-connections' hc_norm, and ungrouped as
q_norm / k_norm), rows are independent of each other, bad metadata is refused with a HebrusError,
opcheck (schema, fake, autograd registration) passes, and it compiles in a full graph. The packed
forward's hyper-connection pre-mix (hebrus_torch.hc.hyper_premix) gives the module's own output."""

from __future__ import annotations

import pytest
import torch

from hf_models import modeling, tiny_config

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.hc import hyper_premix
from hebrus_torch.hc.premix import fused_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rms_module(dim, group, dtype, seed=0, eps=1e-6):
    norm = modeling.Qwen4ExpTextRMSNorm(dim, group_size=group, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim,group", [(7, 4 * 48, 48), (5, 64, None), (1, 4 * 320, 320), (33, 12, 3)])
def test_cpu_kernel_gives_the_modules_bits(dtype, rows, dim, group):
    norm = rms_module(dim, group, dtype, seed=dim)
    x = (torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    with torch.no_grad():
        want = norm(x)
        got = hebrus_torch.hc_rms_norm(x, norm.weight, group or dim, norm.eps)
        assert torch.equal(got, want)
        assert torch.equal(reference.hc_rms_norm(x, norm.weight, group or dim, norm.eps), want)
        assert torch.equal(fused_norm(norm, x), want)


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
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_wrapped_norm_runs_as_itself():
    norm = rms_module(64, 16, torch.float32)
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    x = torch.randn(3, 64)
    assert torch.equal(fused_norm(norm, x), seen[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_of_heads_gives_the_modules_bits(dtype):
    """q [T, H, D] cut from a wider projection (a non-contiguous view), as attention's q_norm sees it."""
    norm = rms_module(16, None, dtype, seed=6)
    q = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(1)).to(dtype)[..., :16]
    with torch.no_grad():
        assert torch.equal(fused_norm(norm, q), norm(q))
