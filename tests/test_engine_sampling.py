"""The sampler's OpenAI parameters (logit_bias, presence/frequency penalties, logprobs with top alternatives)
and the engine's choices of one prompt (``Request.forks``: the prompt prefilled once, each choice with its own
generator). The log-probabilities are checked against ``log_softmax`` computed here, independently."""

from __future__ import annotations

import collections

import pytest
import torch

from hf_models import modeling  # noqa: F401,E402  (skips without transformers)
from test_engine import EOS, eager_experts, make_model, prompts_for, row_invariant  # noqa: F401  (fixture)

from hebrus_torch.engine import BadRequestError, Engine, EngineConfig, RequestStatus, SamplingParams
from hebrus_torch.engine.manager import HebrusBatchingManager, choice_seed
from hebrus_torch.engine.sampling import sample_next, sample_rows

V = 40


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


# ------------------------------------------------------------------------------------------ the sampler
def test_greedy_logprobs_and_top_alternatives_are_those_of_log_softmax():
    logits = _logits(0, 3)
    params = [SamplingParams(logprobs=True, top_logprobs=5), SamplingParams(logprobs=True),
              SamplingParams(logprobs=True, top_logprobs=20)]
    picks = sample_rows(logits, params, [[], [], []], [None] * 3)
    for row, (p, pick) in enumerate(zip(params, picks)):
        lp = torch.log_softmax(logits[row].double(), -1)
        assert pick.token == int(torch.argmax(logits[row]))
        assert pick.logprob == pytest.approx(float(lp[pick.token]), abs=1e-6)
        assert len(pick.top) == p.top_logprobs
        if p.top_logprobs:
            ids, values = zip(*pick.top)
            assert list(values) == sorted(values, reverse=True)
            assert ids[0] == pick.token
            want = torch.topk(lp, p.top_logprobs)
            assert list(ids) == want.indices.tolist()
            assert values == pytest.approx(want.values.tolist(), abs=1e-6)
    assert sample_rows(logits[:1], [SamplingParams()], [[]], [None])[0].logprob is None


def test_sampled_logprobs_are_after_temperature_and_before_top_k_and_top_p():
    logits = _logits(1)[0]
    p = SamplingParams(do_sample=True, temperature=0.7, top_k=3, top_p=0.5, logprobs=True, top_logprobs=6, seed=3)
    pick = sample_next(logits, p, [], p.generator(torch.device("cpu")))
    lp = torch.log_softmax(logits.double() / 0.7, -1)
    assert pick.logprob == pytest.approx(float(lp[pick.token]), abs=1e-6)
    assert [t for t, _ in pick.top] == torch.topk(lp, 6).indices.tolist()       # beyond top_k's 3: still finite
    assert pick.token in torch.topk(logits, 3).indices.tolist()
    again = sample_next(logits, p, [], p.generator(torch.device("cpu")))
    assert again == pick


def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled():
    logits = _logits(2)[0]
    best = int(torch.argmax(logits))
    worst = int(torch.argmin(logits))
    assert sample_next(logits, SamplingParams(logit_bias=((worst, 100.0),)), [], None).token == worst
    banned = sample_next(logits, SamplingParams(logit_bias=((best, -100.0),)), [], None).token
    assert banned == int(torch.topk(logits, 2).indices[1])
    p = SamplingParams(do_sample=True, temperature=1.5, logit_bias=((worst, 100.0),), seed=0)
    gen = p.generator(torch.device("cpu"))
    assert {sample_next(logits, p, [], gen).token for _ in range(20)} == {worst}
    pick = sample_next(logits, SamplingParams(logit_bias=((7, 2.5),), logprobs=True), [], None)
    biased = logits.double().clone()
    biased[7] += 2.5
    assert pick.logprob == pytest.approx(float(torch.log_softmax(biased, -1)[pick.token]), abs=1e-6)


def test_presence_and_frequency_penalties_are_openais_over_generated_tokens_only():
    logits = _logits(3)[0]
    prompt, generated = [1, 2, 2], [5, 5, 5, 9, int(torch.argmax(logits))]
    p = SamplingParams(presence_penalty=0.6, frequency_penalty=1.1, logprobs=True, top_logprobs=20)
    pick = sample_next(logits, p, prompt + generated, None, generated)
    want = logits.double().clone()
    for t, c in collections.Counter(generated).items():
        want[t] -= 0.6 + 1.1 * c
    lp = torch.log_softmax(want, -1)
    assert pick.token == int(torch.argmax(want))
    assert pick.logprob == pytest.approx(float(lp[pick.token]), abs=1e-6)
    want_top = torch.topk(lp, 20)
    assert dict(pick.top) == pytest.approx(dict(zip(want_top.indices.tolist(), want_top.values.tolist())), abs=1e-6)
    assert sample_next(logits, p, prompt, None, ()) == sample_next(logits, SamplingParams(
        logprobs=True, top_logprobs=20), prompt, None)                                  # the prompt is not counted


def test_several_requests_may_read_one_logits_row():
    logits = _logits(4, 2)
    params = [SamplingParams(logprobs=True, top_logprobs=2), SamplingParams(do_sample=True, seed=1),
              SamplingParams(logprobs=True)]
    gens = [None, params[1].generator(torch.device("cpu")), None]
    picks = sample_rows(logits, params, [[]] * 3, gens, rows=[1, 1, 0])
    assert picks[0] == sample_next(logits[1], params[0], [], None)
    assert picks[2] == sample_next(logits[0], params[2], [], None)
    assert picks[1].token == sample_next(logits[1], params[1], [], params[1].generator(torch.device("cpu"))).token


@pytest.mark.parametrize("rows", [None, [0, 1, 2], [2, 0, 2]])
def test_plain_greedy_rows_read_as_the_general_path_reads_them(rows):
    """Greedy rows without penalties or log-probabilities (read as one argmax of the float32 logits, no table) pick
    what the general path picks for the same rows: bfloat16 logits, or one request asking for its log-probability
    beside them, go through it."""
    logits = _logits(6, 3)
    plain = [SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(top_logprobs=0)]
    picks = sample_rows(logits, plain, [[]] * 3, [None] * 3, rows=rows)
    want = torch.argmax(logits if rows is None else logits[rows], -1).tolist()
    assert [p.token for p in picks] == want and all(p.logprob is None and p.top == () for p in picks)
    assert [p.token for p in sample_rows(logits.bfloat16(), plain, [[]] * 3, [None] * 3, rows=rows)] == \
        torch.argmax((logits if rows is None else logits[rows]).bfloat16().float(), -1).tolist()
    mixed = sample_rows(logits, plain[:2] + [SamplingParams(logprobs=True)], [[]] * 3, [None] * 3, rows=rows)
    assert [p.token for p in mixed] == want and mixed[2].logprob is not None


@pytest.mark.parametrize("kwargs, match", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(top_logprobs=2), "needs logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"), (dict(logprobs=1), "logprobs must be a bool"),
    (dict(logit_bias=((3, 100.5),)), r"logit_bias values .*100\.5"), (dict(logit_bias=((-1, 1.0),)), "token ids"),
    (dict(logit_bias=((3, 1.0), (3, 2.0))), "twice"), (dict(logit_bias={3: 1.0}), "tuple of"),
    (dict(logit_bias=((3, float("nan")),)), "logit_bias values"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("inf")), "frequency_penalty")])
def test_bad_openai_sampling_values_are_refused(kwargs, match):
    with pytest.raises(BadRequestError, match=match):
        SamplingParams(**kwargs)


def test_a_logit_bias_outside_the_vocabulary_is_refused_and_nothing_is_queued():
    model = make_model("lin-idx")
    engine = Engine(model, EngineConfig(capacity_tokens=64, max_sequences=2))
    vocab = engine.vocab_size
    with pytest.raises(BadRequestError, match=rf"logit_bias token ids \[{vocab}\]"):
        engine.add_request([5, 6], max_new_tokens=2, sampling=SamplingParams(logit_bias=((vocab, 1.0),)))
    assert not engine.has_unfinished() and not engine.requests


# ------------------------------------------------------------------------------------------ choices (forks)
def _choices(engine, prompt, n, sampling_for, max_new_tokens=6, prefix="c"):
    reqs = [engine.make_request(prompt, request_id=f"{prefix}{i}", max_new_tokens=max_new_tokens,
                                sampling=sampling_for(i), eos_token_id=-1) for i in range(n)]
    reqs[0].forks = reqs[1:]
    engine.submit(reqs[0])
    return reqs


def test_n_choices_prefill_the_prompt_once_and_greedy_choices_equal_one_request(row_invariant):
    model = eager_experts(make_model("lin-idx", seed=21))
    prompt = prompts_for(21, lengths=(23,))[0]
    cfg = dict(capacity_tokens=512, max_sequences=6, max_batch_tokens=8, block_size=4, prefix_cache_tokens=0)
    single = Engine(model, EngineConfig(**cfg))
    single.add_request(prompt, request_id="one", max_new_tokens=6, eos_token_id=-1,
                       sampling=SamplingParams(logprobs=True, top_logprobs=3))
    single.run()
    one = single.requests["one"]
    engine = Engine(model, EngineConfig(**cfg))
    reqs = _choices(engine, prompt, 3, lambda i: SamplingParams(logprobs=True, top_logprobs=3))
    engine.run()
    assert engine.counters.prefill_tokens == len(prompt) == single.counters.prefill_tokens
    assert engine.counters.forked_choices == 2 and engine.counters.prefix_hit_tokens == 0
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        assert (r.generated, r.logprobs, r.top_logprobs) == (one.generated, one.logprobs, one.top_logprobs)
    assert engine._free_cells() == engine.config.capacity_tokens
    assert len(engine.cache.slots.live_handles()) == 0


def test_sampled_choices_each_have_their_own_seeded_stream():
    model = make_model("lin-idx", seed=22)
    prompt = prompts_for(22, lengths=(9,))[0]

    def run(seed, n):
        engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=6, max_batch_tokens=16))
        reqs = _choices(engine, prompt, n, lambda i: SamplingParams(do_sample=True, temperature=1.5,
                                                                   seed=choice_seed(seed, i)), max_new_tokens=10)
        engine.run()
        assert engine.counters.prefill_tokens == len(prompt)
        return [r.generated for r in reqs]

    a, b = run(5, 3), run(5, 3)
    assert a == b                                         # same seed, same choices
    assert len({tuple(x) for x in a}) == 3                # each choice its own stream
    assert run(5, 1) == a[:1]                             # choice 0 is the reply with one choice
    assert run(6, 3) != a


def test_a_leader_cancelled_before_its_prompt_ends_lets_its_choices_run_and_a_cancelled_fork_never_runs():
    model = make_model("lin-idx", seed=23)
    prompt = prompts_for(23, lengths=(30,))[0]
    engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=6, max_batch_tokens=8, block_size=4))
    reqs = _choices(engine, prompt, 3, lambda i: SamplingParams())
    engine.step()
    assert 0 < reqs[0].num_computed < len(prompt)
    engine.cancel("c0")
    engine.cancel("c2")
    engine.run()
    assert [r.status for r in reqs] == [RequestStatus.CANCELLED, RequestStatus.FINISHED, RequestStatus.CANCELLED]
    assert len(reqs[1].generated) == 6 and not reqs[2].generated
    assert len(engine.cache.slots.live_handles()) == len(engine.kept_sequences())


def test_the_manager_runs_num_return_sequences_as_forks_and_validates_it():
    model = make_model("lin-idx", seed=24)
    prompt = prompts_for(24, lengths=(12,))[0]
    manager = HebrusBatchingManager(model, engine_config=EngineConfig(capacity_tokens=256, max_sequences=4))
    manager.start()
    try:
        rid = manager.add_request(prompt, max_new_tokens=4, num_return_sequences=3, eos_token_id=-1,
                                  do_sample=True, seed=11, logprobs=True, top_logprobs=2, logit_bias={7: 100})
        outs = {}
        while len(outs) < 3:
            out = manager.get_result(timeout=30)
            assert out is not None
            if out.is_finished():
                outs[out.request_id] = out
        assert set(outs) == {rid, f"{rid}__child#0", f"{rid}__child#1"}
        for out in outs.values():
            assert out.error is None and out.generated_tokens == [7] * 4 and out.finish_reason == "length"
            assert len(out.logprobs) == 4 and [len(t) for t in out.top_logprobs] == [2] * 4
        assert manager.stats()["counters"]["prefill_tokens"] == len(prompt)
        bad = manager.add_request(prompt, max_new_tokens=4, num_return_sequences=2, logit_bias={10**6: 1})
        failed = [manager.get_result(timeout=30) for _ in range(2)]
        assert {f.request_id for f in failed} == {bad, f"{bad}__child#0"}
        assert all("logit_bias" in f.error for f in failed)
    finally:
        manager.stop(block=True, timeout=30)


@pytest.mark.parametrize("seed", range(3))
def test_choices_on_tiny_capacities_always_end_and_free_everything(seed):
    """Several requests of several choices on a cache too small for all of them (preemption, forks that find
    no slot and prefill on their own, cancellations): every choice ends, and nothing is left behind."""
    import random

    from test_engine import _drive

    rng = random.Random(seed)
    model = make_model("lin-idx", seed=25)
    engine = Engine(model, EngineConfig(capacity_tokens=96, max_sequences=5, max_batch_tokens=16, block_size=4,
                                        prefix_cache_tokens=24))
    groups = []
    for g in range(4):
        prompt = [rng.randrange(4, 50) for _ in range(rng.randrange(3, 30))]
        groups.append(_choices(engine, prompt, rng.randrange(1, 5), lambda i: SamplingParams(
            do_sample=bool(i % 2), seed=i), max_new_tokens=rng.randrange(1, 12), prefix=f"g{g}_"))
    cancelled = rng.choice(groups)[-1]
    _drive(engine, max_steps=2000, seconds=120, arrivals=[(3, lambda: engine.cancel(cancelled.request_id))])
    for reqs in groups:
        for r in reqs:
            assert r.status in (RequestStatus.FINISHED, RequestStatus.CANCELLED), (r.request_id, r.status, r.error)
            assert r.status is RequestStatus.CANCELLED or 1 <= len(r.generated) <= r.max_new_tokens
    engine.clear_prefix_cache()
    assert len(engine.cache.slots.live_handles()) == 0 and engine._free_cells() == engine.config.capacity_tokens


def test_a_batch_of_mixed_requests_picks_what_each_picks_alone():
    """The sampler works on all rows at once (greedy rows in one argmax, sampled rows grouped by their settings):
    each request's token, log-probabilities and alternatives, and its generator's state after, are bitwise those
    of the request sampled alone; the caller's logits are left as they were."""
    logits = _logits(9, 6).to(torch.bfloat16)
    settings = [SamplingParams(), SamplingParams(logprobs=True, top_logprobs=4),
                SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=1),
                SamplingParams(repetition_penalty=1.3, logit_bias=((3, 5.0),), presence_penalty=0.4),
                SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=2, logprobs=True, top_logprobs=2),
                SamplingParams(do_sample=True, top_k=5, seed=3, frequency_penalty=1.5),
                SamplingParams(repetition_penalty=0.8, logprobs=True)]
    params = [settings[i % len(settings)] for i in range(11)]
    rows = [i % 6 for i in range(11)]
    histories = [[(3 * i + j) % V for j in range(i + 2)] for i in range(11)]
    generated = [h[-3:] for h in histories]
    keep = logits.clone()
    gens = [p.generator(torch.device("cpu")) for p in params]
    together = sample_rows(logits, params, histories, gens, rows=rows, generated=generated)
    assert torch.equal(logits, keep)
    for i, p in enumerate(params):
        gen = p.generator(torch.device("cpu"))
        assert together[i] == sample_next(logits[rows[i]], p, histories[i], gen, generated[i]), i
        if gen is not None:
            assert torch.equal(gens[i].get_state(), gen.get_state()), i
