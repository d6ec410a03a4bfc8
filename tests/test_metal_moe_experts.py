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


@pytest.mark.parametrize("rows", [3, 20], ids=["decode", "grouped"])
@pytest.mark.parametrize("sched,guard,contract", [("reverse", "start", "off"), ("random", "end", "off"),
                                                  ("forward", "end", "fast")])
def test_schedules_guards_and_contraction_agree(sched, guard, contract, rows):
    args = make_inputs(rows, 40, 24, 4, 2, torch.bfloat16, seed=9)
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


@pytest.mark.parametrize("rows,row", [(3, 1), (10, 7)], ids=["decode", "grouped"])  # act / route reports
@pytest.mark.parametrize("bad", [4, -2])
def test_expert_id_out_of_range_is_reported(bad, rows, row):
    x, ids, w, gu, dn = make_inputs(rows, 32, 16, 4, 2, torch.float32)
    ids = ids.clone()
    ids[row, 1] = bad
    with pytest.raises(HebrusError) as cpu:
        hebrus_torch.moe_experts(x, ids, w, gu, dn)
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=rf"^hebrus::moe_experts: topk_ids\[{row}, 1\]"):
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


# ---- the grouped (prefill) path: route, act_grouped, down_grouped, sum ---------------------------------------

GROUPED_SHAPES = [  # rows, hidden, inter, experts, top_k, with T * k >= max(E, 16)
    (40, 40, 24, 4, 2),     # tails in H and I; several tiles per expert
    (20, 300, 40, 16, 3),   # H over three staging steps with a tail; I over three output blocks, the last partial
    (48, 32, 16, 64, 2),    # 96 pairs over 64 experts: most hit once or not at all
]


def kernel_names(op, *args):
    return [launch["kernel"] for launch in hebrus_emu.launches(op, *args)]


def split_rows(args, cuts):
    """The op's row arguments (x, ids, weights) cut at `cuts`; the weights stay whole."""
    x, ids, w, *rest = args
    bounds = [0, *cuts, x.shape[0]]
    return [(x[a:b], ids[a:b], w[a:b], *rest) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GROUPED_SHAPES)
def test_grouped_bits_of_the_cpu_kernel(dtype, shape):
    args = make_inputs(*shape, dtype, seed=sum(shape))
    t = hebrus_emu.METAL_TYPE[dtype]
    assert kernel_names("moe_experts", *args) == ["moe_experts_route", f"moe_experts_act_grouped_{t}",
                                                  f"moe_experts_down_grouped_{t}", f"moe_experts_sum_{t}"]
    got = hebrus_emu.moe_experts(*args)
    assert torch.equal(got, hebrus_torch.moe_experts(*args))
    want = reference.moe_experts(*args)
    assert (got.float() - want.float()).abs().max().item() <= REL_TOL[dtype] * want.float().abs().max().item()


def test_path_is_chosen_by_shapes():
    """Grouped from T * k >= max(E, 16) pairs, decode below: never by the ids."""
    x, ids, w, gu, dn = make_inputs(16, 32, 16, 16, 1, torch.float32)
    assert kernel_names("moe_experts", x, ids, w, gu, dn)[0] == "moe_experts_route"
    assert kernel_names("moe_experts", x[:15], ids[:15], w[:15], gu, dn)[0] == "moe_experts_act_float"
    x, ids, w, gu, dn = make_inputs(8, 32, 16, 4, 2, torch.float32)  # 16 pairs >= E = 4
    assert kernel_names("moe_experts", x, ids, w, gu, dn)[0] == "moe_experts_route"
    assert kernel_names("moe_experts", x, ids, w, gu[:1].expand(17, -1, -1), dn[:1].expand(17, -1, -1))[0] == \
        "moe_experts_act_float"  # 16 pairs < E = 17


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_rows_have_the_decode_bits(dtype):
    """Chunk invariance across the two paths: each row of a 24-row batch (grouped) equals the row alone
    (decode, bitwise), and random cuts mixing both paths give the same rows."""
    args = make_inputs(24, 40, 24, 6, 3, dtype, seed=21)
    whole = hebrus_emu.moe_experts(*args)
    for t in (0, 11, 23):
        one = tuple(a[t:t + 1] if i < 3 else a for i, a in enumerate(args))
        assert kernel_names("moe_experts", *one)[0] == f"moe_experts_act_{hebrus_emu.METAL_TYPE[dtype]}"
        assert torch.equal(hebrus_emu.moe_experts(*one)[0], whole[t])
    g = torch.Generator().manual_seed(int(dtype.itemsize))
    cuts = sorted(torch.randperm(23, generator=g)[:3].add(1).tolist())
    parts = [hebrus_emu.moe_experts(*part) for part in split_rows(args, cuts)]
    assert torch.equal(torch.cat(parts), whole)


def test_grouped_launches_do_not_depend_on_the_experts_hit():
    """Route, act, down and sum with the same grids whether the pairs spread or all hit expert 0 (the most
    tiles one expert can have); both give the CPU kernel's bits."""
    x, ids, w, gu, dn = make_inputs(20, 40, 24, 8, 2, torch.float16, seed=5)
    zeros = torch.zeros_like(ids)
    spread = hebrus_emu.launches("moe_experts", x, ids, w, gu, dn)
    one = hebrus_emu.launches("moe_experts", x, zeros, w, gu, dn)
    key = [(launch["kernel"], launch["threads"], launch["group"]) for launch in spread]
    assert key == [(launch["kernel"], launch["threads"], launch["group"]) for launch in one]
    assert len(key) == 4
    assert torch.equal(hebrus_emu.moe_experts(x, zeros, w, gu, dn), hebrus_torch.moe_experts(x, zeros, w, gu, dn))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128), (8, 128)])
def test_quantized_grouped_bits_of_the_cpu_kernel(dtype, bits, group):
    from test_moe_quantized import quantized_inputs

    # H over three staging steps, I over two; 36 pairs over 8 experts
    args = quantized_inputs(18, 384, 256, 8, 2, dtype, bits, group, seed=bits + group)
    t = hebrus_emu.METAL_TYPE[dtype]
    assert kernel_names("moe_experts_quantized", *args) == [
        "moe_experts_route", f"moe_experts_quantized_act_grouped_q{bits}_{t}",
        f"moe_experts_quantized_down_grouped_q{bits}_{t}", f"moe_experts_sum_{t}"]
    got = hebrus_emu.moe_experts_quantized(*args)
    assert torch.equal(got, hebrus_torch.moe_experts_quantized(*args))


@pytest.mark.parametrize("dtype,bits,group", [(torch.bfloat16, 4, 64), (torch.float16, 8, 32)])
def test_quantized_grouped_rows_have_the_decode_bits(dtype, bits, group):
    from test_moe_quantized import quantized_inputs

    args = quantized_inputs(20, 128, 64, 5, 2, dtype, bits, group, seed=3)
    whole = hebrus_emu.moe_experts_quantized(*args)
    assert kernel_names("moe_experts_quantized", *args)[0] == "moe_experts_route"
    for t in (0, 19):
        one = tuple(a[t:t + 1] if i < 3 else a for i, a in enumerate(args))
        assert kernel_names("moe_experts_quantized", *one)[0].startswith("moe_experts_quantized_act_q")
        assert torch.equal(hebrus_emu.moe_experts_quantized(*one)[0], whole[t])
    assert torch.equal(torch.cat([hebrus_emu.moe_experts_quantized(*part) for part in split_rows(args, [3, 17])]),
                       whole)
    assert torch.equal(hebrus_emu.moe_experts_quantized(*args, sched="random", seed=8, guard="start"), whole)


def test_quantized_grouped_bad_id_is_reported():
    from test_moe_quantized import quantized_inputs

    args = list(quantized_inputs(9, 64, 32, 3, 2, torch.float32, 4, 32, seed=6))
    args[1] = args[1].clone()
    args[1][8, 1] = 3
    assert kernel_names("moe_experts_quantized", *args)[0] == "moe_experts_route"
    with pytest.raises(hebrus_emu.ASYNC_ERROR,
                       match=r"^hebrus::moe_experts_quantized: topk_ids\[8, 1\] = 3 is not an expert id in \[0, E=3\)"):
        hebrus_emu.moe_experts_quantized(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 128)])
def test_quantized_linear_tiled_bits_of_the_cpu_kernel(dtype, bits, group):
    from test_quantized_linear import linear_inputs

    x, *rest = linear_inputs(20, 384, 37, dtype, bits, group, seed=bits)  # 3 row tiles, the last partial
    assert kernel_names("quantized_linear", x, *rest) == [
        f"quantized_linear_tiled_q{bits}_{hebrus_emu.METAL_TYPE[dtype]}"]
    whole = hebrus_emu.quantized_linear(x, *rest)
    assert torch.equal(whole, hebrus_torch.quantized_linear(x, *rest))
    assert torch.equal(hebrus_emu.quantized_linear(x[6:7], *rest)[0], whole[6])  # the one-launch kernel's bits
    assert torch.equal(hebrus_emu.quantized_linear(x, *rest, sched="random", seed=1, guard="start"), whole)


# ---- the released shapes (hidden 2560, intermediate 640, top 10; 16 experts: 512 do not fit the emulator) ----

@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "q4g64"])
def test_released_shapes_both_paths(quantized):
    from test_moe_quantized import quantized_inputs

    shape = (2, 2560, 640, 16, 10)  # 20 pairs >= E = 16: grouped; a row alone: decode
    if quantized:
        args = quantized_inputs(*shape, torch.bfloat16, 4, 64, seed=36)
        op, cpu = hebrus_emu.moe_experts_quantized, hebrus_torch.moe_experts_quantized
    else:
        args = make_inputs(*shape, torch.bfloat16, seed=36)
        op, cpu = hebrus_emu.moe_experts, hebrus_torch.moe_experts
    whole = op(*args)
    assert torch.equal(whole, cpu(*args))
    assert torch.equal(op(*(a[1:2] if i < 3 else a for i, a in enumerate(args)))[0], whole[1])


def test_released_routing_512_experts_top_10():
    """The released router's fan-out (512 experts, top 10) through the route at 64 rows (640 pairs: grouped;
    2 experts per route thread, most hit once or twice), on narrow experts (H = 48, I = 32) the emulator
    affords: the CPU kernel's bits, and a row alone (decode) equal to it in the batch."""
    args = make_inputs(64, 48, 32, 512, 10, torch.bfloat16, seed=512)
    assert kernel_names("moe_experts", *args)[0] == "moe_experts_route"
    whole = hebrus_emu.moe_experts(*args)
    assert torch.equal(whole, hebrus_torch.moe_experts(*args))
    one = tuple(a[33:34] if i < 3 else a for i, a in enumerate(args))
    assert torch.equal(hebrus_emu.moe_experts(*one)[0], whole[33])
