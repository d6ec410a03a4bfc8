"""mps_kernels/moe_route.metal (issue 37) run in the emulator with the glue's grid: a MoE block's router after
its linear (softmax in fp32, top-k, renormalisation, cast) and the shared expert's sigmoid gate, against the
reference with its order among equal probabilities made explicit (the kernel takes the lower expert id first;
torch.topk's order there is unspecified): every dtype, k = E and k = 1, with and without renormalisation and
shared gates, exact ties of every size, rows independent of the rest of the launch (bitwise) in every schedule
and guard placement, bad metadata refused with the CPU kernel's messages, the plan's limit on k."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "metal"))
import hebrus_emu  # noqa: E402
import msl_emu  # noqa: E402
from hebrus_torch import reference  # noqa: E402
from hebrus_torch.errors import HebrusError  # noqa: E402
from hebrus_torch.reference.moe import route_weights  # noqa: E402
from moe_fused_cases import ROUTE_BAD  # noqa: E402

pytestmark = [pytest.mark.metal,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator runs on Linux")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(rows, experts, shared, dtype, seed=0, levels=None):
    """Router logits [T, E] (random, or drawn from `levels` distinct values: exact ties) and shared gate
    logits [T, S] (None for S = 0)."""
    g = torch.Generator().manual_seed(seed)
    if levels is None:
        logits = torch.randn(rows, experts, generator=g) * 2
    else:
        logits = torch.randint(0, levels, (rows, experts), generator=g).float() * 0.5
    gate = (torch.randn(rows, shared, generator=g) * 3).to(dtype) if shared else None
    return logits.to(dtype), gate


def lower_id_first(logits, shared, top_k, norm):
    """reference.moe_route with the kernel's order among equal probabilities (a stable descending sort)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return ids, route_weights(probs.gather(1, ids), logits.dtype, shared, norm)


def check(got, want, dtype):
    (ids, weights), (want_ids, want_weights) = got, want
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    assert weights.dtype == dtype and weights.shape == want_weights.shape
    if dtype == torch.float32:  # exp and the sums are the platform's: a few ulp
        torch.testing.assert_close(weights, want_weights, atol=1e-7, rtol=4e-6)
    else:  # fp32 math rounded once: equal but for rare 1-ulp ties of the rounding
        diff = (weights.float() - want_weights.float()).abs()
        ulp = torch.finfo(dtype).eps * want_weights.float().abs().clamp_min(1e-3)
        assert bool((diff <= ulp * 1.01).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,experts,top_k,shared,norm", [
    (5, 512, 10, 1, True), (3, 40, 4, 0, False), (4, 33, 33, 2, True), (2, 7, 1, 1, False), (9, 100, 8, 0, True),
])
def test_matches_reference(dtype, rows, experts, top_k, shared, norm):
    logits, gate = make(rows, experts, shared, dtype, seed=experts + top_k)
    check(hebrus_emu.moe_route(logits, gate, top_k, norm), lower_id_first(logits, gate, top_k, norm), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("levels", [1, 2, 5])
def test_equal_probabilities_take_the_lower_id_first(dtype, levels):
    """Logits drawn from a few values: every row has ties across the top-k boundary and inside it."""
    logits, gate = make(6, 96, 1, dtype, seed=levels, levels=levels)
    got = hebrus_emu.moe_route(logits, gate, 10, True)
    check(got, lower_id_first(logits, gate, 10, True), dtype)
    if levels == 1:
        assert torch.equal(got[0], torch.arange(10).expand(6, 10))


@pytest.mark.parametrize("sched", msl_emu.SCHEDULES)
@pytest.mark.parametrize("guard", ["end", "start"])
def test_rows_do_not_depend_on_the_launch(sched, guard):
    """A row's ids and weights are bitwise the same alone and among others, in every schedule, with the guard
    page before or after every buffer."""
    logits, gate = make(11, 70, 1, torch.float32, seed=3)
    ids, weights = hebrus_emu.moe_route(logits, gate, 6, True, sched=sched, seed=4, guard=guard)
    for row in (0, 5, 10):
        one_ids, one_weights = hebrus_emu.moe_route(logits[row:row + 1].clone(), gate[row:row + 1].clone(), 6, True,
                                                    guard=guard)
        assert torch.equal(one_ids[0], ids[row]) and torch.equal(one_weights[0], weights[row])


def test_empty_rows_launch_nothing():
    logits, gate = make(0, 16, 1, torch.float16)
    assert hebrus_emu.launches("moe_route", logits, gate, 4, True) == []
    ids, weights = hebrus_emu.moe_route(logits, gate, 4, True)
    assert ids.shape == (0, 4) and weights.shape == (0, 5)


def test_top_k_over_the_kernels_limit_is_refused():
    logits, _ = make(2, 80, 0, torch.float32)
    with pytest.raises(HebrusError, match="hebrus::moe_route on MPS: top_k > 64"):
        hebrus_emu.moe_route(logits, None, 65, True)


@pytest.mark.parametrize("bad,match", ROUTE_BAD)
def test_bad_metadata_is_refused_as_on_cpu(bad, match):
    args = bad(*make(3, 8, 1, torch.float32))
    with pytest.raises(HebrusError, match=match):
        hebrus_emu.moe_route(*args, True)
    with pytest.raises(HebrusError, match=match):
        reference.moe_route(*args, True)
