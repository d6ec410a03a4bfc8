"""Typed wrappers and fake impls for the PLE ops (SPEC §2)."""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import translated


def ple_ngram_ids(tokens: torch.Tensor, cu_seqlens: torch.Tensor, history: torch.Tensor,
                  multipliers: torch.Tensor, vocab_sizes: torch.Tensor, offsets: torch.Tensor,
                  eos: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hashed n-gram row ids of packed rows; see :func:`hebrus_torch.reference.ple_ngram_ids`.

    Shapes: tokens [T] i64, cu_seqlens [B+1] i32, history [B, N-1] i64, multipliers [N] i64,
    vocab_sizes / offsets [(N-1)*H] i64 -> (row_ids [T, (N-1)*H] i64, new_history [B, N-1] i64).
    """
    with translated():
        return torch.ops.hebrus.ple_ngram_ids.default(tokens, cu_seqlens, history, multipliers,
                                                      vocab_sizes, offsets, eos, vocab)


def ple_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
             dilation: int = 3, activation: str = "silu", *,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal dilated conv of packed rows; see :func:`hebrus_torch.reference.ple_conv`.

    Shapes: x [T, C], weight [C, K], cu_seqlens [B+1] i32, state [B, (K-1)*dilation, C]
    -> (y [T, C], new_state [B, (K-1)*dilation, C]); float32/float16/bfloat16, fp32 accumulation.

    ``out=(y, new_state)``: write into these contiguous buffers instead (``hebrus::ple_conv_into``)
    and return them; they must have the output shapes and dtype and share no memory with the inputs
    or each other. A prefill loop that reuses them skips a fresh [T, C] allocation per call.
    """
    with translated():
        if out is None:
            return torch.ops.hebrus.ple_conv.default(x, weight, cu_seqlens, state, dilation, activation)
        y, new_state = out
        torch.ops.hebrus.ple_conv_into.default(x, weight, cu_seqlens, state, dilation, activation, y, new_state)
        return y, new_state


def ple_ngram_ids_slots(tokens: torch.Tensor, cu_seqlens: torch.Tensor, history_pool: torch.Tensor,
                        slots: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                        offsets: torch.Tensor, eos: int, vocab: int) -> torch.Tensor:
    """:func:`ple_ngram_ids` with row r's history read from and written back to ``history_pool[slots[r]]``
    in place; see :func:`hebrus_torch.reference.ple_ngram_ids_slots`.

    Shapes: history_pool [S, N-1] i64 (contiguous, mutated), slots [B] i32 (distinct) -> row_ids [T, (N-1)*H].
    """
    with translated():
        return torch.ops.hebrus.ple_ngram_ids_slots.default(tokens, cu_seqlens, history_pool, slots, multipliers,
                                                            vocab_sizes, offsets, eos, vocab)


def ple_conv_slots(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                   slots: torch.Tensor, dilation: int = 3, activation: str = "silu") -> torch.Tensor:
    """:func:`ple_conv` with row r's conv tail read from and written back to ``state_pool[slots[r]]`` in
    place; see :func:`hebrus_torch.reference.ple_conv_slots`.

    Shapes: state_pool [S, (K-1)*dilation, C] like x (contiguous, mutated), slots [B] i32 (distinct) -> y [T, C].
    """
    with translated():
        return torch.ops.hebrus.ple_conv_slots.default(x, weight, cu_seqlens, state_pool, slots, dilation, activation)


@torch.library.register_fake("hebrus::ple_ngram_ids_slots")
def _ple_ngram_ids_slots_fake(tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes, offsets, eos, vocab):
    _, heads = _validate.ple_ngram_ids_slots(tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes,
                                             offsets, eos, vocab)
    return tokens.new_empty((tokens.shape[0], heads))


@torch.library.register_fake("hebrus::ple_conv_slots")
def _ple_conv_slots_fake(x, weight, cu_seqlens, state_pool, slots, dilation, activation):
    _validate.ple_conv_slots(x, weight, cu_seqlens, state_pool, slots, dilation, activation)
    return x.new_empty(x.shape)


@torch.library.register_fake("hebrus::ple_ngram_ids")
def _ple_ngram_ids_fake(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab):
    _, heads = _validate.ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab)
    return tokens.new_empty((tokens.shape[0], heads)), history.new_empty(history.shape)


@torch.library.register_fake("hebrus::ple_conv")
def _ple_conv_fake(x, weight, cu_seqlens, state, dilation, activation):
    _validate.ple_conv(x, weight, cu_seqlens, state, dilation, activation)
    return x.new_empty(x.shape), state.new_empty(state.shape)


@torch.library.register_fake("hebrus::ple_conv_into")
def _ple_conv_into_fake(x, weight, cu_seqlens, state, dilation, activation, y, new_state):
    _validate.ple_conv_into(x, weight, cu_seqlens, state, dilation, activation, y, new_state)
