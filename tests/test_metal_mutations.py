"""The emulator sees what it must: each mutation of today's kernels below, applied to a copy of
mps_kernels/, makes the checks of `pytest -m metal` fail (and the unmutated kernels pass the same
checks). The mutations are the ones a GPU would punish but a lenient emulator would not:

* a threadgroup_barrier without mem_threadgroup (stores not made visible: shim barrier_visibility);
* precise:: -> fast:: (reduced accuracy on the GPU: the shim refuses fast::);
* threadgroup memory over 32 KiB (shim: tg_local refuses it);
* a threadgroup larger than the kernel's max_total_threads_per_threadgroup (msl_emu refuses it);
* `#pragma METAL fp contract(off)` removed (a build with -ffp-contract=fast then gives other bits).

And for the in-place state pools of the slot ops (not poisoned, so guard pages, schedules and the
comparison with the CPU kernel are what must see a wrong access):

* a pool row one slot off (the pool's guard page stops the launch at the last slot);
* token threads reading the state that their row's thread updates in place (a race: a schedule that
  runs the row threads first gives other bits).

And for the gated delta rule (gdn_delta_rule.metal), whose state lives in registers and whose token
tiles go through threadgroup memory: either barrier of the tile loop dropped (a SIMD-group reads a tile
before it is complete, or refills it while others still read it), the fill's barrier without
mem_threadgroup, a wrong SIMD-group reduction (simd_max for a sum, the l2norm's sum of squares left
lane-local), the GQA head repeat off by one or interleaved (h % Hk instead of h / (Hv / Hk)), and the
pool row one slot off.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
import msl_emu  # noqa: E402

from hebrus_torch import reference  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]


def mutated(tmp_path, stem: str, file: str, old: str, new: str, **build) -> msl_emu.Module:
    """mps_kernels/ copied to tmp_path with `old` replaced by `new` (exactly once) in `file`, and
    <stem>.metal of the copy built by the emulator. `old` and `new` may be tuples of replacements."""
    src = tmp_path / "mps_kernels"
    shutil.copytree(msl_emu.KERNEL_DIR, src, ignore=shutil.ignore_patterns("__pycache__"))
    path = src / file
    text = path.read_text()
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):
        assert text.count(o) == 1, f"mutation target not unique in {file}: {o!r}"
        text = text.replace(o, n)
    path.write_text(text)
    return msl_emu.build(str(src / f"{stem}.metal"), **build)


# A mutation that makes a loop endless must count as caught, not hang the suite: every launch here gets
# the emulator's watchdog at a budget far above what an unmutated kernel of these checks needs (well
# under a second of CPU), and WatchdogError is an MSLError, which the tests below accept.
MUTATION_WATCHDOG_S = 20.0


@pytest.fixture(autouse=True)
def watchdog(monkeypatch):
    monkeypatch.setattr(msl_emu, "WATCHDOG_S", MUTATION_WATCHDOG_S)


@pytest.fixture
def use(monkeypatch):
    def install(stem, module):
        monkeypatch.setitem(hebrus_emu.OVERRIDE, stem, module)
    return install


# ---- the checks the mutations must fail (each is what a test of the op asserts) ---------------------------

def attention_check():
    from test_metal_qsa_attention import make

    args = make(3, 8, 2, 40, 24, 20, 9, torch.float32, "scattered")
    got = hebrus_emu.qsa_attention(*args)
    torch.testing.assert_close(got, reference.qsa_attention(*args), rtol=1e-5, atol=1e-5)


def select_check():
    from test_metal_qsa_select import make

    args = make(9, 2, 16, 2, 300, torch.float32, seed=3)
    assert torch.equal(hebrus_emu.qsa_select(*args, 10), reference.qsa_select(*args, 10))


def conv_check(**emu):
    from test_metal_ple_conv import make

    x = make([5, 0, 9], 12, 4, 3, torch.float32)
    y, state = hebrus_emu.ple_conv(*x, 3, "silu", **emu)
    want = reference.ple_conv(*x, 3, "silu")
    torch.testing.assert_close(y, want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(state, want[1])
    return y


def conv_slots_check(**emu):
    from test_metal_ple_conv_slots import cpu, make

    args = make([5, 2, 9, 1], 12, 4, 3, torch.float32, pool_slots=6)  # no empty row: every slot is read
    pool = args[3].clone()
    y = hebrus_emu.ple_conv_slots(*args[:3], pool, args[4], 3, "none", **emu)
    want_y, want_pool = cpu(*args, 3, "none")
    assert torch.equal(y, want_y) and torch.equal(pool, want_pool)


def ngram_slots_check(**emu):
    from test_metal_ple_ngram_ids_slots import EOS, VOCAB, config, cpu, stream

    mult, sizes, offsets = config(3, 4, seed=2)
    tokens, cu, pool, slots = stream([5, 2, 1, 9], 3, pool_slots=6, seed=2)  # every slot is read
    got = pool.clone()
    ids = hebrus_emu.ple_ngram_ids_slots(tokens, cu, got, slots, mult, sizes, offsets, EOS, VOCAB, **emu)
    want_ids, want_pool = cpu(tokens, cu, pool, slots, mult, sizes, offsets, EOS, VOCAB)
    assert torch.equal(ids, want_ids) and torch.equal(got, want_pool)


def gdn_check(**emu):
    """The slot form against the CPU kernel (tolerance) under the forward schedule and two others, which
    must give the same bits (a race between SIMD-groups shows as a difference). Rows longer than a token
    tile, GQA repeat 2, odd head dims, every slot read (the pool's first and last too)."""
    from test_metal_gdn_delta_rule import assert_close, cpu_slots, emu_slots, make

    a = make([10, 3, 9], 2, 4, 33, 20, torch.float32, pool_slots=5, seed=21)
    base = emu_slots(a, **emu)
    assert_close(base, cpu_slots(a), torch.float32)
    for sched, seed in (("reverse", 0), ("random", 5)):
        other = emu_slots(a, sched=sched, seed=seed)
        assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])



def gdn_chunk_check(**emu):
    from test_metal_gdn_chunk_delta_rule import assert_matches, make

    # a whole chunk between partial ones, Dk of two slabs (the second partial), slots 0 and S - 1
    assert_matches(make([150, 3], [40, 64], dk=20, dv=12, seed=11), **emu)


def test_unmutated_kernels_pass_the_checks():
    attention_check()
    select_check()
    conv_check()
    for sched in ("forward", "reverse"):
        conv_slots_check(sched=sched)
        ngram_slots_check(sched=sched)
    gdn_check()
    for sched in ("forward", "reverse", "random"):
        gdn_chunk_check(sched=sched, seed=1)


# ---- barriers without mem_threadgroup ---------------------------------------------------------------------

@pytest.mark.parametrize("stem,old,check", [
    ("qsa_attention", "        q_tile[h][d] = static_cast<float>(q[(head0 + h) * dh + d]);\n      }\n    }\n"
                      "    threadgroup_barrier(mem_flags::mem_threadgroup);",
     attention_check),
    ("qsa_select", "    q_have[lid] = 0;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);", select_check),
])
def test_barrier_without_mem_threadgroup_is_caught(tmp_path, use, stem, old, check):
    new = old.replace("mem_flags::mem_threadgroup", "mem_flags::mem_none")
    use(stem, mutated(tmp_path, stem, f"{stem}.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError, torch.AcceleratorError)):
        check()


def test_barrier_with_device_flag_only_is_caught(tmp_path, use):
    old = "    q_have[lid] = 0;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);"
    use("qsa_select", mutated(tmp_path, "qsa_select", "qsa_select.metal", old,
                              old.replace("mem_flags::mem_threadgroup", "mem_flags::mem_device")))
    with pytest.raises((AssertionError, msl_emu.MSLError, torch.AcceleratorError)):
        select_check()


# ---- fast math ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stem,old", [
    ("ple_conv", "precise::exp(-acc)"),
    ("ple_conv_slots", "precise::exp(-acc)"),
    ("qsa_pool", "precise::cos(angle)"),
    ("qsa_pool", "precise::rsqrt("),
    ("qsa_attention", "precise::exp(s - m_sub)"),
    ("gdn_chunk_delta_rule", "precise::exp(glast)"),
])
def test_fast_math_is_refused(tmp_path, stem, old):
    with pytest.raises(msl_emu.MSLError, match=r"fast::\w+ is refused by the emulator"):
        mutated(tmp_path, stem, f"{stem}.metal", old, old.replace("precise::", "fast::"))


# ---- threadgroup memory and threadgroup size limits --------------------------------------------------------

def test_threadgroup_memory_over_32k_is_refused(tmp_path, use):
    # cand[QB][TILE] doubled: 16 KiB of top-k plus 16 KiB of candidates plus the small arrays > 32 KiB.
    use("qsa_select", mutated(tmp_path, "qsa_select", "qsa_select.metal", "threadgroup ulong cand[QB][TILE];",
                              "threadgroup ulong cand[QB][TILE * 2];"))
    with pytest.raises(msl_emu.MSLError, match=r"threadgroup memory of \d+ bytes exceeds the 32768 bytes"):
        select_check()


def test_threadgroup_over_max_total_threads_is_refused(tmp_path, use):
    use("qsa_attention", mutated(tmp_path, "qsa_attention", "qsa_attention.metal",
                                 "max_total_threads_per_threadgroup(HEBRUS_QSA_ATTN_TG)",
                                 "max_total_threads_per_threadgroup(128)"))
    with pytest.raises(msl_emu.MSLError, match=r"threadgroups of 256 threads exceed the kernel's "
                                               r"max_total_threads_per_threadgroup\(128\)"):
        attention_check()


def test_kernels_declare_their_limits():
    assert hebrus_emu.module("qsa_attention").limits["qsa_attention_h8_d256_float"] == 256
    assert hebrus_emu.module("qsa_select").limits["qsa_select_k512_half"] == 256
    assert hebrus_emu.module("qsa_pool").limits["qsa_pool_float"] == 256


# ---- FMA contraction ------------------------------------------------------------------------------------------

def test_contraction_pragma_is_what_pins_the_bits(tmp_path, use):
    # With the pragma, -ffp-contract=fast (-O2 -mfma) gives the bits of =off (tests/test_mps_glue.py);
    # without it the same build fuses acc + w * u and the conv output changes.
    if os.uname().machine != "x86_64":
        pytest.skip("the -mfma build is set up for x86-64")
    base = conv_check()
    old = "#pragma METAL fp contract(off)\n"
    use("ple_conv", mutated(tmp_path, "ple_conv", "hebrus_metal_common.h", old, "",
                            opt="-O2", extra=("-ffp-contract=fast", "-mfma")))
    y = conv_check()  # still within the tolerance of the reference ...
    assert not torch.equal(y, base)  # ... but other bits: the GPU's would depend on the compiler


# ---- in-place state pools ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stem,old,new,check", [
    ("ple_conv_slots", "device T* tail = state_pool + long(slots[b]) * L * channels;",
     "device T* tail = state_pool + (long(slots[b]) + 1) * L * channels;", conv_slots_check),
    ("ple_ngram_ids_slots", "device I* hist = history_pool + slot * ctx;",
     "device I* hist = history_pool + (slot + 1) * ctx;", ngram_slots_check),
])
def test_pool_row_one_slot_off_hits_the_guard_page(tmp_path, use, stem, old, new, check):
    # The pool is bound as the caller's tensor, not poisoned, but still guard-paged: the last slot's
    # neighbour lies past the end of the buffer (the checks' batches name slots 0 and S - 1).
    use(stem, mutated(tmp_path, stem, f"{stem}.metal", old, new))
    with pytest.raises(msl_emu.MSLError, match=r"past the end"):
        check()


@pytest.mark.parametrize("stem,old,new,check", [
    # token threads compute the outputs near the row start too, reading the state the row thread rewrites
    ("ple_conv_slots",
     "    if (rel < L) {\n      return;  // its conv reads the tail: the row's thread computes it before updating the "
     "tail\n    }\n    for (long c = c0; c < c1; ++c) {\n"
     "      y[t * channels + c] = ple_conv_slots_out(x, weight, state_pool, p, start, rel, c);",
     "    for (long c = c0; c < c1; ++c) {\n"
     "      y[t * channels + c] = ple_conv_slots_out(x, weight, state_pool + long(slots[b]) * L * channels, p, start, "
     "rel, c);",
     conv_slots_check),
    ("ple_ngram_ids_slots",
     ("    if (t - start < ctx) {\n      return;", "ple_ngram_slots_ids(tokens, history_pool, multipliers"),
     ("    if (false) {\n      return;", "ple_ngram_slots_ids(tokens, history_pool + long(slots[b]) * ctx, multipliers"),
     ngram_slots_check),
])
def test_token_threads_racing_the_in_place_update_are_caught(tmp_path, use, stem, old, new, check):
    use(stem, mutated(tmp_path, stem, f"{stem}.metal", old, new))
    check(sched="forward")  # token threads first: they read the old state, as if there were no race ...
    with pytest.raises(AssertionError):
        check(sched="reverse")  # ... the row threads first: the tail was already shifted



# ---- the gated delta rule -----------------------------------------------------------------------------

GDN_FILL_BARRIER = "    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is complete\n"
GDN_REUSE_BARRIER = "    threadgroup_barrier(mem_flags::mem_threadgroup);  // every SIMD-group is done with the tile\n"


@pytest.mark.parametrize("old,new", [
    (GDN_FILL_BARRIER, ""),                                                             # tile read before complete
    (GDN_REUSE_BARRIER, ""),                                                            # tile refilled while read
    (GDN_FILL_BARRIER, GDN_FILL_BARRIER.replace("mem_threadgroup", "mem_none")),        # stores not made visible
    ("const float sk = simd_sum(part);", "const float sk = simd_max(part);"),          # wrong reduction
    ("        qss = simd_sum(qss);\n", ""),                                              # l2norm over one lane's dims
    ("const long kh = h / p.rep;", "const long kh = (h + 1) / p.rep;"),                 # head repeat off by one
    ("const long kh = h / p.rep;", "const long kh = h % p.key_heads;"),                 # heads interleaved
], ids=["no-fill-barrier", "no-reuse-barrier", "fill-barrier-mem-none", "simd-max", "lane-local-norm",
        "head-off-by-one", "head-interleaved"])
def test_gdn_mutations_are_caught(tmp_path, use, old, new):
    use("gdn_delta_rule", mutated(tmp_path, "gdn_delta_rule", "gdn_delta_rule.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError, torch.AcceleratorError)):
        gdn_check()


def test_gdn_pool_row_one_slot_off_hits_the_guard_page(tmp_path, use):
    use("gdn_delta_rule", mutated(tmp_path, "gdn_delta_rule", "gdn_delta_rule.metal", "    row = slots[b];\n",
                                  "    row = long(slots[b]) + 1;\n"))
    with pytest.raises(msl_emu.MSLError, match=r"past the end"):
        gdn_check()


@pytest.mark.parametrize("old", ["precise::exp(g[t * hv + h])", "precise::sqrt(qss + HEBRUS_GDN_L2_EPS)"])
def test_gdn_fast_math_is_refused(tmp_path, old):
    with pytest.raises(msl_emu.MSLError, match=r"fast::\w+ is refused by the emulator"):
        mutated(tmp_path, "gdn_delta_rule", "gdn_delta_rule.metal", old, old.replace("precise::", "fast::"))


# ---- gdn_chunk_delta_rule: barriers and tiles ---------------------------------------------------------------

GDN = "gdn_chunk_delta_rule"
# The barrier between staging the K / Q slabs and the SIMD-groups' tile loads of pass A.
GDN_SLAB_BARRIER = ("        threadgroup_barrier(mem_flags::mem_threadgroup);\n        for (long tt = 0; tt < 2; ++tt) {\n"
                    "          const long d = sl * 2 + tt;\n          if (d >= dkt) {\n            break;\n          }\n"
                    "          simdgroup_float8x8 kt[8];")
# The barrier that publishes the inverted diagonal blocks before the solve reads them.
GDN_TINV_BARRIER = ("          tinv[I * 64 + r * 8 + c] = acc;\n        }\n      }\n"
                    "      threadgroup_barrier(mem_flags::mem_threadgroup);")


@pytest.mark.parametrize("old,new", [
    (GDN_SLAB_BARRIER, GDN_SLAB_BARRIER.replace("        threadgroup_barrier(mem_flags::mem_threadgroup);\n", "", 1)),
    (GDN_TINV_BARRIER, GDN_TINV_BARRIER.replace("mem_flags::mem_threadgroup", "mem_flags::mem_none")),
], ids=["dropped", "mem_none"])
def test_gdn_chunk_barrier_mutations_are_caught(tmp_path, use, old, new):
    use(GDN, mutated(tmp_path, GDN, f"{GDN}.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError, torch.AcceleratorError)):
        for sched in ("forward", "reverse", "random"):
            gdn_chunk_check(sched=sched, seed=1)


@pytest.mark.parametrize("old,new", [
    # pass A: K_J^T from the slab's first 8 key dims for both tile columns
    ("simdgroup_load(kt[J], kslab + J * 8 * GDN_SLAB + tt * 8, GDN_SLAB, ulong2(0, 0), true);",
     "simdgroup_load(kt[J], kslab + J * 8 * GDN_SLAB, GDN_SLAB, ulong2(0, 0), true);"),
    # the solve: the tile of M at (J, I) instead of (I, J)
    ("simdgroup_load(mij, matp + I * 8 * GDN_C + J * 8, GDN_C);",
     "simdgroup_load(mij, matp + J * 8 * GDN_C + I * 8, GDN_C);"),
    # pass B: K^T not transposed
    ("simdgroup_load(kt, kslab + I * 8 * GDN_SLAB + tt * 8, GDN_SLAB, ulong2(0, 0), true);",
     "simdgroup_load(kt, kslab + I * 8 * GDN_SLAB + tt * 8, GDN_SLAB);"),
], ids=["slab_origin", "transposed_tile", "no_transpose"])
def test_gdn_chunk_wrong_tiles_are_caught(tmp_path, use, old, new):
    use(GDN, mutated(tmp_path, GDN, f"{GDN}.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        gdn_chunk_check()


def test_gdn_chunk_endless_piece_loop_is_stopped_by_the_watchdog(tmp_path, use, monkeypatch):
    # The piece loop never advances (what once kept `pytest -m metal` busy for good): the launch stops
    # at the watchdog's budget with the kernel's name instead.
    use(GDN, mutated(tmp_path, GDN, f"{GDN}.metal", "    pos += m;\n", "    pos += m * (pos < 0);\n"))
    monkeypatch.setattr(msl_emu, "WATCHDOG_S", 1.0)
    with pytest.raises(msl_emu.WatchdogError, match=rf"kernel {GDN}\w*: watchdog: .*budget of 1 CPU seconds"):
        gdn_chunk_check()


def test_gdn_chunk_state_one_slot_off_hits_the_guard_page(tmp_path, use):
    use(GDN, mutated(tmp_path, GDN, f"{GDN}.metal", "state_pool + (long(slots[b]) * hv + h) * dk * dv;",
                     "state_pool + ((long(slots[b]) + 1) * hv + h) * dk * dv;"))
    with pytest.raises(msl_emu.MSLError, match=r"past the end"):
        gdn_chunk_check()


# ---- moe_experts (moe_experts.metal): the CPU kernel's summation order and bounds ---------------------------

def moe_check(**emu):
    import hebrus_torch
    from test_moe_experts import make_inputs

    # H and I with tails past a multiple of 16, every expert hit by every row (k = 3: the slot order counts)
    args = make_inputs(5, 40, 24, 3, 3, torch.float32, seed=13)
    assert torch.equal(hebrus_emu.moe_experts(*args, **emu), hebrus_torch.moe_experts(*args))


def test_unmutated_moe_kernels_pass_the_check():
    for sched in ("forward", "reverse", "random"):
        moe_check(sched=sched, seed=2)


@pytest.mark.parametrize("file,old,new", [
    ("moe_experts.h", "  v = v + simd_shuffle_down(v, ushort(8));\n  v = v + simd_shuffle_down(v, ushort(4));\n",
     "  v = v + simd_shuffle_down(v, ushort(4));\n  v = v + simd_shuffle_down(v, ushort(8));\n"),  # another tree
    ("moe_experts.metal", "  g = hebrus_moe_reduce(g);\n", "  g = simd_sum(g) * 0.5f;\n"),  # the hardware's tree
    ("moe_experts.metal", "      const bool in = d < H;\n", "      const bool in = d < H + 1;\n"),  # past the row
    ("moe_experts.metal", "    act[pair * p.inter + i] = hebrus_moe_act_value<T>(g, u);",
     "    act[pair * p.inter + i + 1] = hebrus_moe_act_value<T>(g, u);"),
    ("moe_experts.h", "    s = s + ywt[(t * p.top_k + j) * p.hidden + d];",
     "    s = s + ywt[(t * p.top_k + p.top_k - 1 - j) * p.hidden + d];"),
], ids=["reduce-tree", "simd-sum", "tail-past-row", "act-column-off-by-one", "slots-summed-backwards"])
def test_moe_mutations_are_caught(tmp_path, use, file, old, new):
    use("moe_experts", mutated(tmp_path, "moe_experts", file, old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError, torch.AcceleratorError)):
        for sched in ("forward", "random"):
            moe_check(sched=sched, seed=3)


def moe_grouped_check(**emu):
    import hebrus_torch
    from test_moe_experts import make_inputs

    # the grouped path: 60 pairs over 3 experts (3 tiles each, the last partial), H over two staging steps with
    # a tail, I over two output blocks (the second partial)
    args = make_inputs(20, 140, 24, 3, 3, torch.float32, seed=16)
    assert hebrus_emu.launches("moe_experts", *args)[0]["kernel"] == "moe_experts_route"
    assert torch.equal(hebrus_emu.moe_experts(*args, **emu), hebrus_torch.moe_experts(*args))


def test_unmutated_moe_grouped_kernels_pass_the_check():
    for sched in ("forward", "reverse", "random"):
        moe_grouped_check(sched=sched, seed=2)


@pytest.mark.parametrize("file,old,new", [
    ("moe_experts.metal",
     "e * 2 * I + I, o0, I, H, k0, tid);\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
     "e * 2 * I + I, o0, I, H, k0, tid);\n"),  # the staged tile read before every thread wrote it
    ("moe_experts.metal", "    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step restages\n", ""),
    ("moe_experts.metal", "      tiles[2 + 3 * tb] = pb + m;",
     "      tiles[2 + 3 * tb] = pb;"),  # every tile of a list its first: pairs past 8 never computed
    ("moe_experts.metal", "  for (uint j = 0; j < tid; ++j) {", "  for (uint j = 0; j <= tid; ++j) {"),
    ("moe_experts.metal", "const float gj = hebrus_moe_reduce(g[j]), uj = hebrus_moe_reduce(u[j]);",
     "const float gj = simd_sum(g[j]) * 0.5f, uj = hebrus_moe_reduce(u[j]);"),
    ("moe_experts.h", "static_cast<float>(src[(pair / div) * width + d])", "static_cast<float>(src[pair * width + d])"),
    ("moe_experts.h", "  for (long m = long(l); m < len; m += HEBRUS_MOE_LANES) {",
     "  for (long m = len - HEBRUS_MOE_LANES + long(l); m >= 0; m -= HEBRUS_MOE_LANES) {"),  # a lane's sum reversed
], ids=["stage-barrier", "restage-barrier", "tiles-all-at-the-list-start", "route-offsets-inclusive", "grouped-simd-sum",
        "x-row-of-the-pair", "lane-sum-reversed"])
def test_moe_grouped_mutations_are_caught(tmp_path, use, file, old, new):
    use("moe_experts", mutated(tmp_path, "moe_experts", file, old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError, torch.AcceleratorError)):
        for sched in ("forward", "reverse", "random"):
            moe_grouped_check(sched=sched, seed=3)


def moe_quantized_check(**emu):
    import hebrus_torch
    from test_moe_quantized import quantized_inputs

    from test_quantized_linear import linear_inputs

    args = quantized_inputs(3, 64, 64, 3, 3, torch.float32, 4, 32, seed=14)
    assert torch.equal(hebrus_emu.moe_experts_quantized(*args, **emu), hebrus_torch.moe_experts_quantized(*args))
    lin = linear_inputs(3, 64, 9, torch.float32, 4, 32, seed=15)
    assert torch.equal(hebrus_emu.quantized_linear(*lin, **emu), hebrus_torch.quantized_linear(*lin))
    # the grouped and tiled launches: 20 pairs over 3 experts, H and in over two staging steps
    args = quantized_inputs(10, 256, 64, 3, 2, torch.float32, 4, 32, seed=17)
    assert hebrus_emu.launches("moe_experts_quantized", *args)[0]["kernel"] == "moe_experts_route"
    assert torch.equal(hebrus_emu.moe_experts_quantized(*args, **emu), hebrus_torch.moe_experts_quantized(*args))
    lin = linear_inputs(17, 256, 20, torch.float32, 4, 32, seed=18)
    assert hebrus_emu.launches("quantized_linear", *lin)[0]["kernel"] == "quantized_linear_tiled_q4_float"
    assert torch.equal(hebrus_emu.quantized_linear(*lin, **emu), hebrus_torch.quantized_linear(*lin))


# (the code read and the fold are hebrus_quant.h's, shared with hc_premix.metal's quantized pre-mix)
@pytest.mark.parametrize("file,old,new", [
    ("hebrus_quant.h",
     "  return (codes[d / per_word] >> uint((d % per_word) * BITS)) & ((1u << BITS) - 1u);",
     "  return ((codes[d / per_word] >> uint((d % per_word) * BITS)) & ((1u << BITS) - 1u)) ^ 1u;"),
    ("hebrus_quant.h",
     "  return acc + (qx * static_cast<float>(scales[g]) + xs * static_cast<float>(biases[g]));",
     "  return acc + (qx * static_cast<float>(scales[g]) + xs * static_cast<float>(scales[g]));"),
    ("hebrus_quant.h",
     "  return (codes[d / per_word] >> uint((d % per_word) * BITS)) & ((1u << BITS) - 1u);",
     "  return (codes[d / per_word] >> uint((per_word - 1 - d % per_word) * BITS)) & ((1u << BITS) - 1u);"),
    ("moe_experts_quantized.metal", "    out[t * p.out + o] = static_cast<T>(acc);",
     "    out[o * p.rows + t] = static_cast<T>(acc);"),
    ("moe_experts_quantized.metal", "    const long gi = (k0 + g0) / group_size;",
     "    const long gi = g0 / group_size;"),                                                  # the step's groups
    ("moe_experts_quantized.metal", "      out[t * p.out + o] = static_cast<T>(acc[j]);",
     "      out[t * p.out + o0 + j] = static_cast<T>(acc[j]);"),
    ("moe_experts_quantized.metal",
     "    dst[v] = o < count && d < width ? uchar(hebrus_moe_code_bits<BITS>(codes + (base + o) * words, d)) : uchar(0);",
     "    dst[v] = o < count && d < width ? uchar(hebrus_moe_code_bits<BITS>(codes + (base + o0) * words, d)) : uchar(0);"),
], ids=["code-flipped", "fold-bias-as-scale", "codes-big-end-first", "linear-output-transposed", "group-of-the-step",
        "tiled-output-cell-dropped", "staged-codes-one-row"])
def test_moe_quantized_mutations_are_caught(tmp_path, use, file, old, new):
    moe_quantized_check()
    use("moe_experts_quantized", mutated(tmp_path, "moe_experts_quantized", file, old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError, torch.AcceleratorError)):
        moe_quantized_check()


# ---- hc_rms_norm (issue 37) --------------------------------------------------------------------------------

def hc_norm_check(**emu):
    from test_metal_hc_rms_norm import close, make

    x, w = make(5, 4 * 40, torch.float32, seed=8)     # groups of 40: two strides of the lanes, a tail
    close(hebrus_emu.hc_rms_norm(x, w, 40, 1e-6, **emu), reference.hc_rms_norm(x, w, 40, 1e-6), torch.float32)


# ---- hc_premix, hc_post_combine (issue 37) -----------------------------------------------------------------

def hc_premix_check(**emu):
    from test_metal_hc_premix import close, make

    args = make(5, 4, 40, 12, torch.float32, seed=8)     # hidden 40: two strides of the lanes, a tail
    got, want = hebrus_emu.hc_premix(*args, **emu), reference.hc_premix(*args)
    close(got[0], want[0], torch.float32)
    close(got[1], want[1], torch.float32)
    g = torch.Generator().manual_seed(3)
    hyper, out = torch.randn(5, 160, generator=g), torch.randn(5, 40, generator=g)
    inject = torch.randn(5, 4, generator=g)
    assert torch.equal(hebrus_emu.hc_post_combine(hyper, out, inject, **emu),
                       reference.hc_post_combine(hyper, out, inject))


HC_CHECKS = {"hc_rms_norm": hc_norm_check, "hc_premix": hc_premix_check}


@pytest.mark.parametrize("stem", HC_CHECKS)
def test_unmutated_hc_kernels_pass_their_checks(stem):
    for sched in ("forward", "reverse", "random"):
        HC_CHECKS[stem](sched=sched, seed=1)


@pytest.mark.parametrize("stem,old,new", [
    ("hc_rms_norm", "simd_sum(sum_sq)", "sum_sq"),                                           # lane-local norm
    ("hc_rms_norm", "simd_sum(sum_sq) / float(p.group)", "simd_sum(sum_sq) / float(p.dim)"),  # mean over the row
    ("hc_rms_norm", "* (1.0f + weight[wfirst + i])", "* (1.0f + weight[first + i])"),         # weight of the row offset
    ("hc_rms_norm", "i += HEBRUS_SIMD_WIDTH) {\n    const float v = static_cast<float>(x[first + i]);\n    sum_sq",
     "i += HEBRUS_SIMD_WIDTH + 1) {\n    const float v = static_cast<float>(x[first + i]);\n    sum_sq"),  # skips
    ("hc_premix", "simd_sum(sum_sq)", "sum_sq"),                                             # lane-local norm
    ("hc_premix", "simd_sum(sum_sq) / float(p.hidden)", "simd_sum(sum_sq) / float(p.hc * p.hidden)"),  # row norm
    ("hc_premix", "static_cast<float>(wr[j]) * hc_normed(hr, nw, j, inv)",
     "static_cast<float>(wr[j]) * hc_normed(hr, nw, j - begin, inv)"),                        # stream 0's
    ("hc_premix", "hc_round<T>(hc_round<T>(dot) / float(p.hc))", "hc_round<T>(dot)"),       # no / hc_count
    ("hc_premix", "2.0f * hc_round<T>(hc_sigmoid(scaled))", "hc_round<T>(hc_sigmoid(scaled))"),  # no 2 x
    ("hc_premix", "inv[t * p.hc + c]))", "inv[t * p.hc]))"),                                 # stream 0's norm
    ("hc_premix", "weights[t * p.injects + (o - p.rank)]", "weights[t * p.injects]"),         # one weight per row
    ("hc_premix", "static_cast<T>(sum / float(p.hc))", "static_cast<T>(sum)"),               # sum, not mean
    ("hc_premix", "for (long c = 0; c < cols; ++c)", "for (long c = 1; c < cols; ++c)"),     # skips a rank
    ("hc_premix", "inject[t * p.hc + c]", "inject[t * p.hc]"),                               # combine: stream 0
], ids=["norm-lane-local", "norm-mean-over-row", "norm-weight-row-offset", "norm-stride-skips",
        "premix-lane-local", "premix-norm-over-row", "premix-dot-reads-stream-0", "premix-no-div", "premix-no-2x",
        "premix-inv-stream-0", "premix-one-weight", "premix-sum-not-mean", "premix-skips-rank",
        "combine-stream-0"])
def test_hc_mutations_are_caught(tmp_path, use, stem, old, new):
    use(stem, mutated(tmp_path, stem, f"{stem}.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        HC_CHECKS[stem]()


def hc_premix_quantized_check(**emu):
    from test_metal_hc_premix_quantized import close, make

    for bits in (4, 8):     # hidden 40 with groups of 32: groups inside a stream and groups that span two
        args = make(5, 4, 40, 64, torch.float32, bits, 32, seed=8 + bits)
        got, want = hebrus_emu.hc_premix_quantized(*args, **emu), reference.hc_premix_quantized(*args)
        close(got[0], want[0], torch.float32)
        close(got[1], want[1], torch.float32)


def test_unmutated_quantized_premix_passes_its_check():
    for sched in ("forward", "reverse", "random"):
        hc_premix_quantized_check(sched=sched, seed=1)


@pytest.mark.parametrize("old,new", [
    ("acc = hebrus_moe_fold(acc, qx, xs,", "acc = hebrus_moe_fold(acc, qx, 0.0f,"),              # low: no biases
    ("biases + r * groups, g0 / group_size);\n    }\n    return u;",
     "biases + r * groups, 0);\n    }\n    return u;"),                                          # mix: group 0's
    ("const long first = hebrus_max(g0, begin)", "const long first = g0"),                      # span: other stream
    ("last = hebrus_min(g0 + group_size, end)", "last = g0 + group_size"),                      # span: next stream
    ("cr = codes + r * (cols * BITS / 32);\n    const long groups = cols / group_size;\n    for (long g0 = begin",
     "cr = codes + r * (cols / 32);\n    const long groups = cols / group_size;\n    for (long g0 = begin"),  # row
], ids=["low-no-bias", "mix-group-0-scale", "span-reads-previous-stream", "span-reads-next-stream",
        "low-code-row-stride"])
def test_quantized_premix_mutations_are_caught(tmp_path, use, old, new):
    use("hc_premix", mutated(tmp_path, "hc_premix", "hc_premix.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        hc_premix_quantized_check()


# ---- gdn_gates, gdn_gated_rms_norm (issue 37) ---------------------------------------------------------------

def gdn_fused_check(**emu):
    from test_metal_gdn_fused import close_gates, close_norm, gate_inputs, norm_inputs

    for param_dtype in (torch.bfloat16, torch.float16):   # A_log, dt_bias read in their own dtype
        args = gate_inputs(37, 5, torch.bfloat16, param_dtype=param_dtype, seed=9)
        close_gates(hebrus_emu.gdn_gates(*args, **emu), reference.gdn_gates(*args), torch.bfloat16, args[2])
    x, z, w = norm_inputs(6, 40, torch.bfloat16, seed=10)   # 40 features: two strides of the lanes, a tail
    for activation in ("silu", "sigmoid"):
        close_norm(hebrus_emu.gdn_gated_rms_norm(x, z, w, 1e-6, activation, **emu),
                   reference.gdn_gated_rms_norm(x, z, w, 1e-6, activation), torch.bfloat16)


def test_unmutated_gdn_fused_passes_the_check():
    for sched in ("forward", "reverse", "random"):
        gdn_fused_check(sched=sched, seed=1)


@pytest.mark.parametrize("old,new", [
    ("max(x, 0.0f) + precise::log", "precise::log"),                                      # softplus without max
    ("const long h = i % p.heads;", "const long h = i / p.heads;"),                       # another head's params
    ("return as_type<float>(uint(((device const ushort*)p)[i]) << 16);",
     "return float(((device const half*)p)[i]);"),                                        # bfloat read as half
    ("beta[i] = static_cast<float>(static_cast<T>(s));", "beta[i] = s;"),                 # beta not rounded to T
    ("simd_sum(sum_sq)", "sum_sq"),                                                       # lane-local norm
    ("if (p.round_product != 0) {", "if (p.round_product == 0) {"),                       # product rounding
    ("p.sigmoid != 0 ?", "p.sigmoid == 0 ?"),                                             # activations swapped
    ("const float gv = static_cast<float>(gate[first + i]);",
     "const float gv = static_cast<float>(x[first + i]);"),                               # gated by x
], ids=["softplus-no-max", "head-of-row", "bfloat-as-half", "beta-unrounded", "lane-local", "product-rounding",
        "activation-swapped", "gate-is-x"])
def test_gdn_fused_mutations_are_caught(tmp_path, use, old, new):
    use("gdn_fused", mutated(tmp_path, "gdn_fused", "gdn_fused.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        gdn_fused_check()


# ---- rms_norm_rope and qsa_token_cells (issue 37) ------------------------------------------------------------

def norm_rope_check(**emu):
    from test_metal_qsa_fused import close, weight
    from test_qsa_fused_ops import rope_inputs

    x, cos, sin = rope_inputs(5, 3, 80, 16, torch.float32, seed=8, wide=True)  # 80 dims: lanes stride, a tail
    w = weight(80, seed=2)
    close(hebrus_emu.rms_norm_rope(x, w, 1e-6, cos, sin, **emu), reference.rms_norm_rope(x, w, 1e-6, cos, sin),
          torch.float32)


def token_cells_check(**emu):
    from test_qsa_fused_ops import token_cells_inputs

    # 37 entries: two rounds of 32 lanes, -1 holes anywhere; runs of up to 59 groups: some selections skip groups
    args = token_cells_inputs(9, 37, 4, seed=4, max_groups=60)
    got, want = hebrus_emu.qsa_token_cells(*args, 4, **emu), reference.qsa_token_cells(*args, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_unmutated_fused_qsa_kernels_pass_the_checks():
    for sched in ("forward", "reverse", "random"):
        norm_rope_check(sched=sched, seed=1)
        token_cells_check(sched=sched, seed=1)


@pytest.mark.parametrize("old,new", [
    ("simd_sum(sum_sq)", "sum_sq"),                                                          # lane-local norm
    ("static_cast<T>(-static_cast<float>(x2))", "x2"),                                       # rotate_half's sign
    ("for (long d = p.rot + long(lane)", "for (long d = half + long(lane)"),                 # pass-through overwrites
    ("h * p.x_stride1", "h * p.dim"),                                                        # strides ignored
], ids=["lane-local", "rotate-sign", "pass-through-from-half", "head-stride"])
def test_norm_rope_mutations_are_caught(tmp_path, use, old, new):
    use("rms_norm_rope", mutated(tmp_path, "rms_norm_rope", "rms_norm_rope.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        norm_rope_check()


@pytest.mark.parametrize("old,new", [
    ("kept + long(simd_prefix_exclusive_sum(keep))", "kept + long(lane)"),                   # -1 holes kept
    ("kept += long(simd_sum(keep));", "kept += long(keep);"),                               # lane-local count
    ("const long tail0 = q_groups * r;", "const long tail0 = kept * r;"),                   # tail after the kept
    ("const bool in_tail = off < n;", "const bool in_tail = off <= n;"),                     # one cell too many
], ids=["holes-kept", "lane-local-count", "tail-offset", "tail-past-run"])
def test_token_cells_mutations_are_caught(tmp_path, use, old, new):
    use("qsa_token_cells", mutated(tmp_path, "qsa_token_cells", "qsa_token_cells.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        token_cells_check()


def gate_check(**emu):
    from test_metal_qsa_fused import close
    from test_qsa_fused_ops import gate_inputs

    out, gate = gate_inputs(4, 3, 40, torch.float32, seed=6)
    close(hebrus_emu.sigmoid_gate(out, gate, **emu), reference.sigmoid_gate(out, gate), torch.float32)


def test_unmutated_sigmoid_gate_passes_the_check():
    for sched in ("forward", "reverse", "random"):
        gate_check(sched=sched, seed=1)


@pytest.mark.parametrize("old,new", [
    ("h * p.g_stride1", "h * p.dim"),                                  # the gate's strides ignored
    ("precise::exp(-g)", "precise::exp(g)"),                           # sigmoid(-g)
    ("static_cast<float>(x[i])", "static_cast<float>(x[row])"),        # x indexed by the row
], ids=["gate-stride", "sigmoid-sign", "x-row"])
def test_sigmoid_gate_mutations_are_caught(tmp_path, use, old, new):
    use("sigmoid_gate", mutated(tmp_path, "sigmoid_gate", "sigmoid_gate.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        gate_check()


# ---- moe_route (issue 37) ----------------------------------------------------------------------------------

def moe_route_check(**emu):
    from test_metal_moe_route import check, lower_id_first, make

    for levels in (None, 3):                      # distinct probabilities, then ties across the top-k boundary
        logits, gate = make(5, 70, 1, torch.float32, seed=9, levels=levels)
        check(hebrus_emu.moe_route(logits, gate, 6, True, **emu), lower_id_first(logits, gate, 6, True),
              torch.float32)


def test_unmutated_moe_route_passes_the_check():
    for sched in ("forward", "reverse", "random"):
        moe_route_check(sched=sched, seed=1)


@pytest.mark.parametrize("old,new", [
    ("  mx = simd_max(mx);\n", "\n"),                                                  # lane-local max
    ("1.0f / simd_sum(sum)", "1.0f / sum"),                                          # lane-local sum
    ("simd_min(best_v == v ? best_i : 0x7FFFFFFF)", "simd_max(best_v == v ? best_i : -1)"),  # higher id first
    ("hebrus_route_precedes(last_v, last_i, v, e) && ", ""),                         # a slot selected twice
    ("total = total + v;", "total = v;"),                                            # renormalised by the last
    ("wr[p.top_k + c]", "wr[c]"),                                                    # gate over a routed weight
], ids=["lane-local-max", "lane-local-sum", "ties-higher-id", "no-exclusion", "renorm-last", "gate-slot"])
def test_moe_route_mutations_are_caught(tmp_path, use, old, new):
    use("moe_route", mutated(tmp_path, "moe_route", "moe_route.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        moe_route_check()


# ---- moe_shared_expert (issue 37) --------------------------------------------------------------------------

def moe_shared_check(**emu):
    from test_metal_moe_shared_expert import close, make

    args = make(5, 40, 24, torch.float32, seed=11)   # widths with a tail of the 16 lanes
    close(hebrus_emu.moe_shared_expert(*args, **emu), reference.moe_shared_expert(*args), torch.float32)


def test_unmutated_moe_shared_expert_passes_the_check():
    for sched in ("forward", "reverse", "random"):
        moe_shared_check(sched=sched, seed=1)


@pytest.mark.parametrize("old,new", [
    ("HebrusMoeDenseRows<T>{up_proj, p.hidden}", "HebrusMoeDenseRows<T>{gate_proj, p.hidden}"),  # up from the gate
    ("gate[row * p.gate_stride]", "gate[row]"),                                               # gate stride ignored
    ("static_cast<float>(routed[row * p.hidden + d]) + gated", "gated"),                     # routed dropped
    ("hebrus_moe_round<T>(silu_g * hebrus_moe_round<T>(u))", "hebrus_moe_round<T>(silu_g)"),   # up dropped
], ids=["up-from-gate", "gate-stride", "routed-dropped", "up-dropped"])
def test_moe_shared_expert_mutations_are_caught(tmp_path, use, old, new):
    use("moe_shared_expert", mutated(tmp_path, "moe_shared_expert", "moe_shared_expert.metal", old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        moe_shared_check()


def moe_shared_quantized_check(**emu):
    from moe_fused_cases import quantized_shared_args
    from test_metal_moe_shared_expert import quantized_close

    for bits in (4, 8):
        args = quantized_shared_args(3, 128, 64, torch.float32, bits, 64, seed=12 + bits)
        quantized_close(hebrus_emu.moe_shared_expert_quantized(*args, **emu), args, torch.float32)


def test_unmutated_moe_shared_expert_quantized_passes_the_check():
    for sched in ("forward", "reverse", "random"):
        moe_shared_quantized_check(sched=sched, seed=1)


@pytest.mark.parametrize("file,old,new", [
    ("moe_shared_expert.metal", "Rows{up_proj_q, up_proj_scales, up_proj_biases, p.hidden, p.group_size}",
     "Rows{up_proj_q, gate_proj_scales, up_proj_biases, p.hidden, p.group_size}"),    # up's scales of the gate
    ("moe_shared_expert.metal", "down_proj_q, down_proj_scales, down_proj_biases, p.inter, p.group_size}",
     "down_proj_q, down_proj_scales, down_proj_scales, p.inter, p.group_size}"),      # down's biases dropped
    ("moe_shared_expert.metal", "down_proj_q, down_proj_scales, down_proj_biases, p.inter, p.group_size}",
     "down_proj_q, down_proj_scales, down_proj_biases, p.inter, 32}"),                # the group size ignored
    ("moe_shared_expert.metal", "Rows{up_proj_q, up_proj_scales, up_proj_biases, p.hidden, p.group_size}",
     "Rows{gate_proj_q, up_proj_scales, up_proj_biases, p.hidden, p.group_size}"),     # up's codes of the gate
    ("moe_experts.h", "        qx = fma(hebrus_moe_code<BITS>(codes + r * words, d), xv, qx);",
     "        qx = fma(hebrus_moe_code<BITS>(codes + r * cols, d), xv, qx);"),            # row stride in values
], ids=["up-scales-of-gate", "down-biases-dropped", "group-size-ignored", "up-codes-of-gate", "code-row-stride"])
def test_moe_shared_expert_quantized_mutations_are_caught(tmp_path, use, file, old, new):
    use("moe_shared_expert", mutated(tmp_path, "moe_shared_expert", file, old, new))
    with pytest.raises((AssertionError, msl_emu.MSLError)):
        moe_shared_quantized_check()
