"""hebrus::hc_premix_quantized (issue 37 with issue 36's weights): the hyper-connection pre-mix of a
Qwen4ExpTextGatedResidual whose projections are the converter's QuantizedLinear, in one dispatch. On CPU it
matches the module path within a tolerance (transformers' module calling QuantizedLinear, and hyper_premix's
premix_by_modules; tests/tolerance.py) for bits 4 and 8 and groups 32 / 64 / 128, in every dtype, with and without
injection; the reference matches it to the rounding of the folded sums; rows are independent; bad metadata is refused
with a HebrusError and changes nothing; opcheck (schema, fake) passes and it compiles in a full graph.
hyper_premix calls it for such a module and only then (a mix of plain and quantized projections, two bit
widths, a hooked projection: module calls)."""

from __future__ import annotations

import pytest
import torch

from hf_models import modeling, tiny_config
from tolerance import near

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.hc import hyper_premix
from hebrus_torch.hc import premix as premix_module
from hebrus_torch.moe.quantized_linear import QuantizedLinear, quantize_linears

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PROJECTIONS = ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")
# (rows, hc_count, lowrank, hidden, group_size): D = hc_count * hidden and the low rank multiples of the group;
# hidden 48 and 40 not (a group spans two streams).
SHAPES = [(5, 4, 64, 32, 32), (3, 4, 64, 48, 64), (2, 2, 128, 64, 128), (1, 4, 32, 40, 32), (9, 2, 64, 64, 64)]


def quantized_residual(dtype, bits, group, combine=True, hc_count=4, lowrank=64, hidden=32, seed=9):
    """A Qwen4ExpTextGatedResidual with random weights, its projections QuantizedLinear (the converter's)."""
    config = tiny_config(hc_count=hc_count, hc_lowrank=lowrank, hidden_size=hidden)
    hc = modeling.Qwen4ExpTextGatedResidual(config, use_combine=combine)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hc.named_parameters():
            scale = 0.3 if "norm" in name else p.shape[-1] ** -0.5 * 2
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    hc = hc.to(dtype)
    return quantize_linears(hc, [n for n in PROJECTIONS if getattr(hc, n) is not None], bits, group)


def quantized_args(hc):
    def three(linear):
        return (linear.weight, linear.scales, linear.biases) if linear is not None else (None, None, None)

    down = hc.input_mix_weight_down
    return (hc.hc_norm.weight, *three(down), *three(hc.input_mix_weight_up), *three(hc.block_inject_weight),
            hc.hc_count, hc.hc_norm.eps, down.group_size, down.bits)


def streams(rows, hc, dtype, seed=3):
    return (torch.randn(rows, hc.hc_count * hc.hidden_size, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize("rows,hc_count,lowrank,hidden,group", SHAPES)
def test_cpu_kernel_matches_the_module_path(dtype, bits, combine, rows, hc_count, lowrank, hidden, group):
    hc = quantized_residual(dtype, bits, group, combine, hc_count, lowrank, hidden, seed=rows + lowrank)
    h = streams(rows, hc, dtype, seed=rows)
    with torch.no_grad():
        want = hc(h)
        by_modules = premix_module.premix_by_modules(hc, h)
        mixed, weights = hebrus_torch.hc_premix_quantized(h, *quantized_args(hc))
        ref_mixed, ref_weights = reference.hc_premix_quantized(h, *quantized_args(hc))
    want_mixed, by_modules_mixed = (want[0], by_modules[0]) if combine else (want, by_modules)
    assert near(mixed, want_mixed) and near(by_modules_mixed, want_mixed)
    if combine:
        assert near(weights, want[2])
    else:
        assert weights.shape == ref_weights.shape == (rows, 0)
    assert mixed.dtype == weights.dtype == dtype
    # The reference folds its sums in torch's order: equal to the rounding of the dtype.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4 * torch.finfo(dtype).eps, rtol=0.02)
    torch.testing.assert_close(ref_mixed.float(), mixed.float(), **tol)
    torch.testing.assert_close(ref_weights.float(), weights.float(), **tol)


def test_rows_are_independent():
    hc = quantized_residual(torch.bfloat16, 4, 64, seed=4)
    h = streams(11, hc, torch.bfloat16, seed=8)
    mixed, weights = hebrus_torch.hc_premix_quantized(h, *quantized_args(hc))
    for row in (0, 5, 10):
        m1, w1 = hebrus_torch.hc_premix_quantized(h[row:row + 1], *quantized_args(hc))
        assert torch.equal(m1[0], mixed[row]) and torch.equal(w1[0], weights[row])


def _inputs():
    hc = quantized_residual(torch.float32, 4, 32, hc_count=4, lowrank=32, hidden=16, seed=1)
    return streams(3, hc, torch.float32), quantized_args(hc)


def _replace(args, index, value):
    return args[:index] + (value,) + args[index + 1:]


# indices into quantized_args: 0 norm_weight, 1-3 down, 4-6 up, 7-9 inject, 10 hc_count, 11 eps, 12 group, 13 bits
@pytest.mark.parametrize("bad,match", [
    (lambda a: _replace(a, 13, 3), "bits must be 4 or 8, got 3"),
    (lambda a: _replace(a, 12, 16), "group_size must be 32, 64 or 128, got 16"),
    (lambda a: _replace(a, 12, 64), r"down_scales must be \[32, 1\], got shape \(32, 2\)"),
    (lambda a: _replace(a, 10, 3), "hc_count must be >= 1 and divide D = 64, got 3"),
    (lambda a: _replace(a, 0, a[0][:-1]), "norm_weight must have D = 64 entries, got 63"),
    (lambda a: _replace(a, 1, a[1].float()), "down_q must have dtype torch.int32"),
    (lambda a: _replace(a, 1, a[1][:, :-1]), r"down_q must be \[R >= 1, 64 \* bits / 32 = 8\], got shape \(32, 7\)"),
    (lambda a: _replace(a, 2, a[2].half()), "down_scales dtype torch.float16 must match h dtype torch.float32"),
    (lambda a: _replace(a, 3, a[3][:-1]), r"down_biases must be \[32, 2\], got shape \(31, 2\)"),
    (lambda a: _replace(a, 4, a[4][:-1]), r"up_q must be \[D = 64, 32 \* bits / 32 = 4\], got shape \(63, 4\)"),
    (lambda a: _replace(a, 5, a[5][0]), r"up_scales must be 2-D, got shape \(1,\)"),
    (lambda a: _replace(a, 7, a[7][:-1]), r"inject_q must be \[hc_count = 4, 64 \* bits / 32 = 8\], got shape \(3, 8\)"),
    (lambda a: _replace(a, 9, None), "inject_q, inject_scales and inject_biases must be given together"),
    (lambda a: _replace(a, 11, -1.0), "eps must be >= 0, got -1"),
])
def test_bad_metadata_raises_and_changes_nothing(bad, match):
    h, args = _inputs()
    before = [t.clone() for t in (h, *args) if isinstance(t, torch.Tensor)]
    for fn in (hebrus_torch.hc_premix_quantized, reference.hc_premix_quantized):
        with pytest.raises(HebrusError, match=match):
            fn(h, *bad(args))
    assert all(torch.equal(a, b) for a, b in zip((t for t in (h, *args) if isinstance(t, torch.Tensor)), before))
    with pytest.raises(HebrusError, match="h must be 2-D"):
        hebrus_torch.hc_premix_quantized(h[0], *args)


def test_opcheck():
    for combine, bits, dtype in ((True, 4, torch.float32), (False, 8, torch.float32), (True, 8, torch.bfloat16)):
        hc = quantized_residual(dtype, bits, 32, combine, hc_count=4, lowrank=32, hidden=16, seed=2)
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in quantized_args(hc)]   # (as hc_premix's)
        torch.library.opcheck(torch.ops.hebrus.hc_premix_quantized.default, (streams(3, hc, dtype), *args))


def _count_calls(monkeypatch):
    calls = {"dense": 0, "quantized": 0}
    dense, quantized = premix_module.hc_premix, premix_module.hc_premix_quantized

    def count(kind, fn):
        def wrapped(*a):
            calls[kind] += 1
            return fn(*a)
        return wrapped

    monkeypatch.setattr(premix_module, "hc_premix", count("dense", dense))
    monkeypatch.setattr(premix_module, "hc_premix_quantized", count("quantized", quantized))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("combine", [True, False])
def test_hyper_premix_is_one_fused_op_of_a_quantized_module(monkeypatch, dtype, combine):
    calls = _count_calls(monkeypatch)
    hc = quantized_residual(dtype, 4, 64, combine)
    h = streams(4, hc, dtype)
    with torch.no_grad():
        want, got = hc(h), hyper_premix(hc, h)
    assert calls == {"dense": 0, "quantized": 1}
    want, got = (want, got) if combine else ((want,), (got,))
    assert len(want) == len(got) and all(near(b, a) for a, b in zip(want, got))


@pytest.mark.parametrize("mix", ["one_plain", "two_bit_widths", "two_groups", "hooked", "scales_dtype"])
def test_other_mixes_run_as_module_calls(monkeypatch, mix):
    calls = _count_calls(monkeypatch)
    hc = quantized_residual(torch.float32, 4, 32, hc_count=4, lowrank=64, hidden=32)
    seen = []
    if mix == "one_plain":
        hc.block_inject_weight = torch.nn.Linear(128, 4, bias=False)
    elif mix in ("two_bit_widths", "two_groups"):
        bits, group = (8, 32) if mix == "two_bit_widths" else (4, 64)
        w = torch.randn(128, 64, generator=torch.Generator().manual_seed(5)) * 0.1
        linear = torch.nn.Linear(64, 128, bias=False)
        linear.weight.data.copy_(w)
        hc.input_mix_weight_up = QuantizedLinear.from_linear(linear, bits, group)
    elif mix == "hooked":
        hc.input_mix_weight_up.register_forward_hook(lambda mod, args, out: seen.append(1))
    else:
        down = hc.input_mix_weight_down
        down.scales, down.biases = down.scales.half(), down.biases.half()
    h = streams(3, hc, torch.float32)
    if mix == "scales_dtype":   # the module itself refuses the dtype mix; hyper_premix leaves it to the module
        with torch.no_grad(), pytest.raises(HebrusError):
            hyper_premix(hc, h)
        assert calls == {"dense": 0, "quantized": 0}
        return
    with torch.no_grad():
        want, got = hc(h), hyper_premix(hc, h)
    assert calls == {"dense": 0, "quantized": 0} and all(near(b, a) for a, b in zip(want, got))
    assert seen == ([1, 1] if mix == "hooked" else [])


def test_compiles_fullgraph():
    hc = quantized_residual(torch.float32, 4, 32)
    h = streams(5, hc, torch.float32)
    out = torch.randn(5, hc.hidden_size)

    def layer_hc(h, out):
        x, hyper, inject = hyper_premix(hc, h)
        return hebrus_torch.hc_post_combine(hyper, out + x, inject)

    with torch.no_grad():
        want = layer_hc(h, out)
        got = torch.compile(layer_hc, fullgraph=True, backend="eager")(h, out)
    assert torch.equal(got, want)
