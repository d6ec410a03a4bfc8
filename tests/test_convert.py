"""The quantizing converter (issue 36): ``python -m hebrus_torch.convert`` on the tiny released-layout checkpoint
(hebrus_torch.testing.write_checkpoint), what it writes and refuses, and ``hebrus_torch.from_pretrained`` of
its output against the source model quantized in memory (``hebrus_torch.convert.quantize_model``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import tiny_indexer_config  # noqa: E402  (skips without transformers)

import hebrus_torch
from hebrus_torch.convert import ConvertError, convert, quantize_model
from hebrus_torch.convert import core as convert_core
from hebrus_torch.errors import HebrusError
from hebrus_torch.loading import CheckpointError
from hebrus_torch.moe.quantize import quantize
from hebrus_torch.moe.quantized_experts import QuantizedExperts
from hebrus_torch.moe.quantized_linear import QuantizedLinear
from hebrus_torch.testing import write_checkpoint

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "model.language_model."
EXPERT0 = f"{PREFIX}layers.0.mlp.experts.0.gate_proj"
VOCAB = 50


def config(**overrides):
    """The tiny indexer config with hidden and expert widths of 64, so that groups of 32 and 64 fit."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
              ple_embed_dim=64)
    kw.update(overrides)
    return tiny_indexer_config(**kw)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", config(), seed=7, max_shard_size="40KB")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """(bits, group_size) -> the converted directory (converted once per module)."""
    cache: dict[tuple[int, int], Path] = {}

    def get(bits: int, group: int) -> Path:
        if (bits, group) not in cache:
            cache[(bits, group)] = convert(source, tmp_path_factory.mktemp("dst") / f"q{bits}g{group}", bits=bits,
                                           group_size=group, max_shard_bytes=60_000)
        return cache[(bits, group)]
    return get


def stored(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with open(path / "model.safetensors.index.json") as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for name in files:
        out.update(load_file(path / name))
    return out


def tokens(seed: int, n: int = 11) -> torch.Tensor:
    return torch.randint(4, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ what it writes
def test_cli_converts_and_the_output_is_complete(source, tmp_path):
    dst = tmp_path / "q4"
    done = subprocess.run([sys.executable, "-m", "hebrus_torch.convert", str(source), str(dst), "--bits", "4",
                           "--group-size", "32", "--max-shard-size", "50KB"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4"]        # no temporary directory left
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "hebrus_affine" and (qc["bits"], qc["group_size"], qc["mode"]) == (4, 32, "affine")
    assert qc["quantized"] == ["routed_experts", "shared_expert", "attention", "linear_attention", "indexer",
                               "hyper_connection", "ple_projection", "mtp_fusion"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (dst / name).read_bytes() == (source / name).read_bytes()
    with open(dst / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1                          # sharded
    assert all((dst / name).is_file() for name in weight_map.values())


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_what_is_quantized_and_what_is_copied(source, converted, bits, group):
    src, dst = stored(source), stored(converted(bits, group))
    qc = json.loads((converted(bits, group) / "config.json").read_text())["quantization_config"]
    quantized = {k[:-len(".scales")] for k in dst if k.endswith(".scales")}
    for key in src:
        if key[:-len(".weight")] in quantized:
            want = quantize(src[key], bits, group)
            for part, w in zip(("weight", "scales", "biases"), want):
                assert torch.equal(dst[key[:-len("weight")] + part], w), (key, part)
        else:
            assert torch.equal(dst[key], src[key]), key                  # copied byte for byte
    assert f"{EXPERT0}" in quantized and f"{PREFIX}layers.1.self_attn.q_proj" in quantized
    assert f"{PREFIX}layers.0.linear_attn.in_proj_qkv" in quantized
    assert f"{PREFIX}layers.1.self_attn.indexer.index_qk_proj" in quantized
    assert f"{PREFIX}layers.0.ple.key_proj" in quantized
    assert f"{PREFIX}layers.0.attn_hyper_connection.input_mix_weight_down" in quantized
    for kept in (f"{PREFIX}layers.0.mlp.gate", f"{PREFIX}layers.0.mlp.shared_expert_gate", "lm_head",
                 f"{PREFIX}embed_tokens", f"{PREFIX}layers.1.self_attn.q_norm"):
        assert kept not in quantized, kept
    # hc_lowrank 8 is no multiple of a group: input_mix_weight_up is kept and named
    kept_up = f"{PREFIX}layers.0.attn_hyper_connection.input_mix_weight_up.weight"
    assert kept_up in qc["not_quantized"] and dst[kept_up].dtype == torch.bfloat16
    # the MTP head's projections (write_checkpoint's 4 top-level mtp.* tensors) like the trunk's; its norms copied
    assert {"mtp.fc_embedding", "mtp.fc_hidden"} <= quantized and "mtp.pre_fc_norm_hidden.weight" in dst


def test_lm_head_on_request_and_4bit_experts_are_3_5x_smaller(source, tmp_path):
    dst = stored(convert(source, tmp_path / "q", bits=4, group_size=64, quantize_lm_head=True))
    assert dst["lm_head.weight"].dtype == torch.int32 and "lm_head.scales" in dst
    src = stored(source)
    expert = [k for k in src if ".mlp.experts." in k]
    bf16 = sum(src[k].nbytes for k in expert)
    q4 = sum(dst[k[:-len("weight")] + p].nbytes for k in expert for p in ("weight", "scales", "biases"))
    assert bf16 / q4 == pytest.approx(2 / (0.5 + 4 / 64))             # 3.56x


def test_rows_are_quantized_in_slices_with_the_same_codes(source, converted, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_core, "_SLICE_BYTES", 1)                # one row at a time
    sliced = stored(convert(source, tmp_path / "sliced", bits=4, group_size=32, max_shard_bytes=60_000))
    whole = stored(converted(4, 32))
    assert sliced.keys() == whole.keys()
    assert all(torch.equal(sliced[k], whole[k]) for k in whole)


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("kwargs, match", [(dict(bits=3), "bits must be 4 or 8"),
                                           (dict(group_size=16), "group_size must be 32, 64 or 128"),
                                           (dict(group_size=128), "routed experts cannot be quantized"),
                                           (dict(max_shard_bytes=0), "max_shard_bytes must be positive")])
def test_bad_options_are_refused_and_nothing_is_written(source, tmp_path, kwargs, match):
    with pytest.raises(ConvertError, match=match):
        convert(source, tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_destination_is_refused_and_left_alone(source, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(ConvertError, match="exists"):
        convert(source, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep"]


def test_checkpoints_it_cannot_convert(source, converted, tmp_path):
    with pytest.raises(ConvertError, match="already quantized"):
        convert(converted(4, 32), tmp_path / "again")
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConvertError, match="model_type 'llama'"):
        convert(other, tmp_path / "out")
    with pytest.raises(ConvertError, match="no config.json"):
        convert(tmp_path / "nothing", tmp_path / "out")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((source / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="neither"):
        convert(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_float8_weights_are_refused(tmp_path):
    src = write_checkpoint(tmp_path / "f8", config(), seed=1, max_shard_size="10MB", tokenizer=False, mtp=False)
    from safetensors.torch import load_file, save_file

    with open(src / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    name = weight_map[f"{EXPERT0}.weight"]
    tensors = load_file(src / name)
    tensors[f"{EXPERT0}.weight"] = tensors[f"{EXPERT0}.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(src / name), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="float8"):
        convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f8"]


def test_a_failure_while_writing_removes_the_partial_output(source, tmp_path, monkeypatch):
    calls = []

    def failing(w, bits, group_size):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return quantize(w, bits, group_size)

    monkeypatch.setattr(convert_core, "quantize", failing)
    with pytest.raises(OSError, match="disk full"):
        convert(source, tmp_path / "out", bits=4, group_size=32)
    assert list(tmp_path.iterdir()) == []


def test_cli_exits_non_zero_with_the_message(source, tmp_path):
    done = subprocess.run([sys.executable, "-m", "hebrus_torch.convert", str(source), str(tmp_path / "o"),
                           "--bits", "5"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "bits must be 4 or 8" in done.stderr
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ loading it
@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_loaded_logits_equal_the_source_quantized_in_memory(source, converted, bits, group):
    """Bitwise: the converter's codes are quantize()'s, and both models run the same modules."""
    loaded = hebrus_torch.from_pretrained(converted(bits, group))
    assert sum(isinstance(m, QuantizedExperts) for m in loaded.modules()) == 2
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.modules()) > 10
    in_memory = quantize_model(hebrus_torch.from_pretrained(source), bits, group)
    assert {k: v.dtype for k, v in loaded.state_dict().items()} == \
        {k: v.dtype for k, v in in_memory.state_dict().items()}
    ids = tokens(bits + group, 13)
    with torch.no_grad():
        got, want = loaded(ids).logits, in_memory(ids).logits
    assert torch.equal(got, want)
    with torch.no_grad():
        dense = hebrus_torch.from_pretrained(source)(ids).logits
    assert not torch.equal(got, dense)
    assert (got.float() - dense.float()).abs().max() < (0.05 if bits == 8 else 0.5)


def test_a_quantization_config_the_loader_does_not_read_is_refused(converted, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(converted(4, 32), copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        hebrus_torch.from_pretrained(copy)
    cfg.pop("quantization_config")
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has no quantization_config, but the checkpoint stores quantized"):
        hebrus_torch.from_pretrained(copy)


def test_quantize_model_refuses_bad_options():
    from hf_models import modeling

    with pytest.raises(HebrusError, match="bits must be 4 or 8"):
        quantize_model(modeling.Qwen4ExpForCausalLM(config()), bits=2)
