"""Loading the released layout in place (issue 35): ``hebrus_torch.testing.write_checkpoint`` and
``hebrus_torch.from_pretrained`` against transformers' own ``from_pretrained`` of the same files; bad
checkpoints refused with a CheckpointError naming file and key."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hf_models import modeling, tiny_indexer_config  # noqa: E402  (skips without transformers)

import hebrus_torch
import hebrus_torch.integrations.transformers as hx
from hebrus_torch.engine import Engine, EngineConfig
from hebrus_torch.loading import CheckpointError, choose_ple_table
from hebrus_torch.ple.row_store import DiskNgramEmbedding
from hebrus_torch.testing import write_checkpoint

EOS = 3
VOCAB = 50
PARTS = 4
PREFIX = "model.language_model."
TABLE = f"{PREFIX}layers.0.ple.ple_embedding.ngram_embedding"


def config(**overrides):
    return tiny_indexer_config(vocab_size=VOCAB, split_ngram_parts=PARTS, **overrides)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("released-layout"), config(), seed=3, dtype=torch.bfloat16,
                            max_shard_size="40KB")


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' own load of the same files, patched as ours is (so the two run the same code)."""
    model = modeling.Qwen4ExpForCausalLM.from_pretrained(checkpoint).eval()
    hx.apply(model)
    return model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def weight_map(path: Path) -> dict[str, str]:
    with open(path / "model.safetensors.index.json") as f:
        return json.load(f)["weight_map"]


def prompts(seed: int, lengths=(5, 13, 22)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def greedy(model, prompt: list[int], n: int = 6) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------ the layout
def test_write_checkpoint_writes_the_released_layout(checkpoint):
    from transformers import AutoConfig, AutoTokenizer

    keys = weight_map(checkpoint)
    cfg = config()
    assert AutoConfig.from_pretrained(checkpoint).model_type == "qwen4_exp"
    assert len(set(keys.values())) > 2                                     # sharded, with an index
    assert "lm_head.weight" in keys and any(k.startswith("model.visual.") for k in keys)
    text = [k for k in keys if k.startswith(PREFIX)]
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj", "ngram_embedding.weight")) for k in text)
    for layer in range(cfg.num_hidden_layers):
        for e in range(cfg.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"{PREFIX}layers.{layer}.mlp.experts.{e}.{proj}.weight" in keys
    assert sorted(k for k in keys if ".shard_" in k) == sorted(f"{TABLE}.shard_{i}.weight" for i in range(PARTS))
    assert {k for k in keys if k.startswith("mtp.")} >= {"mtp.fc_embedding.weight", "mtp.fc_hidden.weight"}
    tok = AutoTokenizer.from_pretrained(checkpoint)
    assert len(tok) == VOCAB and tok.eos_token_id == EOS
    ids = tok.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == "<|im_start|>user hello world<|im_end|><|im_start|>assistant "


def test_write_checkpoint_is_a_function_of_the_seed(tmp_path):
    from safetensors.torch import load_file

    a = write_checkpoint(tmp_path / "a", config(), seed=5, tokenizer=False, max_shard_size="10MB")
    b = write_checkpoint(tmp_path / "b", config(), seed=5, tokenizer=False, max_shard_size="10MB")
    c = write_checkpoint(tmp_path / "c", config(), seed=6, tokenizer=False, max_shard_size="10MB")
    name = "model-00001-of-00001.safetensors"
    ta, tb, tc = (load_file(p / name) for p in (a, b, c))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta)


# ------------------------------------------------------------------------------------------ exact loading
@pytest.mark.parametrize("ple_table", ["memory", "disk"])
def test_from_pretrained_equals_transformers_load_bitwise(checkpoint, reference, ple_table):
    model = hebrus_torch.from_pretrained(checkpoint, ple_table=ple_table)
    assert type(model) is modeling.Qwen4ExpForCausalLM and hx.is_applied(model)
    assert model.hebrus_checkpoint.ple_table == ple_table
    assert set(model.hebrus_checkpoint.mtp) >= {"mtp.fc_embedding.weight", "mtp.fc_hidden.weight"}
    ours, theirs = model.state_dict(), reference.state_dict()
    table = "model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    if ple_table == "disk":
        assert isinstance(model.model.layers[0].ple.ple_embedding.ngram_embedding, DiskNgramEmbedding)
        assert set(theirs) - set(ours) == {table}
        ids = torch.arange(theirs[table].shape[0]).flip(0).view(-1, 8)
        assert torch.equal(model.model.layers[0].ple.ple_embedding.ngram_embedding(ids), theirs[table][ids])
    else:
        assert set(theirs) == set(ours)
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype and torch.equal(value, theirs[key]), key
    for (name, buf), (_, ref_buf) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(buf, ref_buf), name
    x = torch.tensor(prompts(0, (24, 24)))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits)


@pytest.mark.parametrize("ple_table", ["memory", "disk"])
def test_logits_and_greedy_tokens_equal_transformers_own_load_and_code(checkpoint, ple_table):
    """Without the drop-in on either side: the model loaded in place (its table in memory or read from disk) runs
    transformers' own forward and gives, on CPU, bitwise the logits and the greedy tokens of transformers' own
    ``from_pretrained`` of the same files."""
    model = hx.revert(hebrus_torch.from_pretrained(checkpoint, ple_table=ple_table))
    plain = modeling.Qwen4ExpForCausalLM.from_pretrained(checkpoint).eval()
    assert not hx.is_applied(model) and not hx.is_applied(plain)
    x = torch.tensor(prompts(3, (20, 20)))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
    assert [greedy(model, p) for p in prompts(4, (9, 17))] == [greedy(plain, p) for p in prompts(4, (9, 17))]


def test_from_pretrained_casts_like_transformers(checkpoint):
    model = hebrus_torch.from_pretrained(checkpoint, dtype=torch.float32, ple_table="disk")
    reference = modeling.Qwen4ExpForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hx.apply(reference)
    assert model.dtype == torch.float32
    ids = torch.arange(100).view(10, 10)
    table = reference.model.layers[0].ple.ple_embedding.ngram_embedding
    assert torch.equal(model.model.layers[0].ple.ple_embedding.ngram_embedding(ids), table(ids))
    x = torch.tensor(prompts(1, (30,)))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits)


@pytest.mark.parametrize("ple_table", ["memory", "disk"])
def test_greedy_tokens_equal_transformers_through_generate_the_engine_and_generate_batch(checkpoint, reference, ple_table):
    model = hebrus_torch.from_pretrained(checkpoint, ple_table=ple_table)
    cases = prompts(2)
    want = [greedy(reference, p) for p in cases]
    assert [greedy(model, p) for p in cases] == want
    engine = Engine(model, EngineConfig(capacity_tokens=512, max_sequences=4, max_batch_tokens=7, block_size=4))
    for i, p in enumerate(cases):
        engine.add_request(p, request_id=f"r{i}", max_new_tokens=6, eos_token_id=-1)
    engine.run()
    assert [engine.requests[f"r{i}"].generated for i in range(len(cases))] == want
    from transformers import GenerationConfig

    out = model.generate_batch(cases, GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None,
                                                       pad_token_id=0))
    assert [o.generated_tokens for o in out.values()] == want


def test_auto_puts_the_table_on_disk_past_a_quarter_of_physical_memory(checkpoint, monkeypatch):
    import hebrus_torch.loading.model as loading_model

    table_bytes = 16896 * 2 * 2     # the tiny table: [16896, 2] bf16
    monkeypatch.setattr(loading_model, "physical_memory_bytes", lambda: 4 * table_bytes)
    assert choose_ple_table("auto", table_bytes) == "memory"
    assert choose_ple_table("auto", table_bytes + 1) == "disk"
    assert choose_ple_table("memory", 10**15) == "memory"
    assert hebrus_torch.from_pretrained(checkpoint).hebrus_checkpoint.ple_table == "memory"
    monkeypatch.setattr(loading_model, "physical_memory_bytes", lambda: 4 * table_bytes - 4)
    assert hebrus_torch.from_pretrained(checkpoint).hebrus_checkpoint.ple_table == "disk"
    with pytest.raises(hebrus_torch.HebrusError, match="ple_table must be one of"):
        hebrus_torch.from_pretrained(checkpoint, ple_table="swap")


def test_a_text_only_checkpoint_loads_too(tmp_path):
    """``Qwen4ExpForCausalLM.save_pretrained`` (model_type ``qwen4_exp_text``, keys under ``model.``)."""
    torch.manual_seed(0)
    text = modeling.Qwen4ExpForCausalLM(config()).eval()
    text.save_pretrained(tmp_path, max_shard_size="40KB")
    model = hebrus_torch.from_pretrained(tmp_path, ple_table="disk")
    x = torch.tensor(prompts(3, (17,)))
    hx.apply(text)
    with torch.inference_mode():
        assert torch.equal(model(input_ids=x).logits, text(input_ids=x).logits)


# ------------------------------------------------------------------------------------------ refusals
def broken_copy(checkpoint: Path, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    return path


def file_of(path: Path, key: str) -> Path:
    return path / weight_map(path)[key]


def rewrite(file: Path, change) -> None:
    """Rewrite one safetensors file with ``change(tensors)`` applied (the index is left as it is)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def refused(path: Path, *patterns: str, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        hebrus_torch.from_pretrained(path, **kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, (pattern, message)
    return message


def test_a_missing_shard_file_is_refused_naming_it(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    victim = file_of(path, f"{TABLE}.shard_1.weight")
    victim.unlink()
    refused(path, victim.name, "which is not there")


def test_an_index_naming_a_file_that_is_not_there_is_refused(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{PREFIX}embed_tokens.weight"] = "model-99999-of-99999.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(path, "model-99999-of-99999.safetensors", f"{PREFIX}embed_tokens.weight")


def test_a_truncated_shard_is_refused_naming_file_and_key(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    victim = file_of(path, f"{TABLE}.shard_2.weight")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 3)
    refused(path, str(victim), "truncated", "'")
    with open(victim, "r+b") as f:
        f.truncate(5)
    refused(path, str(victim), "truncated")


def test_a_missing_expert_is_refused_naming_it(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    key = f"{PREFIX}layers.1.mlp.experts.2.up_proj.weight"
    rewrite(file_of(path, key), lambda t: t.pop(key))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(path, "expert 2", key)


def test_a_key_the_index_puts_in_a_file_that_lacks_it_is_refused(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    key = f"{PREFIX}layers.1.mlp.experts.2.up_proj.weight"
    victim = file_of(path, key)
    rewrite(victim, lambda t: t.pop(key))
    refused(path, str(victim), key)


def test_shards_whose_shape_or_dtype_disagree_with_the_config_are_refused(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    key = f"{TABLE}.shard_1.weight"
    victim = file_of(path, key)
    rewrite(victim, lambda t: t.__setitem__(key, t[key][:-1].clone()))
    refused(path, str(victim), "rows", "the config says")
    shutil.copy(file_of(checkpoint, key), victim)
    rewrite(victim, lambda t: t.__setitem__(key, t[key].to(torch.float16)))
    refused(path, str(victim), key, "shard 0 is torch.bfloat16")
    rewrite(victim, lambda t: t.__setitem__(key, t[key].to(torch.float8_e4m3fn)))
    refused(path, str(victim), key, "fp8")


def test_a_weight_whose_shape_disagrees_with_the_config_is_refused(checkpoint, tmp_path):
    path = broken_copy(checkpoint, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    refused(path, "experts.0.gate_proj.weight", "the config says [8, 32]")
    cfg["text_config"]["moe_intermediate_size"] = 16
    cfg["text_config"]["num_hidden_layers"] = 1
    cfg["text_config"]["layer_types"] = ["linear_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    refused(path, f"{PREFIX}layers.1.", "is not a weight of the model the config describes")


def test_the_main_job_loads_a_checkpoint_in_place_and_says_where_the_table_is(checkpoint, capsys):
    from hebrus_torch.__main__ import main

    assert main(["--model", str(checkpoint), "--device", "cpu", "--ple-table", "disk", "--requests", "3",
                 "--cb-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert f"Loaded {checkpoint} in place; PLE n-gram table" in out and "read from the checkpoint's files" in out
    assert "PLE table disk" in out


PEAK_SCRIPT = """
import sys, json
import torch, transformers  # noqa: F401  (imported before the baseline)
import hebrus_torch
from transformers.models.qwen4_exp import modeling_qwen4_exp  # noqa: F401

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")       # VmHWM := VmRSS
before = rss()
model = hebrus_torch.from_pretrained(sys.argv[1], ple_table=sys.argv[2])
print(json.dumps({"before": before, "peak": peak(), "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "largest": max(p.numel() * p.element_size() for p in model.parameters())}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads VmHWM from /proc (Linux)")
def test_peak_memory_while_loading_is_the_model_plus_about_one_tensor(tmp_path):
    """Some 150 MB of weights in tensors of at most 32 MB: the peak RSS while loading (anonymous and file-backed)
    exceeds what the loaded model holds by about its largest tensor, not by the checkpoint: the pages of each
    tensor's file are let go once it is copied (fails with every file's pages kept mapped until the end)."""
    import subprocess
    import sys

    write_checkpoint(tmp_path, config(hidden_size=512, num_experts=16, moe_intermediate_size=512),
                     seed=0, dtype=torch.float32, max_shard_size="100MB", tokenizer=False)
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path), "memory"], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = {k: round(v / 2**20, 1) for k, v in r.items()}
    assert r["weights"] > 3 * r["largest"], mib
    assert r["peak"] - r["before"] - r["weights"] < r["largest"] + 24 * 2**20, mib
