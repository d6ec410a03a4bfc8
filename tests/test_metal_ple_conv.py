"""mps_kernels/ple_conv.metal run in the emulator with the glue's grid, against the reference.

Ragged packed batches with rows of length 0, every dtype, both activations, channel counts that
are not a multiple of the channel vector, K = 1 (no state), chunk invariance (one shot vs 1/2/1
chunks vs random partitions, bitwise), identical results under every fiber schedule and guard
side, and bad cu_seqlens raising before anything is returned.
"""

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
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def make(lengths, channels, width, dilation, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total, batch, state_len = sum(lengths), len(lengths), (width - 1) * dilation
    x = torch.randn(total, channels, generator=g).to(dtype)
    w = (torch.randn(channels, width, generator=g) / width).to(dtype)
    state = torch.randn(batch, state_len, channels, generator=g).to(dtype)
    return x, w, cu_of(lengths), state


@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, activation):
    x, w, cu, state = make([0, 5, 1, 13, 0, 7, 2], 6, 4, 3, dtype)
    y, new_state = hebrus_emu.ple_conv(x, w, cu, state, 3, activation)
    y_ref, state_ref = reference.ple_conv(x, w, cu, state, 3, activation)
    assert torch.equal(new_state, state_ref)
    if dtype == torch.float32 and activation == "none":
        assert torch.equal(y, y_ref)  # same products and sums in the same order: bitwise
    else:  # SiLU's exp is the platform's; one rounding of the output dtype apart at most
        torch.testing.assert_close(y.float(), y_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("channels,width,dilation", [(1, 1, 1), (33, 2, 5), (4, 4, 3), (70, 3, 1)])
def test_shapes(channels, width, dilation):
    x, w, cu, state = make([3, 0, 11, 1], channels, width, dilation, torch.float32, seed=channels)
    y, new_state = hebrus_emu.ple_conv(x, w, cu, state, dilation, "none")
    y_ref, state_ref = reference.ple_conv(x, w, cu, state, dilation, "none")
    assert torch.equal(y, y_ref) and torch.equal(new_state, state_ref)


def test_launch_geometry_comes_from_the_shared_header():
    p = hebrus_emu.plan("ple_conv", 25, 6, 4, 7, 3, True)
    assert (p.threads, p.group) == ((25 + 7) * 2, 256)


def run_chunks(x_rows, w, state, dilation, activation, cuts):
    """Feed every row's stream in chunks cut at `cuts` (shared positions), carrying the state."""
    ys, bounds = [[] for _ in x_rows], [0, *cuts, max(len(r) for r in x_rows)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts = [r[a:b] for r in x_rows]
        cu = cu_of([len(p) for p in parts])
        y, state = hebrus_emu.ple_conv(torch.cat(parts), w, cu, state, dilation, activation)
        for i, chunk in enumerate(torch.split(y, [len(p) for p in parts])):
            ys[i].append(chunk)
    return [torch.cat(c) for c in ys], state


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_invariance(dtype):
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, 10, generator=g).to(dtype) for n in (9, 4, 0)]
    w = torch.randn(10, 4, generator=g).to(dtype)
    state = torch.zeros(3, 9, 10, dtype=dtype)
    one_shot = run_chunks(rows, w, state, 3, "silu", [])
    small = run_chunks(rows, w, state, 3, "silu", [1, 3, 4, 6, 8])  # 1/2/1/2/2/1 tokens
    cuts = sorted(torch.randperm(8, generator=g)[:3].add(1).tolist())
    random = run_chunks(rows, w, state, 3, "silu", cuts)
    for other in (small, random):
        assert all(torch.equal(a, b) for a, b in zip(one_shot[0], other[0]))
        assert torch.equal(one_shot[1], other[1])


@pytest.mark.parametrize("sched,guard", [("reverse", "end"), ("random", "start"), ("random", "end")])
def test_schedules_and_guards_agree(sched, guard):
    x, w, cu, state = make([4, 0, 9, 3], 9, 4, 3, torch.float16, seed=7)
    base = hebrus_emu.ple_conv(x, w, cu, state, 3, "silu")
    other = hebrus_emu.ple_conv(x, w, cu, state, 3, "silu", sched=sched, seed=11, guard=guard)
    assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])


def test_empty_rows_pass_state_through():
    x, w, cu, state = make([0, 0], 5, 4, 3, torch.float32)
    y, new_state = hebrus_emu.ple_conv(x, w, cu, state, 3, "silu")
    assert y.shape == (0, 5) and torch.equal(new_state, state)


@pytest.mark.parametrize("bad", [[0, 3, 2, 6], [1, 3, 4, 6], [0, 2, 4, 5]])
def test_bad_cu_seqlens_raise(bad):
    x, w, _, state = make([2, 2, 2], 4, 4, 3, torch.float32)
    cu = torch.tensor(bad, dtype=torch.int32)
    with pytest.raises(hebrus_emu.ASYNC_ERROR) as emu_err:  # from the stream's error buffer, at synchronization
        hebrus_emu.ple_conv(x, w, cu, state, 3, "silu")
    with pytest.raises(HebrusError) as ref_err:
        reference.ple_conv(x, w, cu, state, 3, "silu")
    assert str(emu_err.value) == str(ref_err.value)


def test_kernels_present():
    assert set(hebrus_emu.module("ple_conv").kernels) == {"ple_conv_float", "ple_conv_half", "ple_conv_bfloat",
                                                          "ple_conv_check_cu"}
    no_bf16 = msl_emu.translate(os.path.join(msl_emu.KERNEL_DIR, "ple_conv.metal"), defines={})[1]
    assert set(no_bf16) == {"ple_conv_float", "ple_conv_half", "ple_conv_check_cu"}  # HEBRUS_METAL_BFLOAT=0 builds
