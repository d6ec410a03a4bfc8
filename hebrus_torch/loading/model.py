"""``from_pretrained``: a Qwen4Exp checkpoint as transformers' text causal LM, weights filled tensor by tensor from
memory-mapped safetensors, the PLE n-gram table optionally left in the files (docs/ple.md)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from hebrus_torch.errors import HebrusError

from .errors import CheckpointError
from .files import CheckpointFiles, TensorInfo
from .keymap import LoadPlan, Target, plan_load
from .quantized import QuantSpec, quantization_of, refuse_unannounced, swap_quantized_modules

__all__ = ["from_pretrained", "LoadedCheckpoint", "PLE_TABLE_CHOICES", "physical_memory_bytes", "choose_ple_table"]

PLE_TABLE_CHOICES = ("auto", "disk", "memory")
QWEN4_TYPES = ("qwen4_exp", "qwen4_exp_text")


@dataclass
class LoadedCheckpoint:
    """What :func:`from_pretrained` read, kept on the model as ``model.hebrus_checkpoint``.

    ``ple_table``: ``"disk"`` or ``"memory"``, what ran (``"auto"`` resolved); ``ple_table_bytes``: the n-gram
    tables' size as loaded; ``mtp``: the ``mtp.*`` tensors' places in the files, read only when the MTP block is
    first needed (``hebrus_torch.loading.mtp.load_mtp``); ``quantization``: the checkpoint's quantization_config
    (None when it has none), which the MTP block is loaded with too."""
    path: str
    ple_table: str
    ple_table_bytes: int
    mtp: dict[str, TensorInfo] = field(default_factory=dict)
    quantization: QuantSpec | None = None


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_ple_table(choice: str, table_bytes: int) -> str:
    """``"auto"``: ``"disk"`` when the tables are more than a quarter of physical memory, else ``"memory"``."""
    if choice not in PLE_TABLE_CHOICES:
        raise HebrusError(f"ple_table must be one of {PLE_TABLE_CHOICES}, got {choice!r}")
    if choice != "auto":
        return choice
    return "disk" if table_bytes * 4 > physical_memory_bytes() else "memory"


def from_pretrained(path: str | os.PathLike, *, device: str | torch.device | None = None,
                    dtype: torch.dtype | str | None = None, ple_table: str = "auto",
                    ple_cache_bytes: int | None = None, attn_implementation: str | None = None) -> Any:
    """Load a Qwen4Exp checkpoint (``qwen4_exp`` multimodal, served as text, or ``qwen4_exp_text``) as
    transformers' ``Qwen4ExpForCausalLM`` with ``hebrus_torch.integrations.transformers.apply`` done.

    The model is built on the meta device; each weight is then allocated on ``device`` (default CPU) and
    copied from the file's memory map, routed experts fused as transformers fuses them. ``dtype``: the float
    dtype of the weights (default: the config's ``dtype``, else the stored one, as transformers' ``"auto"``).
    ``ple_table``: ``"memory"`` (the n-gram table as one tensor on ``device``), ``"disk"`` (rows gathered from
    the checkpoint's files at each step, :class:`hebrus_torch.ple.row_store.DiskNgramEmbedding`) or ``"auto"``
    (disk when the table is more than a quarter of physical memory). ``ple_cache_bytes``: with the table on
    disk, release the process's mapped pages of it past about this many bytes (None: never).
    ``mtp.*`` tensors are not read here (``model.hebrus_checkpoint.mtp`` lists them; ``loading.mtp.load_mtp``).
    A checkpoint written by ``python -m hebrus_torch.convert`` (a ``quantization_config`` of quant_method
    ``hebrus_affine``) loads with its routed experts as ``QuantizedExperts`` and its stored-quantized projections
    as ``QuantizedLinear`` (docs/quantization.md); ``dtype`` then sets the scales' and biases' dtype and the other
    weights'.

    Raises :class:`~hebrus_torch.loading.CheckpointError` (a ``HebrusError``) naming file and key for a
    missing or truncated file, a tensor whose shape or dtype disagrees with the config, a missing expert or
    shard, an index naming a file that is not there; every check runs before any weight is read.
    """
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    import hebrus_torch.integrations.transformers as hx

    if ple_table not in PLE_TABLE_CHOICES:
        raise HebrusError(f"ple_table must be one of {PLE_TABLE_CHOICES}, got {ple_table!r}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad checkpoint
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    if config.model_type not in QWEN4_TYPES:
        raise CheckpointError(f"{path / 'config.json'}: model_type {config.model_type!r}, not one of {QWEN4_TYPES}")
    text = config.text_config if config.model_type == "qwen4_exp" else config
    if attn_implementation is not None:
        text._attn_implementation = attn_implementation
    quant = quantization_of(config, str(path / "config.json"))
    files = CheckpointFiles.open(path)
    load_dtype = _load_dtype(dtype, config, text, files)
    device = torch.device(device if device is not None else "cpu")

    with _default_dtype(load_dtype), torch.device("meta"):
        model = Qwen4ExpForCausalLM(text)
    if quant is not None:
        swap_quantized_modules(model, files, quant, load_dtype)
    else:
        refuse_unannounced(files, str(path / "config.json"))
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}
    tied = bool(getattr(text, "tie_word_embeddings", False))
    if tied:
        expected.pop("lm_head.weight", None)
    plan = plan_load(files, expected, tied_lm_head=tied)
    table_bytes = sum(t.shape[0] * t.shape[1] * t.dtype.itemsize for t in plan.targets.values() if t.kind == "ngram")
    mode = choose_ple_table(ple_table, table_bytes)

    try:
        _fill(model, plan, files, device, mode, ple_cache_bytes)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        _rebuild_computed_buffers(model, text, load_dtype, device)
    finally:
        files.close()
    model.eval()
    with contextlib.suppress(OSError, ValueError):
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.hebrus_checkpoint = LoadedCheckpoint(str(path), mode, table_bytes, plan.mtp, quant)
    hx.apply(model)
    return model


def _load_dtype(dtype, config, text, files: CheckpointFiles) -> torch.dtype:
    """transformers' ``dtype="auto"``: the given one, else the config's, else the first stored float's."""
    for candidate in (dtype, getattr(text, "dtype", None), getattr(config, "dtype", None)):
        if candidate is None or candidate == "auto":
            continue
        resolved = getattr(torch, candidate) if isinstance(candidate, str) else candidate
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise HebrusError(f"from_pretrained: dtype must be a float torch.dtype, got {candidate!r}")
        return resolved
    for info in files.tensors.values():
        if info.dtype.is_floating_point:
            return info.dtype
    return torch.get_default_dtype()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """What transformers does while it builds a model for ``dtype``: floats created in it by default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    module_path, _, leaf = name.rpartition(".")
    return model.get_submodule(module_path), leaf


def _fill(model, plan: LoadPlan, files: CheckpointFiles, device: torch.device, mode: str,
          cache_bytes: int | None) -> None:
    """Every target allocated on ``device`` and copied from the files, one at a time."""
    from hebrus_torch.ple.row_store import DiskNgramEmbedding, PLERowStore, TableShard

    with torch.no_grad():
        for name, target in plan.targets.items():
            owner, leaf = _owner(model, name)
            if target.kind == "ngram" and mode == "disk":
                src = target.sources
                store = PLERowStore([TableShard(i.file, i.offset, i.shape[0]) for i in src], src[0].dtype,
                                    target.shape[1], cache_bytes=cache_bytes)
                owner_module = model.get_submodule(name.rpartition(".")[0].rpartition(".")[0])
                owner_module.ngram_embedding = DiskNgramEmbedding(store, target.dtype)
                continue
            value = torch.empty(target.shape, dtype=target.dtype, device=device)
            _copy_into(value, target, files)
            if leaf in owner._parameters:
                requires_grad = owner._parameters[leaf].requires_grad
                owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=requires_grad)
            else:
                owner._buffers[leaf] = value


def _copy_into(value: torch.Tensor, target: Target, files: CheckpointFiles) -> None:
    """Each stored tensor of ``target`` copied into its place in ``value``, its file pages let go right after
    (a copy still reading them would only fault them in again from the file)."""
    src = target.sources
    if target.kind == "plain":
        places = [value]
    elif target.kind == "gate_up":
        half = target.shape[1] // 2
        places = [value[e, part] for e in range(target.shape[0]) for part in (slice(0, half), slice(half, None))]
    elif target.kind == "down":
        places = [value[e] for e in range(target.shape[0])]
    elif target.kind == "ngram":
        starts = [0]
        for info in src:
            starts.append(starts[-1] + info.shape[0])
        places = [value[a:b] for a, b in zip(starts, starts[1:])]
    else:  # pragma: no cover - plan_load makes no other kind
        raise AssertionError(target.kind)
    for place, info in zip(places, src, strict=True):
        place.copy_(files.tensor(info))
        files.release(info)


def _rebuild_computed_buffers(model, text, dtype: torch.dtype, device: torch.device) -> None:
    """Non-persistent buffers (the rotary tables) are computed at construction, not stored: build their
    modules again for real, as transformers' own construction does."""
    for name, module in list(model.named_modules()):
        if not any(b is not None and b.is_meta for b in module._buffers.values()):
            continue
        if module._parameters or any(True for _ in module.children()):
            raise CheckpointError(f"{name}: a module with a computed buffer and weights ({type(module).__name__}) "
                                  f"is not supported by the loader")
        with _default_dtype(dtype):
            fresh = type(module)(text)
        for key, buf in fresh._buffers.items():
            module._buffers[key] = buf.to(device) if buf is not None else None
        for key, value in vars(fresh).items():   # e.g. attention_scaling, computed with the buffers
            if not key.startswith("_") and not isinstance(value, torch.Tensor):
                setattr(module, key, value)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"the checkpoint left {left[0]!r} (and {len(left) - 1} more) unset")
