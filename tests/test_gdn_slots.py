"""hebrus::gdn_delta_rule_slots (issue 25): the gated delta rule with each row's state read from and
written back to a pool in place by slot id. Bits equal gdn_delta_rule on the gathered states (CPU
kernel; reference: its own bits); untouched slots stay bitwise; bad slots / cu_seqlens / metadata
are refused before anything is written; opcheck; torch.compile(fullgraph=True); version counter."""

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import _extension, reference
from hebrus_torch.gdn import gated_delta_rule_slots

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
native = pytest.mark.skipif(not _extension.has_native_kernel("gdn_delta_rule_slots", "cpu"),
                            reason="native CPU kernel not built")


def slot_args(lengths, hk=2, hv=4, dk=16, dv=8, dtype=torch.float32, pool_slots=None, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    T, B = sum(lengths), len(lengths)
    pool_slots = pool_slots or B + 3
    args = dict(
        q=torch.randn(T, hk, dk, generator=gen).to(dtype),
        k=torch.randn(T, hk, dk, generator=gen).to(dtype),
        v=torch.randn(T, hv, dv, generator=gen).to(dtype),
        g=(-torch.rand(T, hv, generator=gen) * 2).to(dtype),
        beta=torch.rand(T, hv, generator=gen).to(dtype),
        cu_seqlens=torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32),
        state_pool=torch.randn(pool_slots, hv, dk, dv, generator=gen) * 0.3,
        slots=torch.randperm(pool_slots, generator=gen)[:B].to(torch.int32),
    )
    return {k: v.to(device) for k, v in args.items()}


def plain(a, scale, l2=True, op=torch.ops.hebrus.gdn_delta_rule.default):
    """gather -> gdn_delta_rule -> scatter on a copy of the pool; returns (out, pool)."""
    pool = a["state_pool"].clone()
    idx = a["slots"].long()
    state = pool.index_select(0, idx)
    out = op(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], state, scale, l2)
    pool.index_copy_(0, idx, state)
    return out, pool


def slotted(a, scale, l2=True, op=torch.ops.hebrus.gdn_delta_rule_slots.default):
    pool = a["state_pool"].clone()
    out = op(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], pool, a["slots"], scale, l2)
    return out, pool


CASES = [  # lengths, hk, hv, dk, dv: decode, prefill, empty rows, GQA repeat 1/2/4, odd head dims
    ([1] * 6, 2, 4, 16, 8),
    ([3, 0, 12, 1, 9], 1, 4, 33, 31),
    ([5, 0, 0, 2], 2, 2, 32, 32),
    ([2, 7], 3, 6, 8, 17),
]


@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("l2", [True, False])
def test_kernel_equals_gather_op_scatter_bitwise(dtype, case, l2):
    lengths, hk, hv, dk, dv = CASES[case]
    a = slot_args(lengths, hk, hv, dk, dv, dtype, seed=case)
    want_out, want_pool = plain(a, 0.3, l2)
    got_out, got_pool = slotted(a, 0.3, l2)
    assert got_out.dtype == dtype and torch.equal(got_out, want_out)
    assert torch.equal(got_pool, want_pool)  # the slots' states updated, every other row bitwise kept


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_equals_its_gather_op_scatter_bitwise(case):
    lengths, hk, hv, dk, dv = CASES[case]
    a = slot_args(lengths, hk, hv, dk, dv, seed=10 + case)
    want_out, want_pool = plain(a, 0.25, op=reference.gdn_delta_rule)
    got_out, got_pool = slotted(a, 0.25, op=reference.gdn_delta_rule_slots)
    assert torch.equal(got_out, want_out) and torch.equal(got_pool, want_pool)


@native
def test_kernel_matches_reference():
    a = slot_args([4, 0, 9, 1], 2, 4, 32, 16, seed=3)
    got_out, got_pool = slotted(a, 0.2)
    ref_out, ref_pool = slotted(a, 0.2, op=reference.gdn_delta_rule_slots)
    torch.testing.assert_close(got_out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool, ref_pool, rtol=1e-5, atol=1e-5)


def test_untouched_slots_are_bitwise_unchanged():
    a = slot_args([3, 0, 2], pool_slots=7, seed=5)
    a["state_pool"][a["slots"][1].item()] = float("nan")  # a row of 0 tokens: its state (NaN bits too) passes
    before = a["state_pool"].clone()
    _, got = slotted(a, 0.3)
    named = set(a["slots"].tolist())
    for s in range(before.shape[0]):
        same = torch.equal(got[s].view(torch.int32), before[s].view(torch.int32))
        assert same == (s not in named or s == int(a["slots"][1])), s


@native
def test_decode_chunk_invariant():
    a = slot_args([5, 3, 4], 2, 4, 16, 8, seed=6)
    one_out, one_pool = slotted(a, 0.3)
    pool = a["state_pool"].clone()
    cu = a["cu_seqlens"].tolist()
    outs = torch.empty_like(one_out)
    for a_, b_ in ((0, 1), (1, 3), (3, 4), (4, 5)):   # 1/2/1/1 tokens per row (rows shorter drop out)
        rows = [r for r in range(3) if cu[r] + a_ < cu[r + 1]]
        tok = [list(range(cu[r] + a_, min(cu[r] + b_, cu[r + 1]))) for r in rows]
        flat = torch.tensor([t for ts in tok for t in ts])
        ccu = torch.tensor([0] + torch.tensor([len(t) for t in tok]).cumsum(0).tolist(), dtype=torch.int32)
        o = ht.gdn.gated_delta_rule_slots(a["q"][flat], a["k"][flat], a["v"][flat], a["g"][flat], a["beta"][flat],
                                          ccu, pool, a["slots"][rows], scale=0.3)
        outs[flat] = o
    assert torch.equal(outs, one_out) and torch.equal(pool, one_pool)


BAD_SLOTS = [([1, 1], r"slot 1 appears twice in one batch \(rows 0 and 1\); each row updates its slot in place"),
             ([0, 5], r"slots\[1\] = 5 is outside \[0, S=5\)"),
             ([-1, 0], r"slots\[0\] = -1 is outside \[0, S=5\)")]


def call(impl, a, scale=0.3):
    if impl == "kernel":
        return gated_delta_rule_slots(**a, scale=scale)
    return reference.gdn_delta_rule_slots(*a.values(), scale, True)


@pytest.mark.parametrize("bad,message", BAD_SLOTS)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_bad_slots_are_refused_and_nothing_is_written(bad, message, impl):
    a = slot_args([2, 3], pool_slots=5)
    a["slots"] = torch.tensor(bad, dtype=torch.int32)
    before = a["state_pool"].clone()
    with pytest.raises(ht.HebrusError, match=rf"hebrus::gdn_delta_rule_slots: {message}"):
        call(impl, a)
    assert torch.equal(a["state_pool"], before)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_bad_cu_seqlens_are_refused_and_nothing_is_written(impl):
    for cu, message in (([0, 3, 2, 5], r"cu_seqlens must be non-decreasing; row 1 has cu_seqlens\[1\] = 3 > "
                                       r"cu_seqlens\[2\] = 2"),
                        ([0, 2, 4, 6], r"cu_seqlens must start at 0 and end at T = 5, got 0 \.\. 6")):
        a = slot_args([2, 0, 3], pool_slots=5)
        a["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
        before = a["state_pool"].clone()
        with pytest.raises(ht.HebrusError, match=rf"hebrus::gdn_delta_rule_slots: {message}"):
            call(impl, a)
        assert torch.equal(a["state_pool"], before)


def test_bad_metadata_is_refused():
    op = ht.gdn.gated_delta_rule_slots
    a = slot_args([2, 3])
    a["slots"] = a["slots"].long()
    with pytest.raises(ht.HebrusError, match=r"hebrus::gdn_delta_rule_slots: slots must have dtype torch.int32"):
        op(**a)
    a = slot_args([2, 3])
    a["slots"] = a["slots"][:1]
    with pytest.raises(ht.HebrusError, match=r"slots must have one entry per row \(B = 2\), got 1"):
        op(**a)
    a = slot_args([2, 3])
    a["state_pool"] = a["state_pool"].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ht.HebrusError, match=r"state_pool must be contiguous"):
        op(**a)
    a = slot_args([2, 3])
    a["state_pool"] = torch.zeros(5, 4, 16, 9)
    with pytest.raises(ht.HebrusError, match=r"state_pool must be a \[S, Hv, Dk, Dv\] = \(S, 4, 16, 8\) float32"):
        op(**a)
    a = slot_args([2, 3])
    a["state_pool"] = a["state_pool"].double()
    with pytest.raises(ht.HebrusError, match=r"state_pool must be a .* float32 tensor, got .* torch.float64"):
        op(**a)
    a = slot_args([2, 3])
    a["v"] = a["state_pool"].view(-1)[: a["v"].numel()].view(a["v"].shape)
    with pytest.raises(ht.HebrusError, match=r"state_pool shares memory with v"):
        op(**a)
    a = slot_args([2, 3])
    a["g"] = a["g"][:, :1]
    with pytest.raises(ht.HebrusError, match=r"hebrus::gdn_delta_rule_slots: g must be \[T, Hv\]"):
        op(**a)


def test_fake_mirrors_the_checks():
    a = slot_args([2, 3])
    long_slots = a["slots"].long()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in a.items()}
        out = torch.ops.hebrus.gdn_delta_rule_slots.default(*fake.values(), 0.3, True)
        assert out.shape == a["v"].shape and out.dtype == a["v"].dtype
        fake["slots"] = mode.from_tensor(long_slots)
        with pytest.raises(ht.HebrusError, match=r"slots must have dtype torch.int32"):
            torch.ops.hebrus.gdn_delta_rule_slots.default(*fake.values(), 0.3, True)


def test_opcheck():
    for dtype in DTYPES:
        a = slot_args([2, 0, 3], dtype=dtype)
        torch.library.opcheck(torch.ops.hebrus.gdn_delta_rule_slots.default, (*a.values(), 0.3, True))


def test_compile_decode_loop_matches_eager():
    a = slot_args([1, 1, 1], pool_slots=6, seed=8)
    steps = [slot_args([1, 1, 1], pool_slots=6, seed=20 + i) for i in range(3)]

    def loop(pool):
        return [gated_delta_rule_slots(s["q"], s["k"], s["v"], s["g"], s["beta"], a["cu_seqlens"], pool, a["slots"])
                for s in steps]

    pools = [a["state_pool"].clone(), a["state_pool"].clone()]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(loop, fullgraph=True)(pools[0])
    finally:
        torch._dynamo.reset()
    eager = loop(pools[1])
    assert all(torch.equal(x, y) for x, y in zip(compiled, eager))
    assert torch.equal(pools[0], pools[1])


def test_version_counter_is_bumped_and_grad_mode_refused():
    a = slot_args([2, 1])
    version = a["state_pool"]._version
    gated_delta_rule_slots(**a)
    assert a["state_pool"]._version > version
    q = a["q"].clone().requires_grad_()
    with pytest.raises(ht.HebrusError, match=r"requires grad"), ht.errors.translated():
        torch.ops.hebrus.gdn_delta_rule_slots.default(q, *list(a.values())[1:], 0.3, True)


def test_without_extension_the_reference_runs():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        sys.modules["hebrus_torch._C"] = None
        import torch, hebrus_torch as ht
        from hebrus_torch import _extension
        assert _extension.EXTENSION_ERROR and not _extension.has_native_kernel("gdn_delta_rule_slots", "cpu")
        q = torch.randn(3, 1, 8); v = torch.randn(3, 2, 4); g = -torch.rand(3, 2); beta = torch.rand(3, 2)
        pool = torch.randn(4, 2, 8, 4); before = pool.clone()
        cu = torch.tensor([0, 2, 3], dtype=torch.int32); slots = torch.tensor([3, 1], dtype=torch.int32)
        out = ht.gdn.gated_delta_rule_slots(q, q.clone(), v, g, beta, cu, pool, slots)
        assert out.shape == (3, 2, 4)
        assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])
        assert not torch.equal(pool[3], before[3])
        try:
            ht.gdn.gated_delta_rule_slots(q, q.clone(), v, g, beta, cu, pool, torch.tensor([1, 1], dtype=torch.int32))
        except ht.HebrusError as e:
            assert "slot 1 appears twice" in str(e)
        else:
            raise AssertionError("duplicate slots accepted")
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
