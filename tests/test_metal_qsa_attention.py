"""mps_kernels/qsa_attention.metal run in the emulator with the glue's grid, against the reference.

Outputs are compared with the reference evaluated on the same values in fp32: within fp32 rounding
for float32 and within one rounding of the output dtype for float16 / bfloat16 (the kernel sums in
another order than the reference, never in lower precision). Covered: every dtype and every kernel
variant (1, 2, 4, 8 heads per pass; head dims up to 64, 128, 256), grouped-query attention
(Hq 4 / Hkv 1, Hq 8 / Hkv 2, Hq 12 / Hkv 1 in two passes), Dh != Dv, padding at the end, first,
scattered and with any negative value, rows of one cell and rows longer than the threadgroup,
queries whose whole history is selected (plain causal attention over the run), empty shapes, the
same bits under every schedule and guard side, a query's output independent of the other queries
of the launch, scores of -inf / +inf (finite inputs whose dot product overflows) and NaN, bad
cells / empty queries raising the reference's errors through the error slots, and k / v read in
place through their strides (transposed cache rows, slices of a batched cache, a fused K/V plane, a
broadcast head), bitwise equal to the contiguous-input output, bound without a copy.
"""

from __future__ import annotations

import math
import os
import struct
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative size of one rounding step of the output dtype (a full ulp at the bottom of a binade).
ONE_ROUNDING = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def selection(tq, cells, width, gen, pad="end", fill=0.7):
    """token_cells [tq, width] int32: distinct cells per row, about `fill` of the row used (at least
    one cell), the rest padding: -1 at the end (pad="end") or any negative value anywhere ("scattered")."""
    out = torch.full((tq, width), -1, dtype=torch.int32)
    for t in range(tq):
        n = max(1, min(width, cells, int(width * fill) + int(torch.randint(-2, 3, (1,), generator=gen))))
        sel = torch.randperm(cells, generator=gen)[:n].to(torch.int32)
        if pad == "end":
            out[t, :n] = sel
        else:
            out[t] = torch.randint(-2 ** 31, 0, (width,), generator=gen, dtype=torch.int32)
            out[t, torch.sort(torch.randperm(width, generator=gen)[:n]).values] = sel
    return out


def make(tq, hq, hkv, dh, dv, cells, width, dtype, pad="end", seed=0, fill=0.7):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, dh, generator=gen).to(dtype)
    k = torch.randn(cells, hkv, dh, generator=gen).to(dtype)
    v = torch.randn(cells, hkv, dv, generator=gen).to(dtype)
    return q, k, v, selection(tq, cells, width, gen, pad, fill), dh ** -0.5 if dh else 1.0


def assert_matches_reference(got, q, k, v, tc, scale):
    """got within one rounding of q's dtype of the reference evaluated in fp32 on the same values."""
    want = reference.qsa_attention(q.float(), k.float(), v.float(), tc, scale)
    assert got.dtype == q.dtype and got.shape == want.shape
    tol = ONE_ROUNDING[q.dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=1e-6 if q.dtype == torch.float32 else tol * 1e-3)


CONFIGS = {
    # name: (tq, hq, hkv, dh, dv, cells, width, pad)         variant
    "mha": (5, 2, 2, 32, 32, 40, 12, "end"),                  # h1_d64
    "gqa-4-1": (6, 4, 1, 64, 64, 100, 40, "end"),             # h4_d64
    "gqa-8-2": (5, 8, 2, 48, 40, 120, 50, "scattered"),       # h4_d64
    "gqa-16-2": (3, 16, 2, 24, 24, 90, 30, "scattered"),      # h8_d64
    "dh-ne-dv": (4, 6, 3, 40, 24, 60, 33, "scattered"),       # h2_d64
    "dv-gt-dh": (3, 2, 1, 72, 200, 50, 30, "end"),            # h2_d256
    "odd-dims": (4, 3, 1, 33, 17, 31, 31, "end"),             # h4_d64
    "rep-12": (3, 12, 1, 16, 80, 64, 65, "scattered"),        # h8_d128, passes of 8 and 4 heads
    "long-row": (2, 8, 2, 256, 256, 700, 600, "end"),         # h4_d256, 75 entries per SIMD-group
    "qwen4exp": (2, 16, 2, 256, 256, 2100, 2051, "end"),      # h8_d256, W = budget + r - 1
    "one-cell": (4, 2, 1, 8, 8, 5, 1, "end"),                 # h2_d64
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CONFIGS)
def test_matches_reference(name, dtype):
    tq, hq, hkv, dh, dv, cells, width, pad = CONFIGS[name]
    args = make(tq, hq, hkv, dh, dv, cells, width, dtype, pad, seed=len(name) + DTYPES.index(dtype))
    assert_matches_reference(hebrus_emu.qsa_attention(*args), *args)


def test_variants():
    want = {(1, 64): "h1_d64", (2, 65): "h2_d128", (3, 128): "h4_d128", (4, 129): "h4_d256", (5, 16): "h8_d64",
            (8, 256): "h8_d256", (16, 100): "h8_d128"}
    for (rep, dim), variant in want.items():
        strides = (2 * dim, dim, 16, 8)  # contiguous k [10, 2, dim], v [10, 2, 8]
        assert hebrus_emu.plan("qsa_attention", 3, 2 * rep, 2, dim, 8, 10, 4, *strides, 0.5).variant.decode() == variant
        strides = (16, 8, 2 * dim, dim)
        assert hebrus_emu.plan("qsa_attention", 3, 2 * rep, 2, 8, dim, 10, 4, *strides, 0.5).variant.decode() == variant


def test_plan_carries_kv_strides():
    # QsaAttentionParams (hebrus_params.h): 12 int64 (Tq, Hq, Hkv, rep, Dh, Dv, cells, W, k_stride0,
    # k_stride1, v_stride0, v_stride1), then scale as fp32 and a pad: 104 bytes, a multiple of 8.
    p = hebrus_emu.plan("qsa_attention", 3, 8, 2, 48, 40, 70, 30, 48, 70 * 48, 200, 7, 0.25)
    assert p.params_size == 104
    fields = struct.unpack("<12qfi", p.params_bytes)
    assert fields[:12] == (3, 8, 2, 4, 48, 40, 70, 30, 48, 70 * 48, 200, 7) and fields[12] == 0.25


def test_padding_anywhere():
    # The same five cells with the padding at the end, first, interleaved, and with other negative
    # values (INT_MIN included): every layout is attention over exactly those cells.
    q, k, v, _, scale = make(4, 4, 2, 24, 24, 40, 10, torch.float32, seed=1)
    cells = torch.tensor([3, 17, 5, 39, 0], dtype=torch.int32)
    rows = torch.stack([
        torch.cat([cells, torch.full((5,), -1, dtype=torch.int32)]),
        torch.tensor([-1, 3, -7, 17, 5, -1, -2147483648, 39, 0, -1], dtype=torch.int32),
        torch.cat([torch.full((5,), -3, dtype=torch.int32), cells.flip(0)]),
        torch.tensor([39, -1, 0, -1, 3, -1, 17, -1, 5, -1], dtype=torch.int32),
    ])
    q = q[:1].expand(4, -1, -1).contiguous()
    out = hebrus_emu.qsa_attention(q, k, v, rows, scale)
    assert_matches_reference(out, q, k, v, rows, scale)
    dense = reference.qsa_attention(q[:1], k, v, cells[None], scale)
    for i in range(4):
        torch.testing.assert_close(out[i], dense[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_history_is_causal_attention(dtype):
    # QSA rows of queries that see their whole history (n <= budget + r - 1 tokens): the row lists
    # every cell of the run (scrambled physical cells, -1 after), and the output is plain causal
    # attention over the run, here computed densely in fp64.
    gen = torch.Generator().manual_seed(2)
    hq, hkv, dh, cells, width = 8, 2, 32, 64, 27
    cell_of_pos = torch.randperm(cells, generator=gen)[:width]
    positions = [0, 1, 3, 9, 17, 26]
    tc = torch.full((len(positions), width), -1, dtype=torch.int32)
    for i, p in enumerate(positions):
        tc[i, :p + 1] = cell_of_pos[:p + 1].to(torch.int32)
    q = torch.randn(len(positions), hq, dh, generator=gen).to(dtype)
    k = torch.randn(cells, hkv, dh, generator=gen).to(dtype)
    v = torch.randn(cells, hkv, dh, generator=gen).to(dtype)
    got = hebrus_emu.qsa_attention(q, k, v, tc, dh ** -0.5)
    assert_matches_reference(got, q, k, v, tc, dh ** -0.5)
    rep = hq // hkv
    for i, p in enumerate(positions):
        kk = k[cell_of_pos[:p + 1]].double().repeat_interleave(rep, 1)          # [n, Hq, Dh]
        vv = v[cell_of_pos[:p + 1]].double().repeat_interleave(rep, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kk) * dh ** -0.5, -1)
        want = torch.einsum("hn,nhd->hd", w, vv)
        tol = ONE_ROUNDING[dtype]
        torch.testing.assert_close(got[i].double(), want, rtol=tol, atol=1e-6 if dtype == torch.float32 else tol * 1e-3)


def test_empty_shapes():
    q, k, v, tc, scale = make(3, 4, 2, 16, 8, 20, 5, torch.float32, seed=3)
    assert hebrus_emu.qsa_attention(q[:0], k, v, tc[:0], scale).shape == (0, 4, 8)
    assert hebrus_emu.qsa_attention(q, k, v[..., :0], tc, scale).shape == (3, 4, 0)
    assert hebrus_emu.qsa_attention(q[:, :0], k, v, tc, scale).shape == (3, 0, 8)
    # Dh = 0: every score is 0, so each query averages the values of its cells.
    got = hebrus_emu.qsa_attention(q[..., :0], k[..., :0], v, tc, 1.0)
    assert_matches_reference(got, q[..., :0], k[..., :0], v, tc, 1.0)
    # No kernel thread looks at token_cells there, so the glue checks it on the host.
    bad = tc.clone()
    bad[1, 2] = 20
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"query 1 selects cell 20 \(token_cells\[1, 2\]\)"):
        hebrus_emu.qsa_attention(q, k, v[..., :0], bad, scale)
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"query 0 selects cell"):
        hebrus_emu.qsa_attention(q, k[:0], v[:0], tc, scale)


def overflowing_scores(kinds, tq, hq, hkv, dh, dv, dtype, gen):
    """q, k, v, scale, all finite but k of the "x" cells, whose fp32 score on cell c is -inf for
    kinds[c] == "-", +inf for "+", NaN for "x" (a NaN in k) and finite for "f" (as in
    tests/test_qsa_attention.py: float32 / bfloat16 products of 2^100-sized values overflow; float16
    cannot hold those, so there the scale 2^127 overflows every score with |q . k| > 2 and the
    finite cells have k = 0)."""
    mag = lambda *shape: torch.rand(shape, generator=gen) * 2.5 + 0.5  # noqa: E731
    big, small, scale = (1.0, 0.0, 2.0 ** 127) if dtype == torch.float16 else (2.0 ** 100, 2.0 ** -100, dh ** -0.5)
    q = big * mag(tq, hq, dh)
    k = small * torch.randn(len(kinds), hkv, dh, generator=gen)
    for c, kind in enumerate(kinds):
        if kind in "-+":
            k[c] = (big if kind == "+" else -big) * mag(hkv, dh)
        elif kind == "x":
            k[c, :, dh // 2] = float("nan")
    return q.to(dtype), k.to(dtype), torch.randn(len(kinds), hkv, dv, generator=gen).to(dtype), scale


# Cells 0..69: score -inf, 70..119: finite, 120: +inf, 121: NaN. SIMD-group s takes entries s, s + 8, ...
INF_KINDS = "-" * 70 + "f" * 50 + "+x"
INF_ROWS = {
    # name: (selected cells, finite output)
    "neg-inf-first-everywhere": (list(range(40)) + list(range(70, 80)), True),  # every SIMD-group's first 5
    "simd-group-first-neg-inf": (list(range(70, 73)) + [5] + list(range(73, 82)) + [6] + list(range(82, 104))
                                 + [7] + list(range(104, 110)), True),  # entry 3: SIMD-group 3's first; 13, 36
    "finite-only-at-the-end": (list(range(68)) + [118, 119], True),  # 6 SIMD-groups end with max -inf
    "all-finite": (list(range(70, 120)), True),
    "pos-inf": ([0, 1, 70, 120, 71], False),  # the reference gives NaN; SIMD-groups 5-7 get no cell
    "nan": ([70, 0, 121, 71], False),
    "all-neg-inf": (list(range(35)), False),  # softmax of only -inf: NaN (every partial max -inf)
}


@pytest.mark.parametrize("pad_first", [False, True], ids=["pad-end", "pad-first"])
@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (2, 2)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_infinite_scores_like_the_reference(dtype, heads, pad_first):
    # -inf scores (finite inputs whose fp32 dot product overflows) get weight exactly 0, also as the
    # first cell of a SIMD-group and in a partial state with no finite score; +inf and NaN scores
    # give NaN, as in the reference.
    gen = torch.Generator().manual_seed(60 + DTYPES.index(dtype))
    rows = [cells for cells, _ in INF_ROWS.values()]
    width = max(len(r) for r in rows) + 5
    tc = torch.full((len(rows), width), -1, dtype=torch.int32)
    for t, r in enumerate(rows):
        start = width - len(r) if pad_first else 0
        tc[t, start:start + len(r)] = torch.tensor(r, dtype=torch.int32)
    q, k, v, scale = overflowing_scores(INF_KINDS, len(rows), *heads, 16, 24, dtype, gen)
    scores = torch.einsum("thd,chd->thc", q.float(), k.float().repeat_interleave(heads[0] // heads[1], 1)) * scale
    assert scores[..., :70].eq(-math.inf).all() and scores[..., 70:120].isfinite().all()
    assert scores[..., 120].eq(math.inf).all() and scores[..., 121].isnan().all()
    got = hebrus_emu.qsa_attention(q, k, v, tc, scale)
    want = reference.qsa_attention(q.float(), k.float(), v.float(), tc, scale)
    finite = torch.tensor([f for _, f in INF_ROWS.values()])
    assert got[finite].isfinite().all() and got[~finite].isnan().all()
    assert want[finite].isfinite().all() and want[~finite].isnan().all()
    tol = ONE_ROUNDING[dtype]
    atol = 1e-6 if dtype == torch.float32 else tol * 1e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=atol, equal_nan=True)
    # The -inf cells count for nothing: the same as attention over the finite cells alone.
    for t, (cells, fin) in enumerate(INF_ROWS.values()):
        if fin:
            only = torch.tensor([[c for c in cells if INF_KINDS[c] == "f"]], dtype=torch.int32)
            alone = reference.qsa_attention(q[t:t + 1].float(), k.float(), v.float(), only, scale)[0]
            torch.testing.assert_close(got[t].float(), alone, rtol=tol, atol=atol)


@pytest.mark.parametrize("sched,guard", [("reverse", "start"), ("random", "end"), ("random", "start")])
def test_schedules_agree_bitwise(sched, guard):
    for dtype, config in ((torch.bfloat16, "rep-12"), (torch.float32, "gqa-8-2")):
        tq, hq, hkv, dh, dv, cells, width, pad = CONFIGS[config]
        args = make(tq, hq, hkv, dh, dv, cells, width, dtype, pad, seed=4)
        a = hebrus_emu.qsa_attention(*args)
        b = hebrus_emu.qsa_attention(*args, sched=sched, seed=11, guard=guard)
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_independent_of_the_other_queries(dtype):
    q, k, v, tc, scale = make(10, 8, 2, 32, 32, 200, 60, dtype, "scattered", seed=5)
    batch = hebrus_emu.qsa_attention(q, k, v, tc, scale)
    for t in (0, 7):
        assert torch.equal(hebrus_emu.qsa_attention(q[t:t + 1], k, v, tc[t:t + 1], scale)[0], batch[t])
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(6))
    assert torch.equal(hebrus_emu.qsa_attention(q[perm], k, v, tc[perm], scale), batch[perm])
    # Next to other queries with longer rows: query 3's row padded at the end to their width.
    gen = torch.Generator().manual_seed(7)
    others = selection(4, 200, 150, gen, "scattered")
    row3 = torch.cat([tc[3:4], torch.full((1, 90), -1, dtype=torch.int32)], 1)
    mixed = hebrus_emu.qsa_attention(torch.cat([q[:4], q[3:4]]), k, v, torch.cat([others, row3]), scale)
    assert torch.equal(mixed[4], batch[3])


BAD = {
    "cell-too-big": ([[0, 1, -1, -1], [2, -1, 10, 3], [4, 5, 6, 7]],
                     r"query 1 selects cell 10 \(token_cells\[1, 2\]\), outside \[0, cells=10\); "
                     r"negative entries are padding"),
    "cell-huge": ([[0, 1, -1, -1], [2, -1, 1, 3], [4, 2147483647, 6, 7]], r"query 2 selects cell 2147483647"),
    "two-bad-cells": ([[0, 11, -1, 12], [13, -1, 1, 3], [4, 5, 6, 7]], r"query 0 selects cell 11 "),
    "empty-query": ([[0, 1, -1, -1], [-1, -1, -1, -1], [4, 5, 6, 7]], r"query 1 selects no cell \(every entry "
                    r"of token_cells\[1\] is negative padding\); attention over an empty selection is undefined"),
    "empty-query-other-negatives": ([[0, 1, -1, -1], [3, -1, -1, -1], [-5, -2147483648, -1, -9]],
                                    r"query 2 selects no cell"),
    "only-bad-cells": ([[0, 1, -1, -1], [10, -1, 10, -1], [4, 5, 6, 7]], r"query 1 selects cell 10"),
    "range-before-empty": ([[-1, -1, -1, -1], [2, 12, 1, 3], [4, 5, 6, 7]], r"query 1 selects cell 12"),
    "zero-width": (torch.zeros(3, 0, dtype=torch.int32), r"query 0 selects no cell"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_token_cells_raise_like_the_reference(name):
    rows, pattern = BAD[name]
    q, k, v, _, scale = make(3, 4, 2, 8, 6, 10, 4, torch.float32, seed=8)
    tc = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.int32)
    with pytest.raises(hebrus_emu.ASYNC_ERROR, match=r"hebrus::qsa_attention: ") as emu_err:
        hebrus_emu.qsa_attention(q, k, v, tc, scale)
    with pytest.raises(HebrusError, match=r"hebrus::qsa_attention: " + pattern) as ref_err:
        reference.qsa_attention(q, k, v, tc, scale)
    # the kernel reports every bad entry (which one the stream raises depends on timing); the
    # reference's, the first, is among them
    assert str(ref_err.value) in hebrus_emu.reported() and str(emu_err.value) in hebrus_emu.reported()


def test_head_dims_beyond_the_kernel_limit_are_refused():
    q, k, v, tc, scale = make(2, 2, 1, 8, 257, 6, 3, torch.float32, seed=9)
    with pytest.raises(HebrusError, match=r"qsa_attention on MPS: .*head dims up to 256"):
        hebrus_emu.qsa_attention(q, k, v, tc, scale)
    q, k, v, tc, scale = make(2, 2, 1, 300, 8, 6, 3, torch.float32, seed=9)
    with pytest.raises(HebrusError, match=r"head dims up to 256"):
        hebrus_emu.qsa_attention(q, k, v, tc, scale)


# ---- k and v read in place through their strides -------------------------------------------------------

def strided_kv(k, v, layout):
    """Views with the values of k [cells, Hkv, Dh] and v [cells, Hkv, Dv] in the given memory layout:
    cache-row:   a transformers cache row [Hkv, cells, D] transposed (strides (D, cells * D, 1));
    cache-slice: a row of a batched cache [B, Hkv + 1, cells + 5, D] sliced along the batch, the heads
                 and the cells, then transposed (storage offset, row stride (cells + 5) * D); every
                 element outside the view is NaN, so a misaddressed read shows in the output;
    fused-kv:    k and v as the two halves of the last dim of one [cells, Hkv, Dh + Dv] plane;
    broadcast:   KV head 0 expanded over the heads (head stride 0; k and v passed with head 0 copied);
    last-dim:    a last dim that is not contiguous ([cells, D, Hkv] permuted): the glue copies that one.
    Returns (k_view, v_view, k_values, v_values), the values being what the views hold."""
    cells, hkv, dh = k.shape
    if layout == "broadcast":
        k, v = k[:, :1].expand(-1, hkv, -1), v[:, :1].expand(-1, hkv, -1)
        return k, v, k.contiguous(), v.contiguous()
    if layout == "fused-kv":
        kv = torch.cat([k, v], 2)
        return kv[..., :dh], kv[..., dh:], k, v
    views = []
    for x in (k, v):
        if layout == "cache-row":
            views.append(x.transpose(0, 1).contiguous().transpose(0, 1))
        elif layout == "cache-slice":
            cache = torch.full((3, hkv + 1, cells + 5, x.shape[2]), float("nan"), dtype=x.dtype)
            cache[1, 1:, 2:2 + cells] = x.transpose(0, 1)
            views.append(cache[1, 1:, 2:2 + cells].transpose(0, 1))
        elif layout == "last-dim":
            views.append(x.permute(0, 2, 1).contiguous().permute(0, 2, 1))
        else:
            raise ValueError(layout)
    return views[0], views[1], k, v


STRIDED_LAYOUTS = ("cache-row", "cache-slice", "fused-kv", "broadcast", "last-dim")
STRIDED_CONFIGS = {
    # name: (tq, hq, hkv, dh, dv, cells, width, pad)     variant
    "gqa-8-2": (5, 8, 2, 48, 40, 70, 30, "scattered"),  # h4_d64
    "mha-3": (3, 3, 3, 24, 72, 40, 20, "end"),           # h1_d128, Dh != Dv
}


@pytest.mark.parametrize("layout", STRIDED_LAYOUTS)
@pytest.mark.parametrize("config", STRIDED_CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_kv_match_contiguous_bitwise(dtype, config, layout):
    # The kernel only addresses k and v differently: the output is the contiguous-input output bit for
    # bit, and matches the reference.
    tq, hq, hkv, dh, dv, cells, width, pad = STRIDED_CONFIGS[config]
    q, k, v, tc, scale = make(tq, hq, hkv, dh, dv, cells, width, dtype, pad, seed=20 + DTYPES.index(dtype))
    k_view, v_view, k, v = strided_kv(k, v, layout)
    assert torch.equal(k_view, k) and torch.equal(v_view, v)
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    got = hebrus_emu.qsa_attention(q, k_view, v_view, tc, scale)
    assert torch.equal(got, hebrus_emu.qsa_attention(q, k.contiguous(), v.contiguous(), tc, scale))
    assert_matches_reference(got, q, k, v, tc, scale)


@pytest.mark.parametrize("sched,guard", [("reverse", "start"), ("random", "end")])
def test_strided_kv_schedules_and_guards(sched, guard):
    # The bound span ends at the view's last element (guard="end") and starts at its first one
    # (guard="start"): every read stays inside the view, under every schedule.
    q, k, v, tc, scale = make(4, 16, 2, 24, 24, 90, 30, torch.bfloat16, "scattered", seed=22)
    for layout in ("cache-slice", "broadcast"):
        k_view, v_view, k_values, v_values = strided_kv(k, v, layout)
        want = hebrus_emu.qsa_attention(q, k_values.contiguous(), v_values.contiguous(), tc, scale)
        got = hebrus_emu.qsa_attention(q, k_view, v_view, tc, scale, sched=sched, seed=3, guard=guard)
        assert torch.equal(got, want)


def test_strided_kv_are_bound_without_a_copy():
    # The glue (csrc/mps/hebrus_glue.h, run here through tests/metal/glue_abi.cpp) binds the views
    # themselves (setArg binds their storage from the view's first element; the emulator binds the span
    # through its last) and passes their strides in the parameter block; only a last dim that is not
    # contiguous is copied.
    bound = []

    def run_and_record(q, k, v, tc, scale):
        (launch,) = hebrus_emu.launches("qsa_attention", q, k, v, tc, float(scale))
        bound.append(([hebrus_emu.bound_view(t) for t in launch["tensors"]], launch))

    class P:
        def __init__(self, launch):
            self.params_bytes = launch["params"]

    q, k, v, tc, scale = make(3, 4, 2, 16, 24, 30, 10, torch.float16, seed=24)
    for layout in STRIDED_LAYOUTS:
        k_view, v_view, _, _ = strided_kv(k, v, layout)
        bound.clear()
        run_and_record(q, k_view, v_view, tc, scale)
        (buffers, launch), = bound
        p = P(launch)
        fields = struct.unpack("<12qfi", p.params_bytes)
        for view, buf, strides in ((k_view, buffers[1], fields[8:10]), (v_view, buffers[2], fields[10:12])):
            if layout == "last-dim":  # the one layout the kernel cannot read: copied, contiguous strides
                assert buf.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
                assert strides == (view.shape[1] * view.shape[2], view.shape[2])
                continue
            assert buf.data_ptr() == view.data_ptr()
            assert buf.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            assert buf.is_contiguous() and buf.dim() == 1
            last = sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
            assert buf.numel() == last + 1  # exactly the span of the view
            assert strides == view.stride()[:2]
    # A transformers cache row: the view of [B, Hkv, cells, D] the drop-in passes, read in place.
    cache = torch.randn(2, 2, 30, 16).to(torch.float16)
    bound.clear()
    run_and_record(q, cache[1].transpose(0, 1), cache[1].transpose(0, 1), tc, scale)
    (buffers, launch), = bound
    p = P(launch)
    assert buffers[1].data_ptr() == cache[1].data_ptr() and buffers[1].numel() == 2 * 30 * 16
    assert struct.unpack("<12qfi", p.params_bytes)[8:12] == (16, 30 * 16, 16, 30 * 16)
