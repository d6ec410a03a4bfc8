"""Structured output in the engine (issue 39): a request's ``constraint`` (``engine/constraints.py``).

A random tiny model of a byte-level tokenizer (tests/json_tokenizer.py) generates under JSON-schema grammars:
every request that finishes with a stop parses and validates (small schemas, where the grammar forces the end),
greedy or sampled, with ``n`` choices forked from one prompt, with log-probabilities, with speculation (drafts
the grammar refuses are never verified; greedy tokens equal the plain run's), across a step undone and retried,
beside unconstrained requests (whose tokens the masks never touch) and through ``generate_batch``. A schema that
cannot be compiled, or one too large, is refused before anything is queued.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("llguidance", reason="needs the serve extra (llguidance)")

from hf_models import modeling  # noqa: E402,F401  (skips without transformers)
from json_tokenizer import EOS, make_json_model, make_json_tokenizer  # noqa: E402

import hebrus_torch.engine.engine as engine_module  # noqa: E402
from hebrus_torch.engine import BadRequestError, Engine, EngineConfig, RequestStatus, SamplingParams  # noqa: E402
from hebrus_torch.engine.constraints import (MAX_SCHEMA_BYTES, CompiledConstraint, Constraint,  # noqa: E402
                                             ConstraintError, compile_constraint)

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"], "additionalProperties": False}


def valid(text: str) -> bool:
    """``text`` is JSON valid against SCHEMA (checked by hand: no jsonschema dependency)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"color", "n", "ok"}
            and value["color"] in ("red", "green", "blue") and type(value["n"]) is int and 0 <= value["n"] <= 99
            and type(value["ok"]) is bool)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


@pytest.fixture(scope="module")
def tokenizer():
    return make_json_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_json_model(tokenizer, seed=3)


def engine_for(model, tokenizer, **kwargs) -> Engine:
    cfg = dict(capacity_tokens=4096, max_sequences=16, max_batch_tokens=64, block_size=4)
    return Engine(model, EngineConfig(**cfg), tokenizer=tokenizer, **kwargs)


def prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode(" ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(2, 12))))
            for _ in range(count)]


def text(tokenizer, req) -> str:
    return tokenizer.decode(req.generated, skip_special_tokens=True)


def assert_valid_stops(tokenizer, reqs, at_least: int = 1) -> None:
    stopped = [r for r in reqs if r.finish_reason is not None and r.finish_reason.value == "stop"]
    assert len(stopped) >= at_least, [(r.request_id, r.finish_reason, r.error) for r in reqs]
    for r in stopped:
        assert r.status is RequestStatus.FINISHED and valid(text(tokenizer, r)), (r.request_id, text(tokenizer, r))
        assert r.generated[-1] == EOS          # the grammar is complete, then the end token


# ------------------------------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("do_sample", [False, True])
def test_every_constrained_request_that_stops_is_valid_json_of_its_schema(model, tokenizer, do_sample):
    engine = engine_for(model, tokenizer)
    constraint = Constraint.json_schema(SCHEMA)
    for i, p in enumerate(prompts(tokenizer, 6, seed=1)):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=40, constraint=constraint, eos_token_id=EOS,
                           sampling=SamplingParams(do_sample=do_sample, temperature=1.3, seed=i, logprobs=True,
                                                   top_logprobs=5))
    engine.run()
    reqs = list(engine.requests.values())
    assert_valid_stops(tokenizer, reqs, at_least=6)
    for r in reqs:
        assert len(r.logprobs) == len(r.generated) and all(lp > float("-inf") for lp in r.logprobs)
        # the masked distribution: where the grammar allows one token its log-probability is 0 and the
        # alternatives are only the allowed tokens (no -inf entries)
        for tops in r.top_logprobs:
            assert 1 <= len(tops) <= 5 and all(v > float("-inf") for _, v in tops)
        assert any(len(t) == 1 and t[0][1] == pytest.approx(0.0, abs=1e-6) for t in r.top_logprobs)


def test_choices_forked_from_one_prompt_each_follow_their_own_grammar_state(model, tokenizer):
    engine = engine_for(model, tokenizer)
    constraint = Constraint.json_schema(SCHEMA)
    p = prompts(tokenizer, 1, seed=2)[0]
    reqs = [engine.make_request(p, request_id=f"c{i}", max_new_tokens=40, constraint=constraint, eos_token_id=EOS,
                                sampling=SamplingParams(do_sample=True, temperature=1.5, seed=100 + i))
            for i in range(4)]
    reqs[0].forks = reqs[1:]
    engine.submit(reqs[0])
    engine.run()
    assert engine.counters.forked_choices == 3
    assert_valid_stops(tokenizer, reqs, at_least=4)
    assert len({text(tokenizer, r) for r in reqs}) >= 2


def test_forks_must_carry_their_parents_constraint(model, tokenizer):
    engine = engine_for(model, tokenizer)
    p = prompts(tokenizer, 1)[0]
    parent = engine.make_request(p, request_id="a", constraint=Constraint.json_schema(SCHEMA))
    parent.forks = [engine.make_request(p, request_id="b", constraint=Constraint.json_object())]
    with pytest.raises(BadRequestError, match="constraint"):
        engine.submit(parent)
    assert engine.requests == {}


def test_unconstrained_requests_beside_constrained_ones_get_their_own_tokens(model, tokenizer):
    ps = prompts(tokenizer, 4, seed=4)
    alone = engine_for(model, tokenizer)
    for i, p in enumerate(ps):
        alone.add_request(p, request_id=f"u{i}", max_new_tokens=10, eos_token_id=-1)
    alone.run()
    mixed = engine_for(model, tokenizer)
    for i, p in enumerate(ps):
        mixed.add_request(p, request_id=f"u{i}", max_new_tokens=10, eos_token_id=-1)
        mixed.add_request(p, request_id=f"c{i}", max_new_tokens=10, constraint=Constraint.json_object())
    mixed.run()
    # (greedy; a packed step's rows may differ in the last bit from other batch shapes: compare the tokens)
    assert {k: r.generated for k, r in mixed.requests.items() if k.startswith("u")} == \
        {k: r.generated for k, r in alone.requests.items()}
    for i in range(4):
        assert text(tokenizer, mixed.requests[f"c{i}"]).startswith("{")


@pytest.mark.parametrize("threads, upload", [(0, False), (2, False), (0, True)])
def test_masks_leave_the_allowed_logits_as_they_are_and_put_the_refused_at_minus_infinity(tokenizer, monkeypatch,
                                                                                          threads, upload):
    """``mask_logits`` on a step of three rows: an unconstrained one, a sampling row and a verification row of
    two drafts; row by row, a token is kept iff the grammar (advanced through the drafts before it) takes it,
    and the matchers are where they were afterwards. Masks computed on the engine's thread or in llguidance's
    pool; applied on the host (CPU logits) or as on a device (one upload, unpacked there: run here on CPU)."""
    from types import SimpleNamespace

    import hebrus_torch.engine.constraints as constraints
    from hebrus_torch.engine.constraints import MaskBuffer, mask_logits
    from hebrus_torch.engine.logits_layout import LogitsLayout

    monkeypatch.setattr(constraints, "MASK_THREADS", threads)
    if upload:
        monkeypatch.setattr(constraints, "_mask_on_host", lambda logits, bits, index, vocab: constraints._mask_uploaded(
            logits, torch.cat([bits.flatten(), index]), bits.shape[0], bits.shape[1], vocab))

    compiled = compile_constraint(Constraint.json_schema(SCHEMA), tokenizer, len(tokenizer), [EOS])
    sampling, verifying = compiled.state(), compiled.state()
    start = tokenizer.encode('{"color":"')
    sampling.advance(start)
    verifying.advance(start[:-1])
    drafts = [start[-1], tokenizer.encode("g")[0]]
    chunks = [SimpleNamespace(request=SimpleNamespace(constraint=None), drafts=[]),
              SimpleNamespace(request=SimpleNamespace(constraint=sampling), drafts=[]),
              SimpleNamespace(request=SimpleNamespace(constraint=verifying), drafts=drafts)]
    layout = LogitsLayout.of([1, 1, 3])
    logits = torch.randn(5, len(tokenizer) + 5)             # (wider than the tokenizer: the model's vocabulary)
    compiled = compile_constraint(Constraint.json_schema(SCHEMA), tokenizer, logits.shape[1], [EOS])
    sampling.compiled = verifying.compiled = compiled
    before = logits.clone()
    mask_logits(chunks, layout, logits, MaskBuffer())

    def allowed(state, prefix):       # the matcher's own one-bit-per-token mask, one position at a time
        probe = state.matcher.deep_copy()
        assert probe.consume_tokens(prefix)
        bits = probe.compute_bitmask()
        return {t for t in range(len(tokenizer)) if bits[t // 8] >> (t % 8) & 1}

    expected = [(None, [])] + [(sampling, [])] + [(verifying, drafts[:j]) for j in range(3)]
    for row, (state, prefix) in enumerate(expected):
        keep = set(range(logits.shape[1])) if state is None else allowed(state, prefix)
        assert 0 < len(keep) < logits.shape[1] or state is None
        for token in range(logits.shape[1]):
            assert logits[row, token] == (before[row, token] if token in keep else float("-inf")), (row, token)
    assert torch.isfinite(logits[1]).sum() == 4          # "b", "g", "r", "re" (the enum's first letters)
    assert sampling.valid_prefix(drafts[1:]) == 1 and verifying.valid_prefix(drafts) == 2   # (not advanced)


# ---------------------------------------------------------------------------------------------- speculation
def test_under_speculation_greedy_tokens_are_the_plain_runs_and_refused_drafts_are_never_verified(model, tokenizer):
    ps = prompts(tokenizer, 4, seed=6)
    constraint = Constraint.json_schema(SCHEMA)

    def run(drafter=None, spec=0):
        engine = engine_for(model, tokenizer, drafter=drafter)
        for i, p in enumerate(ps):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=40, constraint=constraint, eos_token_id=EOS,
                               speculative=spec)
        engine.run()
        return engine

    plain = run()
    truth = {k: r.generated for k, r in plain.requests.items()}
    rng = random.Random(7)

    def oracle(req, k):          # the true continuation with errors (mostly tokens the grammar refuses)
        true = truth[req.request_id][len(req.generated):len(req.generated) + k]
        return [t if rng.random() > 0.3 else rng.randrange(len(tokenizer)) for t in true]

    spec = run(oracle, 4)
    assert {k: r.generated for k, r in spec.requests.items()} == truth
    assert spec.counters.spec_accepted_tokens > 0
    assert_valid_stops(tokenizer, list(spec.requests.values()), at_least=4)

    pad = run(lambda req, k: [0] * k, 4)        # "<pad>" is never JSON: every draft is cut before the step
    assert pad.counters.spec_drafted_tokens == 0 and pad.counters.spec_verify_rows == 0
    assert {k: r.generated for k, r in pad.requests.items()} == truth


def grammar_drafter(tokenizer, seed: int):
    """Drafts the grammar takes: random allowed tokens from a copy of the request's matcher."""
    rng = random.Random(seed)

    def draft(req, k):
        probe, out = req.constraint.matcher.deep_copy(), []
        for _ in range(k):
            bits = probe.compute_bitmask()
            allowed = [t for t in range(len(tokenizer)) if bits[t // 8] >> (t % 8) & 1 and t != EOS]
            if not allowed:
                break
            out.append(rng.choice(allowed))
            probe.consume_token(out[-1])
        return out
    return draft


def test_sampled_speculation_keeps_every_output_valid(model, tokenizer):
    engine = engine_for(model, tokenizer, drafter=grammar_drafter(tokenizer, 13))
    for i, p in enumerate(prompts(tokenizer, 4, seed=8)):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=40, constraint=Constraint.json_schema(SCHEMA),
                           eos_token_id=EOS, speculative=3,
                           sampling=SamplingParams(do_sample=True, seed=i, logprobs=True, top_logprobs=2))
    engine.run()
    assert_valid_stops(tokenizer, list(engine.requests.values()), at_least=4)
    assert engine.counters.spec_verify_rows > 0 and engine.counters.spec_accepted_tokens > 0


# -------------------------------------------------------------------------------------------- transactions
@pytest.mark.parametrize("where", ["sample_rows_reading", "mask_logits"])
def test_a_step_undone_and_retried_leaves_each_grammar_where_it_was(model, tokenizer, monkeypatch, where):
    ps = prompts(tokenizer, 3, seed=9)
    sampling = SamplingParams(do_sample=True, temperature=1.2, seed=11)

    def run():
        engine = engine_for(model, tokenizer)
        for i, p in enumerate(ps):
            engine.add_request(p, request_id=f"r{i}", max_new_tokens=40, constraint=Constraint.json_schema(SCHEMA),
                               eos_token_id=EOS, sampling=sampling)
        engine.run()
        return engine

    clean = {k: r.generated for k, r in run().requests.items()}
    for at in (2, 5):
        calls = {"n": 0}
        original = getattr(engine_module, where)

        def faulty(*args, **kwargs):
            result = original(*args, **kwargs)     # (mask_logits: the masks were computed, then the step fails)
            calls["n"] += 1
            if calls["n"] == at:
                raise RuntimeError(f"injected fault after {where}")
            return result
        with monkeypatch.context() as m:
            m.setattr(engine_module, where, faulty)
            engine = run()
        assert engine.counters.retried_steps == 1
        assert {k: r.generated for k, r in engine.requests.items()} == clean
        assert_valid_stops(tokenizer, list(engine.requests.values()), at_least=3)


# ------------------------------------------------------------------------------------------------- refusals
def test_a_schema_that_cannot_be_compiled_or_is_too_large_is_refused_before_anything_is_queued(model, tokenizer):
    engine = engine_for(model, tokenizer)
    p = prompts(tokenizer, 1)[0]
    with pytest.raises(ConstraintError, match="strin"):
        engine.add_request(p, request_id="a", constraint=Constraint.json_schema({"type": "strin"}))
    with pytest.raises(ConstraintError, match="nowhere"):
        engine.add_request(p, request_id="b", constraint=Constraint.json_schema({"$ref": "#/nowhere"}))
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_BYTES // 20)}}
    with pytest.raises(ConstraintError, match="too large"):
        Constraint.json_schema(big)
    with pytest.raises(ConstraintError, match="JSON object"):
        Constraint.json_schema([1, 2])
    assert engine.requests == {} and not engine.has_unfinished()
    bare = Engine(model, EngineConfig(capacity_tokens=256, max_sequences=2))
    with pytest.raises(BadRequestError, match="tokenizer"):
        bare.add_request(p, constraint=Constraint.json_object())
    other = compile_constraint(Constraint.json_object(), tokenizer, len(tokenizer) + 32)
    with pytest.raises(BadRequestError, match="compiled for"):
        engine.add_request(p, constraint=other)
    assert bare.requests == {} and engine.requests == {}


def test_a_schema_is_compiled_once_per_tokenizer_and_width(tokenizer):
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 7}}, "required": ["k"]}
    first = compile_constraint(Constraint.json_schema(schema), tokenizer, len(tokenizer))
    again = compile_constraint(Constraint.json_schema(json.dumps(schema)), tokenizer, len(tokenizer))
    assert isinstance(first, CompiledConstraint) and first.seconds > 0 and again.seconds == 0
    assert again.grammar == first.grammar and again.tokenizer is first.tokenizer


def test_generate_batch_takes_the_constraint_of_its_generation_config(model, tokenizer):
    import hebrus_torch.integrations.transformers as hx
    from transformers import GenerationConfig

    hx.apply(model)
    try:
        gen = GenerationConfig(max_new_tokens=40, eos_token_id=EOS, pad_token_id=0, do_sample=False,
                               constraint=compile_constraint(Constraint.json_schema(SCHEMA), tokenizer,
                                                             len(tokenizer), [EOS]))
        out = model.generate_batch(prompts(tokenizer, 3, seed=12), generation_config=gen)
    finally:
        hx.revert(model)
    assert len(out) == 3
    for result in out.values():
        assert result.error is None and valid(tokenizer.decode(result.generated_tokens, skip_special_tokens=True))


def test_an_objects_properties_come_in_the_schemas_order(model, tokenizer):
    """(a canonical text with sorted keys wrote them alphabetically: "a" before "z")"""
    schema = {"type": "object", "properties": {"z": {"enum": [1, 2]}, "a": {"enum": [3, 4]}},
              "required": ["z", "a"], "additionalProperties": False}
    engine = engine_for(model, tokenizer)
    engine.add_request(prompts(tokenizer, 1, seed=14)[0], request_id="o", max_new_tokens=30, eos_token_id=EOS,
                       constraint=Constraint.json_schema(schema))
    engine.run()
    req = engine.requests["o"]
    assert req.finish_reason.value == "stop"
    assert list(json.loads(text(tokenizer, req))) == ["z", "a"]


def test_prefix_sharing_serves_a_constrained_request_as_any_other(model, tokenizer):
    """A constrained request whose prompt a kept prefix covers starts from it (prefix-hit tokens) and generates
    what it generates on a fresh engine (greedy)."""
    p = prompts(tokenizer, 1, seed=15)[0] * 3
    fresh = engine_for(model, tokenizer)
    fresh.add_request(p, request_id="a", max_new_tokens=40, eos_token_id=EOS,
                      constraint=Constraint.json_schema(SCHEMA))
    fresh.run()
    engine = engine_for(model, tokenizer)
    engine.add_request(p, request_id="first", max_new_tokens=4, eos_token_id=-1)        # unconstrained, kept
    engine.run()
    engine.add_request(p, request_id="b", max_new_tokens=40, eos_token_id=EOS,
                       constraint=Constraint.json_schema(SCHEMA))
    engine.run()
    assert engine.requests["b"].prefix_hit_tokens > 0
    assert engine.requests["b"].generated == fresh.requests["a"].generated
    assert valid(text(tokenizer, engine.requests["b"]))
