"""mps_kernels/hc_premix.metal's quantized pre-mix (hebrus::hc_premix_quantized; hc_premix_quantized_low /
_mix, variants q4 / q8) run in the emulator with the glue's grids: against the reference (the module path
with QuantizedLinear projections) in every dtype, bits 4 and 8, groups 32 / 64 / 128, with and without
inject weights, one row and many, groups inside a stream and groups that span two; rows independent of the
rest of the launch (bitwise), in every schedule, with guard pages at either end of every buffer; two launches
whatever the rows; bad metadata refused with the CPU kernel's messages."""

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
from hebrus_torch.moe.quantize import quantize  # noqa: E402
from test_metal_hc_premix import assert_outputs_close, close as dense_close  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(rows, hc, hidden, rank, dtype, bits=4, group=32, inject=True, seed=0):
    """Streams and quantized weights at the scale of a trained layer (weights ~ 1 / sqrt(fan-in)): the
    arguments of hc_premix_quantized after h."""
    g = torch.Generator().manual_seed(seed)
    dim = hc * hidden
    h = (torch.randn(rows, dim, generator=g) * 2).to(dtype)
    norm_weight = (torch.randn(dim, generator=g) * 0.3).to(dtype)
    down = quantize((torch.randn(rank, dim, generator=g) * dim ** -0.5).to(dtype), bits, group)
    up = quantize((torch.randn(dim, rank, generator=g) * 2 * rank ** -0.5).to(dtype), bits, group)
    inj = quantize((torch.randn(hc, dim, generator=g) * dim ** -0.5).to(dtype), bits, group) if inject \
        else (None, None, None)
    return (h, norm_weight, *down, *up, *inj, hc, 1e-6, group, bits)


# test_metal_hc_premix's bounds, but the kernels fold each group's sums in another order than the reference's
# torch sums (of codes up to 255 times the inputs): fp32 within 1e-5 + 1e-4 relative.
FP32_TOL = (1e-5, 1e-4)


def close(got, want, dtype):
    dense_close(got, want, dtype, FP32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("inject", [True, False])
@pytest.mark.parametrize("rows,hc,hidden,rank,group", [(1, 4, 32, 64, 32), (7, 4, 48, 64, 64), (3, 2, 64, 128, 128),
                                                       (2, 4, 40, 32, 32), (40, 2, 16, 32, 32)])
def test_premix_matches_reference(dtype, bits, inject, rows, hc, hidden, rank, group):
    args = make(rows, hc, hidden, rank, dtype, bits, group, inject, seed=rows + hidden + bits)
    assert_outputs_close(hebrus_emu.hc_premix_quantized(*args), reference.hc_premix_quantized(*args), dtype, FP32_TOL)


def test_strided_inputs_are_read_as_their_values():
    args = make(4, 2, 32, 32, torch.float32, seed=6)
    h = args[0]
    wide = torch.cat([h, h], dim=1)[:, : h.shape[1]]        # rows with a stride of 2 D
    up_q = args[5]
    strided = (wide, *args[1:5], up_q.t().contiguous().t(), *args[6:])
    close(hebrus_emu.hc_premix_quantized(*strided)[0], reference.hc_premix_quantized(*args)[0], torch.float32)


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_rows_do_not_depend_on_the_launch(sched, guard):
    """A row's outputs are bitwise the same alone and among others, in every schedule, with the guard
    page before or after every buffer."""
    args = make(11, 4, 24, 32, torch.bfloat16, bits=8, group=32, seed=7)   # groups span two streams
    mixed, weights = hebrus_emu.hc_premix_quantized(*args, sched=sched, seed=4, guard=guard)
    for row in (0, 5, 10):
        m1, w1 = hebrus_emu.hc_premix_quantized(args[0][row:row + 1].clone(), *args[1:], guard=guard)
        assert torch.equal(m1[0], mixed[row]) and torch.equal(w1[0], weights[row])


@pytest.mark.parametrize("bits", [4, 8])
def test_launches_two_kernels_whatever_the_rows(bits):
    for rows in (1, 64, 512):
        args = make(rows, 4, 32, 32, torch.float16, bits=bits)
        launches = hebrus_emu.launches("hc_premix_quantized", *args)
        assert [launch["kernel"] for launch in launches] == [f"hc_premix_quantized_low_q{bits}_half",
                                                             f"hc_premix_quantized_mix_q{bits}_half"]


def test_empty_rows_launch_nothing():
    args = make(0, 4, 16, 32, torch.float16)
    assert hebrus_emu.launches("hc_premix_quantized", *args) == []
    mixed, weights = hebrus_emu.hc_premix_quantized(*args)
    assert mixed.shape == (0, 16) and weights.shape == (0, 4)


def _replace(args, index, value):
    return args[:index] + (value,) + args[index + 1:]


# indices into make(): 0 h, 1 norm_weight, 2-4 down, 5-7 up, 8-10 inject, 11 hc, 12 eps, 13 group, 14 bits
@pytest.mark.parametrize("bad,match", [
    (lambda a: _replace(a, 14, 2), "bits must be 4 or 8, got 2"),
    (lambda a: _replace(a, 11, 3), "hc_count must be >= 1 and divide D = 64, got 3"),
    (lambda a: _replace(a, 2, a[2][:, :-1]), r"down_q must be \[R >= 1, 64 \* bits / 32 = 8\]"),
    (lambda a: _replace(a, 6, a[6].half()), "up_scales dtype torch.float16 must match h dtype torch.float32"),
    (lambda a: _replace(a, 8, a[8][:-1]), r"inject_q must be \[hc_count = 4, 64 \* bits / 32 = 8\]"),
    (lambda a: _replace(a, 10, None), "inject_q, inject_scales and inject_biases must be given together"),
    (lambda a: _replace(a, 12, -1.0), "eps must be >= 0, got -1"),
])
def test_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(make(3, 4, 16, 32, torch.float32))
    with pytest.raises(HebrusError, match=match):
        hebrus_emu.hc_premix_quantized(*args)
    with pytest.raises(HebrusError, match=match):
        reference.hc_premix_quantized(*args)
