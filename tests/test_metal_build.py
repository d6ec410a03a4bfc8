"""Builds of the Metal side on Linux: every kernel file through the emulator shim (g++) and the
strict clang check (real address spaces), the embedded-source header the glue compiles at first
use, kernel names on both sides, and the .mm glue type-checked as C++ against the torch headers.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import check_mm_syntax  # noqa: E402
import hebrus_emu  # noqa: E402
import msl_emu  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

METAL_FILES = sorted(glob.glob(os.path.join(msl_emu.KERNEL_DIR, "*.metal")))
TYPES = ("float", "half", "bfloat")
EXPECTED = {
    "ple_conv": {f"ple_conv_{t}" for t in TYPES} | {"ple_conv_check_cu"},
    "ple_ngram_ids": {"ple_ngram_ids_long", "ple_ngram_ids_check_cu"},
    "ple_conv_slots": {f"ple_conv_slots_{t}" for t in TYPES} | {"ple_conv_slots_check"},
    "ple_ngram_ids_slots": {"ple_ngram_ids_slots_long", "ple_ngram_ids_slots_check"},
    "qsa_pool": {f"qsa_pool_{t}" for t in TYPES},
    "qsa_select": {f"qsa_select_{v}_{t}" for v in ("k512", "k2048") for t in TYPES},
    "qsa_attention": {f"qsa_attention_h{h}_d{d}_{t}" for h in (1, 2, 4, 8) for d in (64, 128, 256) for t in TYPES}
    | {"qsa_attention_check_cells"},
    "gdn_delta_rule": {f"{op}_k{d}_{t}" for op in ("gdn_delta_rule", "gdn_delta_rule_slots") for d in (32, 64, 128, 256)
                       for t in TYPES} | {"gdn_delta_rule_check_cu", "gdn_delta_rule_slots_check"},
    "gdn_chunk_delta_rule": {f"gdn_chunk_delta_rule_slots_{t}" for t in TYPES}
    | {f"gdn_chunk_delta_rule_slots_gf32_{t}" for t in TYPES[1:]} | {"gdn_chunk_delta_rule_slots_check"},
    "moe_experts": {f"moe_experts_{k}_{t}" for k in ("act", "down", "sum", "act_grouped", "down_grouped")
                    for t in TYPES} | {"moe_experts_route"},
    "moe_experts_quantized": {f"{k}_{q}_{t}" for k in ("moe_experts_quantized_act", "moe_experts_quantized_down",
                                                        "moe_experts_quantized_act_grouped",
                                                        "moe_experts_quantized_down_grouped", "quantized_linear",
                                                        "quantized_linear_tiled") for q in ("q4", "q8") for t in TYPES},
    "hc_rms_norm": {f"hc_rms_norm_{t}" for t in TYPES},
    "gdn_fused": {f"{k}_{t}" for k in ("gdn_gates", "gdn_gated_rms_norm") for t in TYPES},
    "hc_premix": {f"{k}_{t}" for k in ("hc_premix_low", "hc_premix_mix", "hc_post_combine") for t in TYPES}
    | {f"{k}_{q}_{t}" for k in ("hc_premix_quantized_low", "hc_premix_quantized_mix") for q in ("q4", "q8")
       for t in TYPES},
    "qsa_token_cells": {"qsa_token_cells_long"},
    "rms_norm_rope": {f"rms_norm_rope_{t}" for t in TYPES},
    "sigmoid_gate": {f"sigmoid_gate_{t}" for t in TYPES},
    "moe_route": {f"moe_route_{t}" for t in TYPES},
    "moe_shared_expert": {*(f"moe_shared_expert_{k}_{t}" for k in ("act", "down") for t in TYPES),
                          *(f"moe_shared_expert_quantized_{k}_{q}_{t}" for k in ("act", "down") for q in ("q4", "q8")
                            for t in TYPES)},
}
# The op of a kernel file whose stem is not the op's name.
CHECK_KERNELS = {"ple_conv_check_cu", "ple_ngram_ids_check_cu", "ple_conv_slots_check", "ple_ngram_ids_slots_check",
                 "qsa_attention_check_cells", "gdn_delta_rule_check_cu", "gdn_delta_rule_slots_check",
                 "gdn_chunk_delta_rule_slots_check", "moe_experts_route"}
VARIANTS = {
    "qsa_select": ("k512", "k2048"),
    "qsa_attention": tuple(f"h{h}_d{d}" for h in (1, 2, 4, 8) for d in (64, 128, 256)),
    "gdn_delta_rule": ("k32", "k64", "k128", "k256"),
    "moe_experts_quantized": ("q4", "q8"),
    # (an op's own entry, where one file holds kernels with and without variants)
    "moe_shared_expert_quantized_act": ("q4", "q8"),
    "moe_shared_expert_quantized_down": ("q4", "q8"),
}
# Quantized kernels (variants q4 / q8) in a file whose other kernels have no variant.
QUANTIZED_VARIANTS = {"hc_premix": {k: ("q4", "q8") for k in ("hc_premix_quantized_low", "hc_premix_quantized_mix")}}
# Files holding the kernels of several ops (one templated body): the ops, as the host names them.
FILE_OPS = {"gdn_delta_rule": ("gdn_delta_rule", "gdn_delta_rule_slots"),
            "gdn_chunk_delta_rule": ("gdn_chunk_delta_rule_slots",),
            "moe_experts": ("moe_experts_act", "moe_experts_down", "moe_experts_sum", "moe_experts_act_grouped",
                            "moe_experts_down_grouped"),
            "gdn_fused": ("gdn_gates", "gdn_gated_rms_norm"),
            "moe_experts_quantized": ("moe_experts_quantized_act", "moe_experts_quantized_down",
                                      "moe_experts_quantized_act_grouped", "moe_experts_quantized_down_grouped",
                                      "quantized_linear", "quantized_linear_tiled"),
            "hc_premix": ("hc_premix_low", "hc_premix_mix", "hc_post_combine"),
            "moe_shared_expert": ("moe_shared_expert_act", "moe_shared_expert_down", "moe_shared_expert_quantized_act",
                                  "moe_shared_expert_quantized_down")}
# The glue function whose make_launch calls build a file's launches, and the kernels they bind, in order (a list
# of them for a file whose kernels several glue functions launch).
GLUE_FN = {"gdn_delta_rule": ("gdn_delta_rule_launches", ("gdn_delta_rule_slots", "gdn_delta_rule")),
           "gdn_chunk_delta_rule": ("gdn_chunk_delta_rule_slots", ("gdn_chunk_delta_rule_slots",)),
           "gdn_fused": [("gdn_gates", ("gdn_gates",)), ("gdn_gated_rms_norm", ("gdn_gated_rms_norm",))],
           # (the route and sum launches of both moe ops are helpers' (moe_route_launch, moe_sum_launch): checked
           # as a check kernel's layout; quantized_linear_tiled binds quantized_linear's buffers)
           "moe_experts": ("moe_experts", ("moe_experts_act_grouped", "moe_experts_down_grouped", "moe_experts_act",
                                           "moe_experts_down")),
           "moe_experts_quantized": [("moe_experts_quantized", ("moe_experts_quantized_act_grouped",
                                                                "moe_experts_quantized_down_grouped",
                                                                "moe_experts_quantized_act",
                                                                "moe_experts_quantized_down")),
                                     ("quantized_linear", ("quantized_linear",))],
           "hc_premix": [("hc_premix", ("hc_premix_low", "hc_premix_mix")),
                         ("hc_premix_quantized", ("hc_premix_quantized_low", "hc_premix_quantized_mix")),
                         ("hc_post_combine", ("hc_post_combine",))],
           "moe_shared_expert": [("moe_shared_expert", ("moe_shared_expert_act", "moe_shared_expert_down")),
                                 ("moe_shared_expert_quantized", ("moe_shared_expert_quantized_act",
                                                                  "moe_shared_expert_quantized_down"))]}


def stem(path: str) -> str:
    return os.path.basename(path)[: -len(".metal")]


def test_every_op_has_a_kernel_file():
    assert {stem(p) for p in METAL_FILES} == set(EXPECTED)


@pytest.mark.parametrize("path", METAL_FILES, ids=stem)
def test_builds_with_gxx_and_names_match_the_host_helper(path):
    names = set(hebrus_emu.module(stem(path)).kernels)
    assert names == EXPECTED[stem(path)]
    ids = stem(path) in ("ple_ngram_ids", "ple_ngram_ids_slots", "qsa_token_cells")
    dtypes = [hebrus_emu.torch.int64] if ids else list(hebrus_emu.METAL_TYPE)[:3]
    host = {hebrus_emu.kernel_name(op, v, d) for op in FILE_OPS.get(stem(path), (stem(path),))
            for v in VARIANTS.get(op, VARIANTS.get(stem(path), ("",))) for d in dtypes}
    if "gdn_chunk_delta_rule_slots" in FILE_OPS.get(stem(path), ()):  # g and beta in float32 with 16-bit q, k, v
        host |= {hebrus_emu.kernel_name("gdn_chunk_delta_rule_slots", "gf32", d) for d in dtypes[1:]}
    for op, file_variants in QUANTIZED_VARIANTS.get(stem(path), {}).items():  # a file's quantized op beside dense ones
        host |= {hebrus_emu.kernel_name(op, v, d) for v in file_variants for d in dtypes}
    assert host == names - CHECK_KERNELS  # hebrus::metal::kernel_name builds exactly the kernels' host_name strings


@pytest.mark.skipif(not msl_emu.have_clang(), reason=f"{msl_emu.CLANG} not installed")
@pytest.mark.parametrize("bfloat", [True, False])
@pytest.mark.parametrize("path", METAL_FILES, ids=stem)
def test_clang_strict_check(path, bfloat):
    ok, out = msl_emu.check_clang(path, defines=msl_emu.DEFAULT_DEFINES if bfloat else {})
    assert ok, out


def test_embedded_header():
    import embed_metal

    with tempfile.TemporaryDirectory() as out:
        header = embed_metal.write_embedded_header(msl_emu.KERNEL_DIR, out)
        text = open(header).read()
        assert text.isascii()
        for path in METAL_FILES:
            assert f"k_{stem(path)}_source[]" in text
        tu = os.path.join(out, "use.cpp")
        with open(tu, "w") as f:
            f.write('#include "hebrus_metal_sources.h"\n#include <cstring>\n'
                    "static_assert(sizeof(hebrus::metal::k_embedded_sources) / sizeof(hebrus::metal::EmbeddedSource)"
                    f" == {len(METAL_FILES)});\n"
                    "int main() { return std::strlen(hebrus::metal::k_qsa_pool_source) > 0 ? 0 : 1; }\n")
        r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-I", out, tu], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        # Rewriting with unchanged sources leaves the file alone (no rebuild of the glue).
        mtime = os.stat(header).st_mtime_ns
        embed_metal.write_embedded_header(msl_emu.KERNEL_DIR, out)
        assert os.stat(header).st_mtime_ns == mtime


def test_emulator_compiles_the_embedded_text():
    import embed_metal

    for path in METAL_FILES:
        embedded = embed_metal.metal_sources(msl_emu.KERNEL_DIR)[stem(path)]
        emulated = embed_metal.inline_source(path, (msl_emu.KERNEL_DIR,), line_names="abspath")
        strip = lambda s: [ln for ln in s.split("\n") if not ln.startswith("#line")]  # noqa: E731
        assert strip(embedded) == strip(emulated)


def test_mm_glue_typechecks_as_cpp():
    # A pass is remembered under build/metal_emu, keyed by a hash of every input (glue, kernels,
    # torch version, compiler): ~4 s of g++ per file is only spent when something changed.
    stamp = os.path.join(msl_emu.BUILD_DIR, f"mm_syntax.{check_mm_syntax.inputs_digest()}.ok")
    if os.path.exists(stamp):
        return
    results = check_mm_syntax.check_all(jobs=2, bfloat_off_files=1)
    assert len(results) == len(check_mm_syntax.mm_files()) + 1 >= 9  # every .mm, and one without bfloat
    failed = [f"{name}\n{out}" for name, ok, out in results if not ok]
    assert not failed, "\n".join(failed)
    os.makedirs(msl_emu.BUILD_DIR, exist_ok=True)
    open(stamp, "w").write("\n".join(name for name, _, _ in results) + "\n")


def _kernel_buffers(metal_path: str) -> dict[str, list[str]]:
    """For each kernel function of the file, the names of its [[buffer(i)]] parameters in index order."""
    import re

    text = open(metal_path).read()
    out = {}
    for m in re.finditer(r"\bvoid\s+(\w+)\s*\(([^{]*?)\)\s*\{", text):
        found = {int(i): name for name, i in re.findall(r"(\w+)\s*\[\[\s*buffer\((\d+)\)\s*\]\]", m.group(2))}
        if found:
            assert sorted(found) == list(range(len(found)))
            out[m.group(1)] = [found[i] for i in range(len(found))]
    return out


def _glue_buffers(op: str) -> list[list[str]]:
    """The tensor lists of hebrus::glue::<op>'s make_launch calls (csrc/mps/hebrus_glue.h), in order."""
    import re

    text = open(os.path.join(msl_emu.REPO, "csrc", "mps", "hebrus_glue.h")).read()
    body = text[text.index(f"inline Call {op}("):]
    body = body[: body.index("\n}\n")]
    return [[n.strip() for n in m.group(1).split(",")] for m in re.finditer(r"make_launch\([^{]*\{([^}]*)\}", body)]


@pytest.mark.parametrize("path", METAL_FILES, ids=stem)
def test_glue_binds_buffers_in_kernel_order(path):
    # Each launch of the glue binds its tensors as [[buffer(0..n-1)]], then the stream's error buffer
    # (buffer(n), `err`), then the parameter block (buffer(n + 1), `p`), in the kernel's order.
    kernels = _kernel_buffers(path)
    specs = GLUE_FN.get(stem(path), (stem(path), (stem(path),)))
    all_mains: set[str] = set()
    for fn, mains in specs if isinstance(specs, list) else [specs]:
        all_mains |= set(mains)
        glues = [g for g in _glue_buffers(fn) if len(g) > 1]
        assert len(glues) == len(mains)
        for glue, main_name in zip(glues, mains):
            main = kernels[main_name]
            assert len(glue) + 2 == len(main) and main[-2:] == ["err", "p"], (glue, main)
            for g, k in zip(glue, main):
                assert g in k or k in g, f"glue binds {g} where the kernel expects {k}: {glue} vs {main}"
    for name, params in kernels.items():
        if name not in all_mains:  # the check kernels: their inputs, the error buffer, the parameter block
            assert len(params) >= 3 and params[-2:] == ["err", "p"], (name, params)


@pytest.mark.skipif(not msl_emu.have_clang(), reason=f"{msl_emu.CLANG} not installed")
def test_kernels_built_by_clang_agree_with_gxx():
    # A second compiler's view of the same source: undefined behaviour or shim quirks that one
    # compiler happens to hide would show as a difference.
    import torch

    from test_metal_ple_conv import make as conv_inputs
    from test_metal_ple_ngram_ids import EOS, VOCAB, config, stream
    from test_metal_qsa_attention import make as attention_inputs
    from test_metal_qsa_pool import make as pool_inputs
    from test_metal_qsa_select import make as select_inputs

    x = conv_inputs([3, 0, 9], 6, 4, 3, torch.bfloat16)
    a = hebrus_emu.ple_conv(*x, 3, "silu")
    b = hebrus_emu.ple_conv(*x, 3, "silu", cxx=msl_emu.CLANG)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    mult, sizes, offsets = config(3, 8)
    tokens, cu, history = stream([5, 0, 12], 3)
    a = hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB)
    b = hebrus_emu.ple_ngram_ids(tokens, cu, history, mult, sizes, offsets, EOS, VOCAB, cxx=msl_emu.CLANG)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    args = pool_inputs(7, 4, 64, 32, torch.float16)
    assert torch.equal(hebrus_emu.qsa_pool(*args), hebrus_emu.qsa_pool(*args, cxx=msl_emu.CLANG))
    args = select_inputs(9, 4, 16, 2, 300, torch.float32)
    assert torch.equal(hebrus_emu.qsa_select(*args, 10), hebrus_emu.qsa_select(*args, 10, cxx=msl_emu.CLANG))
    for dtype in (torch.float32, torch.bfloat16):
        args = attention_inputs(5, 8, 2, 40, 24, 60, 33, dtype, "scattered")
        assert torch.equal(hebrus_emu.qsa_attention(*args), hebrus_emu.qsa_attention(*args, cxx=msl_emu.CLANG))
    from test_metal_gdn_delta_rule import make as gdn_inputs

    a = gdn_inputs([9, 0, 2], 2, 4, 33, 20, torch.float16)
    outs = []
    for cxx in ("g++", msl_emu.CLANG):
        pool = a["state_pool"].clone()
        outs.append((hebrus_emu.gdn_delta_rule_slots(*list(a.values())[:6], pool, a["slots"], 0.2, True, cxx=cxx), pool))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
