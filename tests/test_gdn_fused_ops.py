"""hebrus::gdn_gates and hebrus::gdn_gated_rms_norm (issue 37): the gated-delta-net layer's gates and
gated output norm, one op each. On CPU both compute in hebrus's own row arithmetic: the gates within the stated
bound of the module's F.softplus / sigmoid and within a tolerance of the packed forward's formulas, the norm within
a tolerance of transformers' Qwen4ExpTextRMSNormGated (tests/tolerance.py); rows are independent of each other; bad
metadata is refused with a HebrusError; opcheck passes; both compile in a full graph; the layer helpers fall back to
the module's own code where the fused op does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_models import modeling
from tolerance import near

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.gdn.fused import _sigmoid, _softplus, layer_gates, output_norm

from test_metal_gdn_fused import gate_inputs  # the emulator tests' inputs (importing runs no emulator)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def norm_module(dim, dtype, activation="silu", seed=0, eps=1e-6):
    norm = modeling.Qwen4ExpTextRMSNormGated(dim, eps=eps, activation=activation)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return norm.to(dtype)


def norm_inputs(rows, dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, dim, generator=g) * 3).to(dtype), (torch.randn(rows, dim, generator=g) * 3).to(dtype)


# ---- gdn_gates -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads", [(1, 48), (7, 5), (33, 16), (3, 1)])
def test_gates_match_the_packed_forwards_formulas(dtype, rows, heads):
    """The formulas the packed forward ran before the op (and still runs under autograd)."""
    a, b, A_log, dt_bias = gate_inputs(rows, heads, dtype, seed=rows + heads)
    g, beta = hebrus_torch.gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == a.shape
    assert near(g, -A_log.float().exp() * _softplus(a.float() + dt_bias))
    assert near(beta, _sigmoid(b).to(dtype).float(), like=dtype)
    ref_g, ref_beta = reference.gdn_gates(a, b, A_log, dt_bias)
    assert near(g, ref_g) and near(beta, ref_beta, like=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gates_are_the_modules_within_the_stated_bound(dtype):
    """transformers computes F.softplus (log1p) and b.sigmoid() (position-dependent on CPU): softplus within
    6e-8 absolute (log(1 + e) loses what log1p keeps of a tiny e), so g within that times exp(A_log) plus an
    ulp; beta within 1 ulp of b's dtype (fp32: a few, exp and division against torch.sigmoid's own)."""
    a, b, A_log, dt_bias = gate_inputs(64, 48, dtype, seed=3)
    g, beta = hebrus_torch.gdn_gates(a, b, A_log, dt_bias)
    want_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    want_beta = b.sigmoid()
    bound = 2.5e-7 * want_g.abs() + 6e-8 * A_log.float().exp()
    assert bool(((g - want_g).abs() <= bound).all())
    ulp = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 1)
    assert bool(((beta - want_beta.float()).abs() <= ulp * want_beta.float().abs()).all())


@pytest.mark.parametrize("param_dtype", DTYPES)
def test_gates_read_parameters_of_any_float_dtype(param_dtype):
    a, b, A_log, dt_bias = gate_inputs(5, 12, torch.bfloat16, param_dtype=param_dtype, seed=2)
    g, beta = hebrus_torch.gdn_gates(a, b, A_log, dt_bias)
    assert near(g, -A_log.float().exp() * _softplus(a.float() + dt_bias))


def test_gate_rows_are_independent():
    a, b, A_log, dt_bias = gate_inputs(19, 7, torch.bfloat16, seed=5)
    g, beta = hebrus_torch.gdn_gates(a, b, A_log, dt_bias)
    for row in (0, 9, 18):
        g1, beta1 = hebrus_torch.gdn_gates(a[row:row + 1], b[row:row + 1], A_log, dt_bias)
        assert torch.equal(g1[0], g[row]) and torch.equal(beta1[0], beta[row])


@pytest.mark.parametrize("bad,match", [
    (lambda a, b, A, d: (a, b, A[:-1], d), "A_log must have Hv = 6 entries, got 5"),
    (lambda a, b, A, d: (a, b, A, d[:-1]), "dt_bias must have Hv = 6 entries, got 5"),
    (lambda a, b, A, d: (a, b[:-1], A, d), r"b must have a's shape \(4, 6\), got \(3, 6\)"),
    (lambda a, b, A, d: (a, b.half(), A, d), "b dtype torch.float16 must match a dtype torch.float32"),
    (lambda a, b, A, d: (a.long(), b.long(), A, d), "a must have dtype"),
    (lambda a, b, A, d: (a[0, 0], b[0, 0], A, d), r"a must be at least 1-D, got shape \(\)"),
    (lambda a, b, A, d: (a, b, A.int(), d), "A_log must have dtype"),
    (lambda a, b, A, d: (a, b, A, d[None]), "dt_bias must be 1-D"),
])
def test_gates_refuse_bad_metadata(bad, match):
    args = gate_inputs(4, 6, torch.float32)
    before = [t.clone() for t in args]
    for fn in (hebrus_torch.gdn_gates, reference.gdn_gates):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(*args))
    assert all(torch.equal(x, y) for x, y in zip(args, before))


# ---- gdn_gated_rms_norm --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("rows,dim", [(6, 128), (5, 12), (1, 8), (40, 33)])
def test_gated_norm_matches_the_module(dtype, activation, rows, dim):
    norm = norm_module(dim, dtype, activation, seed=dim)
    x, z = norm_inputs(rows, dim, dtype, seed=rows)
    with torch.no_grad():
        want = norm(x, z)
        got = hebrus_torch.gdn_gated_rms_norm(x, z, norm.weight, norm.variance_epsilon, activation)
        assert near(got, want)
        assert torch.equal(reference.gdn_gated_rms_norm(x, z, norm.weight, norm.variance_epsilon, activation), want)
        assert torch.equal(output_norm(norm, x, z), got)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_gated_norm_of_a_weight_in_another_dtype(x_dtype, w_dtype):
    """The module's weight * norm is in their promoted dtype: fp32 for an fp32 weight or bf16 x fp16."""
    norm = norm_module(24, torch.float32, seed=4).to(w_dtype)
    x, z = norm_inputs(5, 24, x_dtype, seed=2)
    with torch.no_grad():
        want = norm(x, z)
        assert near(hebrus_torch.gdn_gated_rms_norm(x, z, norm.weight, 1e-6, "silu"), want)


def test_gated_norm_rows_are_independent():
    norm = norm_module(40, torch.bfloat16, seed=3)
    x, z = norm_inputs(11, 40, torch.bfloat16)
    together = hebrus_torch.gdn_gated_rms_norm(x, z, norm.weight, 1e-6, "silu")
    for row in (0, 5, 10):
        alone = hebrus_torch.gdn_gated_rms_norm(x[row:row + 1], z[row:row + 1], norm.weight, 1e-6, "silu")
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("bad,match", [
    (lambda x, z, w: (x, z, w[:-1], 1e-6, "silu"), "weight must have D = 16 entries, got 15"),
    (lambda x, z, w: (x, z[:, :8], w, 1e-6, "silu"), r"gate must have x's shape \(3, 16\), got \(3, 8\)"),
    (lambda x, z, w: (x, z.half(), w, 1e-6, "silu"), "gate dtype torch.float16 must match x dtype torch.float32"),
    (lambda x, z, w: (x, z, w, -1.0, "silu"), "eps must be >= 0, got -1"),
    (lambda x, z, w: (x, z, w, 1e-6, "gelu"), "activation must be 'silu' or 'sigmoid', got 'gelu'"),
    (lambda x, z, w: (x.long(), z.long(), w, 1e-6, "silu"), "x must have dtype"),
    (lambda x, z, w: (x[0, 0], z[0, 0], w, 1e-6, "silu"), r"x must be at least 1-D, got shape \(\)"),
    (lambda x, z, w: (x, z, w.int(), 1e-6, "silu"), "weight must have dtype"),
])
def test_gated_norm_refuses_bad_metadata(bad, match):
    x, z = norm_inputs(3, 16, torch.float32)
    w = torch.randn(16)
    before = [t.clone() for t in (x, z, w)]
    for fn in (hebrus_torch.gdn_gated_rms_norm, reference.gdn_gated_rms_norm):
        with pytest.raises(HebrusError, match=match):
            fn(*bad(x, z, w))
    assert all(torch.equal(t, u) for t, u in zip((x, z, w), before))


# ---- registration, compile -----------------------------------------------------------------------------

def test_opcheck():
    a, b, A_log, dt_bias = gate_inputs(5, 6, torch.float32)
    torch.library.opcheck(torch.ops.hebrus.gdn_gates.default, (a, b, A_log, dt_bias))
    torch.library.opcheck(torch.ops.hebrus.gdn_gates.default, (a.bfloat16(), b.bfloat16(), A_log, dt_bias.half()))
    x, z = norm_inputs(4, 16, torch.float32)
    w = torch.randn(16)
    torch.library.opcheck(torch.ops.hebrus.gdn_gated_rms_norm.default, (x, z, w, 1e-6, "silu"))
    torch.library.opcheck(torch.ops.hebrus.gdn_gated_rms_norm.default,
                          (x.bfloat16(), z.bfloat16(), w.bfloat16(), 1e-5, "sigmoid"))


def test_compile_fullgraph():
    a, b, A_log, dt_bias = gate_inputs(5, 6, torch.float32)
    x, z = norm_inputs(4, 16, torch.float32)
    w = torch.randn(16)

    def both(a, b, A_log, dt_bias, x, z, w):
        return hebrus_torch.gdn_gates(a, b, A_log, dt_bias), hebrus_torch.gdn_gated_rms_norm(x, z, w, 1e-6, "silu")

    fn = torch.compile(both, fullgraph=True, backend="eager")
    (g, beta), out = fn(a, b, A_log, dt_bias, x, z, w)
    (g0, beta0), out0 = both(a, b, A_log, dt_bias, x, z, w)
    assert torch.equal(g, g0) and torch.equal(beta, beta0) and torch.equal(out, out0)


# ---- the layer helpers -----------------------------------------------------------------------------------

class _Gates(torch.nn.Module):
    def __init__(self, heads, dtype):
        super().__init__()
        _, _, A_log, dt_bias = gate_inputs(1, heads, dtype)
        self.A_log, self.dt_bias = torch.nn.Parameter(A_log), torch.nn.Parameter(dt_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_gates_under_autograd_give_the_fused_values(dtype):
    """With autograd recording (the module's parameters require grad) the gates run as ATen ops: within the
    tolerance of the fused op's values."""
    module = _Gates(6, dtype)
    a, b, _, _ = gate_inputs(4, 6, dtype, seed=8)
    g, beta = layer_gates(module, a, b)
    assert g.requires_grad and beta.dtype == dtype
    with torch.no_grad():
        g1, beta1 = layer_gates(module, a, b)
    assert beta1.dtype == torch.float32
    assert near(g.detach(), g1) and near(beta.detach().float(), beta1, like=dtype)


def test_a_hooked_norm_runs_as_itself():
    norm = norm_module(16, torch.float32)
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    x, z = norm_inputs(3, 16, torch.float32)
    with torch.no_grad():
        assert torch.equal(output_norm(norm, x, z), seen[0])


@pytest.mark.parametrize("wrap", ["instance forward", "global hook"])
def test_a_norm_with_a_forward_of_its_own_or_a_global_hook_runs_as_itself(wrap):
    """A forward replaced on the instance, or a global forward hook, sees the norm called (not bypassed by the fused
    op), as the module's own call would."""
    norm = norm_module(16, torch.float32)
    seen = []
    x, z = norm_inputs(3, 16, torch.float32)
    if wrap == "instance forward":
        own = type(norm).forward.__get__(norm)
        norm.forward = lambda *args: seen.append(1) or own(*args) * 0.5
        with torch.no_grad():
            assert torch.equal(output_norm(norm, x, z), own(x, z) * 0.5) and seen == [1]
        return
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append((mod, out)))
    try:
        with torch.no_grad():
            got = output_norm(norm, x, z)
    finally:
        handle.remove()
    own = [out for mod, out in seen if mod is norm]
    assert len(own) == 1 and torch.equal(got, own[0])
