"""hebrus::qsa_attention (issue 6): attention of every query over exactly its QSA selection.

The native kernel against the reference, both against dense attention with the selection mask as
transformers computes it, -inf / +inf scores of finite inputs (overflowing dot products) and NaN
scores, determinism and batch independence, opcheck, torch.compile and every kind of bad input.
"""

from __future__ import annotations

import math

import pytest
import torch

import hebrus_torch as ht
from hebrus_torch import reference
from hebrus_torch._extension import has_native_kernel

from conftest import ATOL, RTOL, assert_mixed_devices_rejected, assert_rejected, with_changes

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# helpers


def rand(shape, gen, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def random_selection(tq: int, cells: int, width: int, gen: torch.Generator, pad: str = "end",
                     fill: float = 0.7) -> torch.Tensor:
    """token_cells [tq, width]: distinct cells per row, about ``fill`` of the row used, -1 elsewhere.

    ``pad="end"`` puts the padding after the selected cells, ``"scattered"`` anywhere in the row
    (with other negative values than -1 too); every row keeps at least one cell.
    """
    rows = []
    for _ in range(tq):
        n = max(1, min(cells, int(width * fill) + int(torch.randint(-2, 3, (1,), generator=gen))))
        n = min(n, width)
        sel = torch.randperm(cells, generator=gen)[:n].to(torch.int32)
        row = torch.full((width,), -1, dtype=torch.int32)
        if pad == "end":
            row[:n] = sel
        else:
            slots = torch.sort(torch.randperm(width, generator=gen)[:n]).values
            row[slots] = sel
            negatives = torch.randint(-9, 0, (width,), generator=gen, dtype=torch.int32)
            keep = torch.zeros(width, dtype=torch.bool)
            keep[slots] = True
            row = torch.where(keep, row, negatives)
        rows.append(row)
    return torch.stack(rows) if rows else torch.empty(0, width, dtype=torch.int32)


def qsa_like_selection(positions: list[int], cell_of_pos: torch.Tensor, r: int, top_k: int,
                       gen: torch.Generator) -> torch.Tensor:
    """What the QSA plan gives attention (SPEC §3): per query at position p (run starting at 0),
    the tokens of up to top_k of its n // r complete groups (here chosen at random, in random
    order as transformers' topk leaves them) plus the raw tail of n % r tokens, mapped to
    physical cells, -1 padded to W = top_k * r + r - 1."""
    width = top_k * r + r - 1
    out = torch.full((len(positions), width), -1, dtype=torch.int32)
    for i, p in enumerate(positions):
        n = p + 1
        groups = n // r
        chosen = torch.randperm(groups, generator=gen)[:min(top_k, groups)]
        toks = (chosen[:, None] * r + torch.arange(r)[None, :]).flatten()
        toks = torch.cat([toks, torch.arange(groups * r, n)])
        out[i, :toks.numel()] = cell_of_pos[toks].to(torch.int32)
    return out


def selection_mask(token_cells: torch.Tensor, cells: int) -> torch.Tensor:
    """Boolean [Tq, cells] mask, built as transformers' indexer builds its selection mask."""
    idx = torch.where(token_cells >= 0, token_cells.long(), cells)
    mask = torch.zeros(token_cells.shape[0], cells + 1, dtype=torch.bool, device=token_cells.device)
    return mask.scatter(-1, idx, True)[:, :cells]


def dense_masked(q, k, v, token_cells, scale):
    """transformers' sdpa path over a key layout of all cells, masked to each query's selection."""
    sdpa = pytest.importorskip("transformers.integrations.sdpa_attention",
                               reason="needs transformers==5.23.0 (pip install -e .[hf])")
    rep = q.shape[1] // k.shape[1]
    module = torch.nn.Module()
    module.num_key_value_groups = rep
    module.is_causal = True
    mask = selection_mask(token_cells, k.shape[0])[None, None]                  # [1, 1, Tq, cells]
    out, _ = sdpa.sdpa_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], mask, scaling=scale)
    return out[0]                                                               # [Tq, Hq, Dv]


def assert_close(got, want, dtype):
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), atol=ATOL[dtype], rtol=RTOL[dtype])


def case(gen, tq, hq, hkv, dh, dv, cells, width, dtype=torch.float32, pad="end", device="cpu", fill=0.7):
    q = rand((tq, hq, dh), gen, dtype, device)
    k = rand((cells, hkv, dh), gen, dtype, device)
    v = rand((cells, hkv, dv), gen, dtype, device)
    tc = random_selection(tq, cells, width, gen, pad, fill).to(device)
    return q, k, v, tc, dh ** -0.5


# ----------------------------------------------------------------------------------------------
# values


def test_native_cpu_kernel_is_registered():
    assert has_native_kernel("qsa_attention", "cpu")


def test_hand_checked(device):
    # One head, two cells selected out of three: softmax over exactly those two.
    q = torch.tensor([[[1.0, 0.0]]], device=device)
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[100.0, 0.0]]], device=device)
    v = torch.tensor([[[1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0]], [[1e6, 1e6, 1e6]]], device=device)
    tc = torch.tensor([[-1, 1, -1, 0]], dtype=torch.int32, device=device)
    w = torch.softmax(torch.tensor([0.5, 0.0]), 0)
    want = w[0] * torch.tensor([1.0, 2.0, 3.0]) + w[1] * torch.tensor([4.0, 5.0, 6.0])
    got = ht.qsa_attention(q, k, v, tc, 0.5)
    torch.testing.assert_close(got.cpu()[0, 0], want, atol=1e-6, rtol=1e-6)


CONFIGS = {
    # name: (tq, hq, hkv, dh, dv, cells, width, pad)
    "mha": (9, 4, 4, 32, 32, 50, 12, "end"),
    "gqa-4-1": (13, 4, 1, 64, 64, 200, 40, "end"),
    "gqa-16-2": (11, 16, 2, 48, 48, 300, 70, "scattered"),
    "dh-ne-dv": (7, 6, 2, 40, 24, 90, 33, "scattered"),
    "odd-dims": (5, 3, 1, 33, 17, 31, 31, "end"),
    "gqa-12-1": (4, 12, 1, 16, 80, 64, 65, "scattered"),
    "long-row": (3, 16, 2, 256, 256, 4000, 2051, "end"),
    "one-cell": (6, 2, 1, 8, 8, 5, 1, "end"),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", CONFIGS)
def test_kernel_vs_reference(device, dtype, name):
    tq, hq, hkv, dh, dv, cells, width, pad = CONFIGS[name]
    gen = torch.Generator().manual_seed(len(name) * 7 + FLOATS.index(dtype))
    q, k, v, tc, scale = case(gen, tq, hq, hkv, dh, dv, cells, width, dtype, pad, device)
    got = ht.qsa_attention(q, k, v, tc, scale)
    want = reference.qsa_attention(q, k, v, tc, scale)
    assert got.shape == (tq, hq, dv) and got.dtype == dtype and got.device == q.device
    assert_close(got, want, dtype)


@pytest.mark.hf
@pytest.mark.parametrize("name", ["gqa-16-2", "dh-ne-dv", "odd-dims", "long-row"])
def test_equals_dense_masked_attention(device, name):
    tq, hq, hkv, dh, dv, cells, width, pad = CONFIGS[name]
    gen = torch.Generator().manual_seed(3)
    q, k, v, tc, scale = case(gen, tq, hq, hkv, dh, dv, cells, width, torch.float32, pad, device)
    want = dense_masked(q, k, v, tc, scale)
    assert_close(ht.qsa_attention(q, k, v, tc, scale), want, torch.float32)
    assert_close(reference.qsa_attention(q, k, v, tc, scale), want, torch.float32)


def qsa_rows(dtype, device):
    """QSA-shaped rows: whole history selected (n <= budget + r - 1), empty tails (n % r == 0),
    sparse rows with a tail, cells in a scrambled physical order."""
    gen = torch.Generator().manual_seed(5)
    r, top_k, hq, hkv, dh = 4, 6, 8, 2, 32
    cells, n_tokens = 128, 90
    cell_of_pos = torch.randperm(cells, generator=gen)[:n_tokens]
    window = top_k * r + r - 1                                                  # 27
    positions = [0, 1, 2, 3, 7, 15, 23, 26, 27, 35, 36, 47, 63, 64, 88, 89]
    tc = qsa_like_selection(positions, cell_of_pos, r, top_k, gen).to(device)
    q = rand((len(positions), hq, dh), gen, dtype, device)
    k = rand((cells, hkv, dh), gen, dtype, device)
    v = rand((cells, hkv, dh), gen, dtype, device)
    counts = (tc >= 0).sum(1).tolist()
    whole = [i for i, p in enumerate(positions) if p + 1 <= window]
    assert all(counts[i] == positions[i] + 1 for i in whole)                    # whole history
    assert any((p + 1) % r == 0 and p + 1 > window for p in positions)          # sparse, empty tail
    assert any((p + 1) % r != 0 and p + 1 > window for p in positions)          # sparse, with a tail
    return q, k, v, tc, dh ** -0.5, positions, whole, cell_of_pos


@pytest.mark.parametrize("dtype", FLOATS)
def test_qsa_selection_rows(device, dtype):
    q, k, v, tc, scale, positions, whole, cell_of_pos = qsa_rows(dtype, device)
    got = ht.qsa_attention(q, k, v, tc, scale)
    assert_close(got, reference.qsa_attention(q, k, v, tc, scale), dtype)
    # The rows that see their whole history are plain causal attention over the run.
    rep = q.shape[1] // k.shape[1]
    for i in whole:
        cells = cell_of_pos[:positions[i] + 1].to(device)
        kk = k[cells].float().repeat_interleave(rep, 1)
        vv = v[cells].float().repeat_interleave(rep, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) * scale, -1)
        assert_close(got[i], torch.einsum("hn,nhd->hd", w, vv), dtype)


@pytest.mark.hf
def test_qsa_selection_matches_dense_masked(device):
    q, k, v, tc, scale, *_ = qsa_rows(torch.float32, device)
    want = dense_masked(q, k, v, tc, scale)
    assert_close(ht.qsa_attention(q, k, v, tc, scale), want, torch.float32)
    assert_close(reference.qsa_attention(q, k, v, tc, scale), want, torch.float32)


def test_padding_position_and_order_of_cells(device):
    gen = torch.Generator().manual_seed(8)
    q, k, v, _, scale = case(gen, 4, 4, 2, 24, 24, 40, 10, device=device)
    cells = torch.tensor([3, 17, 5, 39, 0], dtype=torch.int32)
    rows = torch.stack([
        torch.cat([cells, torch.full((5,), -1, dtype=torch.int32)]),           # padding at the end
        torch.tensor([-1, 3, -7, 17, 5, -1, -2147483648, 39, 0, -1], dtype=torch.int32),  # scattered
        torch.cat([torch.full((5,), -3, dtype=torch.int32), cells.flip(0)]),   # padding first, reversed
        torch.tensor([39, -1, 0, -1, 3, -1, 17, -1, 5, -1], dtype=torch.int32),
    ]).to(device)
    q = q[:1].expand(4, -1, -1)
    out = ht.qsa_attention(q, k, v, rows, scale)
    for i in range(1, 4):  # the same set of cells: the same attention, up to summation order
        assert_close(out[i], out[0], torch.float32)


def test_strided_inputs(device):
    gen = torch.Generator().manual_seed(10)
    tq, hq, hkv, dh, dv, cells = 6, 8, 2, 32, 16, 50
    kv = rand((cells, hkv, dh + dv), gen, device=device)                       # fused K/V plane
    k, v = kv[..., :dh], kv[..., dh:]
    q = rand((hq, tq, dh), gen, device=device).transpose(0, 1)                 # [Tq, Hq, Dh] view
    k_t = rand((hkv, cells, dh), gen, device=device).transpose(0, 1)           # head-major cache
    tc = random_selection(tq, cells, 20, gen, "scattered").to(device)
    for kk in (k, k_t):
        got = ht.qsa_attention(q, kk, v, tc, 0.3)
        want = reference.qsa_attention(q.contiguous(), kk.contiguous(), v.contiguous(), tc, 0.3)
        assert_close(got, want, torch.float32)
    wide = torch.zeros(tq, 3 * 20, dtype=torch.int32, device=device)
    wide[:, ::3] = tc
    got = ht.qsa_attention(q, k, v, wide[:, ::3], 0.3)                          # strided token_cells
    assert torch.equal(got, ht.qsa_attention(q, k, v, tc, 0.3))
    noncontig_last = rand((cells, hkv, dh, 2), gen, device=device)[..., 0]     # last-dim stride 2
    assert_close(ht.qsa_attention(q, noncontig_last, v, tc, 0.3),
                 reference.qsa_attention(q, noncontig_last, v, tc, 0.3), torch.float32)


def test_empty_query_batch_and_empty_heads(device):
    gen = torch.Generator().manual_seed(12)
    q, k, v, _, scale = case(gen, 3, 4, 2, 16, 8, 20, 5, device=device)
    empty = ht.qsa_attention(q[:0], k, v, torch.zeros(0, 5, dtype=torch.int32, device=device), scale)
    assert empty.shape == (0, 4, 8)
    no_cells = torch.zeros(0, 2, 16, device=device)
    assert ht.qsa_attention(q[:0], no_cells, no_cells[..., :8], torch.zeros(0, 0, dtype=torch.int32,
                                                                             device=device), scale).shape == (0, 4, 8)
    tc = random_selection(3, 20, 5, gen).to(device)
    assert ht.qsa_attention(q, k, v[..., :0], tc, scale).shape == (3, 4, 0)
    assert ht.qsa_attention(q[:, :0], k, v, tc, scale).shape == (3, 0, 8)


def test_default_scale_is_inverse_sqrt_head_dim(device):
    gen = torch.Generator().manual_seed(13)
    q, k, v, tc, scale = case(gen, 4, 4, 1, 64, 32, 30, 8, device=device)
    assert torch.equal(ht.qsa_attention(q, k, v, tc), ht.qsa_attention(q, k, v, tc, 64 ** -0.5))


# ----------------------------------------------------------------------------------------------
# scores that are not finite although every input is (the fp32 dot product overflows)


def overflowing_scores(kinds: str, tq: int, hq: int, hkv: int, dh: int, dv: int, dtype, gen):
    """q, k, v, scale, all finite but k of the "x" cells, whose fp32 score on cell c is -inf for
    kinds[c] == "-", +inf for "+", NaN for "x" (a NaN in k) and finite for "f".

    float32 / bfloat16: q = 2^100 * [0.5, 3), k = -+2^100 * [0.5, 3) (every product overflows) or
    2^-100 * randn (ordinary scores). float16 cannot hold such values: the scale 2^127 makes every
    score with |q . k| > 2 overflow, and the finite cells have k = 0 (score 0)."""
    cells = len(kinds)
    mag = lambda *shape: torch.rand(shape, generator=gen) * 2.5 + 0.5  # noqa: E731
    big, small, scale = (1.0, 0.0, 2.0 ** 127) if dtype == torch.float16 else (2.0 ** 100, 2.0 ** -100, dh ** -0.5)
    q = big * mag(tq, hq, dh)
    k = small * torch.randn(cells, hkv, dh, generator=gen)
    for c, kind in enumerate(kinds):
        if kind in "-+":
            k[c] = (big if kind == "+" else -big) * mag(hkv, dh)
        elif kind == "x":
            k[c, :, dh // 2] = float("nan")
    v = torch.randn(cells, hkv, dv, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), scale


# Cells 0..69: score -inf, 70..119: finite, 120: +inf, 121: NaN.
INF_KINDS = "-" * 70 + "f" * 50 + "+x"
INF_ROWS = {
    # name: (selected cells, finite output)
    "first-block-neg-inf": (list(range(40)) + list(range(70, 80)), True),   # > one block (32) at -inf
    "neg-inf-in-the-middle": (list(range(70, 73)) + [5] + list(range(73, 82)) + [6] + list(range(82, 104)) + [7]
                              + list(range(104, 110)), True),             # entries 3, 13 and 36 at -inf
    "finite-only-at-the-end": (list(range(68)) + [118, 119], True),       # two whole blocks at -inf first
    "all-finite": (list(range(70, 120)), True),
    "pos-inf": ([0, 1, 70, 120, 71], False),                                 # the reference gives NaN
    "nan": ([70, 0, 121, 71], False),
    "all-neg-inf": (list(range(35)), False),                                 # softmax of only -inf: NaN
}


def inf_case(dtype, hq, hkv, gen, device="cpu", dh=16, dv=24):
    rows = [cells for cells, _ in INF_ROWS.values()]
    width = max(len(r) for r in rows) + 3
    tc = torch.full((len(rows), width), -1, dtype=torch.int32)
    for t, r in enumerate(rows):
        tc[t, :len(r)] = torch.tensor(r, dtype=torch.int32)
    q, k, v, scale = overflowing_scores(INF_KINDS, len(rows), hq, hkv, dh, dv, dtype, gen)
    return q.to(device), k.to(device), v.to(device), tc.to(device), scale


@pytest.mark.parametrize("heads", [(8, 1), (6, 2), (2, 2)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("dtype", FLOATS)
def test_infinite_scores_like_the_reference(device, dtype, heads):
    # -inf scores (finite bf16 / fp32 inputs whose dot product overflows) get weight exactly 0, also
    # when a whole block of them comes first or only the last cells are finite; +inf and NaN scores
    # give NaN, as in the reference.
    gen = torch.Generator().manual_seed(50 + FLOATS.index(dtype))
    q, k, v, tc, scale = inf_case(dtype, *heads, gen, device)
    scores = torch.einsum("thd,chd->thc", q.cpu().float(), k.cpu().float().repeat_interleave(heads[0] // heads[1], 1))
    scores = scores * scale
    assert scores[..., :70].eq(-math.inf).all() and scores[..., 70:120].isfinite().all()
    assert scores[..., 120].eq(math.inf).all() and scores[..., 121].isnan().all()
    got = ht.qsa_attention(q, k, v, tc, scale).cpu()
    want = reference.qsa_attention(q, k, v, tc, scale).cpu()
    finite = torch.tensor([f for _, f in INF_ROWS.values()])
    assert got[finite].isfinite().all() and got[~finite].isnan().all()
    assert want[finite].isfinite().all() and want[~finite].isnan().all()
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=RTOL[dtype], equal_nan=True)
    # The -inf cells count for nothing: the same as attention over the finite cells alone.
    for t, (cells, fin) in enumerate(INF_ROWS.values()):
        if fin:
            only = torch.tensor([[c for c in cells if INF_KINDS[c] == "f"]], dtype=torch.int32, device=device)
            assert_close(got[t], reference.qsa_attention(q[t:t + 1], k, v, only, scale)[0], dtype)


# ----------------------------------------------------------------------------------------------
# determinism: a query's output depends on its own inputs only


@pytest.mark.parametrize("dtype", FLOATS)
def test_batch_independence_bitwise(device, dtype):
    gen = torch.Generator().manual_seed(20)
    q, k, v, tc, scale = case(gen, 24, 16, 2, 64, 64, 500, 150, dtype, "scattered", device)
    batch = ht.qsa_attention(q, k, v, tc, scale)
    for t in (0, 5, 23):
        alone = ht.qsa_attention(q[t:t + 1], k, v, tc[t:t + 1], scale)
        assert torch.equal(alone[0], batch[t])
    perm = torch.randperm(24, generator=gen).to(device)
    assert torch.equal(ht.qsa_attention(q[perm], k, v, tc[perm], scale), batch[perm])
    # Other queries' selections (longer, shorter, different cells) change nothing for query 3.
    others = random_selection(24, 500, 300, gen).to(device)
    mixed_tc = torch.cat([others[:5], torch.cat([tc[3:4], torch.full((1, 150), -1, dtype=torch.int32,
                                                                     device=device)], 1)], 0)
    mixed = ht.qsa_attention(torch.cat([q[:5], q[3:4]]), k, v, mixed_tc, scale)
    assert torch.equal(mixed[5], batch[3])
    assert torch.equal(ht.qsa_attention(q, k, v, tc, scale), batch)  # repeated run


def test_thread_count_invariance():
    gen = torch.Generator().manual_seed(21)
    q, k, v, tc, scale = case(gen, 33, 16, 2, 256, 256, 3000, 700, torch.bfloat16, "end")
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            results.append(ht.qsa_attention(q, k, v, tc, scale))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


# The CPU kernels' paths: the portable code (what arm64 runs), the hand-written AVX2 kernels (of
# qsa_attention and qsa_select's scores), the AVX-512 kernels and the AVX512-BF16 dot product must
# give the same bits. Each runs in a subprocess, because HEBRUS_CPU_CAPABILITY is read once per process.
_CAPABILITY_SCRIPT = """
import sys, torch, hebrus_torch as ht
gen = torch.Generator().manual_seed(5)
outs = {}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for hq, hkv, dh, dv in [(16, 2, 256, 256), (8, 1, 96, 32), (16, 2, 80, 64), (8, 1, 40, 24),
                            (12, 4, 64, 96), (8, 8, 17, 33), (4, 2, 64, 64), (16, 4, 128, 136), (3, 1, 48, 40),
                            (2, 2, 32, 4)]:
        cells, tq = 300, 7
        # Half the dims hold 8 in every query and key: large partial sums, so that a different
        # order of the additions changes the scores by more than the output dtype hides.
        common = torch.rand(dh, generator=gen) < 0.5
        k = torch.where(common, 8.0, torch.randn(cells, hkv, dh, generator=gen)).to(dtype)
        q = torch.where(common, 8.0, torch.randn(tq, hq, dh, generator=gen)).to(dtype)
        v = (torch.randn(cells, hkv, dv, generator=gen) * 100).to(dtype)
        tc = torch.randint(-1, cells, (tq, 70), dtype=torch.int32, generator=gen)
        tc[:, 0] = 3
        outs[f"{dtype} {hq} {hkv} {dh} {dv}"] = ht.qsa_attention(q, k, v, tc, 0.3)
# qsa_select's scores: fp32 / bf16 rows read in place and fp16 rows widened; heads 1-5, dims a multiple
# of 16 or not (zero-padded); an odd number of groups.
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for hq, dim in [(4, 64), (1, 32), (3, 40), (5, 128)]:
        groups, tq = 37, 6
        common = torch.rand(dim, generator=gen) < 0.5
        pooled = torch.where(common, 8.0, torch.randn(2 * groups, dim, generator=gen)).to(dtype)
        q = torch.where(common, 8.0, torch.randn(tq, hq, dim, generator=gen)).to(dtype)
        seq_groups = torch.randperm(2 * groups, generator=gen)[:groups].to(torch.int32)[None]
        q_groups = torch.tensor([groups, 1, 17, groups - 1, 30, 9], dtype=torch.int32)
        sel = ht.qsa_select(q, pooled, seq_groups, torch.zeros(tq, dtype=torch.int32), q_groups, 5)
        outs[f"select {dtype} {hq} {dim}"] = sel
torch.save(outs, sys.argv[1])
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def _run_with_capability(tmp_path, capability: str | None):
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("HEBRUS_CPU_CAPABILITY", None)
    if capability is not None:
        env["HEBRUS_CPU_CAPABILITY"] = capability
    out = tmp_path / f"{capability}.pt"
    done = subprocess.run([sys.executable, "-c", _CAPABILITY_SCRIPT, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    return done, out


@pytest.mark.skipif(not has_native_kernel("qsa_attention", "cpu"), reason="native CPU kernel not built")
def test_cpu_capabilities_give_the_same_bits(tmp_path):
    flags = _cpu_flags()
    capabilities = ["default"]
    if {"avx2", "fma", "f16c"} <= flags:
        capabilities.append("avx2")
    if "avx512f" in flags:
        capabilities.append("avx512")
    if {"avx512f", "avx512_bf16"} <= flags:
        capabilities.append("avx512_bf16")
    if len(capabilities) == 1:
        pytest.skip("this CPU has no hand-written kernels to compare with the portable code")
    results = {}
    for capability in capabilities:
        done, out = _run_with_capability(tmp_path, capability)
        assert done.returncode == 0, done.stderr[-4000:]
        results[capability] = torch.load(out)
    for capability in capabilities[1:]:
        for key, want in results["default"].items():
            assert torch.equal(results[capability][key], want), (capability, key)


@pytest.mark.skipif(not has_native_kernel("qsa_attention", "cpu"), reason="native CPU kernel not built")
def test_unknown_cpu_capability_is_refused(tmp_path):
    done, _ = _run_with_capability(tmp_path, "avx9000")
    assert done.returncode != 0
    assert "HebrusError" in done.stderr and "HEBRUS_CPU_CAPABILITY='avx9000'" in done.stderr


# ----------------------------------------------------------------------------------------------
# opcheck and torch.compile


def op_samples(device):
    gen = torch.Generator().manual_seed(30)
    for dtype, (tq, hq, hkv, dh, dv, cells, width, pad) in [
        (torch.float32, (5, 4, 2, 16, 16, 30, 9, "end")),
        (torch.float16, (3, 8, 1, 32, 8, 12, 12, "scattered")),
        (torch.bfloat16, (1, 2, 2, 8, 24, 7, 3, "end")),
        (torch.float32, (7, 16, 2, 24, 40, 64, 20, "scattered")),
    ]:
        yield case(gen, tq, hq, hkv, dh, dv, cells, width, dtype, pad, device)


def test_opcheck(device):
    for args in op_samples(device):
        torch.library.opcheck(torch.ops.hebrus.qsa_attention.default, args)


def test_compile_matches_eager(device):
    gen = torch.Generator().manual_seed(31)
    q, k, v, tc, scale = case(gen, 9, 8, 2, 32, 32, 80, 24, torch.float32, "scattered", device)
    w_o = rand((8 * 32, 16), gen, device=device)

    def block(q, k, v, tc):
        out = ht.qsa_attention(q * 1.5, k, v, tc, scale)
        return out.reshape(out.shape[0], -1) @ w_o

    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, fullgraph=True)(q, k, v, tc)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, block(q, k, v, tc))


# ----------------------------------------------------------------------------------------------
# bad input: the wrapper raises HebrusError; the CPU kernel called directly raises a tagged ValueError


def good_args(device="cpu"):
    gen = torch.Generator().manual_seed(40)
    q, k, v, tc, _ = case(gen, 3, 4, 2, 8, 6, 10, 4, device=device)
    return dict(q=q, k=k, v=v, token_cells=tc, scale=0.25)


def _tc(rows):
    return torch.tensor(rows, dtype=torch.int32)


BAD = {
    "q-2d": (dict(q=torch.randn(3, 32)), r"q must be 3-D, got shape \(3, 32\)"),
    "q-float64": (dict(q=torch.randn(3, 4, 8, dtype=torch.float64)), r"q must have dtype torch\.float32 or"),
    "q-int": (dict(q=torch.ones(3, 4, 8, dtype=torch.int64)), r"q must have dtype"),
    "k-2d": (dict(k=torch.randn(10, 16)), r"k must be 3-D"),
    "v-4d": (dict(v=torch.randn(10, 2, 6, 1)), r"v must be 3-D"),
    "k-dtype": (dict(k=torch.randn(10, 2, 8, dtype=torch.float16)),
                r"k dtype torch\.float16 must match q dtype torch\.float32"),
    "v-dtype": (dict(v=torch.randn(10, 2, 6, dtype=torch.bfloat16)), r"v dtype torch\.bfloat16 must match q dtype"),
    "cells-dtype": (dict(token_cells=torch.zeros(3, 4, dtype=torch.int64)),
                    r"token_cells must have dtype torch\.int32, got torch\.int64"),
    "cells-1d": (dict(token_cells=_tc([0, 1, 2])), r"token_cells must be 2-D"),
    "no-kv-heads": (dict(k=torch.randn(10, 0, 8), v=torch.randn(10, 0, 6)), r"k must have Hkv >= 1 heads"),
    "k-head-dim": (dict(k=torch.randn(10, 2, 9)), r"k head dim 9 must equal q head dim 8"),
    "v-cells": (dict(v=torch.randn(11, 2, 6)),
                r"v must have shape \(cells, Hkv, Dv\) with cells = 10 and Hkv = 2 like k, got \(11, 2, 6\)"),
    "v-heads": (dict(v=torch.randn(10, 1, 6)), r"v must have shape .* got \(10, 1, 6\)"),
    "gqa-ratio": (dict(q=torch.randn(3, 3, 8)), r"query heads Hq = 3 must be a multiple of KV heads Hkv = 2"),
    "cells-rows": (dict(token_cells=_tc([[0, 1, 2, 3]])),
                   r"token_cells must have one row per query \(Tq = 3\), got shape \(1, 4\)"),
    "scale-nan": (dict(scale=float("nan")), r"scale must be finite, got nan"),
    "scale-inf": (dict(scale=float("inf")), r"scale must be finite, got inf"),
    "cell-too-big": (dict(token_cells=_tc([[0, 1, -1, -1], [2, -1, 10, 3], [4, 5, 6, 7]])),
                     r"query 1 selects cell 10 \(token_cells\[1, 2\]\), outside \[0, cells=10\); "
                     r"negative entries are padding"),
    "cell-huge": (dict(token_cells=_tc([[0, 1, -1, -1], [2, -1, 1, 3], [4, 2147483647, 6, 7]])),
                  r"query 2 selects cell 2147483647 \(token_cells\[2, 1\]\)"),
    "empty-query": (dict(token_cells=_tc([[0, 1, -1, -1], [-1, -1, -1, -1], [4, 5, 6, 7]])),
                    r"query 1 selects no cell \(every entry of token_cells\[1\] is negative padding\)"),
    "empty-query-other-negatives": (dict(token_cells=_tc([[0, 1, -1, -1], [3, -1, -1, -1],
                                                          [-5, -2147483648, -1, -9]])), r"query 2 selects no cell"),
    "zero-width": (dict(token_cells=torch.zeros(3, 0, dtype=torch.int32)), r"query 0 selects no cell"),
    "range-before-empty": (dict(token_cells=_tc([[-1, -1, -1, -1], [2, 12, 1, 3], [4, 5, 6, 7]])),
                           r"query 1 selects cell 12"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input(device, name):
    changes, pattern = BAD[name]
    args = with_changes(good_args(device), changes, device)
    assert_rejected("qsa_attention", args, pattern, device)
    with pytest.raises(ht.HebrusError, match=r"hebrus::qsa_attention: .*" + pattern):
        reference.qsa_attention(**args)          # the kernel of every device without a native one


@pytest.mark.parametrize("name", ["q", "k", "v", "token_cells"])
def test_mismatched_devices(name):
    assert_mixed_devices_rejected("qsa_attention", good_args(), name)


def test_padding_never_reads_a_cell():
    """Padding entries select nothing: an inf or NaN in a cell no query selected (cell 0, which the
    reference's gather of padding lands on) reaches no output, in the kernel and the reference."""
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(3, 4, 16, generator=gen)
    k = torch.randn(6, 2, 16, generator=gen)
    v = torch.randn(6, 2, 8, generator=gen)
    k[0], v[0] = float("nan"), float("inf")
    cells = torch.tensor([[1, -1, 2, -1], [-1, -1, 5, 3], [4, 4, -1, 1]], dtype=torch.int32)
    want = reference.qsa_attention(q, k, v, cells, 0.25)
    got = ht.qsa_attention(q, k, v, cells, 0.25)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    clean = reference.qsa_attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0, 0.0, 0.0), cells, 0.25)
    assert torch.equal(want, clean)
