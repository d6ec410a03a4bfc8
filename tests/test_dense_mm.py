"""The CPU kernels' dense projections (csrc/cpu/dense_mm.h), seen through hebrus::decode_ple_gate, whose reference
runs the same steps with F.linear:

- with the row kernel off (``hebrus_torch.row_kernel``), and for more than 8 rows always, they are ATen's mm bit
  for bit, on the direct BLAS call and on each way back to at::mm;
- by default, up to 8 rows are the row kernel's: exactly the order its header states (emulated here in float32
  tensors), each row's bits its own whatever the row count and the threads, within fp32 rounding of ATen's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hebrus_torch import reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.models.qwen4_exp.native import NativeLayers, dense_projection
from hebrus_torch.row_kernel import dense_row_kernel, row_kernel_enabled, set_dense_row_kernel

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
    with torch.no_grad(), dense_row_kernel(rows > 8):       # (more rows never take it)
        got = OP(emb, h, w, groups, eps, hc, hidden)
        want = reference.decode_ple_gate(emb, h, w, groups, eps, hc, hidden)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def row_kernel_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in the row kernel's order (cpu/row_math.h), in float32 tensor arithmetic: per output 16
    lanes, lane j adding the products of the columns c = j mod 16 in ascending c (the last ones zero-padded),
    then lane j + lane j + 8, and those as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))."""
    assert bias is None
    k = x.shape[1]
    pad = -k % 16
    xp, wp = F.pad(x, (0, pad)), F.pad(w, (0, pad))
    products = xp[:, None, :] * wp[None, :, :]                       # [M, N, K'] float32, each rounded
    acc = torch.zeros(x.shape[0], w.shape[0], 16)
    for c in range(0, k + pad, 16):
        acc = acc + products[..., c:c + 16]
    a = acc[..., :8] + acc[..., 8:]
    return ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("hidden,hc,ngram_dim", [(16, 2, 24), (48, 4, 40), (20, 2, 64)])
def test_a_few_rows_are_the_row_kernels_order_bit_for_bit(rows, hidden, hc, ngram_dim, monkeypatch):
    assert row_kernel_enabled()                  # (the default)
    emb, h, w, groups, eps = ple_gate_inputs(rows, hidden, hc, ngram_dim, seed=rows)
    with torch.no_grad():
        got = OP(emb, h, w, groups, eps, hc, hidden)
        atens = reference.decode_ple_gate(emb, h, w, groups, eps, hc, hidden)
        monkeypatch.setattr(F, "linear", row_kernel_linear)
        want = reference.decode_ple_gate(emb, h, w, groups, eps, hc, hidden)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for a, b in zip(got, atens):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8])
def test_the_row_kernels_order_holds_on_two_threads(rows, monkeypatch):
    """The key projection's 192 weight rows of 2048 columns split between two threads: still the order above (each
    output is one dot product; the emulation above depends on nothing but the row)."""
    emb, h, w, groups, eps = ple_gate_inputs(rows, 48, 4, 2048, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            got = OP(emb, h, w, groups, eps, 4, 48)
            monkeypatch.setattr(F, "linear", row_kernel_linear)
            want = reference.decode_ple_gate(emb, h, w, groups, eps, 4, 48)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_setting_is_restored_and_returned():
    with dense_row_kernel(False):
        assert not row_kernel_enabled()
        assert set_dense_row_kernel(True) is False
        assert set_dense_row_kernel(False) is True
    assert row_kernel_enabled()


def test_a_non_contiguous_weight_takes_atens_mm():
    emb, h, w, groups, eps = ple_gate_inputs(5, 16, 2, 24, seed=1)
    w[0] = w[0].t().contiguous().t()           # the same values, column-major
    w[2] = torch.cat([w[2], w[2]], dim=1)[:, :24]  # rows with a stride past their length
    assert not w[0].is_contiguous() and not w[2].is_contiguous()
    with torch.no_grad(), dense_row_kernel(False):
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
    with torch.no_grad():                      # (the row kernel is on: 3 rows would take it at IEEE precision)
        got = OP(emb, h, w, groups, eps, 4, 48)
        want = reference.decode_ple_gate(emb, h, w, groups, eps, 4, 48)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---- hebrus::dense_projection: one such projection as an op (the engine's lm_head of a decode step) ----------------


@pytest.mark.parametrize("rows", [1, 5, 8, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_projection_is_the_row_kernel_for_a_few_float_rows_else_atens(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 70, generator=g).to(dtype), torch.randn(33, 70, generator=g).to(dtype)
    with torch.no_grad():
        got = dense_projection(x, w)
        with dense_row_kernel(False):
            assert torch.equal(dense_projection(x, w), F.linear(x, w))
    if dtype == torch.float32 and rows <= 8:
        assert torch.equal(got, row_kernel_linear(x, w))
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, F.linear(x, w))


@pytest.mark.parametrize("rows", [2, 12])
def test_dense_projection_opcheck(rows):
    x, w = torch.randn(rows, 24), torch.randn(40, 24)
    torch.library.opcheck(torch.ops.hebrus.dense_projection.default, (x, w))


@pytest.mark.parametrize("x, w, match", [
    (torch.randn(3, 8), torch.randn(5, 9), r"x must be \[T, K\] and weight \[N, K\], got \(3, 8\) and \(5, 9\)"),
    (torch.randn(8), torch.randn(5, 8), r"x must be \[T, K\]"),
    (torch.randn(3, 8), torch.randn(5, 8, dtype=torch.float64), "one floating dtype, got"),
    (torch.ones(3, 8, dtype=torch.int32), torch.ones(5, 8, dtype=torch.int32), "one floating dtype"),
])
def test_dense_projection_refuses_bad_inputs(x, w, match):
    with pytest.raises(HebrusError, match=match):
        dense_projection(x, w)
    with pytest.raises(HebrusError, match=match):
        reference.dense_projection(x, w)


def test_native_layers_project_takes_the_op_only_for_a_plain_linear_with_native_calls_on():
    layers = NativeLayers(torch.nn.ModuleList(), 0)
    lm_head = torch.nn.Linear(48, 30, bias=False)
    x = torch.randn(2, 48)
    with torch.no_grad():
        assert torch.equal(layers.project(lm_head, x), row_kernel_linear(x, lm_head.weight))
        off = NativeLayers(torch.nn.ModuleList(), 0, enabled=False)
        assert torch.equal(off.project(lm_head, x), F.linear(x, lm_head.weight))       # the Python path
        biased = torch.nn.Linear(48, 30)
        assert torch.equal(layers.project(biased, x), F.linear(x, biased.weight, biased.bias))
        seen = []
        handle = lm_head.register_forward_hook(lambda *args: seen.append(1))
        assert torch.equal(layers.project(lm_head, x), F.linear(x, lm_head.weight)) and seen == [1]
        handle.remove()
    assert torch.equal(layers.project(lm_head, x), F.linear(x, lm_head.weight))         # grad mode: the module
