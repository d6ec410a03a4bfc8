"""mps_kernels/moe_experts.metal run in the emulator with the glue's launches, against the CPU kernel.

The Metal kernels sum every dot product in the CPU kernel's order and use its silu, so the emulated GPU
gives the CPU kernel's bits (every dtype; H and I with and without a tail past a multiple of 16; one
row and many; experts hit by many rows); rows are independent of the batch; every schedule, both guard
sides and contraction on and off agree; an expert id out of range is reported through the stream's error
buffer with the CPU kernel's message; the launch count does not depend on the experts hit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
import hebrus_torch  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402
from test_moe_experts import REL_TOL, make_inputs  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [  # rows, hidden, inter, experts, top_k
    (1, 64, 32, 4, 2),
    (3, 40, 24, 5, 3),     # tails in H and I
    (9, 48, 16, 3, 3),     # every expert hit by several rows
    (2, 17, 9, 2, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bits_of_the_cpu_kernel(dtype, shape):
    args = make_inputs(*shape, dtype, seed=sum(shape))
    got = hebrus_emu.moe_experts(*args)
    assert torch.equal(got, hebrus_torch.moe_experts(*args))
    want = reference.moe_experts(*args)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= REL_TOL[dtype] * want.float().abs().max().item()


@pytest.mark.parametrize("ids_dtype,weights_dtype", [(torch.int32, torch.float32), (torch.int64, torch.bfloat16)])
def test_id_and_weight_dtypes(ids_dtype, weights_dtype):
    args = make_inputs(4, 32, 16, 4, 2, torch.bfloat16, ids_dtype=ids_dtype, weights_dtype=weights_dtype)
    assert torch.equal(hebrus_emu.moe_experts(*args), hebrus_torch.moe_experts(*args))


def test_rows_are_independent_of_the_batch():
    x, ids, w, gu, dn = make_inputs(6, 32, 16, 4, 2, torch.float16, seed=7)
    whole = hebrus_emu.moe_experts(x, ids, w, gu, dn)
    for t in (0, 5):
        assert torch.equal(hebrus_emu.moe_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn)[0], whole[t])


@pytest.mark.parametrize("sched,guard,contract", [("reverse", "start", "off"), ("random", "end", "off"),
                                                  ("forward", "end", "fast")])
def test_schedules_guards_and_contraction_agree(sched, guard, contract):
    args = make_inputs(3, 40, 24, 4, 2, torch.bfloat16, seed=9)
    want = hebrus_emu.moe_experts(*args)
    assert torch.equal(hebrus_emu.moe_experts(*args, sched=sched, seed=11, guard=guard, contract=contract), want)


def test_empty_and_top_k_zero_launch_nothing():
    x, ids, w, gu, dn = make_inputs(3, 32, 16, 4, 2, torch.float32)
    assert hebrus_emu.launches("moe_experts", x[:0], ids[:0], w[:0], gu, dn) == []
    assert hebrus_emu.launches("moe_experts", x, ids[:, :0], w[:, :0], gu, dn) == []
    assert torch.equal(hebrus_emu.moe_experts(x, ids[:, :0], w[:, :0], gu, dn), torch.zeros(3, 32))


def test_launches_do_not_depend_on_the_experts_hit():
    x, ids, w, gu, dn = make_inputs(4, 32, 16, 8, 2, torch.float32)
    spread = hebrus_emu.launches("moe_experts", x, ids, w, gu, dn)
    one = hebrus_emu.launches("moe_experts", x, torch.zeros_like(ids), w, gu, dn)
    key = [(launch["kernel"], launch["threads"], launch["group"]) for launch in spread]
    assert [launch["kernel"] for launch in spread] == ["moe_experts_act_float", "moe_experts_down_float",
                                                       "moe_experts_sum_float"]
    assert key == [(launch["kernel"], launch["threads"], launch["group"]) for launch in one]


@pytest.mark.parametrize("bad", [4, -2])
def test_expert_id_out_of_range_is_reported(bad):
    x, ids, w, gu, dn = make_inputs(3, 32, 16, 4, 2, torch.float32)
    ids = ids.clone()
    ids[1, 1] = bad
    with pytest.raises(HebrusError) as cpu:
        hebrus_torch.moe_experts(x, ids, w, gu, dn)
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"^hebrus::moe_experts: topk_ids\[1, 1\]"):
        hebrus_emu.moe_experts(x, ids, w, gu, dn)
    assert hebrus_emu.reported() == [str(cpu.value)]


def test_metadata_errors_before_any_launch():
    x, ids, w, gu, dn = make_inputs(3, 32, 16, 4, 2, torch.float32)
    with pytest.raises(HebrusError, match=r"hebrus::moe_experts: down must have shape \(E, H, I\)"):
        hebrus_emu.moe_experts(x, ids, w, gu, dn[:, :, :8])
    with pytest.raises(HebrusError, match="hebrus::moe_experts: gate_up dtype torch.float16 must match x dtype"):
        hebrus_emu.launches("moe_experts", x, ids, w, gu.half(), dn)


# ---- moe_experts_quantized (moe_experts_quantized.metal) ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128)])
def test_quantized_bits_of_the_cpu_kernel(dtype, bits, group):
    from test_moe_quantized import quantized_inputs

    args = quantized_inputs(3, 128, 128, 4, 2, dtype, bits, group, seed=bits + group)
    got = hebrus_emu.moe_experts_quantized(*args)
    assert torch.equal(got, hebrus_torch.moe_experts_quantized(*args))
    names = [launch["kernel"] for launch in hebrus_emu.launches("moe_experts_quantized", *args)]
    t = hebrus_emu.METAL_TYPE[dtype]
    assert names == [f"moe_experts_quantized_act_q{bits}_{t}", f"moe_experts_quantized_down_q{bits}_{t}",
                     f"moe_experts_sum_{t}"]


def test_quantized_schedules_and_bad_id():
    from test_moe_quantized import quantized_inputs

    args = list(quantized_inputs(2, 64, 32, 3, 2, torch.bfloat16, 8, 32, seed=4))
    want = hebrus_emu.moe_experts_quantized(*args)
    assert torch.equal(hebrus_emu.moe_experts_quantized(*args, sched="random", seed=5, guard="start"), want)
    args[1] = args[1].clone()
    args[1][1, 0] = 7
    with pytest.raises(hebrus_emu.ASYNC_ERROR,
                       match=r"^hebrus::moe_experts_quantized: topk_ids\[1, 0\] = 7 is not an expert id in \[0, E=3\)"):
        hebrus_emu.moe_experts_quantized(*args)


# ---- quantized_linear (moe_experts_quantized.metal) --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group,rows,out", [(4, 32, 1, 37), (8, 64, 5, 20), (4, 128, 3, 9), (8, 32, 9, 16)])
def test_quantized_linear_bits_of_the_cpu_kernel(dtype, bits, group, rows, out):
    from test_quantized_linear import linear_inputs

    args = linear_inputs(rows, 256, out, dtype, bits, group, seed=rows + out)
    got = hebrus_emu.quantized_linear(*args)
    assert torch.equal(got, hebrus_torch.quantized_linear(*args))
    launches = hebrus_emu.launches("quantized_linear", *args)
    assert [launch["kernel"] for launch in launches] == [f"quantized_linear_q{bits}_{hebrus_emu.METAL_TYPE[dtype]}"]


def test_quantized_linear_schedules_rows_and_empty():
    from test_quantized_linear import linear_inputs

    x, *rest = linear_inputs(6, 128, 19, torch.bfloat16, 4, 32, seed=2)
    want = hebrus_emu.quantized_linear(x, *rest)
    for sched, guard in (("reverse", "start"), ("random", "end")):
        assert torch.equal(hebrus_emu.quantized_linear(x, *rest, sched=sched, seed=3, guard=guard), want)
    assert torch.equal(hebrus_emu.quantized_linear(x[4:5], *rest)[0], want[4])
    assert hebrus_emu.launches("quantized_linear", x[:0], *rest) == []
    with pytest.raises(HebrusError, match=r"hebrus::quantized_linear: wq must have shape \(out, in \* bits / 32\)"):
        hebrus_emu.launches("quantized_linear", x, rest[0][:, :3], *rest[1:])
