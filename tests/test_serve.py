"""``python -m hebrus_torch.serve``: transformers' own server on the hebrus engine, driven over loopback.

Each server is a subprocess on 127.0.0.1 (a free port) serving a random tiny Qwen4Exp saved with
``save_pretrained`` next to a word-level tokenizer with a chat template built here (no downloads), driven
with the ``openai`` client. Every wait has a timeout and every server is stopped (SIGTERM, then SIGKILL)
when its fixture or test ends, so nothing here can hang CI. Skipped without the ``serve`` extra.

Greedy texts are compared with per-request ``model.generate`` on the same templated prompt; prompts are
chosen away from near ties (SPEC §8: a packed step's rows may differ from a 1-row call in the last bit).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(_mod, reason="needs the serve extra (pip install -e .[serve])")

import openai  # noqa: E402

from hf_models import modeling, tiny_indexer_config  # noqa: E402  (skips without transformers)

ROOT = Path(__file__).resolve().parents[1]
EOS = 3
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
VOCAB = 50
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIAL) - len(ROLES))]
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
MAX_TOKENS = 8
START_TIMEOUT = 180.0    # the CI box has 2 shared cores: importing torch + transformers takes a while
REQUEST_TIMEOUT = 120.0


# ------------------------------------------------------------------------------------ model + tokenizer
def make_tokenizer(template: str = TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + ROLES + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")      # words joined by spaces
    # only <eos> is special (dropped when decoding): every other id decodes to a word that encodes back to it,
    # so a reply sent back as the assistant turn re-renders to the tokens generated (as BPE text mostly does)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = template
    return fast


def make_model(seed: int = 0, vocab_size: int = VOCAB, **overrides):
    torch.manual_seed(seed)
    model = modeling.Qwen4ExpForCausalLM(tiny_indexer_config(vocab_size=vocab_size, **overrides)).eval()
    with torch.no_grad():  # transformers zero-initialises norms and the PLE conv: give every path a say
        for name, p in model.named_parameters():
            if "conv1d" in name or "norm" in name:
                p.normal_(0, 0.3)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


def save_checkpoint(path: Path, model=None, tokenizer=None) -> Path:
    model = model if model is not None else make_model()
    tokenizer = tokenizer if tokenizer is not None else make_tokenizer()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompt_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def reference(model, tokenizer, messages, max_new_tokens: int = MAX_TOKENS):
    """(text, prompt ids, generated ids, smallest top-1/top-2 logit gap) of greedy ``generate`` alone."""
    ids = prompt_ids(tokenizer, messages)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    gen = out.sequences[0, len(ids):].tolist()
    if EOS in gen:
        gen = gen[:gen.index(EOS) + 1]
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores[:len(gen)]]
    return tokenizer.decode(gen, skip_special_tokens=True), ids, gen, min(gaps)


def user_message(rng: random.Random, n: int) -> list[dict]:
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(n))}]


def clear_chats(model, tokenizer, count: int, seed: int = 0, min_gap: float = 1e-3, plain: bool = False):
    """``count`` single-turn chats whose greedy replies have no near tie (and, if ``plain``, no special token)."""
    rng = random.Random(seed)
    found = []
    for _ in range(40 * count):
        messages = user_message(rng, rng.randrange(1, 30))
        text, ids, gen, gap = reference(model, tokenizer, messages)
        if gap < min_gap or (plain and any(t < len(SPECIAL) + len(ROLES) for t in gen)):
            continue
        found.append((messages, text, ids, gen))
        if len(found) == count:
            return found
    raise AssertionError(f"only {len(found)} of {count} prompts away from near ties")


# --------------------------------------------------------------------------------------------- a server
class Reply:
    def __init__(self, status: int, body: bytes):
        self.status_code, self.text = status, body.decode(errors="replace")

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | dict | None = None, timeout: float = 30.0) -> Reply:
    """One plain HTTP request (stdlib only); 4xx/5xx are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, r.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, err.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m hebrus_torch.serve`` as a subprocess on loopback; a context manager that always stops it."""

    def __init__(self, model_dir: Path, *args: str, log: Path):
        self.model_dir = str(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hebrus_torch.serve", self.model_dir, "--host", "127.0.0.1", "--port",
             str(self.port), "--device", "cpu", "--log-level", "warning", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))

    def __enter__(self) -> "Server":
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if http("GET", f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise AssertionError(f"the server did not come up in {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._log.close()

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)

    def chat(self, messages, max_tokens: int = MAX_TOKENS, **kwargs):
        return self.client().chat.completions.create(model=self.model_dir, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, **kwargs)

    def stats(self) -> dict:
        r = http("GET", f"{self.url}/hebrus/stats")
        assert r.status_code == 200, r.text
        return r.json()

    def settled_stats(self, timeout: float = 60.0) -> dict:
        """Stats once nothing is queued or running."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.get("engine") is None or (s["running_requests"] == 0 and s["waiting_requests"] == 0):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still in flight after {timeout}s: {s}")
            time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4exp-tiny")
    model, tokenizer = make_model(), make_tokenizer()
    save_checkpoint(path, model, tokenizer)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """One server for the tests that leave the engine alive; stopped when they are done."""
    path, _, _ = checkpoint
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with Server(path, "--cb-block-size", "16", "--cb-max-batch-tokens", "64", "--hebrus-capacity-tokens", "2048",
                log=log) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


# ------------------------------------------------------------------------------------------------- tests
def test_sixteen_concurrent_chats_equal_generate_on_each_prompt(server, checkpoint):
    _, model, tokenizer = checkpoint
    chats = clear_chats(model, tokenizer, 16, seed=1)
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda c: server.chat(c[0]), chats))
    for (messages, text, ids, gen), reply in zip(chats, replies):
        assert reply.choices[0].message.content == text, messages
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(gen)
    stats = server.settled_stats()
    assert stats["fatal_error"] is None and stats["live_sequences"] == stats["kept_sequences"]


def test_streamed_chunks_concatenate_to_the_non_streamed_text(server, checkpoint):
    _, model, tokenizer = checkpoint
    (messages, text, _, _), = clear_chats(model, tokenizer, 1, seed=2)
    plain = server.chat(messages).choices[0].message.content
    chunks = [c.choices[0].delta.content or "" for c in server.chat(messages, stream=True) if c.choices]
    assert len([c for c in chunks if c]) > 1
    assert "".join(chunks) == plain == text
    assert server.model_dir in [m.id for m in server.client().models.list()]


def test_each_request_samples_with_its_own_settings(server, checkpoint):
    """transformers serve shares the first request's sampling settings; here each request keeps its own."""
    _, model, tokenizer = checkpoint
    (messages, text, _, gen), = clear_chats(model, tokenizer, 1, seed=7, plain=True)
    # the model's generation config is greedy (do_sample False, as transformers leaves it for a temperature)
    sampled = dict(temperature=1.5, top_p=0.95, seed=1234, extra_body={"generation_config": json.dumps(
        {"do_sample": True, "eos_token_id": EOS, "pad_token_id": 0})})
    ref_words = text.split(" ")
    stop = ref_words[2]
    expected = text[:text.index(stop)]             # the reply ends before the stop string (not returned)
    with ThreadPoolExecutor(5) as pool:
        a = pool.submit(server.chat, messages)
        b, c = (pool.submit(lambda: server.client().chat.completions.create(
            model=server.model_dir, messages=messages, max_tokens=32, **sampled)) for _ in range(2))
        d = pool.submit(server.chat, messages, MAX_TOKENS, stop=[stop])
        e = pool.submit(server.chat, messages, 32)
    assert a.result().choices[0].message.content == text
    assert b.result().choices[0].message.content == c.result().choices[0].message.content
    assert b.result().choices[0].message.content != e.result().choices[0].message.content   # it did sample
    assert d.result().choices[0].message.content == expected


def test_a_client_that_disconnects_mid_stream_cancels_its_request_and_frees_its_state(server, checkpoint):
    _, model, tokenizer = checkpoint
    server.chat(user_message(random.Random(3), 4))            # the engine exists; a kept prefix or two
    before = server.settled_stats()
    rng = random.Random(4)
    for _ in range(50):                                       # a reply that runs long without EOS
        messages = user_message(rng, rng.randrange(2, 20))
        if EOS not in reference(model, tokenizer, messages, max_new_tokens=200)[2]:
            break
    else:
        pytest.fail("no prompt runs 200 tokens without EOS")
    stream = server.chat(messages, max_tokens=1500, stream=True)
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 3:
            break
    stream.close()                                            # the client goes away mid-stream
    after = server.settled_stats()
    assert after["cancelled_requests"] == before["cancelled_requests"] + 1
    decoded = after["counters"]["decode_tokens"] - before["counters"]["decode_tokens"]
    assert decoded < 1500 - 1
    for key in ("free_cells", "live_sequences", "kept_sequences", "kept_tokens"):
        assert after[key] == before[key], (key, before, after)


def test_streams_closed_right_after_the_headers_are_all_cancelled(server, checkpoint):
    """16 streaming requests whose clients close the connection as soon as the response headers arrive: every
    one is cancelled (it used to depend on when the abandoned SSE generator was garbage-collected: 12/16 and
    15/16 in two of four runs, the rest decoding to the end)."""
    import http.client

    _, _, tokenizer = checkpoint
    rng = random.Random(8)
    server.chat(user_message(rng, 3))                         # the engine exists
    before = server.settled_stats()
    body = json.dumps({"model": server.model_dir, "messages": user_message(rng, 6), "max_tokens": 400,
                       "temperature": 0, "stream": True,
                       "generation_config": json.dumps({"eos_token_id": -1, "pad_token_id": 0})})

    def open_and_close(_):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        status = conn.getresponse().status        # the status line and headers, nothing of the body
        conn.sock.close()
        conn.close()
        return status

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(open_and_close, range(16))) == [200] * 16
    after = server.settled_stats(timeout=120)
    assert after["cancelled_requests"] - before["cancelled_requests"] == 16, (before, after)
    assert after["counters"]["decode_tokens"] - before["counters"]["decode_tokens"] < 16 * 399
    # nothing of theirs is left (cancelled requests are not kept; kept state may have yielded cells to them)
    assert after["live_sequences"] == after["kept_sequences"] <= before["kept_sequences"], (before, after)


def test_a_non_streaming_request_whose_client_goes_away_is_cancelled(server, checkpoint):
    """Issue 27: a non-streaming request whose client disconnects before the reply decoded to its end (nothing
    cancels a non-streaming handler); it is cancelled when the disconnect arrives and its state freed."""
    import http.client

    rng = random.Random(9)
    server.chat(user_message(rng, 3))                         # the engine exists
    before = server.settled_stats()
    body = json.dumps({"model": server.model_dir, "messages": user_message(rng, 6), "max_tokens": 1500,
                       "temperature": 0, "generation_config": json.dumps({"eos_token_id": -1, "pad_token_id": 0})})
    conns = []
    for _ in range(4):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        conns.append(conn)
    deadline = time.monotonic() + 60
    while server.stats()["running_requests"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)                                      # (the requests are in the engine)
    for conn in conns:                                        # the clients go away without reading a byte
        conn.sock.close()
        conn.close()
    after = server.settled_stats(timeout=120)
    assert after["cancelled_requests"] - before["cancelled_requests"] == 4, (before, after)
    assert after["counters"]["decode_tokens"] - before["counters"]["decode_tokens"] < 4 * 1499
    assert after["live_sequences"] == after["kept_sequences"] <= before["kept_sequences"], (before, after)


def test_a_second_chat_turn_prefills_only_its_new_tokens_and_equals_a_cold_start(server, checkpoint):
    _, model, tokenizer = checkpoint
    rng = random.Random(5)
    for _ in range(100):
        first = clear_chats(model, tokenizer, 1, seed=rng.randrange(10**6), plain=True)[0]
        messages2 = first[0] + [{"role": "assistant", "content": first[1]},
                                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(7))}]
        text2, ids2, _, gap2 = reference(model, tokenizer, messages2)
        if gap2 >= 1e-3:
            break
    else:
        pytest.fail("no two-turn chat away from near ties")
    messages1, text1, ids1, gen1 = first
    reply1 = server.chat(messages1)
    assert reply1.choices[0].message.content == text1
    assert ids2[:len(ids1) + len(gen1) - (gen1[-1] == EOS)] == ids1 + [t for t in gen1 if t != EOS]
    s0 = server.settled_stats()
    reply2 = server.chat(messages2)
    s1 = server.settled_stats()
    reused = len(ids1) + len(gen1) - 1        # the first turn's state: its prompt and all but its last token
    prefilled = s1["counters"]["prefill_tokens"] - s0["counters"]["prefill_tokens"]
    hit = s1["counters"]["prefix_hit_tokens"] - s0["counters"]["prefix_hit_tokens"]
    assert reply2.usage.prompt_tokens == len(ids2)
    assert (hit, prefilled) == (reused, len(ids2) - reused)
    assert reply2.choices[0].message.content == text2

    r = http("POST", f"{server.url}/hebrus/prefix_cache/clear")    # a cold start of the same turn
    assert r.status_code == 200 and r.json()["evicted"] >= 1
    s2 = server.settled_stats()
    cold = server.chat(messages2)
    s3 = server.settled_stats()
    assert cold.choices[0].message.content == text2
    assert s3["counters"]["prefill_tokens"] - s2["counters"]["prefill_tokens"] == len(ids2)
    assert s3["counters"]["prefix_hit_tokens"] == s2["counters"]["prefix_hit_tokens"]


def test_bad_requests_get_4xx_while_others_complete_and_health_reports_a_dead_engine(checkpoint, tmp_path):
    path, model, tokenizer = checkpoint
    chats = clear_chats(model, tokenizer, 6, seed=6)
    with Server(path, "--hebrus-capacity-tokens", "256", "--hebrus-debug", log=tmp_path / "server.log") as srv:
        client = srv.client()
        with ThreadPoolExecutor(6) as pool:
            good = [pool.submit(srv.chat, c[0]) for c in chats]

            def refused(status: int, **body) -> str:
                with pytest.raises(openai.APIStatusError) as info:
                    client.chat.completions.create(**body)
                assert info.value.status_code == status, info.value
                return info.value.response.text

            base = dict(model=srv.model_dir, messages=chats[0][0], max_tokens=MAX_TOKENS)
            long_prompt = [{"role": "user", "content": " ".join(["w1"] * 300)}]
            assert "does not fit" in refused(400, **{**base, "messages": long_prompt})
            assert "max_tokens" in refused(400, **{**base, "max_tokens": 0})
            assert "max_tokens" in refused(400, **{**base, "max_tokens": -3})
            assert "pinned" in refused(400, **{**base, "model": "no-such-model"})
            assert "temperature" in refused(400, **{**base, "temperature": -1.0})
            assert "messages" in refused(400, **{**base, "messages": []})
            for content, where in (([1, 2], "[0]"), (["w1 w2"], "[0]"), ([{"text": "w1"}], "[0].type"),
                                   ([{"type": "text"}], "[0].text"), ([{"type": 3, "text": "w1"}], "[0].type"),
                                   ([{"type": "text", "text": "w1"}, {"type": "image_url", "image_url": {"url": "x"}}],
                                    "[1].type")):   # (transformers' message parsing answered these with a 500)
                text = refused(400, **{**base, "messages": [{"role": "user", "content": content}]})
                assert f"messages[0].content{where}" in text, (content, text)
            parts = [{"type": "text", "text": chats[0][0][0]["content"]}]
            assert srv.chat([{"role": "user", "content": parts}]).choices[0].message.content == chats[0][1]
            r = http("POST", f"{srv.url}/v1/chat/completions", b'{"messages": [')
            assert r.status_code == 422 and "JSON" in r.text
            r = http("POST", f"{srv.url}/v1/chat/completions", {"model": srv.model_dir})
            assert r.status_code == 400 and "messages" in r.text
            for (_, text, _, _), fut in zip(chats, good):
                assert fut.result(timeout=REQUEST_TIMEOUT).choices[0].message.content == text
        assert http("GET", f"{srv.url}/health").status_code == 200
        stats = srv.settled_stats()
        assert stats["live_sequences"] == stats["kept_sequences"] and stats["fatal_error"] is None

        # a dead engine: /health says so (transformers' own check of background_thread_status.fatal_error)
        assert http("POST", f"{srv.url}/hebrus/debug/kill_engine").status_code == 200
        with pytest.raises(openai.APIStatusError) as info:
            srv.chat(chats[1][0])
        assert info.value.status_code == 503
        health = http("GET", f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["reason"] == "cb_worker_dead"
        assert "killed" in srv.stats()["fatal_error"]
        with pytest.raises(openai.APIStatusError) as info:    # and later requests are refused at once
            srv.chat(chats[2][0])
        assert info.value.status_code == 503


def test_a_prompt_behind_kept_state_is_served_and_sigterm_under_load_stops_the_server_promptly(checkpoint, tmp_path):
    """The issue's case, scaled down: finished chats' kept state holds most of a 256-cell cache, then a prompt
    that fits the cache but not its free cells (it used to stop part-way, no token ever coming). Then SIGTERM
    with a queue of long streams in flight: the server exits within seconds, each stream ending with an error
    (uvicorn used to wait for every one of them to finish)."""
    path, model, tokenizer = checkpoint
    rng = random.Random(9)
    with Server(path, "--cb-block-size", "16", "--cb-max-batch-tokens", "64", "--hebrus-capacity-tokens", "256",
                "--hebrus-prefix-cache-tokens", "220", log=tmp_path / "server.log") as srv:
        for _ in range(5):
            srv.chat(user_message(rng, 30), max_tokens=8)
        kept = srv.settled_stats()["kept_tokens"]
        big = user_message(rng, 190)
        assert kept > 256 - len(prompt_ids(tokenizer, big)) - MAX_TOKENS, kept
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=srv.model_dir, messages=big, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.usage.prompt_tokens == len(prompt_ids(tokenizer, big)) and reply.usage.completion_tokens >= 1
        assert srv.settled_stats()["counters"]["prefix_evictions"] >= 1

        no_eos = {"generation_config": json.dumps({"eos_token_id": -1, "pad_token_id": 0})}
        first_token = __import__("threading").Event()

        def stream(i):
            pieces = []
            try:
                for chunk in client.chat.completions.create(model=srv.model_dir, messages=user_message(rng, 5),
                                                            max_tokens=240, temperature=0, stream=True,
                                                            extra_body=no_eos):
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
                        first_token.set()
            except Exception as err:  # noqa: BLE001 - the stream is cut by the shutdown
                return len(pieces), repr(err)
            return len(pieces), None

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, i) for i in range(8)]
            assert first_token.wait(60)
            t0 = time.monotonic()
            srv.proc.terminate()
            srv.proc.wait(timeout=30)
            took = time.monotonic() - t0
            ended = [f.result(timeout=30) for f in futures]
        assert took < 10, (took, srv.log_tail())
        assert sum(n for n, _ in ended) < 8 * 240 - 1, ended      # not decoded to the end


def test_a_qwen4exp_checkpoint_is_served_as_a_patched_text_only_llm(tmp_path):
    """transformers loads a Qwen4Exp checkpoint as the multimodal class and classes it MULTIMODAL (no
    continuous batching); the entry point loads Qwen4ExpForCausalLM, patched, whose manager is hebrus'."""
    from transformers.cli.serving import model_manager, utils
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig

    import hebrus_torch.integrations.transformers as hx
    from hebrus_torch import serve
    from hebrus_torch.engine.manager import HebrusBatchingManager

    text = tiny_indexer_config(vocab_size=VOCAB)
    config = Qwen4ExpConfig(text_config=text.to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=64))
    torch.manual_seed(0)
    modeling.Qwen4ExpForConditionalGeneration(config).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    name = f"{tmp_path}@main"

    stock = model_manager.ModelManager(device="cpu", continuous_batching=True)
    loaded = stock._load_model(name)
    assert type(loaded).__name__ == "Qwen4ExpForConditionalGeneration"
    assert stock.get_model_modality(loaded) == utils.Modality.MULTIMODAL
    assert not utils.GenerationState(continuous_batching=True).use_continuous_batching(loaded, utils.Modality.MULTIMODAL)

    ours = serve._model_manager_class()(device="cpu", continuous_batching=True)
    model, tokenizer = ours.load_model_and_processor(name)
    assert type(model).__name__ == "Qwen4ExpForCausalLM" and hx.is_applied(model)
    modality = ours.get_model_modality(model, processor=tokenizer)
    assert modality == utils.Modality.LLM
    assert serve._generation_state_class()(continuous_batching=True).use_continuous_batching(model, modality)
    assert isinstance(model.init_continuous_batching(), HebrusBatchingManager)
    with torch.inference_mode():    # the same weights: the text model's logits are the multimodal model's
        x = torch.tensor([prompt_ids(make_tokenizer(), [{"role": "user", "content": "w1 w2 w3"}])])
        torch.testing.assert_close(model(input_ids=x).logits, loaded(input_ids=x).logits, rtol=1e-4, atol=1e-4)
    ours.shutdown()


# ------------------------------------------------------------------------------------------------ API key
def test_an_api_key_is_required_on_the_api_but_not_on_health(checkpoint, tmp_path):
    path, model, tokenizer = checkpoint
    key = "sk-hebrus-test-0123456789"
    with Server(path, "--api-key", key, "--cb-block-size", "16", "--hebrus-capacity-tokens", "1024",
                log=tmp_path / "server.log") as srv:
        assert http("GET", f"{srv.url}/health").status_code == 200
        (messages, text, _, _), = clear_chats(model, tokenizer, 1, seed=5)
        for wrong in ("unused", key[:-1], key + "0"):
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=wrong, max_retries=0, timeout=REQUEST_TIMEOUT)
            with pytest.raises(openai.AuthenticationError) as err:
                client.chat.completions.create(model=srv.model_dir, messages=messages, max_tokens=4)
            assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        for route in ("/v1/models", "/hebrus/stats"):
            r = http("GET", srv.url + route)
            assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error", route
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT)
        reply = good.chat.completions.create(model=srv.model_dir, messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0)
        assert reply.choices[0].message.content == text
        assert srv.model_dir in [m.id for m in good.models.list()]


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from hebrus_torch import serve
    from hebrus_torch.serving import app, cli, settings

    seen = []
    monkeypatch.setattr(cli, "_run_serve", lambda args: seen.append(settings.current().api_key))
    monkeypatch.setattr(app, "patch_transformers_serve", settings.install)
    monkeypatch.setattr(settings, "_current", serve.HebrusServeSettings())
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    serve.main(["model-dir"])
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    serve.main(["model-dir"])
    serve.main(["model-dir", "--api-key", "from-flag"])
    assert seen == [None, "from-env", "from-flag"]


# ------------------------------------------------------------------------------------------------ prompt cache
def two_turn_chat(model, tokenizer, seed: int):
    """(messages1, text1, ids1, gen1, messages2, text2, ids2): a two-turn chat away from near ties whose
    second prompt extends the first turn's tokens."""
    rng = random.Random(seed)
    for _ in range(100):
        first = clear_chats(model, tokenizer, 1, seed=rng.randrange(10**6), plain=True)[0]
        messages2 = first[0] + [{"role": "assistant", "content": first[1]},
                                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(7))}]
        text2, ids2, _, gap2 = reference(model, tokenizer, messages2)
        if gap2 >= 1e-3:
            return (*first, messages2, text2, ids2)
    pytest.fail("no two-turn chat away from near ties")


@pytest.fixture(scope="module")
def warm_prompt_cache(checkpoint, tmp_path_factory):
    """A prompt-cache directory after a server answered a chat's first turn and was stopped (SIGTERM)."""
    path, model, tokenizer = checkpoint
    chat = two_turn_chat(model, tokenizer, seed=8)
    directory = tmp_path_factory.mktemp("prompt-cache")
    with Server(path, "--cb-block-size", "16", "--prompt-cache-dir", str(directory),
                log=directory.parent / "turn1.log") as srv:
        assert srv.chat(chat[0]).choices[0].message.content == chat[1]
        stats = srv.settled_stats()
        assert stats["counters"]["prompt_cache_writes"] == 1 and stats["prompt_cache_files"] == 1
        with pytest.raises(AssertionError, match="in use by another engine"):   # one server per directory
            with Server(path, "--prompt-cache-dir", str(directory), log=directory.parent / "second.log"):
                pass
    return directory, chat


def test_after_a_restart_the_second_turn_prefills_only_its_new_tokens_from_the_files(checkpoint, warm_prompt_cache,
                                                                                     tmp_path):
    path, _, _ = checkpoint
    directory, (messages1, text1, ids1, gen1, messages2, text2, ids2) = warm_prompt_cache
    work = tmp_path / "cache"
    shutil.copytree(directory, work)
    with Server(path, "--cb-block-size", "16", "--prompt-cache-dir", str(work), log=tmp_path / "turn2.log") as srv:
        reply = srv.chat(messages2)
        stats = srv.settled_stats()
    assert reply.choices[0].message.content == text2
    reused = len(ids1) + len(gen1) - 1
    c = stats["counters"]
    assert (c["prompt_cache_hits"], c["prompt_cache_hit_tokens"], c["prompt_cache_skipped_files"]) == (1, reused, 0)
    assert c["prefill_tokens"] == len(ids2) - reused


def test_a_corrupted_prompt_cache_is_skipped_with_one_warning_and_changes_no_answer(checkpoint, warm_prompt_cache,
                                                                                    tmp_path):
    path, _, _ = checkpoint
    directory, (*_, messages2, text2, ids2) = warm_prompt_cache
    work = tmp_path / "cache"
    shutil.copytree(directory, work)
    entry, = work.glob("*.hpc")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0x01                      # one flipped bit in the saved state
    entry.write_bytes(bytes(data))
    (work / "garbage.hpc").write_bytes(b"\0" * 100)
    log = tmp_path / "corrupt.log"
    with Server(path, "--cb-block-size", "16", "--prompt-cache-dir", str(work), log=log) as srv:
        reply = srv.chat(messages2)
        again = srv.chat(messages2)
        stats = srv.settled_stats()
    assert reply.choices[0].message.content == again.choices[0].message.content == text2
    c = stats["counters"]
    assert c["prompt_cache_hits"] == 0 and c["prompt_cache_skipped_files"] == 2
    text = log.read_text(errors="replace")
    for name in (entry.name, "garbage.hpc"):
        assert text.count(f"skipping {work / name}") == 1, text[-3000:]


def test_parameters_the_server_would_ignore_are_refused(server):
    """transformers serve logs `best_of`, `echo` and `suffix` once and answers as if they were absent: a client
    asking for them gets a 400 naming the parameter instead. Their default values pass. (n, logprobs,
    top_logprobs, logit_bias and the penalties are honoured: tests/test_serve_openai.py.)"""
    for extra in ({"best_of": 2}, {"echo": True}, {"suffix": "w1"}):
        r = http("POST", f"{server.url}/v1/completions",
                 {"model": server.model_dir, "prompt": "w1 w2", "max_tokens": 2, **extra})
        assert r.status_code == 400 and f"`{next(iter(extra))}`" in r.text, (extra, r.status_code, r.text)
    r = http("POST", f"{server.url}/v1/completions",
             {"model": server.model_dir, "prompt": "w1 w2", "max_tokens": 2, "best_of": 1, "echo": False})
    assert r.status_code == 200, r.text


def test_speculative_serving_gives_the_plain_replies_and_counts_its_drafts(checkpoint, tmp_path):
    """--speculative-tokens (prompt lookup) and --draft-model: greedy replies equal generate's; the stats
    count drafted, accepted and verified tokens."""
    path, model, tokenizer = checkpoint
    chats = [(messages, text) for messages, text, _, _ in clear_chats(model, tokenizer, 4, seed=9)]
    for args in (("--speculative-tokens", "4"), ("--speculative-tokens", "3", "--draft-model", str(path))):
        with Server(path, *args, "--cb-block-size", "16", "--hebrus-capacity-tokens", "2048",
                    log=tmp_path / "server.log") as srv:
            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(lambda c: srv.chat(c[0]), chats))
            for (messages, text), reply in zip(chats, replies):
                assert reply.choices[0].message.content == text, (args, messages)
            counters = srv.settled_stats()["counters"]
            assert counters["spec_verify_rows"] > 0 and counters["spec_drafted_tokens"] > 0, counters
            if "--draft-model" in args:          # the target drafts for itself: every draft is accepted
                assert counters["spec_accepted_tokens"] == counters["spec_drafted_tokens"], counters


def test_bad_speculative_flags_are_refused():
    from hebrus_torch import serve

    for argv, match in ((["m", "--speculative-tokens", "40"], "speculative-tokens"),
                        (["m", "--draft-model", "/nonexistent/dir"], "draft-model"),
                        (["m", "--speculative-method", "mtp", "--draft-model", "."], "leave --draft-model out"),
                        (["m", "--speculative-disable-by-batch-size", "-1"], "disable-by-batch-size"),
                        (["m", "--speculative-method", "mtp", "--speculative-confidence-threshold", "1.5"],
                         r"confidence-threshold must be in \[0, 1\)"),
                        (["m", "--speculative-method", "mtp", "--speculative-confidence-threshold", "nan"],
                         r"confidence-threshold must be in \[0, 1\)"),
                        (["m", "--speculative-confidence-threshold", "0.2"], "mtp only"),
                        (["m", "--speculative-method", "mtp", "--speculative-first-token-threshold", "-0.1"],
                         r"first-token-threshold must be in \[0, 1\)"),
                        (["m", "--speculative-first-token-threshold", "0.2"], "first-token-threshold applies to "
                                                                              "--speculative-method mtp only")):
        with pytest.raises(SystemExit, match=match):
            serve.main(argv)


def test_speculative_flags_make_the_engine_s_speculative_config():
    from hebrus_torch.engine.speculative import (DEFAULT_CONFIDENCE_THRESHOLD, DEFAULT_DISABLE_BY_BATCH_SIZE,
                                                 DEFAULT_FIRST_TOKEN_THRESHOLD)
    from hebrus_torch.serving.loading import speculative_config
    from hebrus_torch.serving.settings import HebrusServeSettings

    assert speculative_config(HebrusServeSettings()) is None
    plain = speculative_config(HebrusServeSettings(speculative_tokens=4))
    assert (plain.num_draft_tokens, plain.method, plain.disable_by_batch_size) == (4, "ngram",
                                                                                  DEFAULT_DISABLE_BY_BATCH_SIZE)
    mtp = speculative_config(HebrusServeSettings(speculative_method="mtp", speculative_disable_by_batch_size=1))
    assert (mtp.num_draft_tokens, mtp.method, mtp.disable_by_batch_size) == (3, "mtp", 1)
    unlimited = speculative_config(HebrusServeSettings(speculative_tokens=2, speculative_disable_by_batch_size=0))
    assert unlimited.disable_by_batch_size is None
    assert mtp.confidence_threshold == DEFAULT_CONFIDENCE_THRESHOLD
    sure = speculative_config(HebrusServeSettings(speculative_method="mtp", speculative_confidence_threshold=0.3))
    assert (sure.method, sure.confidence_threshold) == ("mtp", 0.3)
    off = speculative_config(HebrusServeSettings(speculative_method="mtp", speculative_confidence_threshold=0.0))
    assert off.confidence_threshold == 0.0
    assert mtp.first_token_threshold == DEFAULT_FIRST_TOKEN_THRESHOLD
    first = speculative_config(HebrusServeSettings(speculative_method="mtp", speculative_first_token_threshold=0.3))
    assert (first.first_token_threshold, first.confidence_threshold) == (0.3, DEFAULT_CONFIDENCE_THRESHOLD)


def test_mtp_speculative_serving_gives_the_plain_replies(checkpoint, tmp_path):
    """--speculative-method mtp: the checkpoint's own MTP block drafts (mtp.* added to a copy of the test
    checkpoint); greedy replies equal generate's and the stats count the drafts."""
    from hebrus_torch.testing import random_mtp, save_mtp

    path, model, tokenizer = checkpoint
    with_mtp = tmp_path / "with-mtp"
    shutil.copytree(path, with_mtp)
    save_mtp(with_mtp, random_mtp(model.config, 3).to(model.dtype))
    chats = [(messages, text) for messages, text, _, _ in clear_chats(model, tokenizer, 3, seed=10)]
    with Server(with_mtp, "--speculative-method", "mtp", "--cb-block-size", "16", "--hebrus-capacity-tokens",
                "2048", log=tmp_path / "server.log") as srv:
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda c: srv.chat(c[0]), chats))
        for (messages, text), reply in zip(chats, replies):
            assert reply.choices[0].message.content == text, messages
        counters = srv.settled_stats()["counters"]
    assert counters["spec_verify_rows"] > 0 and counters["spec_drafted_tokens"] > 0, counters
