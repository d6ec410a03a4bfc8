"""Saved-state format: plain tensor bytes plus JSON metadata, checksummed. No pickle.

Layout: ``MAGIC | u32 format version | u64 header length | header JSON | tensor bytes | sha256``,
little-endian; the sha256 covers everything before it. The header names the holder kind, its
metadata, and each tensor's dtype, shape, offset and byte length. ``unpack`` validates all of it
before building any tensor, so a blob from an untrusted file is safe to read: it either yields
exactly what ``pack`` was given or raises CorruptStateError.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import Any

import torch

from ..errors import CorruptStateError

MAGIC = b"HEBRUSv1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ")
_DIGEST = 32
_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "uint8": torch.uint8,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor in C order (any dtype, any device)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def pack(kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    entries, chunks, offset = [], [], 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise TypeError(f"pack: unsupported dtype {t.dtype} for {name}")
        data = tensor_bytes(t)
        entries.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "offset": offset, "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    header = json.dumps({"kind": kind, "meta": meta, "tensors": entries}, sort_keys=True).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + b"".join(chunks)
    return body + hashlib.sha256(body).digest()


def unpack(blob: bytes, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Validate and decode a blob of ``kind``. Raises CorruptStateError naming what is wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptStateError(f"{kind} blob must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _PREFIX.size + _DIGEST:
        raise CorruptStateError(f"{kind} blob is truncated: {len(blob)} bytes")
    magic, version, header_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptStateError(f"{kind} blob has a wrong magic number (not a hebrus_torch saved state)")
    if version != FORMAT_VERSION:
        raise CorruptStateError(f"{kind} blob has format version {version}; this build reads {FORMAT_VERSION}")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptStateError(f"{kind} blob checksum mismatch: truncated or modified")
    payload_start = _PREFIX.size + header_len
    if payload_start > len(body):
        raise CorruptStateError(f"{kind} blob header length {header_len} exceeds the blob")
    try:
        header = json.loads(body[_PREFIX.size:payload_start].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStateError(f"{kind} blob header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("kind") != kind:
        got = header.get("kind") if isinstance(header, dict) else None
        raise CorruptStateError(f"blob holds {got!r} state, expected {kind!r}")
    meta, entries = header.get("meta"), header.get("tensors")
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise CorruptStateError(f"{kind} blob header lacks meta or tensors")
    payload = body[payload_start:]
    tensors: dict[str, torch.Tensor] = {}
    end = 0
    for entry in entries:
        try:
            name, dtype_name, shape = entry["name"], entry["dtype"], entry["shape"]
            offset, nbytes = entry["offset"], entry["nbytes"]
        except (TypeError, KeyError):
            raise CorruptStateError(f"{kind} blob has a malformed tensor entry: {entry!r}") from None
        if dtype_name not in _DTYPES or not isinstance(name, str) or name in tensors:
            raise CorruptStateError(f"{kind} blob tensor {name!r} has a bad name or dtype {dtype_name!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise CorruptStateError(f"{kind} blob tensor {name!r} has a bad shape {shape!r}")
        dtype = _DTYPES[dtype_name]
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not (isinstance(offset, int) and isinstance(nbytes, int)) or nbytes != expected or offset != end:
            raise CorruptStateError(f"{kind} blob tensor {name!r}: {nbytes} bytes at {offset}, "
                                    f"expected {expected} bytes at {end}")
        end = offset + nbytes
        if end > len(payload):
            raise CorruptStateError(f"{kind} blob tensor {name!r} runs past the end of the blob")
        raw = bytearray(payload[offset:end])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dtype).reshape(shape).clone()
    if end != len(payload):
        raise CorruptStateError(f"{kind} blob has {len(payload) - end} unexpected trailing bytes")
    return meta, tensors


def expect(kind: str, cond: bool, what: str) -> None:
    """Raise CorruptStateError(what) unless cond: one line for each validation of decoded state."""
    if not cond:
        raise CorruptStateError(f"{kind}: {what}")


def digest_of(parts: list[tuple[str, Any]]) -> str:
    """sha256 hex of named parts (tensors as raw bytes, anything else as its JSON)."""
    h = hashlib.sha256()
    for name, value in parts:
        h.update(name.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            h.update(f"{_NAMES.get(value.dtype, str(value.dtype))}{list(value.shape)}".encode())
            h.update(tensor_bytes(value))
        else:
            h.update(json.dumps(value, sort_keys=True).encode())
    return h.hexdigest()
