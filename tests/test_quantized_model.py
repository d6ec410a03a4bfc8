"""A checkpoint written by ``python -m hebrus_torch.convert`` run by the engine and the server (issue 36): the
engine's invariance and speculation checks (tests/test_engine.py, tests/test_engine_speculative.py) on the
loaded quantized model, and a served chat over loopback that gives the quantized model's greedy reply. Its MTP
block (issue 38) quantized as the trunk: loaded, equal to the source block quantized in memory, and MTP
speculation on it exact (tests/test_engine_mtp.py's check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_models import tiny_indexer_config  # noqa: E402  (skips without transformers)
from test_engine import prompts_for, row_invariant, run_engine  # noqa: F401
from test_engine_mtp import assert_greedy_mtp_speculation_is_plain, reference_drafts
from test_engine_speculative import assert_greedy_speculation_is_plain

import hebrus_torch
from hebrus_torch.convert import convert, quantize_model
from hebrus_torch.hc.premix import _fusable_quantized_premix
from hebrus_torch.loading.mtp import load_mtp
from hebrus_torch.moe.quantized_experts import QuantizedExperts
from hebrus_torch.moe.quantized_linear import QuantizedLinear
from hebrus_torch.testing import write_checkpoint

VOCAB = 50
EOS = 3


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """(conftest's one_thread for every test here)"""


def tiny_config(hc_lowrank: int = 8):
    """The tiny indexer model (widths of 32, so every projection and expert quantizes at group 32; the
    hyper-connections' input_mix_weight_up too where ``hc_lowrank`` is 32, so their pre-mixes run as
    hc_premix_quantized; at 8 it stays dense and they run as module calls)."""
    return tiny_indexer_config(vocab_size=VOCAB, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               hc_lowrank=hc_lowrank)


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory) -> Path:
    """The tiny model at 4 bits (every hyper-connection projection quantized)."""
    src = write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tiny_config(hc_lowrank=32), seed=21, dtype=torch.float32,
                           max_shard_size="40KB")
    return convert(src, tmp_path_factory.mktemp("dst") / "q4", bits=4, group_size=32)


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(source, converted at 4 bits): the tiny model with a whole MTP block."""
    src = write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tiny_config(), seed=22, dtype=torch.float32,
                           max_shard_size="40KB", tokenizer=False, mtp_block=True)
    return src, convert(src, tmp_path_factory.mktemp("dst") / "q4", bits=4, group_size=32)


@pytest.fixture(scope="module")
def model(quantized_dir):
    loaded = hebrus_torch.from_pretrained(quantized_dir)
    assert sum(type(m) is QuantizedExperts for m in loaded.modules()) == 2
    assert sum(type(m) is QuantizedLinear for m in loaded.modules()) >= 15
    premixes = [m for m in loaded.modules() if type(m).__name__ == "Qwen4ExpTextGatedResidual"]
    assert premixes and all(_fusable_quantized_premix(m, torch.empty(1, m.hc_count * m.hidden_size))
                            for m in premixes)                # (the engine runs them as hc_premix_quantized)
    return loaded


def test_engine_tokens_and_state_do_not_depend_on_cut_cap_order_or_sharing(model, row_invariant):
    """test_engine's invariance check on the quantized model: every quantized op computes each row on its own."""
    base = prompts_for(4, lengths=(14, 6, 21, 2))
    shared = base[2][:12]
    prompts = base + [shared + [9, 8, 7], shared + [9, 8, 7, 6, 5]]
    ref_tokens, ref_states = run_engine(model, prompts, max_batch_tokens=None, allow_block_sharing=False)
    for s in [dict(max_batch_tokens=1), dict(max_batch_tokens=7), dict(max_batch_tokens=64),
              dict(max_batch_tokens=16, order=[5, 3, 1, 0, 4, 2]), dict(max_batch_tokens=7, allow_block_sharing=True)]:
        tokens, states = run_engine(model, prompts, **s)
        assert tokens == ref_tokens, s
        assert states == ref_states, s


def test_engine_greedy_tokens_equal_generate(model):
    for prompt in prompts_for(6, lengths=(5, 13)):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=EOS,
                              pad_token_id=0)[0, len(prompt):].tolist()
        want = want[:want.index(EOS) + 1] if EOS in want else want
        tokens, _ = run_engine(model, [prompt], max_new_tokens=6)
        assert tokens["r0"] == want


def test_greedy_speculation_gives_the_plain_tokens_and_state(model, row_invariant):
    """test_engine_speculative's check on the quantized model."""
    assert_greedy_speculation_is_plain(model, cases=((0, 16, 4), (1, 7, 6)))


def test_the_converted_checkpoint_is_served(quantized_dir, model, tmp_path):
    pytest.importorskip("openai", reason="needs the serve extra")
    from test_serve import Server
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(quantized_dir)
    messages = [{"role": "user", "content": "abc ab"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=EOS,
                             pad_token_id=EOS)[0, len(ids):].tolist()
    gen = gen[:gen.index(EOS) + 1] if EOS in gen else gen
    with Server(quantized_dir, "--cb-block-size", "16", "--hebrus-capacity-tokens", "1024",
                log=tmp_path / "server.log") as srv:
        reply = srv.chat(messages, max_tokens=6)
        assert reply.choices[0].message.content == tokenizer.decode(gen, skip_special_tokens=True)
        assert srv.stats()["engine"] is not None


# ------------------------------------------------------------------------------------------ the MTP block
def test_the_mtp_block_loads_quantized_and_equals_the_source_block_quantized_in_memory(mtp_dirs):
    """Bitwise: the converter's codes of ``mtp.*`` are quantize_model's of the source block (same rules as the
    trunk's), so the drafts and their logits are the same; they differ from the unquantized block's."""
    src, dst = mtp_dirs
    loaded = hebrus_torch.from_pretrained(dst)
    mtp = load_mtp(loaded)
    assert type(mtp.block.mlp.experts) is QuantizedExperts
    quantized = {name for name, m in mtp.named_modules() if type(m) is QuantizedLinear}
    assert {"fc_embedding", "fc_hidden", "layers.0.self_attn.q_proj", "layers.0.self_attn.indexer.index_qk_proj",
            "layers.0.mlp.shared_expert.down_proj", "layers.0.attn_hyper_connection.input_mix_weight_down",
            "hyper_connection_mixer.input_mix_weight_down"} <= quantized
    for kept in ("layers.0.mlp.shared_expert_gate", "layers.0.attn_hyper_connection.input_mix_weight_up"):
        assert type(mtp.get_submodule(kept)) is torch.nn.Linear, kept       # (input 8: no multiple of 32)
    dense = hebrus_torch.from_pretrained(src)
    dense.mtp = load_mtp(dense)
    in_memory = hebrus_torch.from_pretrained(src)
    in_memory.mtp = load_mtp(in_memory)
    quantize_model(in_memory, 4, 32)
    want = in_memory.mtp.state_dict()
    got = mtp.state_dict()
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in want)
    loaded.mtp = mtp
    tokens = prompts_for(8, lengths=(12,))[0]
    drafts, logits = reference_drafts(loaded, tokens, 3)
    want_drafts, want_logits = reference_drafts(in_memory, tokens, 3)
    assert drafts == want_drafts and all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    _, dense_logits = reference_drafts(dense, tokens, 3)
    assert not torch.equal(logits[0], dense_logits[0])


def test_greedy_mtp_speculation_on_the_quantized_model_gives_its_plain_tokens(mtp_dirs, row_invariant,
                                                                              monkeypatch):
    """test_engine_mtp's exactness check on the converted model, its MTP block loaded (quantized) by the engine."""
    model = hebrus_torch.from_pretrained(mtp_dirs[1])
    assert_greedy_mtp_speculation_is_plain(model, prompts_for(9, lengths=(14, 6, 21, 3)), monkeypatch,
                                           cases=((0, 16, 4, None), (1, 7, 6, [3, 1, 0, 2])))
    assert type(model.mtp.block.mlp.experts) is QuantizedExperts


def test_a_quantized_mtp_block_that_is_not_whole_or_not_announced_is_refused(quantized_dir, mtp_dirs):
    from hebrus_torch.engine import Engine, EngineConfig
    from hebrus_torch.engine.speculative import SpeculativeConfig
    from hebrus_torch.errors import HebrusError
    from hebrus_torch.loading import CheckpointError

    partial = hebrus_torch.from_pretrained(quantized_dir)     # write_checkpoint's 4 top-level mtp.* keys, quantized
    with pytest.raises(HebrusError, match="MTP block .*mtp"):
        Engine(partial, EngineConfig(capacity_tokens=64, max_sequences=2,
                                     speculative=SpeculativeConfig(2, method="mtp")))
    loaded = hebrus_torch.from_pretrained(mtp_dirs[1])
    loaded.hebrus_checkpoint.quantization = None              # quantized mtp.* read as if the config had no format
    with pytest.raises(CheckpointError, match="MTP block.*no quantization_config"):
        load_mtp(loaded)
