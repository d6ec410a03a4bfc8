"""Metadata checks of ``hebrus::moe_experts``, shared by its fake impl and its reference; the C++ kernel and
the MPS glue make the same checks with the same messages (csrc/moe_checks.h). Expert ids are values: the
kernels and the reference check them (:func:`check_moe_ids`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _validate
from ..errors import HebrusError
from .quantize import check_quant_options

__all__ = ["MoeSizes", "check_moe_experts", "check_moe_ids", "check_moe_experts_quantized", "check_quantized_linear",
           "check_moe_route", "check_moe_shared_expert", "check_moe_shared_expert_quantized"]

OP = "moe_experts"


class MoeSizes(NamedTuple):
    """The sizes of a ``moe_experts`` call."""

    rows: int     # T
    hidden: int   # H
    top_k: int    # k
    experts: int  # E
    inter: int    # I (gate_up has 2 I rows per expert)


def _routing_shapes(op: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, int, int]:
    """topk_ids [T, k] and topk_weights [T, k] against x [T, H]; returns (T, H, k)."""
    rows, hidden = x.shape
    _validate.check(topk_ids.shape[0] == rows, op, f"topk_ids must have shape (T, k) with T = x.shape[0] = {rows}, "
                    f"got {tuple(topk_ids.shape)}")
    _validate.check(topk_weights.shape == topk_ids.shape, op, f"topk_weights must have the shape of topk_ids "
                    f"{tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    return rows, hidden, topk_ids.shape[1]


def check_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor) -> MoeSizes:
    """Ranks, dtypes and shapes of ``moe_experts``' arguments (csrc/moe_checks.h); returns its sizes."""
    _validate._same_device(OP, x=x, topk_ids=topk_ids, topk_weights=topk_weights, gate_up=gate_up, down=down)
    _validate._ranks_and_dtypes(OP, ("x", x, 2, _validate.FLOAT_DTYPES),
                                ("topk_ids", topk_ids, 2, (torch.int64, torch.int32)),
                                ("topk_weights", topk_weights, 2, _validate.FLOAT_DTYPES),
                                ("gate_up", gate_up, 3, _validate.FLOAT_DTYPES),
                                ("down", down, 3, _validate.FLOAT_DTYPES))
    for name, t in (("gate_up", gate_up), ("down", down)):
        _validate.check(t.dtype == x.dtype, OP, f"{name} dtype {t.dtype} must match x dtype {x.dtype}")
    rows, hidden, top_k = _routing_shapes(OP, x, topk_ids, topk_weights)
    experts, two_i, gate_up_h = gate_up.shape
    _validate.check(experts >= 1 and gate_up_h == hidden and two_i % 2 == 0 and two_i >= 2, OP,
                    f"gate_up must have shape (E, 2 * I, H) with E >= 1, I >= 1 and H = x.shape[1] = {hidden}, "
                    f"got {tuple(gate_up.shape)}")
    inter = two_i // 2
    _validate.check(tuple(down.shape) == (experts, hidden, inter), OP,
                    f"down must have shape (E, H, I) = {(experts, hidden, inter)} to match gate_up, "
                    f"got {tuple(down.shape)}")
    return MoeSizes(rows, hidden, top_k, experts, inter)


def check_moe_ids(topk_ids: torch.Tensor, experts: int, op: str = OP) -> None:
    """Every expert id in ``[0, E)``; reads the ids (a host read on an accelerator)."""
    ids = topk_ids.long()
    bad = (ids < 0) | (ids >= experts)
    if bool(bad.any()):
        t, j = (int(v) for v in torch.nonzero(bad)[0])
        raise HebrusError(f"hebrus::{op}: topk_ids[{t}, {j}] = {int(ids[t, j])} is not an expert id in "
                          f"[0, E={experts})")


QOP = "moe_experts_quantized"


def check_moe_experts_quantized(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                                gate_up_q: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_biases: torch.Tensor,
                                down_q: torch.Tensor, down_scales: torch.Tensor, down_biases: torch.Tensor,
                                group_size: int, bits: int) -> MoeSizes:
    """``moe_experts_quantized``'s arguments (csrc/moe_checks.h); returns its sizes."""
    _validate._same_device(QOP, x=x, topk_ids=topk_ids, topk_weights=topk_weights, gate_up_q=gate_up_q,
                           gate_up_scales=gate_up_scales, gate_up_biases=gate_up_biases, down_q=down_q,
                           down_scales=down_scales, down_biases=down_biases)
    check_quant_options(bits, group_size, op=QOP)
    _validate._ranks_and_dtypes(QOP, ("x", x, 2, _validate.FLOAT_DTYPES),
                                ("topk_ids", topk_ids, 2, (torch.int64, torch.int32)),
                                ("topk_weights", topk_weights, 2, _validate.FLOAT_DTYPES),
                                ("gate_up_q", gate_up_q, 3, torch.int32), ("down_q", down_q, 3, torch.int32))
    for name, t in (("gate_up_scales", gate_up_scales), ("gate_up_biases", gate_up_biases),
                    ("down_scales", down_scales), ("down_biases", down_biases)):
        _validate._dims(t, 3, QOP, name)
        _validate.check(t.dtype == x.dtype, QOP, f"{name} dtype {t.dtype} must match x dtype {x.dtype}")
    rows, hidden, top_k = _routing_shapes(QOP, x, topk_ids, topk_weights)
    _validate.check(hidden % group_size == 0, QOP, f"H = x.shape[1] = {hidden} must be a multiple of group_size "
                    f"{group_size}")
    experts, two_i = gate_up_q.shape[:2]
    per_word = 32 // bits
    _validate.check(experts >= 1 and two_i >= 2 and two_i % 2 == 0 and gate_up_q.shape[2] * per_word == hidden, QOP,
                    f"gate_up_q must have shape (E, 2 * I, H * bits / 32) with E >= 1, I >= 1 and H = {hidden}, "
                    f"got {tuple(gate_up_q.shape)}")
    inter = two_i // 2
    _validate.check(inter % group_size == 0, QOP, f"I = {inter} must be a multiple of group_size {group_size}")
    _validate.check(tuple(down_q.shape) == (experts, hidden, inter // per_word), QOP,
                    f"down_q must have shape (E, H, I * bits / 32) = {(experts, hidden, inter // per_word)}, "
                    f"got {tuple(down_q.shape)}")
    for name, t, want in (("gate_up_scales", gate_up_scales, (experts, two_i, hidden // group_size)),
                          ("gate_up_biases", gate_up_biases, (experts, two_i, hidden // group_size)),
                          ("down_scales", down_scales, (experts, hidden, inter // group_size)),
                          ("down_biases", down_biases, (experts, hidden, inter // group_size))):
        _validate.check(tuple(t.shape) == want, QOP, f"{name} must have shape {want}, got {tuple(t.shape)}")
    return MoeSizes(rows, hidden, top_k, experts, inter)


LOP = "quantized_linear"


def check_quantized_linear(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                           group_size: int, bits: int) -> tuple[int, int, int]:
    """``quantized_linear``'s arguments (csrc/moe_checks.h); returns (T, in, out)."""
    _validate._same_device(LOP, x=x, wq=wq, scales=scales, biases=biases)
    check_quant_options(bits, group_size, op=LOP)
    _validate._ranks_and_dtypes(LOP, ("x", x, 2, _validate.FLOAT_DTYPES), ("wq", wq, 2, torch.int32))
    for name, t in (("scales", scales), ("biases", biases)):
        _validate._dims(t, 2, LOP, name)
        _validate.check(t.dtype == x.dtype, LOP, f"{name} dtype {t.dtype} must match x dtype {x.dtype}")
    rows, in_dim = x.shape
    _validate.check(in_dim % group_size == 0, LOP, f"in = x.shape[1] = {in_dim} must be a multiple of group_size "
                    f"{group_size}")
    out_dim = wq.shape[0]
    _validate.check(wq.shape[1] * (32 // bits) == in_dim, LOP, f"wq must have shape (out, in * bits / 32) with "
                    f"in = {in_dim}, got {tuple(wq.shape)}")
    want = (out_dim, in_dim // group_size)
    for name, t in (("scales", scales), ("biases", biases)):
        _validate.check(tuple(t.shape) == want, LOP, f"{name} must have shape {want}, got {tuple(t.shape)}")
    return rows, in_dim, out_dim


ROP = "moe_route"


def check_moe_route(router_logits: torch.Tensor, shared_gate_logits: torch.Tensor | None,
                    top_k: int) -> tuple[int, int, int, int]:
    """``moe_route``'s arguments (csrc/moe_checks.h); returns (T, E, k, S), S = 0 without shared gate logits."""
    tensors = {"router_logits": router_logits}
    if shared_gate_logits is not None:
        tensors["shared_gate_logits"] = shared_gate_logits
    _validate._same_device(ROP, **tensors)
    _validate._ranks_and_dtypes(ROP, ("router_logits", router_logits, 2, _validate.FLOAT_DTYPES))
    rows, experts = router_logits.shape
    shared = 0
    if shared_gate_logits is not None:
        _validate._dims(shared_gate_logits, 2, ROP, "shared_gate_logits")
        _validate.check(shared_gate_logits.dtype == router_logits.dtype, ROP,
                        f"shared_gate_logits dtype {shared_gate_logits.dtype} must match router_logits dtype "
                        f"{router_logits.dtype}")
        _validate.check(shared_gate_logits.shape[0] == rows, ROP, f"shared_gate_logits must have shape (T, S) with "
                        f"T = router_logits.shape[0] = {rows}, got {tuple(shared_gate_logits.shape)}")
        shared = shared_gate_logits.shape[1]
    _validate.check(1 <= top_k <= experts, ROP, f"top_k must be in [1, E = {experts}], got {top_k}")
    return rows, experts, top_k, shared


SOP = "moe_shared_expert"


def check_moe_shared_expert(x: torch.Tensor, routed: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                            down_proj: torch.Tensor, gate: torch.Tensor) -> tuple[int, int, int]:
    """``moe_shared_expert``'s arguments (csrc/moe_checks.h); returns (T, H, I)."""
    tensors = {"x": x, "routed": routed, "gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj,
               "gate": gate}
    _validate._same_device(SOP, **tensors)
    _validate._ranks_and_dtypes(SOP, ("x", x, 2, _validate.FLOAT_DTYPES))
    for name, t in list(tensors.items())[1:]:
        _validate._dims(t, 2, SOP, name)
        _validate.check(t.dtype == x.dtype, SOP, f"{name} dtype {t.dtype} must match x dtype {x.dtype}")
    (rows, hidden), inter = x.shape, gate_proj.shape[0]
    _validate.check(inter >= 1, SOP, f"gate_proj must have I >= 1 rows, got shape {tuple(gate_proj.shape)}")
    _check_shapes_2d(SOP, tensors, (("routed", (rows, hidden)), ("gate_proj", (inter, hidden)),
                                    ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)), ("gate", (rows, 1))))
    return rows, hidden, inter


def _check_shapes_2d(op: str, tensors: dict[str, torch.Tensor], wants) -> None:
    """``(name, (rows, cols))`` each, in order (csrc/moe_checks.h check_shapes_2d)."""
    for name, want in wants:
        _validate.check(tuple(tensors[name].shape) == want, op,
                        f"{name} must have shape ({want[0]}, {want[1]}), got {tuple(tensors[name].shape)}")


SQOP = "moe_shared_expert_quantized"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def check_moe_shared_expert_quantized(x: torch.Tensor, routed: torch.Tensor, gate_proj_q: torch.Tensor,
                                      gate_proj_scales: torch.Tensor, gate_proj_biases: torch.Tensor,
                                      up_proj_q: torch.Tensor, up_proj_scales: torch.Tensor,
                                      up_proj_biases: torch.Tensor, down_proj_q: torch.Tensor,
                                      down_proj_scales: torch.Tensor, down_proj_biases: torch.Tensor,
                                      gate: torch.Tensor, group_size: int, bits: int) -> tuple[int, int, int]:
    """``moe_shared_expert_quantized``'s arguments (csrc/moe_checks.h); returns (T, H, I)."""
    weights = (gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q, up_proj_scales, up_proj_biases,
               down_proj_q, down_proj_scales, down_proj_biases)
    names = [f"{p}_{part}" for p in PROJECTIONS for part in ("q", "scales", "biases")]
    tensors = {"x": x, "routed": routed, **dict(zip(names, weights)), "gate": gate}
    _validate._same_device(SQOP, **tensors)
    check_quant_options(bits, group_size, op=SQOP)
    _validate._ranks_and_dtypes(SQOP, ("x", x, 2, _validate.FLOAT_DTYPES),
                                *((f"{p}_q", tensors[f"{p}_q"], 2, torch.int32) for p in PROJECTIONS))
    for name in ("routed", *(n for n in names if not n.endswith("_q")), "gate"):
        _validate._dims(tensors[name], 2, SQOP, name)
        _validate.check(tensors[name].dtype == x.dtype, SQOP,
                        f"{name} dtype {tensors[name].dtype} must match x dtype {x.dtype}")
    (rows, hidden), inter, per_word = x.shape, gate_proj_q.shape[0], 32 // bits
    _validate.check(inter >= 1, SQOP, f"gate_proj_q must have I >= 1 rows, got shape {tuple(gate_proj_q.shape)}")
    _validate.check(hidden % group_size == 0, SQOP, f"H = x.shape[1] = {hidden} must be a multiple of group_size "
                    f"{group_size}")
    _validate.check(inter % group_size == 0, SQOP, f"I = gate_proj_q.shape[0] = {inter} must be a multiple of "
                    f"group_size {group_size}")
    wants = [("routed", (rows, hidden))]
    for proj, (out_dim, in_dim) in zip(PROJECTIONS, ((inter, hidden), (inter, hidden), (hidden, inter))):
        wants += [(f"{proj}_q", (out_dim, in_dim // per_word)), (f"{proj}_scales", (out_dim, in_dim // group_size)),
                  (f"{proj}_biases", (out_dim, in_dim // group_size))]
    _check_shapes_2d(SQOP, tensors, (*wants, ("gate", (rows, 1))))
    return rows, hidden, inter
