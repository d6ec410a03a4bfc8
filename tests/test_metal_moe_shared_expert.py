"""mps_kernels/moe_shared_expert.metal (issue 37) run in the emulator with the glue's grid: a MoE block's shared
expert times its gate, added to the routed output, against the reference (transformers' modules, op for op):
every dtype, widths that are and are not multiples of the 16 lanes, the gate as moe_route returns it (a strided
column), rows independent of the rest of the launch (bitwise) in every schedule and guard placement, bad
metadata refused with the CPU kernel's messages. The same for moe_shared_expert_quantized (the projections
affine-quantized: 4 and 8 bits, groups of 32, 64 and 128), also against the CPU kernel (the QuantizedLinear
modules' bits)."""

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
from moe_fused_cases import SHARED_BAD, SHARED_QUANT_BAD, quantized_shared_args  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(rows, hidden, inter, dtype, seed=0, k=3):
    """x, routed [T, H]; gate_proj, up_proj [I, H]; down_proj [H, I]; the gate: column k of [T, k + 1]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    routed = (torch.randn(rows, hidden, generator=g) * 0.5).to(dtype)
    gp = (torch.randn(inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    up = (torch.randn(inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    dp = (torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    gate = torch.rand(rows, k + 1, generator=g).to(dtype)[:, k:]
    return x, routed, gp, up, dp, gate


def close(got, want, dtype):
    """Each dot product is summed in another order than torch's mm and silu is the CPU kernels', so values
    differ by roundings: fp32 to ~1e-6, half types by a few ulp of the intermediate roundings."""
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if dtype != torch.float32:
        assert float((got != want).float().mean()) < 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,inter", [(4, 64, 32), (3, 40, 24), (1, 256, 80), (6, 17, 5)])
def test_matches_reference(dtype, rows, hidden, inter):
    args = make(rows, hidden, inter, dtype, seed=hidden + inter)
    close(hebrus_emu.moe_shared_expert(*args), reference.moe_shared_expert(*args), dtype)


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_rows_do_not_depend_on_the_launch(sched, guard):
    x, routed, gp, up, dp, gate = make(7, 48, 20, torch.float32, seed=3)
    whole = hebrus_emu.moe_shared_expert(x, routed, gp, up, dp, gate, sched=sched, seed=4, guard=guard)
    for t in (0, 3, 6):
        one = hebrus_emu.moe_shared_expert(x[t:t + 1].clone(), routed[t:t + 1].clone(), gp, up, dp,
                                           gate[t:t + 1].clone(), guard=guard)
        assert torch.equal(one[0], whole[t])


def test_empty_rows_launch_nothing():
    args = make(0, 16, 8, torch.float16)
    assert hebrus_emu.launches("moe_shared_expert", *args) == []
    assert hebrus_emu.moe_shared_expert(*args).shape == (0, 16)


@pytest.mark.parametrize("bad,match", SHARED_BAD)
def test_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(make(3, 8, 6, torch.float32))
    with pytest.raises(HebrusError, match=match):
        hebrus_emu.moe_shared_expert(*args)
    with pytest.raises(HebrusError, match=match):
        reference.moe_shared_expert(*args)


# ---- moe_shared_expert_quantized ---------------------------------------------------------------------------------

def quantized_close(got, args, dtype):
    """Against the reference (torch's sums of the folded groups) to rounding, and against the CPU kernel (the
    modules' bits: quantized_linear's fold, at::silu) to the roundings of silu's last ulp."""
    import hebrus_torch

    close(got, reference.moe_shared_expert_quantized(*args), dtype)
    close(got, hebrus_torch.moe_shared_expert_quantized(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,hidden,inter,group_size", [(4, 64, 32, 32), (3, 128, 64, 64), (2, 256, 128, 128),
                                                         (1, 96, 160, 32)])
def test_quantized_matches_reference(dtype, bits, rows, hidden, inter, group_size):
    args = quantized_shared_args(rows, hidden, inter, dtype, bits, group_size, seed=hidden + inter + bits)
    launches = hebrus_emu.launches("moe_shared_expert_quantized", *args)
    suffix = f"q{bits}_{hebrus_emu.METAL_TYPE[dtype]}"
    assert [l["kernel"] for l in launches] == [f"moe_shared_expert_quantized_act_{suffix}",
                                               f"moe_shared_expert_quantized_down_{suffix}"]
    quantized_close(hebrus_emu.moe_shared_expert_quantized(*args), args, dtype)


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_quantized_rows_do_not_depend_on_the_launch(sched, guard):
    args = quantized_shared_args(7, 64, 96, torch.float32, 4, 32, seed=3)
    whole = hebrus_emu.moe_shared_expert_quantized(*args, sched=sched, seed=4, guard=guard)
    for t in (0, 3, 6):
        one = hebrus_emu.moe_shared_expert_quantized(args[0][t:t + 1].clone(), args[1][t:t + 1].clone(), *args[2:11],
                                                     args[11][t:t + 1].clone(), *args[12:], guard=guard)
        assert torch.equal(one[0], whole[t])


def test_quantized_empty_rows_launch_nothing():
    args = quantized_shared_args(0, 64, 32, torch.float16, 8, 32)
    assert hebrus_emu.launches("moe_shared_expert_quantized", *args) == []
    assert hebrus_emu.moe_shared_expert_quantized(*args).shape == (0, 64)


@pytest.mark.parametrize("bad,match", SHARED_QUANT_BAD)
def test_quantized_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(quantized_shared_args(3, 64, 32, torch.float32, 4, 32))
    with pytest.raises(HebrusError, match=match):
        hebrus_emu.moe_shared_expert_quantized(*args)
    with pytest.raises(HebrusError, match=match):
        reference.moe_shared_expert_quantized(*args)
