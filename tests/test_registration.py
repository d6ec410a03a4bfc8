"""Registration: one schema per op, the op registry's (hebrus_torch._op_registry) equal the compiled
schemas, and the package imports and works with no compiled extension at all (the reference then runs
everywhere)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import hebrus_torch
from hebrus_torch import _extension
from hebrus_torch._op_registry import SCHEMAS


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_mirror_matches_compiled(name):
    if _extension.EXTENSION_ERROR:
        pytest.skip(f"extension not built: {_extension.EXTENSION_ERROR}")
    compiled = str(getattr(torch.ops.hebrus, name).default._schema)
    assert compiled == "hebrus::" + SCHEMAS[name]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_native_cpu_kernel_registered(name):
    if _extension.EXTENSION_ERROR:
        pytest.skip(f"extension not built: {_extension.EXTENSION_ERROR}")
    assert _extension.has_native_kernel(name, "cpu")


def test_import_without_extension_falls_back_to_reference():
    code = textwrap.dedent("""
        import sys
        sys.modules["hebrus_torch._C"] = None  # makes `from . import _C` raise ImportError
        import torch, hebrus_torch as ht
        from hebrus_torch import _extension
        assert _extension.EXTENSION_ERROR
        assert not _extension.has_native_kernel("ple_conv", "cpu")
        x = torch.randn(5, 3); w = torch.randn(3, 4); cu = torch.tensor([0, 5], dtype=torch.int32)
        y, s = ht.ple_conv(x, w, cu, torch.zeros(1, 9, 3))
        assert y.shape == (5, 3) and s.shape == (1, 9, 3)
        # ple_conv_into without a native kernel: the device's ple_conv, then a copy (the MPS path).
        assert not _extension.has_native_kernel("ple_conv_into", "cpu")
        yb, sb = torch.full((5, 3), float("nan")), torch.full((1, 9, 3), float("nan"))
        got = ht.ple_conv(x, w, cu, torch.zeros(1, 9, 3), out=(yb, sb))
        assert got[0] is yb and torch.equal(yb, y) and torch.equal(sb, s)
        for bad_out, bad_cu, message in [((x, sb), cu, "y shares memory with x"),
                                         ((yb, sb), torch.tensor([0, 4], dtype=torch.int32), "end at T = 5")]:
            before = yb.clone()
            try:
                ht.ple_conv(x, w, bad_cu, torch.zeros(1, 9, 3), out=bad_out)
            except ht.HebrusError as e:
                assert str(e).startswith("hebrus::ple_conv_into: ") and message in str(e), e
            else:
                raise AssertionError(message)
            assert torch.equal(yb, before)
        try:
            ht.ple_ngram_ids(torch.tensor([7]), torch.tensor([0, 1], dtype=torch.int32),
                             torch.zeros(1, 2, dtype=torch.long), torch.tensor([1, 3, 5]),
                             torch.tensor([11, 13]), torch.tensor([0, 11]), 0, 5)
        except ht.HebrusError as e:
            assert "outside" in str(e)
        else:
            raise AssertionError("out-of-range token accepted")
        # As with the compiled extension: backward through an op raises instead of giving no gradient.
        wg = w.clone().requires_grad_()
        try:
            ht.ple_conv(x, wg, cu, torch.zeros(1, 9, 3))[0].sum().backward()
        except RuntimeError as e:
            assert "derivative for hebrus::ple_conv is not implemented" in str(e), e
        else:
            raise AssertionError("backward through ple_conv gave no error")
        with torch.no_grad():
            assert not ht.ple_conv(x, wg, cu, torch.zeros(1, 9, 3))[0].requires_grad
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_errors_translate_tagged_kernel_messages():
    exc = hebrus_torch.errors.translate(ValueError("[HoleError] hebrus::qsa_pool: group 2 has a hole"))
    assert isinstance(exc, hebrus_torch.HoleError) and str(exc) == "hebrus::qsa_pool: group 2 has a hole"
    plain = ValueError("something else")
    assert hebrus_torch.errors.translate(plain) is plain


# ----------------------------------------------------------------------------------------------
# autograd: the ops have no backward, and say so instead of giving no gradient


def _needs_extension():
    if _extension.EXTENSION_ERROR:
        pytest.skip(f"extension not built: {_extension.EXTENSION_ERROR}")


def _conv_inputs(requires_grad: bool = False):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 4, generator=gen)
    w = torch.randn(4, 4, generator=gen).requires_grad_(requires_grad)
    return x, w, torch.tensor([0, 3, 7], dtype=torch.int32), torch.zeros(2, 9, 4)


def test_backward_through_an_op_raises():
    _needs_extension()
    import hebrus_torch as ht

    x, w, cu, state = _conv_inputs(requires_grad=True)
    y, new_state = ht.ple_conv(x, w, cu, state)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="derivative for hebrus::ple_conv is not implemented"):
        y.sum().backward()

    keys = torch.randn(8, 16, requires_grad=True)
    pooled = ht.qsa_pool(keys, torch.arange(8), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32),
                         torch.tensor([0, 4]), torch.ones(16), 1e-6, torch.ones(4))
    with pytest.raises(RuntimeError, match="derivative for hebrus::qsa_pool is not implemented"):
        pooled.sum().backward()

    q = torch.randn(2, 4, 16, requires_grad=True)
    k, v = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    out = ht.qsa_attention(q, k, v, torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="derivative for hebrus::qsa_attention is not implemented"):
        out.sum().backward()

    with torch.no_grad():
        assert not ht.qsa_attention(q, k, v, torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)).requires_grad


def test_ple_conv_into_behaves_like_an_aten_out_variant():
    _needs_extension()
    import hebrus_torch as ht
    from hebrus_torch.errors import HebrusError

    x, w, cu, state = _conv_inputs(requires_grad=True)
    y, new_state = torch.zeros(7, 4), torch.zeros(2, 9, 4)
    # An argument that requires grad, with grad mode on: refused, nothing written.
    with pytest.raises(HebrusError, match="weight requires grad"):
        ht.ple_conv(x, w, cu, state, out=(y, new_state))
    assert not y.any() and not new_state.any() and y._version == 0
    with torch.no_grad():
        ht.ple_conv(x, w, cu, state, out=(y, new_state))
    assert y._version > 0 and new_state._version > 0
    want, _ = ht.ple_conv(x, w.detach(), cu, state)
    assert torch.equal(y, want)

    # A buffer autograd saved and the op then overwrites: backward refuses, as after torch.mul(out=).
    p = torch.randn(7, 4, requires_grad=True)
    loss = (p * y).sum()
    with torch.no_grad():
        ht.ple_conv(x, w, cu, state, out=(y, new_state))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # The same when the overwrite happens inside inference_mode (the buffer is a normal tensor).
    loss = (p * y).sum()
    with torch.inference_mode():
        ht.ple_conv(x, w, cu, state, out=(y, new_state))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    # Inference tensors: written inside inference_mode, refused outside it (nothing written).
    with torch.inference_mode():
        y_inf, state_inf = torch.zeros(7, 4), torch.zeros(2, 9, 4)
        ht.ple_conv(x, w, cu, state, out=(y_inf, state_inf))
        assert torch.equal(y_inf, want)
        y_inf.zero_()
    with torch.no_grad(), pytest.raises(HebrusError, match="y is an inference tensor"):
        ht.ple_conv(x, w, cu, state, out=(y_inf, state_inf))
    assert not y_inf.any()


def test_a_build_for_another_torch_is_not_loaded(tmp_path):
    """Issue 27: a build against torch 2.11 segfaulted in qsa_pool. setup.py refuses other torches and records
    the one it built against; the package does not load a build whose torch differs from the running one."""
    from hebrus_torch._extension import build_mismatch

    info = tmp_path / "_build_info.json"
    assert build_mismatch(str(info), "2.13.0+cpu") is None                       # nothing recorded: load
    info.write_text(json.dumps({"torch": "2.13.0+cpu"}))
    assert build_mismatch(str(info), "2.13.1") is None                           # same minor version
    info.write_text(json.dumps({"torch": "2.11.0+cu130"}))
    why = build_mismatch(str(info), "2.13.0+cpu")
    assert "built against torch 2.11.0+cu130" in why and "this is torch 2.13.0+cpu" in why
    info.write_text("not json")
    assert build_mismatch(str(info), "2.13.0") is None
