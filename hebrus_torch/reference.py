"""Pure-PyTorch reference implementations of every hebrus op: the executable form of SPEC.md.

They run on any device, are vectorised over tokens, queries and sequences (the only Python loops
are over sequences or fixed-size query blocks, never over tokens; qsa_select's scores also loop
over the 16-dim chunks of D and over the heads, to fix their summation order), and are registered
as the kernel of every device that has no native one. fp32 accumulation throughout.
"""

from __future__ import annotations

import math

import torch

from . import _validate
from .errors import HebrusError, HoleError
from .qsa.runs import first_hole

__all__ = ["ple_ngram_ids", "ple_conv", "ple_conv_into", "ple_ngram_ids_slots", "ple_conv_slots", "qsa_pool",
           "qsa_select", "qsa_attention", "gdn_delta_rule", "gdn_delta_rule_slots", "check_cu_seqlens_values",
           "check_slot_values"]


def checks_async(device: torch.device) -> bool:
    """Whether value checks on ``device`` are device-side asserts (SPEC §4 "Errors on GPUs": CUDA and
    other accelerators report bad values at their next synchronization, no op waits for the device) or
    raise at once (CPU; MPS, whose native kernels run wherever the extension is built)."""
    return device.type not in ("cpu", "mps", "meta")


def assert_values(ok: torch.Tensor, op: str, rule: str) -> None:
    """Device-side check that every entry of the bool tensor ``ok`` holds (``torch._assert_async``): the
    host does not wait; a failure surfaces at the device's next synchronization, as PyTorch's own
    index errors do. The message names the op and the rule (the device cannot format values)."""
    torch._assert_async(ok.all(), f"hebrus::{op}: {rule}")


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, total: int, op: str) -> None:
    """cu_seqlens[0] == 0, non-decreasing, cu_seqlens[-1] == total (on CPU at once; on CUDA as a device-side
    assert, with no host synchronization)."""
    if checks_async(cu_seqlens.device):
        cu = cu_seqlens.long()
        ok = (cu[0] == 0) & (cu[-1] == total)
        if cu.numel() > 1:
            ok = ok & (cu[1:] >= cu[:-1]).all()
        assert_values(ok, op, f"cu_seqlens must start at 0, be non-decreasing and end at T = {total}")
        return
    cu = cu_seqlens.to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        raise HebrusError(f"hebrus::{op}: cu_seqlens must start at 0 and end at T = {total}, "
                          f"got {int(cu[0])} .. {int(cu[-1])}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        row = int(torch.nonzero(cu[1:] < cu[:-1])[0])
        raise HebrusError(f"hebrus::{op}: cu_seqlens must be non-decreasing; row {row} has "
                          f"cu_seqlens[{row}] = {int(cu[row])} > cu_seqlens[{row + 1}] = {int(cu[row + 1])}")


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


# Uniform rows (B rows of L tokens each, host-known; the drop-in's calls): the same arithmetic as
# ple_ngram_ids / ple_conv with cu_seqlens = [0, L, 2L, ...], each row's stream one concatenation
# (no index arithmetic, no cu_seqlens checks: a few kernels where the CUDA fallback is launch-bound,
# issue 19). Not ops: the drop-in calls them only where the device has no native kernel.

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


def check_slot_values(slots: torch.Tensor, pool_slots: int, op: str) -> None:
    """Every slot in [0, S) and none twice (each row updates its slot in place). On CPU at once, with the
    row and value; on CUDA as a device-side assert (the state holders check the slots they own on the
    host before launching, SPEC §4)."""
    s = slots.long()
    if checks_async(slots.device):
        ok = ((s >= 0) & (s < pool_slots)).all()
        if s.numel() > 1:
            ordered = torch.sort(s).values
            ok = ok & (ordered[1:] != ordered[:-1]).all()
        assert_values(ok, op, f"slots must lie in [0, S={pool_slots}) and be distinct")
        return
    s = s.cpu().tolist()
    first: dict[int, int] = {}
    for row, v in enumerate(s):
        if not 0 <= v < pool_slots:
            raise HebrusError(f"hebrus::{op}: slots[{row}] = {v} is outside [0, S={pool_slots})")
        if v in first:
            raise HebrusError(f"hebrus::{op}: slot {v} appears twice in one batch (rows {first[v]} and {row}); "
                              f"each row updates its slot in place")
        first[v] = row


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def check_groups_contiguous(cell_pos: torch.Tensor, group_cells: torch.Tensor, group_pos: torch.Tensor,
                            op: str = "qsa_pool") -> None:
    """Raise HoleError unless every group's cells hold positions group_pos, group_pos+1, ... (on devices
    with device-side checks, SPEC §4, a device assert instead: a hole inside a group is a value check)."""
    cells = cell_pos.shape[0]
    out_of_range = (group_cells < 0) | (group_cells >= cells)
    if checks_async(cell_pos.device):
        r = group_cells.shape[1]
        got = cell_pos[group_cells.long().clamp(0, max(cells - 1, 0))]
        expected = group_pos[:, None] + torch.arange(r, device=group_pos.device)
        assert_values(~out_of_range & (got == expected), op,
                      f"group cells must lie in [0, {cells}) and hold consecutive positions from group_pos "
                      f"(a hole inside the run is not padding)")
        return
    if bool(out_of_range.any()):
        g, i = (int(v) for v in torch.nonzero(out_of_range)[0])
        raise HebrusError(f"hebrus::{op}: group {g} cell {i} = {int(group_cells[g, i])} is outside [0, {cells})")
    r = group_cells.shape[1]
    got = cell_pos[group_cells.long()]
    # Each group is a run of r positions from group_pos (the run rule: hebrus_torch.qsa.runs).
    hole = first_hole(got.reshape(-1), group_pos, torch.full_like(group_pos, r)) if r else None
    if hole is not None:
        g, i = divmod(hole, r)
        expected = group_pos[:, None] + torch.arange(r, device=group_pos.device)[None, :]
        raise HoleError(f"hebrus::{op}: group {g} starting at position {int(group_pos[g])} has position "
                        f"{int(got[g, i])} in member {i} where {int(expected[g, i])} is required "
                        f"(a hole inside the run is not padding)")


def qsa_pool(keys: torch.Tensor, cell_pos: torch.Tensor, group_cells: torch.Tensor, group_pos: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pooled, normed and roped key of every group (SPEC §3), as transformers' indexer computes it.

    Args:
        keys: Tensor[cells, D] float32/float16/bfloat16, raw indexer keys (no norm, no RoPE).
        cell_pos: Tensor[cells] int64, logical position held by each cell.
        group_cells: Tensor[G, r] int32, the r cells of each group in position order.
        group_pos: Tensor[G] int64, position of each group's first token.
        norm_weight: Tensor[D], ``k_layernorm.weight`` (applied as ``1 + w``).
        eps: RMSNorm epsilon.
        inv_freq: Tensor[R/2] float32, rotary inverse frequencies (rotate-half on the first R dims).

    Returns:
        Tensor[G, D] in keys' dtype. Raises HoleError when a group's cells are not consecutive positions.
    """
    _validate.qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq)
    check_groups_contiguous(cell_pos, group_cells, group_pos)
    dtype = keys.dtype
    pooled = keys[group_cells.long()].float().mean(dim=1).to(dtype)
    xf = pooled.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * (1.0 + norm_weight.float())).to(dtype)
    rot = 2 * inv_freq.shape[0]
    if rot == 0:                         # no rotary dims (a caller that ropes the pooled keys itself)
        return normed
    freqs = group_pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    head = normed[:, :rot]
    head = head * cos + rotate_half(head) * sin
    return torch.cat((head, normed[:, rot:]), dim=-1)


_SCORE_LANES = 16                 # lanes of the CPU kernel's dot products (csrc/cpu/hebrus_simd.h, kLanes)
_SELECT_BLOCK_BYTES = 64 << 20    # fp32 working set of one block of (queries x groups) scores


def qsa_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``sum_h relu(q_h . k_g) / sqrt(D)`` in fp32, in the CPU kernel's fixed order (SPEC §3, §5.1).

    Every score is a function of its own query and key only, computed with the arithmetic of
    csrc/cpu/qsa_kernels.cpp's score_rows and hebrus_simd.h's lane reduction, so it is bitwise
    independent of the other queries and groups (no matmul, whose blocking changes the summation
    order with the batch) and bitwise equal to the CPU kernel's score:

    * D is zero padded to a multiple of 16; lane j (0..15) sums the products ``q[d] * k[d]`` (each
      rounded to fp32, never fused) of the dims ``d = j mod 16`` in ascending d;
    * the 16 lanes combine pairwise: lane j + lane j+8, then + 4, + 2, + 1;
    * the heads add in order from 0 onto 0: ``((0 + relu(dot_0)) + relu(dot_1)) + ...``;
    * the sum is divided (a true fp32 division) by ``float(sqrt(D))``.

    The lane sums start at their first product instead of 0: that changes only the sign of a zero lane
    sum, which the head sum (starting from +0) absorbs, so the bits are those of the order above. All
    products of a block are one multiplication (elementwise: the same rounding), so a block launches a
    fixed, small number of kernels whatever D and Hq are (issue 19: the CUDA fallback is launch-bound).

    Args:
        q: Tensor[n, Hq, D] any float dtype (widened to fp32).
        keys: Tensor[G, D] (the same keys for every query) or Tensor[n, G, D] (each query its own G keys),
            any float dtype (widened to fp32).

    Returns:
        Tensor[n, G] float32, not differentiable (the inputs are detached: a selection has no
        gradient, and the in-place and out= operations below refuse inputs that require one).
    """
    q, keys = q.detach(), keys.detach()
    n, hq, dim = q.shape
    shared = keys.dim() == 2
    groups = keys.shape[-2]
    lanes = _SCORE_LANES
    chunks = max(1, -(-dim // lanes))
    pad = chunks * lanes - dim
    qf = q.float()
    kf = keys.float()
    if pad:
        qf = torch.nn.functional.pad(qf, (0, pad))
        kf = torch.nn.functional.pad(kf, (0, pad))
    qf = qf.view(n, hq, 1, chunks, lanes)
    kf = kf.view(1, 1, groups, chunks, lanes) if shared else kf.view(n, 1, groups, chunks, lanes)
    # A true division by a tensor on q's device: CUDA turns a division by a host scalar into a
    # multiplication by its reciprocal, which is not the kernel's rounding.
    sqrt_d = torch.full((), math.sqrt(dim), dtype=torch.float32, device=q.device)
    out = torch.empty((n, groups), dtype=torch.float32, device=q.device)
    if n == 0 or groups == 0:
        return out
    # Blocks of queries and groups bound the [n, Hq, G, chunks, 16] products; every score is computed
    # independently of the block it falls in.
    per_pair = max(hq, 1) * (chunks + 1) * lanes * 4
    g_block = max(1, min(groups, _SELECT_BLOCK_BYTES // per_pair))
    q_block = max(1, min(n, _SELECT_BLOCK_BYTES // (per_pair * g_block)))
    for q0 in range(0, n, q_block):
        qs = qf[q0:q0 + q_block]                                         # [nb, Hq, 1, chunks, 16]
        nb = qs.shape[0]
        for g0 in range(0, groups, g_block):
            ks = kf[:, :, g0:g0 + g_block] if shared else kf[q0:q0 + nb, :, g0:g0 + g_block]
            prod = qs * ks                                               # [nb, Hq, gb, chunks, 16]
            acc = prod[:, :, :, 0]
            for c in range(1, chunks):                                   # ascending d in every lane
                acc = acc + prod[:, :, :, c]
            half = acc[..., :8] + acc[..., 8:]                           # lanes j and j + 8
            half = half[..., :4] + half[..., 4:]                         # then + 4
            half = half[..., :2] + half[..., 2:]                         # then + 2
            dots = torch.relu(half[..., 0] + half[..., 1])               # then + 1: [nb, Hq, gb]
            total = dots[:, 0] + 0.0 if hq else torch.zeros_like(out[q0:q0 + nb, g0:g0 + dots.shape[2]])
            for h in range(1, hq):                                       # heads in order from 0
                total = total + dots[:, h]
            torch.div(total, sqrt_d, out=out[q0:q0 + nb, g0:g0 + dots.shape[2]])
    return out


def qsa_select(q: torch.Tensor, pooled: torch.Tensor, seq_groups: torch.Tensor, q_row: torch.Tensor,
               q_groups: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k groups per query by ``sum_h relu(q_h . k_g) / sqrt(D)`` in fp32 (SPEC §3).

    Args:
        q: Tensor[Tq, Hq, D], indexer queries (normed and roped by the model).
        pooled: Tensor[rows, D], pooled group keys.
        seq_groups: Tensor[B, maxG] int32, pooled row of each sequence's groups in order, -1 past the end.
        q_row: Tensor[Tq] int32, the seq_groups row of each query.
        q_groups: Tensor[Tq] int32, number of complete groups visible to each query.
        top_k: number of groups to keep.

    Returns:
        Tensor[Tq, top_k] int32: selected group indices within the sequence, ascending, -1 padded.
        Ties are broken by the lower group index.
    """
    _validate.qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k)
    op = "qsa_select"
    tq, max_g = q.shape[0], seq_groups.shape[1]
    out = torch.full((tq, top_k), -1, dtype=torch.int32, device=q.device)
    if tq == 0:
        return out
    rows = q_row.long()
    ng = q_groups.long()
    if checks_async(q.device):
        assert_values(((rows >= 0) & (rows < seq_groups.shape[0])).all() & ((ng >= 0) & (ng <= max_g)).all(), op,
                      f"q_row must lie in [0, B={seq_groups.shape[0]}) and q_groups in [0, maxG={max_g}]")
        # No host loop over sequences (it would read the rows on the host): every query at once.
        return _qsa_select_all(q, pooled, seq_groups, rows, ng, top_k, out)
    bad = (rows < 0) | (rows >= seq_groups.shape[0])
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0])
        raise HebrusError(f"hebrus::{op}: q_row[{t}] = {int(rows[t])} is outside [0, B={seq_groups.shape[0]})")
    bad = (ng < 0) | (ng > max_g)
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0])
        raise HebrusError(f"hebrus::{op}: q_groups[{t}] = {int(ng[t])} is outside [0, maxG={max_g}]")
    # One pass per sequence: the pooled keys of a sequence are gathered once. A query that sees at
    # most top_k groups selects all of them, whatever the scores; the others rank their scores.
    for row in torch.unique(rows).tolist():
        members = torch.nonzero(rows == row).flatten()
        groups_needed = int(ng[members].max())
        if groups_needed == 0:
            continue
        group_rows = seq_groups[row, :groups_needed].long()
        bad = (group_rows < 0) | (group_rows >= pooled.shape[0])
        if bool(bad.any()):
            g = int(torch.nonzero(bad)[0])
            raise HebrusError(f"hebrus::{op}: seq_groups[{row}, {g}] = {int(group_rows[g])} is outside "
                              f"[0, rows={pooled.shape[0]}); the first {groups_needed} groups of row {row} "
                              f"are visible to its queries")
        light = members[ng[members] <= top_k]
        if light.numel():
            k_all = min(top_k, groups_needed)
            g_idx = torch.arange(k_all, device=q.device)
            out[light, :k_all] = torch.where(g_idx[None, :] < ng[light][:, None], g_idx[None, :],
                                             torch.full_like(g_idx[None, :], -1)).to(torch.int32)
        heavy = members[ng[members] > top_k]
        if heavy.numel() == 0:
            continue
        need = int(ng[heavy].max())
        keys = pooled[group_rows[:need]]                                    # [need, D]
        g_idx = torch.arange(need, device=q.device)
        # Blocks of queries bound the scores and the sort (fp32 values, int64 indices, copies).
        block = max(1, _SELECT_BLOCK_BYTES // (32 * need))
        for start in range(0, heavy.numel(), block):
            sel = heavy[start:start + block]
            scores = qsa_scores(q[sel], keys)                               # [n, need] fp32
            scores = torch.where(g_idx[None, :] < ng[sel][:, None], scores, torch.full_like(scores, -math.inf))
            # Stable descending sort: NaN first (as torch ranks it), then higher score, then lower
            # group. Every query here sees more than top_k groups, so the first top_k are visible.
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]
            out[sel] = torch.sort(order, dim=1).values.to(torch.int32)
    return out


def _qsa_select_all(q, pooled, seq_groups, rows, ng, top_k, out):
    """qsa_select of every query at once, with no host read (the device-side-check devices' form, SPEC §4):
    the same scores (:func:`qsa_scores`, elementwise) and the same stable ranking as the loop over
    sequences, so the same selections. One sequence's keys are scored once for all queries
    (``seq_groups`` with one row: prefill); several are gathered per query (decode: one query each)."""
    op = "qsa_select"
    tq, max_g = q.shape[0], seq_groups.shape[1]
    rows_n = seq_groups.shape[0]
    k_all = min(top_k, max_g)
    if max_g == 0:
        return out
    g_idx = torch.arange(max_g, device=q.device)
    visible = g_idx < ng[:, None]                                           # [Tq, maxG]
    group_rows = seq_groups.index_select(0, rows.clamp(0, max(rows_n - 1, 0))).long()   # [Tq, maxG]
    assert_values(((group_rows >= 0) & (group_rows < pooled.shape[0])) | ~visible, op,
                  f"seq_groups entries visible to a query must lie in [0, rows={pooled.shape[0]})")
    # A query that sees at most top_k groups selects all of them, whatever the scores.
    light = torch.where(visible[:, :k_all], g_idx[:k_all], -1)
    if max_g <= top_k or pooled.shape[0] == 0:
        out[:, :k_all] = light
        return out
    safe = group_rows.clamp(0, pooled.shape[0] - 1)
    if rows_n == 1:
        scores = qsa_scores(q, pooled.index_select(0, safe[0]))             # [Tq, maxG]
    else:
        # Blocks of queries bound the gathered keys.
        block = max(1, _SELECT_BLOCK_BYTES // (4 * max_g * max(pooled.shape[1], 1)))
        scores = torch.cat([qsa_scores(q[s:s + block], pooled[safe[s:s + block]])
                            for s in range(0, tq, block)])
    scores = torch.where(visible, scores, -math.inf)
    # Stable descending sort: NaN first (as torch ranks it), then higher score, then lower group.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_k]
    heavy = torch.sort(order, dim=1).values
    return torch.where(ng[:, None] > top_k, heavy, light).to(torch.int32)


_ATTENTION_BLOCK_BYTES = 64 << 20  # fp32 working set of one block of queries (gathered K/V, scores)


def check_token_cells_values(token_cells: torch.Tensor, cells: int, op: str = "qsa_attention") -> None:
    """Every entry is padding (< 0) or a cell in [0, cells); every query selects at least one cell."""
    idx = token_cells.long()
    valid = idx >= 0
    out_of_range = valid & (idx >= cells)
    if checks_async(token_cells.device):
        assert_values(~out_of_range & valid.any(dim=1, keepdim=True), op,
                      f"every query selects at least one cell and none outside [0, cells={cells})")
        return
    if bool(out_of_range.any()):
        t, i = (int(x) for x in torch.nonzero(out_of_range)[0])
        raise HebrusError(f"hebrus::{op}: query {t} selects cell {int(idx[t, i])} (token_cells[{t}, {i}]), "
                          f"outside [0, cells={cells}); negative entries are padding")
    empty = ~valid.any(dim=1)
    if bool(empty.any()):
        t = int(torch.nonzero(empty)[0])
        raise HebrusError(f"hebrus::{op}: query {t} selects no cell (every entry of token_cells[{t}] is "
                          f"negative padding); attention over an empty selection is undefined")


def qsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_cells: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of every query over exactly its selected cells (issue 6).

    ``out[t, h] = sum_j softmax_j(scale * q[t, h] . k[c_j, g]) * v[c_j, g]`` over the cells
    ``c_j = token_cells[t, j] >= 0``, with ``g = h // (Hq // Hkv)`` (grouped-query attention), in fp32,
    cast to q's dtype. This equals dense attention over a key layout of all cells with the boolean
    mask "cell is selected by the query" (what transformers computes with the QSA selection mask).

    Args:
        q: Tensor[Tq, Hq, Dh] float32/float16/bfloat16, queries.
        k: Tensor[cells, Hkv, Dh], same dtype, keys of every cell (Hq a multiple of Hkv).
        v: Tensor[cells, Hkv, Dv], same dtype, values of every cell.
        token_cells: Tensor[Tq, W] int32, the selected cells of each query. Every negative entry is
            padding, wherever it appears in the row; the non-negative entries are summed in row
            order. A cell listed twice counts twice (callers list each selected cell once).
        scale: softmax scale, usually ``Dh ** -0.5``.

    Returns:
        Tensor[Tq, Hq, Dv] in q's dtype. Raises HebrusError when an entry is ``>= cells`` or a
        query selects no cell, before anything is computed.
    """
    rep = _validate.qsa_attention(q, k, v, token_cells, scale)
    tq, hq, dh = q.shape
    cells, hkv, dv = v.shape
    out = q.new_empty((tq, hq, dv))
    if tq == 0:
        return out
    check_token_cells_values(token_cells, cells)
    idx = token_cells.long()
    valid = idx >= 0
    width = idx.shape[1]
    per_query = width * hkv * (dh + dv + rep) * 4 + 1
    block = max(1, min(tq, _ATTENTION_BLOCK_BYTES // per_query))
    for start in range(0, tq, block):
        sl = slice(start, min(tq, start + block))
        n = sl.stop - sl.start
        ids = idx[sl].clamp(min=0)
        kk = k[ids].float()                                                  # [n, W, Hkv, Dh]
        # Padding reads cell 0 (clamped); its value rows are zeroed so that an inf or NaN there reaches
        # no query that did not select it (its score is masked to -inf below).
        vv = v[ids].float().masked_fill(~valid[sl][:, :, None, None], 0.0)   # [n, W, Hkv, Dv]
        qq = q[sl].float().reshape(n, hkv, rep, dh)
        scores = torch.einsum("bgrd,bwgd->bgrw", qq, kk) * scale
        scores = scores.masked_fill(~valid[sl][:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[sl] = torch.einsum("bgrw,bwgd->bgrd", probs, vv).reshape(n, hq, dv).to(q.dtype)
    return out


def gdn_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   cu_seqlens: torch.Tensor, state: torch.Tensor, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The gated delta rule of packed rows (issue 17), each row's state updated in place.

    Per row b, value head h and token t of the row, in fp32 (q, k l2-normalised over Dk when
    ``use_qk_l2norm``, ``x / sqrt(sum(x * x) + 1e-6)``; q then times ``scale``; key head ``h // (Hv // Hk)``)::

        S = S * exp(g[t, h])
        delta = (v[t, h] - sum_dk(S * k_t)) * beta[t, h]
        S = S + k_t (outer) delta
        out[t, h] = sum_dk(S * q_t)

    Args:
        q, k: Tensor[T, Hk, Dk]; v: Tensor[T, Hv, Dv]; g, beta: Tensor[T, Hv] (float32, float16 or bfloat16).
        cu_seqlens: Tensor[B+1] int32, row boundaries, rising from 0 to T.
        state: Tensor[B, Hv, Dk, Dv] float32, contiguous: row b's state, replaced by the state after its tokens.
        scale: the query scale (transformers: ``Dk ** -0.5``).

    Returns:
        Tensor[T, Hv, Dv] in v's dtype.

    Sums over Dk only, vectorised over the rows of the step: a row's bits never depend on the other rows
    or on how its tokens were cut (the CPU kernel sums over Dk in ascending order; this one as
    ``torch.sum`` does, so the two agree to fp32 rounding, not bitwise).
    """
    from .gdn.delta_rule import check_delta_rule_args, recurrent_delta_rule

    cu = check_delta_rule_args(q, k, v, g, beta, cu_seqlens, state)
    if not state.is_contiguous():
        raise HebrusError("hebrus_torch.gdn.gated_delta_rule: state must be contiguous")
    return recurrent_delta_rule(q, k, v, g, beta, cu, state, use_qk_l2norm, float(scale))


def gdn_delta_rule_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, scale: float,
                         use_qk_l2norm: bool) -> torch.Tensor:
    """:func:`gdn_delta_rule` whose row b reads its state from ``state_pool[slots[b]]`` and writes the new
    state back there, in place (issue 25; the slot form of ple_conv_slots), so a step moves only the
    states of its rows and the holder no gather or scatter.

    Args:
        q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm: as :func:`gdn_delta_rule`.
        state_pool: Tensor[S, Hv, Dk, Dv] float32, contiguous; the rows of ``slots`` are read and updated.
        slots: Tensor[B] int32, distinct slots in [0, S), one per row of cu_seqlens.

    Returns:
        Tensor[T, Hv, Dv] in v's dtype, :func:`gdn_delta_rule` on the gathered states; the pool rows of
        ``slots`` then hold its new states (a row of 0 tokens keeps its state), the others are untouched.
        Checks every value before writing: cu_seqlens and slot ids (range, duplicates) with the CPU
        kernel's messages.
    """
    from .gdn.delta_rule import check_delta_rule_slots_args, recurrent_delta_rule

    op = "gdn_delta_rule_slots"
    pool_slots = check_delta_rule_slots_args(q, k, v, g, beta, cu_seqlens, state_pool, slots)
    check_cu_seqlens_values(cu_seqlens, q.shape[0], op)
    check_slot_values(slots, pool_slots, op)
    idx = slots.long()
    state = state_pool.index_select(0, idx)
    out = recurrent_delta_rule(q, k, v, g, beta, cu_seqlens.tolist(), state, use_qk_l2norm, float(scale))
    state_pool.index_copy_(0, idx, state)
    return out


def gdn_chunk_delta_rule_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               cu_seqlens: torch.Tensor, start_pos: torch.Tensor, state_pool: torch.Tensor,
                               slots: torch.Tensor, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The gated delta rule of packed rows in the chunked (WY) form (issue 25): whole chunks of 64
    positions aligned to absolute positions (row b's first token is at ``start_pos[b]``) run the WY form,
    the partial chunks at a row's ends the recurrent form of :func:`gdn_delta_rule`; row b's state is read
    from and written back to ``state_pool[slots[b]]`` in place. See :mod:`hebrus_torch.gdn.chunked`.

    Args:
        q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm: as :func:`gdn_delta_rule`.
        start_pos: Tensor[B] int64 (>= 0), the absolute position of each row's first token.
        state_pool: Tensor[S, Hv, Dk, Dv] float32, contiguous; the rows of ``slots`` are read and updated.
        slots: Tensor[B] int32, distinct slots in [0, S), one per row of cu_seqlens.

    Returns:
        Tensor[T, Hv, Dv] in v's dtype. Checks every value (cu_seqlens, start_pos >= 0, slot ids) before
        writing, with the CPU kernel's messages.
    """
    from .gdn.chunked import chunk_delta_rule_reference

    _validate.gdn_chunk_delta_rule_slots(q, k, v, g, beta, cu_seqlens, start_pos, state_pool, slots)
    op = "gdn_chunk_delta_rule_slots"
    check_cu_seqlens_values(cu_seqlens, q.shape[0], op)
    pos = start_pos.cpu().tolist()
    for b, p in enumerate(pos):
        if p < 0:
            raise HebrusError(f"hebrus::{op}: start_pos[{b}] = {p} is negative")
    check_slot_values(slots, state_pool.shape[0], op)
    return chunk_delta_rule_reference(q, k, v, g, beta, cu_seqlens.cpu().tolist(), pos, state_pool,
                                      slots.cpu().tolist(), bool(use_qk_l2norm), float(scale))
