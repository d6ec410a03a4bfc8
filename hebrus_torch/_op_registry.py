"""The one registry of the hebrus ops: which ``torch.ops.hebrus`` ops exist (each one's schema, as
csrc/library.cpp declares it), which device types a build has a native kernel of each for, and each
op's composite (the kernel of every device that has no native one: its pure-PyTorch reference, or
for ``ple_conv_into`` the device's ``ple_conv`` and a copy).

Its readers: :mod:`hebrus_torch._extension` defines the schemas from it where no compiled extension
did and registers the composites; :mod:`hebrus_torch._emulate` runs an op natively or as its
composite by it; :func:`has_native_kernel` (the drop-in's, the report's and the tests' question)
answers from it. ``_extension`` and ``_emulate`` import this module, never each other
(tests/test_op_registry.py checks both).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from . import reference

__all__ = ["OpSpec", "OPS", "OP_NAMES", "SCHEMAS", "NATIVE_OPS", "has_native_kernel", "emulated_device_type",
           "emulating"]


@dataclass(frozen=True)
class OpSpec:
    """One ``hebrus::`` op.

    Attributes:
        name: the op's name in ``torch.ops.hebrus``.
        schema: its schema without the namespace, character for character csrc/library.cpp's
            (tests/test_registration.py compares them with the compiled ones).
        composite: the ``CompositeExplicitAutograd`` kernel, what every device without a native kernel
            runs (CUDA, XPU, MPS for the ops without a Metal kernel, any device without the extension).
        native: the device types a build has a kernel of its own for: ``"cpu"`` (C++, csrc/cpu/, every
            build of the extension), ``"mps"`` (Metal, csrc/mps/ + mps_kernels/, macOS builds).
        composite_via: the op whose device kernel the composite runs, where it runs one (``ple_conv_into``:
            ``ple_conv``, then a copy into the buffers); None where the composite is the reference alone.
    """

    name: str
    schema: str
    composite: Callable[..., Any]
    native: frozenset[str]
    composite_via: str | None = None

    @property
    def mutates(self) -> bool:
        """Whether the op writes an argument in place (a ``Tensor(a!)`` in its schema)."""
        return "!)" in self.schema


def _ple_conv_into_composite(x, weight, cu_seqlens, state, dilation, activation, y, new_state) -> None:
    """ple_conv_into where the device has no kernel of it: the device's ple_conv (its native kernel
    where one is built, as on MPS; else the reference), then a copy into the buffers."""
    reference.ple_conv_into_via(torch.ops.hebrus.ple_conv.default, x, weight, cu_seqlens, state, dilation,
                                activation, y, new_state)


_CPU = frozenset({"cpu"})
_CPU_MPS = frozenset({"cpu", "mps"})

OPS: dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec("ple_ngram_ids",
           "ple_ngram_ids(Tensor tokens, Tensor cu_seqlens, Tensor history, Tensor multipliers, "
           "Tensor vocab_sizes, Tensor offsets, int eos, int vocab) -> (Tensor, Tensor)",
           reference.ple_ngram_ids, _CPU_MPS),
    OpSpec("ple_conv",
           "ple_conv(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
           "str activation) -> (Tensor, Tensor)",
           reference.ple_conv, _CPU_MPS),
    OpSpec("ple_conv_into",
           "ple_conv_into(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor state, int dilation, "
           "str activation, Tensor(a!) y, Tensor(b!) new_state) -> ()",
           _ple_conv_into_composite, _CPU, composite_via="ple_conv"),
    OpSpec("ple_ngram_ids_slots",
           "ple_ngram_ids_slots(Tensor tokens, Tensor cu_seqlens, Tensor(a!) history_pool, "
           "Tensor slots, Tensor multipliers, Tensor vocab_sizes, Tensor offsets, int eos, "
           "int vocab) -> Tensor",
           reference.ple_ngram_ids_slots, _CPU_MPS),
    OpSpec("ple_conv_slots",
           "ple_conv_slots(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor(a!) state_pool, "
           "Tensor slots, int dilation, str activation) -> Tensor",
           reference.ple_conv_slots, _CPU_MPS),
    OpSpec("qsa_pool",
           "qsa_pool(Tensor keys, Tensor cell_pos, Tensor group_cells, Tensor group_pos, "
           "Tensor norm_weight, float eps, Tensor inv_freq) -> Tensor",
           reference.qsa_pool, _CPU_MPS),
    OpSpec("qsa_select",
           "qsa_select(Tensor q, Tensor pooled, Tensor seq_groups, Tensor q_row, Tensor q_groups, "
           "int top_k) -> Tensor",
           reference.qsa_select, _CPU_MPS),
    OpSpec("qsa_attention",
           "qsa_attention(Tensor q, Tensor k, Tensor v, Tensor token_cells, float scale) -> Tensor",
           reference.qsa_attention, _CPU_MPS),
    OpSpec("qsa_token_cells",
           "qsa_token_cells(Tensor selected, Tensor nvis, Tensor first, Tensor cells, int r) -> (Tensor, Tensor)",
           reference.qsa_token_cells, _CPU_MPS),
    OpSpec("qsa_plan_one_row",
           "qsa_plan_one_row(Tensor cell_pos, Tensor run_cells, Tensor run_groups, Tensor cells, int p0, int start, "
           "int r) -> Tensor[]",
           reference.qsa_plan_one_row, _CPU),
    OpSpec("qsa_claim_cells",
           "qsa_claim_cells(Tensor(a!) cell_ref, Tensor(b!) cell_pos, Tensor(c!) unwritten, Tensor freed, int start, "
           "int[] starts, int[] counts) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
           reference.qsa_claim_cells, _CPU),
    OpSpec("rms_norm_rope",
           "rms_norm_rope(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin) -> Tensor",
           reference.rms_norm_rope, _CPU_MPS),
    OpSpec("sigmoid_gate", "sigmoid_gate(Tensor x, Tensor gate) -> Tensor", reference.sigmoid_gate, _CPU_MPS),
    OpSpec("gdn_delta_rule",
           "gdn_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
           "Tensor(a!) state, float scale, bool use_qk_l2norm) -> Tensor",
           reference.gdn_delta_rule, _CPU_MPS),
    OpSpec("gdn_delta_rule_slots",
           "gdn_delta_rule_slots(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
           "Tensor cu_seqlens, Tensor(a!) state_pool, Tensor slots, float scale, "
           "bool use_qk_l2norm) -> Tensor",
           reference.gdn_delta_rule_slots, _CPU_MPS),
    OpSpec("gdn_chunk_delta_rule_slots",
           "gdn_chunk_delta_rule_slots(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
           "Tensor cu_seqlens, Tensor start_pos, Tensor(a!) state_pool, Tensor slots, "
           "float scale, bool use_qk_l2norm) -> Tensor",
           reference.gdn_chunk_delta_rule_slots, _CPU_MPS),
    OpSpec("gdn_gates",
           "gdn_gates(Tensor a, Tensor b, Tensor A_log, Tensor dt_bias) -> (Tensor, Tensor)",
           reference.gdn_gates, _CPU_MPS),
    OpSpec("gdn_gated_rms_norm",
           "gdn_gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps, str activation) -> Tensor",
           reference.gdn_gated_rms_norm, _CPU_MPS),
    OpSpec("hc_rms_norm",
           "hc_rms_norm(Tensor x, Tensor weight, int group_size, float eps) -> Tensor",
           reference.hc_rms_norm, _CPU_MPS),
    OpSpec("hc_premix",
           "hc_premix(Tensor h, Tensor norm_weight, Tensor down, Tensor up, Tensor? inject, int hc_count, "
           "float eps) -> (Tensor, Tensor)",
           reference.hc_premix, _CPU_MPS),
    OpSpec("hc_premix_quantized",
           "hc_premix_quantized(Tensor h, Tensor norm_weight, Tensor down_q, Tensor down_scales, Tensor down_biases, "
           "Tensor up_q, Tensor up_scales, Tensor up_biases, Tensor? inject_q, Tensor? inject_scales, "
           "Tensor? inject_biases, int hc_count, float eps, int group_size, int bits) -> (Tensor, Tensor)",
           reference.hc_premix_quantized, _CPU_MPS),
    OpSpec("hc_post_combine",
           "hc_post_combine(Tensor hyper, Tensor out, Tensor inject) -> Tensor",
           reference.hc_post_combine, _CPU_MPS),
    OpSpec("moe_experts",
           "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down) -> Tensor",
           reference.moe_experts, _CPU_MPS),
    OpSpec("moe_experts_quantized",
           "moe_experts_quantized(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_q, "
           "Tensor gate_up_scales, Tensor gate_up_biases, Tensor down_q, Tensor down_scales, Tensor down_biases, "
           "int group_size, int bits) -> Tensor",
           reference.moe_experts_quantized, _CPU_MPS),
    OpSpec("quantized_linear",
           "quantized_linear(Tensor x, Tensor wq, Tensor scales, Tensor biases, int group_size, int bits) -> Tensor",
           reference.quantized_linear, _CPU_MPS),
    OpSpec("moe_route",
           "moe_route(Tensor router_logits, Tensor? shared_gate_logits, int top_k, bool norm_topk_prob) "
           "-> (Tensor, Tensor)",
           reference.moe_route, _CPU_MPS),
    OpSpec("moe_shared_expert",
           "moe_shared_expert(Tensor x, Tensor routed, Tensor gate_proj, Tensor up_proj, Tensor down_proj, "
           "Tensor gate) -> Tensor",
           reference.moe_shared_expert, _CPU_MPS),
    OpSpec("moe_shared_expert_quantized",
           "moe_shared_expert_quantized(Tensor x, Tensor routed, Tensor gate_proj_q, Tensor gate_proj_scales, "
           "Tensor gate_proj_biases, Tensor up_proj_q, Tensor up_proj_scales, Tensor up_proj_biases, "
           "Tensor down_proj_q, Tensor down_proj_scales, Tensor down_proj_biases, Tensor gate, int group_size, "
           "int bits) -> Tensor",
           reference.moe_shared_expert_quantized, _CPU_MPS),
    # The native decoder-layer calls (CPU only: elsewhere they run as the ops they are made of, each the device's).
    OpSpec("decode_moe_tail",
           "decode_moe_tail(Tensor hyper, Tensor out, Tensor inject, Tensor[] mlp_hc, Tensor[] moe, int hc_count, "
           "float hc_eps, int top_k, bool norm_topk_prob) -> Tensor",
           reference.decode_moe_tail, _CPU),
    OpSpec("decode_gdn_layer",
           "decode_gdn_layer(Tensor h, Tensor[] attn_hc, Tensor[] gdn, Tensor(a!) conv_pool, "
           "Tensor(b!) recurrent_pool, Tensor slots, Tensor cu_seqlens, Tensor[] mlp_hc, Tensor[] moe, int[] heads, "
           "float[] eps, str conv_activation, str norm_activation, int hc_count, int top_k, "
           "bool norm_topk_prob) -> Tensor",
           reference.decode_gdn_layer, _CPU),
    OpSpec("decode_attention_head",
           "decode_attention_head(Tensor h, Tensor[] attn_hc, Tensor[] attention, Tensor cos, Tensor sin, int[] dims, "
           "float[] eps, int hc_count) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
           reference.decode_attention_head, _CPU),
    OpSpec("decode_attention_tail",
           "decode_attention_tail(Tensor hyper, Tensor attn_out, Tensor gate, Tensor o_proj, Tensor inject, "
           "Tensor[] mlp_hc, Tensor[] moe, int hc_count, float hc_eps, int top_k, bool norm_topk_prob) -> Tensor",
           reference.decode_attention_tail, _CPU),
    OpSpec("decode_attention_layer",
           "decode_attention_layer(Tensor h, Tensor[] attn_hc, Tensor[] attention, Tensor cos, Tensor sin, int[] dims, "
           "float[] eps, int hc_count, Tensor(a!)[] planes, Tensor[] qsa, Tensor[] plan, int[] sizes, float qsa_eps, "
           "float scaling, Tensor o_proj, Tensor[] mlp_hc, Tensor[] moe, float hc_eps, int top_k, bool norm_topk_prob) "
           "-> Tensor",
           reference.decode_attention_layer, _CPU),
    OpSpec("decode_ple_gate",
           "decode_ple_gate(Tensor rows, Tensor h, Tensor[] ple, int[] groups, float[] eps, int hc_count, int hidden) "
           "-> (Tensor, Tensor)",
           reference.decode_ple_gate, _CPU),
    OpSpec("dense_projection", "dense_projection(Tensor x, Tensor weight) -> Tensor", reference.dense_projection, _CPU),
)}

OP_NAMES: tuple[str, ...] = tuple(OPS)
SCHEMAS: dict[str, str] = {name: spec.schema for name, spec in OPS.items()}

# The ops a build has native kernels of, per device type: what has_native_kernel(op, "mps") answers on a
# Mac build (the macOS workflow checks that these are registered there; tests/test_mps_step_counts.py
# checks this list against the workflow's) and while MPS is emulated. One dict, which benchmarks may edit
# to count an op as a fallback (benchmarks/count_mps_step.py --fallback).
NATIVE_OPS: dict[str, frozenset[str]] = {
    device: frozenset(name for name, spec in OPS.items() if device in spec.native) for device in ("cpu", "mps")
}


class _Emulation(threading.local):
    device_type: str | None = None
    """(a class default: a thread that never emulated reads None without a failed attribute lookup, twice a step)"""


_emulation = _Emulation()


def emulated_device_type() -> str | None:
    """The device type being emulated on this thread (``"mps"``, inside ``hebrus_torch._emulate.emulate``),
    or None."""
    return _emulation.device_type


@contextlib.contextmanager
def emulating(device_type: str) -> Iterator[None]:
    """Answer for ``device_type`` from :data:`NATIVE_OPS` on this thread while the block runs: the CPU
    tensors of ``hebrus_torch._emulate`` stand in for that device, whose dispatcher has no kernels."""
    _emulation.device_type = device_type
    try:
        yield
    finally:
        _emulation.device_type = None


def has_native_kernel(op: str, device_type: str) -> bool:
    """True when ``hebrus::<op>`` has a compiled kernel for ``device_type`` ("cpu", "mps", ...).

    While the device type is emulated on CPU (``hebrus_torch._emulate``), the answer is the emulated
    device's list (:data:`NATIVE_OPS`), what a build for that device has; otherwise the dispatcher's."""
    if device_type == emulated_device_type():
        return op in NATIVE_OPS[device_type]
    return _dispatcher_has_kernel(op, device_type)


@functools.lru_cache(maxsize=None)
def _dispatcher_has_kernel(op: str, device_type: str) -> bool:
    # Cached: the kernels are registered when hebrus_torch is imported (the extension's and the composites'),
    # never later, and the dispatcher's query costs ~13 us, on every MoE layer of every step.
    key = {"cpu": "CPU", "mps": "MPS", "cuda": "CUDA"}.get(device_type, device_type.upper())
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"hebrus::{op}", key))
