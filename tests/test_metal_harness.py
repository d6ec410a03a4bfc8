"""The Metal emulator itself (tests/metal): it must catch the bugs it exists to catch.

Deliberately broken kernels in tests/metal/bad_kernels.metal: divergent and skipped barriers, SIMD
functions in divergent code, missing barriers (visible through poisoned threadgroup memory under
another schedule), device accesses past either end of a buffer or far from every buffer,
threadgroup arrays indexed out of bounds, and address-space misuse (strict clang check). Plus the
conversions and builtins the hebrus kernels rely on.
"""

from __future__ import annotations

import os
import struct
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import msl_emu  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

BAD = os.path.join(msl_emu.HERE, "bad_kernels.metal")


@pytest.fixture(scope="module")
def mod() -> msl_emu.Module:
    return msl_emu.build(BAD)


def line_of(snippet: str) -> int:
    """Line number of `snippet` in bad_kernels.metal."""
    return next(i for i, line in enumerate(open(BAD), 1) if snippet in line)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def test_finds_plain_kernels(mod):
    assert {"tg_reverse", "racy_reverse", "divergent_barrier", "read_past_end", "address_spaces"} <= set(mod.kernels)


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
def test_correct_kernel_all_schedules(mod, sched):
    data = torch.arange(128, dtype=torch.float32)
    mod.dispatch("tg_reverse", [data], grid=(2,), tg=(64,), threads=False, sched=sched, seed=5)
    assert torch.equal(data, torch.cat([torch.arange(63, -1, -1), torch.arange(127, 63, -1)]).float())


def test_missing_barrier_reads_poison(mod):
    # Forward order happens to work; reverse order reads threadgroup memory nobody wrote yet (NaN).
    data = torch.arange(128, dtype=torch.float32)
    mod.dispatch("racy_reverse", [data], grid=(2,), tg=(64,), threads=False, sched="reverse")
    assert torch.isnan(data).any()


def test_divergent_barrier(mod):
    with pytest.raises(msl_emu.MSLError, match="different threadgroup_barrier calls"):
        mod.dispatch("divergent_barrier", [torch.ones(64)], grid=(1,), tg=(64,), threads=False)


def test_barrier_after_early_return(mod):
    with pytest.raises(msl_emu.MSLError, match=r"reached by 36 of 64 threads"):
        mod.dispatch("early_return", [torch.zeros(100), u32(100)], grid=(2,), tg=(64,), threads=False)
    # non-strict mode runs it the way a GPU might (undefined behaviour, but no report)
    mod.dispatch("early_return", [torch.zeros(100), u32(100)], grid=(2,), tg=(64,), threads=False, strict=False)


def test_divergent_simd(mod):
    with pytest.raises(msl_emu.MSLError, match=f"SIMD-group function at .*bad_kernels.metal:{line_of('s = simd_sum')} "
                                               r"called in divergent control flow \(16 lanes .* already returned"):
        mod.dispatch("divergent_simd", [torch.zeros(32)], grid=(1,), tg=(32,), threads=False)
    out = torch.zeros(32)
    mod.dispatch("divergent_simd", [out], grid=(1,), tg=(32,), threads=False, strict=False)
    assert out[:16].tolist() == [120.0] * 16 and out[16:].tolist() == [-1.0] * 16  # active lanes only


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
def test_uniform_simd(mod, sched):
    out = torch.zeros(4)
    mod.dispatch("uniform_simd", [out], grid=(1,), tg=(128,), threads=False, sched=sched)
    assert out.tolist() == [496.0] * 4


def test_read_past_end(mod):
    # guard="end" (the default) catches reads past the end; guard="start" reads before the start.
    n = 37
    with pytest.raises(msl_emu.MSLError, match=r"buffer\(0\) holds 148 bytes, accessed at byte offset 148 "
                                               r"\(past the end\) by thread_position_in_grid 36,0,0"):
        mod.dispatch("read_past_end", [torch.zeros(n), torch.zeros(n), u32(n)], grid=(n,), tg=(32,))


def test_out_of_bounds_names_the_source_line(mod):
    n = 40
    with pytest.raises(msl_emu.MSLError, match=rf"at .*bad_kernels\.metal:{line_of('in[gid + 1]')}"):
        mod.dispatch("read_past_end", [torch.zeros(n), torch.zeros(n), u32(n)], grid=(n,), tg=(32,))


def test_read_before_start(mod):
    n = 5
    with pytest.raises(msl_emu.MSLError, match=r"byte offset -4 \(before the start\) by thread_position_in_grid 0,0,0"):
        mod.dispatch("read_before_start", [torch.zeros(n), torch.zeros(n), u32(n)], grid=(n,), tg=(32,),
                     guard="start")


def test_wild_access_far_from_every_buffer(mod):
    # Not on a guard page: reported all the same (with the source line), the process survives.
    rows = torch.tensor([0, 1, -2 ** 31, 2], dtype=torch.int32)
    with pytest.raises(msl_emu.MSLError, match=rf"invalid memory access at address .* not next to any bound buffer "
                                               rf".*thread_position_in_grid 2,0,0 .*bad_kernels\.metal:"
                                               rf"{line_of('rows[gid]) * 4096')}"):
        mod.dispatch("wild_read", [torch.zeros(4 * 4096), torch.zeros(4), rows], grid=(4,), tg=(4,))


@pytest.mark.parametrize("guard", ["end", "start"])
def test_write_past_end(mod, guard):
    n = 8
    out = torch.zeros(n)
    with pytest.raises(msl_emu.MSLError, match=r"out-of-bounds device memory (write|access)"):
        mod.dispatch("write_past_end", [out, u32(n)], grid=(n + 1,), tg=(32,), guard=guard)


def test_threadgroup_array_out_of_bounds(mod):
    with pytest.raises(msl_emu.MSLError, match=r"threadgroup array index 32 out of bounds \[0, 32\)"):
        mod.dispatch("tg_out_of_bounds", [torch.zeros(64)], grid=(1,), tg=(64,), threads=False)


def test_conversions_match_torch(mod):
    special = [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.0e38, -3.4e38, 65504.0, 65520.0, 1e-8, 5.96e-8,
               float("inf"), float("-inf"), 1.0 + 2**-8, 1.0 + 3 * 2**-9]
    x = torch.cat([torch.tensor(special), torch.randn(1000) * 100, torch.randn(1000) * 1e-3])
    h = torch.zeros(x.shape, dtype=torch.float16)
    b = torch.zeros(x.shape, dtype=torch.bfloat16)
    back = torch.zeros(x.shape)
    mod.dispatch("convert_float", [x, h, b, back], grid=(x.numel(),), tg=(256,))
    assert torch.equal(h.view(torch.int16), x.to(torch.float16).view(torch.int16))
    assert torch.equal(b.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(back, x.to(torch.bfloat16).float())


def test_dispatch_threads_builtins(mod):
    n, tg = 70, 32  # 3 threadgroups, the last one partial (6 threads), as dispatchThreads runs them
    out = torch.zeros(n * 6, dtype=torch.int32)
    mod.dispatch("builtins", [out], grid=(n,), tg=(tg,))
    got = out.view(n, 6)
    gid = torch.arange(n)
    assert torch.equal(got[:, 0], gid.int()) and torch.equal(got[:, 1], (gid % tg).int())
    assert torch.equal(got[:, 2], torch.where(gid < 64, 32, 6).int()) and torch.equal(got[:, 3], (gid // tg).int())
    assert torch.equal(got[:, 4], (gid % 32).int()) and torch.equal(got[:, 5], torch.zeros(n, dtype=torch.int32))


@pytest.mark.skipif(not msl_emu.have_clang(), reason=f"{msl_emu.CLANG} not installed")
@pytest.mark.parametrize("case", [0, 1, 2, 3, 4])
def test_clang_strict_address_spaces(case):
    ok, out = msl_emu.check_clang(BAD, defines={"CASE": str(case)})
    if case == 0:
        assert ok, out
    else:
        assert not ok and "error" in out, out


def test_gxx_check_rejects_non_msl():
    # double does not exist in MSL: the shim turns it into an error.
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".metal", delete=False) as f:
        f.write("#include <metal_stdlib>\nusing namespace metal;\n"
                "kernel void k(device float* o [[buffer(0)]]) { double d = 1.0; o[0] = d; }\n")
    try:
        ok, out = msl_emu.check(f.name)
    finally:
        os.unlink(f.name)
    assert not ok and "double" in out


# ---- memory visibility, reduction order (shim: barrier_visibility, tree_reduce) ---------------------------

def test_barrier_without_mem_threadgroup_publishes_nothing(mod):
    data = torch.arange(128, dtype=torch.float32)
    mod.dispatch("tg_reverse_no_mem_flag", [data], grid=(2,), tg=(64,), threads=False)
    assert torch.isnan(data).all()  # every store before the barrier stayed unpublished (poison)


@pytest.mark.parametrize("flag", [0, 1])
def test_device_stores_are_published_only_by_mem_device(mod, flag):
    data = torch.zeros(2)
    mod.dispatch("device_publish", [data, u32(flag)], grid=(1,), tg=(2,), threads=False, device_visibility=True)
    if flag:
        assert data.tolist() == [42.0, 42.0]
    else:
        assert torch.isnan(data).all()
    data = torch.zeros(2)  # without the opt-in (the default) device stores are visible at any barrier
    mod.dispatch("device_publish", [data, u32(flag)], grid=(1,), tg=(2,), threads=False)
    assert data.tolist() == [42.0, 42.0]


def test_simd_sum_order_is_a_random_tree(mod):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, generator=g) * torch.logspace(-6, 6, 32)).float()
    same = torch.zeros(1, dtype=torch.int32)
    mod.dispatch("simd_order_assumed", [x, same], grid=(32,), tg=(32,), simd_seed=0)
    assert int(same) == 1  # lane order: bitwise the sequential sum
    seen = set()
    for seed in range(1, 9):
        mod.dispatch("simd_order_assumed", [x, same], grid=(32,), tg=(32,), simd_seed=seed)
        seen.add(int(same))
    assert 0 in seen  # a kernel that assumes lane order is caught


# ---- simdgroup_matrix (shim: simdgroup_matrix<T, 8, 8>, mat_multiply, mat_load, mat_store) ----------------

@pytest.mark.parametrize("transpose_b", [0, 1])
@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
def test_simdgroup_matrix_gemm16(mod, transpose_b, sched):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    c = torch.full((16, 16), float("nan"))
    mod.dispatch("mat_gemm16", [a, b, c, u32(transpose_b)], grid=(1,), tg=(32,), threads=False, sched=sched, seed=2)
    ref = a.double().numpy() @ (b.double().numpy().T if transpose_b else b.double().numpy())
    assert np.allclose(c.double().numpy(), ref, rtol=1e-5, atol=1e-5)


def test_simdgroup_matrix_half_and_thread_elements(mod):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(8, 8, generator=g).half(), torch.randn(8, 8, generator=g).half()
    d, elems = torch.zeros(8, 8, dtype=torch.half), torch.zeros(64, dtype=torch.half)
    mod.dispatch("mat_half", [a, b, d, elems], grid=(1,), tg=(32,), threads=False, simd_seed=0)
    # lane order, every product and partial sum rounded to half (the accumulator is the element type)
    ref = torch.zeros(8, 8, dtype=torch.half)
    for k in range(8):
        ref = (ref.float() + (a[:, k:k + 1].float() * b[k:k + 1, :].float()).half().float()).half()
    assert torch.equal(d, ref)
    lane = np.arange(32)
    row = (lane // 4 & 4) + (lane // 2) % 4
    col = (lane // 4 & 2) * 2 + (lane % 2) * 2
    want = torch.stack([d[row, col], d[row, col + 1]], 1).reshape(-1)
    assert torch.equal(elems, want)  # thread_elements(): lane l holds (row, col) and (row, col + 1)


def test_simdgroup_matrix_divergent(mod):
    with pytest.raises(msl_emu.MSLError, match=f"SIMD-group function at .*bad_kernels.metal:"
                                               f"{line_of('if (lane < 16) simdgroup_multiply_accumulate')} "
                                               r"called in divergent control flow"):
        mod.dispatch("mat_divergent", [torch.randn(64), torch.zeros(64)], grid=(1,), tg=(32,), threads=False)


@pytest.mark.parametrize("guard", ["end", "start"])
def test_simdgroup_load_out_of_bounds(mod, guard):
    a = torch.randn(10 * 8)
    mod.dispatch("mat_load_oob", [a, torch.zeros(64), u32(2)], grid=(1,), tg=(32,), threads=False, guard=guard)
    with pytest.raises(msl_emu.MSLError, match=r"buffer\(0\) holds 320 bytes, accessed at byte offset 320 \(past the end\)"):
        mod.dispatch("mat_load_oob", [a, torch.zeros(64), u32(3)], grid=(1,), tg=(32,), threads=False)
    with pytest.raises(msl_emu.MSLError, match=r"threadgroup pointer access at element 64 out of bounds \[0, 64\)"):
        mod.dispatch("mat_tg_oob", [torch.zeros(64)], grid=(1,), tg=(32,), threads=False)


def test_simdgroup_load_arguments_must_be_uniform(mod):
    with pytest.raises(msl_emu.MSLError, match=r"simdgroup_load at .*differ between the lanes"):
        mod.dispatch("mat_nonuniform", [torch.randn(80), torch.zeros(64)], grid=(1,), tg=(32,), threads=False)


def test_simdgroup_multiply_order_is_a_random_tree(mod):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(8, 8, generator=g) * torch.logspace(-4, 4, 8)).float()
    b = torch.randn(8, 8, generator=g)
    same = torch.zeros(1, dtype=torch.int32)
    mod.dispatch("mat_order_assumed", [a, b, same], grid=(1,), tg=(32,), threads=False, simd_seed=0)
    assert int(same) == 1  # lane order: bitwise the products summed in index order
    seen = set()
    for seed in range(1, 6):
        mod.dispatch("mat_order_assumed", [a, b, same], grid=(1,), tg=(32,), threads=False, simd_seed=seed)
        seen.add(int(same))
    assert 0 in seen  # a kernel that assumes an order is caught


# ---- the watchdog: a kernel that does not terminate ---------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_watchdog_stops_a_kernel_that_never_ends(mod, workers):
    """The loop of `spin_forever` never meets its bound: the launch stops after its budget of CPU
    time with the kernel's name and the loop's source line, as a GPU's watchdog aborts the command
    buffer (without it this test would not end)."""
    data = torch.zeros(1 + 64, dtype=torch.int32)
    data[0] = 7                                                    # odd: i += 2 steps over it
    start = time.monotonic()
    with pytest.raises(msl_emu.WatchdogError, match=r"kernel spin_forever: watchdog: .*budget of 0\.3 CPU seconds.*"
                                                    rf"bad_kernels\.metal:{line_of('data[1 + gid] = i;') - 1}|"
                                                    rf"bad_kernels\.metal:{line_of('data[1 + gid] = i;')}"):
        mod.dispatch("spin_forever", [data], grid=(64,), tg=(32,), workers=workers, watchdog_s=0.3)
    assert time.monotonic() - start < 30
    data[0] = 8                                                    # even: the same kernel ends
    mod.dispatch("spin_forever", [data], grid=(64,), tg=(32,), workers=workers, watchdog_s=0.3)
    assert data[1:].tolist() == [6] * 64


def test_watchdog_stops_threads_looping_over_barriers(mod):
    data = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(msl_emu.WatchdogError, match=r"kernel barrier_forever: watchdog: "):
        mod.dispatch("barrier_forever", [data], grid=(2,), tg=(64,), threads=False, sched="random", seed=3,
                     watchdog_s=0.3)
    data[0] = 1
    mod.dispatch("barrier_forever", [data], grid=(2,), tg=(64,), threads=False, watchdog_s=0.3)   # leaves at once


def test_watchdog_is_on_by_default():
    assert msl_emu.WATCHDOG_S > 0
