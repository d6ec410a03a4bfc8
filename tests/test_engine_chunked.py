"""The engine's chunked GDN prefill (issue 25): prefill chunks cut at aligned positions, so tokens and
every holder's digest stay bitwise independent of max_batch_tokens (>= 64), the request cap, arrival
order and prefix sharing; the scheduler's alignment rule and its progress."""

from __future__ import annotations

import random

import pytest
import torch

from hf_models import modeling  # noqa: F401,E402  (skips without transformers)
from test_engine import EOS, eager_experts, make_model, row_invariant, run_engine  # noqa: F401  (fixture)

from hebrus_torch import HebrusError, _extension
from hebrus_torch.engine import Engine, EngineConfig
from hebrus_torch.engine.requests import Request
from hebrus_torch.engine.scheduler import Scheduler

needs_kernel = pytest.mark.skipif(not _extension.has_native_kernel("gdn_chunk_delta_rule_slots", "cpu"),
                                  reason="no CPU kernel built")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def long_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [[rng.randrange(4, 50) for _ in range(n)] for n in (100, 300, 130)]
    shared = base[1][:150]                       # shares 150 tokens (two whole chunks and a part) with base[1]
    # base[0] + 120 more: base[0]'s snapshots at 68..100 lie inside a chunk this prompt runs whole (64..127),
    # so only the one at 64 may be shared (the engine's accept rule).
    return base + [shared + [9, 8, 7], shared + [rng.randrange(4, 50) for _ in range(60)], base[0][:64] + [5],
                   base[0] + [rng.randrange(4, 50) for _ in range(120)]]


@needs_kernel
def test_tokens_and_state_do_not_depend_on_budget_cap_order_or_sharing_with_whole_chunks(row_invariant):
    model = eager_experts(make_model("lin-idx", seed=7))
    prompts = long_prompts(7)
    ref_tokens, ref_states = run_engine(model, prompts, max_new_tokens=4, max_batch_tokens=None,
                                        allow_block_sharing=False, capacity_tokens=4096)
    settings = [dict(max_batch_tokens=64), dict(max_batch_tokens=100), dict(max_batch_tokens=256),
                dict(max_batch_tokens=None), dict(max_batch_tokens=100, max_requests_per_batch=2),
                dict(max_batch_tokens=256, order=[6, 5, 4, 3, 2, 1, 0]),
                dict(max_batch_tokens=64, max_requests_per_batch=3, order=[2, 0, 4, 1, 6, 5, 3])]
    for s in settings:
        for sharing in (False, True):
            tokens, states = run_engine(model, prompts, max_new_tokens=4, capacity_tokens=4096,
                                        allow_block_sharing=sharing, **s)
            assert tokens == ref_tokens, (s, sharing)
            assert states == ref_states, (s, sharing)
    # Not vacuous: the recurrent form gives other state bits after these prompts.
    _, rec_states = run_engine(model, prompts, max_new_tokens=4, max_batch_tokens=None, allow_block_sharing=False,
                               capacity_tokens=4096, chunked_prefill=False)
    assert rec_states != ref_states


def request(prompt_len: int, computed: int = 0, generated: int = 0) -> Request:
    req = Request(request_id="r", prompt=list(range(prompt_len)), max_new_tokens=100)
    req.generated = [1] * generated
    req.num_computed = computed
    return req


@pytest.mark.parametrize("prompt_len,computed,generated,limit,want", [
    (300, 0, 0, 100, 64),       # below the extent (256): down to a multiple of 64
    (300, 0, 0, 63, 0),         # cannot reach 64: waits
    (300, 10, 0, 100, 54),      # from an unaligned start (never scheduled so, but defined): to 64
    (300, 192, 0, 100, 100),    # reaches past the extent: any cut in [256, 300]
    (300, 256, 0, 20, 20),      # at or past the extent: any cut
    (100, 0, 0, 1000, 100),     # the whole prompt (extent 64, end 100)
    (100, 0, 50, 1000, 100),    # recompute after a preemption: never past the prompt from below the extent
    (100, 100, 50, 1000, 50),   # the recomputed outputs, from the prompt's end (recurrent)
    (64, 0, 0, 64, 64),
])
def test_chunk_cuts_at_aligned_positions(prompt_len, computed, generated, limit, want):
    s = Scheduler(max_batch_tokens=None, max_requests_per_batch=None, max_sequences=4, chunk_align=64)
    assert s._chunk(request(prompt_len, computed, generated), limit) == want


def test_chunk_with_block_boundaries_keeps_alignment():
    s = Scheduler(max_batch_tokens=None, max_requests_per_batch=None, max_sequences=4, block_size=48, chunk_align=64)
    assert s._chunk(request(300), 150) == 128       # 128, not the block boundary 144 (below the extent)
    assert s._chunk(request(300, 256), 40) == 32    # past the extent: the block boundary 288
    s4 = Scheduler(max_batch_tokens=None, max_requests_per_batch=None, max_sequences=4, block_size=4, chunk_align=64)
    assert s4._chunk(request(300, 256), 30) == 28   # 284


def test_a_waiting_prefill_holds_the_budget_and_progresses():
    s = Scheduler(max_batch_tokens=64, max_requests_per_batch=None, max_sequences=4, chunk_align=64)
    decoding = request(10, 10, 1)
    long = request(200, 0, 0)
    later = Request(request_id="w", prompt=list(range(5)), max_new_tokens=4)
    for r in (decoding, long):
        s.running.append(r)
    s.add(later)
    plan = s.schedule(free_cells=1000)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(decoding, 1)]   # long waits, later not admitted
    assert not plan.admitted
    s.running.remove(decoding)                                                     # the decode finished
    plan = s.schedule(free_cells=1000)
    assert [(c.request, c.num_tokens) for c in plan.chunks][0] == (long, 64)


def test_small_budgets_and_the_switch_turn_the_chunked_form_off():
    model = make_model("lin-idx", seed=1)
    assert Engine(model, EngineConfig(capacity_tokens=256, max_batch_tokens=63)).chunk_align is None
    assert Engine(model, EngineConfig(capacity_tokens=256, max_batch_tokens=64)).chunk_align == 64
    assert Engine(model, EngineConfig(capacity_tokens=256, max_batch_tokens=None)).chunk_align == 64
    assert Engine(model, EngineConfig(capacity_tokens=256, chunked_prefill=False)).chunk_align is None
    with pytest.raises(HebrusError, match="chunked_prefill must be a bool"):
        EngineConfig(chunked_prefill="yes")
    with pytest.raises(ValueError):
        Scheduler(max_batch_tokens=32, max_requests_per_batch=None, max_sequences=4, chunk_align=64)


@needs_kernel
def test_engine_with_a_tight_budget_and_decodes_completes(row_invariant):
    model = eager_experts(make_model("lin-idx", seed=2))
    prompts = [[5 + i % 40 for i in range(n)] for n in (7, 9, 150, 5, 200)]
    ref, _ = run_engine(model, prompts, max_new_tokens=12, max_batch_tokens=None, capacity_tokens=2048)
    got, _ = run_engine(model, prompts, max_new_tokens=12, max_batch_tokens=64, capacity_tokens=2048)
    assert got == ref


@needs_kernel
def test_many_requests_through_two_slots_keep_the_bits(row_invariant):
    """More requests than 2 x max_sequences: the engine forgets freed sequences' extents (and kept
    prefixes come and go) without changing a bit."""
    model = eager_experts(make_model("lin-idx", seed=7))
    prompts = long_prompts(7)
    ref_tokens, ref_states = run_engine(model, prompts, max_new_tokens=4, max_batch_tokens=None,
                                        allow_block_sharing=False, capacity_tokens=4096)
    tokens, states = run_engine(model, prompts, max_new_tokens=4, max_batch_tokens=100, max_sequences=2,
                                capacity_tokens=4096)
    assert tokens == ref_tokens and states == ref_states


def test_a_held_prefill_goes_first_in_the_next_step_while_others_decode():
    """With the decodes first, a budget of 64 never left a whole chunk while any request decoded: the prefill
    waited for every decode to finish (python -m hebrus_torch's engine demo: 212 steps instead of 45)."""
    s = Scheduler(max_batch_tokens=64, max_requests_per_batch=None, max_sequences=4, chunk_align=64)
    decoding = request(10, 10, 1)                 # decodes on and on (max_new_tokens 100)
    long = request(200, 0, 0)
    s.running.extend([decoding, long])
    plan = s.schedule(free_cells=1000)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(decoding, 1)]      # long waits: 63 < 64
    plan = s.schedule(free_cells=1000)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(long, 64)]         # its turn: the whole budget
    long.num_computed += 64
    plan = s.schedule(free_cells=1000)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(decoding, 1)]      # the decode again
