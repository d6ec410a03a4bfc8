"""Calling a model's own ``nn.Linear`` modules on the decode hot path without ``nn.Module.__call__``'s machinery,
where skipping it changes nothing (and the same for ``nn.Embedding``: :func:`embedding`).

``module(x)`` of an ``nn.Linear`` runs ``F.linear(x, weight, bias)`` after checking for hooks, a compiled call,
an instance ``forward`` and TorchScript tracing; :func:`linear` makes the same checks itself and, where none
applies, calls ``F.linear`` on the module's own parameters (the same op on the same tensors: the same bits).
Any other module (a subclass, a quantized or LoRA-wrapped projection, a hooked one) is called as itself. A
1-request decode step calls about 25 such projections; the module call costs a few microseconds each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _module

__all__ = ["embedding", "linear", "plain_linear_weight", "runs_as_f_linear", "runs_forward_only", "submodule"]


def runs_forward_only(module: torch.nn.Module) -> bool:
    """``module(...)`` would run exactly ``type(module).forward``: no module or global hooks (forward or
    backward), no ``torch.compile``-d call, no ``forward`` of the instance's own, no TorchScript tracing."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks) \
        and module._compiled_call_impl is None and "forward" not in module.__dict__ \
        and not torch._C._get_tracing_state()


def runs_as_f_linear(module: torch.nn.Module | None) -> bool:
    """``module`` is a plain ``nn.Linear`` whose call is ``F.linear`` of its own parameters (:func:`runs_forward_only`):
    what :func:`linear` and every fused path that reads a projection's weight ask."""
    return type(module) is torch.nn.Linear and runs_forward_only(module)


def plain_linear_weight(module: torch.nn.Module | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight [out, in] of a bias-free ``nn.Linear`` that :func:`linear` runs as ``F.linear``, where it has
    ``dtype``; else None."""
    if not runs_as_f_linear(module):
        return None
    params = module._parameters          # (weight and bias live here: read without Module.__getattr__)
    weight = params["weight"]
    return weight if params["bias"] is None and weight.dtype == dtype else None


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: as ``F.linear(x, weight, bias)`` where ``module`` is a plain ``nn.Linear``
    (:func:`runs_as_f_linear`), else the module's own call. x Tensor[..., in] -> Tensor[..., out]."""
    if runs_as_f_linear(module):
        params = module._parameters
        return F.linear(x, params["weight"], params["bias"])
    return module(x)


def embedding(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``module(ids)``: as ``F.embedding`` of the module's own weight and options where ``module`` is a plain
    ``nn.Embedding`` (:func:`runs_forward_only`: what its ``forward`` runs, the same bits), else the module's own call.
    ids Tensor[...] int64 -> Tensor[..., embedding_dim]."""
    if type(module) is torch.nn.Embedding and runs_forward_only(module):
        return F.embedding(ids, module._parameters["weight"], module.padding_idx, module.max_norm, module.norm_type,
                           module.scale_grad_by_freq, module.sparse)
    return module(ids)


_ABSENT = object()


def submodule(module: torch.nn.Module, name: str, *default):
    """``getattr(module, name[, default])`` for a submodule, read from ``module._modules`` (no
    ``Module.__getattr__``, which runs only after the instance's own lookup failed); a name that holds no module
    (set to None before any module was assigned to it, or not a submodule at all) is read as ``getattr`` reads
    it."""
    found = module._modules.get(name, _ABSENT)
    return getattr(module, name, *default) if found is _ABSENT else found
