"""mps_kernels/hc_rms_norm.metal (issue 37) run in the emulator with the glue's grid, against the
reference (transformers' Qwen4ExpTextRMSNorm, op for op): every dtype, groups of fewer and more than
32 features and with a tail, one group per row (an ungrouped norm), rows independent of the rest of
the launch (bitwise), every schedule, guard pages at either end of every buffer, bad metadata refused
with the CPU kernel's messages."""

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


def make(rows, dim, dtype, seed=0, weight_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    weight = (torch.randn(dim, generator=g) * 0.3).to(weight_dtype or dtype)
    return x, weight


def close(got, want, dtype):
    if dtype == torch.float32:  # the squares are summed in another order, rsqrt is the platform's
        torch.testing.assert_close(got, want, atol=3e-6, rtol=3e-6)
    else:  # fp32 math rounded once at the end, as the module: equal except rare 1-ulp ties
        diff = (got.float() - want.float()).abs()
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(1e-3)
        assert bool((diff <= ulp * 1.01).all()) and float((got != want).float().mean()) < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim,group", [(5, 128, 32), (3, 4 * 40, 40), (7, 80, 80), (1, 4 * 100, 100),
                                            (9, 12, 3)])
def test_matches_reference(dtype, rows, dim, group):
    x, w = make(rows, dim, dtype, seed=dim + group)
    close(hebrus_emu.hc_rms_norm(x, w, group, 1e-6), reference.hc_rms_norm(x, w, group, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_heads_of_a_wider_projection(dtype):
    """x [T, H, D] cut from [T, H, 2D] (q and the output gate of one projection): any strides."""
    x, w = make(4 * 3, 2 * 48, dtype, seed=5)
    x = x.view(4, 3, 96)[..., :48]
    close(hebrus_emu.hc_rms_norm(x, w[:48], 48, 1e-6), reference.hc_rms_norm(x, w[:48], 48, 1e-6), dtype)


def test_bfloat16_weight_of_a_float32_activation():
    x, w = make(4, 96, torch.float32, seed=3, weight_dtype=torch.bfloat16)
    close(hebrus_emu.hc_rms_norm(x, w, 24, 1e-5), reference.hc_rms_norm(x, w, 24, 1e-5), torch.float32)


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_rows_do_not_depend_on_the_launch(sched, guard):
    """A row's output is bitwise the same alone and among others, in every schedule, with the guard
    page before or after every buffer."""
    x, w = make(11, 4 * 24, torch.float32, seed=7)
    together = hebrus_emu.hc_rms_norm(x, w, 24, 1e-6, sched=sched, seed=4, guard=guard)
    for row in (0, 5, 10):
        alone = hebrus_emu.hc_rms_norm(x[row:row + 1].clone(), w, 24, 1e-6, guard=guard)
        assert torch.equal(alone[0], together[row])


def test_empty_rows_launch_nothing():
    x, w = make(0, 64, torch.float16)
    assert hebrus_emu.launches("hc_rms_norm", x, w, 16, 1e-6) == []
    assert hebrus_emu.hc_rms_norm(x, w, 16, 1e-6).shape == (0, 64)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x, w[:-1], 16, 1e-6), "weight must have D = 64 entries, got 63"),
    (lambda x, w: (x, w, 24, 1e-6), "group_size must be >= 1 and divide D = 64, got 24"),
    (lambda x, w: (x, w, 16, -1.0), "eps must be >= 0, got -1"),
    (lambda x, w: (x.long(), w, 16, 1e-6), "x must have dtype"),
    (lambda x, w: (x[0, 0], w, 16, 1e-6), r"x must be at least 1-D, got shape \(\)"),
])
def test_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(*make(3, 64, torch.float32))
    with pytest.raises(HebrusError, match=match):
        hebrus_emu.hc_rms_norm(*args)
    with pytest.raises(HebrusError, match=match):
        reference.hc_rms_norm(*args)
