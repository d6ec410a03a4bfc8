"""Checkpoint keys -> the weights of transformers' ``Qwen4ExpForCausalLM``, as transformers 5.23.0 maps them.

transformers' ``conversion_mapping.py`` (``qwen4_exp_text`` = ``qwen3_5_moe_text`` + the n-gram rule) does:

- ``model.language_model.X`` -> ``model.X`` (the multimodal checkpoint read as the text model);
  ``model.visual.*`` and ``mtp.*`` are not weights of the text model (``mtp.*`` is kept aside here);
- ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj.weight`` [I, H] -> ``mlp.experts.gate_up_proj`` [E, 2I, H]
  (experts stacked, then gate and up concatenated on dim 1) and ``mlp.experts.{e}.down_proj.weight`` [H, I]
  -> ``mlp.experts.down_proj`` [E, H, I];
- ``ngram_embedding.shard_{i}.weight`` -> ``ngram_embedding.weight``, the shards concatenated on dim 0 in
  order of ``i`` (``split_ngram_parts`` of them in a checkpoint transformers wrote).

:func:`plan_load` matches every weight the model expects to its stored tensors and checks shapes and dtypes,
raising :class:`CheckpointError` (naming file and key) for anything missing or disagreeing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .errors import CheckpointError
from .files import CheckpointFiles, TensorInfo

__all__ = ["Target", "LoadPlan", "plan_load", "FLOAT_TABLE_DTYPES"]

_EXPERT = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.(?P<part>weight|scales|biases)$")
# fused experts' weights (transformers' and QuantizedExperts' buffers) -> (kind, stored part of each expert)
_FUSED_EXPERTS = {"gate_up_proj": ("gate_up", "weight"), "down_proj": ("down", "weight"),
                  "gate_up_q": ("gate_up", "weight"), "gate_up_scales": ("gate_up", "scales"),
                  "gate_up_biases": ("gate_up", "biases"), "down_q": ("down", "weight"),
                  "down_scales": ("down", "scales"), "down_biases": ("down", "biases")}
_NGRAM_SHARD = re.compile(r"^(?P<base>.+\.ngram_embedding)\.shard_(?P<i>\d+)\.weight$")
_MULTIMODAL_TEXT = "model.language_model."
FLOAT_TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOATS = (torch.float64, *FLOAT_TABLE_DTYPES)


@dataclass
class Target:
    """One weight of the model and the stored tensors it is made of.

    ``kind``: ``"plain"`` (one tensor, same shape), ``"gate_up"`` (sources: gate_0, up_0, gate_1, up_1 ...),
    ``"down"`` (down_0, down_1 ...) or ``"ngram"`` (the table's shards in order)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    sources: list[TensorInfo]


@dataclass
class LoadPlan:
    targets: dict[str, Target]
    mtp: dict[str, TensorInfo] = field(default_factory=dict)
    not_text: list[str] = field(default_factory=list)


def _text_name(key: str) -> str | None:
    """The text model's name for a checkpoint key, or None for keys outside it (vision, MTP)."""
    if key.startswith(_MULTIMODAL_TEXT):
        return "model." + key[len(_MULTIMODAL_TEXT):]
    if key.startswith(("model.visual.", "mtp.")):
        return None
    return key


def plan_load(files: CheckpointFiles, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
              *, tied_lm_head: bool = False) -> LoadPlan:
    """Match ``expected`` (model name -> (shape, dtype) of every parameter and persistent buffer) to the
    checkpoint's tensors. ``tied_lm_head``: ``lm_head.weight`` may be absent (tied to the embedding)."""
    plan = LoadPlan(targets={})
    multimodal = any(k.startswith(_MULTIMODAL_TEXT) for k in files.tensors)
    direct: dict[str, TensorInfo] = {}
    experts: dict[tuple[str, str], dict[int, TensorInfo]] = {}
    shards: dict[str, dict[int, TensorInfo]] = {}
    for key, info in files.tensors.items():
        if key.startswith("mtp."):
            plan.mtp[key] = info
            continue
        name = _text_name(key)
        if name is None:
            plan.not_text.append(key)
            continue
        if (m := _EXPERT.match(name)) is not None:
            experts.setdefault((m["base"], m["proj"], m["part"]), {})[int(m["e"])] = info
        elif (m := _NGRAM_SHARD.match(name)) is not None:
            shards.setdefault(m["base"] + ".weight", {})[int(m["i"])] = info
        else:
            direct[name] = info

    def stored(name: str) -> str:
        return _MULTIMODAL_TEXT + name[len("model."):] if multimodal and name.startswith("model.") else name

    for name, (shape, dtype) in expected.items():
        if name in direct:
            info = direct[name]
            _check(info, shape, dtype)
            plan.targets[name] = Target(name, shape, dtype, "plain", [info])
        elif (fused := _fused_expert(name, shape)) is not None:
            base, kind, part = fused
            num, rows, last = shape
            if kind == "gate_up":
                sources = [_expert(experts, base, proj, part, e, (rows // 2, last), dtype, stored, files)
                           for e in range(num) for proj in ("gate_proj", "up_proj")]
            else:
                sources = [_expert(experts, base, "down_proj", part, e, (rows, last), dtype, stored, files)
                           for e in range(num)]
            plan.targets[name] = Target(name, shape, dtype, kind, sources)
        elif name.endswith(".ngram_embedding.weight") and name in shards:
            plan.targets[name] = Target(name, shape, dtype, "ngram", _ngram_shards(name, shards[name], shape,
                                                                                 stored, files))
        elif name == "lm_head.weight" and tied_lm_head:
            continue
        else:
            raise CheckpointError(f"{files.directory}: the checkpoint has no {stored(name)!r} "
                                  f"({list(shape)}), which the config's model needs")
    used = {info.key for target in plan.targets.values() for info in target.sources}
    extra = [info for key, info in files.tensors.items()
             if key not in used and key not in plan.mtp and _text_name(key) is not None]
    if extra:
        raise CheckpointError(f"{extra[0].file}: {extra[0].key!r} (and {len(extra) - 1} more) is not a weight of "
                              f"the model the config describes")
    return plan


def _check(info: TensorInfo, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if info.shape != tuple(shape):
        raise CheckpointError(f"{info.file}: {info.key!r} has shape {list(info.shape)}, the config says "
                              f"{list(shape)}")
    if dtype.is_floating_point:
        if info.dtype not in _FLOATS:
            raise CheckpointError(f"{info.file}: {info.key!r} is stored as {info.dtype}: float8 and other "
                                  f"quantized weights are not supported (bf16, fp16, fp32)")
    elif info.dtype != dtype:
        raise CheckpointError(f"{info.file}: {info.key!r} is stored as {info.dtype}, the model's buffer is {dtype}")


def _fused_expert(name: str, shape: tuple[int, ...]) -> tuple[str, str, str] | None:
    """(experts module name, "gate_up" or "down", stored part) for a fused experts weight, else None."""
    base, _, leaf = name.rpartition(".")
    if not base.endswith(".experts") or leaf not in _FUSED_EXPERTS or len(shape) != 3:
        return None
    return (base, *_FUSED_EXPERTS[leaf])


def _expert(experts, base, proj, part, e, shape, dtype, stored, files) -> TensorInfo:
    info = experts.get((base, proj, part), {}).get(e)
    if info is None:
        raise CheckpointError(f"{files.directory}: expert {e} is missing: no {stored(f'{base}.{e}.{proj}.{part}')!r} "
                              f"in the checkpoint")
    _check(info, shape, dtype)
    return info


def _ngram_shards(name, by_index: dict[int, TensorInfo], shape, stored, files) -> list[TensorInfo]:
    rows, dim = shape
    count = max(by_index) + 1
    base = name[:-len(".weight")]
    for i in range(count):
        if i not in by_index:
            raise CheckpointError(f"{files.directory}: n-gram shard {i} of {count} is missing: no "
                                  f"{stored(f'{base}.shard_{i}.weight')!r} in the checkpoint")
    sources = [by_index[i] for i in range(count)]
    first = sources[0].dtype
    for info in sources:
        if info.dtype not in FLOAT_TABLE_DTYPES:
            raise CheckpointError(f"{info.file}: {info.key!r} is stored as {info.dtype}: n-gram tables in bf16, "
                                  f"fp16 or fp32 are supported (an fp8 table with its weight_scale is not)")
        if info.dtype != first:
            raise CheckpointError(f"{info.file}: {info.key!r} is {info.dtype}, shard 0 is {first}")
        if len(info.shape) != 2 or info.shape[1] != dim:
            raise CheckpointError(f"{info.file}: {info.key!r} has shape {list(info.shape)}, the config says rows "
                                  f"of {dim}")
    total = sum(info.shape[0] for info in sources)
    if total != rows:
        raise CheckpointError(f"{sources[-1].file}: the {count} shards of {stored(name)!r} hold {total} rows, the "
                              f"config says {rows} (last shard {sources[-1].key!r})")
    return sources
