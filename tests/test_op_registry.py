"""The op registry (issue 33): one list of the hebrus ops, their native devices and composites, which
``_extension`` and ``_emulate`` both read and neither imports the other for; and the reference split by
op family, every name still reachable as ``hebrus_torch.reference.X``."""

from __future__ import annotations

import ast
import re
import threading
from pathlib import Path

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import _emulate, _extension, _op_registry, reference
from hebrus_torch._op_registry import NATIVE_OPS, OP_NAMES, OPS, has_native_kernel

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hebrus_torch"


def hebrus_imports(source: str, package: str) -> set[str]:
    """The hebrus_torch modules that ``source`` (a module of ``package``) imports, anywhere in it
    (function-level imports included), as dotted names: ``from . import _emulate`` and
    ``from ._emulate import x`` both give ``hebrus_torch._emulate``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hebrus_torch"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module.startswith("hebrus_torch"):
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)   # `from pkg import submodule`
    return found


def module_imports(name: str) -> set[str]:
    """hebrus_imports of the top-level module ``hebrus_torch.<name>``."""
    return hebrus_imports((PACKAGE / f"{name}.py").read_text(), "hebrus_torch")


def test_hebrus_imports_sees_relative_and_function_level_imports():
    source = "import torch\nfrom .. import _emulate\ndef f():\n    from ..reference.qsa import qsa_pool\n"
    got = hebrus_imports(source, "hebrus_torch.engine")
    assert {"hebrus_torch._emulate", "hebrus_torch.reference.qsa"} <= got and "torch" not in got
    assert hebrus_imports("from hebrus_torch._extension import x", "hebrus_torch") >= {"hebrus_torch._extension"}


def test_extension_and_emulate_do_not_import_each_other():
    """Issue 33: `_emulate` imported `_extension` (for the composites) and `_extension` imported `_emulate`
    (for the emulated device's native list), one registry split in two. Both read `_op_registry` now."""
    extension = module_imports("_extension")
    emulate = module_imports("_emulate")
    registry = module_imports("_op_registry")
    assert "hebrus_torch._emulate" not in extension, extension
    assert "hebrus_torch._extension" not in emulate, emulate
    assert not {"hebrus_torch._emulate", "hebrus_torch._extension"} & registry, registry
    assert "hebrus_torch._op_registry" in extension and "hebrus_torch._op_registry" in emulate


def test_registry_lists_every_registered_op():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("hebrus::")}
    assert registered == set(OP_NAMES)
    for name in OP_NAMES:
        if not _extension.EXTENSION_ERROR:
            assert str(getattr(torch.ops.hebrus, name).default._schema) == "hebrus::" + OPS[name].schema


def _cpp_string_literals(text: str) -> str:
    """The adjacent C++ string literals of ``text`` concatenated."""
    return "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', text))


def test_registry_schemas_are_library_cpps():
    """Without a build too: the schemas equal csrc/library.cpp's m.def strings, in its order."""
    text = (ROOT / "csrc" / "library.cpp").read_text()
    body = text[text.index("TORCH_LIBRARY(hebrus, m)"):]
    body = body[:body.index("\n}\n")]
    defs = [_cpp_string_literals(d) for d in re.findall(r"m\.def\((.*?)\);", body, flags=re.S)]
    assert defs == [spec.schema for spec in OPS.values()]


def test_registry_native_devices_are_the_kernels_csrc_registers():
    """Each op's native device types equal the TORCH_LIBRARY_IMPL blocks of csrc/cpu (CPU) and csrc/mps
    (MPS), so the emulated MPS list is what a Mac build registers."""
    registered: dict[str, set[str]] = {"cpu": set(), "mps": set()}
    for path in [*(ROOT / "csrc" / "cpu").glob("*.cpp"), *(ROOT / "csrc" / "mps").glob("*.mm")]:
        for key, block in re.findall(r"TORCH_LIBRARY_IMPL\(hebrus, (\w+), m\) \{(.*?)\n\}", path.read_text(),
                                     flags=re.S):
            registered[key.lower()].update(re.findall(r'm\.impl\("(\w+)"', block))
    assert registered["cpu"] and registered["mps"]
    assert {d: set(ops) for d, ops in NATIVE_OPS.items()} == registered
    for name, spec in OPS.items():
        assert spec.native == {d for d, ops in registered.items() if name in ops}, name


def test_composites_and_native_lists_are_the_registrys():
    assert _emulate.NATIVE_OPS is _op_registry.NATIVE_OPS
    assert _extension.has_native_kernel is has_native_kernel and _extension.OP_NAMES == OP_NAMES
    for name, spec in OPS.items():
        if spec.composite_via is None:
            assert spec.composite is getattr(reference, name)
        assert spec.mutates == (name in ("ple_conv_into", "ple_ngram_ids_slots", "ple_conv_slots",
                                         "gdn_delta_rule", "gdn_delta_rule_slots",
                                         "gdn_chunk_delta_rule_slots", "decode_gdn_layer",
                                         "decode_attention_layer", "qsa_claim_cells"))


def test_has_native_kernel_answers_for_the_emulated_device_from_the_registry(monkeypatch):
    assert _op_registry.emulated_device_type() is None
    with _emulate.emulate("mps"):
        assert _emulate.emulated_device_type() == "mps"
        assert [has_native_kernel(op, "mps") for op in OP_NAMES] == [op in NATIVE_OPS["mps"] for op in OP_NAMES]
        assert not has_native_kernel("ple_conv_into", "mps")
        monkeypatch.setitem(NATIVE_OPS, "mps", NATIVE_OPS["mps"] - {"qsa_attention"})
        assert not has_native_kernel("qsa_attention", "mps")
    assert _op_registry.emulated_device_type() is None
    with pytest.raises(ht.HebrusError, match=r"can emulate \['mps'\], not 'cpu'"):
        with _emulate.emulate("cpu"):
            pass


def test_the_emulated_device_is_the_emulating_thread_s_alone():
    """A thread that never emulated reads None (a class default, not a failed lookup) while another emulates."""
    seen = []
    with _emulate.emulate("mps"):
        reader = threading.Thread(target=lambda: seen.append(_op_registry.emulated_device_type()))
        reader.start()
        reader.join()
        assert _op_registry.emulated_device_type() == "mps"
    assert seen == [None] and _op_registry.emulated_device_type() is None


def test_an_op_not_native_on_the_emulated_device_runs_its_composite(monkeypatch):
    """The registry's composite runs op by op where the emulated device has no kernel (a "fallback")."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8,
                                                                                                     generator=gen)
    cells = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1]], dtype=torch.int32)
    want = reference.qsa_attention(q, k, v, cells, 0.25)
    monkeypatch.setitem(NATIVE_OPS, "mps", NATIVE_OPS["mps"] - {"qsa_attention"})
    seen = []
    with _emulate.emulate("mps") as dev, _emulate.observe(lambda kind, name: seen.append((kind, name))):
        got = ht.qsa_attention(q.to(dev), k.to(dev), v.to(dev), cells.to(dev), 0.25)
        assert got.device.type == "mps"
        got = got.cpu()
    assert ("fallback", "qsa_attention") in seen and ("dispatch", "hebrus.qsa_attention") not in seen
    assert torch.equal(got, want)


# The names `hebrus_torch.reference` had as one module (before issue 33); tests, benchmarks and the
# drop-in reach them as reference.X.
REFERENCE_NAMES = [
    "assert_values", "check_cu_seqlens_values", "check_groups_contiguous", "check_slot_values",
    "check_token_cells_values", "checks_async", "gdn_chunk_delta_rule_slots", "gdn_delta_rule",
    "gdn_delta_rule_slots", "gdn_gated_rms_norm", "gdn_gates", "hc_post_combine", "hc_premix", "hc_premix_quantized", "hc_rms_norm", "moe_experts", "moe_experts_quantized", "moe_route", "moe_shared_expert", "moe_shared_expert_quantized", "ple_conv", "ple_conv_into", "ple_conv_into_via", "ple_conv_rows", "ple_conv_slots",
    "ple_ngram_ids", "ple_ngram_ids_rows", "ple_ngram_ids_slots", "qsa_attention", "qsa_pool", "qsa_scores",
    "quantized_linear",
    "qsa_select", "rotate_half", "_qsa_select_all", "_silu",
    "qsa_token_cells", "qsa_plan_one_row", "qsa_claim_cells", "rms_norm_rope", "sigmoid_gate",
    "decode_gdn_layer", "decode_moe_tail", "decode_attention_head", "decode_attention_tail", "decode_attention_layer",
    "decode_ple_gate", "dense_projection",
]


def test_reference_package_keeps_every_name():
    from hebrus_torch.reference import attention, checks, decode, gdn, hc, moe, ple, qsa, uniform_rows

    families = (attention, checks, decode, gdn, hc, moe, ple, qsa, uniform_rows)
    for name in REFERENCE_NAMES:
        homes = [m for m in families if getattr(m, name, None) is getattr(reference, name)
                 and getattr(reference, name).__module__ == m.__name__]
        assert len(homes) == 1, (name, homes)
    assert set(reference.__all__) == {n for n in REFERENCE_NAMES if not n.startswith("_")}
    assert reference.ple_ngram_ids_rows.__module__ == "hebrus_torch.reference.uniform_rows"
