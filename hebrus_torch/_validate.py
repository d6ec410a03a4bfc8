"""Metadata checks shared by the fake (meta) impls and the reference kernels.

They read only shapes, dtypes and devices, so they run unchanged on fake tensors under
``torch.compile``. The C++ kernels and the MPS glue make the same checks with the same messages
(csrc/op_checks.h), so the op wrappers leave checking to whichever kernel runs. Checks that need
tensor values (token ranges, holes) live in the kernels. Messages start with ``hebrus::<op>:`` and
state what was expected and what was got.
"""

from __future__ import annotations

import torch

from .errors import HebrusError
from .moe.quantize import check_quant_options

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = ("silu", "none")


def check(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise HebrusError(f"hebrus::{op}: {message}")


def _dims(t: torch.Tensor, n: int, op: str, name: str) -> None:
    check(t.dim() == n, op, f"{name} must be {n}-D, got shape {tuple(t.shape)}")


def _dtype(t: torch.Tensor, dtypes, op: str, name: str) -> None:
    if not isinstance(dtypes, tuple):
        dtypes = (dtypes,)
    check(t.dtype in dtypes, op, f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")


def _ranks_and_dtypes(op: str, *specs) -> None:
    """``(name, tensor, rank, dtype or dtypes)`` each: its rank, then its dtype (csrc/op_checks.h check_kinds)."""
    for name, t, n, dtypes in specs:
        _dims(t, n, op, name)
        _dtype(t, dtypes, op, name)


def _same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        check(dev == first, op, f"all tensors must be on one device; {first_name} is on {first}, {name} is on {dev}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, op: str) -> int:
    """Returns B, the number of rows."""
    _dims(cu_seqlens, 1, op, "cu_seqlens")
    _dtype(cu_seqlens, torch.int32, op, "cu_seqlens")
    check(cu_seqlens.shape[0] >= 1, op, "cu_seqlens must have B+1 >= 1 entries")
    return cu_seqlens.shape[0] - 1


def _ple_ngram_ids(op: str, tokens, cu_seqlens, history, slots, multipliers, vocab_sizes, offsets, eos,
                   vocab) -> tuple[int, int]:
    """hebrus::ple_ngram_ids (``slots`` None: ``history`` [B, N-1]) and hebrus::ple_ngram_ids_slots (``history``
    the pool [S, N-1], written in place at the rows' ``slots``); returns (N, number of hash heads)."""
    history_name = "history" if slots is None else "history_pool"
    tensors = {"tokens": tokens, "cu_seqlens": cu_seqlens, history_name: history}
    if slots is not None:
        tensors["slots"] = slots
    _same_device(op, **tensors, multipliers=multipliers, vocab_sizes=vocab_sizes, offsets=offsets)
    for name, t in (("tokens", tokens), (history_name, history), ("multipliers", multipliers),
                    ("vocab_sizes", vocab_sizes), ("offsets", offsets)):
        _dtype(t, torch.int64, op, name)
    _dims(tokens, 1, op, "tokens")
    _dims(multipliers, 1, op, "multipliers")
    _dims(vocab_sizes, 1, op, "vocab_sizes")
    _dims(offsets, 1, op, "offsets")
    _dims(history, 2, op, history_name)
    batch = check_cu_seqlens(cu_seqlens, op)
    if slots is not None:
        _slots(slots, batch, op)
    n = multipliers.shape[0]
    check(n >= 2, op, f"multipliers must have N >= 2 entries (ngram_size), got {n}")
    heads = vocab_sizes.shape[0]
    check(heads >= n - 1 and heads % (n - 1) == 0, op,
          f"vocab_sizes must have (N-1)*H entries for N={n}, got {heads}")
    check(offsets.shape[0] == heads, op, f"offsets must have {heads} entries like vocab_sizes, got {offsets.shape[0]}")
    rows = "B" if slots is None else "S"
    check((slots is not None or history.shape[0] == batch) and history.shape[1] == n - 1, op,
          f"{history_name} must have shape ({rows}, N-1) = ({batch if slots is None else 'S'}, {n - 1}), "
          f"got {tuple(history.shape)}")
    check(vocab > 0, op, f"vocab must be positive, got {vocab}")
    # eos is any int64 (SPEC §2: transformers' generation tests put it outside the vocabulary); it is
    # only ever compared with token ids.
    check(-(1 << 63) <= eos < (1 << 63), op, f"eos {eos} must be an int64")
    if slots is not None:
        _pool_writable(op, history, history_name,
                       {"tokens": tokens, "cu_seqlens": cu_seqlens, "slots": slots, "multipliers": multipliers,
                        "vocab_sizes": vocab_sizes, "offsets": offsets})
    return n, heads


def ple_ngram_ids(tokens, cu_seqlens, history, multipliers, vocab_sizes, offsets, eos, vocab) -> tuple[int, int]:
    """Metadata of hebrus::ple_ngram_ids; returns (N, number of hash heads)."""
    return _ple_ngram_ids("ple_ngram_ids", tokens, cu_seqlens, history, None, multipliers, vocab_sizes, offsets,
                          eos, vocab)


def _ple_conv(op: str, x, weight, cu_seqlens, state, slots, dilation, activation) -> None:
    """hebrus::ple_conv (``slots`` None: ``state`` [B, (K-1)*dilation, C]) and hebrus::ple_conv_slots (``state``
    the pool [S, (K-1)*dilation, C], written in place at the rows' ``slots``)."""
    state_name = "state" if slots is None else "state_pool"
    tensors = {"x": x, "weight": weight, "cu_seqlens": cu_seqlens, state_name: state}
    if slots is not None:
        tensors["slots"] = slots
    _same_device(op, **tensors)
    _dims(x, 2, op, "x")
    _dims(weight, 2, op, "weight")
    _dims(state, 3, op, state_name)
    _dtype(x, FLOAT_DTYPES, op, "x")
    check(weight.dtype == x.dtype, op, f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    check(state.dtype == x.dtype, op, f"{state_name} dtype {state.dtype} must match x dtype {x.dtype}")
    batch = check_cu_seqlens(cu_seqlens, op)
    if slots is not None:
        _slots(slots, batch, op)
    check(dilation >= 1, op, f"dilation must be >= 1, got {dilation}")
    check(activation in ACTIVATIONS, op, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    channels = x.shape[1]
    width = weight.shape[1]
    check(weight.shape[0] == channels and width >= 1, op,
          f"weight must have shape (C, K) with C = {channels} and K >= 1, got {tuple(weight.shape)}")
    state_len = (width - 1) * dilation
    rows = "B" if slots is None else "S"
    check((slots is not None or state.shape[0] == batch) and tuple(state.shape[1:]) == (state_len, channels), op,
          f"{state_name} must have shape ({rows}, (K-1)*dilation, C) = ({batch if slots is None else 'S'}, "
          f"{state_len}, {channels}), got {tuple(state.shape)}")
    if slots is not None:
        _pool_writable(op, state, state_name, {"x": x, "weight": weight, "cu_seqlens": cu_seqlens, "slots": slots})


def ple_conv(x, weight, cu_seqlens, state, dilation, activation, op: str = "ple_conv") -> None:
    """Metadata of hebrus::ple_conv (and of ple_conv_into's inputs, under ``op``)."""
    _ple_conv(op, x, weight, cu_seqlens, state, None, dilation, activation)


def ple_conv_into(x, weight, cu_seqlens, state, dilation, activation, y, new_state) -> None:
    """ple_conv's checks, then the buffers': y like x and new_state like state, both contiguous."""
    op = "ple_conv_into"
    _same_device(op, x=x, weight=weight, cu_seqlens=cu_seqlens, state=state, y=y, new_state=new_state)
    ple_conv(x, weight, cu_seqlens, state, dilation, activation, op)
    check(y.shape == x.shape and y.dtype == x.dtype, op,
          f"y must have the shape and dtype of x, {tuple(x.shape)} {x.dtype}, got {tuple(y.shape)} {y.dtype}")
    check(new_state.shape == state.shape and new_state.dtype == state.dtype, op,
          f"new_state must have the shape and dtype of state, {tuple(state.shape)} {state.dtype}, "
          f"got {tuple(new_state.shape)} {new_state.dtype}")
    check(y.is_contiguous() and new_state.is_contiguous(), op, "y and new_state must be contiguous")


def _byte_span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of the elements of an eager tensor; None if empty."""
    if t.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + (last + 1) * t.element_size()


def no_overlap(op: str, outs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """Every out shares no memory with an input or another out (eager tensors only)."""
    spans = {name: _byte_span(t) for name, t in {**inputs, **outs}.items()}
    for out_name in outs:
        a = spans[out_name]
        for name, span in spans.items():
            if name == out_name or a is None or span is None:
                continue
            check(a[0] != span[0] or a[2] <= span[1] or span[2] <= a[1], op,
                  f"{out_name} shares memory with {name}; the outputs must not overlap the inputs or each other")


def _no_storage(t: torch.Tensor) -> bool:
    """A fake, meta or functional tensor (under torch.compile): no memory to compare."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or t.device.type == "meta" or torch._is_functional_tensor(t)


def _slots(slots, batch: int, op: str) -> None:
    _dims(slots, 1, op, "slots")
    _dtype(slots, torch.int32, op, "slots")
    check(slots.shape[0] == batch, op, f"slots must have one entry per row (B = {batch}), got {slots.shape[0]}")


def _pool_writable(op: str, pool, pool_name: str, inputs: dict) -> None:
    check(pool.is_contiguous(), op, f"{pool_name} must be contiguous (it is updated in place)")
    if _no_storage(pool):
        return
    for name, t in inputs.items():
        span, other = _byte_span(pool), _byte_span(t)
        check(span is None or other is None or span[0] != other[0] or span[2] <= other[1] or other[2] <= span[1], op,
              f"{pool_name} shares memory with {name}; the pool is written in place and must not overlap the inputs")


def ple_conv_slots(x, weight, cu_seqlens, state_pool, slots, dilation, activation) -> int:
    """Metadata of hebrus::ple_conv_slots; returns S (the pool's slot count)."""
    _ple_conv("ple_conv_slots", x, weight, cu_seqlens, state_pool, slots, dilation, activation)
    return state_pool.shape[0]


def ple_ngram_ids_slots(tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes, offsets, eos,
                        vocab) -> tuple[int, int]:
    """Metadata of hebrus::ple_ngram_ids_slots; returns (N, number of hash heads)."""
    return _ple_ngram_ids("ple_ngram_ids_slots", tokens, cu_seqlens, history_pool, slots, multipliers, vocab_sizes,
                          offsets, eos, vocab)


def qsa_pool(keys, cell_pos, group_cells, group_pos, norm_weight, eps, inv_freq) -> None:
    op = "qsa_pool"
    _same_device(op, keys=keys, cell_pos=cell_pos, group_cells=group_cells, group_pos=group_pos,
                 norm_weight=norm_weight, inv_freq=inv_freq)
    _ranks_and_dtypes(op, ("keys", keys, 2, FLOAT_DTYPES), ("cell_pos", cell_pos, 1, torch.int64),
                      ("group_cells", group_cells, 2, torch.int32), ("group_pos", group_pos, 1, torch.int64),
                      ("norm_weight", norm_weight, 1, FLOAT_DTYPES), ("inv_freq", inv_freq, 1, torch.float32))
    cells, dim = keys.shape
    check(cell_pos.shape[0] == cells, op, f"cell_pos must have one entry per cell ({cells}), got {cell_pos.shape[0]}")
    check(group_cells.shape[1] >= 1, op, "group_cells must have r >= 1 columns")
    check(group_pos.shape[0] == group_cells.shape[0], op,
          f"group_pos must have one entry per group ({group_cells.shape[0]}), got {group_pos.shape[0]}")
    check(norm_weight.shape[0] == dim, op, f"norm_weight must have D = {dim} entries, got {norm_weight.shape[0]}")
    check(2 * inv_freq.shape[0] <= dim, op, f"rotary dims 2*{inv_freq.shape[0]} exceed head dim {dim}")
    check(eps >= 0, op, f"eps must be >= 0, got {eps}")


def qsa_select(q, pooled, seq_groups, q_row, q_groups, top_k) -> None:
    op = "qsa_select"
    _same_device(op, q=q, pooled=pooled, seq_groups=seq_groups, q_row=q_row, q_groups=q_groups)
    _ranks_and_dtypes(op, ("q", q, 3, FLOAT_DTYPES), ("pooled", pooled, 2, FLOAT_DTYPES),
                      ("seq_groups", seq_groups, 2, torch.int32), ("q_row", q_row, 1, torch.int32),
                      ("q_groups", q_groups, 1, torch.int32))
    check(q.shape[2] == pooled.shape[1], op, f"q head dim {q.shape[2]} must equal pooled dim {pooled.shape[1]}")
    check(q_row.shape[0] == q.shape[0] and q_groups.shape[0] == q.shape[0], op,
          f"q_row and q_groups must have Tq = {q.shape[0]} entries, got {q_row.shape[0]} and {q_groups.shape[0]}")
    check(1 <= top_k <= 2**31 - 1, op, f"top_k must be in [1, 2147483647] (group indices are int32), got {top_k}")


def qsa_token_cells(selected, nvis, first, cells, r) -> int:
    """Metadata of hebrus::qsa_token_cells (issue 37); returns W = top_k * r + r - 1."""
    op = "qsa_token_cells"
    _same_device(op, selected=selected, nvis=nvis, first=first, cells=cells)
    _ranks_and_dtypes(op, ("selected", selected, 2, torch.int32), ("nvis", nvis, 1, torch.int64),
                      ("first", first, 1, torch.int64), ("cells", cells, 1, torch.int32))
    tq = selected.shape[0]
    check(nvis.shape[0] == tq and first.shape[0] == tq, op,
          f"nvis and first must have Tq = {tq} entries, got {nvis.shape[0]} and {first.shape[0]}")
    check(1 <= r <= 2**20, op, f"r must be in [1, 1048576], got {r}")
    check(selected.shape[1] <= 2**31 // r, op,
          f"top_k * r must stay below 2^31, got top_k = {selected.shape[1]} and r = {r}")
    return selected.shape[1] * r + r - 1


def qsa_plan_one_row(cell_pos, run_cells, run_groups, cells, p0, start, r) -> tuple[int, int]:
    """Metadata of hebrus::qsa_plan_one_row (issue 37); returns (nvis, groups): the chunk's visible positions in
    the run (``start - p0 + T``) and its complete groups (``nvis // r``)."""
    op = "qsa_plan_one_row"
    _same_device(op, cell_pos=cell_pos, run_cells=run_cells, run_groups=run_groups, cells=cells)
    _ranks_and_dtypes(op, ("cell_pos", cell_pos, 1, torch.int64), ("run_cells", run_cells, 1, torch.int64),
                      ("run_groups", run_groups, 1, torch.int64), ("cells", cells, 1, torch.int64))
    t = cells.shape[0]
    check(t >= 1, op, "the chunk must have at least one cell")
    check(1 <= r <= 2**20, op, f"r must be in [1, 1048576], got {r}")
    check(0 <= p0 <= start, op, f"need 0 <= p0 <= start, got p0 = {p0} and start = {start}")
    check(start - p0 <= run_cells.shape[0] - t, op,
          f"the chunk's {t} positions from {start} pass the run's {run_cells.shape[0]} cells from {p0}")
    nvis = start - p0 + t
    check(nvis // r <= run_groups.shape[0], op,
          f"the run's {nvis} visible positions make {nvis // r} groups but run_groups has {run_groups.shape[0]}")
    check(cell_pos.shape[0] <= 2**31 - 1, op, f"cell_pos must have fewer than 2^31 cells, got {cell_pos.shape[0]}")
    return nvis, nvis // r


def qsa_claim_cells(cell_ref, cell_pos, unwritten, freed, start, starts, counts) -> tuple[int, int]:
    """Metadata of hebrus::qsa_claim_cells (issue 37); returns (T, L): the cells taken and the layers flagged."""
    op = "qsa_claim_cells"
    _same_device(op, cell_ref=cell_ref, cell_pos=cell_pos, unwritten=unwritten, freed=freed)
    _ranks_and_dtypes(op, ("cell_ref", cell_ref, 1, torch.int32), ("cell_pos", cell_pos, 1, torch.int64),
                      ("unwritten", unwritten, 2, torch.bool), ("freed", freed, 1, torch.bool))
    capacity = cell_ref.shape[0]
    check(cell_pos.shape[0] == capacity and unwritten.shape[1] == capacity and freed.shape[0] == capacity, op,
          f"cell_pos, unwritten and freed must cover cell_ref's C = {capacity} cells, got {cell_pos.shape[0]}, "
          f"{unwritten.shape[1]} and {freed.shape[0]}")
    check(len(starts) == len(counts), op, f"{len(starts)} starts but {len(counts)} counts")
    for i, (first, count) in enumerate(zip(starts, counts)):
        check(0 <= count <= capacity, op, f"counts[{i}] = {count} is outside [0, {capacity}]")
        check(count == 0 or 0 <= first <= 2**63 - count, op,
              f"row {i}'s {count} positions from {first} are outside [0, 2^63)")
    total = sum(counts)
    check(total >= 1 and 0 <= start <= capacity - total, op,
          f"the {total} cells from {start} must be at least one and lie in [0, {capacity})")
    check(total < 2**31, op, f"at most 2^31 - 1 cells at once, got {total}")
    return total, unwritten.shape[0]


def rms_norm_rope(x, weight, eps, cos, sin) -> None:
    """Metadata of hebrus::rms_norm_rope (issue 37)."""
    op = "rms_norm_rope"
    _same_device(op, x=x, weight=weight, cos=cos, sin=sin)
    _ranks_and_dtypes(op, ("x", x, 3, FLOAT_DTYPES), ("weight", weight, 1, FLOAT_DTYPES),
                      ("cos", cos, 2, FLOAT_DTYPES), ("sin", sin, 2, FLOAT_DTYPES))
    check(cos.dtype == x.dtype, op, f"cos dtype {cos.dtype} must match x dtype {x.dtype}")
    check(sin.dtype == x.dtype, op, f"sin dtype {sin.dtype} must match x dtype {x.dtype}")
    tokens, _, dim = x.shape
    check(weight.shape[0] == dim, op, f"weight must have D = {dim} entries, got {weight.shape[0]}")
    check(cos.shape[0] == tokens and sin.shape == cos.shape, op,
          f"cos and sin must both have shape (T, R) with T = {tokens}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    check(cos.shape[1] % 2 == 0 and cos.shape[1] <= dim, op,
          f"the rotary dims R must be even and at most D = {dim}, got {cos.shape[1]}")
    check(eps >= 0, op, f"eps must be >= 0, got {eps}")


def sigmoid_gate(x, gate) -> None:
    """Metadata of hebrus::sigmoid_gate (issue 37)."""
    op = "sigmoid_gate"
    _same_device(op, x=x, gate=gate)
    _ranks_and_dtypes(op, ("x", x, 3, FLOAT_DTYPES), ("gate", gate, 3, FLOAT_DTYPES))
    check(gate.dtype == x.dtype, op, f"gate dtype {gate.dtype} must match x dtype {x.dtype}")
    check(gate.shape == x.shape, op, f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")


def qsa_attention(q, k, v, token_cells, scale) -> int:
    """Returns the number of query heads per KV head (Hq // Hkv)."""
    op = "qsa_attention"
    _same_device(op, q=q, k=k, v=v, token_cells=token_cells)
    _dims(q, 3, op, "q")
    _dtype(q, FLOAT_DTYPES, op, "q")
    _dims(k, 3, op, "k")
    _dims(v, 3, op, "v")
    check(k.dtype == q.dtype, op, f"k dtype {k.dtype} must match q dtype {q.dtype}")
    check(v.dtype == q.dtype, op, f"v dtype {v.dtype} must match q dtype {q.dtype}")
    _dims(token_cells, 2, op, "token_cells")
    _dtype(token_cells, torch.int32, op, "token_cells")
    tq, hq, dh = q.shape
    cells, hkv, _ = k.shape
    check(hkv >= 1, op, f"k must have Hkv >= 1 heads, got shape {tuple(k.shape)}")
    check(k.shape[2] == dh, op, f"k head dim {k.shape[2]} must equal q head dim {dh}")
    check(v.shape[0] == cells and v.shape[1] == hkv, op,
          f"v must have shape (cells, Hkv, Dv) with cells = {cells} and Hkv = {hkv} like k, got {tuple(v.shape)}")
    check(hq % hkv == 0, op, f"query heads Hq = {hq} must be a multiple of KV heads Hkv = {hkv}")
    check(token_cells.shape[0] == tq, op,
          f"token_cells must have one row per query (Tq = {tq}), got shape {tuple(token_cells.shape)}")
    check(abs(scale) < float("inf"), op, f"scale must be finite, got {scale}")
    return hq // hkv


def gdn_chunk_delta_rule_slots(q, k, v, g, beta, cu_seqlens, start_pos, state_pool, slots) -> int:
    """Metadata of hebrus::gdn_chunk_delta_rule_slots (csrc/cpu/gdn_chunk_kernels.cpp: same order and
    messages); returns S (the pool's slot count)."""
    op = "gdn_chunk_delta_rule_slots"
    _same_device(op, q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, start_pos=start_pos,
                 state_pool=state_pool, slots=slots)
    for name, t, n in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        _dims(t, n, op, name)
    for name, t in (("q", q), ("v", v), ("g", g), ("beta", beta)):
        _dtype(t, FLOAT_DTYPES, op, name)
    check(k.dtype == q.dtype, op, f"k dtype {k.dtype} must match q dtype {q.dtype}")
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    check(k.shape == q.shape, op, f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    check(v.shape[0] == T, op, f"v has {v.shape[0]} tokens, q has {T}")
    check(hk >= 1 and dk >= 1 and hv >= 1 and dv >= 1 and hv % hk == 0, op,
          f"value heads ({hv}) must be a positive multiple of key heads ({hk}), with Dk, Dv >= 1")
    for name, t in (("g", g), ("beta", beta)):
        check(t.shape[0] == T and t.shape[1] == hv, op,
              f"{name} must have shape (T, Hv) = ({T}, {hv}), got {tuple(t.shape)}")
    batch = check_cu_seqlens(cu_seqlens, op)
    _dims(start_pos, 1, op, "start_pos")
    _dtype(start_pos, torch.int64, op, "start_pos")
    check(start_pos.shape[0] == batch, op,
          f"start_pos must have one entry per row (B = {batch}), got {start_pos.shape[0]}")
    _slots(slots, batch, op)
    _dims(state_pool, 4, op, "state_pool")
    _dtype(state_pool, torch.float32, op, "state_pool")
    check(tuple(state_pool.shape[1:]) == (hv, dk, dv), op,
          f"state_pool must have shape (S, Hv, Dk, Dv) = (S, {hv}, {dk}, {dv}), got {tuple(state_pool.shape)}")
    _pool_writable(op, state_pool, "state_pool",
                   {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens, "start_pos": start_pos,
                    "slots": slots})
    return state_pool.shape[0]


# ---- fused GDN gates and output norm (issue 37) -----------------------------------------------------------

def gdn_gates(a, b, A_log, dt_bias) -> tuple[int, int]:
    """Metadata of hebrus::gdn_gates (csrc/gdn_fused_checks.h: same order and messages); returns (rows, Hv)."""
    op = "gdn_gates"
    _same_device(op, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    check(a.dim() >= 1, op, f"a must be at least 1-D, got shape {tuple(a.shape)}")
    _dtype(a, FLOAT_DTYPES, op, "a")
    check(b.dtype == a.dtype, op, f"b dtype {b.dtype} must match a dtype {a.dtype}")
    check(b.shape == a.shape, op, f"b must have a's shape {tuple(a.shape)}, got {tuple(b.shape)}")
    _ranks_and_dtypes(op, ("A_log", A_log, 1, FLOAT_DTYPES), ("dt_bias", dt_bias, 1, FLOAT_DTYPES))
    heads = a.shape[-1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check(t.shape[0] == heads, op, f"{name} must have Hv = {heads} entries, got {t.shape[0]}")
    return (a.numel() // heads if heads else 0), heads


def gdn_gated_rms_norm(x, gate, weight, eps, activation) -> tuple[int, int]:
    """Metadata of hebrus::gdn_gated_rms_norm (csrc/gdn_fused_checks.h: same order and messages); returns (rows, D)."""
    op = "gdn_gated_rms_norm"
    _same_device(op, x=x, gate=gate, weight=weight)
    check(x.dim() >= 1, op, f"x must be at least 1-D, got shape {tuple(x.shape)}")
    _dtype(x, FLOAT_DTYPES, op, "x")
    check(gate.dtype == x.dtype, op, f"gate dtype {gate.dtype} must match x dtype {x.dtype}")
    check(gate.shape == x.shape, op, f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    _ranks_and_dtypes(op, ("weight", weight, 1, FLOAT_DTYPES))
    dim = x.shape[-1]
    check(weight.shape[0] == dim, op, f"weight must have D = {dim} entries, got {weight.shape[0]}")
    check(eps >= 0, op, f"eps must be >= 0, got {eps}")
    check(activation in ("silu", "sigmoid"), op, f"activation must be 'silu' or 'sigmoid', got '{activation}'")
    return (x.numel() // dim if dim else 0), dim


# ---- fused hyper-connection ops (issue 37) ----------------------------------------------------------------

def hc_rms_norm(x, weight, group_size, eps) -> tuple[int, int]:
    """Metadata of hebrus::hc_rms_norm; returns (rows, D): x [..., D] has rows = numel / D rows."""
    op = "hc_rms_norm"
    _same_device(op, x=x, weight=weight)
    check(x.dim() >= 1, op, f"x must be at least 1-D, got shape {tuple(x.shape)}")
    _dtype(x, FLOAT_DTYPES, op, "x")
    _ranks_and_dtypes(op, ("weight", weight, 1, FLOAT_DTYPES))
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    check(weight.shape[0] == dim, op, f"weight must have D = {dim} entries, got {weight.shape[0]}")
    check(group_size >= 1 and dim % group_size == 0, op,
          f"group_size must be >= 1 and divide D = {dim}, got {group_size}")
    check(eps >= 0, op, f"eps must be >= 0, got {eps}")
    return rows, dim


def _hc_streams(op: str, h, norm_weight, hc_count) -> tuple[int, int]:
    """The pre-mix ops' streams (h already checked 2-D float): returns (T, D)."""
    rows, dim = h.shape
    check(hc_count >= 1 and dim % hc_count == 0, op, f"hc_count must be >= 1 and divide D = {dim}, got {hc_count}")
    check(norm_weight.shape[0] == dim, op, f"norm_weight must have D = {dim} entries, got {norm_weight.shape[0]}")
    return rows, dim


def _hc_quant_projection(op: str, name: str, q, scales, biases, h, in_dim: int, out_rows: int | None,
                         out_name: str, group_size: int, bits: int) -> int:
    """One quantized projection W [out, in] of hc_premix_quantized (csrc/hc_checks.h); returns out."""
    _ranks_and_dtypes(op, (f"{name}_q", q, 2, torch.int32))
    for suffix, t in (("scales", scales), ("biases", biases)):
        _dims(t, 2, op, f"{name}_{suffix}")
        check(t.dtype == h.dtype, op, f"{name}_{suffix} dtype {t.dtype} must match h dtype {h.dtype}")
    check(in_dim % group_size == 0, op, f"{name}'s input dimension {in_dim} must be a multiple of group_size "
          f"{group_size}")
    out = q.shape[0]
    check((out >= 1 if out_rows is None else out == out_rows) and q.shape[1] * (32 // bits) == in_dim, op,
          f"{name}_q must be [{out_name}, {in_dim} * bits / 32 = {in_dim * bits // 32}], got shape {tuple(q.shape)}")
    for suffix, t in (("scales", scales), ("biases", biases)):
        check(tuple(t.shape) == (out, in_dim // group_size), op,
              f"{name}_{suffix} must be [{out}, {in_dim // group_size}], got shape {tuple(t.shape)}")
    return out


def hc_premix_quantized(h, norm_weight, down_q, down_scales, down_biases, up_q, up_scales, up_biases, inject_q,
                        inject_scales, inject_biases, hc_count, eps, group_size, bits) -> tuple[int, int, int]:
    """Metadata of hebrus::hc_premix_quantized; returns (T, hidden, R). Same order and messages as
    csrc/hc_checks.h (check_hc_premix_quantized_args)."""
    op = "hc_premix_quantized"
    inject = (inject_q, inject_scales, inject_biases)
    has_inject = inject_q is not None
    check(all((t is not None) == has_inject for t in inject), op,
          "inject_q, inject_scales and inject_biases must be given together")
    tensors = {"h": h, "norm_weight": norm_weight, "down_q": down_q, "down_scales": down_scales,
               "down_biases": down_biases, "up_q": up_q, "up_scales": up_scales, "up_biases": up_biases}
    if has_inject:
        tensors.update(inject_q=inject_q, inject_scales=inject_scales, inject_biases=inject_biases)
    _same_device(op, **tensors)
    check_quant_options(bits, group_size, op=op)
    _ranks_and_dtypes(op, ("h", h, 2, FLOAT_DTYPES), ("norm_weight", norm_weight, 1, FLOAT_DTYPES))
    rows, dim = _hc_streams(op, h, norm_weight, hc_count)
    rank = _hc_quant_projection(op, "down", down_q, down_scales, down_biases, h, dim, None, "R >= 1", group_size,
                                bits)
    _hc_quant_projection(op, "up", up_q, up_scales, up_biases, h, rank, dim, f"D = {dim}", group_size, bits)
    if has_inject:
        _hc_quant_projection(op, "inject", *inject, h, dim, hc_count, f"hc_count = {hc_count}", group_size, bits)
    check(eps >= 0, op, f"eps must be >= 0, got {eps}")
    return rows, dim // hc_count, rank


def hc_premix(h, norm_weight, down, up, inject, hc_count, eps) -> tuple[int, int, int]:
    """Metadata of hebrus::hc_premix; returns (T, hidden, R): h [T, hc_count * hidden], down [R, D]."""
    op = "hc_premix"
    tensors = {"h": h, "norm_weight": norm_weight, "down": down, "up": up}
    if inject is not None:
        tensors["inject"] = inject
    _same_device(op, **tensors)
    _ranks_and_dtypes(op, ("h", h, 2, FLOAT_DTYPES), ("norm_weight", norm_weight, 1, FLOAT_DTYPES),
                      ("down", down, 2, FLOAT_DTYPES), ("up", up, 2, FLOAT_DTYPES))
    rows, dim = _hc_streams(op, h, norm_weight, hc_count)
    check(down.dtype == h.dtype, op, f"down dtype {down.dtype} must match h dtype {h.dtype}")
    check(up.dtype == h.dtype, op, f"up dtype {up.dtype} must match h dtype {h.dtype}")
    rank = down.shape[0]
    check(rank >= 1 and down.shape[1] == dim, op, f"down must be [R >= 1, D = {dim}], got shape {tuple(down.shape)}")
    check(tuple(up.shape) == (dim, rank), op, f"up must be [D = {dim}, R = {rank}], got shape {tuple(up.shape)}")
    if inject is not None:
        _ranks_and_dtypes(op, ("inject", inject, 2, FLOAT_DTYPES))
        check(inject.dtype == h.dtype, op, f"inject dtype {inject.dtype} must match h dtype {h.dtype}")
        check(tuple(inject.shape) == (hc_count, dim), op,
              f"inject must be [hc_count = {hc_count}, D = {dim}], got shape {tuple(inject.shape)}")
    check(eps >= 0, op, f"eps must be >= 0, got {eps}")
    return rows, dim // hc_count, rank


def hc_post_combine(hyper, out, inject) -> tuple[int, int, int]:
    """Metadata of hebrus::hc_post_combine; returns (T, hc, hidden)."""
    op = "hc_post_combine"
    _same_device(op, hyper=hyper, out=out, inject=inject)
    _ranks_and_dtypes(op, ("hyper", hyper, 2, FLOAT_DTYPES), ("out", out, 2, FLOAT_DTYPES),
                      ("inject", inject, 2, FLOAT_DTYPES))
    check(out.dtype == hyper.dtype, op, f"out dtype {out.dtype} must match hyper dtype {hyper.dtype}")
    check(inject.dtype == hyper.dtype, op, f"inject dtype {inject.dtype} must match hyper dtype {hyper.dtype}")
    rows, hidden, hc = hyper.shape[0], out.shape[1], inject.shape[1]
    check(out.shape[0] == rows and inject.shape[0] == rows, op,
          f"hyper, out and inject must have the same rows, got {rows}, {out.shape[0]} and {inject.shape[0]}")
    check(hyper.shape[1] == hc * hidden, op,
          f"hyper must have hc * hidden = {hc} * {hidden} features, got {hyper.shape[1]}")
    return rows, hc, hidden
