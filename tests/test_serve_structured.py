"""``python -m hebrus_torch.serve`` (issue 39): structured output and ``/metrics`` over loopback with the official
``openai`` client, against a random tiny Qwen4Exp of a byte-level tokenizer (tests/json_tokenizer.py: it can
spell JSON) whose ``response_template`` is Qwen's (tool calls as ``<tool_call>\\n{...}\\n</tool_call>``).

One server, with an API key and prompt-lookup speculation on: ``response_format`` json_schema / json_object on
chat and text completions, streamed and not, with ``n`` and logprobs (every choice that stops parses and
validates; the small schemas force the end, so choices do stop), ``client.beta.chat.completions.parse`` with a
Pydantic model, ``tool_choice`` "required" and a named function (the call's arguments validate against the
tool's parameters), bad schemas as 400s, and ``/metrics`` parsed with prometheus_client's parser, its counters
moving as requests run, behind the API key.
"""

from __future__ import annotations

import copy
import json
import random
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Literal

import pytest

pytest.importorskip("llguidance", reason="needs the serve extra (llguidance)")
pytest.importorskip("prometheus_client", reason="needs the serve extra (prometheus-client)")

from test_serve import REQUEST_TIMEOUT, Server  # noqa: E402  (skips without the serve extra)
from test_serve import _one_thread  # noqa: E402,F401

import openai  # noqa: E402
from json_tokenizer import EOS, make_json_model, make_json_tokenizer  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

KEY = "sk-structured-test"
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                                          "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}}]
SAMPLED = {"generation_config": json.dumps({"do_sample": True, "eos_token_id": EOS, "pad_token_id": 0})}


def valid(value, schema: dict = SCHEMA) -> bool:
    """``value`` (parsed JSON) valid against one of this file's small object schemas (checked by hand)."""
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    for key, rule in schema["properties"].items():
        v = value[key]
        if "enum" in rule and v not in rule["enum"]:
            return False
        if rule.get("type") == "integer" and not (type(v) is int and rule["minimum"] <= v <= rule["maximum"]):
            return False
    return True


class Reading(BaseModel):
    color: Literal["red", "green", "blue"]
    n: int = Field(ge=0, le=99)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    path = tmp_path_factory.mktemp("qwen4exp-json")
    tokenizer = make_json_tokenizer()
    template = copy.deepcopy(next(v for k, v in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in k))
    template["fields"]["content"]["close_pattern"] = r"\s*(?:<eos>|<\|im_end\|>)"     # (this tokenizer's EOS)
    tokenizer.response_template = template
    make_json_model(tokenizer, seed=5).save_pretrained(path)
    tokenizer.save_pretrained(path)
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with Server(path, "--cb-block-size", "16", "--cb-max-batch-tokens", "64", "--hebrus-capacity-tokens", "4096",
                "--speculative-tokens", "2", "--api-key", KEY, log=log) as srv:
        yield srv


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_TIMEOUT)


def messages(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"role": "user", "content": " ".join(f"w{rng.randrange(40)}" for _ in range(rng.randrange(2, 9)))}]


def response_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reading", "schema": schema, "strict": True}}


def assert_stopped_choices_valid(choices: list[tuple[str, str]], at_least: int) -> None:
    """choices: (text, finish_reason); the ones that stopped parse and validate, and at least ``at_least`` did."""
    stopped = [text for text, reason in choices if reason == "stop"]
    assert len(stopped) >= at_least, choices
    for text in stopped:
        assert valid(json.loads(text)), text


def metrics(server, key: str | None = KEY) -> tuple[int, dict]:
    """(status, {sample name + labels: value}) of GET /metrics."""
    req = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as err:
        return err.code, {}
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return status, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ------------------------------------------------------------------------------------------- response_format
def test_json_schema_chat_choices_that_stop_are_valid_streamed_or_not_with_n_and_logprobs(server):
    c = client(server)
    reply = c.chat.completions.create(model=server.model_dir, messages=messages(1), n=3, max_tokens=60,
                                      temperature=1.0, seed=7, logprobs=True, top_logprobs=3,
                                      response_format=response_format(), extra_body=SAMPLED)
    assert [ch.index for ch in reply.choices] == [0, 1, 2]
    assert_stopped_choices_valid([(ch.message.content, ch.finish_reason) for ch in reply.choices], at_least=3)
    for ch in reply.choices:
        assert all(e.logprob > float("-inf") and 1 <= len(e.top_logprobs) <= 3 for e in ch.logprobs.content)

    texts, reasons = defaultdict(str), {}
    for chunk in c.chat.completions.create(model=server.model_dir, messages=messages(2), n=2, max_tokens=60,
                                           temperature=0, stream=True, response_format=response_format()):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason
    assert set(reasons) == {0, 1}
    assert_stopped_choices_valid([(texts[i], reasons[i]) for i in range(2)], at_least=2)
    assert texts[0] == texts[1]                       # greedy choices are equal


def test_text_completions_take_response_format_streamed_or_not(server):
    c = client(server)
    reply = c.completions.create(model=server.model_dir, prompt="w1 w2 w3", n=2, max_tokens=60, logprobs=2,
                                 extra_body={"response_format": response_format()})
    assert_stopped_choices_valid([(ch.text, ch.finish_reason) for ch in reply.choices], at_least=2)
    texts, reasons = defaultdict(str), {}
    for chunk in c.completions.create(model=server.model_dir, prompt="w4 w5", max_tokens=60, stream=True,
                                      extra_body={"response_format": response_format()}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason
    assert_stopped_choices_valid([(texts[0], reasons[0])], at_least=1)

    # any JSON object: the grammar opens it; a choice that stops is a parsed object
    obj = c.completions.create(model=server.model_dir, prompt="w6", max_tokens=24, n=2,
                               extra_body={"response_format": {"type": "json_object"}})
    for ch in obj.choices:
        assert ch.text.startswith("{"), ch.text
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.text), dict)


def test_the_openai_clients_parse_with_a_pydantic_model(server):
    c = client(server)
    parse = c.beta.chat.completions.parse if hasattr(getattr(c, "beta", None), "chat") else c.chat.completions.parse
    for seed in range(3):
        reply = parse(model=server.model_dir, messages=messages(10 + seed), max_tokens=60, temperature=0,
                      response_format=Reading)
        ch = reply.choices[0]
        assert ch.finish_reason == "stop"
        assert isinstance(ch.message.parsed, Reading), ch.message.content
        assert valid(json.loads(ch.message.content))


# ------------------------------------------------------------------------------------------------ tool calls
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_choice_gives_a_call_whose_arguments_validate(server, stream):
    c = client(server)
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "add"}}]):
        ask = dict(model=server.model_dir, messages=messages(20 + i), tools=TOOLS, tool_choice=choice,
                   max_tokens=80, temperature=0)
        if not stream:
            ch = c.chat.completions.create(**ask).choices[0]
            calls = [(tc.function.name, tc.function.arguments) for tc in ch.message.tool_calls or []]
            reason = ch.finish_reason
        else:
            calls, reason = [], None
            for chunk in c.chat.completions.create(stream=True, **ask):
                for ch in chunk.choices:
                    calls += [(tc.function.name, tc.function.arguments) for tc in ch.delta.tool_calls or []]
                    reason = ch.finish_reason or reason
        assert reason == "tool_calls" and len(calls) == 1, (reason, calls)
        name, arguments = calls[0]
        assert name in tools and (choice == "required" or name == "add")
        assert valid(json.loads(arguments), tools[name]), arguments


# -------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("body, says", [
    ({"response_format": response_format({"type": "strin"})}, "strin"),
    ({"response_format": response_format({"$ref": "#/nowhere"})}, "nowhere"),
    ({"response_format": response_format({"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(4000)}})}, "too large"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "needs `tools`"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_a_bad_schema_or_tool_choice_is_a_400_naming_it_before_anything_is_queued(server, body, says):
    _, before = metrics(server)
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model=server.model_dir, messages=messages(30), max_tokens=4,
                                               extra_body=body)
    assert says in err.value.response.text, err.value.response.text
    _, after = metrics(server)
    assert value(after, "hebrus_requests_finished_total", outcome="failed") == \
        value(before, "hebrus_requests_finished_total", outcome="failed")
    assert value(after, "hebrus_prompt_tokens_total") == value(before, "hebrus_prompt_tokens_total")


# --------------------------------------------------------------------------------------------------- metrics
def test_metrics_parse_and_move_as_requests_run_behind_the_api_key(server):
    assert metrics(server, key=None)[0] == 401 and metrics(server, key="wrong")[0] == 401
    status, before = metrics(server)
    assert status == 200
    c = client(server)
    replies = [c.chat.completions.create(model=server.model_dir, messages=messages(40 + i), max_tokens=6,
                                         temperature=0) for i in range(3)]
    status, after = metrics(server)
    assert status == 200
    generated = sum(r.usage.completion_tokens for r in replies)
    prompt = sum(r.usage.prompt_tokens for r in replies)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("hebrus_http_requests_total", endpoint="/v1/chat/completions", status="200") == 3
    assert moved("hebrus_generation_tokens_total") == generated
    assert moved("hebrus_prompt_tokens_total") == prompt
    assert sum(moved("hebrus_requests_finished_total", outcome=o) for o in ("stop", "length")) == 3
    assert moved("hebrus_time_to_first_token_seconds_count") == 3
    assert moved("hebrus_inter_token_latency_seconds_count") == generated - 3
    assert moved("hebrus_step_seconds_count") >= max(r.usage.completion_tokens for r in replies)
    assert moved("hebrus_engine_steps_total") >= 1 and moved("hebrus_prefill_tokens_total") >= 1
    assert value(after, "hebrus_engine_up") == 1
    assert value(after, "hebrus_requests_running") == 0 and value(after, "hebrus_requests_waiting") == 0
    used, free = (value(after, "hebrus_cache_cells", state=s) for s in ("used", "free"))
    assert used + free == 4096 and free > 0 and used > 0             # (finished requests' prefixes are kept)
    assert 0 < value(after, "hebrus_cache_kept_cells")
    for name in ("hebrus_preemptions_total", "hebrus_spec_drafted_tokens_total", "hebrus_spec_accepted_tokens_total",
                 "hebrus_prompt_cache_file_hits_total", "hebrus_prefix_reused_tokens_total"):
        assert (name, ()) in after, name
    # a second identical prompt reuses the first one's prefix
    again = metrics(server)[1]
    c.chat.completions.create(model=server.model_dir, messages=messages(40), max_tokens=2, temperature=0)
    assert value(metrics(server)[1], "hebrus_prefix_reused_tokens_total") > \
        value(again, "hebrus_prefix_reused_tokens_total")


def test_the_sequential_path_refuses_structured_output_it_would_ignore():
    from hebrus_torch.serving.validation import check_body

    body = {"messages": [{"role": "user", "content": "w1"}]}
    assert check_body(dict(body, response_format={"type": "json_object"}), "chat").beyond_transformers == \
        ["response_format"]
    assert check_body(dict(body, tools=TOOLS, tool_choice="required"), "chat").beyond_transformers == ["tool_choice"]
    assert check_body(dict(body, tools=TOOLS, tool_choice="auto", response_format={"type": "text"}),
                      "chat").beyond_transformers == []
