"""The checkpoint's MTP block (``mtp.*``), read when it is first needed.

``from_pretrained`` keeps the ``mtp.*`` tensors' places in the files (``model.hebrus_checkpoint.mtp``) and reads
none of them; :func:`load_mtp` builds :class:`~hebrus_torch.models.qwen4_exp.mtp.Qwen4ExpMTP` and fills it from
the memory-mapped files as the trunk's weights are (routed experts stored per expert, fused as transformers
fuses them), on the trunk's device and in its dtype. It has no ``embed_tokens`` or ``lm_head``: the trunk's
are used. From a checkpoint written by ``python -m hebrus_torch.convert`` its routed experts load as
``QuantizedExperts`` and its stored-quantized projections as ``QuantizedLinear`` (the trunk's
:func:`~hebrus_torch.loading.quantized.swap_quantized_modules`). :func:`mtp_state_dict` is the inverse (the released layout, what ``testing.save_mtp`` writes).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from .errors import CheckpointError
from .files import CheckpointFiles
from .keymap import plan_load
from .quantized import refuse_unannounced, swap_quantized_modules

__all__ = ["load_mtp", "mtp_state_dict", "PREFIX"]

PREFIX = "mtp."
_FUSED = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def load_mtp(model: torch.nn.Module):
    """The MTP block of the checkpoint ``model`` was loaded from (``from_pretrained``), or None when the model
    was not loaded so or its checkpoint has no ``mtp.*`` tensors.

    Raises:
        CheckpointError: the checkpoint's ``mtp.*`` tensors are not a whole MTP block of this config (a key
            missing, a shape or dtype that disagrees, quantized tensors without a quantization_config or that
            its format cannot hold): nothing is loaded.
    """
    from ..models.qwen4_exp import find_text_model
    from ..models.qwen4_exp.mtp import Qwen4ExpMTP
    from .model import _default_dtype, _fill

    loaded = getattr(model, "hebrus_checkpoint", None)
    if loaded is None or not loaded.mtp:
        return None
    text = find_text_model(model)
    weight = text.embed_tokens.weight
    infos = {key[len(PREFIX):]: dataclasses.replace(info, key=key[len(PREFIX):])
             for key, info in loaded.mtp.items()}
    with _default_dtype(weight.dtype), torch.device("meta"):
        mtp = Qwen4ExpMTP(text.config)
    files = CheckpointFiles(Path(loaded.path), infos)
    try:
        try:
            if loaded.quantization is not None:
                swap_quantized_modules(mtp, files, loaded.quantization, weight.dtype)
            else:
                refuse_unannounced(files, f"{loaded.path}/config.json")
            expected = {name: (tuple(t.shape), t.dtype) for name, t in mtp.state_dict(keep_vars=True).items()}
            plan = plan_load(files, expected)
        except CheckpointError as err:
            raise CheckpointError(f"the checkpoint's MTP block (keys under {PREFIX!r}): {err}") from None
        _fill(mtp, plan, files, weight.device, "memory", None)
    finally:
        files.close()
    return mtp.eval()


def mtp_state_dict(mtp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``mtp``'s weights under the released checkpoint's keys (``mtp.`` prefix, routed experts per expert:
    ``experts.{e}.{gate,up}_proj.weight`` [I, H], ``experts.{e}.down_proj.weight`` [H, I])."""
    out: dict[str, torch.Tensor] = {}
    for name, t in mtp.state_dict().items():
        m = _FUSED.match(name)
        if m is None:
            out[PREFIX + name] = t.detach().contiguous()
            continue
        base = PREFIX + m["base"]
        for e in range(t.shape[0]):
            if m["proj"] == "down_proj":
                out[f"{base}.{e}.down_proj.weight"] = t[e].detach().contiguous()
            else:
                gate, up = t[e].detach().chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}.{e}.up_proj.weight"] = up.contiguous()
    return out
