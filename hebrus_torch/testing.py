"""Checkpoints to test with: random weights in the released Qwen4Exp layout (``write_checkpoint``).

The layout is what transformers 5.23.0's ``save_pretrained`` writes for ``Qwen4ExpForConditionalGeneration``
(the released checkpoint is that class): sharded safetensors with ``model.safetensors.index.json``, the text
model under ``model.language_model.``, a vision tower under ``model.visual.``, ``lm_head.weight``, routed
experts stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``; ``save_pretrained`` reverts
transformers' fusion itself) and each PLE layer's n-gram table as ``ngram_embedding.shard_{i}.weight``
(``split_ngram_parts`` shards, also reverted by ``save_pretrained``). transformers drops ``mtp.*`` keys, so
they are added here in a file of their own and listed in the index, as the released checkpoint has them.
A small byte-level BPE tokenizer with a chat template (built offline) is saved beside them.

Needs transformers 5.23.0 (the ``hf`` extra).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["write_checkpoint", "make_tokenizer", "random_mtp", "save_mtp", "CHAT_TEMPLATE", "TINY_VISION"]

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
# The smallest vision tower Qwen4ExpVisionConfig accepts: the loader never reads it, but the files carry one.
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                   num_position_embeddings=64)
MTP_FILE = "model-mtp.safetensors"


def write_checkpoint(path: str | os.PathLike, config: Any, seed: int = 0, *, dtype: torch.dtype = torch.bfloat16,
                     max_shard_size: str | int = "1MB", tokenizer: bool = True, mtp: bool = True,
                     mtp_block: bool = False) -> Path:
    """Write a random-weight Qwen4Exp checkpoint in the released layout to ``path`` and return it.

    ``config``: a ``Qwen4ExpTextConfig`` (wrapped into a ``Qwen4ExpConfig`` with a tiny vision tower) or a
    ``Qwen4ExpConfig``. ``seed`` fixes every weight. ``dtype``: the stored float dtype (the released one is
    bf16). transformers zero-initialises the RMSNorm weights and the PLE conv; they are drawn at random here
    (N(0, 0.3)) so that every path of the model changes the logits. ``max_shard_size``: passed to
    ``save_pretrained`` (small, so that tiny models are sharded too). ``tokenizer``: save a word-level
    tokenizer of ``vocab_size`` tokens whose ``<eos>`` is the config's ``eos_token_id``. ``mtp``: add the
    MTP head's top-level tensors (``mtp.fc_embedding.weight`` ...) in a file of their own. ``mtp_block``: the
    whole MTP block instead, every ``mtp.*`` key of the released layout (:func:`random_mtp`, :func:`save_mtp`).
    """
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig, Qwen4ExpTextConfig

    path = Path(path)
    if isinstance(config, Qwen4ExpTextConfig):
        full = Qwen4ExpConfig(text_config=config.to_dict(), vision_config=dict(TINY_VISION))
    elif isinstance(config, Qwen4ExpConfig):
        full = config
    else:
        raise TypeError(f"write_checkpoint: a Qwen4ExpTextConfig or Qwen4ExpConfig, got {type(config).__name__}")
    text = full.text_config
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = modeling.Qwen4ExpForConditionalGeneration(full).eval()
    zero_initialised = [p for name, p in model.named_parameters() if "conv1d" in name or "norm" in name]
    with torch.no_grad():
        for p in zero_initialised:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model = model.to(dtype)
    eos = text.eos_token_id[0] if isinstance(text.eos_token_id, list) else text.eos_token_id
    if eos is not None:
        model.generation_config.eos_token_id = eos
    model.save_pretrained(path, max_shard_size=max_shard_size)
    del model
    _make_sharded(path)
    if mtp_block:
        save_mtp(path, random_mtp(text, seed + 1).to(dtype))
    elif mtp:
        _add_mtp(path, text, dtype, gen)
    if tokenizer:
        make_tokenizer(text.vocab_size, eos).save_pretrained(path)
    return path


def _make_sharded(path: Path) -> None:
    """A model small enough for one file is saved without an index: give it the released form (an index)."""
    single = path / "model.safetensors"
    if not single.exists():
        return
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        keys = list(f.keys())
    target = "model-00001-of-00001.safetensors"
    single.rename(path / target)
    _write_index(path, {k: target for k in keys})


def _write_index(path: Path, weight_map: dict[str, str]) -> None:
    total = sum(os.path.getsize(path / f) for f in set(weight_map.values()))
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def _add_mtp(path: Path, text: Any, dtype: torch.dtype, gen: torch.Generator) -> None:
    """The MTP head's own top-level tensors (shapes as in the released checkpoint), in MTP_FILE."""
    from safetensors.torch import save_file

    hidden, hc = text.hidden_size, text.hc_count
    shapes = {"mtp.fc_embedding.weight": (hidden, hidden), "mtp.fc_hidden.weight": (hidden, hidden),
              "mtp.pre_fc_norm_embedding.weight": (hidden,), "mtp.pre_fc_norm_hidden.weight": (hidden * hc,)}
    tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(dtype) for k, s in shapes.items()}
    save_file(tensors, str(path / MTP_FILE), metadata={"format": "pt"})
    with open(path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    weight_map.update({k: MTP_FILE for k in tensors})
    _write_index(path, weight_map)


def random_mtp(text_config: Any, seed: int = 0):
    """A random :class:`~hebrus_torch.models.qwen4_exp.mtp.Qwen4ExpMTP` for ``text_config`` (float32), its
    RMSNorm weights drawn as ``write_checkpoint`` draws the trunk's (N(0, 0.3))."""
    from hebrus_torch.models.qwen4_exp.mtp import Qwen4ExpMTP

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mtp = Qwen4ExpMTP(text_config).eval()
        with torch.no_grad():
            for name, p in mtp.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    return mtp


def save_mtp(path: str | os.PathLike, mtp: torch.nn.Module) -> None:
    """Write ``mtp``'s weights into the checkpoint at ``path`` in the released layout (``mtp.*`` keys,
    experts per expert; ``hebrus_torch.loading.mtp.mtp_state_dict``), in :data:`MTP_FILE`, replacing any
    ``mtp.*`` tensors the index listed (a checkpoint in one file without an index gets one)."""
    from safetensors.torch import save_file

    from hebrus_torch.loading.mtp import mtp_state_dict

    path = Path(path)
    _make_sharded(path)
    tensors = mtp_state_dict(mtp)
    save_file(tensors, str(path / MTP_FILE), metadata={"format": "pt"})
    with open(path / "model.safetensors.index.json") as f:
        weight_map = {k: v for k, v in json.load(f)["weight_map"].items() if not k.startswith("mtp.")}
    weight_map.update({k: MTP_FILE for k in tensors})
    _write_index(path, weight_map)


def make_tokenizer(vocab_size: int, eos_token_id: int | None):
    """A byte-level BPE tokenizer of ``vocab_size`` ids in the form transformers loads for ``qwen4_exp``
    (``Qwen3_5Tokenizer``, which ``AutoTokenizer`` picks for that model type whatever the files name), with
    :data:`CHAT_TEMPLATE`. Built offline (no download).

    Tokens: ``<|endoftext|>`` (the eos, at ``eos_token_id``), ``<|im_start|>``, ``<|im_end|>``, then for as many
    lowercase letters as fit, the letter alone and the letter after a space (``"a"``, ``" a"``), and a space;
    ids left over are unreachable fillers. Every token decodes to text that encodes back to it."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    letters = "abcdefghijklmnopqrstuvwxyz"[:max(0, (vocab_size - len(special) - 1) // 2)]
    if not letters:
        raise ValueError(f"make_tokenizer: vocab_size {vocab_size} leaves no room for a letter")
    eos = 0 if eos_token_id is None else eos_token_id
    if not 0 <= eos < vocab_size:
        raise ValueError(f"make_tokenizer: eos_token_id {eos_token_id} outside [0, {vocab_size})")
    words = ["\u0120"] + list(letters) + ["\u0120" + c for c in letters]     # \u0120: byte-level space
    merges = [("\u0120", c) for c in letters]
    free = [i for i in range(vocab_size) if i != eos]
    names = [f"<|filler_{i}|>" for i in range(vocab_size)]
    names[eos] = special[0]
    for i, name in zip(free, special[1:] + words):
        names[i] = name
    vocab = {name: i for i, name in enumerate(names)}
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges, unk_token=special[0], eos_token=special[0],
                           pad_token=special[0])
    tok.add_special_tokens({"additional_special_tokens": special[1:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok
