"""The native decoder-layer calls (``hebrus::decode_gdn_layer``, ``decode_moe_tail``, ``decode_attention_head``,
``decode_attention_tail``, ``decode_attention_layer``, ``decode_ple_gate``; issue 37) as the ops they are made of:
what the engine's packed forward runs for a stock Qwen4Exp decoder layer
(``hebrus_torch.models.qwen4_exp.forward.packed_decoder_layer`` with the fused path of every part), one op after
another through ``torch.ops.hebrus`` (each device's own kernels) and ``F.linear``. On the CPU the native kernel
calls the same ops in the same order, so its outputs and state equal these bit for bit where its projections are
ATen's (``hebrus_torch.row_kernel.dense_row_kernel(False)``; by default up to 8 float32 rows take the row kernel, a
fixed order of its own: docs/cpu.md); a device without a native kernel runs these. ``dense_projection`` is one such
projection (the engine's ``lm_head`` of a decode step).

Weight lists (what ``hebrus_torch.models.qwen4_exp.native`` builds from the layer's modules):

- ``hc`` (a ``Qwen4ExpTextGatedResidual``): ``hc_norm.weight``, ``input_mix_weight_down.weight``,
  ``input_mix_weight_up.weight``, ``block_inject_weight.weight``;
- ``moe`` (a ``Qwen4ExpTextSparseMoeBlock``): ``gate.weight``, ``shared_expert_gate.weight``,
  ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_expert.{gate_proj, up_proj, down_proj}.weight``;
- ``gdn`` (a ``Qwen4ExpTextGatedDeltaNet``): ``in_proj_{qkv, z, b, a}.weight``, ``conv1d.weight``, ``A_log``,
  ``dt_bias``, ``norm.weight``, ``out_proj.weight``;
- ``attention`` (a ``Qwen4ExpTextAttention``): ``indexer.index_qk_proj.weight``, ``indexer.q_layernorm.weight``,
  ``{q, k, v}_proj.weight``, ``q_norm.weight``, ``k_norm.weight`` (and ``o_proj.weight`` on its own);
- ``ple`` (a ``Qwen4ExpTextPLELayer``): ``key_proj.weight``, ``norm_key.weight``, ``value_proj.weight``,
  ``norm_query.weight``, ``norm_conv.weight``.

Each is also its op's fake (``models/qwen4_exp/native.py``): run on fake tensors, it gives the kernel's output
views, strides and offsets included.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import HebrusError

_HEBRUS = torch.ops.hebrus

HC_WEIGHTS, MOE_WEIGHTS, GDN_WEIGHTS = 4, 7, 9


def _count(op: str, what: str, tensors: Sequence[torch.Tensor], want: int) -> None:
    if len(tensors) != want:
        raise HebrusError(f"hebrus::{op}: {what} must hold {want} tensors, got {len(tensors)}")


def _moe_block(x: torch.Tensor, moe: Sequence[torch.Tensor], top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    logits, shared_logit = F.linear(x, moe[0]), F.linear(x, moe[1])
    ids, weights = _HEBRUS.moe_route.default(logits, shared_logit, top_k, norm_topk_prob)
    routed = _HEBRUS.moe_experts.default(x, ids, weights[:, :top_k], moe[2], moe[3])
    return _HEBRUS.moe_shared_expert.default(x, routed, moe[4], moe[5], moe[6], weights[:, top_k:])


def _moe_tail(hyper, out, inject, mlp_hc, moe, hc_count, hc_eps, top_k, norm_topk_prob) -> torch.Tensor:
    h = _HEBRUS.hc_post_combine.default(hyper, out, inject)
    x, weights = _HEBRUS.hc_premix.default(h, *mlp_hc, hc_count, hc_eps)
    return _HEBRUS.hc_post_combine.default(h, _moe_block(x, moe, top_k, norm_topk_prob), weights)


def decode_moe_tail(hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor, mlp_hc: Sequence[torch.Tensor],
                    moe: Sequence[torch.Tensor], hc_count: int, hc_eps: float, top_k: int,
                    norm_topk_prob: bool) -> torch.Tensor:
    """A decoder layer after its token mixer: ``hc_post_combine(hyper, out, inject)``, the MLP hyper-connection's
    ``hc_premix``, the MoE block (router and shared-gate linears, ``moe_route``, ``moe_experts``,
    ``moe_shared_expert``) and its ``hc_post_combine``.

    Shapes: hyper [T, hc * H], out [T, H], inject [T, hc], all in one float dtype -> [T, hc * H].
    """
    _count("decode_moe_tail", "mlp_hc", mlp_hc, HC_WEIGHTS)
    _count("decode_moe_tail", "moe", moe, MOE_WEIGHTS)
    return _moe_tail(hyper, out, inject, mlp_hc, moe, hc_count, hc_eps, top_k, norm_topk_prob)


def _gated_delta_net(x, gdn, conv_pool, recurrent_pool, slots, cu_seqlens, heads, norm_eps, conv_activation,
                     norm_activation) -> torch.Tensor:
    t = x.shape[0]
    hk, hv, dk, dv = heads
    mixed = F.linear(x, gdn[0])
    z = F.linear(x, gdn[1]).reshape(t, hv, dv)
    b, a = F.linear(x, gdn[2]), F.linear(x, gdn[3])
    g, beta = _HEBRUS.gdn_gates.default(a, b, gdn[5], gdn[6])
    weight = gdn[4]
    if weight.dim() == 3:
        weight = weight.reshape(weight.shape[0], weight.shape[2])
    if weight.dtype != x.dtype or weight.device != x.device:
        weight = weight.to(device=x.device, dtype=x.dtype)
    mixed = _HEBRUS.ple_conv_slots.default(mixed, weight, cu_seqlens, conv_pool, slots, 1, conv_activation)
    q, k, v = mixed.split_with_sizes([hk * dk, hk * dk, hv * dv], dim=-1)
    out = _HEBRUS.gdn_delta_rule_slots.default(q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), g,
                                               beta, cu_seqlens, recurrent_pool, slots, float(dk) ** -0.5, True)
    out = _HEBRUS.gdn_gated_rms_norm.default(out.reshape(-1, dv), z.reshape(-1, dv), gdn[7], norm_eps,
                                             norm_activation).reshape(t, hv * dv)
    return F.linear(out, gdn[8])


def decode_gdn_layer(h: torch.Tensor, attn_hc: Sequence[torch.Tensor], gdn: Sequence[torch.Tensor],
                     conv_pool: torch.Tensor, recurrent_pool: torch.Tensor, slots: torch.Tensor,
                     cu_seqlens: torch.Tensor, mlp_hc: Sequence[torch.Tensor], moe: Sequence[torch.Tensor],
                     heads: Sequence[int], eps: Sequence[float], conv_activation: str, norm_activation: str,
                     hc_count: int, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """A gated-delta-net decoder layer after its PLE: the attention hyper-connection's ``hc_premix``, the GDN
    (projections, ``gdn_gates``, the conv over the tails in ``conv_pool`` by ``ple_conv_slots``, the delta rule
    over the states in ``recurrent_pool`` by ``gdn_delta_rule_slots`` (q scaled by Dk ** -0.5, qk l2-normed),
    ``gdn_gated_rms_norm``, ``out_proj``) and :func:`decode_moe_tail`.

    Shapes: h [T, hc * H]; conv_pool [S, K - 1, conv_dim] in h's dtype and recurrent_pool [S, Hv, Dk, Dv] float32
    (both updated in place at ``slots`` [B] int32); cu_seqlens [B + 1] int32; heads [Hk, Hv, Dk, Dv]; eps [the
    attention hc norm's, the gated norm's, the MLP hc norm's] -> [T, hc * H].
    """
    op = "decode_gdn_layer"
    _count(op, "attn_hc", attn_hc, HC_WEIGHTS)
    _count(op, "gdn", gdn, GDN_WEIGHTS)
    _count(op, "mlp_hc", mlp_hc, HC_WEIGHTS)
    _count(op, "moe", moe, MOE_WEIGHTS)
    if len(heads) != 4:
        raise HebrusError(f"hebrus::{op}: heads must be [Hk, Hv, Dk, Dv], got {len(heads)} values")
    if len(eps) != 3:
        raise HebrusError(f"hebrus::{op}: eps must be [attention hc norm, gated norm, mlp hc norm], got "
                          f"{len(eps)} values")
    if h.dim() != 2:
        raise HebrusError(f"hebrus::{op}: h must be [T, hc * hidden], got {tuple(h.shape)}")
    x, inject = _HEBRUS.hc_premix.default(h, *attn_hc, hc_count, eps[0])
    out = _gated_delta_net(x, gdn, conv_pool, recurrent_pool, slots, cu_seqlens, heads, eps[1], conv_activation,
                           norm_activation)
    return _moe_tail(h, out, inject, mlp_hc, moe, hc_count, eps[2], top_k, norm_topk_prob)


ATTENTION_WEIGHTS = 7


def decode_attention_head(h: torch.Tensor, attn_hc: Sequence[torch.Tensor], attention: Sequence[torch.Tensor],
                          cos: torch.Tensor, sin: torch.Tensor, dims: Sequence[int], eps: Sequence[float],
                          hc_count: int) -> tuple[torch.Tensor, ...]:
    """An indexed-attention decoder layer up to its QSA cache: the attention hyper-connection's ``hc_premix``, the
    indexer's ``index_qk_proj`` (its queries through ``rms_norm_rope`` with ``q_layernorm``), and ``q_proj``
    (queries and output gate), ``k_proj``, ``v_proj`` (q and k through ``rms_norm_rope`` with ``q_norm`` /
    ``k_norm``).

    ``attention``: ``indexer.index_qk_proj.weight``, ``indexer.q_layernorm.weight``, ``{q, k, v}_proj.weight``,
    ``q_norm.weight``, ``k_norm.weight``; dims [index heads, index kv heads (1), index head dim D, head dim Dh];
    eps [hc norm, q_layernorm, q_norm, k_norm].

    Shapes: h [T, hc * H]; cos, sin [T, R] in h's dtype -> (injection weights [T, hc], indexer queries
    [T, index heads, D], raw indexer keys [T, D], q [T, Hq, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh], gate [T, Hq, Dh]).
    """
    op = "decode_attention_head"
    _count(op, "attn_hc", attn_hc, HC_WEIGHTS)
    _count(op, "attention", attention, ATTENTION_WEIGHTS)
    if len(dims) != 4:
        raise HebrusError(f"hebrus::{op}: dims must be [index heads, index kv heads, index head dim, head dim], got "
                          f"{len(dims)} values")
    if len(eps) != 4:
        raise HebrusError(f"hebrus::{op}: eps must be [hc norm, q_layernorm, q_norm, k_norm], got {len(eps)} values")
    if h.dim() != 2:
        raise HebrusError(f"hebrus::{op}: h must be [T, hc * hidden], got {tuple(h.shape)}")
    index_heads, index_kv, d, hd = dims
    if index_kv != 1:
        raise HebrusError(f"hebrus::{op}: the indexer must have one key head, got {index_kv}")
    x, inject = _HEBRUS.hc_premix.default(h, *attn_hc, hc_count, eps[0])
    t = x.shape[0]
    q_index, token_k = F.linear(x, attention[0]).split_with_sizes([index_heads * d, index_kv * d], dim=-1)
    q_index = _HEBRUS.rms_norm_rope.default(q_index.reshape(t, -1, d), attention[1], eps[1], cos, sin)
    raw_keys = token_k.reshape(t, -1, d).squeeze(-2).reshape(t, d)
    q, gate = torch.chunk(F.linear(x, attention[2]).view(t, -1, hd * 2), 2, dim=-1)
    k, v = F.linear(x, attention[3]).view(t, -1, hd), F.linear(x, attention[4]).view(t, -1, hd)
    return (inject, q_index, raw_keys, _HEBRUS.rms_norm_rope.default(q, attention[5], eps[2], cos, sin),
            _HEBRUS.rms_norm_rope.default(k, attention[6], eps[3], cos, sin), v, gate)


def decode_attention_tail(hyper: torch.Tensor, attn_out: torch.Tensor, gate: torch.Tensor, o_proj: torch.Tensor,
                          inject: torch.Tensor, mlp_hc: Sequence[torch.Tensor], moe: Sequence[torch.Tensor],
                          hc_count: int, hc_eps: float, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """An indexed-attention decoder layer after its attention: ``o_proj(sigmoid_gate(attn_out, gate))``, then
    :func:`decode_moe_tail`.

    Shapes: hyper [T, hc * H]; attn_out, gate [T, Hq, Dh]; o_proj [H, Hq * Dh]; inject [T, hc] -> [T, hc * H].
    """
    _count("decode_attention_tail", "mlp_hc", mlp_hc, HC_WEIGHTS)
    _count("decode_attention_tail", "moe", moe, MOE_WEIGHTS)
    out = F.linear(_HEBRUS.sigmoid_gate.default(attn_out, gate).view(attn_out.shape[0], -1), o_proj)
    return _moe_tail(hyper, out, inject, mlp_hc, moe, hc_count, hc_eps, top_k, norm_topk_prob)


QSA_PLANES, QSA_INPUTS, QSA_PLAN = 4, 3, 10


def decode_attention_layer(h: torch.Tensor, attn_hc: Sequence[torch.Tensor], attention: Sequence[torch.Tensor],
                           cos: torch.Tensor, sin: torch.Tensor, dims: Sequence[int], eps: Sequence[float],
                           hc_count: int, planes: Sequence[torch.Tensor], qsa: Sequence[torch.Tensor],
                           plan: Sequence[torch.Tensor], sizes: Sequence[int], qsa_eps: float, scaling: float,
                           o_proj: torch.Tensor, mlp_hc: Sequence[torch.Tensor], moe: Sequence[torch.Tensor],
                           hc_eps: float, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """A whole indexed-attention decoder layer over its QSA cache's step plan (``QSACache.step_plan``):
    :func:`decode_attention_head`; the cache's write of the chunk's fresh cells (raw keys, k and v ``index_copy_``-ed
    into the planes in their dtype) and the pooling of the groups the chunk completes (``qsa_pool`` into their
    pooled rows); ``qsa_select``, ``qsa_token_cells`` and ``qsa_attention``; :func:`decode_attention_tail`.

    ``planes`` (written in place): the layer's keys [C, D], k_cache [C, Hkv, Dh], v_cache [C, Hkv, Dv], pooled
    [G, D]; ``qsa``: cell_pos [C] int64, the pool's norm_weight [D], inv_freq [R/2] float32; ``plan``: cells [T]
    int64, pool_cells [P, r] int32, pool_pos [P] int64, pool_rows [P] int64, then ``qsa_select``'s seq_groups,
    q_row, q_groups and ``qsa_token_cells``' nvis, first, cells; sizes [top_k groups, r]; the other arguments as
    :func:`decode_attention_head` and :func:`decode_attention_tail`.

    Shapes: h [T, hc * H] -> [T, hc * H].
    """
    op = "decode_attention_layer"
    _count(op, "planes", planes, QSA_PLANES)
    _count(op, "qsa", qsa, QSA_INPUTS)
    _count(op, "plan", plan, QSA_PLAN)
    if len(sizes) != 2:
        raise HebrusError(f"hebrus::{op}: sizes must be [top_k groups, compress ratio], got {len(sizes)} values")
    inject, q_index, raw_keys, q, k, v, gate = decode_attention_head(h, attn_hc, attention, cos, sin, dims, eps,
                                                                     hc_count)
    keys_plane, k_plane, v_plane, pooled_plane = planes
    cells = plan[0]
    keys_plane.index_copy_(0, cells, raw_keys.to(keys_plane.dtype))
    k_plane.index_copy_(0, cells, k.to(k_plane.dtype))
    v_plane.index_copy_(0, cells, v.to(v_plane.dtype))
    if plan[3].numel():
        pooled_plane.index_copy_(0, plan[3], _HEBRUS.qsa_pool.default(keys_plane, qsa[0], plan[1], plan[2], qsa[1],
                                                                      qsa_eps, qsa[2]))
    selected = _HEBRUS.qsa_select.default(q_index, pooled_plane, plan[4], plan[5], plan[6], sizes[0])
    token_cells, _ = _HEBRUS.qsa_token_cells.default(selected, plan[7], plan[8], plan[9], sizes[1])
    out = _HEBRUS.qsa_attention.default(q, k_plane, v_plane, token_cells, scaling)
    if out.shape != gate.shape or out.dtype != gate.dtype:
        raise HebrusError(f"hebrus::{op}: the attention's output {tuple(out.shape)} does not match its gate "
                          f"{tuple(gate.shape)} (a value head dim other than the head dim: run the head and tail "
                          f"apart)")
    return decode_attention_tail(h, out, gate, o_proj, inject, mlp_hc, moe, hc_count, hc_eps, top_k, norm_topk_prob)


PLE_WEIGHTS = 5


def dense_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as the native calls compute a bias-free projection (``F.linear``; on the CPU a few float32
    rows take the row kernel). Shapes: x [T, K], weight [N, K], one floating dtype -> [T, N]."""
    op = "dense_projection"
    if x.device != weight.device:
        raise HebrusError(f"hebrus::{op}: all tensors must be on one device; x is on {x.device}, weight is on "
                          f"{weight.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise HebrusError(f"hebrus::{op}: x must be [T, K] and weight [N, K], got {tuple(x.shape)} and "
                          f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or not x.dtype.is_floating_point:
        raise HebrusError(f"hebrus::{op}: x and weight must have one floating dtype, got {x.dtype} and "
                          f"{weight.dtype}")
    return F.linear(x, weight)


def decode_ple_gate(rows: torch.Tensor, h: torch.Tensor, ple: Sequence[torch.Tensor], groups: Sequence[int],
                    eps: Sequence[float], hc_count: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A PLE layer (transformers' ``Qwen4ExpTextPLELayer``) up to its conv: each stream's activations, normed
    (``norm_query``), gate the n-gram value (``value_proj``) against that stream's key (``key_proj``, ``norm_key``) by
    a sigmoid of the signed square root of their scaled dot product; the gated values and them normed for the conv
    (``norm_conv``), each norm one ``hc_rms_norm``.

    ``ple``: ``key_proj.weight``, ``norm_key.weight``, ``value_proj.weight``, ``norm_query.weight``,
    ``norm_conv.weight``; groups, eps: the three norms' group sizes and eps (norm_key, norm_query, norm_conv).

    Shapes: rows [T, N, dim] (the n-gram embedding rows), h [T, hc * H] -> (gated [T, hc * H], normed [T, hc * H]).
    """
    op = "decode_ple_gate"
    _count(op, "ple", ple, PLE_WEIGHTS)
    if len(groups) != 3 or len(eps) != 3:
        raise HebrusError(f"hebrus::{op}: groups and eps must hold the norms' [norm_key, norm_query, norm_conv] "
                          f"values, got {len(groups)} and {len(eps)}")
    if rows.dim() < 2:
        raise HebrusError(f"hebrus::{op}: rows must be [T, N, dim], got {tuple(rows.shape)}")
    emb = rows.flatten(-2)
    key = _HEBRUS.hc_rms_norm.default(F.linear(emb, ple[0]), ple[1], groups[0], eps[0]).unflatten(-1, (hc_count,
                                                                                                        hidden))
    value = F.linear(emb, ple[2])
    query = _HEBRUS.hc_rms_norm.default(h, ple[3], groups[1], eps[1]).unflatten(-1, (hc_count, hidden))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    return gated, _HEBRUS.hc_rms_norm.default(gated, ple[4], groups[2], eps[2])
