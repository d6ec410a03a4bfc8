"""The CPU kernels' dense projections (csrc/cpu/dense_mm.h) are ATen's mm bit for bit, on the direct BLAS call and on
each way back to at::mm: seen through hebrus::decode_ple_gate, whose reference runs the same steps with F.linear."""

from __future__ import annotations

import pytest
import torch

from hebrus_torch import reference

OP = torch.ops.hebrus.decode_ple_gate


def ple_gate_inputs(rows: int, hidden: int, hc: int, ngram_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dim = 8

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    emb = rand(rows, ngram_dim // dim, dim)
    h = rand(rows, hc * hidden)
    weights = [rand(hc * hidden, ngram_dim) * 0.2, rand(hc * hidden), rand(hidden, ngram_dim) * 0.2,
               rand(hc * hidden), rand(hc * hidden)]
    return emb, h, weights, [hidden] * 3, [1e-6] * 3


@pytest.fixture
def matmul_precision():
    """Restores torch's fp32 matmul precision settings after a test changed them."""
    saved = (torch.backends.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision,
             torch.backends.cuda.matmul.fp32_precision)
    yield
    (torch.backends.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision,
     torch.backends.cuda.matmul.fp32_precision) = saved


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
@pytest.mark.parametrize("hidden,hc,ngram_dim", [(16, 2, 24), (48, 4, 40)])
def test_projections_are_atens_mm_bit_for_bit(rows, hidden, hc, ngram_dim):
    emb, h, w, groups, eps = ple_gate_inputs(rows, hidden, hc, ngram_dim, seed=rows)
    with torch.no_grad():
        got = OP(emb, h, w, groups, eps, hc, hidden)
        want = reference.decode_ple_gate(emb, h, w, groups, eps, hc, hidden)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_non_contiguous_weight_takes_atens_mm():
    emb, h, w, groups, eps = ple_gate_inputs(5, 16, 2, 24, seed=1)
    w[0] = w[0].t().contiguous().t()           # the same values, column-major
    w[2] = torch.cat([w[2], w[2]], dim=1)[:, :24]  # rows with a stride past their length
    assert not w[0].is_contiguous() and not w[2].is_contiguous()
    with torch.no_grad():
        got = OP(emb, h, w, groups, eps, 2, 16)
        want = reference.decode_ple_gate(emb, h, w, groups, eps, 2, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("setting", ["mkldnn bf16", "medium"])
def test_reduced_fp32_matmul_precision_takes_atens_mm(setting, matmul_precision):
    """Where torch is asked for reduced-precision fp32 matmuls, the projections are whatever ATen's mm makes of them
    (on a CPU with AMX-BF16, oneDNN's bf16 product: not the fp32 BLAS call's bits)."""
    emb, h, w, groups, eps = ple_gate_inputs(3, 48, 4, 40, seed=2)
    if setting == "medium":
        torch.set_float32_matmul_precision("medium")
    else:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    with torch.no_grad():
        got = OP(emb, h, w, groups, eps, 4, 48)
        want = reference.decode_ple_gate(emb, h, w, groups, eps, 4, 48)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
