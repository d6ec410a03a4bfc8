"""Speculative decoding in the engine (issue 26): drafting, verification in the packed step, exact rollback.

- ``ModelCache.truncate``: a step that fed n tokens and kept m is, in every holder, bitwise the step that fed m;
- greedy requests get exactly the tokens of the plain engine, and with the row-invariant layers of
  test_engine.py bitwise the same holder digests at every frontier both runs reach, whatever the
  drafts (an oracle drafter that proposes the true continuation with errors at random places, so
  every accepted length occurs), the budget, and what else shares the step;
- rejection sampling keeps the target distribution (``verify_rows`` on a small vocabulary);
- faults, preemption, cancellation and the prefix cache keep working with speculation on.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from hf_models import modeling  # noqa: F401  (skips without transformers)
from test_engine import EOS, eager_experts, make_model, prompts_for, row_invariant  # noqa: F401

from hebrus_torch.engine import BadRequestError, Engine, EngineConfig, RequestStatus, SamplingParams
from hebrus_torch.engine.speculative import (NgramIndex, SpecState, SpeculativeConfig, prompt_lookup, target_scores,
                                              verify_rows)
from hebrus_torch.errors import HebrusError


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def oracle(reference: dict[str, list[int]], seed: int, error_rate: float = 0.35, vocab: int = 50, key=None):
    """A drafter that proposes each request's true continuation (from a plain run; ``key`` maps a request id
    to its reference's) with errors at random positions, so that every number of accepted drafts occurs."""
    rng = random.Random(seed)

    def draft(req, k):
        rid = req.request_id if key is None else key(req.request_id)
        truth = reference[rid][len(req.generated):len(req.generated) + k]
        return [t if rng.random() > error_rate else (t + 1 + rng.randrange(vocab - 1)) % vocab for t in truth]
    return draft


def run(model, prompts, *, spec=None, drafter=None, draft_model=None, max_new_tokens=12, sampling=None,
        digests=None, digest=None, **config):
    """Each prompt's greedy tokens and the engine; ``digests`` gets every running request's holders' digests after
    each step, by ``(request id, frontier)`` (``digest(engine, seq)`` gives them where set)."""
    cfg = dict(capacity_tokens=1024, max_sequences=8, max_batch_tokens=16, block_size=4)
    cfg.update(config)
    engine = Engine(model, EngineConfig(**cfg), drafter=drafter, draft_model=draft_model)
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=max_new_tokens, eos_token_id=EOS,
                           speculative=spec, sampling=sampling)
    while engine.has_unfinished():
        engine.step()
        if digests is not None:
            for req in engine.scheduler.running:
                if req.seq is not None:
                    digests[(req.request_id, req.num_computed)] = (
                        digest(engine, req.seq) if digest is not None else
                        tuple(h.digest(req.seq) for h in engine.cache.holders))
    assert all(r.status is RequestStatus.FINISHED for r in engine.requests.values()), \
        [(r.request_id, r.error) for r in engine.requests.values()]
    return {rid: r.generated for rid, r in engine.requests.items()}, engine


# ------------------------------------------------------------------------------------------ drafting
def test_ngram_index_equals_prompt_lookup_on_growing_streams():
    rng = random.Random(0)
    for trial in range(30):
        index = NgramIndex(max_ngram=3, min_ngram=1)
        stream = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        for _ in range(40):
            k = rng.randrange(0, 5)
            assert index.propose(stream, k) == prompt_lookup(stream, k, 3, 1), (trial, stream, k)
            stream += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_prompt_lookup_follows_the_latest_occurrence():
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 4, 7, 1, 2], 2) == [4, 7]
    assert prompt_lookup([5, 6, 7], 3) == []
    assert prompt_lookup([1, 2, 1], 2) == [2, 1]


def test_adaptive_length_backs_off_after_misses():
    cfg = SpeculativeConfig(6)
    st = SpecState()
    assert st.next_length(cfg) == 2
    st.update(cfg, 2, 2)
    assert st.next_length(cfg) == 4
    st.update(cfg, 4, 4)
    assert st.next_length(cfg) == 6
    st.update(cfg, 6, 2)
    assert st.next_length(cfg) == 3
    verified_at = []
    for step in range(300):                       # never accepted: ever rarer verifications
        k = st.next_length(cfg)
        if k:
            verified_at.append(step)
            st.update(cfg, k, 0)
    assert verified_at == [0, 4, 20, 84, 148, 212, 276]       # pauses of 3, 15, then 63 steps


@pytest.mark.parametrize("bad", [dict(num_draft_tokens=-1), dict(num_draft_tokens=33), dict(num_draft_tokens=True),
                                 dict(num_draft_tokens=2, min_ngram=0), dict(num_draft_tokens=2, max_ngram=0),
                                 dict(num_draft_tokens=2, adaptive=1), dict(num_draft_tokens=2, disable_by_batch_size=0),
                                 dict(num_draft_tokens=2, disable_by_batch_size=2.0)])
def test_bad_speculative_configs_are_refused(bad):
    with pytest.raises(BadRequestError, match="SpeculativeConfig"):
        SpeculativeConfig(**bad)


# ------------------------------------------------------------------------------------------ the cache
@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin"])
def test_truncate_leaves_every_holder_as_if_only_the_kept_tokens_were_fed(shape, row_invariant):
    model = eager_experts(make_model(shape, seed=11))
    prompt = prompts_for(11, lengths=(13,))[0]
    extra = [7, 19, 23, 5, 41, 8]
    for keep in range(1, len(extra) + 1):
        engines = [Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2, max_batch_tokens=None))
                   for _ in range(2)]
        seqs = []
        for engine in engines:
            seq = engine.cache.new_sequence()
            engine.runner.execute([seq], [prompt], [True], [0])
            seqs.append(seq)
        (a, sa), (b, sb) = (engines[0], seqs[0]), (engines[1], seqs[1])
        with a.cache.recording({sa: len(extra)}) as rec:
            a.runner.execute([sa], [extra], [len(extra)], [len(prompt)])
        a.cache.truncate(rec, {sa: keep})
        b.runner.execute([sb], [extra[:keep]], [True], [len(prompt)])
        assert [h.digest(sa) for h in a.cache.holders] == [h.digest(sb) for h in b.cache.holders], keep
        # and both continue alike
        la = a.runner.execute([sa], [[9, 9]], [2], [len(prompt) + keep])
        lb = b.runner.execute([sb], [[9, 9]], [2], [len(prompt) + keep])
        assert torch.equal(la, lb), keep


def test_truncate_after_other_sequences_ran_a_step(row_invariant):
    """The recorded rows are the GDN undo log's own buffers: the holder must not recycle them for a later step
    before the recording is released (a step of other sequences in between overwrote them when it did)."""
    model = eager_experts(make_model("lin-idx", seed=16))
    prompt, other = prompts_for(16, lengths=(11, 11))
    extra = [7, 19, 23, 5]
    engines = [Engine(model, EngineConfig(capacity_tokens=256, max_sequences=3, max_batch_tokens=None))
               for _ in range(2)]
    seqs = []
    for engine in engines:
        s, o = engine.cache.new_sequence(), engine.cache.new_sequence()
        engine.runner.execute([s, o], [prompt, other], [True, True], [0, 0])
        seqs.append((s, o))
    (a, (sa, oa)), (b, (sb, ob)) = (engines[0], seqs[0]), (engines[1], seqs[1])
    with a.cache.recording({sa: len(extra)}) as rec:
        a.runner.execute([sa], [extra], [len(extra)], [len(prompt)])
    a.runner.execute([oa], [[3, 4]], [True], [len(other)])          # its undo log wants buffers of sa's shape
    a.cache.truncate(rec, {sa: 2})
    rec.release()
    b.runner.execute([sb], [extra[:2]], [True], [len(prompt)])
    b.runner.execute([ob], [[3, 4]], [True], [len(other)])
    assert a.cache.digest() == b.cache.digest()


def test_truncate_refuses_bad_arguments_and_changes_nothing():
    model = make_model("lin-idx", seed=12)
    engine = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=3, max_batch_tokens=None))
    s1, s2 = engine.cache.new_sequence(), engine.cache.new_sequence()
    engine.runner.execute([s1, s2], [[5, 6, 7], [8, 9]], [True, True], [0, 0])
    with engine.cache.recording({s1: 3}) as rec:
        engine.runner.execute([s1, s2], [[10, 11, 12], [13]], [3, True], [3, 2])
    before = engine.cache.digest()
    for keep, match in (({s1: 0}, "keep must be in"), ({s1: 4}, "keep must be in"), ({s2: 1}, "not recorded")):
        with pytest.raises(HebrusError, match=match):
            engine.cache.truncate(rec, keep)
        assert engine.cache.digest() == before


# ------------------------------------------------------------------------------------------ greedy exactness
def assert_greedy_speculation_is_plain(model, cases=((0, 16, 4), (1, 7, 6), (2, None, 3), (3, 32, 8))) -> None:
    """Speculation with an oracle drafter (each (seed, max_batch_tokens, k) of ``cases``) gives the plain run's
    tokens and, at every common point, the plain run's state digests."""
    prompts = prompts_for(13, lengths=(14, 6, 21, 3))
    plain_digests: dict = {}
    ref, _ = run(model, prompts, digests=plain_digests, max_new_tokens=14)
    for seed, budget, k in cases:
        digests: dict = {}
        tokens, engine = run(model, prompts, spec=k, drafter=oracle(ref, seed), digests=digests,
                             max_batch_tokens=budget, max_new_tokens=14)
        assert tokens == ref, (seed, budget, k)
        c = engine.counters
        assert c.spec_verify_rows > 0 and 0 < c.spec_accepted_tokens < c.spec_drafted_tokens
        assert c.spec_rollbacks > 0
        common = set(digests) & set(plain_digests)
        assert len(common) >= len(digests) // 2
        for key in common:
            assert digests[key] == plain_digests[key], (seed, key)


@pytest.mark.parametrize("shape", ["lin-idx", "idx-lin-idx-lin", "lin-lin-idx"])
def test_greedy_speculation_gives_the_plain_tokens_and_state(shape, row_invariant):
    assert_greedy_speculation_is_plain(eager_experts(make_model(shape, seed=13)))


def test_greedy_prompt_lookup_gives_the_plain_tokens():
    model = make_model("lin-idx", seed=14)
    base = prompts_for(14, lengths=(10, 16))
    prompts = [p + p[:6] + p for p in base]                      # passages that repeat: lookups find drafts
    ref, _ = run(model, prompts, max_new_tokens=16)
    tokens, engine = run(model, prompts, spec=5, max_new_tokens=16)
    assert tokens == ref
    assert engine.counters.spec_drafted_tokens > 0


@pytest.mark.parametrize("do_sample", [False, True])
def test_logprobs_and_top_alternatives_of_verified_tokens_are_the_plain_ones(do_sample, row_invariant):
    """A request asking for top_logprobs speculates too: every emitted token (accepted drafts and the target's
    own) gets the log-probability and the alternatives that decoding token by token gives it."""
    model = eager_experts(make_model("lin-idx", seed=17))
    prompts = prompts_for(17, lengths=(9, 14))
    kw = dict(do_sample=True, temperature=0.8, top_k=20, seed=5) if do_sample else {}
    sampling = SamplingParams(logprobs=True, top_logprobs=4, **kw)
    _, plain = run(model, prompts, max_new_tokens=14, sampling=sampling)
    ref = {rid: r.generated for rid, r in plain.requests.items()}
    drafting = dict(draft_model=model) if do_sample else dict(drafter=oracle(ref, 3))    # (the target drafts for
    _, spec = run(model, prompts, max_new_tokens=14, sampling=sampling, spec=4, **drafting)   # itself: q = p)
    assert spec.counters.spec_accepted_tokens > 0
    for i, (rid, req) in enumerate(spec.requests.items()):
        assert len(req.logprobs) == len(req.top_logprobs) == len(req.generated)
        if not do_sample:
            want = plain.requests[rid]
            assert req.generated == want.generated and req.logprobs == pytest.approx(want.logprobs, abs=1e-6)
        else:                  # another stream of draws: decode each of its tokens alone, from the same prefix
            tops = []
            for j in range(len(req.generated)):
                _, one = run(model, [prompts[i] + req.generated[:j]], max_new_tokens=1, sampling=sampling)
                tops.append(one.requests["r0"].top_logprobs[0])
            want = SimpleNamespace(top_logprobs=tops, logprobs=[dict(t).get(tok) for t, tok in zip(tops, req.generated)])
        assert [[t for t, _ in top] for top in req.top_logprobs] == [[t for t, _ in top] for top in want.top_logprobs]
        assert [v for top in req.top_logprobs for _, v in top] == \
            pytest.approx([v for top in want.top_logprobs for _, v in top], abs=1e-6)
        for lp, lp_want in zip(req.logprobs, want.logprobs):
            if lp_want is not None:              # (a sampled token outside the top 4 has no reference here)
                assert lp == pytest.approx(lp_want, abs=1e-6)


def test_a_request_whose_drafts_are_never_accepted_soon_stops_drafting(row_invariant):
    model = eager_experts(make_model("lin-idx", seed=15))
    prompts = prompts_for(15, lengths=(9,))
    ref, _ = run(model, prompts, max_new_tokens=40)
    tokens, engine = run(model, prompts, spec=4, drafter=oracle(ref, 0, error_rate=1.0), max_new_tokens=40)
    assert tokens == ref
    assert engine.counters.spec_accepted_tokens == 0
    assert engine.counters.spec_verify_rows == 3      # 40 tokens: decode steps 0, 4 and 20 (pauses of 3 and 15)
    assert engine.counters.spec_drafted_tokens == 2 + 1 + 1


def test_no_request_drafts_while_more_requests_decode_than_disable_by_batch_size(row_invariant):
    """Steps where more than ``disable_by_batch_size`` requests decode verify nothing and count for no request's
    back-off; once fewer decode, they draft again; the tokens are the plain ones throughout."""
    model = eager_experts(make_model("lin-idx", seed=18))
    prompts = prompts_for(18, lengths=(6, 9, 12))
    lengths = (4, 8, 20)
    ref = {}
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        ref[f"r{i}"] = run(model, [p], max_new_tokens=n)[0]["r0"]
    engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=8, max_batch_tokens=64, block_size=4),
                    drafter=oracle(ref, 2, error_rate=0.0))
    spec = SpeculativeConfig(2, disable_by_batch_size=2)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=EOS, speculative=spec)
    verified_with = []
    while engine.has_unfinished():
        decoding = sum(1 for r in engine.scheduler.running if r.remaining == 1)
        rows = engine.counters.spec_verify_rows
        backoff = [(r.spec.length, r.spec.pause) for r in engine.requests.values()]
        engine.step()
        if engine.counters.spec_verify_rows > rows:
            verified_with.append(decoding)
        if decoding > 2:
            assert engine.counters.spec_verify_rows == rows
            assert [(r.spec.length, r.spec.pause) for r in engine.requests.values()] == backoff
    assert verified_with and max(verified_with) <= 2
    assert {rid: r.generated for rid, r in engine.requests.items()} == ref
    tokens, _ = run(model, prompts[:1], spec=SpeculativeConfig(2, disable_by_batch_size=None), max_new_tokens=4,
                    drafter=oracle({"r0": ref["r0"]}, 2, error_rate=0.0))
    assert tokens == {"r0": ref["r0"]}


def test_a_request_that_accepts_nothing_backs_off_alone(row_invariant):
    """The back-off is per request: one whose drafts are never accepted stops drafting while another, drafting
    in the same steps, keeps its full length."""
    model = eager_experts(make_model("lin-idx", seed=19))
    prompts = prompts_for(19, lengths=(7, 11))
    ref, _ = run(model, prompts, max_new_tokens=24)
    good = oracle(ref, 4, error_rate=0.0)
    bad = oracle(ref, 4, error_rate=1.0)
    tokens, engine = run(model, prompts, spec=4, max_new_tokens=24, max_batch_tokens=64,
                         drafter=lambda req, k: (good if req.request_id == "r0" else bad)(req, k))
    assert tokens == ref
    r0, r1 = engine.requests["r0"].spec, engine.requests["r1"].spec
    assert r1.accepted_tokens == 0 and r1.verify_steps == 3          # decode steps 0, 4 and 20
    assert r0.accepted_tokens == r0.drafted_tokens > 0 and r0.verify_steps < 24 // 3


def test_speculation_mixed_with_prefills_and_plain_decodes(row_invariant):
    model = eager_experts(make_model("idx-lin-idx-lin", seed=16))
    prompts = prompts_for(16, lengths=(5, 30, 12, 25, 8))
    ref, _ = run(model, prompts, max_new_tokens=10)
    rng = random.Random(3)
    cfg = dict(capacity_tokens=1024, max_sequences=8, max_batch_tokens=12, block_size=4)
    late = {}
    engine = Engine(model, EngineConfig(**cfg), drafter=oracle(ref, 5, key=lambda rid: late.get(rid, rid)))
    mixed = 0
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=10, eos_token_id=EOS, speculative=4 if i % 2 else 0)
    while engine.has_unfinished():
        before = engine.counters.spec_verify_rows
        prefilling = any(r.num_computed < len(r.prompt) for r in engine.scheduler.running)
        engine.step()
        mixed += prefilling and engine.counters.spec_verify_rows > before
        if rng.random() < 0.2 and len(engine.requests) < 8:     # arrivals while others speculate
            n = len(engine.requests)
            late[f"late{n}"] = f"r{n % len(prompts)}"
            engine.add_request(prompts[n % len(prompts)], request_id=f"late{n}", max_new_tokens=10,
                               eos_token_id=EOS, speculative=3)
    assert mixed > 0
    for rid, req in engine.requests.items():
        assert req.generated == ref[late.get(rid, rid)], rid


def test_greedy_rows_verified_together_give_each_row_s_own_verdict(monkeypatch):
    """``verify_rows`` verifies the greedy rows without logit processors or top log-probabilities in one block:
    each row's verdict (accepted drafts, the token after them, log-probabilities) is the one it gets verified
    alone (the row-by-row path), beside rows that stay on that path (sampled, penalised, with top_logprobs), with
    drafts that are all right, partly right and empty, and ties in the logits."""
    vocab = 50
    g = torch.Generator().manual_seed(3)
    shapes = [(3, dict()), (0, dict()), (4, dict(logprobs=True)), (2, dict(do_sample=True, temperature=0.7)),
              (2, dict(repetition_penalty=1.3)), (3, dict(logprobs=True, top_logprobs=3)), (5, dict()), (1, dict())]
    offsets, drafts, params, histories, at = [], [], [], [], 0
    logits = torch.randn(sum(k + 1 for k, _ in shapes), vocab, generator=g)
    logits[at + 1, 7] = logits[at + 1, 9] = logits[at + 1].max() + 1.0          # a tie: the first index wins
    for i, (k, kw) in enumerate(shapes):
        truth = logits[at:at + k + 1].argmax(-1).tolist()
        d = truth[:k] if i % 3 else truth[:k // 2] + [(t + 1) % vocab for t in truth[k // 2:k]]
        offsets.append(at)
        drafts.append(d)
        params.append(SamplingParams(seed=i, **kw))
        histories.append([1, 2, 3 + i])
        at += k + 1
    gens = lambda: [torch.Generator().manual_seed(50 + i) for i in range(len(shapes))]   # noqa: E731
    import hebrus_torch.engine.speculative as speculative

    calls = []
    original = speculative.target_scores
    monkeypatch.setattr(speculative, "target_scores", lambda *a: calls.append(1) or original(*a))
    together = verify_rows(logits, offsets, drafts, params, histories, gens())
    assert len(calls) == 3 + 3 + 4          # (only the sampled, penalised and top_logprobs rows, position by position)
    alone = [verify_rows(logits[o:o + len(d) + 1], [0], [d], [p], [h], [gen])[0]
             for o, d, p, h, gen in zip(offsets, drafts, params, histories, gens())]
    assert together == alone
    assert [together[i].accepted for i in (0, 1, 2, 5, 6, 7)] == [1, 0, 4, 3, 2, 1]
    assert together[2].logprobs is not None and together[5].tops is not None


# ------------------------------------------------------------------------------------------ sampling
def _distribution(samples: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(samples), minlength=vocab).double() / len(samples)


@pytest.mark.parametrize("processing", [dict(temperature=0.8, top_k=5),
                                        dict(temperature=1.3, top_p=0.8, repetition_penalty=1.4)])
@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_q, processing):
    """Drafts from q (a draft model: sampled from q; prompt lookup: a fixed draft, q one-hot): the first
    emitted token is distributed as the target p_0, the second (after an accepted first) as p_1, and the
    first draft is accepted with probability sum(min(p_0, q_0)); p is the processed distribution
    (temperature, top-k or top-p, repetition penalty)."""
    vocab, k, trials = 6, 2, 12000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    params = SamplingParams(do_sample=True, **processing)
    history = [1, 2]
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1) if with_q else None
    p = [torch.softmax(target_scores(logits[j], params, history, ())[1], -1).double() for j in range(k + 1)]
    first, second = [], []
    gens = [torch.Generator().manual_seed(1000 + t) for t in range(trials)]
    batch = 500
    for t0 in range(0, trials, batch):
        n = min(batch, trials - t0)
        drafts = (torch.stack([torch.multinomial(q, 1, generator=g)[:, 0] for _ in range(n)]).tolist()
                  if q is not None else [[2, 4]] * n)
        verdicts = verify_rows(logits.repeat(n, 1), [i * (k + 1) for i in range(n)], drafts, [params] * n,
                               [history] * n, gens[t0:t0 + n], [q] * n if q is not None else None)
        for v, d in zip(verdicts, drafts):
            emitted = v.emitted(d)
            first.append(emitted[0])
            if v.accepted >= 1:
                second.append(emitted[1])
    tv0 = 0.5 * (_distribution(first, vocab) - p[0]).abs().sum()
    tv1 = 0.5 * (_distribution(second, vocab) - p[1]).abs().sum()
    assert tv0 < 0.03 and tv1 < 0.05, (tv0, tv1)
    qd = q[0].double() if q is not None else torch.nn.functional.one_hot(torch.tensor(2), vocab).double()
    assert abs(len(second) / trials - torch.minimum(p[0], qd).sum()) < 0.03


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    logits = torch.tensor([[0., 5, 1], [4, 0, 1], [0, 1, 3]])
    v = verify_rows(logits, [0], [[1, 0]], [SamplingParams()], [[2]], [None])[0]
    assert (v.accepted, v.token) == (2, 2)
    v = verify_rows(logits, [0], [[1, 2]], [SamplingParams()], [[2]], [None])[0]
    assert (v.accepted, v.token) == (1, 0)
    v = verify_rows(logits, [0], [[0, 0]], [SamplingParams()], [[2]], [None])[0]
    assert (v.accepted, v.token) == (0, 1)


def test_seeded_sampling_with_speculation_is_reproducible():
    model = make_model("lin-idx", seed=17)
    prompts = [p + p for p in prompts_for(17, lengths=(8, 12))]
    sampling = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=5)
    a, ea = run(model, prompts, spec=4, sampling=sampling, max_new_tokens=16)
    b, _ = run(model, prompts, spec=4, sampling=sampling, max_new_tokens=16)
    assert a == b
    assert all(len(t) == 16 or t[-1] == EOS for t in a.values())


# ------------------------------------------------------------------------------------------ the engine around it
@pytest.mark.parametrize("target", ["ple_conv", "delta_rule", "hook", "truncate"])
def test_faults_with_speculation_roll_back_and_every_request_completes(target, monkeypatch):
    model = make_model("lin-idx", seed=18)
    prompts = prompts_for(18, lengths=(10, 4, 15))
    ref, _ = run(model, prompts, max_batch_tokens=7, max_new_tokens=10)
    for k in ((1, 2, 4) if target == "truncate" else (2, 5, 9)):
        calls = {"n": 0}

        def fault(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == k:
                raise RuntimeError(f"injected fault at call {k}")

        cfg = dict(capacity_tokens=1024, max_sequences=8, max_batch_tokens=7, block_size=4)
        engine = Engine(model, EngineConfig(**cfg), drafter=oracle(ref, k))
        if target == "hook":
            engine._fault_hook = lambda plan: fault()
        elif target == "truncate":
            original = engine.cache.truncate

            def failing(*args, _orig=original, **kwargs):
                fault()
                return _orig(*args, **kwargs)
            monkeypatch.setattr(engine.cache, "truncate", failing)
        else:
            holder = engine.cache.ple if target == "ple_conv" else engine.cache.gdn
            name = "conv" if target == "ple_conv" else "delta_rule"
            original = getattr(holder, name)

            def faulty(*args, _orig=original, **kwargs):
                fault()
                return _orig(*args, **kwargs)
            monkeypatch.setattr(holder, name, faulty)
        for i, p in enumerate(prompts):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=10, eos_token_id=EOS,
                               speculative=SpeculativeConfig(4, adaptive=False))     # (a cut in most steps)
        engine.run()
        assert calls["n"] >= k
        assert {r: q.generated for r, q in engine.requests.items()} == ref, (target, k)
        assert all(r.status is RequestStatus.FINISHED for r in engine.requests.values())


def test_speculation_under_preemption_and_cancellation():
    model = make_model("lin-idx", seed=19)
    prompts = prompts_for(19, lengths=(20, 18, 22, 16))
    ref, _ = run(model, prompts, max_new_tokens=12, capacity_tokens=4096)
    tokens, engine = run(model, prompts, spec=4, drafter=oracle(ref, 1), max_new_tokens=12, capacity_tokens=90,
                         max_batch_tokens=32)
    assert tokens == ref
    assert engine.counters.preemptions > 0 and engine.counters.spec_verify_rows > 0
    engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=4, max_batch_tokens=32),
                    drafter=oracle(ref, 2))
    for i, p in enumerate(prompts):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=12, eos_token_id=EOS, speculative=4)
    for _ in range(4):
        engine.step()
    engine.cancel("r1")
    engine.run()
    assert engine.requests["r1"].status is RequestStatus.CANCELLED
    assert {r: q.generated for r, q in engine.requests.items() if r != "r1"} == {r: t for r, t in ref.items()
                                                                                 if r != "r1"}
    assert len(engine.cache.slots.live_handles()) == len(engine.kept_sequences())


def test_a_second_turn_after_a_speculating_one_reuses_its_kept_state(row_invariant):
    model = eager_experts(make_model("lin-idx", seed=20))
    prompt = prompts_for(20, lengths=(12,))[0]
    ref, _ = run(model, [prompt], max_new_tokens=9)
    for spec in (0, 4):
        engine = Engine(model, EngineConfig(capacity_tokens=1024, max_sequences=4, max_batch_tokens=16, block_size=4),
                        drafter=oracle(ref, 4))
        engine.add_request(prompt, request_id="r0", max_new_tokens=9, eos_token_id=-1, speculative=spec)
        engine.run()
        turn2 = prompt + engine.requests["r0"].generated + [11, 12, 13]
        engine.add_request(turn2, request_id="t2", max_new_tokens=6, eos_token_id=-1, speculative=0)
        engine.run()
        if spec == 0:
            want = engine.requests["t2"].generated
        else:
            assert engine.requests["t2"].prefix_hit_tokens > len(prompt)
            assert engine.requests["t2"].generated == want


# ------------------------------------------------------------------------------------------ a draft model
def test_a_draft_model_gives_greedy_requests_the_plain_tokens():
    model = make_model("lin-idx", seed=21)
    prompts = prompts_for(21, lengths=(14, 6, 21))
    ref, _ = run(model, prompts, max_new_tokens=12)
    same, engine = run(model, prompts, max_new_tokens=12, draft_model=make_model("lin-idx", seed=21))
    assert same == ref
    c = engine.counters
    assert c.spec_accepted_tokens == c.spec_drafted_tokens > 0          # the target itself drafts
    assert c.steps < sum(len(t) for t in ref.values())
    other, engine = run(model, prompts, max_new_tokens=12, draft_model=make_model("idx-lin-idx-lin", seed=3))
    assert other == ref
    assert engine.counters.spec_drafted_tokens > 0
    assert engine.drafter.cache.slots.live_handles() == []               # every draft sequence released


def test_a_draft_model_with_sampling_is_reproducible_and_releases_its_sequences():
    model = make_model("lin-idx", seed=22)
    prompts = prompts_for(22, lengths=(9, 15))
    sampling = SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=3)
    draft = make_model("lin-idx", seed=23)
    a, ea = run(model, prompts, sampling=sampling, max_new_tokens=10, draft_model=draft)
    b, _ = run(model, prompts, sampling=sampling, max_new_tokens=10, draft_model=draft)
    assert a == b and ea.counters.spec_verify_rows > 0
    assert ea.drafter.cache.slots.live_handles() == []


def generate_batch_once(model, prompts, generation_config, cb_config):
    """``generate_batch`` with a persistent manager, then destroyed: (tokens per request id, engine counters)."""
    out = model.generate_batch(prompts, generation_config, continuous_batching_config=cb_config,
                               persistent_manager=True)
    manager = model._cached_continuous_batching_manager
    try:
        return {k: o.generated_tokens for k, o in out.items()}, manager.engine.counters
    finally:
        manager.destroy()
        del model._cached_continuous_batching_manager


def test_generate_batch_honours_prompt_lookup_and_assistant_model():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from hebrus_torch.integrations import transformers as htx

    model = make_model("lin-idx", seed=24)
    prompts = [p + p for p in prompts_for(24, lengths=(7, 12))]
    cb = ContinuousBatchingConfig(max_batch_tokens=32, page_size=4)
    htx.apply(model)
    try:
        outs, counters = [], []
        for extra in ({}, {"prompt_lookup_num_tokens": 4}, {"assistant_model": make_model("lin-idx", seed=24)}):
            gc = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                                  **{k: v for k, v in extra.items() if k != "assistant_model"})
            if "assistant_model" in extra:
                gc.assistant_model = extra["assistant_model"]
            tokens, engine_counters = generate_batch_once(model, prompts, gc, cb)
            outs.append(tokens)
            counters.append(engine_counters)
        assert outs[1] == outs[0] and outs[2] == outs[0]
        assert counters[0].spec_verify_rows == 0
        assert counters[1].spec_drafted_tokens > 0 and counters[2].spec_accepted_tokens > 0
    finally:
        htx.revert(model)


def test_any_causal_lm_with_the_same_vocabulary_can_draft():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = make_model("lin-idx", seed=25)
    prompts = prompts_for(25, lengths=(10, 17))
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    ref, _ = run(model, prompts, max_new_tokens=12)
    tokens, engine = run(model, prompts, max_new_tokens=12, draft_model=llama)
    assert tokens == ref
    assert type(engine.drafter).__name__ == "CausalLMDrafter" and engine.counters.spec_drafted_tokens > 0
    sampling = SamplingParams(do_sample=True, temperature=0.8, seed=2)
    a, _ = run(model, prompts, max_new_tokens=12, draft_model=llama, sampling=sampling)
    b, engine = run(model, prompts, max_new_tokens=12, draft_model=llama, sampling=sampling)
    assert a == b and engine.drafter._drafts == {}


def test_speculation_on_device_gives_the_plain_tokens(device):
    """cpu here; mps on the macOS workflow's required job (the slot ops, the replay and the QSA rewind on
    Metal): greedy speculation with an oracle drafter gives that device's plain tokens."""
    model = make_model("idx-lin-idx-lin", seed=26).to(device)
    prompts = prompts_for(26, lengths=(14, 6, 21))
    ref, _ = run(model, prompts, max_new_tokens=10)
    tokens, engine = run(model, prompts, spec=4, drafter=oracle(ref, 7), max_new_tokens=10)
    assert tokens == ref
    assert engine.counters.spec_rollbacks > 0 and engine.counters.spec_accepted_tokens > 0


def test_the_logits_layout_places_each_row_s_logits_once_for_runner_sampler_and_verifier():
    from hebrus_torch.engine.logits_layout import LogitsLayout
    from hebrus_torch.engine.requests import Request
    from hebrus_torch.engine.scheduler import ScheduledChunk

    prefill = Request("p", list(range(4, 20)), 4)                      # 16 prompt tokens, 10 of them this step
    decode = Request("d", [4, 5, 6], 4, generated=[7])
    decode.num_computed = 3
    verify = Request("v", [4, 5, 6], 4, generated=[8])
    verify.num_computed = 3
    chunks = [ScheduledChunk(prefill, 10), ScheduledChunk(decode, 1), ScheduledChunk(verify, 1, [9, 10, 11])]
    layout = LogitsLayout.of_plan(chunks)
    assert layout.wanted == (0, 1, 4) and layout.starts == (0, 0, 1) and layout.total == 5
    assert layout.token_indices([c.width for c in chunks]) == [10, 11, 12, 13, 14]
    assert LogitsLayout.of([True, False, 2]).token_indices([3, 2, 2]) == [2, 5, 6]
