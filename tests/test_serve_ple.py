"""``python -m hebrus_torch.serve`` on a checkpoint in the released layout (issue 35): loaded in place by
``hebrus_torch.from_pretrained``, ``--ple-table disk`` serves the replies of transformers' own load, the log says
which table ran, and a bad checkpoint stops the server before it serves, naming file and key."""

from __future__ import annotations

import os
import random

import pytest
import torch

from test_serve import Server, http  # noqa: E402  (skips without the serve extra)
from hf_models import modeling, tiny_indexer_config  # noqa: E402

import hebrus_torch.integrations.transformers as hx
from hebrus_torch.serving.cli import main as serve_main
from hebrus_torch.testing import write_checkpoint

VOCAB = 50
EOS = 3
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("released-serve"), tiny_indexer_config(
        vocab_size=VOCAB, split_ngram_parts=4), seed=8, dtype=torch.float32, max_shard_size="40KB")


def clear_replies(checkpoint, count: int, seed: int):
    """(messages, greedy reply ids) of transformers' own load of the files, for chats with no near tie."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = modeling.Qwen4ExpForCausalLM.from_pretrained(checkpoint).eval()
    hx.apply(model)
    rng = random.Random(seed)
    found = []
    while len(found) < count:
        words = " ".join(rng.choice("abcdefgh") * rng.randrange(1, 3) for _ in range(rng.randrange(2, 12)))
        messages = [{"role": "user", "content": words}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=EOS,
                                 output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[0, len(ids):].tolist()
        gen = gen[:gen.index(EOS) + 1] if EOS in gen else gen
        if min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores[:len(gen)]) > 1e-3:
            found.append((messages, tokenizer.decode(gen, skip_special_tokens=True)))
    return found


def test_the_released_layout_is_served_with_the_table_on_disk(checkpoint, tmp_path):
    chats = clear_replies(checkpoint, 3, seed=1)
    with Server(checkpoint, "--ple-table", "disk", "--ple-cache-bytes", "65536", "--ple-prefetch", "on",
                "--cb-block-size", "16",
                "--hebrus-capacity-tokens", "1024", log=tmp_path / "server.log") as srv:
        for messages, text in chats:
            reply = srv.chat(messages, max_tokens=MAX_TOKENS)
            assert reply.choices[0].message.content == text
        stats = srv.stats()
        assert stats["engine"] is not None
        assert stats["ple_prefetch"]["steps"] >= stats["counters"]["steps"] > 0       # every step prefetched
        assert stats["ple_prefetch"]["errors"] == 0
        log = srv.log_tail(200)
    assert "PLE n-gram table" in log and "read from the checkpoint's files" in log and "--ple-table disk" in log


def test_a_truncated_shard_stops_the_server_naming_file_and_key(checkpoint, tmp_path):
    import json
    import shutil

    path = tmp_path / "broken"
    shutil.copytree(checkpoint, path)
    key = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_3.weight"
    victim = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 1)
    srv = Server(path, "--ple-table", "disk", log=tmp_path / "server.log")
    try:
        srv.proc.wait(timeout=180)
    finally:
        srv.stop()
    assert srv.proc.returncode != 0
    log = srv.log_tail(80)
    flat = "".join(log.split())         # (the traceback's box wraps long lines)
    assert "CheckpointError" in log and "truncated" in log
    assert "".join(str(victim).split()) in flat and key in flat
    with pytest.raises(Exception):
        http("GET", f"{srv.url}/health", timeout=2)


def test_bad_ple_flags_are_refused():
    with pytest.raises(SystemExit):
        serve_main(["somewhere", "--ple-table", "swap"])
    with pytest.raises(SystemExit, match="--ple-cache-bytes must be >= 1"):
        serve_main(["somewhere", "--ple-cache-bytes", "0"])


def test_the_draft_model_is_loaded_in_place_with_the_served_models_ple_table(checkpoint):
    """--draft-model of a Qwen4Exp checkpoint goes through hebrus_torch.from_pretrained with --ple-table's choice
    (before issue 35's last part: transformers' AutoModelForCausalLM, the table in memory)."""
    from hebrus_torch.ple.row_store import DiskNgramEmbedding
    from hebrus_torch.serving.loading import PLEOptions, _load_draft, ple_options, set_ple_options

    target = modeling.Qwen4ExpForCausalLM.from_pretrained(checkpoint).eval()
    hx.apply(target)              # (the draft comes with the drop-in applied: the same kernels, the same bits)
    before = ple_options()
    try:
        for table in ("disk", "memory"):
            set_ple_options(PLEOptions(table, 1 << 20))
            draft = _load_draft(str(checkpoint), target)
            assert draft.hebrus_checkpoint.ple_table == table
            assert draft.dtype == target.dtype and draft.device == target.device
            disk = [m for m in draft.modules() if isinstance(m, DiskNgramEmbedding)]
            assert len(disk) == (1 if table == "disk" else 0)
            if disk:
                assert disk[0].store.cache_bytes == 1 << 20
            ids = torch.tensor([[5, 9, 12, 7, 30, 2]])
            with torch.inference_mode():
                assert torch.equal(draft(ids).logits, target(ids).logits)
    finally:
        set_ple_options(before)


def test_a_draft_model_with_its_table_on_disk_serves_the_plain_replies(checkpoint, tmp_path):
    chats = clear_replies(checkpoint, 2, seed=3)
    with Server(checkpoint, "--ple-table", "disk", "--speculative-tokens", "3", "--draft-model", str(checkpoint),
                "--cb-block-size", "16", "--hebrus-capacity-tokens", "1024", log=tmp_path / "server.log") as srv:
        for messages, text in chats:
            assert srv.chat(messages, max_tokens=MAX_TOKENS).choices[0].message.content == text
        counters = srv.settled_stats()["counters"]
        log = srv.log_tail(200)
    assert counters["spec_drafted_tokens"] > 0
    assert counters["spec_accepted_tokens"] == counters["spec_drafted_tokens"]     # the target drafts for itself
    lines = [line for line in log.splitlines() if f"hebrus: draft model {checkpoint} loaded in place" in line]
    assert len(lines) == 1 and "read from the checkpoint's files" in lines[0] and "--ple-table disk" in lines[0]
