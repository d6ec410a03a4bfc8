"""The drop-in's fast paths of the PLE ops: uniform rows (B rows of L tokens each, host-known; the
drop-in's calls), the same arithmetic as ple_ngram_ids / ple_conv with cu_seqlens = [0, L, 2L, ...],
each row's stream one concatenation (no index arithmetic, no cu_seqlens checks: a few kernels where the
CUDA fallback is launch-bound, issue 19). Not ops: the drop-in
(``hebrus_torch.integrations.qwen4_exp.ple``) calls them only where the device has no native kernel."""

from __future__ import annotations

import torch

from .. import _validate
from .ple import _conv_sum, _ngram_hash, _ngram_value_checks

__all__ = ["ple_ngram_ids_rows", "ple_conv_rows"]


def ple_ngram_ids_rows(tokens: torch.Tensor, history: torch.Tensor, multipliers: torch.Tensor,
                       vocab_sizes: torch.Tensor, offsets: torch.Tensor, eos: int, vocab: int) -> torch.Tensor:
    """:func:`ple_ngram_ids` of tokens [B, L] (rows of equal length) with history [B, N-1]: row_ids
    [B, L, (N-1)*H], equal to the op's on the packed rows; the op's argument and value checks."""
    batch = tokens.shape[0]
    n, heads = _validate.ple_ngram_ids(tokens.reshape(-1), torch.empty(batch + 1, dtype=torch.int32,
                                                                       device=tokens.device),
                                       history, multipliers, vocab_sizes, offsets, eos, vocab)
    _ngram_value_checks(tokens, history, vocab_sizes, eos, vocab, "ple_ngram_ids")
    ctx = n - 1
    stream = torch.cat((history, tokens), dim=1)                            # [B, ctx + L]
    # window[b, i, s - 1] = the entry s back from token i: stream[b, ctx + i - s].
    window = stream.unfold(1, ctx + 1, 1)[:, :, :ctx].flip(-1)              # [B, L, ctx]
    return _ngram_hash(tokens, window, multipliers, vocab_sizes, offsets, eos, ctx, heads)


def ple_conv_rows(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, dilation: int,
                  activation: str) -> torch.Tensor:
    """y of :func:`ple_conv` for x [B, L, C] (rows of equal length), state [B, (K-1)*d, C] (any strides),
    weight [C, K]: y [B, L, C], the op's bits on the packed rows."""
    batch, length, channels = x.shape
    _validate.ple_conv(x.reshape(batch * length, channels), weight,
                       torch.empty(batch + 1, dtype=torch.int32, device=x.device), state, dilation, activation)
    width = weight.shape[1]
    span = (width - 1) * dilation
    stream = torch.cat((state, x), dim=1)                                   # [B, span + L, C]
    # tap k of token i reads (K-1-k)*d back: stream[b, i + k*d]
    window = stream.unfold(1, span + 1, 1)[..., ::dilation]                 # [B, L, C, K]
    prod = window.float() * weight.float()                                  # w[c, k] * u
    return _conv_sum(prod, x.shape, x.dtype, width, activation, x.device)
