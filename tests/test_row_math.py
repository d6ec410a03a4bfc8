"""The CPU fused ops' own row arithmetic (csrc/cpu/row_math.h) at the edges of the float range, through the ops that
use it: sigmoid saturates to exactly 0 and 1 and keeps a NaN, softplus follows x for large x and exp(x) for very
negative x without overflow, SiLU stays finite at large magnitudes, and a row of zeros normalises to zeros (eps keeps it
finite). Values within tests/tolerance.py's fp32 tolerance of torch's own functions elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hebrus_torch
from hebrus_torch.qsa.ops import sigmoid_gate
from tolerance import near

EDGES = [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 20.0, -20.0, 88.0, -88.0, 90.0, -90.0, 1e30, -1e30,
         math.inf, -math.inf, math.nan]


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal NaN positions, equal infinities, the rest within the fp32 tolerance."""
    if not torch.equal(got.isnan(), want.isnan()):
        return False
    finite = want.isfinite()
    if not torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()]):
        return False
    return near(got[finite], want[finite])


def test_sigmoid_saturates_and_keeps_nan():
    gate = torch.tensor(EDGES).view(1, 1, -1)
    got = sigmoid_gate(torch.ones_like(gate), gate)
    assert same(got, torch.sigmoid(gate))
    assert float(got[0, 0, EDGES.index(math.inf)]) == 1.0 and float(got[0, 0, EDGES.index(-math.inf)]) == 0.0


def test_sigmoid_of_a_long_row_is_each_element_alone_nan_kept_anywhere():
    """A row long enough for the vector loop (and its tail): each element gives the bits it gives alone (a row of one:
    no vector lane), and a NaN stays a NaN at every lane position."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 1, 77, generator=g) * 30
    row[0, 0, ::5] = math.nan
    row[0, 0, 3::11] = math.inf
    row[0, 0, 7::13] = -math.inf
    got = sigmoid_gate(torch.ones_like(row), row)
    alone = torch.cat([sigmoid_gate(torch.ones(1, 1, 1), row[..., i:i + 1]) for i in range(row.shape[-1])], dim=-1)
    assert torch.equal(got.isnan(), row.isnan())
    assert torch.equal(got.nan_to_num(7.0), alone.nan_to_num(7.0))
    assert same(got, torch.sigmoid(row))


def test_gates_softplus_and_sigmoid_at_the_edges():
    x = torch.tensor(EDGES).view(1, -1)
    zeros = torch.zeros(x.shape[1])
    g, beta = hebrus_torch.gdn_gates(x, x, zeros, zeros)   # g = -exp(0) * softplus(x)
    assert same(g, -F.softplus(x))
    assert same(beta, torch.sigmoid(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_of_the_shared_expert_at_large_values(dtype):
    """gate_proj and down_proj the identity, up_proj picking the last input (a 1): out = silu(x), through a matrix
    product (so finite inputs only: an infinity times a 0 of the identity is NaN)."""
    finite = [v for v in EDGES if math.isfinite(v)]
    x = torch.tensor([finite + [1.0]]).to(dtype)
    n = x.shape[1]
    eye = torch.eye(n, dtype=dtype)
    pick_last = torch.zeros(n, n, dtype=dtype)
    pick_last[:, -1] = 1
    got = hebrus_torch.moe_shared_expert(x, torch.zeros_like(x), eye, pick_last, eye, torch.ones(1, 1, dtype=dtype))
    assert near(got, F.silu(x.float()).to(dtype))
    assert bool(got.isfinite().all())


def test_a_row_of_zeros_normalises_to_zeros():
    x = torch.zeros(2, 64)
    x[1] = 3.0
    w = torch.randn(64)
    got = hebrus_torch.hc_rms_norm(x, w, 32, 1e-6)
    assert torch.equal(got[0], torch.zeros(64)) and bool(got.isfinite().all())
    assert near(got[1], (1.0 + w))
