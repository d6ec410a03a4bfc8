"""mps_kernels/rms_norm_rope.metal and mps_kernels/qsa_token_cells.metal (issue 37) run in the emulator
with the glue's grid. rms_norm_rope against the reference (transformers' norm then RoPE, op for op) in
every dtype, with partial, full and no rotary dims, heads read in place from a wider projection;
qsa_token_cells bitwise against the reference (and so against what QSACache.plan computed before), with
-1 entries anywhere in a selection. Both: rows independent of the rest of the launch (bitwise) in every
schedule, with guard pages at either end of every buffer; bad metadata refused with the CPU kernel's
messages; qsa_token_cells' bad values reported through the stream's error buffer as the reference words
them."""

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
from test_qsa_fused_ops import rope_inputs, token_cells_inputs  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def weight(dim, dtype=torch.float32, seed=0):
    return (torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.3).to(dtype)


def close(got, want, dtype):
    """The squares are summed in another order and rsqrt is the platform's, so the normed value may be
    one unit in the last place off; the RoPE then rounds that through a product and a sum."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:
        diff = (got.float() - want.float()).abs()
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(1e-2)
        assert bool((diff <= 4 * ulp).all()) and float((got != want).float().mean()) < 0.05


# ---- rms_norm_rope ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim,rot,wide", [(5, 3, 64, 16, True), (3, 2, 256, 64, False),
                                                       (4, 1, 40, 40, False), (2, 2, 96, 0, True),
                                                       (6, 2, 128, 32, True)])
def test_rms_norm_rope_matches_reference(dtype, tokens, heads, dim, rot, wide):
    x, cos, sin = rope_inputs(tokens, heads, dim, rot, dtype, seed=dim + rot, wide=wide)
    w = weight(dim, dtype, seed=dim)
    close(hebrus_emu.rms_norm_rope(x, w, 1e-6, cos, sin), reference.rms_norm_rope(x, w, 1e-6, cos, sin), dtype)


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_rms_norm_rope_rows_do_not_depend_on_the_launch(sched, guard):
    x, cos, sin = rope_inputs(7, 3, 64, 16, torch.bfloat16, seed=3, wide=True)
    w = weight(64, seed=1)
    together = hebrus_emu.rms_norm_rope(x, w, 1e-6, cos, sin, sched=sched, seed=4, guard=guard)
    for t in (0, 3, 6):
        alone = hebrus_emu.rms_norm_rope(x[t:t + 1].clone(), w, 1e-6, cos[t:t + 1].clone(), sin[t:t + 1].clone(),
                                         guard=guard)
        assert torch.equal(alone[0], together[t])


def test_rms_norm_rope_empty_launches_nothing():
    x, cos, sin = rope_inputs(0, 2, 32, 8, torch.float16)
    assert hebrus_emu.launches("rms_norm_rope", x, weight(32), 1e-6, cos, sin) == []
    assert hebrus_emu.rms_norm_rope(x, weight(32), 1e-6, cos, sin).shape == (0, 2, 32)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, c, s: (x, w[:-1], 1e-6, c, s), "weight must have D = 32 entries, got 31"),
    (lambda x, w, c, s: (x, w, 1e-6, c.half(), s.half()), "cos dtype torch.float16 must match x dtype torch.float32"),
    (lambda x, w, c, s: (x, w, 1e-6, c[:, :7], s[:, :7]), "the rotary dims R must be even and at most D = 32, got 7"),
    (lambda x, w, c, s: (x, w, -1.0, c, s), "eps must be >= 0, got -1"),
])
def test_rms_norm_rope_bad_metadata_is_refused_as_on_cpu(bad, match):
    x, cos, sin = rope_inputs(4, 2, 32, 8, torch.float32, seed=2)
    args = bad(x, weight(32), cos, sin)
    for fn in (hebrus_emu.rms_norm_rope, reference.rms_norm_rope):
        with pytest.raises(HebrusError, match=match):
            fn(*args)


# ---- qsa_token_cells ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tq,top_k,r,holes,max_groups", [(9, 4, 4, True, 12), (5, 40, 1, True, 12),
                                                         (7, 70, 2, False, 100), (3, 1, 8, True, 12),
                                                         (12, 33, 4, True, 50)])
def test_token_cells_match_reference(tq, top_k, r, holes, max_groups):
    args = token_cells_inputs(tq, top_k, r, seed=tq * top_k, holes=holes, max_groups=max_groups)
    got, want = hebrus_emu.qsa_token_cells(*args, r), reference.qsa_token_cells(*args, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_token_cells_rows_do_not_depend_on_the_launch(sched, guard):
    selected, nvis, first, cells = token_cells_inputs(10, 37, 4, seed=5)
    together = hebrus_emu.qsa_token_cells(selected, nvis, first, cells, 4, sched=sched, seed=2, guard=guard)
    want = reference.qsa_token_cells(selected, nvis, first, cells, 4)
    assert torch.equal(together[0], want[0]) and torch.equal(together[1], want[1])
    for t in (0, 9):
        alone = hebrus_emu.qsa_token_cells(selected[t:t + 1].clone(), nvis[t:t + 1].clone(), first[t:t + 1].clone(),
                                           cells, 4, guard=guard)
        assert torch.equal(alone[0][0], together[0][t]) and torch.equal(alone[1][0], together[1][t])


def test_token_cells_empty_and_tail_only():
    selected, nvis, first, cells = token_cells_inputs(4, 3, 4, seed=6)
    assert hebrus_emu.launches("qsa_token_cells", selected[:0], nvis[:0], first[:0], cells, 4) == []
    assert hebrus_emu.qsa_token_cells(selected[:0], nvis[:0], first[:0], cells, 4)[0].shape == (0, 15)
    got = hebrus_emu.qsa_token_cells(selected[:, :0].contiguous(), nvis, first, cells, 4)
    want = reference.qsa_token_cells(selected[:, :0], nvis, first, cells, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("name,edit", [
    ("group-past-the-run", lambda s, n, f, c: s.__setitem__((2, 1), int(n[2]) // 4)),
    ("below-minus-one", lambda s, n, f, c: s.__setitem__((0, 0), -2)),
    ("run-past-cells", lambda s, n, f, c: f.__setitem__(3, c.numel() - int(n[3]) + 1)),
    ("negative-first", lambda s, n, f, c: f.__setitem__(1, -1)),
])
def test_token_cells_bad_values_are_reported_like_the_reference(name, edit):
    args = token_cells_inputs(6, 3, 4, seed=9)
    edit(*args)
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"hebrus::qsa_token_cells: ") as emu_err:
        hebrus_emu.qsa_token_cells(*args, 4)
    with pytest.raises(HebrusError, match=r"hebrus::qsa_token_cells: ") as ref_err:
        reference.qsa_token_cells(*args, 4)
    assert str(ref_err.value) in hebrus_emu.reported() and str(emu_err.value) in hebrus_emu.reported()


def test_token_cells_bad_metadata_is_refused_as_on_cpu():
    selected, nvis, first, cells = token_cells_inputs(6, 3, 4, seed=1)
    for args, match in (((selected.long(), nvis, first, cells, 4), "selected must have dtype torch.int32"),
                        ((selected, nvis, first[:-1], cells, 4), "nvis and first must have Tq = 6 entries"),
                        ((selected, nvis, first, cells, 0), r"r must be in \[1, 1048576\], got 0")):
        for fn in (hebrus_emu.qsa_token_cells, reference.qsa_token_cells):
            with pytest.raises(HebrusError, match=match):
                fn(*args)


# ---- sigmoid_gate -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(5, 3, 16), (2, 24, 256), (3, 2, 40)])
def test_sigmoid_gate_matches_reference(dtype, tokens, heads, dim):
    from test_qsa_fused_ops import gate_inputs

    out, gate = gate_inputs(tokens, heads, dim, dtype, seed=dim)
    close(hebrus_emu.sigmoid_gate(out, gate), reference.sigmoid_gate(out, gate), dtype)


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_sigmoid_gate_rows_do_not_depend_on_the_launch(sched, guard):
    from test_qsa_fused_ops import gate_inputs

    out, gate = gate_inputs(6, 3, 40, torch.bfloat16, seed=2)
    together = hebrus_emu.sigmoid_gate(out, gate, sched=sched, seed=3, guard=guard)
    for t in (0, 5):
        alone = hebrus_emu.sigmoid_gate(out[t:t + 1].clone(), gate[t:t + 1].clone(), guard=guard)
        assert torch.equal(alone[0], together[t])
    out0, gate0 = gate_inputs(0, 3, 40, torch.float16)
    assert hebrus_emu.launches("sigmoid_gate", out0, gate0) == []
    with pytest.raises(HebrusError, match="gate dtype torch.float16 must match x dtype torch.bfloat16"):
        hebrus_emu.sigmoid_gate(out, gate.half())
