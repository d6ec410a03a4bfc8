"""``convert``: a Qwen4Exp checkpoint -> the same checkpoint with its projections affine-quantized.

Streams: the source's files are memory-mapped (:class:`hebrus_torch.loading.files.CheckpointFiles`), each
stored tensor is read, quantized (in slices of rows, so even ``lm_head`` is never whole in fp32) or copied,
written to its place in the output file and its pages let go, one tensor at a time. The output is written in
a temporary directory beside ``dst`` and renamed to ``dst`` once complete; on any failure the temporary
directory is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hebrus_torch.errors import HebrusError
from hebrus_torch.loading.files import INDEX_NAME, CheckpointFiles, TensorInfo
from hebrus_torch.loading.model import QWEN4_TYPES
from hebrus_torch.moe.quantize import check_quant_options, quantize

from .rules import CATEGORIES, category_of, rule_name
from .writer import OutputTensor, ShardLayout, plan_shards, write_index

__all__ = ["convert", "ConvertError", "QUANT_METHOD", "DEFAULT_MAX_SHARD_BYTES"]

QUANT_METHOD = "hebrus_affine"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_SLICE_BYTES = 64 * 2**20          # fp32 working set of one slice of rows being quantized
_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)


class ConvertError(HebrusError):
    """The converter's refusal: bad options, a destination that exists, or a checkpoint it cannot convert.
    Raised before anything is written, or after the partial output was removed."""


@dataclass
class _Job:
    info: TensorInfo
    category: str | None          # None: copied as stored

    def outputs(self, bits: int, group_size: int) -> list[OutputTensor]:
        info = self.info
        if self.category is None:
            return [OutputTensor(info.key, info.dtype, info.shape)]
        out_dim, in_dim = info.shape
        stem = info.key[:-len("weight")]
        return [OutputTensor(info.key, torch.int32, (out_dim, in_dim * bits // 32)),
                OutputTensor(stem + "scales", info.dtype, (out_dim, in_dim // group_size)),
                OutputTensor(stem + "biases", info.dtype, (out_dim, in_dim // group_size))]


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, bits: int = 4, group_size: int = 64,
            quantize_lm_head: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write ``src`` (a Qwen4Exp checkpoint directory, as :func:`hebrus_torch.from_pretrained` reads) to ``dst``
    with its weights quantized (docs/quantization.md, "The checkpoint"); returns ``dst``.

    Args:
        bits: 4 or 8. group_size: 32, 64 or 128.
        quantize_lm_head: quantize ``lm_head`` too (an untied one).
        max_shard_bytes: the most data bytes per safetensors file (a larger single tensor gets its own file).

    Raises:
        ConvertError (a HebrusError): bad options, ``dst`` exists or its parent does not, ``src`` has no config
        or is not Qwen4Exp, is already quantized, holds float8 weights, or has routed experts whose input
        dimension is not a multiple of ``group_size``. ``CheckpointError`` for a broken ``src`` (from the loader's
        checks). Nothing is left at ``dst`` on failure.
    """
    try:
        check_quant_options(bits, group_size, op="convert")
    except HebrusError as exc:
        raise ConvertError(str(exc)) from None
    if max_shard_bytes <= 0:
        raise ConvertError(f"hebrus::convert: max_shard_bytes must be positive, got {max_shard_bytes}")
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        raise ConvertError(f"hebrus::convert: {dst} exists; give a new directory")
    if not dst.parent.is_dir():
        raise ConvertError(f"hebrus::convert: {dst.parent} (the destination's parent) is not a directory")
    if src.resolve() == dst.resolve():
        raise ConvertError(f"hebrus::convert: the source and the destination are the same ({src})")
    config = _read_config(src)
    files = CheckpointFiles.open(src)
    try:
        jobs, not_quantized = _plan(files, bits, group_size, quantize_lm_head)
        shards = plan_shards([job.outputs(bits, group_size) for job in jobs], max_shard_bytes)
        categories = [c for c in CATEGORIES if any(job.category == c for job in jobs)]
        config["quantization_config"] = {"quant_method": QUANT_METHOD, "mode": "affine", "bits": bits,
                                         "group_size": group_size, "quantized": categories,
                                         "not_quantized": not_quantized}
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
        try:
            _write_shards(tmp, shards, jobs, files, bits, group_size)
            write_index(tmp, shards)
            with open(tmp / "config.json", "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
            _copy_other_files(src, tmp)
            if dst.exists():
                raise ConvertError(f"hebrus::convert: {dst} appeared while converting; left as it is")
            os.rename(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        files.close()
    return dst


def _read_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not path.is_file():
        raise ConvertError(f"hebrus::convert: {src} has no config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as exc:
        raise ConvertError(f"hebrus::convert: {path} is not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("model_type") not in QWEN4_TYPES:
        model_type = config.get("model_type") if isinstance(config, dict) else None
        raise ConvertError(f"hebrus::convert: {path}: model_type {model_type!r}, not one of {QWEN4_TYPES}")
    nested = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if config.get("quantization_config") or nested.get("quantization_config"):
        raise ConvertError(f"hebrus::convert: {path} has a quantization_config: the checkpoint is already quantized")
    return config


def _plan(files: CheckpointFiles, bits: int, group_size: int,
          quantize_lm_head: bool) -> tuple[list[_Job], list[str]]:
    """Every stored tensor's job, in key order; and the projections kept for their input dimension."""
    jobs, not_quantized = [], []
    for key in sorted(files.tensors):
        info = files.tensors[key]
        text_name = rule_name(key)
        if text_name is not None and info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConvertError(f"hebrus::convert: {info.file}: {key!r} is stored as {info.dtype}: float8 checkpoints "
                               f"are not supported (convert from bf16, fp16 or fp32)")
        category = category_of(text_name, quantize_lm_head) if text_name is not None else None
        if category is not None:
            if info.dtype not in _QUANTIZABLE or len(info.shape) != 2:
                raise ConvertError(f"hebrus::convert: {info.file}: {key!r} ({info.dtype}, shape {list(info.shape)}) is "
                                   f"not a 2-D bf16/fp16/fp32 projection weight")
            if info.shape[1] % group_size:
                if category == "routed_experts":
                    raise ConvertError(f"hebrus::convert: {key!r} has input dimension {info.shape[1]}, not a multiple "
                                       f"of group_size {group_size}: the routed experts cannot be quantized (try a "
                                       f"smaller --group-size)")
                not_quantized.append(key)
                category = None
        jobs.append(_Job(info, category))
    return jobs, not_quantized


def _write_shards(directory: Path, shards: list[ShardLayout], jobs: list[_Job], files: CheckpointFiles, bits: int,
                  group_size: int) -> None:
    by_key = {job.info.key: job for job in jobs}
    for shard in shards:
        with open(directory / shard.name, "wb") as f:
            f.write(shard.header)
            for t in shard.tensors:
                job = by_key.get(t.key)
                if job is None:
                    continue        # a scales / biases tensor: written with its weight
                _write_job(f, shard, job, files, bits, group_size)
            f.truncate(shard.size)


def _write_job(f, shard: ShardLayout, job: _Job, files: CheckpointFiles, bits: int, group_size: int) -> None:
    info = job.info
    stored = files.tensor(info)
    if job.category is None:
        shard.write(f, info.key, stored)
    else:
        out_dim, in_dim = info.shape
        stem = info.key[:-len("weight")]
        step = max(1, _SLICE_BYTES // (4 * in_dim))
        words, groups = in_dim * bits // 32, in_dim // group_size
        for r0 in range(0, out_dim, step):
            wq, scales, biases = quantize(stored[r0:r0 + step], bits, group_size)
            shard.write(f, info.key, wq, r0 * words * 4)
            shard.write(f, stem + "scales", scales, r0 * groups * info.dtype.itemsize)
            shard.write(f, stem + "biases", biases, r0 * groups * info.dtype.itemsize)
    files.release(info)


def _copy_other_files(src: Path, dst: Path) -> None:
    """Every other file of the source (tokenizer, generation config, chat template ...), the weights' files,
    their index and config.json aside."""
    weights = {INDEX_NAME, "config.json"}
    for path in sorted(src.iterdir()):
        if path.name in weights or path.suffix == ".safetensors" or path.name.startswith("."):
            continue
        if path.is_file():
            shutil.copy2(path, dst / path.name)
        elif path.is_dir():
            shutil.copytree(path, dst / path.name)
