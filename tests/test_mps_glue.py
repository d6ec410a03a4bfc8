"""The MPS glue on Linux: nothing in csrc/mps/ reads a device tensor on the host, the .mm files only
encode what csrc/mps/hebrus_glue.h decides, and the emulator runs exactly those decisions
(tests/metal/glue_abi.cpp builds the header for Linux), value errors included: reported through the
stream's error buffer (c10::metal::ErrorMessages) and raised at the next synchronization.
"""

from __future__ import annotations

import os
import re
import struct
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
import msl_emu  # noqa: E402

from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

MPS_DIR = os.path.join(msl_emu.REPO, "csrc", "mps")
OPS = ("ple_conv", "ple_ngram_ids", "ple_conv_slots", "ple_ngram_ids_slots", "qsa_pool", "qsa_select",
       "qsa_attention", "gdn_delta_rule", "gdn_delta_rule_slots", "gdn_chunk_delta_rule_slots", "gdn_gates",
       "gdn_gated_rms_norm")
# csrc/mps/<file>.mm of an op, where not its name
MM_FILE = {"gdn_delta_rule_slots": "gdn_delta_rule", "gdn_chunk_delta_rule_slots": "gdn_chunk_delta_rule",
           "gdn_gates": "gdn_fused", "gdn_gated_rms_norm": "gdn_fused"}

# What a host read of a device tensor, or a wait for the GPU, looks like in C++ / Objective-C++.
HOST_READS = {
    "copy to the CPU": r"\.to\s*\(\s*(?:at::|c10::|torch::)?(?:kCPU|Device\s*\(\s*(?:at::|c10::)?(?:kCPU|DeviceType::CPU))",
    ".cpu()": r"\.cpu\s*\(",
    ".item": r"\.item\s*[<(]",
    "host pointer": r"\.(?:data_ptr|const_data_ptr|mutable_data_ptr)\s*[<(]",
    "accessor": r"\.accessor\s*<",
    "tensor indexing to a scalar": r"\]\s*\.\s*item",
    "synchronize": r"synchroni[sz]e",
    "commit": r"\bcommit\w*",
    "wait": r"\bwait\w*|waitUntil\w*",
    "host value checks": r"\bcheck_cu_values\b|\bcheck_slot_values\b|\bread_error\w*",
    "local scalar dense": r"_local_scalar_dense",
}


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)  # string literals (messages) say nothing about the code


def mps_sources() -> list[str]:
    return sorted(os.path.join(MPS_DIR, f) for f in os.listdir(MPS_DIR) if f.endswith((".mm", ".h", ".cpp")))


@pytest.mark.parametrize("path", mps_sources(), ids=os.path.basename)
def test_no_host_read_of_a_device_tensor(path):
    code = strip_comments(open(path).read())
    found = {what: m.group(0) for what, pat in HOST_READS.items() if (m := re.search(pat, code))}
    assert not found, f"{os.path.basename(path)} reads a device tensor on the host or waits: {found}"


@pytest.mark.parametrize("pattern", sorted(HOST_READS))
def test_the_source_check_sees_each_host_read(pattern):
    # Each pattern fires on the code it names (the check would otherwise pass vacuously).
    samples = {
        "copy to the CPU": "auto h = err.to(at::kCPU);",
        ".cpu()": "auto h = t.cpu();",
        ".item": "auto v = t[3].item<int64_t>();",
        "host pointer": "const int* p = host.data_ptr<int32_t>();",
        "accessor": "auto a = t.accessor<int, 1>();",
        "tensor indexing to a scalar": "auto v = t[i] .item();",
        "synchronize": "at::mps::getCurrentMPSStream()->synchronize(SyncType::COMMIT_AND_WAIT);",
        "commit": "stream->commitAndWait();",
        "wait": "[cb waitUntilCompleted];",
        "host value checks": "check_cu_values(op, cu, total);",
        "local scalar dense": "at::_local_scalar_dense(t);",
    }
    assert re.search(HOST_READS[pattern], strip_comments(samples[pattern]))
    if pattern == "host value checks":  # the slot ops' host check (csrc/ple_slots_checks.h) is one too
        assert re.search(HOST_READS[pattern], "check_slot_values(op, slots, pool.size(0));")


@pytest.mark.parametrize("op", OPS)
def test_mm_only_encodes_what_the_glue_decides(op):
    code = strip_comments(open(os.path.join(MPS_DIR, MM_FILE.get(op, op) + ".mm")).read())
    body = code[code.index(f"{op}_mps("):]
    body = body[body.index("{") + 1: body.index("\n}")]
    statements = [s.strip() for s in body.split(";") if s.strip()]
    assert len(statements) == 3, statements
    assert statements[0].startswith(f"const hebrus::glue::Call call = hebrus::glue::{op}(")
    assert statements[0].endswith("c10::DeviceType::MPS)")
    assert statements[1] == f'encode("", call)'  # literals are blanked by strip_comments
    # the outputs, or the glue's <op>_result(call, ...) of them (a dtype narrowing after the launches)
    assert statements[2].startswith("return") and ("call.outputs" in statements[2] or "_result(call" in statements[2])


def test_encode_is_setarg_error_buffer_and_dispatch_only():
    code = strip_comments(open(os.path.join(MPS_DIR, "hebrus_mps.h")).read())
    body = code[code.index("inline void encode("):]
    body = body[: body.index("\n}\n")]
    calls = set(re.findall(r"fn->(\w+)\(", body))
    assert calls == {"runCommandBlock", "startEncoding", "setArg", "setErrorBufferIndex", "dispatch"}


# ---- the emulator runs the glue's launches ----------------------------------------------------------------

def pool_inputs(seed=0, groups=6, r=4, dim=32):
    from test_metal_qsa_pool import make

    return make(groups, r, dim, 16, torch.float32, seed=seed)


def test_launch_is_the_plan():
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = pool_inputs()
    (launch,) = hebrus_emu.launches("qsa_pool", keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq)
    plan = hebrus_emu.plan("qsa_pool", keys.shape[0], 32, 6, 4, inv_freq.shape[0], eps)
    assert launch["kernel"] == hebrus_emu.kernel_name("qsa_pool", "", torch.float32) == "qsa_pool_float"
    assert (launch["threads"], launch["group"]) == (plan.threads, plan.group) == (6 * 32, 256)
    assert launch["params"] == plan.params_bytes
    assert (launch["error_index"], launch["params_index"]) == (7, 8)
    assert launch["written"] == [False] * 6 + [True]


def test_value_errors_surface_at_the_next_synchronization():
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = pool_inputs(seed=3)
    cell_pos[group_cells[4, 1]] += 7
    pooled = hebrus_emu.qsa_pool(keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq, sync=False)
    assert pooled.shape == (6, 32)  # the op returned without waiting for the device
    assert bool(torch.isnan(pooled[4]).all())  # the faulty group is not written
    with pytest.raises(HebrusError) as ref:
        reference.qsa_pool(keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq)
    with pytest.raises(torch.AcceleratorError) as err:
        hebrus_emu.synchronize()
    assert str(err.value) == str(ref.value)  # names the op, the group, the member and the positions
    hebrus_emu.synchronize()  # the stream's error count was reset


def test_metadata_errors_raise_before_any_launch():
    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = pool_inputs()
    with pytest.raises(HebrusError, match=r"hebrus::qsa_pool: "):
        hebrus_emu.launches("qsa_pool", keys, cell_pos.int(), group_cells, group_pos, weight, eps, inv_freq)


def test_empty_shapes_launch_check_kernels_instead_of_reading_values():
    from test_metal_qsa_attention import make as attention_inputs

    q, k, v, tc, scale = attention_inputs(3, 4, 2, 16, 8, 20, 5, torch.float32, seed=3)
    (launch,) = hebrus_emu.launches("qsa_attention", q, k, v[..., :0], tc, float(scale))
    assert launch["kernel"] == "qsa_attention_check_cells" and launch["threads"] == 3
    assert struct.unpack("<3q", launch["params"]) == (20, 3, tc.shape[1])
    x = torch.zeros(0, 4)
    (launch,) = hebrus_emu.launches("ple_conv", x, torch.zeros(4, 4), torch.tensor([0], dtype=torch.int32),
                                    torch.zeros(0, 9, 4), 3, "silu")
    assert launch["kernel"] == "ple_conv_check_cu" and launch["threads"] == 1
    with pytest.raises(torch.AcceleratorError, match=r"hebrus::ple_conv: cu_seqlens must start at 0 and end at "
                                                     r"T = 0, got 5 \.\. 5"):
        hebrus_emu.ple_conv(x, torch.zeros(4, 4), torch.tensor([5], dtype=torch.int32), torch.zeros(0, 9, 4), 3,
                            "silu")


def test_error_buffer_layout_is_pytorchs():
    # static_asserts in hebrus_glue.h compare with c10::metal::ErrorMessages; the emulator's decoder agrees.
    assert hebrus_emu.glue().error_buffer_bytes() == 4 + 30 * 512 == 4 + 30 * hebrus_emu.ERROR_MESSAGE_SIZE


@pytest.mark.parametrize("simd_seed", [0, 2, 3])
def test_results_do_not_depend_on_the_simd_reduction_order(simd_seed):
    # simd_sum combines lanes in a random tree (shim: tree_reduce); results stay within the tests'
    # tolerance of the reference whatever the order, and bitwise equal for a given order.
    from test_metal_qsa_attention import make as attention_inputs

    keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq = pool_inputs(seed=5, dim=64)
    want = reference.qsa_pool(keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq)
    got = hebrus_emu.qsa_pool(keys, cell_pos, group_cells, group_pos, weight, eps, inv_freq, simd_seed=simd_seed)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    args = attention_inputs(4, 4, 2, 40, 24, 30, 12, torch.float32, "scattered")
    a = hebrus_emu.qsa_attention(*args, simd_seed=simd_seed)
    torch.testing.assert_close(a, reference.qsa_attention(*args), rtol=1e-5, atol=1e-5)
    assert torch.equal(a, hebrus_emu.qsa_attention(*args, simd_seed=simd_seed, sched="random", seed=4))


def test_results_do_not_depend_on_fp_contraction():
    # The kernels pin contraction off (#pragma METAL fp contract(off) from MSL 3.2); built with
    # -ffp-contract=fast (and -mfma on x86-64) the emulator gives the same bits as with =off.
    from test_metal_ple_conv import make as conv_inputs
    from test_metal_qsa_attention import make as attention_inputs

    x = conv_inputs([5, 0, 9], 12, 4, 3, torch.float32)
    a = hebrus_emu.ple_conv(*x, 3, "silu")
    b = hebrus_emu.ple_conv(*x, 3, "silu", contract="fast")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    args = attention_inputs(3, 4, 2, 32, 16, 20, 9, torch.float32, "scattered")
    assert torch.equal(hebrus_emu.qsa_attention(*args), hebrus_emu.qsa_attention(*args, contract="fast"))
