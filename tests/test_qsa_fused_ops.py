"""The indexed-attention layer's fused ops (issue 37). hebrus::sigmoid_gate: the module's output gate, on CPU within a
tolerance of the module (tests/tolerance.py). hebrus::rms_norm_rope: on CPU within that tolerance of
transformers' ``apply_rotary_pos_emb(Qwen4ExpTextRMSNorm(x))`` (every dtype, partial and full rotary,
heads cut from a wider projection), rows independent. hebrus::qsa_token_cells: exactly the offsets and
cells ``QSACache.plan`` derived with ATen ops before (selected groups in order, -1 entries skipped
wherever they are, then the raw tail, then -1), every bad value refused with a HebrusError before
anything is written. Both: bad metadata refused as the reference refuses it, opcheck, torch.compile
(fullgraph). The packed attention uses them (norm_and_rope). hebrus::qsa_plan_one_row: the host's selection rows of
a one-row chunk, exactly the values built from host integers, holes refused with a HoleError. hebrus::qsa_claim_cells:
a chunk's cells taken at the allocator's head, the tables written as the allocator's writes leave them, the old values
returned; a taken or freed cell refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from hf_models import modeling
from tolerance import near

from hebrus_torch import reference
from hebrus_torch.errors import HebrusError, HoleError
from hebrus_torch.models.qwen4_exp.attention import norm_and_rope
from hebrus_torch.qsa.ops import qsa_claim_cells, qsa_plan_one_row, qsa_token_cells, rms_norm_rope, sigmoid_gate
from hebrus_torch.qsa.runs import group_and_tail_offsets

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def norm_module(dim, dtype, seed=0, eps=1e-6):
    norm = modeling.Qwen4ExpTextRMSNorm(dim, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return norm.to(dtype)


def rope_inputs(tokens, heads, dim, rot, dtype, seed=0, wide=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, heads, 2 * dim if wide else dim, generator=g) * 3).to(dtype)
    if wide:
        x = x[..., :dim]                        # q of q_proj's [q | gate] halves: a strided view
    pos = torch.randint(0, 5000, (tokens,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / max(rot, 1)))
    freqs = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    return x, freqs.cos().to(dtype), freqs.sin().to(dtype)


# ---- rms_norm_rope ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim,rot,wide", [(7, 3, 64, 16, True), (5, 2, 32, 32, False),
                                                       (1, 4, 256, 64, True), (9, 1, 48, 0, False),
                                                       (3, 2, 40, 8, False)])
def test_cpu_kernel_matches_the_modules(dtype, tokens, heads, dim, rot, wide):
    norm = norm_module(dim, dtype, seed=dim)
    x, cos, sin = rope_inputs(tokens, heads, dim, rot, dtype, seed=tokens, wide=wide)
    with torch.no_grad():
        want = modeling.apply_rotary_pos_emb(norm(x), cos=cos, sin=sin, unsqueeze_dim=1)
        got = rms_norm_rope(x, norm.weight, norm.eps, cos, sin)
        assert near(got, want)
        assert torch.equal(reference.rms_norm_rope(x, norm.weight, norm.eps, cos, sin), want)
        assert torch.equal(norm_and_rope(norm, x, cos, sin, modeling.apply_rotary_pos_emb), got)


def test_rms_norm_rope_rows_are_independent():
    norm = norm_module(64, torch.bfloat16, seed=3)
    x, cos, sin = rope_inputs(9, 3, 64, 16, torch.bfloat16, seed=4)
    together = rms_norm_rope(x, norm.weight, 1e-6, cos, sin)
    for t in (0, 4, 8):
        alone = rms_norm_rope(x[t:t + 1, 1:2].clone(), norm.weight, 1e-6, cos[t:t + 1], sin[t:t + 1])
        assert torch.equal(alone[0, 0], together[t, 1])


@pytest.mark.parametrize("layout", ["query half of q_proj", "heads apart", "tokens apart", "dim strided"])
def test_rms_norm_rope_reads_strided_rows_as_their_copy(layout):
    """A view whose rows are dense (the query half of q_proj's output, read in place) or not (a copy first) gives
    the bits of its contiguous copy."""
    norm = norm_module(32, torch.bfloat16, seed=5)
    x, cos, sin = rope_inputs(6, 3, 32, 16, torch.bfloat16, seed=6)
    if layout == "query half of q_proj":
        view = torch.cat([x, torch.randn_like(x)], dim=-1)[..., :32]
    elif layout == "heads apart":
        view = torch.zeros(6, 6, 32, dtype=x.dtype)[:, ::2]
        view.copy_(x)
    elif layout == "tokens apart":
        view = torch.zeros(12, 3, 32, dtype=x.dtype)[::2]
        view.copy_(x)
    else:
        view = torch.stack([x, x], dim=-1)[..., 0]
    assert torch.equal(view, x) and not view.is_contiguous()
    with torch.no_grad():
        assert torch.equal(rms_norm_rope(view, norm.weight, 1e-6, cos, sin),
                           rms_norm_rope(x, norm.weight, 1e-6, cos, sin))


def test_norm_and_rope_runs_other_modules_as_themselves():
    """A norm with a hook, or another rope function, is called as given (no fused op)."""
    norm = norm_module(32, torch.float32)
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    x, cos, sin = rope_inputs(4, 2, 32, 8, torch.float32, seed=1)
    want = modeling.apply_rotary_pos_emb(norm(x), cos=cos, sin=sin, unsqueeze_dim=1)
    assert torch.equal(norm_and_rope(norm, x, cos, sin, modeling.apply_rotary_pos_emb), want) and len(seen) == 2
    calls = []

    def my_rope(q, cos=None, sin=None, unsqueeze_dim=1):
        calls.append(q.shape)
        return q

    assert near(norm_and_rope(norm_module(32, torch.float32), x, cos, sin, my_rope),
                norm_module(32, torch.float32)(x)) and calls == [x.shape]


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, c, s: (x, w[:-1], 1e-6, c, s), "weight must have D = 32 entries, got 31"),
    (lambda x, w, c, s: (x, w, -1.0, c, s), "eps must be >= 0, got -1"),
    (lambda x, w, c, s: (x, w, 1e-6, c.double(), s), "cos must have dtype|cos dtype"),
    (lambda x, w, c, s: (x, w, 1e-6, c.half(), s.half()), "cos dtype torch.float16 must match x dtype torch.float32"),
    (lambda x, w, c, s: (x, w, 1e-6, c[:-1], s[:-1]), r"cos and sin must both have shape \(T, R\) with T = 4"),
    (lambda x, w, c, s: (x, w, 1e-6, c, s[:, :6]), r"cos and sin must both have shape"),
    (lambda x, w, c, s: (x, w, 1e-6, c[:, :7], s[:, :7]), "the rotary dims R must be even and at most D = 32, got 7"),
    (lambda x, w, c, s: (x[0], w, 1e-6, c, s), r"x must be 3-D, got shape \(2, 32\)"),
    (lambda x, w, c, s: (x.long(), w, 1e-6, c, s), "x must have dtype"),
])
def test_rms_norm_rope_bad_metadata_raises(bad, match):
    x, cos, sin = rope_inputs(4, 2, 32, 8, torch.float32, seed=2)
    w = torch.randn(32)
    args = bad(x, w, cos, sin)
    for fn in (rms_norm_rope, reference.rms_norm_rope):
        with pytest.raises(HebrusError, match=match):
            fn(*args)


def test_rms_norm_rope_opcheck_and_compile():
    x, cos, sin = rope_inputs(5, 2, 32, 8, torch.float32, seed=5)
    w = torch.randn(32)
    torch.library.opcheck(torch.ops.hebrus.rms_norm_rope.default, (x, w, 1e-6, cos, sin))
    xb, cb, sb = rope_inputs(3, 2, 64, 16, torch.bfloat16, seed=6, wide=True)
    torch.library.opcheck(torch.ops.hebrus.rms_norm_rope.default, (xb, w.repeat(2), 1e-5, cb, sb))
    fn = torch.compile(rms_norm_rope, fullgraph=True, backend="eager")
    assert torch.equal(fn(x, w, 1e-6, cos, sin), rms_norm_rope(x, w, 1e-6, cos, sin))


# ---- qsa_token_cells ----------------------------------------------------------------------------------------

def token_cells_inputs(tq, top_k, r, seed=0, holes=True, max_groups=12):
    """Random queries over one cell table: each query's run of nvis cells (fewer than ``max_groups``
    groups) from first, its selection of at most top_k distinct complete groups in random order
    (qsa_select's are ascending), -1 entries anywhere."""
    g = torch.Generator().manual_seed(seed)
    nvis = torch.randint(1, max_groups * r, (tq,), generator=g)
    first = torch.cumsum(nvis, 0) - nvis
    cells = torch.randperm(int(nvis.sum()) + 5, generator=g).to(torch.int32)
    selected = torch.full((tq, top_k), -1, dtype=torch.int32)
    for t in range(tq):
        groups = int(nvis[t]) // r
        pick = torch.randperm(groups, generator=g)[:top_k]
        cols = torch.randperm(top_k, generator=g)[:pick.numel()] if holes else torch.arange(pick.numel())
        selected[t, cols] = pick.to(torch.int32)
    return selected, nvis, first, cells


def planned(selected, nvis, first, cells, r):
    """What QSACache.plan computed with ATen ops before the fused op."""
    offs = group_and_tail_offsets(selected.to(torch.int64), (nvis // r).to(torch.int32), nvis, r)
    table = torch.cat((cells, torch.full((1,), -1, dtype=torch.int32)))
    at = torch.where(offs >= 0, first[:, None] + offs, cells.numel())
    return table[at], offs


@pytest.mark.parametrize("tq,top_k,r,holes", [(9, 4, 4, True), (5, 3, 1, True), (7, 6, 4, False),
                                              (40, 33, 2, True), (3, 1, 8, True)])
def test_token_cells_are_the_plans(tq, top_k, r, holes):
    args = token_cells_inputs(tq, top_k, r, seed=tq + r, holes=holes)
    want_cells, want_offs = planned(*args, r)
    for fn in (qsa_token_cells, reference.qsa_token_cells):
        cells, offs = fn(*args, r)
        assert cells.dtype == torch.int32 and offs.dtype == torch.int64
        assert torch.equal(cells, want_cells) and torch.equal(offs, want_offs)


def test_token_cells_rows_are_independent_and_empty_inputs_work():
    selected, nvis, first, cells = token_cells_inputs(11, 5, 4, seed=3)
    tc, offs = qsa_token_cells(selected, nvis, first, cells, 4)
    for t in (0, 6, 10):
        one = qsa_token_cells(selected[t:t + 1], nvis[t:t + 1], first[t:t + 1], cells, 4)
        assert torch.equal(one[0][0], tc[t]) and torch.equal(one[1][0], offs[t])
    empty = qsa_token_cells(selected[:0], nvis[:0], first[:0], cells, 4)
    assert empty[0].shape == (0, 23) and empty[1].shape == (0, 23)
    tail_only = qsa_token_cells(selected[:, :0], nvis, first, cells, 4)[1]
    assert torch.equal(tail_only, planned(selected[:, :0], nvis, first, cells, 4)[1])


@pytest.mark.parametrize("edit,match", [
    (lambda s, n, f, c: s.__setitem__((2, 1), int(n[2]) // 4), r"selected\[2, 1\] = \d+ is outside \[-1, \d+\)"),
    (lambda s, n, f, c: s.__setitem__((0, 0), -2), r"selected\[0, 0\] = -2 is outside \[-1, \d+\)"),
    (lambda s, n, f, c: f.__setitem__(3, c.numel() - int(n[3]) + 1), r"query 3 sees nvis = \d+ cells from first"),
    (lambda s, n, f, c: f.__setitem__(1, -1), r"query 1 sees nvis = \d+ cells from first = -1, outside cells"),
    (lambda s, n, f, c: n.__setitem__(4, -3), r"query 4 sees nvis = -3 cells"),
])
def test_token_cells_bad_values_raise(edit, match):
    args = token_cells_inputs(6, 3, 4, seed=9)
    edit(*args)
    for fn in (qsa_token_cells, reference.qsa_token_cells):
        with pytest.raises(HebrusError, match="hebrus::qsa_token_cells: " + match):
            fn(*args, 4)


@pytest.mark.parametrize("bad,match", [
    (lambda s, n, f, c: (s.long(), n, f, c, 4), "selected must have dtype torch.int32"),
    (lambda s, n, f, c: (s, n.int(), f, c, 4), "nvis must have dtype torch.int64"),
    (lambda s, n, f, c: (s, n, f[:-1], c, 4), "nvis and first must have Tq = 6 entries, got 6 and 5"),
    (lambda s, n, f, c: (s, n, f, c[None], 4), r"cells must be 1-D"),
    (lambda s, n, f, c: (s, n, f, c, 0), r"r must be in \[1, 1048576\], got 0"),
    (lambda s, n, f, c: (s[0], n, f, c, 4), r"selected must be 2-D"),
])
def test_token_cells_bad_metadata_raises(bad, match):
    args = bad(*token_cells_inputs(6, 3, 4, seed=1))
    for fn in (qsa_token_cells, reference.qsa_token_cells):
        with pytest.raises(HebrusError, match=match):
            fn(*args)


def test_token_cells_opcheck_and_compile():
    args = token_cells_inputs(7, 4, 4, seed=2)
    torch.library.opcheck(torch.ops.hebrus.qsa_token_cells.default, (*args, 4))
    fn = torch.compile(qsa_token_cells, fullgraph=True, backend="eager")
    got, want = fn(*args, 4), qsa_token_cells(*args, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- qsa_plan_one_row ---------------------------------------------------------------------------------------

def plan_one_row_inputs(n_run, capacity=96, seed=0):
    """A run of n_run cells (scattered over a table of ``capacity``) holding positions 7, 8, ... and its groups."""
    g = torch.Generator().manual_seed(seed)
    cell_pos = torch.full((capacity,), -1, dtype=torch.int64)
    run = torch.randperm(capacity, generator=g)[:n_run]
    cell_pos[run] = torch.arange(7, 7 + n_run)
    groups = torch.randperm(500, generator=g)[: n_run + 2]
    return cell_pos, run, groups


def expected_plan_rows(run, groups, p0, start, t, r):
    """The plan rows from host integers (what QSACache._plan_one_row built with torch ops before the op)."""
    nvis, skip = start - p0 + t, start - p0
    seen = [skip + 1 + j for j in range(t)]
    g = groups[: nvis // r].tolist() or [-1]
    i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
    return [torch.tensor([g], **i32), torch.zeros(t, **i32), torch.tensor([n // r for n in seen], **i32),
            torch.tensor(run[:nvis].tolist() + [-1], **i32), torch.tensor(seen, **i64), torch.zeros(t, **i64),
            torch.full((t,), p0, **i64), torch.zeros(t, **i64)]


@pytest.mark.parametrize("n_run,start,t,r", [(30, 7, 1, 4), (30, 36, 1, 4), (30, 30, 3, 4), (9, 9, 2, 4),
                                             (2, 8, 1, 4), (40, 20, 17, 3), (5, 7, 5, 1)])
def test_plan_one_row_is_the_host_integers(n_run, start, t, r):
    cell_pos, run, groups = plan_one_row_inputs(n_run, seed=n_run + t)
    cells = run[start - 7:start - 7 + t].clone()
    want = expected_plan_rows(run, groups, 7, start, t, r)
    for fn in (qsa_plan_one_row, reference.qsa_plan_one_row):
        got = fn(cell_pos, run, groups, cells, 7, start, r)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (fn, a, b)


@pytest.mark.parametrize("edit,error,match", [
    (lambda pos, run, grp, cells: pos.__setitem__(run[3], 99), HoleError,
     r"the run starting at 7 has cell \d+ at position 99 where 10 is required"),
    (lambda pos, run, grp, cells: pos.__setitem__(run[21], -1), HoleError,
     r"the run starting at 7 has cell \d+ at position -1 where 28 is required"),
    (lambda pos, run, grp, cells: cells.__setitem__(1, run[0]), HoleError,
     r"the chunk's cell 1 is \d+ but the run holds cell \d+ at position 28"),
    (lambda pos, run, grp, cells: run.__setitem__(5, 96), HebrusError, r"run_cells\[5\] = 96 is outside the table's"),
    (lambda pos, run, grp, cells: grp.__setitem__(2, 2**31), HebrusError, r"run_groups\[2\] = 2147483648 is outside"),
])
def test_plan_one_row_refuses_holes_and_bad_values(edit, error, match):
    cell_pos, run, groups = plan_one_row_inputs(24)
    cells = run[20:23].clone()
    edit(cell_pos, run, groups, cells)
    for fn in (qsa_plan_one_row, reference.qsa_plan_one_row):
        with pytest.raises(error, match="hebrus::qsa_plan_one_row: " + match):
            fn(cell_pos, run, groups, cells, 7, 27, 4)


@pytest.mark.parametrize("bad,match", [
    (lambda pos, run, grp, cells: (pos.int(), run, grp, cells, 7, 27, 4), "cell_pos must have dtype torch.int64"),
    (lambda pos, run, grp, cells: (pos, run[None], grp, cells, 7, 27, 4), "run_cells must be 1-D"),
    (lambda pos, run, grp, cells: (pos, run, grp, cells[:0], 7, 27, 4), "the chunk must have at least one cell"),
    (lambda pos, run, grp, cells: (pos, run, grp, cells, 7, 27, 0), r"r must be in \[1, 1048576\], got 0"),
    (lambda pos, run, grp, cells: (pos, run, grp, cells, 28, 27, 4), "need 0 <= p0 <= start, got p0 = 28"),
    (lambda pos, run, grp, cells: (pos, run, grp, cells, 7, 29, 4), "the chunk's 3 positions from 29 pass the run's"),
    (lambda pos, run, grp, cells: (pos, run, grp[:3], cells, 7, 27, 5), "make 4 groups but run_groups has 3"),
])
def test_plan_one_row_bad_metadata_raises(bad, match):
    cell_pos, run, groups = plan_one_row_inputs(24)
    args = bad(cell_pos, run, groups, run[20:23].clone())
    for fn in (qsa_plan_one_row, reference.qsa_plan_one_row):
        with pytest.raises(HebrusError, match=match):
            fn(*args)


def test_plan_one_row_opcheck_and_compile():
    cell_pos, run, groups = plan_one_row_inputs(30, seed=3)
    args = (cell_pos, run, groups, run[26:28].clone(), 7, 33, 4)
    torch.library.opcheck(torch.ops.hebrus.qsa_plan_one_row.default, args)
    fn = torch.compile(qsa_plan_one_row, fullgraph=True, backend="eager")
    for a, b in zip(fn(*args), qsa_plan_one_row(*args)):
        assert torch.equal(a, b)


# ---- qsa_claim_cells ----------------------------------------------------------------------------------------

def claim_tables(capacity=40, layers=3, seed=0):
    """cell_ref, cell_pos, unwritten, freed as a QSA cache holds them, with some cells referenced, flagged, freed."""
    g = torch.Generator().manual_seed(seed)
    ref = (torch.rand(capacity, generator=g) < 0.4).to(torch.int32) * torch.randint(1, 3, (capacity,), generator=g,
                                                                                      dtype=torch.int32)
    pos = torch.where(ref > 0, torch.randint(0, 1000, (capacity,), generator=g), -1)
    unwritten = torch.rand(layers, capacity, generator=g) < 0.3
    freed = torch.zeros(capacity, dtype=torch.bool)
    return ref, pos, unwritten, freed


@pytest.mark.parametrize("starts,counts", [([5], [1]), ([0, 17, 2**62], [3, 0, 2]), ([9, 40], [4, 4]),
                                           ([2**63 - 3], [3])])
def test_claim_cells_takes_the_head_as_the_allocator_writes(starts, counts):
    total = sum(counts)
    ref, pos, unwritten, freed = claim_tables(seed=total)
    head = 11
    ref[head:head + total] = 0
    results = []
    for fn in (qsa_claim_cells, reference.qsa_claim_cells):
        tables = [t.clone() for t in (ref, pos, unwritten)]
        out = fn(*tables, freed, head, starts, counts)
        results.append((out, tables))
    want_pos = [first + j for first, count in zip(starts, counts) for j in range(count)]
    (out, tables), (ref_out, ref_tables) = results
    assert out[0].tolist() == list(range(head, head + total)) and out[1].tolist() == want_pos
    assert out[2].tolist() == [sum(counts[:i]) for i in range(len(counts) + 1)]
    at = slice(head, head + total)
    assert torch.equal(out[3], ref[at]) and torch.equal(out[4], pos[at]) and torch.equal(out[5], unwritten[:, at])
    assert tables[0][at].tolist() == [1] * total and tables[1][at].tolist() == want_pos and bool(tables[2][:, at].all())
    outside = torch.ones(ref.shape[0], dtype=torch.bool)
    outside[at] = False
    for new, old in zip(tables, (ref, pos, unwritten)):
        assert torch.equal(new[..., outside], old[..., outside])
    for a, b in zip(out, ref_out):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(tables, ref_tables):
        assert torch.equal(a, b)


@pytest.mark.parametrize("taken", ["referenced", "freed in this block"])
def test_claim_cells_refuses_a_cell_not_free_and_writes_nothing(taken):
    ref, pos, unwritten, freed = claim_tables(seed=4)
    ref[20:26] = 0
    if taken == "referenced":
        ref[24] = 2
    else:
        freed[24] = True
    for fn in (qsa_claim_cells, reference.qsa_claim_cells):
        tables = [t.clone() for t in (ref, pos, unwritten)]
        with pytest.raises(HebrusError, match=f"hebrus::qsa_claim_cells: cell 24 is not free for the taking \\({taken}\\)"):
            fn(*tables, freed, 20, [100, 7], [2, 4])
        for new, old in zip(tables, (ref, pos, unwritten)):
            assert torch.equal(new, old)


@pytest.mark.parametrize("bad,match", [
    (lambda r, p, u, f: (r.long(), p, u, f, 0, [3], [2]), "cell_ref must have dtype torch.int32"),
    (lambda r, p, u, f: (r, p, u[0], f, 0, [3], [2]), "unwritten must be 2-D"),
    (lambda r, p, u, f: (r, p[:-1], u, f, 0, [3], [2]), r"cover cell_ref's C = 40 cells, got 39, 40 and 40"),
    (lambda r, p, u, f: (r, p, u, f, 0, [3, 4], [2]), "2 starts but 1 counts"),
    (lambda r, p, u, f: (r, p, u, f, 0, [3], [-1]), r"counts\[0\] = -1 is outside \[0, 40\]"),
    (lambda r, p, u, f: (r, p, u, f, 0, [-3], [2]), r"row 0's 2 positions from -3 are outside \[0, 2\^63\)"),
    (lambda r, p, u, f: (r, p, u, f, 0, [2**63 - 2], [3]), r"row 0's 3 positions from \d+ are outside"),
    (lambda r, p, u, f: (r, p, u, f, 0, [3], [0]), r"the 0 cells from 0 must be at least one"),
    (lambda r, p, u, f: (r, p, u, f, 39, [3], [2]), r"the 2 cells from 39 must be at least one and lie in \[0, 40\)"),
])
def test_claim_cells_bad_metadata_raises(bad, match):
    ref, pos, unwritten, freed = claim_tables(seed=1)
    ref.zero_()
    for fn in (qsa_claim_cells, reference.qsa_claim_cells):
        args = bad(ref.clone(), pos.clone(), unwritten.clone(), freed)
        with pytest.raises(HebrusError, match=match):
            fn(*args)


def test_claim_cells_opcheck_and_compile():
    ref, pos, unwritten, freed = claim_tables(seed=2)
    ref[3:8] = 0
    torch.library.opcheck(torch.ops.hebrus.qsa_claim_cells.default,
                          (ref.clone(), pos.clone(), unwritten.clone(), freed, 3, [10, 50], [2, 3]))
    fn = torch.compile(qsa_claim_cells, fullgraph=True, backend="eager")
    tables = [t.clone() for t in (ref, pos, unwritten)]
    got = fn(*tables, freed, 3, [10, 50], [2, 3])
    want_tables = [t.clone() for t in (ref, pos, unwritten)]
    want = qsa_claim_cells(*want_tables, freed, 3, [10, 50], [2, 3])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(tables, want_tables))


# ---- sigmoid_gate -------------------------------------------------------------------------------------------

def gate_inputs(tokens, heads, dim, dtype, seed=0):
    """The attention output [T, H, D] and the gate half of q_proj's [T, H, 2D] output (a strided view)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    gate = (torch.randn(tokens, heads, 2 * dim, generator=g) * 4).to(dtype)[..., dim:]
    return out, gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(7, 3, 16), (1, 24, 256), (5, 2, 40)])
def test_sigmoid_gate_matches_the_module(dtype, tokens, heads, dim):
    """What Qwen4ExpTextAttention computes: attn_output [.., H * D] * sigmoid(gate [.., H * D])."""
    out, gate = gate_inputs(tokens, heads, dim, dtype, seed=dim)
    want = (out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))).view(tokens, heads, dim)
    assert near(sigmoid_gate(out, gate), want)
    assert torch.equal(reference.sigmoid_gate(out, gate), want)


def test_sigmoid_gate_metadata_opcheck_and_compile():
    out, gate = gate_inputs(4, 2, 16, torch.float32, seed=3)
    for args, match in (((out, gate[:, :1]), r"gate must have x's shape \(4, 2, 16\), got \(4, 1, 16\)"),
                        ((out, gate.half()), "gate dtype torch.float16 must match x dtype torch.float32"),
                        ((out[0], gate[0]), "x must be 3-D")):
        for fn in (sigmoid_gate, reference.sigmoid_gate):
            with pytest.raises(HebrusError, match=match):
                fn(*args)
    torch.library.opcheck(torch.ops.hebrus.sigmoid_gate.default, (out, gate))
    fn = torch.compile(sigmoid_gate, fullgraph=True, backend="eager")
    assert torch.equal(fn(out, gate), sigmoid_gate(out, gate))
