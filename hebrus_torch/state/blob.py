"""Saved-state format: plain tensor bytes plus JSON metadata, checksummed. No pickle.

Layout: ``MAGIC | u32 format version | u64 header length | header JSON | tensor bytes | sha256``,
little-endian; the sha256 covers everything before it. The header names the holder kind, its
metadata, and each tensor's dtype, shape, offset and byte length. ``unpack`` validates all of it
before building any tensor, so a blob from an untrusted file is safe to read: it either yields
exactly what ``pack`` was given or raises CorruptStateError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import reprlib
import struct
from typing import Any, BinaryIO

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
# An untrusted header is refused beyond these (a real one nests 4 deep and has 1-5 dimensions per tensor).
_MAX_DEPTH = 16
_MAX_DIMS = 16
# Elements times element size of every tensor's shape (with 0-length dimensions counted as 1) stays below
# this, so no size or stride computed from a shape can overflow int64.
_MAX_SPAN = 2**62


def short(value: Any) -> str:
    """``repr`` of decoded, untrusted data for an error message: bounded in depth and length, never raising."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, 60, 60, 40
    try:
        return r.repr(value)
    except Exception:  # noqa: BLE001 (an object whose repr fails is described by its type)
        return f"<{type(value).__name__}>"


def same(value: Any, expected: Any) -> bool:
    """``value == expected`` for JSON-like data, with exact types: JSON true/false is not 1/0, 1.0 is not 1.

    Recurses only as deep as ``expected`` (the holder's own, shallow metadata), so a deeply nested
    untrusted ``value`` cannot exhaust the stack."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(same(value[k], expected[k]) for k in expected)
    if isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(same(v, e) for v, e in zip(value, expected))
    return value == expected


def _too_deep(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor in C order (any dtype, any device)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


@dataclasses.dataclass(frozen=True)
class Unpacked:
    """A blob's contents taken out of a holder but not serialised yet: ``pack()`` gives the bytes that
    ``pack(kind, meta, tensors)`` gives, and may run on another thread (the prompt cache's writer), since the
    tensors are the holder's copies on the CPU, never views of its live pools. A tensor given as an
    ``Unpacked`` is packed first and stored as its blob's bytes (uint8), as a ModelCache nests its holders'."""

    kind: str
    meta: dict[str, Any]
    tensors: dict[str, "torch.Tensor | Unpacked"]

    @classmethod
    def of(cls, kind: str, meta: dict[str, Any], tensors: dict[str, "torch.Tensor | Unpacked"]) -> "Unpacked":
        """Taken now: device tensors are read to the CPU on the caller's thread (a device wait belongs to it)."""
        return cls(kind, meta, {n: t if isinstance(t, Unpacked) else t.detach().to("cpu") for n, t in tensors.items()})

    def pack(self) -> bytes:
        return pack(self.kind, self.meta, {n: torch.frombuffer(bytearray(t.pack()), dtype=torch.uint8)
                                           if isinstance(t, Unpacked) else t for n, t in self.tensors.items()})


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
    pieces = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header, *chunks]
    h = hashlib.sha256()
    for piece in pieces:      # (one copy of the payload, into the result: the body is not built twice)
        h.update(piece)
    return b"".join(pieces + [h.digest()])


def _header_length(head: bytes, kind: str) -> int:
    """The header length a blob's prefix records, after checking its magic number and format version."""
    magic, version, header_len = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise CorruptStateError(f"{kind} blob has a wrong magic number (not a hebrus_torch saved state)")
    if version != FORMAT_VERSION:
        raise CorruptStateError(f"{kind} blob has format version {version}; this build reads {FORMAT_VERSION}")
    return header_len


def _header(raw: bytes, kind: str) -> tuple[Any, Any]:
    """(meta, tensor entries) of a blob's JSON header, its structure checked (CorruptStateError)."""
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, or an integer of more digits than Python converts.
        raise CorruptStateError(f"{kind} blob header is not valid JSON: {short(str(exc))}") from None
    if _too_deep(header, _MAX_DEPTH):
        raise CorruptStateError(f"{kind} blob header nests deeper than {_MAX_DEPTH} levels")
    if not isinstance(header, dict) or not same(header.get("kind"), kind):
        got = header.get("kind") if isinstance(header, dict) else None
        raise CorruptStateError(f"blob holds {short(got)} state, expected {kind!r}")
    meta, entries = header.get("meta"), header.get("tensors")
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise CorruptStateError(f"{kind} blob header lacks meta or tensors")
    return meta, entries


def unpack(blob: bytes, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Validate and decode a blob of ``kind``. Raises CorruptStateError naming what is wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptStateError(f"{kind} blob must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _PREFIX.size + _DIGEST:
        raise CorruptStateError(f"{kind} blob is truncated: {len(blob)} bytes")
    header_len = _header_length(blob, kind)
    body, digest = memoryview(blob)[:-_DIGEST], blob[-_DIGEST:]    # (a view: the payload is copied once, below)
    if hashlib.sha256(body).digest() != digest:
        raise CorruptStateError(f"{kind} blob checksum mismatch: truncated or modified")
    payload_start = _PREFIX.size + header_len
    if payload_start > len(body):
        raise CorruptStateError(f"{kind} blob header length {header_len} exceeds the blob")
    meta, entries = _header(bytes(body[_PREFIX.size:payload_start]), kind)
    payload = body[payload_start:]
    tensors: dict[str, torch.Tensor] = {}
    end = 0
    for entry in entries:
        if not (isinstance(entry, dict) and {"name", "dtype", "shape", "offset", "nbytes"} <= entry.keys()):
            raise CorruptStateError(f"{kind} blob has a malformed tensor entry: {short(entry)}")
        name, dtype_name, shape = entry["name"], entry["dtype"], entry["shape"]
        offset, nbytes = entry["offset"], entry["nbytes"]
        if not (isinstance(name, str) and isinstance(dtype_name, str)) or dtype_name not in _DTYPES or name in tensors:
            raise CorruptStateError(f"{kind} blob tensor {short(name)} has a bad name or dtype {short(dtype_name)}")
        dtype = _DTYPES[dtype_name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(type(s) is int and s >= 0 for s in shape)
                and math.prod(max(s, 1) for s in shape) * itemsize < _MAX_SPAN):
            raise CorruptStateError(f"{kind} blob tensor {short(name)} has a bad shape {short(shape)} (at most "
                                    f"{_MAX_DIMS} non-negative integer dimensions spanning under 2**62 bytes)")
        expected = math.prod(shape) * itemsize
        if not (type(offset) is int and type(nbytes) is int) or nbytes != expected or offset != end:
            raise CorruptStateError(f"{kind} blob tensor {short(name)}: {short(nbytes)} bytes at {short(offset)}, "
                                    f"expected {expected} bytes at {end}")
        end = offset + nbytes
        if end > len(payload):
            raise CorruptStateError(f"{kind} blob tensor {short(name)} runs past the end of the blob")
        raw = bytearray(payload[offset:end])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dtype).reshape(shape).clone()
    if end != len(payload):
        raise CorruptStateError(f"{kind} blob has {len(payload) - end} unexpected trailing bytes")
    return meta, tensors


def peek(f: BinaryIO, kind: str, size: int) -> tuple[dict[str, Any], int]:
    """The metadata of a blob of ``kind`` read from the binary file ``f`` (at its start, ``size`` bytes
    long), and the length the whole blob must have, from its prefix and header only: what an index reads
    without loading the tensors. Nothing is checksummed here (``unpack`` of the whole blob still validates
    everything). CorruptStateError if the prefix or header is wrong or runs past ``size``."""
    head = f.read(_PREFIX.size)
    if len(head) < _PREFIX.size:
        raise CorruptStateError(f"{kind} blob is truncated: {len(head)} bytes")
    header_len = _header_length(head, kind)
    if _PREFIX.size + header_len + _DIGEST > size:
        raise CorruptStateError(f"{kind} blob header length {header_len} exceeds the blob ({size} bytes)")
    meta, entries = _header(f.read(header_len), kind)
    sizes = [e.get("nbytes") if isinstance(e, dict) else None for e in entries]
    if not all(type(n) is int and n >= 0 for n in sizes):
        raise CorruptStateError(f"{kind} blob has a malformed tensor entry")
    return meta, _PREFIX.size + header_len + sum(sizes) + _DIGEST


def known_entries(kind: str, state_dict: dict, expected: set, strict: bool) -> tuple[dict, list]:
    """The entries of ``state_dict`` named in ``expected``, and the names of the others: with ``strict``
    those are refused (CorruptStateError naming them), else left out and returned, as torch reports them.

    Loaded through a parent module a holder always checks strictly: torch's recursion passes
    ``strict=True`` to every ``_load_from_state_dict`` and decides only after everything is loaded."""
    unexpected = sorted((k for k in state_dict if k not in expected), key=str)
    if unexpected and strict:
        raise CorruptStateError(f"{kind}: unexpected key(s) {short(unexpected)} in the state dict (strict=True; "
                                f"load_state_dict(..., strict=False) leaves them out)")
    return {k: v for k, v in state_dict.items() if k in expected}, unexpected


def check_tensors(kind: str, entries: dict[str, Any]) -> None:
    """CorruptStateError unless every entry of an untrusted state dict is a dense tensor holding data, of a
    dtype saved state uses: run it before anything reads an entry's bytes (a checksum), shape or values,
    so a non-tensor, a meta or sparse tensor, or an exotic dtype is refused, never crashes a read."""
    for name, t in sorted(entries.items(), key=lambda kv: str(kv[0])):
        expect(kind, isinstance(t, torch.Tensor), f"entry {short(name)} must be a tensor, got {type(t).__name__}")
        expect(kind, t.layout == torch.strided and not t.is_meta and t.device.type != "meta",
               f"entry {short(name)} must be a dense tensor holding data, got a {t.layout} tensor on {t.device}")
        expect(kind, t.dtype in _NAMES, f"entry {short(name)} has dtype {t.dtype}, which saved state never uses")


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
