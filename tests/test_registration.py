"""Registration: one schema per op, the Python mirror equals the compiled schemas, and the package
imports and works with no compiled extension at all (the reference then runs everywhere)."""

import subprocess
import sys
import textwrap

import pytest
import torch

import hebrus_torch
from hebrus_torch import _extension
from hebrus_torch._schemas import SCHEMAS


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
