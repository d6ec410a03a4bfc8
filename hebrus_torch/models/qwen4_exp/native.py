"""Native decoder layers (issue 37): a stock decoder layer's ops in one to three C++ calls instead of ~35 from Python.

``hebrus::decode_gdn_layer`` runs a whole gated-delta-net layer after its PLE (pre-mix, GDN with its conv tails and
recurrent states updated in place at the step's slots, post-combine, the MLP pre-mix, the MoE block,
post-combine). An indexed-attention layer is one call, ``hebrus::decode_attention_layer``, where its QSA cache has
planned the step once for every layer (``QSACache.step_plan``: the chunk's cells fresh, the groups it completes
known; the cache's host bookkeeping then settles each layer, ``settle_step_plan``); otherwise two calls around the
cache's own write, selection and attention: ``hebrus::decode_attention_head`` (pre-mix, the indexer's queries and
raw keys, q / k / v, each norm and rope) and ``hebrus::decode_attention_tail`` (the output gate and o_proj, then
the rest of the layer). ``hebrus::decode_moe_tail`` runs the part after the token mixer of a layer
whose mixer runs in Python, ``hebrus::decode_ple_gate`` a PLE layer's gate around its n-gram ids and conv (the PLE
state's). Each is the packed forward's own sequence of ops
(:mod:`hebrus_torch.reference.decode` states it), so a row's bits are the Python path's: the engine's
invariance suites hold either way.

**When a layer runs natively.** :class:`NativeLayers` resolves the decoder layers once: a part runs natively where
the packed forward's checks would take the fused path of every op in it (transformers' own modules, plain
bias-free ``nn.Linear`` projections in the activations' dtype, no hooks, no forward of an instance's own, nothing
compiled), with the same predicates the Python path asks on every call. On every step it then checks, in a few C
loops over flat lists, that nothing those predicates read has changed since (:class:`ModuleWatch`): hooks, each
module's class, its instance ``forward`` and compiled call, its submodules' and parameters' identities, and every
parameter's dtype. Any change (a hook added or removed, a module or weight replaced, a cast) re-resolves before the
step runs, so a layer hooked between steps takes the module path from its next step, as before. (A parameter's
data moved to another device in place is not watched: ATen refuses the mixed devices.)
Attributes the packed forward reads as configuration (``hc_count``, norms' ``eps``, a router's ``top_k``, a GDN's
head counts and activations) are read when resolving. Nothing runs natively off the CPU, with grad mode on, or
while a global module hook is registered.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Sequence

import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from ..._op_registry import emulated_device_type
from ... import _extension, reference
from ...errors import translated
from ...gdn.state import _ACTIVATIONS as _GDN_ACTIVATIONS
from ...hc.premix import _fusable_premix, _is_stock_rms_norm, premix_params, stock_gated_residual
from ...moe.block import _plain_call, experts_unsupported, shared_expert_weights, stock_router_weight
from ...module_calls import linear, plain_linear_weight, submodule
from ...reference.decode import GDN_WEIGHTS, HC_WEIGHTS, MOE_WEIGHTS
from ...integrations.qwen4_exp.common import _modeling

__all__ = ["decode_moe_tail", "decode_gdn_layer", "decode_attention_head", "decode_attention_tail",
           "decode_attention_layer", "decode_ple_gate", "dense_projection",
           "NativeLayers", "GdnLayerCall", "MoeTailCall", "AttentionLayerCall", "PleGateCall", "LayerCalls",
           "BoundLayer", "MixerCall", "ModuleWatch"]


# ----------------------------------------------------------------------------------------------- the ops
def decode_moe_tail(hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor, mlp_hc: Sequence[torch.Tensor],
                    moe: Sequence[torch.Tensor], hc_count: int, hc_eps: float, top_k: int,
                    norm_topk_prob: bool) -> torch.Tensor:
    """A decoder layer after its token mixer in one call; see :func:`hebrus_torch.reference.decode_moe_tail`.

    Shapes: hyper [T, hc * H], out [T, H], inject [T, hc] -> [T, hc * H].
    """
    with translated():
        return torch.ops.hebrus.decode_moe_tail.default(hyper, out, inject, mlp_hc, moe, int(hc_count),
                                                        float(hc_eps), int(top_k), bool(norm_topk_prob))


# Each fake is the op's reference (its ops' fakes): outputs with the very shapes, strides and offsets the kernel's
# (views of the projections, as the kernel returns them).
torch.library.register_fake("hebrus::decode_moe_tail")(reference.decode_moe_tail)


def decode_gdn_layer(h: torch.Tensor, attn_hc: Sequence[torch.Tensor], gdn: Sequence[torch.Tensor],
                     conv_pool: torch.Tensor, recurrent_pool: torch.Tensor, slots: torch.Tensor,
                     cu_seqlens: torch.Tensor, mlp_hc: Sequence[torch.Tensor], moe: Sequence[torch.Tensor],
                     heads: Sequence[int], eps: Sequence[float], conv_activation: str, norm_activation: str,
                     hc_count: int, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """A gated-delta-net decoder layer in one call, its conv tails and recurrent states updated in place at
    ``slots``; see :func:`hebrus_torch.reference.decode_gdn_layer`.

    Shapes: h [T, hc * H]; conv_pool [S, K - 1, conv_dim] in h's dtype; recurrent_pool [S, Hv, Dk, Dv] float32;
    slots [B] int32; cu_seqlens [B + 1] int32 -> [T, hc * H].
    """
    with translated():
        return torch.ops.hebrus.decode_gdn_layer.default(
            h, attn_hc, gdn, conv_pool, recurrent_pool, slots, cu_seqlens, mlp_hc, moe, [int(v) for v in heads],
            [float(v) for v in eps], conv_activation, norm_activation, int(hc_count), int(top_k),
            bool(norm_topk_prob))


torch.library.register_fake("hebrus::decode_gdn_layer")(reference.decode_gdn_layer)


def decode_attention_head(h: torch.Tensor, attn_hc: Sequence[torch.Tensor], attention: Sequence[torch.Tensor],
                          cos: torch.Tensor, sin: torch.Tensor, dims: Sequence[int], eps: Sequence[float],
                          hc_count: int) -> tuple[torch.Tensor, ...]:
    """An indexed-attention layer up to its QSA cache in one call; see
    :func:`hebrus_torch.reference.decode_attention_head` (shapes and the seven outputs)."""
    with translated():
        return torch.ops.hebrus.decode_attention_head.default(h, attn_hc, attention, cos, sin, [int(v) for v in dims],
                                                              [float(v) for v in eps], int(hc_count))


torch.library.register_fake("hebrus::decode_attention_head")(reference.decode_attention_head)


def decode_attention_tail(hyper: torch.Tensor, attn_out: torch.Tensor, gate: torch.Tensor, o_proj: torch.Tensor,
                          inject: torch.Tensor, mlp_hc: Sequence[torch.Tensor], moe: Sequence[torch.Tensor],
                          hc_count: int, hc_eps: float, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """An indexed-attention layer after its attention in one call; see
    :func:`hebrus_torch.reference.decode_attention_tail`."""
    with translated():
        return torch.ops.hebrus.decode_attention_tail.default(hyper, attn_out, gate, o_proj, inject, mlp_hc, moe,
                                                              int(hc_count), float(hc_eps), int(top_k),
                                                              bool(norm_topk_prob))


torch.library.register_fake("hebrus::decode_attention_tail")(reference.decode_attention_tail)


def decode_attention_layer(h: torch.Tensor, attn_hc: Sequence[torch.Tensor], attention: Sequence[torch.Tensor],
                           cos: torch.Tensor, sin: torch.Tensor, dims: Sequence[int], eps: Sequence[float],
                           hc_count: int, planes: Sequence[torch.Tensor], qsa: Sequence[torch.Tensor],
                           plan: Sequence[torch.Tensor], sizes: Sequence[int], qsa_eps: float, scaling: float,
                           o_proj: torch.Tensor, mlp_hc: Sequence[torch.Tensor], moe: Sequence[torch.Tensor],
                           hc_eps: float, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """A whole indexed-attention layer over its QSA cache's step plan in one call, the cache's planes written in
    place; see :func:`hebrus_torch.reference.decode_attention_layer`. Shapes: h [T, hc * H] -> [T, hc * H]."""
    with translated():
        return torch.ops.hebrus.decode_attention_layer.default(
            h, attn_hc, attention, cos, sin, dims, eps, hc_count, planes, qsa, plan, sizes, qsa_eps, scaling, o_proj,
            mlp_hc, moe, hc_eps, top_k, norm_topk_prob)


torch.library.register_fake("hebrus::decode_attention_layer")(reference.decode_attention_layer)


def decode_ple_gate(rows: torch.Tensor, h: torch.Tensor, ple: Sequence[torch.Tensor], groups: Sequence[int],
                    eps: Sequence[float], hc_count: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A PLE layer's gate before its conv in one call; see :func:`hebrus_torch.reference.decode_ple_gate`."""
    with translated():
        return torch.ops.hebrus.decode_ple_gate.default(rows, h, ple, [int(v) for v in groups],
                                                        [float(v) for v in eps], int(hc_count), int(hidden))


torch.library.register_fake("hebrus::decode_ple_gate")(reference.decode_ple_gate)


def dense_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as the native calls compute a projection; see :func:`hebrus_torch.reference.dense_projection`.
    Shapes: x [T, K], weight [N, K] -> [T, N]."""
    with translated():
        return torch.ops.hebrus.dense_projection.default(x, weight)


torch.library.register_fake("hebrus::dense_projection")(reference.dense_projection)


# ----------------------------------------------------------------------------------------------- resolution
@dataclass(frozen=True)
class MoeTailCall:
    """A layer's part after its token mixer as :func:`decode_moe_tail`'s arguments after (hyper, out, inject)."""

    mlp_hc: list[torch.Tensor]
    moe: list[torch.Tensor]
    hc_count: int
    hc_eps: float
    top_k: int
    norm_topk_prob: bool

    def __call__(self, hyper: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        return decode_moe_tail(hyper, out, inject, self.mlp_hc, self.moe, self.hc_count, self.hc_eps, self.top_k,
                               self.norm_topk_prob)


@dataclass(frozen=True)
class GdnLayerCall:
    """A whole gated-delta-net layer as :func:`decode_gdn_layer`'s arguments other than h and the state."""

    attn_hc: list[torch.Tensor]
    gdn: list[torch.Tensor]
    heads: list[int]
    eps: list[float]
    conv_activation: str
    norm_activation: str
    tail: MoeTailCall

    def __call__(self, h: torch.Tensor, conv_pool: torch.Tensor, recurrent_pool: torch.Tensor, slots: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor:
        t = self.tail
        return decode_gdn_layer(h, self.attn_hc, self.gdn, conv_pool, recurrent_pool, slots, cu_seqlens, t.mlp_hc,
                                t.moe, self.heads, self.eps, self.conv_activation, self.norm_activation, t.hc_count,
                                t.top_k, t.norm_topk_prob)

    def bound(self, conv_pool: torch.Tensor, recurrent_pool: torch.Tensor, slots: torch.Tensor,
              cu_seqlens: torch.Tensor) -> BoundLayer:
        """This call over the step's state (as :meth:`__call__` takes it), h left to the layer."""
        t = self.tail
        return BoundLayer(torch.ops.hebrus.decode_gdn_layer.default, (
            self.attn_hc, self.gdn, conv_pool, recurrent_pool, slots, cu_seqlens, t.mlp_hc, t.moe, self.heads,
            self.eps, self.conv_activation, self.norm_activation, t.hc_count, t.top_k, t.norm_topk_prob))


@dataclass(frozen=True)
class AttentionLayerCall:
    """An indexed-attention layer as :func:`decode_attention_head` before its QSA cache and
    :func:`decode_attention_tail` after it; ``rope_dims``: the largest rotary width its ``rms_norm_rope`` calls
    take (the indexer's and the attention's head dims)."""

    attn_hc: list[torch.Tensor]
    attention: list[torch.Tensor]
    dims: list[int]
    eps: list[float]
    o_proj: torch.Tensor
    scaling: float
    rope_dims: int
    tail: MoeTailCall

    def head(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return decode_attention_head(h, self.attn_hc, self.attention, cos, sin, self.dims, self.eps,
                                     self.tail.hc_count)

    def finish(self, hyper: torch.Tensor, attn_out: torch.Tensor, gate: torch.Tensor,
               inject: torch.Tensor) -> torch.Tensor:
        t = self.tail
        return decode_attention_tail(hyper, attn_out, gate, self.o_proj, inject, t.mlp_hc, t.moe, t.hc_count,
                                     t.hc_eps, t.top_k, t.norm_topk_prob)

    def whole(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, planes: list[torch.Tensor],
              qsa: list[torch.Tensor], plan: list[torch.Tensor], sizes: list[int], qsa_eps: float) -> torch.Tensor:
        """The layer in one :func:`decode_attention_layer` call over its QSA cache's step plan (``QSACache.step_plan``:
        ``planes`` written in place)."""
        t = self.tail
        return decode_attention_layer(h, self.attn_hc, self.attention, cos, sin, self.dims, self.eps, t.hc_count,
                                      planes, qsa, plan, sizes, qsa_eps, self.scaling, self.o_proj, t.mlp_hc, t.moe,
                                      t.hc_eps, t.top_k, t.norm_topk_prob)

    def bound(self, cos: torch.Tensor, sin: torch.Tensor, planes: list[torch.Tensor], qsa: list[torch.Tensor],
              plan: list[torch.Tensor], sizes: list[int], qsa_eps: float,
              then: Callable[[], None] | None = None) -> BoundLayer:
        """:meth:`whole` over the step's rotary rows and plan, h left to the layer; ``then`` runs after the call."""
        t = self.tail
        return BoundLayer(torch.ops.hebrus.decode_attention_layer.default, (
            self.attn_hc, self.attention, cos, sin, self.dims, self.eps, t.hc_count, planes, qsa, plan, sizes, qsa_eps,
            self.scaling, self.o_proj, t.mlp_hc, t.moe, t.hc_eps, t.top_k, t.norm_topk_prob), then)


@dataclass(frozen=True)
class PleGateCall:
    """A PLE layer's gate as :func:`decode_ple_gate`'s arguments after (rows, h); ``conv_weight``: its conv's weight
    (what ``ChunkStep.ple_conv`` takes)."""

    ple: list[torch.Tensor]
    groups: list[int]
    eps: list[float]
    hc_count: int
    hidden: int
    conv_weight: torch.Tensor

    def __call__(self, rows: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_ple_gate(rows, h, self.ple, self.groups, self.eps, self.hc_count, self.hidden)


@dataclass(frozen=True)
class LayerCalls:
    """What of one decoder layer runs natively: the whole GDN layer (``layer``), the indexed attention's layer
    around its QSA cache (``attention``), any layer's part after its token mixer (``tail``) and its PLE's gate
    (``ple``); None: the Python path."""

    layer: GdnLayerCall | None
    tail: MoeTailCall | None
    attention: AttentionLayerCall | None = None
    ple: PleGateCall | None = None


_NONE = LayerCalls(None, None)


class BoundLayer:
    """One decoder layer's native call of a step with every argument but the streams bound before the first layer
    runs (the step's state pools or plan): ``bound(h)`` -> Tensor[T, hc * H]. Binding is the state holders' host
    work, done next to the step's other host work; between two layers' calls only the call is left. ``then``: what
    runs once the call returned (an indexed layer's bookkeeping listed for later)."""

    __slots__ = ("op", "args", "then")

    def __init__(self, op: Callable[..., torch.Tensor], args: tuple, then: Callable[[], None] | None = None) -> None:
        self.op, self.args, self.then = op, args, then

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        with translated():
            out = self.op(h, *self.args)
        if self.then is not None:
            self.then()
        return out


def _premix_weights(hc: torch.nn.Module | None, h: torch.Tensor) -> tuple[list[torch.Tensor], int, float] | None:
    """(the ``hc_premix`` weights, hc_count, eps) where ``hyper_premix(hc, h)`` runs one ``hc_premix`` with an
    injection; else None."""
    if hc is None or not stock_gated_residual(hc, h) or not _fusable_premix(hc, h):
        return None
    norm_weight, down, up, inject, eps = premix_params(hc)
    if inject is None:
        return None
    return [norm_weight, down, up, inject], int(hc.hc_count), eps


def _moe_weights(mlp: torch.nn.Module | None, x: torch.Tensor) -> tuple[list[torch.Tensor], int, bool] | None:
    """(the MoE block's weights, top_k, norm_topk_prob) where ``packed_moe(mlp, x)`` runs the router's and the shared
    gate's ``F.linear``, ``moe_route``, ``moe_experts`` and ``moe_shared_expert``; else None."""
    m = _modeling()
    if type(mlp) is not m.Qwen4ExpTextSparseMoeBlock or not _plain_call(mlp):
        return None
    gate = submodule(mlp, "gate")
    router = stock_router_weight(gate)
    shared_gate = plain_linear_weight(submodule(mlp, "shared_expert_gate", None), x.dtype)
    experts = submodule(mlp, "experts")
    if router is None or router.dtype != x.dtype or shared_gate is None \
            or not _plain_call(experts, "_experts_forward") or experts_unsupported(experts, x) is not None:
        return None
    shared = shared_expert_weights(submodule(mlp, "shared_expert"), x)
    if shared is None:
        return None
    params = experts._parameters
    return [router, shared_gate, params["gate_up_proj"], params["down_proj"], *shared], int(gate.top_k), \
        bool(gate.norm_topk_prob)


def _tail_call(layer: torch.nn.Module, h: torch.Tensor, x: torch.Tensor) -> MoeTailCall | None:
    hc = _premix_weights(submodule(layer, "mlp_hyper_connection", None), h)
    moe = _moe_weights(submodule(layer, "mlp", None), x)
    if hc is None or moe is None:
        return None
    return MoeTailCall(hc[0], moe[0], hc[1], hc[2], moe[1], moe[2])


def _gdn_weights(gdn: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """The GDN's weights where ``gated_delta_net`` runs ``F.linear`` for each projection, ``gdn_gates`` and
    ``gdn_gated_rms_norm`` (the gated norm transformers' own, without hooks); else None."""
    from ...gdn.fused import _is_stock_gated_norm

    linears = [plain_linear_weight(submodule(gdn, name, None), dtype)
               for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
    norm, conv = submodule(gdn, "norm", None), submodule(gdn, "conv1d", None)
    if any(w is None for w in linears) or norm is None or not _is_stock_gated_norm(norm) or conv is None:
        return None
    conv_weight = conv._parameters.get("weight")
    if conv_weight is None or conv_weight.dim() not in (2, 3) or (conv_weight.dim() == 3 and conv_weight.shape[1] != 1):
        return None
    params = gdn._parameters
    a_log, dt_bias = params.get("A_log"), params.get("dt_bias")
    if a_log is None or dt_bias is None:
        return None
    return [*linears[:4], conv_weight, a_log, dt_bias, norm._parameters["weight"], linears[4]]


def _gdn_layer_call(layer: torch.nn.Module, h: torch.Tensor, x: torch.Tensor,
                    tail: MoeTailCall | None) -> GdnLayerCall | None:
    gdn = submodule(layer, "linear_attn", None)
    attn = _premix_weights(submodule(layer, "attn_hyper_connection", None), h)
    if tail is None or attn is None or gdn is None or attn[1] != tail.hc_count:
        return None
    weights = _gdn_weights(gdn, x.dtype)
    activation = getattr(gdn, "activation", None)
    if weights is None or activation not in _GDN_ACTIVATIONS:
        return None
    norm = submodule(gdn, "norm")
    heads = [int(gdn.num_k_heads), int(gdn.num_v_heads), int(gdn.head_k_dim), int(gdn.head_v_dim)]
    return GdnLayerCall(attn[0], weights, heads, [attn[2], float(norm.variance_epsilon), tail.hc_eps],
                        _GDN_ACTIVATIONS[activation], str(norm.activation), tail)


def _stock_norm_weight(norm: torch.nn.Module | None, dim: int) -> torch.Tensor | None:
    """The weight of transformers' own ungrouped Qwen4Exp RMSNorm over ``dim`` (what ``norm_and_rope`` fuses into
    ``rms_norm_rope``); else None."""
    if norm is None or not _is_stock_rms_norm(norm) or norm.group_size not in (None, dim):
        return None
    return norm._parameters.get("weight")


def _attention_layer_call(layer: torch.nn.Module, h: torch.Tensor, x: torch.Tensor,
                          tail: MoeTailCall | None) -> AttentionLayerCall | None:
    """Where ``packed_indexed_attention`` runs plain ``F.linear`` projections and one ``rms_norm_rope`` per norm,
    and ``_gated_heads`` one ``sigmoid_gate`` and ``F.linear``: the weights of the layer's head and tail."""
    attn = submodule(layer, "self_attn", None)
    hc = _premix_weights(submodule(layer, "attn_hyper_connection", None), h)
    indexer = None if attn is None else submodule(attn, "indexer", None)
    if tail is None or hc is None or indexer is None or hc[1] != tail.hc_count \
            or int(getattr(indexer, "index_kv_heads", 0)) != 1:
        return None
    d, hd = int(indexer.index_head_dim), int(attn.head_dim)
    linears = [plain_linear_weight(submodule(indexer, "index_qk_proj", None), x.dtype)] + [
        plain_linear_weight(submodule(attn, name, None), x.dtype)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    norms = [_stock_norm_weight(submodule(indexer, "q_layernorm", None), d),
             _stock_norm_weight(submodule(attn, "q_norm", None), hd),
             _stock_norm_weight(submodule(attn, "k_norm", None), hd)]
    if any(w is None for w in linears + norms):
        return None
    eps = [hc[2]] + [float(submodule(m, n).eps) for m, n in ((indexer, "q_layernorm"), (attn, "q_norm"),
                                                             (attn, "k_norm"))]
    weights = [linears[0], norms[0], linears[1], linears[2], linears[3], norms[1], norms[2]]
    return AttentionLayerCall(hc[0], weights, [int(indexer.index_n_heads), 1, d, hd], eps, linears[4],
                              float(attn.scaling), min(d, hd), tail)


def _ple_gate_call(ple: torch.nn.Module | None, dtype: torch.dtype) -> PleGateCall | None:
    """Where ``packed_ple`` runs ``F.linear`` for its key and value projections and one ``hc_rms_norm`` per norm:
    the gate's weights."""
    if ple is None:
        return None
    hc, hidden = int(ple.hc_count), int(ple.hidden_size)
    norms = [submodule(ple, name, None) for name in ("norm_key", "norm_query", "norm_conv")]
    linears = [plain_linear_weight(submodule(ple, name, None), dtype) for name in ("key_proj", "value_proj")]
    conv = submodule(ple, "conv1d", None)
    if any(w is None for w in linears) or conv is None or conv._parameters.get("weight") is None \
            or not all(n is not None and _is_stock_rms_norm(n) for n in norms):
        return None
    weights = [n._parameters.get("weight") for n in norms]
    if any(w is None for w in weights):
        return None
    groups = [int(n.group_size) if n.group_size is not None else hc * hidden for n in norms]
    return PleGateCall([linears[0], weights[0], linears[1], weights[1], weights[2]], groups,
                       [float(n.eps) for n in norms], hc, hidden, conv._parameters["weight"])


def resolve_layer(layer: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> LayerCalls:
    """What of ``layer`` (a ``Qwen4ExpTextDecoderLayer``) runs natively on activations of ``dtype``."""
    hc = submodule(layer, "mlp_hyper_connection", None)
    if hc is None:
        return _NONE
    hidden = int(hc.hidden_size)
    h = torch.empty(0, int(hc.hc_count) * hidden, dtype=dtype, device=device)
    x = torch.empty(0, hidden, dtype=dtype, device=device)
    tail = _tail_call(layer, h, x)
    ple = _ple_gate_call(submodule(layer, "ple", None), dtype)
    if getattr(layer, "layer_type", None) == "linear_attention":
        return LayerCalls(_gdn_layer_call(layer, h, x, tail), tail, None, ple)
    return LayerCalls(None, tail, _attention_layer_call(layer, h, x, tail), ple)


def _global_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


class ModuleWatch:
    """What the resolution read of modules, to tell cheaply whether any of it changed: hooks (any registered since,
    anywhere: ``RemovableHandle``'s id counter, and the modules' hook counts), each module's class, instance
    ``forward`` and compiled call, its submodules and parameters (their names and identities) and every parameter's
    dtype. :meth:`unchanged` compares them in one C++ pass over a snapshot of these objects (``_C._module_watch``)
    that prefetches them first: inside a decode step they are out of the caches (the native calls stream megabytes of
    weights through them), and the interpreter's loops touched them one memory latency at a time. Without the
    compiled extension the same comparisons run as map loops over flat lists (:meth:`unchanged_in_python`)."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self.modules = list(modules)
        self.types = list(map(type, self.modules))
        self.hook_id = RemovableHandle.next_id
        self.hook_dicts = [d for m in self.modules for d in (m._forward_hooks, m._forward_pre_hooks,
                                                               m._backward_hooks, m._backward_pre_hooks)]
        self.hook_count = sum(map(len, self.hook_dicts))
        self.instance_dicts = [m.__dict__ for m in self.modules]
        self.forwards = list(map(dict.get, self.instance_dicts, repeat("forward")))
        self.compiled = list(map(dict.get, self.instance_dicts, repeat("_compiled_call_impl")))
        self.owner_dicts = [d for m in self.modules for d in (m._modules, m._parameters)]
        self.owner_sizes = list(map(len, self.owner_dicts))
        self.member_dicts, self.member_names, self.members = [], [], []
        for d in self.owner_dicts:
            for name, obj in d.items():
                self.member_dicts.append(d)
                self.member_names.append(name)
                self.members.append(obj)
        self.params = [p for m in self.modules for p in m._parameters.values() if p is not None]
        self.dtypes = list(map(_DTYPE, self.params))
        self._snapshot = self._take_snapshot()

    def _take_snapshot(self):
        native = _extension._C
        return None if native is None else native._module_watch(
            RemovableHandle, self.hook_id, self.hook_dicts, self.hook_count, self.member_dicts, self.member_names,
            self.members, self.owner_dicts, self.owner_sizes, self.instance_dicts, self.forwards, self.compiled,
            self.modules, self.types, self.params, self.dtypes)

    # A copy (copy.deepcopy of an engine, a pickle) holds the lists, copied with the modules they name, and takes its
    # snapshot of them afresh (the capsule itself cannot be copied): it compares the copies with what the resolution
    # read, as the original compares the originals.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_snapshot"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._snapshot = self._take_snapshot()

    def unchanged(self) -> bool:
        """Whether nothing the resolution read has changed since this watch was made."""
        if self._snapshot is not None:
            return _extension._C._module_watch_unchanged(self._snapshot)
        return self.unchanged_in_python()

    def unchanged_in_python(self) -> bool:
        # (No hook was registered anywhere since (the id counter) and none removed here (the count).)
        return RemovableHandle.next_id == self.hook_id and sum(map(len, self.hook_dicts)) == self.hook_count \
            and all(map(operator.is_, map(dict.get, self.member_dicts, self.member_names), self.members)) \
            and list(map(len, self.owner_dicts)) == self.owner_sizes \
            and all(map(operator.is_, map(dict.get, self.instance_dicts, repeat("forward")), self.forwards)) \
            and all(map(operator.is_, map(dict.get, self.instance_dicts, repeat("_compiled_call_impl")),
                        self.compiled)) \
            and list(map(type, self.modules)) == self.types \
            and list(map(_DTYPE, self.params)) == self.dtypes


_DTYPE = operator.attrgetter("dtype")


def watched_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :func:`resolve_layer` reads of a decoder layer: the layer, its hyper-connections, its MoE block,
    its PLE and its token mixer (each with its submodules)."""
    parts = ["mlp_hyper_connection", "mlp", "attn_hyper_connection", "ple"]
    parts.append("linear_attn" if getattr(layer, "layer_type", None) == "linear_attention" else "self_attn")
    found = [layer]
    for name in parts:
        part = layer._modules.get(name)
        if part is not None:
            found.extend(part.modules())
    return found


@dataclass(frozen=True)
class MixerCall:
    """A text model's final ``hyper_connection_mixer`` (no injection) as ``hebrus::hc_premix`` of its weights, what
    ``hyper_premix`` runs for it: ``call(h)`` h Tensor[T, hc * H] -> Tensor[T, H]."""

    weights: list[torch.Tensor]
    hc_count: int
    eps: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        norm_weight, down, up = self.weights
        with translated():
            return torch.ops.hebrus.hc_premix.default(h, norm_weight, down, up, None, self.hc_count, self.eps)[0]


def resolve_mixer(mixer: torch.nn.Module | None, dtype: torch.dtype, device: torch.device) -> MixerCall | None:
    """``mixer`` (a text model's ``hyper_connection_mixer``) as a :class:`MixerCall` on streams of ``dtype`` where
    ``hyper_premix`` runs one ``hc_premix`` without an injection for it; else None."""
    if mixer is None or not hasattr(mixer, "hc_count") or not hasattr(mixer, "hidden_size"):
        return None
    h = torch.empty(0, int(mixer.hc_count) * int(mixer.hidden_size), dtype=dtype, device=device)
    if not stock_gated_residual(mixer, h) or not _fusable_premix(mixer, h):
        return None
    norm_weight, down, up, inject, eps = premix_params(mixer)
    return None if inject is not None else MixerCall([norm_weight, down, up], int(mixer.hc_count), eps)


class NativeLayers:
    """The native calls of a text model's decoder layers (:func:`resolve_layer`) and of its final mixer
    (:func:`resolve_mixer`), resolved afresh whenever :class:`ModuleWatch` sees a change.

    Args:
        layers: the text model's ``layers`` (a ``ModuleList``: a layer replaced in it is seen as a change).
        count: how many of them the forward runs (``num_hidden_layers``; an MTP block may follow them).
        enabled: False: no layer runs natively (the Python path everywhere).
        text: the text model, whose ``hyper_connection_mixer`` is resolved too (None: it is not; a mixer replaced
            on the text model is seen as a change).
    """

    def __init__(self, layers: torch.nn.Module, count: int, enabled: bool = True,
                 text: torch.nn.Module | None = None) -> None:
        self.container, self.count = layers, int(count)
        self.enabled = enabled
        self.text = text
        self.resolutions = 0
        """How many times the layers were resolved (the first step's, and one per change seen)."""
        self._watch: ModuleWatch | None = None
        self._key: tuple | None = None
        self._calls: list[LayerCalls] = []
        self._mixer: MixerCall | None = None

    @property
    def mixer(self) -> MixerCall | None:
        """The final mixer's call as resolved for the streams :meth:`calls` last returned calls for (None: the mixer
        takes ``hyper_premix``). Read it only after a :meth:`calls` that returned a list."""
        return self._mixer

    def calls(self, h: torch.Tensor) -> list[LayerCalls] | None:
        """Per decoder layer what runs natively on this step's streams h Tensor[T, hc * H], or None where
        nothing can (disabled, off the CPU, an emulated device's tensors, grad mode on, a global module hook)."""
        if not self._may_run(h):
            return None
        key = (h.dtype, h.device)
        if key != self._key or self._watch is None or not self._watch.unchanged():
            self._resolve(h.dtype, h.device)
            self._key = key
        return self._calls

    def project(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` (the step's ``lm_head``): where the layers may run natively (:meth:`calls`' conditions) and
        ``module`` is a plain bias-free ``nn.Linear`` of x's dtype, as the native calls compute a projection
        (:func:`dense_projection`: a few float32 rows by the row kernel, docs/cpu.md); else the module's own call.
        x Tensor[T, in] -> Tensor[T, out]."""
        weight = plain_linear_weight(module, x.dtype)
        if weight is None or not self._may_run(x) or x.dim() != 2 or weight.device != x.device:
            return linear(module, x)
        return dense_projection(x, weight)

    def _may_run(self, x: torch.Tensor) -> bool:
        """Whether a native call may take ``x`` at all: enabled, a plain CPU tensor, grad mode off, no global module
        hook, no device emulated."""
        return self.enabled and type(x) is torch.Tensor and x.device.type == "cpu" and not torch.is_grad_enabled() \
            and not _global_hooks() and emulated_device_type() is None

    def _resolve(self, dtype: torch.dtype, device: torch.device) -> None:
        self.resolutions += 1
        layers = list(self.container)[: self.count]
        mixer = None if self.text is None else self.text._modules.get("hyper_connection_mixer")
        watched = [self.container] + [m for layer in layers for m in watched_modules(layer)]
        if self.text is not None:
            watched += [self.text] + ([] if mixer is None else list(mixer.modules()))
        self._watch = ModuleWatch(watched)
        self._calls = [resolve_layer(layer, dtype, device) for layer in layers]
        self._mixer = resolve_mixer(mixer, dtype, device)
