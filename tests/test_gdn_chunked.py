"""The chunked (WY) form of the gated delta rule, aligned to absolute positions (hebrus_torch.gdn.chunked)."""

from __future__ import annotations

import pytest
import torch

from hebrus_torch.gdn.chunked import CHUNK, chunk_delta_rule_reference, row_pieces
from hebrus_torch.gdn.delta_rule import recurrent_delta_rule


def make(T, hk=2, hv=4, dk=32, dv=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    g = -torch.rand(T, hv, generator=gen) * 0.2
    beta = torch.rand(T, hv, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("start,length,want", [
    (0, 64, [(0, 64, True)]),
    (0, 10, [(0, 10, False)]),
    (60, 10, [(0, 4, False), (4, 6, False)]),
    (10, 300, [(0, 54, False), (54, 64, True), (118, 64, True), (182, 64, True), (246, 54, False)]),
    (64, 128, [(0, 64, True), (64, 64, True)]),
    (5, 0, []),
])
def test_row_pieces(start, length, want):
    assert row_pieces(start, length) == want


@pytest.mark.parametrize("start", [0, 10, 63])
def test_chunked_equals_recurrent_within_rounding(start):
    q, k, v, g, beta = make(300)
    pool = torch.randn(2, 4, 32, 24) * 0.1
    a, b = pool.clone(), pool[1:2].clone()
    out = chunk_delta_rule_reference(q, k, v, g, beta, [0, 300], [start], a, [1], True, 32 ** -0.5)
    ref = recurrent_delta_rule(q, k, v, g, beta, [0, 300], b, True, 32 ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(a[1], b[0], atol=2e-6, rtol=1e-5)
    assert torch.equal(a[0], pool[0])


def test_aligned_cuts_and_other_rows_do_not_change_bits():
    q, k, v, g, beta = make(300, seed=1)
    pool = torch.randn(3, 4, 32, 24) * 0.1
    one = pool.clone()
    out = chunk_delta_rule_reference(q, k, v, g, beta, [0, 300], [10], one, [1], True, 32 ** -0.5)
    cut = pool.clone()
    cuts = [0, 54, 118, 246, 300]          # positions 10 + cut: 64, 128, 256 (aligned)
    parts = [chunk_delta_rule_reference(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], [0, b - a], [10 + a], cut, [1],
                                        True, 32 ** -0.5) for a, b in zip(cuts[:-1], cuts[1:])]
    assert torch.equal(torch.cat(parts), out) and torch.equal(cut, one)
    q2, k2, v2, g2, b2 = make(200, seed=2)
    mixed = pool.clone()
    both = chunk_delta_rule_reference(torch.cat([q2, q]), torch.cat([k2, k]), torch.cat([v2, v]), torch.cat([g2, g]),
                                      torch.cat([b2, beta]), [0, 200, 500], [0, 10], mixed, [2, 1], True, 32 ** -0.5)
    assert torch.equal(both[200:], out) and torch.equal(mixed[1], one[1])


def test_an_unaligned_cut_inside_a_chunk_runs_it_recurrently():
    q, k, v, g, beta = make(CHUNK, seed=3)
    pool = torch.zeros(1, 4, 32, 24)
    whole = chunk_delta_rule_reference(q, k, v, g, beta, [0, CHUNK], [0], pool.clone(), [0], True, 32 ** -0.5)
    split = pool.clone()
    parts = [chunk_delta_rule_reference(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], [0, b - a], [a], split, [0], True,
                                        32 ** -0.5) for a, b in ((0, 30), (30, CHUNK))]
    rec = recurrent_delta_rule(q, k, v, g, beta, [0, CHUNK], torch.zeros(1, 4, 32, 24), True, 32 ** -0.5)
    assert torch.equal(torch.cat(parts), rec)
    assert not torch.equal(whole, rec)       # the two forms round differently: the test above is not vacuous
    torch.testing.assert_close(whole, rec, atol=2e-6, rtol=1e-5)
