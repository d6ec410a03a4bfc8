"""Indexed attention (transformers' ``Qwen4ExpTextAttention`` with its ``Qwen4ExpTextQSAIndexer``): the
projections both the engine and the drop-in run, and the engine's packed form over the QSA cache.

The shared pieces take activations with any leading shape (``[T, ...]`` packed, ``[B, T, ...]`` in the
drop-in) and cos/sin with the same leading shape, so one formula serves both; ``rope`` is transformers'
``apply_rotary_pos_emb`` (resolved by the caller: the drop-in resolves it at patch time, outside traced code).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ...hc.premix import _is_stock_rms_norm, fused_norm
from ...module_calls import linear, runs_as_f_linear
from ...qsa.ops import rms_norm_rope, sigmoid_gate

if TYPE_CHECKING:
    from ...model_cache import ChunkStep

Rope = Callable[..., torch.Tensor]
"""transformers' ``apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1)``."""


def _is_module_rope(rope: Rope) -> bool:
    return getattr(rope, "__name__", None) == "apply_rotary_pos_emb" \
        and getattr(rope, "__module__", "").startswith("transformers.")


def rope_fuses(rope: Rope, cos: torch.Tensor, sin: torch.Tensor, rows: int, dtype: torch.dtype, width: int) -> bool:
    """Whether ``rms_norm_rope`` takes these rotary rows for ``rows`` packed tokens of heads ``width`` wide in
    ``dtype``: transformers' own ``apply_rotary_pos_emb``, cos and sin Tensor[rows, R] in ``dtype``, R even and at
    most ``width`` (what :func:`norm_and_rope` and the native attention head both ask)."""
    return _is_module_rope(rope) and cos.dim() == 2 and cos.shape[0] == rows and cos.dtype == dtype \
        and sin.dtype == dtype and sin.shape == cos.shape and cos.shape[1] % 2 == 0 and cos.shape[1] <= width


def norm_and_rope(norm: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rope: Rope) -> torch.Tensor:
    """``rope(norm(x))`` of heads x Tensor[..., H, D] at cos, sin Tensor[..., R]: one ``hebrus::rms_norm_rope``
    dispatch for packed rows (x [T, H, D], cos [T, R] in x's dtype) where ``norm`` is transformers' own
    ungrouped Qwen4Exp RMSNorm without hooks and ``rope`` its ``apply_rotary_pos_emb``; anything else runs
    the norm (:func:`~hebrus_torch.hc.premix.fused_norm`) and ``rope`` as given."""
    if (_is_stock_rms_norm(norm) and x.dim() == 3 and norm.group_size in (None, x.shape[2])
            and rope_fuses(rope, cos, sin, x.shape[0], x.dtype, x.shape[2])):
        return rms_norm_rope(x, norm.weight, float(norm.eps), cos, sin)
    return rope(fused_norm(norm, x), cos=cos, sin=sin, unsqueeze_dim=cos.dim() - 1)


def _raw_projections(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q (not normed), k (not normed), v Tensor[..., H(kv), Dh] and the gate Tensor[..., H, Dh] (a view of
    q_proj's output, as q)."""
    lead, hd = x.shape[:-1], attn.head_dim
    q, gate = torch.chunk(linear(attn.q_proj, x).view(*lead, -1, hd * 2), 2, dim=-1)
    return q, linear(attn.k_proj, x).view(*lead, -1, hd), linear(attn.v_proj, x).view(*lead, -1, hd), gate


def index_queries_and_keys(indexer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries and raw keys, as ``Qwen4ExpTextQSAIndexer.forward`` computes them.

    Args:
        indexer: the layer's ``self_attn.indexer``.
        x: Tensor[..., hidden_size]; cos, sin: Tensor[..., R] at x's positions.

    Returns:
        q Tensor[..., Hq, D] (``q_layernorm``-ed, roped) and the raw (unnormed, unroped) keys Tensor[..., D]
        (one index kv head).
    """
    d = indexer.index_head_dim
    q, token_k = linear(indexer.index_qk_proj, x).split_with_sizes(
        [indexer.index_n_heads * d, indexer.index_kv_heads * d], dim=-1)
    lead = x.shape[:-1]
    q, raw_keys = q.reshape(*lead, -1, d), token_k.reshape(*lead, -1, d).squeeze(-2)
    return norm_and_rope(indexer.q_layernorm, q, cos, sin, rope), raw_keys


def index_keys(indexer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The raw indexer keys of :func:`index_queries_and_keys` alone: x Tensor[..., hidden_size] ->
    Tensor[..., D]. Where ``index_qk_proj`` is a plain ``nn.Linear`` only its key rows are computed (the queries
    are not needed where nothing attends: a row's values equal the whole projection's to rounding, not
    bitwise); any other module (quantized, wrapped) runs whole and its key columns are kept."""
    d = indexer.index_head_dim
    n_k = indexer.index_kv_heads * d
    proj = indexer.index_qk_proj
    if runs_as_f_linear(proj):
        bias = proj.bias[-n_k:] if proj.bias is not None else None
        keys = torch.nn.functional.linear(x, proj.weight[-n_k:], bias)
    else:
        keys = proj(x)[..., -n_k:]
    return keys.reshape(*x.shape[:-1], -1, d).squeeze(-2)


def attention_projections(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output gate of ``Qwen4ExpTextAttention.forward``, token-major and not roped.

    Args:
        attn: the layer's ``self_attn``; x: Tensor[..., hidden_size].

    Returns:
        q Tensor[..., H, Dh] (``q_norm``-ed), k Tensor[..., Hkv, Dh] (``k_norm``-ed), v Tensor[..., Hkv, Dh]
        and the gate Tensor[..., H * Dh] (:func:`gated_output`).
    """
    q, k, v, gate = _raw_projections(attn, x)
    return fused_norm(attn.q_norm, q), fused_norm(attn.k_norm, k), v, gate.reshape(*x.shape[:-1], -1)


def gated_output(attn: torch.nn.Module, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention's output: ``o_proj(out * sigmoid(gate))``; out Tensor[..., H, Dv] (token-major), gate
    from :func:`attention_projections` -> Tensor[..., hidden_size]."""
    out = out.reshape(*gate.shape[:-1], -1).contiguous()
    return attn.o_proj(out * torch.sigmoid(gate))


def _gated_heads(attn: torch.nn.Module, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """:func:`gated_output` of out Tensor[T, H, Dv] and the gate's heads Tensor[T, H, Dh]: one
    ``hebrus::sigmoid_gate`` dispatch (the gate read in place) where the shapes and dtypes match, then ``o_proj``."""
    if out.dim() == 3 and out.shape == gate.shape and out.dtype == gate.dtype:
        return linear(attn.o_proj, sigmoid_gate(out, gate).view(out.shape[0], -1))
    return gated_output(attn, out, gate.reshape(*gate.shape[:-2], -1))


def packed_indexed_attention(step: ChunkStep, layer_idx: int, attn: torch.nn.Module, x: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, rope: Rope) -> torch.Tensor:
    """``Qwen4ExpTextAttention.forward`` with its indexer on a ``ChunkStep``'s packed rows, over the QSA cache.

    x: Tensor[T, hidden_size]; cos, sin: Tensor[T, R] -> Tensor[T, hidden_size]. The raw indexer keys and K/V
    are written to the cache (``qsa_write``), each query selects its groups (``qsa_select``) and attends to
    exactly those cells (``qsa_attention``; a query whose history is within the budget attends to all of it).
    """
    t = x.shape[0]
    q_index, raw_keys = index_queries_and_keys(attn.indexer, x, cos, sin, rope)
    q, k, v, gate = _raw_projections(attn, x)
    q, k = norm_and_rope(attn.q_norm, q, cos, sin, rope), norm_and_rope(attn.k_norm, k, cos, sin, rope)
    step.qsa_write(layer_idx, raw_keys.reshape(t, attn.indexer.index_head_dim), k, v)
    plan = step.qsa_select(layer_idx, q_index)
    return _gated_heads(attn, step.qsa_attention(layer_idx, q, plan, attn.scaling), gate)


def write_keys_and_values(step: ChunkStep, layer_idx: int, attn: torch.nn.Module, x: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, rope: Rope) -> None:
    """Only the cache writes of :func:`packed_indexed_attention` (raw indexer keys, roped K, V of x
    Tensor[T, hidden_size]), without its queries, selection or attention: what a layer whose outputs at these
    positions are not needed contributes to the state (the MTP block during a trunk step)."""
    t, hd = x.shape[0], attn.head_dim
    raw_keys = index_keys(attn.indexer, x)
    k = norm_and_rope(attn.k_norm, attn.k_proj(x).view(t, -1, hd), cos, sin, rope)
    v = attn.v_proj(x).view(t, -1, hd)
    step.qsa_write(layer_idx, raw_keys.reshape(t, attn.indexer.index_head_dim), k, v)

