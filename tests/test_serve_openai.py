"""``python -m hebrus_torch.serve``: the OpenAI parameters of the batching path (issue 27) over loopback with the
official ``openai`` client: ``n`` choices (the prompt prefilled once), ``logprobs`` / ``top_logprobs`` (checked
against ``log_softmax`` of the model's logits computed here), ``logit_bias``, presence / frequency penalties,
``stop`` strings cut off (one split across tokens), ``seed``, and the 400s, streamed and not.

The server and helpers are tests/test_serve.py's (a random tiny Qwen4Exp and a word-level tokenizer whose
words decode to ``w<i>`` joined by spaces)."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_serve import (EOS, MAX_TOKENS, REQUEST_TIMEOUT, Server, WORDS, clear_chats, http,  # noqa: F401
                        make_model, make_tokenizer, prompt_ids, reference, save_checkpoint, user_message)
from test_serve import _one_thread, checkpoint, server  # noqa: F401  (its fixtures: one server per module)

import openai  # noqa: E402

SAMPLED = {"generation_config": json.dumps({"do_sample": True, "eos_token_id": EOS, "pad_token_id": 0})}
NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1, "pad_token_id": 0})}


def chat(server, messages, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return server.client().chat.completions.create(model=server.model_dir, messages=messages, **kwargs)


def streamed_choices(stream) -> tuple[dict, dict, dict, list]:
    """(text per index, finish_reason per index, logprobs content per index, usages) of a chat stream."""
    texts, reasons, lps, usages = defaultdict(str), {}, defaultdict(list), []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
            if c.logprobs is not None and c.logprobs.content:
                lps[c.index] += c.logprobs.content
    return dict(texts), reasons, dict(lps), usages


def model_logprobs(model, ids: list[int], generated: list[int], presence: float = 0.0, frequency: float = 0.0):
    """log_softmax of the model's logits (after OpenAI's penalties over the tokens generated before) at each
    generated position, computed with one full forward."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + generated])).logits[0, len(ids) - 1:-1].double()
    out = []
    for j in range(len(generated)):
        row = logits[j].clone()
        for t in set(generated[:j]):
            row[t] -= presence + frequency * generated[:j].count(t)
        out.append(torch.log_softmax(row, -1))
    return out


# ----------------------------------------------------------------------------------------------------- n
def test_n_greedy_choices_are_equal_and_the_prompt_is_prefilled_once(server, checkpoint):
    _, model, tokenizer = checkpoint
    (messages, text, ids, gen), = clear_chats(model, tokenizer, 1, seed=31)
    chat(server, user_message(random.Random(0), 3), max_tokens=1)       # the engine exists
    assert http("POST", f"{server.url}/hebrus/prefix_cache/clear").status_code == 200
    before = server.settled_stats()
    reply = chat(server, messages, n=3, temperature=0)
    after = server.settled_stats()
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [text] * 3
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 3 * len(gen)
    delta = {k: after["counters"][k] - before["counters"][k] for k in ("prefill_tokens", "prefix_hit_tokens",
                                                                        "forked_choices")}
    assert delta == {"prefill_tokens": len(ids), "prefix_hit_tokens": 0, "forked_choices": 2}, delta

    texts, reasons, _, usages = streamed_choices(chat(server, messages, n=3, temperature=0, stream=True))
    assert texts == {0: text, 1: text, 2: text} and set(reasons) == {0, 1, 2}
    assert [u.completion_tokens for u in usages] == [3 * len(gen)]


def test_n_sampled_choices_differ_and_a_seed_reproduces_them_streamed_or_not(server, checkpoint):
    _, model, tokenizer = checkpoint
    messages = user_message(random.Random(32), 6)
    ask = dict(n=3, temperature=1.5, max_tokens=16, seed=1234, extra_body=SAMPLED)
    with ThreadPoolExecutor(3) as pool:
        a, b = pool.map(lambda _: chat(server, messages, **ask), range(2))
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) >= 2, texts                          # each choice its own stream
    one = chat(server, messages, **{**ask, "n": 1})
    assert one.choices[0].message.content == texts[0]           # choice 0 is the reply with n = 1
    streamed, _, _, _ = streamed_choices(chat(server, messages, stream=True, **ask))
    assert [streamed[i] for i in range(3)] == texts
    other = chat(server, messages, **{**ask, "seed": 4321})
    assert [c.message.content for c in other.choices] != texts


# ------------------------------------------------------------------------------------------------ logprobs
def test_chat_logprobs_and_top_logprobs_are_the_models_log_softmax_streamed_or_not(server, checkpoint):
    _, model, tokenizer = checkpoint
    (messages, text, ids, gen), = clear_chats(model, tokenizer, 1, seed=33)
    reply = chat(server, messages, temperature=0, logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(gen)
    want = model_logprobs(model, ids, gen)
    for j, entry in enumerate(content):
        assert entry.token == tokenizer.decode([gen[j]]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(want[j][gen[j]]), abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 5
        assert entry.top_logprobs[0].token == entry.token             # greedy: the chosen token is the top one
        top = torch.topk(want[j], 5)
        assert [tokenizer.convert_tokens_to_ids(t.token) for t in entry.top_logprobs] == top.indices.tolist()
        assert tops == pytest.approx(top.values.tolist(), abs=1e-4)
    _, _, lps, _ = streamed_choices(chat(server, messages, temperature=0, logprobs=True, top_logprobs=5,
                                         stream=True))
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in lps[0]] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in content]
    assert [e.logprob for e in lps[0]] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert chat(server, messages, temperature=0).choices[0].logprobs is None


def test_a_speculating_server_gives_the_models_logprobs_and_alternatives(checkpoint, tmp_path):
    """With --draft-model (the target drafts for itself: every draft accepted), the tokens a verification
    emits carry the log-probabilities and top alternatives of the model's log_softmax, as decoded tokens do."""
    path, model, tokenizer = checkpoint
    (messages, text, ids, gen), = clear_chats(model, tokenizer, 1, seed=35)
    with Server(path, "--speculative-tokens", "3", "--draft-model", str(path), "--hebrus-capacity-tokens", "2048",
                log=tmp_path / "server.log") as srv:
        reply = chat(srv, messages, temperature=0, logprobs=True, top_logprobs=4)
        counters = srv.settled_stats()["counters"]
    assert counters["spec_accepted_tokens"] > 0, counters
    assert reply.choices[0].message.content == text
    content = reply.choices[0].logprobs.content
    assert len(content) == len(gen)
    want = model_logprobs(model, ids, gen)
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(want[j][gen[j]]), abs=1e-4)
        top = torch.topk(want[j], 4)
        assert [tokenizer.convert_tokens_to_ids(t.token) for t in entry.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_sampled_logprobs_are_after_temperature(server, checkpoint):
    _, model, tokenizer = checkpoint
    messages = user_message(random.Random(34), 5)
    ids = prompt_ids(tokenizer, messages)
    reply = chat(server, messages, temperature=0.7, seed=5, max_tokens=6, logprobs=True, top_logprobs=3,
                 extra_body=NO_EOS | {"generation_config": json.dumps({"do_sample": True, "eos_token_id": -1,
                                                                      "pad_token_id": 0})})
    content = reply.choices[0].logprobs.content
    gen = [tokenizer.convert_tokens_to_ids(e.token) for e in content]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + gen])).logits[0, len(ids) - 1:-1].double()
    for j, entry in enumerate(content):
        lp = torch.log_softmax(logits[j] / 0.7, -1)
        assert entry.logprob == pytest.approx(float(lp[gen[j]]), abs=1e-4)
        if entry.token in [t.token for t in entry.top_logprobs]:     # the chosen token, when in the top list
            assert gen[j] in torch.topk(lp, 3).indices.tolist()


def test_legacy_completions_logprobs_streamed_or_not(server, checkpoint):
    _, model, tokenizer = checkpoint
    client = server.client()
    prompt = "w3 w17 w9 w22"
    ids = list(tokenizer(prompt)["input_ids"])
    reply = client.completions.create(model=server.model_dir, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                      extra_body=NO_EOS)
    lp = reply.choices[0].logprobs
    gen = [tokenizer.convert_tokens_to_ids(t) for t in lp.tokens]
    assert len(gen) == 5 and reply.choices[0].text == tokenizer.decode(gen)
    want = model_logprobs(model, ids, gen)
    for j in range(5):
        assert lp.token_logprobs[j] == pytest.approx(float(want[j][gen[j]]), abs=1e-4)
        assert len(lp.top_logprobs[j]) == 3 and lp.tokens[j] in lp.top_logprobs[j]
        for t, v in lp.top_logprobs[j].items():
            assert v == pytest.approx(float(want[j][tokenizer.convert_tokens_to_ids(t)]), abs=1e-4)
    assert lp.text_offset == [reply.choices[0].text.index(t, o) for t, o in zip(lp.tokens, lp.text_offset)]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    tokens, texts = [], ""
    for chunk in client.completions.create(model=server.model_dir, prompt=prompt, max_tokens=5, temperature=0,
                                           logprobs=3, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            texts += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
    assert tokens == lp.tokens and texts == reply.choices[0].text


# ------------------------------------------------------------------------------- bias, penalties, stop
def test_logit_bias_forces_and_bans_a_token(server, checkpoint):
    _, model, tokenizer = checkpoint
    (messages, text, ids, gen), = clear_chats(model, tokenizer, 1, seed=35, plain=True)
    forced = tokenizer.convert_tokens_to_ids("w5")
    reply = chat(server, messages, temperature=0, max_tokens=4, logit_bias={str(forced): 100})
    assert reply.choices[0].message.content == "w5 w5 w5 w5"
    sampled = chat(server, messages, temperature=1.5, max_tokens=4, seed=3, logit_bias={str(forced): 100},
                   extra_body=SAMPLED)
    assert sampled.choices[0].message.content == "w5 w5 w5 w5"
    banned = chat(server, messages, temperature=0, max_tokens=1, logit_bias={str(gen[0]): -100})
    assert banned.choices[0].message.content != tokenizer.decode(gen[:1])


def test_presence_and_frequency_penalties_are_openais(server, checkpoint):
    _, model, tokenizer = checkpoint
    messages = user_message(random.Random(36), 4)
    ids = prompt_ids(tokenizer, messages)
    reply = chat(server, messages, temperature=0, max_tokens=8, presence_penalty=0.5, frequency_penalty=1.5,
                 logprobs=True, extra_body=NO_EOS)
    content = reply.choices[0].logprobs.content
    gen = [tokenizer.convert_tokens_to_ids(e.token) for e in content]
    want = model_logprobs(model, ids, gen, presence=0.5, frequency=1.5)
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(want[j][gen[j]]), abs=1e-4)
        assert float(want[j].max() - want[j][gen[j]]) < 1e-4         # greedy on the penalised logits
    assert reply.choices[0].message.content == tokenizer.decode(gen)


def test_a_stop_string_split_across_tokens_ends_the_reply_without_it(server, checkpoint):
    _, model, tokenizer = checkpoint
    (messages, text, ids, gen), = clear_chats(model, tokenizer, 1, seed=37, plain=True)
    words = text.split(" ")
    assert len(words) >= 4, text
    stop = words[1][-1] + " " + words[2][:2]           # the end of one token, a space and the start of the next
    expected = text[:text.index(stop)]
    reply = chat(server, messages, temperature=0, stop=[stop, "zzz"])
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 3
    texts, reasons, _, _ = streamed_choices(chat(server, messages, temperature=0, stop=stop, stream=True, n=2))
    assert texts == {0: expected, 1: expected} and reasons == {0: "stop", 1: "stop"}
    client = server.client()
    legacy = client.completions.create(model=server.model_dir, prompt="w3 w17 w9", max_tokens=6, temperature=0,
                                       extra_body=NO_EOS)
    full = legacy.choices[0].text
    cut = full.split(" ")
    stop = cut[0][-1] + " " + cut[1][:2]
    again = client.completions.create(model=server.model_dir, prompt="w3 w17 w9", max_tokens=6, temperature=0,
                                      stop=stop, extra_body=NO_EOS)
    assert again.choices[0].text == full[:full.index(stop)] and again.choices[0].finish_reason == "stop"
    assert legacy.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------------ 400s
@pytest.mark.parametrize("path, extra, name", [
    ("chat", {"n": 0}, "n"), ("chat", {"n": 17}, "n"), ("chat", {"n": 1.5}, "n"), ("chat", {"n": "2"}, "n"),
    ("chat", {"n": True}, "n"), ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": -1, "logprobs": True}, "top_logprobs"), ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"), ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"), ("chat", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("chat", {"logit_bias": [5]}, "logit_bias"), ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completion", {"logprobs": 6}, "logprobs"), ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"n": 99}, "n"), ("completion", {"best_of": 2}, "best_of"), ("completion", {"echo": True}, "echo"),
    ("completion", {"suffix": "w1"}, "suffix")])
def test_bad_values_are_400s_naming_the_parameter(server, path, extra, name):
    if path == "chat":
        body = {"model": server.model_dir, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}
        url = f"{server.url}/v1/chat/completions"
    else:
        body = {"model": server.model_dir, "prompt": "w1 w2", "max_tokens": 2}
        url = f"{server.url}/v1/completions"
    for stream in (False, True):
        r = http("POST", url, dict(body, stream=stream, **extra))
        assert r.status_code == 400 and name in r.text, (extra, r.status_code, r.text)


def test_bad_requests_do_not_disturb_others_and_defaults_pass(server, checkpoint):
    _, model, tokenizer = checkpoint
    chats = clear_chats(model, tokenizer, 4, seed=38)
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(chat, server, c[0], temperature=0, n=2) for c in chats]
        for extra in ({"n": 0}, {"logit_bias": {"999999": 1}}, {"top_logprobs": 30, "logprobs": True}):
            with pytest.raises(openai.BadRequestError):
                chat(server, chats[0][0], **extra)
        for (_, text, _, _), fut in zip(chats, good):
            assert [c.message.content for c in fut.result(timeout=REQUEST_TIMEOUT).choices] == [text, text]
    r = http("POST", f"{server.url}/v1/chat/completions",
             {"model": server.model_dir, "messages": chats[0][0], "max_tokens": 2, "n": 1, "logprobs": False,
              "top_logprobs": 0, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0})
    assert r.status_code == 200, r.text
    stats = server.settled_stats()
    assert stats["fatal_error"] is None and stats["live_sequences"] == stats["kept_sequences"]


def test_the_sequential_path_refuses_what_it_would_ignore(checkpoint, tmp_path):
    """``--no-continuous-batching`` is transformers' ``generate`` path: n, logprobs, logit_bias and the penalties
    would be ignored there (or, for frequency_penalty, mean a repetition penalty), so they are 400s."""
    path, model, tokenizer = checkpoint
    (messages, text, _, _), = clear_chats(model, tokenizer, 1, seed=39)
    with Server(path, "--no-continuous-batching", log=tmp_path / "server.log") as srv:
        for extra, name in (({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                            ({"presence_penalty": 0.5}, "presence_penalty"),
                            ({"frequency_penalty": 0.5}, "frequency_penalty")):
            with pytest.raises(openai.BadRequestError) as err:
                chat(srv, messages, temperature=0, **extra)
            assert f"`{name}` needs continuous batching" in err.value.response.text
        assert chat(srv, messages, temperature=0, n=1).choices[0].message.content == text


# ------------------------------------------------------------------------------------ request ids, /v1/responses
def post(url: str, body: dict, headers: dict, timeout: float = 30.0):
    """``http`` with extra headers: (status, text)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_duplicate_request_id_is_a_409_naming_it_and_the_first_request_completes(server, checkpoint):
    """Two requests with the same X-Request-ID: the second replaced the first's result handler and got a 500,
    and the first never got its answer."""
    _, model, tokenizer = checkpoint
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.chat.completions.create(model=server.model_dir, messages=user_message(random.Random(41), 6),
                                            max_tokens=120, temperature=0, stream=True, extra_body=NO_EOS,
                                            extra_headers={"X-Request-ID": "dup-41"})
    texts, usages, second = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        if chunk.choices and chunk.choices[0].delta.content:
            texts.append(chunk.choices[0].delta.content)
            if second is None:      # the first is running: the same id again, streamed and not
                second = [post(f"{server.url}/v1/chat/completions",
                               {"model": server.model_dir, "messages": user_message(random.Random(42), 3),
                                "max_tokens": 2, "stream": stream_it}, {"X-Request-ID": "dup-41"})
                          for stream_it in (False, True)]
    assert second is not None and all(status == 409 and "dup-41" in text for status, text in second), second
    assert usages and usages[-1].completion_tokens == 120 and len(texts) >= 100
    stats = server.settled_stats()
    assert stats["fatal_error"] is None and stats["live_sequences"] == stats["kept_sequences"]


@pytest.mark.parametrize("extra, name", [
    ({"top_logprobs": 3}, "top_logprobs"), ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"input": []}, "input"),
    ({"input": " ".join(["w1"] * 2100)}, "does not fit")])      # (the engine's refusal, before any event)
def test_responses_refuse_what_they_would_ignore_or_cannot_take_with_a_400(server, extra, name):
    """/v1/responses accepted `top_logprobs` and `include: ["message.output_text.logprobs"]` and returned no
    log-probabilities, accepted a negative temperature, and answered fields outside its schema with 422."""
    body = {"model": server.model_dir, "input": "w1 w2", "max_output_tokens": 2, **extra}
    for stream in (False, True):
        r = http("POST", f"{server.url}/v1/responses", dict(body, stream=stream))
        assert r.status_code == 400 and f"{name}" in r.text, (extra, stream, r.status_code, r.text)


def test_responses_serve_the_greedy_reply_streamed_or_not(server, checkpoint):
    _, model, tokenizer = checkpoint
    (messages, text, _, _), = clear_chats(model, tokenizer, 1, seed=43)
    body = {"model": server.model_dir, "input": messages[0]["content"], "max_output_tokens": MAX_TOKENS,
            "temperature": 0, "top_logprobs": 0, "include": []}
    r = http("POST", f"{server.url}/v1/responses", dict(body, stream=False))
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == text
    r = http("POST", f"{server.url}/v1/responses", dict(body, stream=True))
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][-1]["content"][0]["text"] == text
