"""Speculation from the checkpoint's own MTP block (issue 38): loading ``mtp.*``, the block against transformers'
own modules (its QSA selection per draft position included), and exactness under continuous batching.

- the drafter's logits at every draft position equal the reference block's (``reference_mtp``: transformers'
  decoder layer on the whole MTP sequence, each query selecting its own groups), for prompts past the
  indexer's budget and for every cut of the prefill; the same reference with selection off differs;
- drafting leaves the cache bitwise as it was (its transaction is rolled back);
- greedy requests get the plain engine's tokens, and every holder (the MTP layer included) the digests of an
  engine that writes the MTP layer without speculating, at every common frontier, whatever the budget,
  draft length and arrival order; the trunk's recurrent holders those of the plain engine;
- sampled requests are reproducible; a model without ``mtp.*`` is refused at start.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_models import modeling, tiny_indexer_config  # noqa: F401  (skips without transformers)
from test_engine import EOS, eager_experts, make_model, prompts_for, row_invariant  # noqa: F401
from test_engine_speculative import generate_batch_once, run as speculative_run

import hebrus_torch.engine.mtp as engine_mtp
from hebrus_torch.engine import BadRequestError, Engine, EngineConfig, RequestStatus, SamplingParams
from hebrus_torch.engine.speculative import SpecState, SpeculativeConfig
from hebrus_torch.errors import HebrusError
from hebrus_torch.models.qwen4_exp.mtp import reference_mtp
from hebrus_torch.testing import random_mtp


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def with_mtp(model, seed: int = 7):
    model.mtp = random_mtp(model.config, seed)
    return model


def mtp_config(k: int, **kw) -> SpeculativeConfig:
    """MTP speculation with k drafts; the confidence rule and the first-token rule off unless ``kw`` sets them
    (a random block's distribution is flat: with the default thresholds it would propose nothing)."""
    return SpeculativeConfig(k, method="mtp", **{"confidence_threshold": 0.0, "first_token_threshold": 0.0, **kw})


class _Peek(Exception):
    """Rolls back the transaction a caught-up digest is taken in."""


def caught_up_digests(engine, seq) -> tuple:
    """Every holder's digest of ``seq`` as it will be once the MTP block's deferred entries are written
    (``MTPDrafter.catch_up`` inside a transaction that is rolled back: the run goes on as it was)."""
    drafter = engine.mtp_drafter
    if drafter is None or not drafter.pending_positions(seq):
        return tuple(h.digest(seq) for h in engine.cache.holders)
    pending, caught = dict(drafter._pending), drafter.caught_up
    got = None
    try:
        with engine.cache.transaction():
            assert drafter.catch_up([seq]) > 0
            got = tuple(h.digest(seq) for h in engine.cache.holders)
            raise _Peek
    except _Peek:
        pass
    finally:
        drafter._pending, drafter.caught_up = pending, caught
    return got


def run(model, prompts, *, spec=None, digests=None, order=None, **config):
    """test_engine_speculative's ``run`` with ``spec`` the engine's default, the requests arriving in ``order``
    (their ids and the digests' keys stay those of their place in ``prompts``); the digests are those once the MTP
    block's deferred entries are written (``caught_up_digests``)."""
    order = list(order) if order is not None else list(range(len(prompts)))
    got: dict = {}
    tokens, engine = speculative_run(model, [prompts[i] for i in order], digests=got if digests is not None else None,
                                     digest=caught_up_digests, speculative=spec, **config)
    name = {f"r{j}": f"r{i}" for j, i in enumerate(order)}
    if digests is not None:
        digests.update({(name[rid], n): d for (rid, n), d in got.items()})
    return {name[rid]: t for rid, t in tokens.items()}, engine


def trunk_streams(model, tokens: list[int]) -> torch.Tensor:
    """The trunk's pre-mixer streams Tensor[T, hc * hidden] of transformers' own forward over ``tokens``."""
    got = {}
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, out: got.__setitem__("h", out))
    try:
        with torch.no_grad():
            model.model(torch.tensor([tokens]))
    finally:
        hook.remove()
    return got["h"][0]


def reference_drafts(model, tokens: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
    """k greedy drafts after ``tokens`` (the last one not yet fed to the trunk) by transformers' modules: the MTP
    sequence is (zero streams, t0), (h0, t1), ..., (h_{P-1}, t_P), then each draft's (block output, draft)."""
    mtp = model.mtp
    h = trunk_streams(model, tokens[:-1])
    streams = torch.cat([torch.zeros_like(h[:1]), h])
    ids = list(tokens)
    drafts, logits = [], []
    for _ in range(k):
        out, lg = reference_mtp(model, mtp, streams, torch.tensor(ids))
        logits.append(lg[-1])
        d = int(lg[-1].argmax())
        drafts.append(d)
        streams = torch.cat([streams, out[-1:]])
        ids.append(d)
    return drafts, logits


def _recording_logits(monkeypatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    original = engine_mtp.mtp_logits

    def record(*args):
        out = original(*args)
        seen.append(out.clone())
        return out
    monkeypatch.setattr(engine_mtp, "mtp_logits", record)
    return seen


# ------------------------------------------------------------------------------------------ the block itself
@pytest.mark.parametrize("budget", [5, 16, None])
def test_drafts_equal_the_reference_block_with_its_own_selection_per_position(budget, monkeypatch):
    model = with_mtp(make_model("lin-idx", seed=21))
    prompt = prompts_for(21, lengths=(23,))[0]          # past the indexer's budget (8): selection is real
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, max_batch_tokens=budget,
                                        block_size=4, speculative=mtp_config(0)))
    rid = engine.add_request(prompt, max_new_tokens=20, eos_token_id=None)
    req = engine.requests[rid]
    assert engine.make_request([5], speculative=2).speculative == mtp_config(2)   # (an int: MTP drafts here)
    while len(req.generated) < 3:
        assert not req.status.is_done
        engine.step()
    seen = _recording_logits(monkeypatch)
    before = engine.cache.digest()
    drafts = engine.mtp_drafter.propose_batch([req], [4])[0]
    assert engine.cache.digest() == before                       # drafting publishes nothing
    want, want_logits = reference_drafts(model, req.tokens, 4)
    assert drafts == want
    assert len(seen) == 4
    for got, ref in zip(seen, want_logits):
        torch.testing.assert_close(got[0], ref, atol=2e-4, rtol=2e-4)
    # the same reference attending densely (no selection) gives other logits: the check above sees selection
    indexer = model.mtp.block.self_attn.indexer
    monkeypatch.setattr(indexer, "token_budget", 1024)
    monkeypatch.setattr(indexer, "block_topk", 256)
    _, dense = reference_drafts(model, req.tokens, 4)
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(dense, want_logits))


def test_drafting_is_batched_one_pass_per_draft_position():
    model = with_mtp(make_model("lin-idx", seed=22))
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, block_size=4,
                                        speculative=mtp_config(0)))
    reqs = [engine.requests[engine.add_request(p, max_new_tokens=20, eos_token_id=None)]
            for p in prompts_for(22, lengths=(9, 4, 13))]
    while any(len(r.generated) < 2 for r in reqs):
        engine.step()
    from hebrus_torch.engine.step_counts import PARTS

    class Parts(list):                     # the parts a step names (engine.step_counts labels each)
        seen: set = set()

        def append(self, part):
            self.seen.add(part)
            super().append(part)
    engine.runner.parts = Parts()
    engine.step()
    engine.runner.parts = None
    assert "mtp" in Parts.seen and Parts.seen <= set(PARTS)
    engine.mtp_drafter.min_pass_share = 0.0        # (every pass a draft asks for: no round cut short)
    alone = [engine.mtp_drafter.propose_batch([r], [k])[0] for r, k in zip(reqs, (3, 1, 2))]
    passes = engine.mtp_drafter.passes
    together = engine.mtp_drafter.propose_batch(reqs, [3, 1, 2])
    assert engine.mtp_drafter.passes - passes == 3
    assert together == alone and [len(d) for d in together] == [3, 1, 2]


def test_the_drafter_keeps_recent_streams_and_block_boundaries_only():
    """A sequence's kept pre-mixer streams stay bounded as it grows: the last MAX_DRAFT_TOKENS + 1 positions and
    the block boundaries (every position stayed before)."""
    from hebrus_torch.engine.speculative import MAX_DRAFT_TOKENS

    model = with_mtp(make_model("lin-idx", seed=24))
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, block_size=16,
                                        speculative=mtp_config(2)))
    req = engine.requests[engine.add_request(prompts_for(24, lengths=(10,))[0], max_new_tokens=70, eos_token_id=-1)]
    for _ in range(70):
        engine.step()
        if len(req.generated) >= 65:
            break
    assert len(req.generated) >= 65 and not req.status.is_done
    frontier = req.num_computed
    kept = [q for q in range(frontier) if engine.mtp_drafter.streams_at(req.seq, q) is not None]
    assert frontier - 1 in kept
    assert all(q >= frontier - 2 * (MAX_DRAFT_TOKENS + 1) or (q + 1) % 16 == 0 for q in kept)
    assert len(kept) <= 2 * (MAX_DRAFT_TOKENS + 1) + frontier // 16


# ------------------------------------------------------------------------------------------ exactness
def _steer(monkeypatch, prompts, ref, seed: int, rate: float = 0.6, wrong: float = 0.0):
    """Bias the MTP drafts towards the plain run's continuation at random positions (random MTP weights accept
    almost nothing), so that every accepted length occurs; the drafts still come from the MTP passes. With
    ``wrong``, at that share of the other positions towards another token (a confident draft that is
    rejected); elsewhere the random block's flat distribution (below a ``confidence_threshold`` of 0.5)."""
    rng = random.Random(seed)
    truth = {tuple(p): ref[f"r{i}"] for i, p in enumerate(prompts)}
    original = engine_mtp.target_scores

    def steered(logits, sampling, tokens, generated):
        scores, sampled = original(logits, sampling, tokens, generated)
        prompt = tuple(tokens[:len(tokens) - len(generated)])
        cont = truth.get(prompt, [])
        if len(generated) < len(cont):
            u = rng.random()
            if u < rate + wrong:
                scores = scores.clone()
                scores[(cont[len(generated)] + (0 if u < rate else 1)) % scores.shape[-1]] += 1e4
        return scores, sampled
    monkeypatch.setattr(engine_mtp, "target_scores", steered)


def assert_greedy_mtp_speculation_is_plain(model, prompts, monkeypatch,
                                           cases=((0, 16, 4, None), (1, 7, 6, [3, 1, 0, 2]), (2, None, 3, [2, 3, 0, 1]),
                                                  (3, 32, 8, None)), threshold: float = 0.0) -> None:
    """MTP speculation (each (seed, max_batch_tokens, k, arrival order) of ``cases``, drafts steered) gives the
    plain run's greedy tokens; every holder (the MTP layer included) the digests of an engine that writes the MTP
    layer without speculating, at every common frontier; the trunk's recurrent holders those of the plain engine.
    ``model.mtp`` is the block; ``prompts``: 4 of them. ``threshold``: the drafter's ``confidence_threshold``
    (above 0: some steered drafts are confidently wrong, the unsteered positions stop the drafts)."""
    plain_digests: dict = {}
    ref, _ = run(model, prompts, digests=plain_digests, max_new_tokens=14)
    layer_digests: dict = {}
    same, _ = run(model, prompts, spec=mtp_config(0), digests=layer_digests, max_new_tokens=14)
    assert same == ref
    stops = rides = 0                       # drafts the confidence rule ended before their length; rides
    for case, (seed, budget, k, order) in enumerate(cases):
        if case == 0:                       # rounds cut short by MTPDrafter.min_pass_share (the default): exact too
            pristine = engine_mtp.target_scores
            _steer(monkeypatch, prompts, ref, seed, wrong=0.25 if threshold else 0.0)
            digests = {}
            tokens, _ = run(model, prompts, spec=mtp_config(k, confidence_threshold=threshold), digests=digests,
                            max_batch_tokens=budget, max_new_tokens=14, order=order)
            common = set(digests) & set(layer_digests)
            assert tokens == ref and common and all(digests[key] == layer_digests[key] for key in common)
            monkeypatch.setattr(engine_mtp, "target_scores", pristine)
        monkeypatch.setattr(engine_mtp.MTPDrafter, "min_pass_share", 0.0)    # every pass a draft asks for
        _steer(monkeypatch, prompts, ref, seed, wrong=0.25 if threshold else 0.0)
        digests: dict = {}
        tokens, engine = run(model, prompts, spec=mtp_config(k, confidence_threshold=threshold), digests=digests,
                             max_batch_tokens=budget, max_new_tokens=14, order=order)
        assert tokens == ref, (seed, budget, k)
        c = engine.counters
        assert c.spec_verify_rows > 0 and 0 < c.spec_accepted_tokens < c.spec_drafted_tokens
        stops += sum(r.spec.confidence_stops for r in engine.requests.values())
        rides += c.spec_rides
        assert c.spec_confidence_stops == sum(r.spec.confidence_stops for r in engine.requests.values())
        assert c.spec_rollbacks > 0 and c.spec_drafter_errors == 0
        common = set(digests) & set(layer_digests)
        assert len(common) >= len(digests) // 2
        for key in common:                                   # every holder, the MTP layer included
            assert digests[key] == layer_digests[key], (seed, key)
        recurrent = len(engine.cache.holders) - 1            # the trunk's recurrent holders (PLE, GDN): all but QSA
        for key in set(digests) & set(plain_digests):
            assert digests[key][:recurrent] == plain_digests[key][:recurrent], (seed, key)
    assert (stops > 0) == (threshold > 0)
    assert rides > 0                        # (paused requests rode others' rounds, exactly too)


@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin"])
def test_greedy_mtp_speculation_gives_the_plain_tokens_and_state(shape, row_invariant, monkeypatch):
    model = with_mtp(eager_experts(make_model(shape, seed=23)))
    assert_greedy_mtp_speculation_is_plain(model, prompts_for(23, lengths=(14, 6, 21, 3)), monkeypatch)


def test_greedy_mtp_speculation_with_the_confidence_rule_gives_the_plain_tokens_and_state(row_invariant,
                                                                                           monkeypatch):
    model = with_mtp(eager_experts(make_model("lin-idx", seed=23)))
    assert_greedy_mtp_speculation_is_plain(model, prompts_for(23, lengths=(14, 6, 21, 3)), monkeypatch,
                                           cases=((0, 16, 4, None), (1, 7, 6, [3, 1, 0, 2])), threshold=0.5)


# ------------------------------------------------------------------------------------------ deferred block writes
def _written_rows(monkeypatch) -> list[int]:
    """The rows of every ``mtp_write`` call (the block's K/V written), appended as they run."""
    rows: list[int] = []
    original = engine_mtp.mtp_write

    def counting(step, trunk, mtp, streams, *args):
        rows.append(int(streams.shape[0]))
        return original(step, trunk, mtp, streams, *args)
    monkeypatch.setattr(engine_mtp, "mtp_write", counting)
    return rows


def _lockstep(model, prompt, monkeypatch, max_new_tokens: int = 40):
    """Two engines on one request whose random block's drafts are all rejected (so it backs off): one deferring
    the block's writes of its backed-off steps, one writing them in every step; both stepped once per yield."""
    engines = []
    for defer in (True, False):
        engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, block_size=4,
                                            speculative=mtp_config(2)))
        engine.mtp_drafter.defer_writes = defer
        engine.add_request(prompt, request_id="r", max_new_tokens=max_new_tokens, eos_token_id=None)
        engines.append(engine)
    return engines


def test_a_backed_off_request_defers_the_block_write_until_it_drafts_again(row_invariant, monkeypatch):
    """While a request whose drafts are rejected is backed off, its decode steps write none of the block's entries
    (every trunk step wrote every row's before); they wait, and are written in one packed write when it drafts
    again: at every frontier the cache, once caught up, is bitwise the always-writing engine's."""
    model = with_mtp(eager_experts(make_model("lin-idx", seed=29)))
    rows = _written_rows(monkeypatch)
    lazy, eager = _lockstep(model, prompts_for(29, lengths=(11,))[0], monkeypatch)
    quiet = most = 0
    written = {True: 0, False: 0}
    while lazy.has_unfinished():
        del rows[:]
        lazy.step()
        quiet += not rows
        written[True] += sum(rows)
        del rows[:]
        eager.step()
        written[False] += sum(rows)
        a, b = lazy.requests["r"], eager.requests["r"]
        assert a.generated == b.generated
        if a.status.is_done:
            break
        most = max(most, len(lazy.mtp_drafter.pending_positions(a.seq)))
        assert caught_up_digests(lazy, a.seq) == tuple(h.digest(b.seq) for h in eager.cache.holders)
    assert a.spec.verify_steps >= 3 and a.spec.accepted_tokens == 0        # (drafted again after each back-off)
    assert quiet >= 10 and most >= 15
    assert lazy.mtp_drafter.caught_up >= 3 + 15 and eager.mtp_drafter.caught_up == 0
    assert written[True] < written[False] - 10


def test_backed_off_requests_decoding_together_defer_without_a_write_and_catch_up_exactly(row_invariant,
                                                                                           monkeypatch):
    """Several requests backed off together: their steps' rows are all deferred decode rows (the drafter stages
    them without a write or an index list: ``_defer_all``), while steps that also prefill another request's chunk
    defer some rows and write the others; at every frontier each request's cache, once caught up, is bitwise the
    always-writing engine's, and the tokens are the same."""
    model = with_mtp(eager_experts(make_model("lin-idx", seed=32)))
    rows = _written_rows(monkeypatch)
    together = []
    original = engine_mtp.MTPDrafter._defer_all

    def counting(self, seqs, *args):
        together.append(len(seqs))
        return original(self, seqs, *args)
    monkeypatch.setattr(engine_mtp.MTPDrafter, "_defer_all", counting)
    prompts = prompts_for(32, lengths=(5, 9, 26))
    engines = []
    for defer in (True, False):
        engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=4, block_size=4, max_batch_tokens=8,
                                            speculative=mtp_config(2)))
        engine.mtp_drafter.defer_writes = defer
        for i, p in enumerate(prompts):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=30, eos_token_id=None)
        engines.append(engine)
    lazy, eager = engines
    mixed = 0
    while lazy.has_unfinished():
        del rows[:]
        before = len(together)
        lazy.step()
        mixed += bool(rows) and len(together) == before and any(
            r.seq is not None and lazy.mtp_drafter.pending_positions(r.seq) for r in lazy.scheduler.running)
        eager.step()
        for rid, a in lazy.requests.items():
            b = eager.requests[rid]
            assert a.generated == b.generated
            if a.seq is not None and not a.status.is_done:
                assert caught_up_digests(lazy, a.seq) == tuple(h.digest(b.seq) for h in eager.cache.holders)
    assert not eager.has_unfinished()
    assert max(together) >= 2 and len(together) >= 10 and mixed >= 1
    assert lazy.mtp_drafter.caught_up > 0 and eager.mtp_drafter.caught_up == 0


def _with_deferred_entries(seed: int, monkeypatch, count: int = 5):
    """The lockstep pair (:func:`_lockstep`) on one 9-token prompt, stepped until the deferring engine holds
    ``count`` deferred block entries: (model, lazy, eager, lazy's request, eager's request, the always-writing
    engine's digests of its sequence), the lazy cache's digests checked to differ (zeros until caught up)."""
    model = with_mtp(eager_experts(make_model("lin-idx", seed=seed)))
    lazy, eager = _lockstep(model, prompts_for(seed, lengths=(9,))[0], monkeypatch)
    a, b = lazy.requests["r"], eager.requests["r"]
    while len(lazy.mtp_drafter.pending_positions(a.seq)) < count:
        lazy.step()
        eager.step()
        assert not a.status.is_done
    want = tuple(h.digest(b.seq) for h in eager.cache.holders)
    assert tuple(h.digest(a.seq) for h in lazy.cache.holders) != want
    return model, lazy, eager, a, b, want


def test_a_fork_carries_the_deferred_block_entries_and_a_save_writes_them_first(row_invariant, monkeypatch):
    _, lazy, eager, a, b, want = _with_deferred_entries(30, monkeypatch)
    pending = lazy.mtp_drafter.pending_positions(a.seq)
    child = lazy.cache.fork(a.seq)
    assert lazy.mtp_drafter.pending_positions(child) == pending
    data = lazy.cache.save(child)                        # writes the child's deferred entries first
    assert lazy.mtp_drafter.pending_positions(child) == []
    restored = lazy.cache.restore(data)
    assert tuple(h.digest(restored) for h in lazy.cache.holders) == want
    assert tuple(h.digest(child) for h in lazy.cache.holders) == want
    assert caught_up_digests(lazy, a.seq) == want
    lazy.cache.free(restored)
    lazy.cache.free(child)
    lazy.run()
    eager.run()
    assert a.generated == b.generated


def test_the_cache_s_state_dict_writes_the_deferred_block_entries_first(row_invariant, monkeypatch):
    """``ModelCache.state_dict`` of an MTP engine's cache catches up the entries the backed-off steps deferred (they
    were zeros in it before): the state it returns, loaded into a cache of the same build, holds the always-writing
    engine's state, and the run goes on to the same tokens."""
    model, lazy, eager, a, b, want = _with_deferred_entries(33, monkeypatch)
    written = lazy.mtp_drafter.caught_up
    state = lazy.cache.state_dict()
    assert lazy.mtp_drafter.pending_positions(a.seq) == []
    assert lazy.mtp_drafter.caught_up >= written + 5
    assert tuple(h.digest(a.seq) for h in lazy.cache.holders) == want
    other = engine_mtp.mtp_model_cache(model, engine_mtp.mtp_module(model), capacity_tokens=256, max_sequences=4)
    other.load_state_dict(state)
    assert tuple(h.digest(a.seq) for h in other.holders) == want
    lazy.run()
    eager.run()
    assert a.generated == b.generated


def test_an_engine_s_cache_refuses_a_state_dict_and_keeps_its_state(row_invariant, monkeypatch):
    """A state dict loaded into a running engine's cache would give the handles of its requests, its kept prompts
    and the drafter's streams and deferred entries other sequences: refused (directly and through a parent
    module), naming the engine, with nothing changed; the run goes on to the same tokens."""
    _, lazy, eager, a, b, want = _with_deferred_entries(34, monkeypatch)
    state = eager.cache.state_dict()
    before = tuple(h.digest(a.seq) for h in lazy.cache.holders)
    pending = lazy.mtp_drafter.pending_positions(a.seq)
    parent = torch.nn.Module()
    parent.cache = lazy.cache
    for load, given in ((lazy.cache.load_state_dict, state),
                        (parent.load_state_dict, {f"cache.{k}": v for k, v in state.items()})):
        with pytest.raises(HebrusError, match="run by an Engine"):
            load(given)
        assert tuple(h.digest(a.seq) for h in lazy.cache.holders) == before
        assert lazy.mtp_drafter.pending_positions(a.seq) == pending
    with pytest.raises(HebrusError, match="already run by an Engine"):
        Engine(lazy.model, lazy.config, cache=lazy.cache)
    lazy.run()
    eager.run()
    assert a.generated == b.generated


def test_a_request_that_does_not_draft_again_writes_its_deferred_block_entries_every_max_pending_steps(
        row_invariant, monkeypatch):
    """What is deferred stays bounded: a request backed off for good has at most ``MAX_PENDING`` block entries
    waiting; then they are written in one packed write (not one per step), and the cache is the always-writing
    engine's once caught up."""
    monkeypatch.setattr(engine_mtp, "MAX_PENDING", 5)
    model = with_mtp(eager_experts(make_model("lin-idx", seed=31)))
    rows = _written_rows(monkeypatch)
    lazy, eager = _lockstep(model, prompts_for(31, lengths=(7,))[0], monkeypatch, max_new_tokens=30)
    a, b = lazy.requests["r"], eager.requests["r"]
    while not a.generated:                                      # (the prompt, in chunks)
        lazy.step()
        eager.step()
    a.spec.pause = b.spec.pause = 10 ** 6
    seen = []                  # per step: the entries deferred after it, the lazy engine's writes in it
    while len(seen) < 20:
        del rows[:]
        lazy.step()
        seen.append((len(lazy.mtp_drafter.pending_positions(a.seq)) if a.seq is not None else None, list(rows)))
        eager.step()
        assert a.generated == b.generated
        if a.status.is_done:
            break
        assert caught_up_digests(lazy, a.seq) == tuple(h.digest(b.seq) for h in eager.cache.holders)
    assert len(seen) >= 11
    assert [n for n, _ in seen[:10]] == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    assert [w for _, w in seen[:11]] == [[], [], [], [], [], [5], [], [], [], [], [5]]


def test_drafts_after_a_catch_up_equal_those_of_the_always_written_block(row_invariant, monkeypatch):
    """The drafts (every ``propose_batch`` answer) of an engine that defers the block's writes of backed-off steps
    are those of one that writes them in every step, under continuous batching with steered acceptance."""
    model = with_mtp(eager_experts(make_model("lin-idx", seed=23)))
    prompts = prompts_for(23, lengths=(14, 6, 21, 3))
    ref, _ = run(model, prompts, max_new_tokens=14)
    pristine, original = engine_mtp.target_scores, engine_mtp.MTPDrafter.propose_batch
    drafted, caught = {}, {}
    for defer in (True, False):
        seen = drafted[defer] = []

        def recording(self, requests, lengths, _seen=seen):
            out = original(self, requests, lengths)
            _seen.append([(r.request_id, len(r.tokens), list(d)) for r, d in zip(requests, out)])
            return out
        monkeypatch.setattr(engine_mtp.MTPDrafter, "propose_batch", recording)
        monkeypatch.setattr(engine_mtp.MTPDrafter, "defer_writes", defer)
        monkeypatch.setattr(engine_mtp, "target_scores", pristine)
        _steer(monkeypatch, prompts, ref, 1)
        tokens, engine = run(model, prompts, spec=mtp_config(3), max_new_tokens=14, max_batch_tokens=16)
        assert tokens == ref
        caught[defer] = engine.mtp_drafter.caught_up
    assert drafted[True] == drafted[False] and len(drafted[True]) > 5
    assert caught[True] > 0 and caught[False] == 0


# ------------------------------------------------------------------------------------------ the confidence rule
def _scripted(monkeypatch, confident: dict[int, int], token: int = 7) -> dict[int, int]:
    """The drafter's (greedy) distribution made sure of ``token`` at the first ``confident[t]`` draft positions of
    the request whose prompt starts with t, flat (the random block's) after; returns the dict to fill with each
    such request's token count before drafting."""
    base: dict[int, int] = {}
    original = engine_mtp.target_scores

    def scripted(logits, sampling, tokens, generated):
        scores, sampled = original(logits, sampling, tokens, generated)
        if len(tokens) - base[tokens[0]] < confident[tokens[0]]:
            scores = scores.clone()
            scores[token] += 1e4
        return scores, scores
    monkeypatch.setattr(engine_mtp, "target_scores", scripted)
    return base


def test_the_confidence_rule_ends_each_draft_and_the_round(monkeypatch):
    """A request's draft ends at its first position below ``confidence_threshold`` (that token still proposed, no
    later one drafted); the round stops when every request has ended, so it runs as many passes as the longest
    draft; ``SpecState.confidence_stops`` counts the drafts ended before their length. With the rule off the
    same block drafts every position, the same tokens first."""
    from hebrus_torch.engine.drafting import propose_drafts

    model = with_mtp(make_model("lin-idx", seed=28))
    prompts = [[11, 5, 6, 7], [12, 5, 6, 7, 8], [13, 9, 20]]
    confident = {11: 2, 12: 1, 13: 0}
    drafts = {}
    for threshold in (0.5, 0.0):
        engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, block_size=4,
                                            speculative=mtp_config(4, confidence_threshold=threshold)))
        engine.mtp_drafter.min_pass_share = 0.0    # (rounds as long as their longest draft)
        reqs = [engine.requests[engine.add_request(p, max_new_tokens=20, eos_token_id=None)] for p in prompts]
        while any(not r.generated for r in reqs):
            engine.step()
        base = _scripted(monkeypatch, confident)
        base.update({r.tokens[0]: len(r.tokens) for r in reqs})
        passes = engine.mtp_drafter.passes
        drafts[threshold] = engine.mtp_drafter.propose_batch(reqs, [4, 4, 4])
        assert engine.mtp_drafter.passes - passes == (3 if threshold else 4)
        if threshold:
            assert engine.mtp_drafter.stopped == {reqs[0]: 3, reqs[1]: 2, reqs[2]: 1}
            for r in reqs:                  # (the flat block's first steps backed off: start afresh)
                r.spec = SpecState()
            got = propose_drafts(engine.scheduler.running, None, vocab_size=engine.vocab_size, capacity_tokens=256,
                                 stop_speculating=lambda r, why: None, mtp_drafter=engine.mtp_drafter)
            assert [len(got[r]) for r in reqs] == [2, 2, 1]        # (the adaptive first length: 2)
            assert [r.spec.confidence_stops for r in reqs] == [0, 0, 1]
        monkeypatch.undo()
    assert [d[:c] for d, c in zip(drafts[0.5], (2, 1, 0))] == [[7, 7], [7], []]
    assert [len(d) for d in drafts[0.5]] == [3, 2, 1]
    assert [len(d) for d in drafts[0.0]] == [4, 4, 4]
    assert [d[:len(e)] for d, e in zip(drafts[0.0], drafts[0.5])] == drafts[0.5]


def test_a_round_ends_when_too_few_of_its_requests_still_draft(monkeypatch):
    """``MTPDrafter.min_pass_share``: the round's next pass runs only while the requests still drafting are at least
    that share of the round's; the drafts of those left end where the round does (the same tokens first). Off (0):
    as many passes as the longest confident draft."""
    model = with_mtp(make_model("lin-idx", seed=28))
    prompts = [[11, 5, 6, 7], [12, 5, 6, 7, 8], [13, 9, 20]]
    got = {}
    for share in (0.0, 0.5, 0.7):
        engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, block_size=4,
                                            speculative=mtp_config(4, confidence_threshold=0.5)))
        engine.mtp_drafter.min_pass_share = share
        reqs = [engine.requests[engine.add_request(p, max_new_tokens=20, eos_token_id=None)] for p in prompts]
        while any(not r.generated for r in reqs):
            engine.step()
        base = _scripted(monkeypatch, {11: 3, 12: 1, 13: 0})
        base.update({r.tokens[0]: len(r.tokens) for r in reqs})
        passes = engine.mtp_drafter.passes
        got[share] = (engine.mtp_drafter.propose_batch(reqs, [4, 4, 4]), engine.mtp_drafter.passes - passes)
        monkeypatch.undo()
    (full, n_full), (half, n_half), (most, n_most) = got[0.0], got[0.5], got[0.7]
    assert [len(d) for d in full] == [4, 2, 1] and n_full == 4
    assert [len(d) for d in half] == [2, 2, 1] and n_half == 2      # (pass 2 had 1 of 3 going on: < 1.5)
    assert [len(d) for d in most] == [1, 1, 1] and n_most == 1      # (pass 1 had 2 of 3 going on: < 2.1)
    assert all(d == f[:len(d)] for d, f in zip(half + most, full + full))


@pytest.mark.parametrize("name", ["confidence_threshold", "first_token_threshold"])
@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), "0.5", True, None])
def test_a_bad_confidence_threshold_is_refused(bad, name):
    with pytest.raises(BadRequestError, match=name):
        SpeculativeConfig(2, method="mtp", **{name: bad})
    assert issubclass(BadRequestError, HebrusError)
    assert getattr(SpeculativeConfig(2, method="mtp", **{name: 0}), name) == 0


def test_an_unsure_first_token_proposes_nothing_and_counts_as_a_miss():
    """A round whose first drafted token is below ``first_token_threshold`` (the random block's flat distribution
    against 0.5) proposes nothing: no verification row, the tokens of plain decoding, and the back-off of a miss
    (pauses 3, 15: 3 rounds in 65 tokens, 4 and 16 steps apart). With the rule off the same block's first tokens
    are proposed and rejected, in rounds as far apart."""
    model = with_mtp(make_model("lin-idx", seed=29))
    prompt = prompts_for(29, lengths=(7,))[0]
    generated = []
    assert SpeculativeConfig(4, method="mtp").first_token_threshold == 0.02
    for first in (None, 0.5, 0.0):
        spec = None if first is None else mtp_config(4, first_token_threshold=first)
        engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, block_size=4, speculative=spec))
        req = engine.requests[engine.add_request(prompt, max_new_tokens=65, eos_token_id=None)]
        passes = []
        while engine.has_unfinished():
            before = getattr(engine.mtp_drafter, "passes", 0)
            engine.step()
            passes.append(getattr(engine.mtp_drafter, "passes", 0) - before)
        generated.append(req.generated)
        assert len(req.generated) == 65 and req.generated == generated[0]
        if first is None:
            continue
        c = engine.counters
        rounds = [i for i, n in enumerate(passes) if n]
        assert [b - a for a, b in zip(rounds, rounds[1:])] == [4, 16]
        if first:
            assert (c.spec_drafted_tokens, c.spec_verify_rows, req.spec.drafted_tokens) == (0, 0, 0)
            assert c.spec_unsure_rounds == req.spec.unsure_rounds == 3 and req.spec.misses == 3
        else:
            assert c.spec_unsure_rounds == 0
            assert c.spec_drafted_tokens > 0 and c.spec_accepted_tokens == 0 and c.spec_verify_rows == 3


def test_an_unsure_round_is_a_miss_without_a_verification():
    cfg = SpeculativeConfig(3, method="mtp")
    spec = SpecState()
    pauses = []
    for _ in range(4):
        spec.unsure_round(cfg)
        pauses.append(spec.pause)
    assert pauses == [3, 15, 63, 63] and spec.misses == 4 and spec.unsure_rounds == 4
    assert (spec.drafted_tokens, spec.verify_steps) == (0, 0)
    spec.update(cfg, 2, 1)                    # a verification that accepted something ends the run of misses
    assert (spec.misses, spec.length) == (0, 2)
    fixed = SpecState()
    fixed.unsure_round(SpeculativeConfig(3, method="mtp", adaptive=False))
    assert (fixed.pause, fixed.misses, fixed.unsure_rounds) == (0, 0, 1)


def test_a_paused_request_rides_a_round_others_draft_in():
    """A request in its back-off pause joins (rides) the round of a request that drafts, with its adaptive length
    but at least 2; with every request paused nobody drafts and no pass runs. A ride that accepts nothing
    leaves the pause counting down (no miss more); one that accepts something ends it; an unsure ride is no miss."""
    from hebrus_torch.engine.config import EngineCounters
    from hebrus_torch.engine.drafting import propose_drafts

    model = with_mtp(make_model("lin-idx", seed=30))
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=4, block_size=4,
                                        speculative=mtp_config(4)))
    engine.mtp_drafter.min_pass_share = 0.0        # (the rider's 2 drafts do not cut the other's 4 short)
    reqs = [engine.requests[engine.add_request(p, max_new_tokens=20, eos_token_id=None)]
            for p in prompts_for(30, lengths=(6, 9))]
    while any(not r.generated for r in reqs):
        engine.step()

    def propose(counters):
        passes = engine.mtp_drafter.passes
        got = propose_drafts(engine.scheduler.running, None, vocab_size=engine.vocab_size, capacity_tokens=256,
                             stop_speculating=lambda r, why: None, mtp_drafter=engine.mtp_drafter, counters=counters)
        return {reqs.index(r): len(d) for r, d in got.items()}, engine.mtp_drafter.passes - passes

    counters = EngineCounters()
    reqs[0].spec, reqs[1].spec = SpecState(length=4), SpecState(length=1, misses=1, pause=3)
    assert propose(counters) == ({0: 4, 1: 2}, 4)
    assert (reqs[1].spec.riding, reqs[1].spec.rides, counters.spec_rides) == (True, 1, 1)
    assert (reqs[0].spec.riding, reqs[1].spec.pause) == (False, 2)
    reqs[1].spec.update(reqs[1].speculative, 2, 0)         # a missed ride: no miss more, the pause goes on
    assert (reqs[1].spec.misses, reqs[1].spec.pause, reqs[1].spec.length, reqs[1].spec.riding) == (1, 2, 1, False)
    reqs[0].spec.pause = 5                                 # everybody paused: no round, nobody rides
    assert propose(counters) == ({}, 0)
    assert (reqs[1].spec.pause, counters.spec_rides) == (1, 1)
    reqs[0].spec.pause = 0
    assert propose(counters)[0] == {0: 4, 1: 2} and reqs[1].spec.pause == 0
    reqs[1].spec.pause = 3
    reqs[1].spec.update(reqs[1].speculative, 2, 1)         # a ride that accepted something ends the pause
    assert (reqs[1].spec.misses, reqs[1].spec.pause, reqs[1].spec.length) == (0, 0, 2)
    reqs[1].spec = SpecState(length=1, misses=2, pause=9, riding=True)
    reqs[1].spec.unsure_round(reqs[1].speculative)          # an unsure ride: no miss either
    assert (reqs[1].spec.misses, reqs[1].spec.pause, reqs[1].spec.unsure_rounds) == (2, 9, 1)


def test_sampled_mtp_speculation_is_reproducible_and_drafts_with_its_distribution(monkeypatch):
    model = with_mtp(make_model("lin-idx", seed=24))
    prompts = prompts_for(24, lengths=(9, 5, 12))
    asked = []
    original = engine_mtp.MTPDrafter.draft_probs

    def draft_probs(self, request, n):
        q = original(self, request, n)
        asked.append(q)
        return q
    monkeypatch.setattr(engine_mtp.MTPDrafter, "draft_probs", draft_probs)
    sampling = SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=5)
    a, ea = run(model, prompts, spec=mtp_config(3), sampling=sampling, max_new_tokens=10)
    b, _ = run(model, prompts, spec=mtp_config(3), sampling=sampling, max_new_tokens=10)
    assert a == b
    assert ea.counters.spec_drafted_tokens > 0
    assert asked and all(q is not None and q.shape[-1] == model.config.vocab_size for q in asked)
    assert not ea.mtp_drafter._probs and not ea.mtp_drafter._generators     # released with the requests


def test_sampled_mtp_speculation_with_the_confidence_rule_gives_the_verifier_one_q_per_draft(monkeypatch):
    """Sampled requests under the rule: the distribution drafts are drawn from is sure of a token at random
    positions, flat elsewhere (stopped); the verifier gets one q row per drafted token, runs reproduce."""
    model = with_mtp(make_model("lin-idx", seed=24))
    prompts = prompts_for(24, lengths=(9, 5, 12))
    rng = random.Random(3)
    original = engine_mtp.target_scores

    def sure_at_times(logits, sampling, tokens, generated):
        scores, sampled = original(logits, sampling, tokens, generated)
        if rng.random() < 0.7:
            sampled = sampled.clone()
            sampled[rng.randrange(4, 50)] += 1e4
        return scores, sampled
    monkeypatch.setattr(engine_mtp, "target_scores", sure_at_times)
    shapes = []
    original_probs = engine_mtp.MTPDrafter.draft_probs

    def draft_probs(self, request, n):
        q = original_probs(self, request, n)
        shapes.append((n, None if q is None else q.shape[0]))
        return q
    monkeypatch.setattr(engine_mtp.MTPDrafter, "draft_probs", draft_probs)
    sampling = SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=5)
    got = []
    for _ in range(2):
        rng.seed(3)
        tokens, engine = run(model, prompts, spec=mtp_config(3, confidence_threshold=0.5, adaptive=False),
                             sampling=sampling, max_new_tokens=10)
        got.append(tokens)
        assert engine.counters.spec_drafted_tokens > 0
        assert sum(r.spec.confidence_stops for r in engine.requests.values()) > 0
    assert got[0] == got[1]
    assert shapes and all(n == rows for n, rows in shapes)


# ------------------------------------------------------------------------------------------ refusals
def test_a_model_without_an_mtp_block_is_refused_at_start():
    model = make_model("lin-idx", seed=25)
    with pytest.raises(HebrusError, match="MTP block"):
        Engine(model, EngineConfig(capacity_tokens=64, max_sequences=2, speculative=mtp_config(2)))
    plain = Engine(model, EngineConfig(capacity_tokens=64, max_sequences=2))
    with pytest.raises(BadRequestError, match="method 'mtp'"):
        plain.add_request([5, 6, 7], speculative=mtp_config(2))
    assert not plain.requests and not plain.has_unfinished()
    with pytest.raises(BadRequestError, match="method must be one of"):
        SpeculativeConfig(2, method="eagle")


def test_the_checkpoint_s_mtp_block_loads_lazily_and_drafts(tmp_path):
    from hebrus_torch.loading import from_pretrained
    from hebrus_torch.testing import write_checkpoint

    config = tiny_indexer_config()
    write_checkpoint(tmp_path / "full", config, seed=3, dtype=torch.float32, mtp_block=True, tokenizer=False)
    model = from_pretrained(tmp_path / "full")
    assert getattr(model, "mtp", None) is None and len(model.hebrus_checkpoint.mtp) > 4
    engine = Engine(model, EngineConfig(capacity_tokens=128, max_sequences=2, speculative=mtp_config(3)))
    want = random_mtp(model.config, 4).state_dict()            # (write_checkpoint's MTP block: seed + 1)
    got = model.mtp.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert model.mtp.fc_embedding.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    engine.add_request([5, 6, 7, 8, 9], max_new_tokens=6, eos_token_id=None)
    engine.run()
    assert engine.counters.spec_drafted_tokens > 0

    write_checkpoint(tmp_path / "partial", config, seed=3, dtype=torch.float32, tokenizer=False)  # 4 mtp keys
    write_checkpoint(tmp_path / "none", config, seed=3, dtype=torch.float32, tokenizer=False, mtp=False)
    for name, match in (("partial", "MTP block .*mtp"), ("none", "no mtp")):
        model = from_pretrained(tmp_path / name)
        with pytest.raises(HebrusError, match=match):
            Engine(model, EngineConfig(capacity_tokens=64, max_sequences=2, speculative=mtp_config(2)))


def test_generate_batch_speculates_with_the_mtp_block():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from hebrus_torch.integrations import transformers as htx

    model = with_mtp(make_model("lin-idx", seed=26))
    prompts = prompts_for(26, lengths=(7, 12, 4))
    cb = ContinuousBatchingConfig(max_batch_tokens=32, page_size=4)
    htx.apply(model)
    try:
        outs, counters = [], []
        for extra in ({}, {"speculative_method": "mtp", "num_assistant_tokens": 3,
                           "assistant_confidence_threshold": 0.0}):
            gc = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=EOS, pad_token_id=0, **extra)
            tokens, engine_counters = generate_batch_once(model, prompts, gc, cb)
            outs.append(tokens)
            counters.append(engine_counters)
        assert outs[1] == outs[0]
        assert counters[0].spec_verify_rows == 0 and counters[1].spec_drafted_tokens > 0
    finally:
        htx.revert(model)


@pytest.mark.parametrize("fault_at", [2, 5])
def test_mtp_speculation_under_preemption_faults_and_cancellation(fault_at, monkeypatch):
    model = with_mtp(make_model("lin-idx", seed=27))
    prompts = prompts_for(27, lengths=(20, 18, 22, 16))
    ref, _ = run(model, prompts, max_new_tokens=12, capacity_tokens=4096)
    _steer(monkeypatch, prompts, ref, 0)
    tokens, engine = run(model, prompts, spec=mtp_config(4), max_new_tokens=12, capacity_tokens=90,
                         max_batch_tokens=32)                       # (drafting too runs out of cells at times)
    assert tokens == ref
    assert engine.counters.preemptions > 0 and engine.counters.spec_accepted_tokens > 0
    calls = {"n": 0}
    original = engine_mtp.mtp_write

    def faulty(*args):                # a fault inside a step's MTP write: the step is rolled back and retried
        calls["n"] += 1
        if calls["n"] == fault_at:
            raise RuntimeError("injected fault in the MTP write")
        return original(*args)
    monkeypatch.setattr(engine_mtp, "mtp_write", faulty)
    engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=4, max_batch_tokens=32,
                                        speculative=mtp_config(4, adaptive=False)))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=12, eos_token_id=EOS)
    for _ in range(4):
        engine.step()
    engine.cancel("r1")
    engine.run()
    assert calls["n"] > fault_at and engine.counters.retried_steps == 1
    assert engine.requests["r1"].status is RequestStatus.CANCELLED
    assert {r: q.generated for r, q in engine.requests.items() if r != "r1"} == {r: t for r, t in ref.items()
                                                                                 if r != "r1"}
    assert len(engine.cache.slots.live_handles()) == len(engine.kept_sequences())


def test_the_benchmark_trains_the_draft_the_drafter_runs(monkeypatch):
    """bench_mtp.py's unrolled training forward (``unrolled_logits``: every frontier's chain of 3 draft steps at
    once, the earlier steps' K/V kept) gives, for the chain at the prompt's frontier fed the drafted tokens,
    the reference block's logits at each draft position (both attending densely)."""
    import bench_mtp

    model = with_mtp(make_model("lin-idx", seed=21))
    indexer = model.mtp.block.self_attn.indexer
    monkeypatch.setattr(indexer, "token_budget", 1024)
    monkeypatch.setattr(indexer, "block_topk", 256)
    tokens = prompts_for(21, lengths=(13,))[0]
    drafts, want = reference_drafts(model, tokens, 3)
    seq = tokens + drafts + [5]
    h = trunk_streams(model, seq)
    monkeypatch.setattr(indexer, "forward", lambda hidden, pe, mask, cache: mask)     # (sdpa: a bool mask)
    with torch.no_grad():
        got = bench_mtp.unrolled_logits(model, model.mtp, torch.cat([torch.zeros_like(h[:1]), h[:-1]])[None],
                                        torch.tensor([seq]), len(tokens) - 1, 3)
    assert [g.shape[1] for g in got] == [4, 3, 2]
    for g, w in zip(got, want):
        torch.testing.assert_close(g[0, 0], w, atol=2e-5, rtol=2e-5)
