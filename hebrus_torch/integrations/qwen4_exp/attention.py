"""Qwen4ExpTextAttention.forward with one hebrus::qsa_attention call over the selected cells where the
selection is sparser than the cache; everything else is transformers' own."""

from __future__ import annotations

import torch

import hebrus_torch
from hebrus_torch import _limits
from hebrus_torch._extension import has_native_kernel
from hebrus_torch.models.qwen4_exp.attention import attention_projections, gated_output

from .common import _PATCH
from .selection import _Selection, selection_mask
from .stats import _STATS

def _attentions_requested(kwargs) -> bool:
    """Whether this forward must return attention weights (transformers records them from our output)."""
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
        collected = _active_collector.get()
    except (ImportError, LookupError):
        return False
    except Exception:                    # unknown transformers internals: be safe, take the original path
        return True
    return bool(collected) and "attentions" in collected


def _attention_beyond_kernel_limits(attention, device: torch.device) -> bool:
    limit = _limits.ATTENTION_HEAD_DIM_LIMITS.get(device.type)      # hebrus_torch._limits
    return (limit is not None and attention.head_dim > limit
            and has_native_kernel("qsa_attention", device.type))


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                       past_key_values=None, **kwargs):
    """Qwen4ExpTextAttention.forward with one hebrus::qsa_attention call where the selection is sparser than
    the cache; everything else (projections, norms, rope, cache update, output gate) as transformers does it."""
    record = self.__dict__[_PATCH]
    original = record["original_forward"]
    indexer = self.indexer
    reason = None
    if torch.compiler.is_compiling():
        return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    if not record.get("sparse", True):
        reason = "off"
    elif _PATCH not in indexer.__dict__:
        reason = "indexer_not_patched"
    elif attention_mask is None or attention_mask.dim() != 4:
        reason = "mask_shape"
    elif attention_mask.shape[-1] <= indexer.token_budget + indexer.compress_ratio - 1:
        reason = "not_sparser"           # every query may select the whole cache: plain attention
    elif self.training and self.attention_dropout > 0:
        reason = "dropout"
    elif torch.is_grad_enabled() and (hidden_states.requires_grad or self.q_proj.weight.requires_grad):
        reason = "autograd"              # hebrus::qsa_attention has no backward
    elif _attentions_requested(kwargs):
        reason = "output_attentions"
    elif _attention_beyond_kernel_limits(self, hidden_states.device):
        reason = "kernel_limits"
    if reason is not None:
        _STATS[f"sparse_attention_skipped:{reason}"] += 1
        return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)

    ind_record = indexer.__dict__[_PATCH]
    ind_record["as_indices"] = True
    try:                                 # through the module call, so indexer hooks still see its output
        selection = indexer(hidden_states, position_embeddings, attention_mask, past_key_values)
    finally:
        ind_record["as_indices"] = False

    # From here on transformers' Qwen4ExpTextAttention.forward (5.23.0): its projections and output gate are
    # hebrus_torch.models.qwen4_exp.attention's (the engine's too), the rest line for line.
    position_embeddings = tuple(x[:, -hidden_states.shape[1]:, :] for x in position_embeddings)
    query_states, key_states, value_states, gate = attention_projections(self, hidden_states)
    query_states, key_states, value_states = (t.transpose(1, 2) for t in (query_states, key_states, value_states))
    cos, sin = position_embeddings
    query_states, key_states = record["rope"](query_states, key_states, cos, sin)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    interface = record["interfaces"].get_interface(self.config._attn_implementation, record["eager"])

    batch = query_states.shape[0]
    kv = key_states.shape[-2]
    if not isinstance(selection, _Selection) or selection.kv != kv:
        # The indexer fell back to transformers' own (a dense mask), or a cache whose key count differs
        # from the mask's: masked dense attention, as the original.
        _STATS["sparse_attention_skipped:dense_mask"] += 1
        selected = selection_mask(selection)
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & selected
        else:
            attention_mask = attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)
        attn_output, attn_weights = interface(self, query_states, key_states, value_states, attention_mask,
                                              dropout=0.0 if not self.training else self.attention_dropout,
                                              scaling=self.scaling, **kwargs)
    else:
        # One call per batch row: the op reads cells-major K/V ([cells, Hkv, D]) through strides, and a
        # row of the cache ([Hkv, K, D]) transposed is such a view, so no K/V is copied (merging the
        # batch into the cells would copy the whole cache on every call once B > 1 and Hkv > 1).
        q = query_states.transpose(1, 2)                                         # [B, T, H, D]
        cells = selection.token_idx                                              # [B, T, W]
        maybe_empty = selection.any_empty is None or selection.any_empty    # None: only the device knows
        if maybe_empty:
            # Queries that see nothing (left-padding positions): give them one cell for the op, then take
            # transformers' own result for them below (a fully masked row: eager averages, sdpa as torch does).
            cells = cells.clone()
            cells[..., 0] = torch.where(selection.empty, 0, cells[..., 0])
        attn_output = torch.stack([
            hebrus_torch.qsa_attention(q[b], key_states[b].transpose(0, 1), value_states[b].transpose(0, 1),
                                       cells[b], self.scaling)
            for b in range(batch)])                                              # [B, T, H, Dv]
        if maybe_empty:
            if selection.any_empty is None:  # no host read: transformers' result for every query position
                rows, count = slice(None), q.shape[1]
            else:
                rows = torch.nonzero(selection.empty.any(0)).flatten()          # query positions with an empty row
                count = rows.numel()
            if attention_mask.dtype == torch.bool:
                masked = attention_mask.new_zeros((batch, 1, count, kv))
            else:
                masked = attention_mask.new_full((batch, 1, count, kv), torch.finfo(attention_mask.dtype).min)
            dense, _ = interface(self, query_states[:, :, rows], key_states, value_states, masked, dropout=0.0,
                                 scaling=self.scaling, **kwargs)                 # [B, n, H, Dv]
            keep = selection.empty[:, rows][..., None, None]
            attn_output[:, rows] = torch.where(keep, dense.to(attn_output.dtype), attn_output[:, rows])
        attn_weights = None
        _STATS["sparse_attention_calls"] += 1

    return gated_output(self, attn_output, gate), attn_weights
