"""hebrus::gdn_delta_rule (issue 17): the gated delta rule of packed rows, each row's state updated in
place. The CPU kernel against the reference (fp32 rounding apart: they sum over Dk in different
orders), both batch- and chunk-invariant bitwise on their own; bad arguments refused before anything
is written; opcheck; torch.compile(fullgraph=True)."""

import random

import pytest
import torch

from hebrus_torch import _extension, reference
from hebrus_torch.errors import HebrusError
from hebrus_torch.gdn import gated_delta_rule
from hebrus_torch.gdn.delta_rule import recurrent_delta_rule

native = pytest.mark.skipif(not _extension.has_native_kernel("gdn_delta_rule", "cpu"),
                            reason="native CPU kernel not built")


def inputs(lengths, hk=2, hv=4, dk=16, dv=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return dict(
        q=torch.randn(T, hk, dk, generator=gen).to(dtype),
        k=torch.randn(T, hk, dk, generator=gen).to(dtype),
        v=torch.randn(T, hv, dv, generator=gen).to(dtype),
        g=(-torch.rand(T, hv, generator=gen) * 2).to(dtype),
        beta=torch.rand(T, hv, generator=gen).to(dtype),
        cu_seqlens=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32),
        state=torch.randn(len(lengths), hv, dk, dv, generator=gen) * 0.3,
    )


def run_op(a, scale=0.25, l2=True):
    state = a["state"].clone()
    out = torch.ops.hebrus.gdn_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], state,
                                          scale, l2)
    return out, state


def run_reference(a, scale=0.25, l2=True):
    state = a["state"].clone()
    cu = a["cu_seqlens"].tolist()
    out = recurrent_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], cu, state, l2, scale)
    return out, state


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 8), (1, 1, 32, 32), (4, 8, 24, 40)])
@pytest.mark.parametrize("l2", [True, False])
def test_kernel_matches_reference(dtype, hk, hv, dk, dv, l2):
    a = inputs([5, 0, 37, 1, 12], hk, hv, dk, dv, dtype, seed=hk + dk)
    out, state = run_op(a, 0.3, l2)
    want_out, want_state = run_reference(a, 0.3, l2)
    assert out.dtype == dtype and out.shape == (a["q"].shape[0], hv, dv)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(state[1], a["state"][1])   # a row of no tokens passes its state through


@pytest.mark.parametrize("path", ["op", "reference"])
def test_rows_are_batch_and_chunk_invariant(path):
    """A row's bits do not depend on the other rows of the step or on where its tokens were cut."""
    if path == "op" and not _extension.has_native_kernel("gdn_delta_rule", "cpu"):
        pytest.skip("native CPU kernel not built")
    run = run_op if path == "op" else run_reference
    lengths = [random.Random(i).randint(0, 11) for i in range(24)]
    lengths[5] = 23
    a = inputs(lengths, seed=3)
    out, state = run(a)
    s, e = int(a["cu_seqlens"][5]), int(a["cu_seqlens"][6])
    carried, pieces = a["state"][5:6].clone(), []
    for c0, c1 in [(0, 1), (1, 8), (8, 9), (9, 23)]:
        part = {name: t[s + c0:s + c1] for name, t in a.items() if name not in ("cu_seqlens", "state")}
        part["cu_seqlens"] = torch.tensor([0, c1 - c0], dtype=torch.int32)
        part["state"] = carried
        o, carried = run(part)
        pieces.append(o)
    assert torch.equal(torch.cat(pieces), out[s:e])
    assert torch.equal(carried[0], state[5])


@native
def test_wrapper_runs_the_kernel_and_leaves_the_input_state():
    a = inputs([4, 9])
    before = a["state"].clone()
    out, new = gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], a["state"], scale=0.25)
    want_out, want_state = run_op(a)
    assert torch.equal(out, want_out) and torch.equal(new, want_state)
    assert torch.equal(a["state"], before)
    out2, same = gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], a["state"],
                                  scale=0.25, inplace=True)
    assert same is a["state"] and torch.equal(same, want_state) and torch.equal(out2, want_out)


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 9, 4], dtype=torch.int32)), "without decreasing"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32)), "rise from 0 to T = 13"),
    (lambda a: a.update(state=a["state"][:, :, :, :4]), "state must be"),
    (lambda a: a.update(g=a["g"][:, :2]), "g must be [T, Hv]"),
    (lambda a: a.update(v=a["v"][:5]), "v has 5 tokens"),
    (lambda a: a.update(k=a["k"].bfloat16()), "must share a dtype"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), "cu_seqlens must be a 1-D int32"),
])
def test_bad_arguments_are_refused_before_anything_is_written(impl, change, message):
    if impl == "op" and not _extension.has_native_kernel("gdn_delta_rule", "cpu"):
        pytest.skip("native CPU kernel not built")
    a = inputs([4, 9])
    change(a)
    state = a["state"].clone()
    before = state.clone()
    call = torch.ops.hebrus.gdn_delta_rule if impl == "op" else reference.gdn_delta_rule
    with pytest.raises((HebrusError, ValueError, RuntimeError)) as info:
        from hebrus_torch.errors import translated
        with translated():
            call(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], state, 0.25, True)
    assert isinstance(info.value, HebrusError), info.value
    assert message in str(info.value), str(info.value)
    assert torch.equal(state, before)


@native
def test_opcheck():
    a = inputs([3, 0, 6])
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], a["state"].clone(), 0.25, True)
    torch.library.opcheck(torch.ops.hebrus.gdn_delta_rule.default, args)
    b = inputs([2, 5], dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.hebrus.gdn_delta_rule.default,
                          (b["q"], b["k"], b["v"], b["g"], b["beta"], b["cu_seqlens"], b["state"].clone(), 0.5, False))


def test_compiled_decode_loop_matches_eager():
    """Decode steps (one token per row) under torch.compile(fullgraph=True), the state carried in place."""
    a = inputs([1, 1, 1], seed=9)
    steps = [inputs([1, 1, 1], seed=20 + i) for i in range(4)]

    def step(q, k, v, g, beta, cu, state):
        return torch.ops.hebrus.gdn_delta_rule(q, k, v, g, beta, cu, state, 0.25, True)

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        state = a["state"].clone()
        outs = [fn(s["q"], s["k"], s["v"], s["g"], s["beta"], s["cu_seqlens"], state) for s in steps]
        results.append((torch.cat(outs), state))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
