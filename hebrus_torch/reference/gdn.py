"""The gated delta rule's references (issues 17, 25): ``gdn_delta_rule``, its slot form and the chunked
(WY) slot form. The math lives in :mod:`hebrus_torch.gdn` (imported when called: that package registers
fakes of the ops, which exist only once the extension or the fallback library has defined them)."""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import HebrusError
from .checks import check_cu_seqlens_values, check_slot_values

__all__ = ["gdn_delta_rule", "gdn_delta_rule_slots", "gdn_chunk_delta_rule_slots", "gdn_gates", "gdn_gated_rms_norm"]


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
    from ..gdn.delta_rule import check_delta_rule_args, recurrent_delta_rule

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
    from ..gdn.delta_rule import check_delta_rule_slots_args, recurrent_delta_rule

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
    from ..gdn.chunked import chunk_delta_rule_reference

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


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated-delta-net layer's gates (issue 37) from its ``in_proj_a`` / ``in_proj_b`` outputs, in fp32::

        g    = -exp(A_log) * softplus(a + dt_bias),  softplus(x) = max(x, 0) + log(1 + exp(-|x|))
        beta = 1 / (1 + exp(-b)), rounded to b's dtype

    transformers' ``Qwen4ExpTextGatedDeltaNet`` computes ``F.softplus`` and ``b.sigmoid()``, whose CPU
    kernels round differently in a loop's vectorised body and its scalar tail (a token's bits would
    depend on where it sits in a packed step); these forms give every element the same bits wherever it
    sits. They differ from the module's by under 6e-8 absolute in softplus (``log(1 + e)`` loses what
    ``log1p`` keeps of a tiny ``e``), so g by that times ``exp(A_log)`` plus an ulp, and beta by a few ulp
    of fp32 before its rounding to b's dtype (tests/test_gdn_fused_ops.py).

    Args:
        a, b: Tensor[..., Hv], one float dtype (the projections' outputs).
        A_log, dt_bias: Tensor[Hv], any float dtype.

    Returns:
        (g, beta): Tensor[..., Hv] float32 each; beta holds values of b's dtype, widened (exact), as
        the delta rule reads them. Each element depends only on its own inputs.
    """
    _validate.gdn_gates(a, b, A_log, dt_bias)
    beta = 1.0 / (1.0 + torch.exp(-b.float()))
    beta = beta.to(b.dtype).float()
    x = a.float() + dt_bias
    g = -A_log.float().exp() * (x.clamp(min=0) + torch.log(1.0 + torch.exp(-x.abs())))
    return g, beta


def gdn_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       activation: str) -> torch.Tensor:
    """transformers' ``Qwen4ExpTextRMSNormGated`` (the gated-delta-net layer's output norm, issue 37) of
    every row of x, op for op::

        n   = (x * rsqrt(mean(x ** 2) + eps)) in fp32, rounded to x's dtype
        out = (weight * n) * act(gate) in fp32 (weight * n in their promoted dtype), rounded to x's dtype

    Args:
        x, gate: Tensor[..., D], one float dtype and shape (the delta rule's output and ``in_proj_z``'s).
        weight: Tensor[D], any float dtype. eps: >= 0.
        activation: ``"silu"`` or ``"sigmoid"`` (the config's ``output_gate_type or hidden_act``).

    Returns:
        Tensor of x's shape and dtype. A row's output depends only on that row.
    """
    _validate.gdn_gated_rms_norm(x, gate, weight, eps, activation)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scaled = weight * normed.to(x.dtype)
    act = torch.nn.functional.silu if activation == "silu" else torch.sigmoid
    return (scaled * act(gate.float())).to(x.dtype)
