"""The gated-delta-net layer's gates and gated output norm as one hebrus op each (issue 37):
``hebrus::gdn_gates`` and ``hebrus::gdn_gated_rms_norm`` (typed wrappers, fakes), and the layer-level
helpers the packed forward calls (:func:`layer_gates`, :func:`output_norm`), which fall back to the
module's own code where the fused op does not apply (autograd, another norm class, hooks)."""

from __future__ import annotations

import torch

from .. import _validate
from ..errors import translated
from ..module_calls import runs_forward_only

__all__ = ["gdn_gates", "gdn_gated_rms_norm", "layer_gates", "output_norm"]


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log decay g and the beta gate in one dispatch; see :func:`hebrus_torch.reference.gdn_gates`.

    Shapes: a, b [..., Hv] (one float dtype), A_log, dt_bias [Hv] -> (g, beta) float32 of a's shape
    (beta's values are b's dtype's).
    """
    with translated():
        return torch.ops.hebrus.gdn_gates.default(a, b, A_log, dt_bias)


def gdn_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       activation: str) -> torch.Tensor:
    """transformers' ``Qwen4ExpTextRMSNormGated`` of every row in one dispatch; see
    :func:`hebrus_torch.reference.gdn_gated_rms_norm`.

    Shapes: x, gate [..., D] (one float dtype), weight [D] -> out of x's shape and dtype.
    """
    with translated():
        return torch.ops.hebrus.gdn_gated_rms_norm.default(x, gate, weight, eps, activation)


@torch.library.register_fake("hebrus::gdn_gates")
def _gdn_gates_fake(a, b, A_log, dt_bias):
    _validate.gdn_gates(a, b, A_log, dt_bias)
    return a.new_empty(a.shape, dtype=torch.float32), a.new_empty(a.shape, dtype=torch.float32)


@torch.library.register_fake("hebrus::gdn_gated_rms_norm")
def _gdn_gated_rms_norm_fake(x, gate, weight, eps, activation):
    _validate.gdn_gated_rms_norm(x, gate, weight, eps, activation)
    return x.new_empty(x.shape)


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in fp32. torch.sigmoid's CPU kernel rounds differently in the vectorised body
    and the scalar tail of a loop, so a token's value would depend on where it sits in the packed step;
    exp and division give every element the same bits wherever it sits."""
    return 1.0 / (1.0 + torch.exp(-x.float()))


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0) + log(1 + exp(-|x|))`` in fp32 (softplus; ``F.softplus`` has torch.sigmoid's position
    dependence through log1p). Differs from log1p's result by under 6e-8 absolute."""
    x = x.float()
    return x.clamp(min=0) + torch.log(1.0 + torch.exp(-x.abs()))


def layer_gates(module: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, Hv] of a ``Qwen4ExpTextGatedDeltaNet`` from its ``in_proj_a`` / ``in_proj_b`` outputs:
    one ``gdn_gates`` dispatch (beta float32 holding b's dtype's values), or, where autograd must see
    the graph, the same formulas as ATen ops (beta in b's dtype). Both give the delta rule the same values."""
    if _needs_autograd(a, b, module.A_log, module.dt_bias):
        beta = _sigmoid(b).to(b.dtype)
        return -module.A_log.float().exp() * _softplus(a.float() + module.dt_bias), beta
    return gdn_gates(a, b, module.A_log, module.dt_bias)


def _is_stock_gated_norm(norm: torch.nn.Module) -> bool:
    cls = type(norm)
    return cls.__name__ == "Qwen4ExpTextRMSNormGated" and cls.__module__.startswith("transformers.") \
        and runs_forward_only(norm) and getattr(norm, "activation", None) in ("silu", "sigmoid")


def output_norm(norm: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``norm(x, gate)`` for x, gate [N, Dv]: one ``gdn_gated_rms_norm`` where ``norm`` is transformers'
    ``Qwen4ExpTextRMSNormGated`` called as its class's forward (``runs_forward_only``: no module or global hooks, no
    forward of the instance's own), x and gate share a dtype and autograd needs no graph
    (any other case: the module's own call)."""
    if not _is_stock_gated_norm(norm) or x.dtype != gate.dtype or x.dim() < 1 \
            or _needs_autograd(x, gate, norm.weight):
        return norm(x, gate)
    return gdn_gated_rms_norm(x, gate, norm.weight, float(norm.variance_epsilon), norm.activation)
