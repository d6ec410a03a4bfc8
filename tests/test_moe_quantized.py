"""Affine group quantization (MLX's semantics, hebrus_torch/moe/quantize.py) and hebrus::moe_experts_quantized
(issue 36): the rounding against a per-group loop written from MLX's description, packing, the CPU kernel
against dequantize-then-reference, batch independence, opcheck and bad input."""

from __future__ import annotations

import pytest
import torch

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.moe.quantize import dequantize, quantize, unpack
from test_moe_experts import assert_close_rel, make_inputs


def mlx_group(values: list[float], bits: int) -> tuple[list[int], float, float]:
    """One group quantized value by value as MLX's affine_quantize does it (fp32 arithmetic via float32 casts)."""
    f = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731  (round to fp32)
    n = float((1 << bits) - 1)
    lo, hi = min(values), max(values)
    delta = max(f(f(hi - lo) / n), f(1e-7))
    use_lo = abs(lo) > abs(hi)
    scale = delta if use_lo else -delta
    edge = lo if use_lo else hi
    q0 = round(f(edge / scale))                               # Python's round: ties to even, as rint
    bias = 0.0
    if q0 != 0:
        scale, bias = f(edge / q0), edge
    return [int(min(max(round(f(f(v - bias) / scale)), 0), n)) for v in values], scale, bias


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("group", (32, 64, 128))
def test_rounding_is_mlx_affine(bits, group, dtype):
    # In half precision MLX takes each code from the fp32 scale and bias, and only then rounds those two to the
    # weight's dtype for storage (the bf16 case failed when the codes came from the stored, rounded values).
    g = torch.Generator().manual_seed(bits + group)
    w = torch.randn(3, 2 * group, generator=g) * torch.tensor([[1.0], [0.01], [50.0]])
    w[0, :group] = 0.25                                        # a constant group: zero range
    w[1, group:] = torch.linspace(-1, 2, group)                # |max| > |min|: the edge is the maximum
    w = w.to(dtype)
    wq, scales, biases = quantize(w, bits, group)
    assert wq.dtype == torch.int32 and wq.shape == (3, 2 * group * bits // 32)
    assert scales.shape == biases.shape == (3, 2) and scales.dtype == dtype
    codes = unpack(wq, bits).reshape(3, 2, group)
    stored = lambda v: float(torch.tensor(v, dtype=torch.float32).to(dtype))  # noqa: E731
    for r in range(3):
        for j in range(2):
            q, s, b = mlx_group(w[r, j * group:(j + 1) * group].float().tolist(), bits)
            assert codes[r, j].tolist() == q
            assert float(scales[r, j]) == stored(s) and float(biases[r, j]) == stored(b)


def test_packing_little_end_first():
    w = torch.arange(32, dtype=torch.float32).reshape(1, 32)   # codes 0..15 twice (4 bits: scale 31/15 ...)
    wq, _, _ = quantize(w, 4, 32)
    codes = unpack(wq, 4)[0].tolist()
    word = int(wq[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * k)) & 15 for k in range(8)] == codes[:8]


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 128)])
def test_dequantize_error_is_within_a_step(bits, group):
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    wq, s, b = quantize(w, bits, group)
    back = dequantize(wq, s, b, bits, group)
    step = s.float().abs().repeat_interleave(group, -1)
    # A step for the rounding and the clamped far end, plus what storing the scale in bf16 (relative error at
    # most 2**-8) costs a code of up to n, since the codes come from the fp32 scale (MLX's order).
    n = (1 << bits) - 1
    assert bool(((back - w.float()).abs() <= step * (1.01 + n * 2.0 ** -8) + 1e-6).all())
    # bits / 8 bytes a value plus a bf16 scale and bias a group: 4 bits / group 64 is 3.56x smaller than bf16
    size = wq.numel() * 4 + (s.numel() + b.numel()) * 2
    assert size == w.numel() * (bits / 8 + 4 / group)
    if (bits, group) == (4, 64):
        assert w.numel() * 2 / size > 3.5


def quantized_inputs(rows, hidden, inter, experts, top_k, dtype, bits, group, seed=0, **kw):
    x, ids, w, gu, dn = make_inputs(rows, hidden, inter, experts, top_k, dtype, seed=seed, **kw)
    return (x, ids, w, *quantize(gu, bits, group), *quantize(dn, bits, group), group, bits)


def dense_of(args):
    x, ids, w, guq, gus, gub, dq, ds, db, group, bits = args
    return x, ids, w, dequantize(guq, gus, gub, bits, group), dequantize(dq, ds, db, bits, group)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 64), (8, 128), (4, 128)])
def test_matches_dequantize_then_reference(dtype, bits, group):
    args = quantized_inputs(6, 128, 128, 5, 3, dtype, bits, group, seed=bits * group)
    got = hebrus_torch.moe_experts_quantized(*args)
    want = reference.moe_experts_quantized(*args)
    assert_close_rel(got, want, dtype)
    if dtype == torch.float32:   # the dequantized fp32 weights through the dense op give the same result
        assert_close_rel(got, hebrus_torch.moe_experts(*dense_of(args)), dtype)


def test_released_shape_layer_4bit():
    """hidden 2560, I 640, top 10, group 64 (10 experts): against dequantize-then-reference."""
    args = quantized_inputs(3, 2560, 640, 10, 10, torch.bfloat16, 4, 64, seed=5)
    assert_close_rel(hebrus_torch.moe_experts_quantized(*args), reference.moe_experts_quantized(*args),
                     torch.bfloat16)


def test_rows_independent_of_batch():
    """Alone, a row's experts read their codes in place; in the batch every expert has 9 pairs and its rows
    are dequantized once into scratch first: the same bits."""
    args = quantized_inputs(9, 64, 64, 2, 2, torch.bfloat16, 4, 32, seed=3)
    whole = hebrus_torch.moe_experts_quantized(*args)
    x, ids, w, *rest = args
    for t in (0, 8):
        alone = hebrus_torch.moe_experts_quantized(x[t:t + 1], ids[t:t + 1], w[t:t + 1], *rest)
        assert torch.equal(alone[0], whole[t])


@pytest.mark.parametrize("args", [quantized_inputs(4, 64, 32, 3, 2, torch.float32, 4, 32),
                                  quantized_inputs(3, 128, 64, 2, 2, torch.bfloat16, 8, 64, ids_dtype=torch.int32),
                                  quantized_inputs(0, 64, 32, 3, 2, torch.float16, 4, 32)])
def test_opcheck(args):
    torch.library.opcheck(torch.ops.hebrus.moe_experts_quantized.default, args)


def _bad_cases():
    base = quantized_inputs(3, 64, 32, 3, 2, torch.float32, 4, 32)
    x, ids, w, guq, gus, gub, dq, ds, db, group, bits = base

    def with_(**kw):
        names = ["x", "ids", "w", "guq", "gus", "gub", "dq", "ds", "db", "group", "bits"]
        vals = dict(zip(names, base))
        vals.update(kw)
        return tuple(vals[n] for n in names)

    yield "bits must be 4 or 8, got 3", with_(bits=3)
    yield "group_size must be 32, 64 or 128, got 16", with_(group=16)
    yield "gate_up_q must have dtype torch.int32", with_(guq=guq.long())
    yield "gate_up_scales dtype torch.bfloat16 must match x dtype torch.float32", with_(gus=gus.bfloat16())
    yield r"H = x.shape\[1\] = 64 must be a multiple of group_size 128", with_(group=128)
    yield r"gate_up_q must have shape \(E, 2 \* I, H \* bits / 32\)", with_(guq=guq[:, :, :4])
    yield r"down_q must have shape \(E, H, I \* bits / 32\) = \(3, 64, 4\)", with_(dq=dq[:, :, :2])
    yield r"down_biases must have shape \(3, 64, 1\), got \(3, 32, 1\)", with_(db=db[:, :32])
    yield r"topk_ids must have shape \(T, k\)", with_(ids=ids[:2])


@pytest.mark.parametrize("message,args", list(_bad_cases()))
def test_bad_input(message, args):
    for fn in (hebrus_torch.moe_experts_quantized, reference.moe_experts_quantized):
        with pytest.raises(HebrusError, match="hebrus::moe_experts_quantized: " + message):
            fn(*args)
    fake = [torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(HebrusError, match="hebrus::moe_experts_quantized: " + message):
        torch.ops.hebrus.moe_experts_quantized.default(*fake)


def test_expert_id_out_of_range():
    args = list(quantized_inputs(3, 64, 32, 3, 2, torch.float32, 8, 32))
    args[1] = args[1].clone()
    args[1][0, 1] = 3
    with pytest.raises(HebrusError, match=r"moe_experts_quantized: topk_ids\[0, 1\] = 3 is not an expert id"):
        hebrus_torch.moe_experts_quantized(*args)


def test_quantize_refuses_bad_options():
    w = torch.randn(2, 64)
    with pytest.raises(HebrusError, match="bits must be 4 or 8"):
        quantize(w, 3, 32)
    with pytest.raises(HebrusError, match="not a multiple of group_size 128"):
        quantize(w, 4, 128)
    with pytest.raises(HebrusError, match="must be float32, float16 or bfloat16"):
        quantize(w.double(), 4, 32)


# ---- quantized experts in a model: the engine and transformers' own forward -------------------------------

@pytest.mark.parametrize("bits", (4, 8))
def test_engine_on_quantized_experts_matches_transformers(bits):
    """quantize_experts swaps transformers' experts for QuantizedExperts: transformers' generate and the engine
    (which runs it as a module call) then give the same greedy tokens, and 8 bits stays close to the model."""
    from hf_models import random_model
    from hebrus_torch.engine import Engine, EngineConfig
    from hebrus_torch.moe.quantized_experts import QuantizedExperts, quantize_experts

    model = random_model(6, moe_intermediate_size=32)
    ids = torch.tensor([[5, 9, 14, 22, 7, 30, 11, 8, 41, 17, 12, 6, 19]])
    with torch.no_grad():
        dense_logits = model(ids).logits
    quantize_experts(model, bits=bits, group_size=32)
    assert sum(type(m) is QuantizedExperts for m in model.modules()) == model.config.num_hidden_layers
    with torch.no_grad():
        logits = model(ids).logits
    if bits == 8:
        torch.testing.assert_close(logits, dense_logits, atol=0.05, rtol=0.05)
    want = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=8, block_size=4))
    engine.add_request(ids[0].tolist(), request_id="a", max_new_tokens=5)
    engine.run()
    assert engine.requests["a"].generated == want


def test_quantize_experts_checks_every_module_first():
    from hf_models import random_model
    from hebrus_torch.moe.quantized_experts import quantize_experts

    model = random_model(7)                         # moe_intermediate_size 16: not a multiple of 32
    with pytest.raises(HebrusError, match="hebrus::quantize_experts: the input dimension 16"):
        quantize_experts(model, bits=4, group_size=32)
    assert not any(type(m).__name__ == "QuantizedExperts" for m in model.modules())
