"""mps_kernels/gdn_fused.metal (issue 37: gdn_gates, gdn_gated_rms_norm) run in the emulator with the glue's
grid, against the references (the packed forward's gate formulas; transformers' Qwen4ExpTextRMSNormGated,
op for op): every dtype of the activations and of the parameter vectors (read in their own dtype), row
counts that leave a partial threadgroup, rows independent of the rest of the launch (bitwise), every
schedule, guard pages at either end of every buffer, bad metadata refused with the CPU kernel's messages."""

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


def gate_inputs(rows, heads, dtype, param_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(rows, heads, generator=g) * 4).to(dtype)
    b = (torch.randn(rows, heads, generator=g) * 4).to(dtype)
    A_log = torch.log(torch.empty(heads).uniform_(0.01, 16, generator=g)).to(param_dtype or dtype)
    dt_bias = torch.randn(heads, generator=g).to(param_dtype or dtype)
    return a, b, A_log, dt_bias


def norm_inputs(rows, dim, dtype, weight_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    z = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(dim, generator=g) * 0.3).to(weight_dtype or dtype)
    return x, z, w


def close_gates(got, want, dtype, A_log):
    """g: exp, log and the division are the platform's (a few ulp of fp32), and an ulp of exp(-|x|) can
    move 1 + exp(-|x|) by an ulp of 1 (2 ulp allowed), times exp(A_log); beta: rounded to b's dtype from
    an fp32 value a few ulp away, so equal but for rare ties one ulp of that dtype apart."""
    (g, beta), (want_g, want_beta) = got, want
    assert g.dtype == beta.dtype == torch.float32
    bound = 4e-7 * want_g.abs() + 2.5e-7 * A_log.float().exp()
    assert bool(((g - want_g).abs() <= bound).all()), float(((g - want_g).abs() / bound).max())
    ulp = (torch.finfo(dtype).eps if dtype != torch.float32 else 4 * torch.finfo(torch.float32).eps)
    assert bool(((beta - want_beta).abs() <= ulp * want_beta.abs()).all())
    if dtype != torch.float32:
        assert float((beta != want_beta).float().mean()) < 0.02


def close_norm(got, want, dtype):
    """Sums of squares in another order, rsqrt, exp and division the platform's: fp32 to a few ulp; in
    bf16 / fp16 two roundings (the norm, the output) each at most one ulp off, and rarely."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=2e-6)
        return
    diff = (got.float() - want.float()).abs()
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(1e-3)
    assert bool((diff <= 2.01 * ulp).all()) and float((got != want).float().mean()) < 0.05


# ---- gdn_gates -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads", [(1, 48), (7, 5), (300, 3), (2, 1)])
def test_gates_match_reference(dtype, rows, heads):
    args = gate_inputs(rows, heads, dtype, seed=rows + heads)
    close_gates(hebrus_emu.gdn_gates(*args), reference.gdn_gates(*args), dtype, args[2])


@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_read_parameters_in_their_own_dtype(dtype, param_dtype):
    args = gate_inputs(9, 12, dtype, param_dtype=param_dtype, seed=4)
    assert all(launch["tensors"][i].dtype == param_dtype for launch in hebrus_emu.launches("gdn_gates", *args)
               for i in (2, 3))
    close_gates(hebrus_emu.gdn_gates(*args), reference.gdn_gates(*args), dtype, args[2])


# ---- gdn_gated_rms_norm --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("rows,dim", [(5, 128), (3, 40), (9, 12), (1, 8)])
def test_gated_norm_matches_reference(dtype, activation, rows, dim):
    x, z, w = norm_inputs(rows, dim, dtype, seed=rows + dim)
    close_norm(hebrus_emu.gdn_gated_rms_norm(x, z, w, 1e-6, activation),
               reference.gdn_gated_rms_norm(x, z, w, 1e-6, activation), dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_gated_norm_of_a_weight_in_another_dtype(x_dtype, w_dtype):
    """The product weight * norm is rounded to x's dtype only where the module's promoted dtype is x's."""
    x, z, w = norm_inputs(6, 48, x_dtype, weight_dtype=w_dtype, seed=3)
    close_norm(hebrus_emu.gdn_gated_rms_norm(x, z, w, 1e-5, "silu"),
               reference.gdn_gated_rms_norm(x, z, w, 1e-5, "silu"), x_dtype)


def test_gated_norm_of_heads_as_rows():
    """x, z [T, Hv, Dv] (the delta rule's output and in_proj_z's, any strides): a row per (token, head)."""
    x, z, w = norm_inputs(4 * 3, 2 * 32, torch.bfloat16, seed=5)
    x, z, w = x.view(4, 3, 64)[..., :32], z.view(4, 3, 64)[..., 32:], w[:32]
    close_norm(hebrus_emu.gdn_gated_rms_norm(x, z, w, 1e-6, "silu"),
               reference.gdn_gated_rms_norm(x, z, w, 1e-6, "silu"), torch.bfloat16)


# ---- both: schedules, guard pages, empty launches, bad metadata -----------------------------------------

@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_rows_do_not_depend_on_the_launch(sched, guard):
    """A row's outputs are bitwise the same alone and among others, in every schedule, with the guard page
    before or after every buffer."""
    a, b, A_log, dt_bias = gate_inputs(70, 5, torch.float16, param_dtype=torch.bfloat16, seed=6)
    g, beta = hebrus_emu.gdn_gates(a, b, A_log, dt_bias, sched=sched, seed=3, guard=guard)
    x, z, w = norm_inputs(11, 40, torch.bfloat16, seed=7)
    out = hebrus_emu.gdn_gated_rms_norm(x, z, w, 1e-6, "silu", sched=sched, seed=3, guard=guard)
    for row in (0, 5, 10):
        g1, beta1 = hebrus_emu.gdn_gates(a[row:row + 1].clone(), b[row:row + 1].clone(), A_log, dt_bias, guard=guard)
        assert torch.equal(g1[0], g[row]) and torch.equal(beta1[0], beta[row])
        alone = hebrus_emu.gdn_gated_rms_norm(x[row:row + 1].clone(), z[row:row + 1].clone(), w, 1e-6, "silu",
                                              guard=guard)
        assert torch.equal(alone[0], out[row])


def test_empty_rows_launch_nothing():
    a, b, A_log, dt_bias = gate_inputs(0, 6, torch.float16)
    assert hebrus_emu.launches("gdn_gates", a, b, A_log, dt_bias) == []
    g, beta = hebrus_emu.gdn_gates(a, b, A_log, dt_bias)
    assert g.shape == beta.shape == (0, 6) and g.dtype == torch.float32
    x, z, w = norm_inputs(0, 16, torch.bfloat16)
    assert hebrus_emu.launches("gdn_gated_rms_norm", x, z, w, 1e-6, "silu") == []
    assert hebrus_emu.gdn_gated_rms_norm(x, z, w, 1e-6, "silu").shape == (0, 16)


@pytest.mark.parametrize("bad,match", [
    (lambda a, b, A, d: (a, b, A[:-1], d), "A_log must have Hv = 6 entries, got 5"),
    (lambda a, b, A, d: (a, b[:-1], A, d), r"b must have a's shape \(4, 6\), got \(3, 6\)"),
    (lambda a, b, A, d: (a, b.half(), A, d), "b dtype torch.float16 must match a dtype torch.float32"),
    (lambda a, b, A, d: (a.long(), b.long(), A, d), "a must have dtype"),
])
def test_gates_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(*gate_inputs(4, 6, torch.float32))
    for fn in (hebrus_emu.gdn_gates, reference.gdn_gates):
        with pytest.raises(HebrusError, match=match):
            fn(*args)


@pytest.mark.parametrize("bad,match", [
    (lambda x, z, w: (x, z, w[:-1], 1e-6, "silu"), "weight must have D = 16 entries, got 15"),
    (lambda x, z, w: (x, z.half(), w, 1e-6, "silu"), "gate dtype torch.float16 must match x dtype torch.float32"),
    (lambda x, z, w: (x, z, w, -1.0, "silu"), "eps must be >= 0, got -1"),
    (lambda x, z, w: (x, z, w, 1e-6, "gelu"), "activation must be 'silu' or 'sigmoid', got 'gelu'"),
])
def test_gated_norm_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(*norm_inputs(3, 16, torch.float32))
    for fn in (hebrus_emu.gdn_gated_rms_norm, reference.gdn_gated_rms_norm):
        with pytest.raises(HebrusError, match=match):
            fn(*args)
