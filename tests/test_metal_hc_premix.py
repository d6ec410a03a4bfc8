"""mps_kernels/hc_premix.metal (issue 37) run in the emulator with the glue's grids: hebrus::hc_premix
(two launches, low and mix) against the reference (transformers' Qwen4ExpTextGatedResidual, op for op)
in every dtype, with and without inject weights, for one row and many (a prefill chunk's), hidden sizes
below and above a SIMD-group with a tail; hebrus::hc_post_combine bitwise equal to the CPU kernel; rows
independent of the rest of the launch (bitwise), in every schedule, with guard pages at either end of
every buffer; bad metadata refused with the CPU kernel's messages."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
import msl_emu  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(rows, hc, hidden, rank, dtype, inject=True, seed=0):
    """Streams and weights at the scale of a trained layer (weights ~ 1 / sqrt(fan-in))."""
    g = torch.Generator().manual_seed(seed)
    dim = hc * hidden
    h = (torch.randn(rows, dim, generator=g) * 2).to(dtype)
    norm_weight = (torch.randn(dim, generator=g) * 0.3).to(dtype)
    down = (torch.randn(rank, dim, generator=g) * dim ** -0.5).to(dtype)
    up = (torch.randn(dim, rank, generator=g) * 2 * rank ** -0.5).to(dtype)
    inj = (torch.randn(hc, dim, generator=g) * dim ** -0.5).to(dtype) if inject else None
    return h, norm_weight, down, up, inj, hc, 1e-6


def close(got, want, dtype, fp32_tol=(1e-6, 1e-5)):
    """fp32: the dot products' order and the platform's exp / rsqrt only (within ``fp32_tol``: atol, rtol).
    Half types: every op rounds as the module's, so a value differs from the module's only where an fp32 sum
    in another order rounds to a neighbour and that propagates (within 2 ulp of the dtype, rare)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=fp32_tol[0], rtol=fp32_tol[1])
    else:
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), want.float(), atol=2 * eps, rtol=2 * eps)
        assert got.numel() == 0 or float((got != want).float().mean()) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inject", [True, False])
@pytest.mark.parametrize("rows,hc,hidden,rank", [(1, 4, 40, 12), (7, 4, 32, 8), (3, 3, 24, 33), (2, 1, 70, 5),
                                                 (40, 2, 16, 4)])
def test_premix_matches_reference(dtype, inject, rows, hc, hidden, rank):
    args = make(rows, hc, hidden, rank, dtype, inject, seed=rows + hidden)
    assert_outputs_close(hebrus_emu.hc_premix(*args), reference.hc_premix(*args), dtype)


def assert_outputs_close(got, want, dtype, fp32_tol=(1e-6, 1e-5)):
    """A pre-mix's (mixed, weights) against the reference's: shapes, dtype, then :func:`close`."""
    (mixed, weights), (want_mixed, want_weights) = got, want
    assert mixed.shape == want_mixed.shape and weights.shape == want_weights.shape
    assert mixed.dtype == weights.dtype == dtype
    close(mixed, want_mixed, dtype, fp32_tol)
    close(weights, want_weights, dtype, fp32_tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_post_combine_equals_the_cpu_kernel(dtype):
    g = torch.Generator().manual_seed(2)
    hyper = (torch.randn(9, 4 * 40, generator=g) * 3).to(dtype)
    out, inject = torch.randn(9, 40, generator=g).to(dtype), (torch.rand(9, 4, generator=g) * 2).to(dtype)
    assert torch.equal(hebrus_emu.hc_post_combine(hyper, out, inject), reference.hc_post_combine(hyper, out, inject))


def test_strided_inputs_are_read_as_their_values():
    h, w, down, up, inj, hc, eps = make(4, 2, 24, 6, torch.float32, seed=6)
    wide = torch.cat([h, h], dim=1)[:, : h.shape[1]]        # rows with a stride of 2 D
    close(hebrus_emu.hc_premix(wide, w, down, up.t().contiguous().t(), inj, hc, eps)[0],
          reference.hc_premix(h, w, down, up, inj, hc, eps)[0], torch.float32)
    out = torch.randn(4, 48)[:, ::2]
    assert torch.equal(hebrus_emu.hc_post_combine(wide, out, wide[:, :2]),
                       reference.hc_post_combine(h, out.contiguous(), h[:, :2].contiguous()))


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_rows_do_not_depend_on_the_launch(sched, guard):
    """A row's outputs are bitwise the same alone and among others, in every schedule, with the guard
    page before or after every buffer."""
    h, w, down, up, inj, hc, eps = make(11, 4, 24, 10, torch.bfloat16, seed=7)
    mixed, weights = hebrus_emu.hc_premix(h, w, down, up, inj, hc, eps, sched=sched, seed=4, guard=guard)
    out = torch.randn(11, 24).to(torch.bfloat16)
    combined = hebrus_emu.hc_post_combine(h, out, weights, sched=sched, seed=4, guard=guard)
    for row in (0, 5, 10):
        m1, w1 = hebrus_emu.hc_premix(h[row:row + 1].clone(), w, down, up, inj, hc, eps, guard=guard)
        assert torch.equal(m1[0], mixed[row]) and torch.equal(w1[0], weights[row])
        c1 = hebrus_emu.hc_post_combine(h[row:row + 1].clone(), out[row:row + 1].clone(),
                                        weights[row:row + 1].clone(), guard=guard)
        assert torch.equal(c1[0], combined[row])


def test_launches_two_kernels_whatever_the_rows():
    for rows in (1, 64, 512):
        args = make(rows, 4, 32, 8, torch.float16)
        launches = hebrus_emu.launches("hc_premix", *args)
        assert [launch["kernel"] for launch in launches] == ["hc_premix_low_half", "hc_premix_mix_half"]


def test_empty_rows_launch_nothing():
    args = make(0, 4, 16, 8, torch.float16)
    assert hebrus_emu.launches("hc_premix", *args) == []
    mixed, weights = hebrus_emu.hc_premix(*args)
    assert mixed.shape == (0, 16) and weights.shape == (0, 4)
    empty = torch.empty(0, 64)
    assert hebrus_emu.launches("hc_post_combine", empty, empty[:, :16], empty[:, :4]) == []


@pytest.mark.parametrize("bad,match", [
    (lambda h, w, d, u, i, hc, e: (h, w, d, u, i, 3, e), "hc_count must be >= 1 and divide D = 64, got 3"),
    (lambda h, w, d, u, i, hc, e: (h, w[:-1], d, u, i, hc, e), "norm_weight must have D = 64 entries, got 63"),
    (lambda h, w, d, u, i, hc, e: (h, w, d[:, :-1], u, i, hc, e), r"down must be \[R >= 1, D = 64\]"),
    (lambda h, w, d, u, i, hc, e: (h, w, d, u, i[:-1], hc, e), r"inject must be \[hc_count = 4, D = 64\]"),
    (lambda h, w, d, u, i, hc, e: (h, w, d, u.half(), i, hc, e), "up dtype torch.float16 must match h dtype"),
    (lambda h, w, d, u, i, hc, e: (h, w, d, u, i, hc, -1.0), "eps must be >= 0, got -1"),
])
def test_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(*make(3, 4, 16, 5, torch.float32))
    with pytest.raises(HebrusError, match=match):
        hebrus_emu.hc_premix(*args)
    with pytest.raises(HebrusError, match=match):
        reference.hc_premix(*args)
