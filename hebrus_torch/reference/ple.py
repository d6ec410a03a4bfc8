"""The PLE ops' references (SPEC §2): hashed n-gram row ids (``ple_ngram_ids``), the depthwise causal
conv (``ple_conv``, its out-variant ``ple_conv_into``) and their slot forms, over packed rows with
``cu_seqlens``. SiLU is computed with the CPU kernel's arithmetic (:func:`_silu`) so the bits match it."""

from __future__ import annotations

import math

import torch

from .. import _validate
from ..errors import HebrusError
from .checks import assert_values, check_cu_seqlens_values, check_slot_values, checks_async

__all__ = ["ple_ngram_ids", "ple_conv", "ple_conv_into", "ple_conv_into_via", "ple_ngram_ids_slots",
           "ple_conv_slots"]


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """``fma(a, b, c)`` of float32 values, rounded once, as C's fmaf: the product is exact in float64,
    the sum is rounded to odd in float64 (TwoSum gives its exact error), and rounding that to float32
    is then the correctly rounded result (53 >= 24 + 2 bits). Elementwise IEEE operations only, so
    every device and every vector width give the same bits (MPS has no float64: computed on the CPU)."""
    if a.device.type == "mps":
        c = c.cpu() if isinstance(c, torch.Tensor) else c
        return _fma32(a.cpu(), b.cpu(), c).to(a.device)
    p = a.double() * b.double()
    c64 = torch.as_tensor(c, dtype=torch.float64, device=p.device)
    s = p + c64
    bp = s - c64
    err = (p - bp) + (c64 - (s - bp))
    to_odd = (err != 0) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(err > 0, math.inf, -math.inf).to(torch.float64)
    return torch.where(to_odd, torch.nextafter(s, toward), s).float()


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of float32 values as unsigned 32-bit integers held in int64."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    """float32 values from unsigned 32-bit patterns held in int64 (the low 32 bits are used)."""
    b = b & 0xFFFFFFFF
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of float32 values with the CPU kernel's arithmetic (csrc/cpu/ple_kernels.cpp, exp_silu and
    silu): ``x / (1 + exp(-x))`` with its clamped Cephes exp and fused multiply-adds, so the reference
    gives the kernel's bits. torch's own silu takes another exp on its vector body than on the scalar
    tail (CPU), so its bits would depend on where a token falls in the tensor: on how a batch is cut."""
    e = -x
    b = _bits(e)
    neg_capped = torch.where(b < 0xC2AF0000, b, 0xC2AF0000)                 # -87.5 and below -> -87.5
    flipped = neg_capped ^ 0x80000000
    capped = torch.where(flipped < (0x42B20000 ^ 0x80000000), flipped, 0x42B20000 ^ 0x80000000)  # -> <= 89
    xc = _from_bits(capped ^ 0x80000000)
    magic = 12582912.0                                                     # 1.5 * 2^23
    t = _fma32(xc, torch.tensor(1.44269504088896341, dtype=torch.float32), magic)
    n = t - magic
    ni = _bits(t) - _bits(torch.tensor(magic, dtype=torch.float32))
    r = _fma32(n, torch.tensor(2.12194440e-4, dtype=torch.float32),
               _fma32(n, torch.tensor(-0.693359375, dtype=torch.float32), xc))
    y = torch.full_like(r, 1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = _fma32(y, r, torch.tensor(coef, dtype=torch.float32))
    poly = _fma32(y, r * r, r) + 1.0
    exp_neg = (poly * _from_bits((ni + 126) << 23)) * 2.0
    return x / (1.0 + exp_neg)


def _row_streams(values: torch.Tensor, prefix: torch.Tensor, cu_seqlens: torch.Tensor, back: torch.Tensor):
    """Each row's stream ``prefix[b] ++ values[cu[b]:cu[b+1]]`` read without building it.

    Args:
        values: Tensor[T, ...] packed tokens; prefix: Tensor[B, P, ...], each row's P entries before them.
        back: Tensor[S] int64, distances 0 <= s <= P.

    Returns:
        (src, window_idx, tail_idx): ``src`` is values then the flattened prefixes; ``src[window_idx[t, j]]``
        is the entry ``back[j]`` places before token t in its row's stream; ``src[tail_idx[b, m]]`` is
        entry m of the last P of row b's stream (oldest first). A fixed number of kernels, no host read.
    """
    batch, plen = prefix.shape[0], prefix.shape[1]
    device = values.device
    total = values.shape[0]
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    src = torch.cat((values, prefix.reshape(batch * plen, *prefix.shape[2:])))
    t = torch.arange(total, device=device)
    row = torch.searchsorted(cu[1:], t, right=True)                        # row of each token
    i = t - cu[row]                                                        # index within its row
    # An entry s back from in-row index i: token t - s when i >= s, else prefix entry P + i - s of its row.
    pre = (row * plen + (total + plen))[:, None] + (i[:, None] - back)
    window_idx = torch.where(i[:, None] >= back, t[:, None] - back, pre)
    lengths = cu[1:] - cu[:-1]
    m = torch.arange(plen, device=device) - plen                           # -P .. -1
    p = lengths[:, None] + m                                               # in-row index of tail entry m
    rows = torch.arange(batch, device=device)[:, None]
    tail_idx = torch.where(p >= 0, cu[:-1, None] + p, rows * plen + (total + plen) + p)
    return src, window_idx, tail_idx


def ple_ngram_ids(tokens: torch.Tensor, cu_seqlens: torch.Tensor, history: torch.Tensor,
                  multipliers: torch.Tensor, vocab_sizes: torch.Tensor, offsets: torch.Tensor,
                  eos: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hashed n-gram row ids with the frozen EOS history rule (SPEC §2).

    Args:
        tokens: Tensor[T] int64, packed token ids of B sequences.
        cu_seqlens: Tensor[B+1] int32, row boundaries into ``tokens``.
        history: Tensor[B, N-1] int64, the last N-1 raw tokens before this chunk per row
            (``[eos]*(N-1)`` for a fresh sequence).
        multipliers: Tensor[N] int64, ``layer_multipliers``.
        vocab_sizes: Tensor[(N-1)*H] int64, ``ngram_heads_vocab_sizes``.
        offsets: Tensor[(N-1)*H] int64, ``ngram_heads_offsets``.
        eos: end-of-sequence token id, any int64 (inside the vocabulary or not: it is only compared with ids).
        vocab: unigram vocabulary size; every token id must lie in ``[0, vocab)``, every history id there
            or equal ``eos``.

    Returns:
        row_ids: Tensor[T, (N-1)*H] int64, bigram heads first, then trigram heads, ...
        new_history: Tensor[B, N-1] int64, the last N-1 raw tokens of ``history ++ tokens``.
    """
    n, heads = _validate.ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab)
    return _ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab, n, heads,
                          "ple_ngram_ids")


def _ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab, n, heads, op,
                   history_name="history"):
    check_cu_seqlens_values(cu_seqlens, tokens.shape[0], op)
    _ngram_value_checks(tokens, history, vocab_sizes, eos, vocab, op, history_name)
    ctx = n - 1
    back = torch.arange(1, ctx + 1, device=tokens.device)
    src, window_idx, tail_idx = _row_streams(tokens, history, cu_seqlens, back)
    window = src[window_idx]                                               # [T, ctx]: 1, 2, ... tokens back
    return _ngram_hash(tokens, window, multipliers, vocab_sizes, offsets, eos, ctx, heads), src[tail_idx]


def _ngram_value_checks(tokens, history, vocab_sizes, eos, vocab, op, history_name="history"):
    """Token ids in [0, vocab), history ids there or eos, vocab_sizes positive (CPU: at once, with the
    entry; devices with device-side checks: one assert)."""
    if checks_async(tokens.device):
        hist_ok = ((history >= 0) & (history < vocab)) | (history == eos)
        assert_values(((tokens >= 0) & (tokens < vocab)).all() & hist_ok.all() & (vocab_sizes > 0).all(), op,
                      f"token ids must lie in [0, vocab={vocab}), {history_name} ids there or equal eos, "
                      f"vocab_sizes be positive")
    for name, t in (() if checks_async(tokens.device) else (("tokens", tokens), (history_name, history))):
        bad = (t < 0) | (t >= vocab)
        if name == history_name:            # a fresh history is [eos]*(N-1), and eos may lie outside the vocabulary
            bad &= t != eos
        if bool(bad.any()):
            where = tuple(int(i) for i in torch.nonzero(bad)[0])
            tail = " and is not eos" if name == history_name else ""
            raise HebrusError(f"hebrus::{op}: {name}{list(where)} = {int(t[where])} is outside [0, vocab={vocab})"
                              f"{tail}")
    if not checks_async(tokens.device) and bool((vocab_sizes <= 0).any()):
        head = int(torch.nonzero(vocab_sizes <= 0)[0])
        raise HebrusError(f"hebrus::{op}: vocab_sizes[{head}] must be positive, got {int(vocab_sizes[head])}")


def _ngram_hash(tokens, window, multipliers, vocab_sizes, offsets, eos, ctx, heads):
    """Row ids [..., heads] of tokens [...] from their windows [..., ctx] (1, 2, ... tokens back)."""
    h = heads // ctx if ctx else 0
    # The shift rule (SPEC §2): the token k back reads as eos once an eos lies 1..k back in the row's
    # stream (history included); an eos k back reads as itself, eos.
    seen = torch.cumsum(window == eos, dim=-1) > 0
    shifted = torch.where(seen, eos, window)
    mixed = tokens * multipliers[0]
    prods = shifted * multipliers[1:]
    orders = []
    for k in range(ctx):                                                   # order k + 2: xor in the token k+1 back
        mixed = torch.bitwise_xor(mixed, prods[..., k])
        orders.append(mixed)
    if ctx:
        stacked = torch.stack(orders, dim=-1)[..., None]                   # [..., ctx, 1]
        return (torch.remainder(stacked, vocab_sizes.view(ctx, h)) + offsets.view(ctx, h)).reshape(
            *tokens.shape, heads)
    return tokens.new_empty((*tokens.shape, 0))


def ple_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
             dilation: int, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal dilated conv over packed rows with carried input tails (SPEC §2).

    ``y[t, c] = act(sum_{k<K} w[c, k] * u[t - (K-1-k)*d, c])`` accumulated in fp32 in ascending k,
    where u is each row's ``state ++ x`` stream.

    Args:
        x: Tensor[T, C] float32/float16/bfloat16, packed conv inputs.
        weight: Tensor[C, K], same dtype as x.
        cu_seqlens: Tensor[B+1] int32.
        state: Tensor[B, L, C], L = (K-1)*dilation, the last L inputs per row, oldest first.
        dilation: d >= 1.
        activation: ``"silu"`` or ``"none"``.

    Returns:
        y: Tensor[T, C] in x's dtype; new_state: Tensor[B, L, C], the last L inputs of ``state ++ x``.
    """
    _validate.ple_conv(x, weight, cu_seqlens, state, dilation, activation)
    return _ple_conv(x, weight, cu_seqlens, state, dilation, activation, "ple_conv")


def _ple_conv(x, weight, cu_seqlens, state, dilation, activation, op):
    check_cu_seqlens_values(cu_seqlens, x.shape[0], op)
    width = weight.shape[1]
    back = torch.arange(width - 1, -1, -1, device=x.device) * dilation    # tap k reads (K-1-k)*d back
    src, window_idx, tail_idx = _row_streams(x, state, cu_seqlens, back)
    prod = src[window_idx].float() * weight.float().t()                    # [T, K, C]: w[c, k] * u
    return _conv_sum(prod.movedim(1, -1), x.shape, x.dtype, width, activation, x.device), src[tail_idx]


def _conv_sum(prod, shape, dtype, width, activation, device):
    """act(sum over the last dim of prod [..., C, K]) in ``dtype``."""
    # fp32 in ascending k from 0 (0 + p_0 + p_1 + ...: one product rounding, then each sum rounded).
    acc = prod[..., 0] + 0.0 if width else torch.zeros(shape, dtype=torch.float32, device=device)
    for k in range(1, width):
        acc = acc + prod[..., k]
    if activation == "silu":
        # CPU (and MPS, which has no float64: its reference runs only without the extension): the CPU
        # kernel's bits. Elsewhere torch's own elementwise SiLU, a function of each value alone, so
        # chunk-invariant on its device (SPEC §6) and with no host round trip.
        acc = _silu(acc) if device.type in ("cpu", "mps") else torch.nn.functional.silu(acc)
    return acc.to(dtype)


def ple_conv_into(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                  dilation: int, activation: str, y: torch.Tensor, new_state: torch.Tensor) -> None:
    """:func:`ple_conv` written into caller-owned buffers (not in the SPEC; an out-variant).

    Args:
        x, weight, cu_seqlens, state, dilation, activation: as :func:`ple_conv`.
        y: Tensor[T, C] like x, contiguous; receives y.
        new_state: Tensor[B, L, C] like state, contiguous; receives new_state.

    Neither buffer may share memory with an input or with the other. Every check runs before
    anything is written.
    """
    ple_conv_into_via(ple_conv, x, weight, cu_seqlens, state, dilation, activation, y, new_state)


def ple_conv_into_via(conv, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                      dilation: int, activation: str, y: torch.Tensor, new_state: torch.Tensor) -> None:
    """ple_conv_into computed by ``conv``, a functional ple_conv (this reference's, or a device's
    native kernel in the composite of devices without an out-variant kernel): every check of
    ple_conv_into first, then conv's outputs copied into the buffers."""
    _validate.ple_conv_into(x, weight, cu_seqlens, state, dilation, activation, y, new_state)
    _validate.no_overlap("ple_conv_into", {"y": y, "new_state": new_state},
                         {"x": x, "weight": weight, "cu_seqlens": cu_seqlens, "state": state})
    check_cu_seqlens_values(cu_seqlens, x.shape[0], "ple_conv_into")
    out_y, out_state = conv(x, weight, cu_seqlens, state, dilation, activation)
    y.copy_(out_y)
    new_state.copy_(out_state)


def ple_ngram_ids_slots(tokens: torch.Tensor, cu_seqlens: torch.Tensor, history_pool: torch.Tensor,
                        slots: torch.Tensor, multipliers: torch.Tensor, vocab_sizes: torch.Tensor,
                        offsets: torch.Tensor, eos: int, vocab: int) -> torch.Tensor:
    """:func:`ple_ngram_ids` whose row r reads its history from ``history_pool[slots[r]]`` and writes the
    new history back there, in place (issue 19; the slot-indexed form of causal-conv1d's
    ``conv_state_indices``).

    Args:
        tokens, cu_seqlens, multipliers, vocab_sizes, offsets, eos, vocab: as :func:`ple_ngram_ids`.
        history_pool: Tensor[S, N-1] int64, contiguous; the rows of ``slots`` are read and updated.
        slots: Tensor[B] int32, distinct slots in [0, S), one per row of cu_seqlens.

    Returns:
        row_ids: Tensor[T, (N-1)*H] int64, equal to ple_ngram_ids on the gathered histories; rows of
        the pool not named in ``slots`` are untouched, a row with no tokens keeps its history.
    """
    n, heads = _validate.ple_ngram_ids_slots(tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes,
                                             offsets, eos, vocab)
    op = "ple_ngram_ids_slots"
    check_slot_values(slots, history_pool.shape[0], op)
    idx = slots.long()
    row_ids, new_history = _ple_ngram_ids(tokens, cu_seqlens, history_pool.index_select(0, idx), multipliers,
                                          vocab_sizes, offsets, eos, vocab, n, heads, op, "history_pool[slots]")
    history_pool.index_copy_(0, idx, new_history)
    return row_ids


def ple_conv_slots(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, state_pool: torch.Tensor,
                   slots: torch.Tensor, dilation: int, activation: str) -> torch.Tensor:
    """:func:`ple_conv` whose row r reads its conv tail from ``state_pool[slots[r]]`` and writes the new
    tail back there, in place (issue 19), so a decode step moves only the rows it updates.

    Args:
        x, weight, cu_seqlens, dilation, activation: as :func:`ple_conv`.
        state_pool: Tensor[S, (K-1)*dilation, C] in x's dtype, contiguous; the rows of ``slots`` are read
            and updated.
        slots: Tensor[B] int32, distinct slots in [0, S), one per row of cu_seqlens.

    Returns:
        y: Tensor[T, C], bitwise ple_conv's on the gathered tails; the pool rows of ``slots`` then hold
        ple_conv's new_state, the others are untouched.
    """
    _validate.ple_conv_slots(x, weight, cu_seqlens, state_pool, slots, dilation, activation)
    op = "ple_conv_slots"
    check_slot_values(slots, state_pool.shape[0], op)
    idx = slots.long()
    y, new_state = _ple_conv(x, weight, cu_seqlens, state_pool.index_select(0, idx), dilation, activation, op)
    state_pool.index_copy_(0, idx, new_state)
    return y
