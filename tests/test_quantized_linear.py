"""hebrus::quantized_linear (issue 36): x [T, in] times an affine-quantized W [out, in]^T. The CPU kernel against
the reference (dequantize, then torch's matmul) on random inputs and a released-shape projection, each output
row bitwise independent of the batch, the same bits on every CPU capability, opcheck, bad input, and
QuantizedLinear / quantize_linears."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.moe.quantize import quantize
from hebrus_torch.moe.quantized_linear import QuantizedLinear, quantize_linears
from test_moe_experts import assert_close_rel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def linear_inputs(rows, in_dim, out_dim, dtype, bits, group, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_dim, generator=gen).to(dtype)
    w = (torch.randn(out_dim, in_dim, generator=gen) / in_dim ** 0.5).to(dtype)
    return (x, *quantize(w, bits, group), group, bits)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
@pytest.mark.parametrize("rows,out_dim", [(1, 37), (3, 64), (9, 70)])
def test_matches_the_reference(dtype, bits, group, rows, out_dim):
    args = linear_inputs(rows, 256, out_dim, dtype, bits, group, seed=rows * out_dim + bits + group)
    assert_close_rel(hebrus_torch.quantized_linear(*args), reference.quantized_linear(*args), dtype)


def test_released_shape_projection():
    """o_proj of the released attention layer: [2560, 6144], 4 bits, group 64, bf16 rows."""
    args = linear_inputs(2, 6144, 2560, torch.bfloat16, 4, 64, seed=11)
    assert_close_rel(hebrus_torch.quantized_linear(*args), reference.quantized_linear(*args), torch.bfloat16)


@pytest.mark.parametrize("bits", (4, 8))
def test_rows_independent_of_batch(bits):
    """Alone (and in batches of up to 4) a row's weights are read as codes; in a batch of 9 they are dequantized
    into scratch first: the same bits either way."""
    x, *rest = linear_inputs(9, 128, 70, torch.bfloat16, bits, 32, seed=bits)
    whole = hebrus_torch.quantized_linear(x, *rest)
    for t in range(9):
        assert torch.equal(hebrus_torch.quantized_linear(x[t:t + 1], *rest)[0], whole[t]), t
    assert torch.equal(hebrus_torch.quantized_linear(x[2:6], *rest), whole[2:6])


_CAPABILITY_SCRIPT = """
import sys, torch, hebrus_torch
from hebrus_torch.moe.quantize import quantize
gen = torch.Generator().manual_seed(5)
outs = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for bits, group in ((4, 32), (8, 128)):
        for rows in (1, 9):
            x = torch.randn(rows, 256, generator=gen).to(dtype)
            w = torch.randn(37, 256, generator=gen).to(dtype)
            outs[f"{dtype} {bits} {rows}"] = hebrus_torch.quantized_linear(x, *quantize(w, bits, group), group, bits)
torch.save(outs, sys.argv[1])
"""


def assert_same_bits_on_every_capability(tmp_path, script: str, *args: str) -> None:
    """Runs `script` (which saves a dict of tensors to sys.argv[1]; `args` follow) under every HEBRUS_CPU_CAPABILITY
    this CPU has and compares each tensor with the portable build's bit for bit."""
    with open("/proc/cpuinfo") as f:
        flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    capabilities = ["default"] + (["avx2"] if {"avx2", "fma", "f16c"} <= flags else []) + (
        ["avx512"] if "avx512f" in flags else [])
    results = {}
    for capability in capabilities:
        env = {k: v for k, v in os.environ.items() if k != "HEBRUS_CPU_CAPABILITY"}
        env.update(HEBRUS_CPU_CAPABILITY=capability, PYTHONPATH=ROOT)
        out = tmp_path / f"{capability}.pt"
        done = subprocess.run([sys.executable, "-c", script, str(out), *args], env=env, capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-4000:]
        results[capability] = torch.load(out)
    for capability, outs in results.items():
        for key, got in outs.items():
            assert torch.equal(got, results["default"][key]), (capability, key)


def test_every_cpu_capability_gives_the_same_bits(tmp_path):
    assert_same_bits_on_every_capability(tmp_path, _CAPABILITY_SCRIPT)


@pytest.mark.parametrize("args", [linear_inputs(4, 64, 9, torch.float32, 4, 32),
                                  linear_inputs(3, 128, 16, torch.bfloat16, 8, 64),
                                  linear_inputs(0, 64, 5, torch.float16, 4, 32)])
def test_opcheck(args):
    torch.library.opcheck(torch.ops.hebrus.quantized_linear.default, args)


def _bad_cases():
    x, wq, s, b, group, bits = linear_inputs(3, 64, 8, torch.float32, 4, 32)
    yield "bits must be 4 or 8, got 3", (x, wq, s, b, group, 3)
    yield "group_size must be 32, 64 or 128, got 16", (x, wq, s, b, 16, bits)
    yield "x must be 2-D", (x[None], wq, s, b, group, bits)
    yield "wq must have dtype torch.int32", (x, wq.long(), s, b, group, bits)
    yield "scales dtype torch.bfloat16 must match x dtype torch.float32", (x, wq, s.bfloat16(), b, group, bits)
    yield r"in = x.shape\[1\] = 64 must be a multiple of group_size 128", (x, wq, s, b, 128, bits)
    yield r"wq must have shape \(out, in \* bits / 32\) with in = 64", (x, wq[:, :4], s, b, group, bits)
    yield r"biases must have shape \(8, 2\), got \(7, 2\)", (x, wq, s, b[:7], group, bits)


@pytest.mark.parametrize("message,args", list(_bad_cases()))
def test_bad_input(message, args):
    for fn in (hebrus_torch.quantized_linear, reference.quantized_linear):
        with pytest.raises(HebrusError, match="hebrus::quantized_linear: " + message):
            fn(*args)
    fake = [torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(HebrusError, match="hebrus::quantized_linear: " + message):
        torch.ops.hebrus.quantized_linear.default(*fake)


def test_quantized_linear_module():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, bias=False).bfloat16()
    q = QuantizedLinear.from_linear(linear, bits=8, group_size=32)
    x = torch.randn(2, 5, 64).bfloat16()
    y = q(x)
    assert y.shape == (2, 5, 24) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(10, 24), hebrus_torch.quantized_linear(x.reshape(10, 64), q.weight, q.scales,
                                                                        q.biases, 32, 8))
    torch.testing.assert_close(y, linear(x), atol=0.03, rtol=0.03)
    assert "bits=8" in repr(q)
    with pytest.raises(HebrusError, match="a linear with a bias is not supported"):
        QuantizedLinear.from_linear(torch.nn.Linear(64, 8))


def test_quantize_linears_checks_every_module_first():
    model = torch.nn.Sequential(torch.nn.Linear(64, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    with pytest.raises(HebrusError, match="quantize_linears: the input dimension 8"):
        quantize_linears(model, ["0", "1"], bits=4, group_size=32)
    assert type(model[0]) is torch.nn.Linear
    with pytest.raises(HebrusError, match="is a Linear with a bias"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(64, 8)), ["0"])
    quantize_linears(model, ["0"], bits=4, group_size=32)
    assert type(model[0]) is QuantizedLinear and type(model[1]) is torch.nn.Linear
