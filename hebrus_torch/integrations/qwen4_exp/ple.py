"""PLE forwards: Qwen4ExpTextNGramEmbedding.forward as one hebrus::ple_ngram_ids call and
Qwen4ExpTextPLELayer._short_conv as one hebrus::ple_conv call; the cache bookkeeping is transformers' own."""

from __future__ import annotations

from typing import NamedTuple

import torch

import hebrus_torch
from hebrus_torch import reference
from hebrus_torch._extension import has_native_kernel
from hebrus_torch._validate import FLOAT_DTYPES
from hebrus_torch.errors import HebrusError

from . import cuda_graphs
from .common import _PATCH
from .stats import _STATS, _warn_once

def _ngram_forward(self, input_ids: torch.Tensor, past_key_values) -> torch.Tensor:
    """Qwen4ExpTextNGramEmbedding.forward with the hash as one hebrus::ple_ngram_ids call.

    Token ids outside ``[0, vocab_size)`` (embeddings resized past the config's vocabulary) are bad
    input to the op (SPEC §2); transformers hashes them anyway, so such a call runs its forward."""
    original = self.__dict__[_PATCH]["original_forward"]
    raw_ids = input_ids
    input_ids = input_ids.long()
    batch, length = input_ids.shape
    ctx_len = self.context_len
    cached_ctx = past_key_values.get_conv_state(self.layer_idx, state_idx=2) if past_key_values is not None else None
    if cached_ctx is not None:
        # The shift rule reads at most N-1 tokens back (record_past may keep more columns; a shorter
        # history reads as EOS, as transformers' shift does past the start).
        history = cached_ctx[:, -ctx_len:]
        if not _rows_form("ple_ngram_ids", input_ids.device):
            history = history.clone()
        if history.shape[1] < ctx_len:
            history = torch.nn.functional.pad(history, (ctx_len - history.shape[1], 0), value=self.eos_token_id)
    else:
        history = input_ids.new_full((batch, ctx_len), self.eos_token_id)

    if not torch.compiler.is_compiling() and _ids_may_leave_the_vocab(self, input_ids):
        # The op's id check is a device-side assert here (SPEC §4), which would leave the device unusable
        # instead of falling back: with embeddings resized past the PLE vocabulary, look on the host first.
        vocab = int(self.unigram_vocab_size)
        outside_history = ((history < 0) | (history >= vocab)) & (history != int(self.eos_token_id))
        if bool(((input_ids < 0) | (input_ids >= vocab)).any() | outside_history.any()):
            _STATS["ple_fallback:token_outside_vocab"] += 1
            _warn_once("ple_fallback:token_outside_vocab")
            return original(raw_ids, past_key_values)
    rows_form = _rows_form("ple_ngram_ids", input_ids.device)
    if not rows_form:
        cu_seqlens = torch.arange(batch + 1, device=input_ids.device, dtype=torch.int32) * length
        args = (input_ids.reshape(-1), cu_seqlens, history, self.layer_multipliers, self.ngram_heads_vocab_sizes,
                self.ngram_heads_offsets, int(self.eos_token_id), int(self.unigram_vocab_size))
    if torch.compiler.is_compiling():
        row_ids, _ = hebrus_torch.ple_ngram_ids(*args)
    else:
        try:   # the op checks the ids anyway: no extra host sync to find the rare call that falls back
            if rows_form:
                row_ids = _maybe_graphed(ngram_rows, _NgramSpec(int(self.eos_token_id), int(self.unigram_vocab_size)),
                                         (input_ids, history, self.layer_multipliers, self.ngram_heads_vocab_sizes,
                                          self.ngram_heads_offsets), length)
            else:
                row_ids, _ = hebrus_torch.ple_ngram_ids(*args)
        except HebrusError as exc:
            if "outside [0, vocab=" not in str(exc):
                raise
            _STATS["ple_fallback:token_outside_vocab"] += 1
            _warn_once("ple_fallback:token_outside_vocab")
            return original(raw_ids, past_key_values)      # the cache is untouched so far

    # Cache bookkeeping exactly as transformers does it.
    if past_key_values is not None:
        input_ids_to_cache = input_ids
        if cached_ctx is None and length < ctx_len:
            input_ids_to_cache = torch.nn.functional.pad(
                input_ids_to_cache, (ctx_len - length, 0), value=self.eos_token_id)
        past_key_values.update_conv_state(input_ids_to_cache, self.layer_idx, state_idx=2, conv_kernel_size=ctx_len)

    ngram_ids = row_ids.view(batch, length, -1)
    if not torch.compiler.is_compiling():
        _STATS["ple_ngram"] += 1
    execution_device = (
        self.ngram_embedding.weight.device if self.ngram_embedding.weight.device.type != "meta" else None
    )
    return self.ngram_embedding(ngram_ids.to(execution_device)).to(ngram_ids.device).flatten(-2)


def _ids_may_leave_the_vocab(ngram, input_ids: torch.Tensor) -> bool:
    """Whether ids outside the PLE vocabulary can reach this call where the op checks them asynchronously:
    only when the model's token embeddings were resized past it (otherwise the embedding lookup already
    refuses such ids). Host-known facts only: no sync on the common path."""
    if not reference.checks_async(input_ids.device):
        return False
    ref = ngram.__dict__[_PATCH].get("text_model")
    text_model = ref() if ref is not None else None
    embed = getattr(text_model, "embed_tokens", None)
    return embed is None or getattr(embed, "num_embeddings", 0) > int(ngram.unigram_vocab_size)


class _NgramSpec(NamedTuple):
    eos: int
    vocab: int


class _ConvSpec(NamedTuple):
    dilation: int
    activation: str


def ngram_rows(spec: _NgramSpec, tokens, history, multipliers, vocab_sizes, offsets) -> torch.Tensor:
    """reference.ple_ngram_ids_rows as a function of tensors (what cuda_graphs captures)."""
    return reference.ple_ngram_ids_rows(tokens, history, multipliers, vocab_sizes, offsets, spec.eos, spec.vocab)


def conv_rows(spec: _ConvSpec, x, weight, state) -> torch.Tensor:
    """reference.ple_conv_rows as a function of tensors (what cuda_graphs captures)."""
    return reference.ple_conv_rows(x, weight, state, spec.dilation, spec.activation)


def _maybe_graphed(fn, spec, args: tuple, length: int) -> torch.Tensor:
    """``fn(spec, *args)``, through a captured CUDA graph for short calls on CUDA (decode: the rows forms are
    some 20 launches of tiny kernels, a replay is one; :mod:`.cuda_graphs`)."""
    if length <= cuda_graphs.MAX_TOKENS and cuda_graphs.usable(*args):
        return cuda_graphs.replay(fn, spec, args, counter="ple_cuda_graph")
    return fn(spec, *args)


def _rows_form(op: str, device: torch.device) -> bool:
    """Whether an eager call runs the reference's uniform-rows form (hebrus_torch.reference.ple_*_rows:
    the op's results with a few kernels, read before the cache updates in place) instead of the op: on
    devices with no native kernel and device-side checks (CUDA: the fallback is launch-bound, issue 19)."""
    return (not torch.compiler.is_compiling() and reference.checks_async(device)
            and not has_native_kernel(op, device.type))


def _plain_depthwise(conv: torch.nn.Conv1d) -> bool:
    """What hebrus::ple_conv computes: depthwise, no bias, no padding, stride 1 (checked at each call:
    a bias may be added after apply)."""
    return (conv.bias is None and conv.groups == conv.in_channels == conv.out_channels
            and conv.padding in ((0,), 0) and conv.stride == (1,) and conv.padding_mode == "zeros")


def _short_conv(self, hidden_states: torch.Tensor, past_key_values) -> torch.Tensor:
    """Qwen4ExpTextPLELayer._short_conv as one hebrus::ple_conv call; the cache updates itself as before.

    hebrus::ple_conv has no backward and takes fp32/fp16/bf16: where a gradient is wanted, or for
    another dtype, transformers' own conv runs."""
    original = self.__dict__[_PATCH]["original__short_conv"]
    if torch.is_grad_enabled() and (hidden_states.requires_grad or self.conv1d.weight.requires_grad):
        _STATS["ple_fallback:autograd"] += 1
        return original(hidden_states, past_key_values)
    if hidden_states.dtype not in FLOAT_DTYPES or self.conv1d.weight.dtype != hidden_states.dtype:
        _STATS["ple_fallback:dtype"] += 1
        _warn_once("ple_fallback:dtype")
        return original(hidden_states, past_key_values)
    if not _plain_depthwise(self.conv1d):
        _STATS["ple_fallback:conv_not_plain"] += 1
        _warn_once("ple_fallback:conv_not_plain")
        return original(hidden_states, past_key_values)
    batch, length, channels = hidden_states.shape
    state_len = self.short_conv_state_len
    state = None
    if _rows_form("ple_conv", hidden_states.device):
        # The cache's tail read in place and y computed before update_conv_state writes over it.
        previous = (past_key_values.get_conv_state(self.layer_idx, state_idx=1)
                    if past_key_values is not None else None)
        if previous is not None:
            previous = previous[..., -state_len:]
            if previous.shape[-1] < state_len:
                previous = torch.nn.functional.pad(previous, (state_len - previous.shape[-1], 0))
            state = previous.transpose(1, 2)
        else:
            state = hidden_states.new_zeros((batch, state_len, channels))
        y = _maybe_graphed(conv_rows, _ConvSpec(int(self.conv1d.dilation[0]), "silu"),
                           (hidden_states, self.conv1d.weight[:, 0, :], state), length)
        if past_key_values is not None:
            past_key_values.update_conv_state(hidden_states.transpose(1, 2), self.layer_idx, state_idx=1,
                                              conv_kernel_size=state_len)
        _STATS["ple_conv"] += 1
        return y
    if past_key_values is not None:
        previous = past_key_values.get_conv_state(self.layer_idx, state_idx=1)
        if previous is not None:
            # [B, C, L'] -> the last L inputs as [B, L, C]; a copy, since the cache overwrites in place.
            # (record_past keeps L' > L columns, or fewer after a short prefill: zeros, as F.pad does.)
            previous = previous[..., -state_len:]
            if previous.shape[-1] < state_len:
                previous = torch.nn.functional.pad(previous, (state_len - previous.shape[-1], 0))
            state = previous.transpose(1, 2).contiguous().clone()
        past_key_values.update_conv_state(hidden_states.transpose(1, 2), self.layer_idx, state_idx=1,
                                          conv_kernel_size=state_len)
    if state is None:
        state = hidden_states.new_zeros((batch, state_len, channels))
    weight = self.conv1d.weight[:, 0, :].contiguous()
    cu_seqlens = torch.arange(batch + 1, device=hidden_states.device, dtype=torch.int32) * length
    y, _ = hebrus_torch.ple_conv(hidden_states.reshape(batch * length, channels), weight, cu_seqlens, state,
                                 int(self.conv1d.dilation[0]), "silu")
    if not torch.compiler.is_compiling():
        _STATS["ple_conv"] += 1
    return y.view(batch, length, channels)
