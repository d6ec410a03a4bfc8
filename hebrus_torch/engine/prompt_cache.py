"""A prompt cache that survives restarts: kept prefixes as files in one directory (issue 27).

Each file holds one finished request's state at its frontier (every holder of the ModelCache: QSA
cells and K/V, PLE history and tails, GDN state and conv tails, as ``ModelCache.save`` writes them)
with the tokens it is the state after. A later request whose prompt starts with those tokens is
restored from the file and prefills only the rest, in this process or the next one.

File format: two ``hebrus_torch.state.blob``s back to back (each: magic, blob format version, JSON
header, raw bytes, sha256 over all of it; no pickle). The first, of kind
``hebrus_torch.PromptCacheEntry`` and without tensors, is the entry's header: the entry format
``version``, the ``fingerprint`` of the model and holders it was written for (:func:`fingerprint`),
the ``tokens``, and the length and trailing sha256 of the second, the ModelCache blob
(``ModelCache.save``), which ``ModelCache.restore`` verifies. The file is named by a hash of
fingerprint and tokens and written atomically (a temporary file in the directory, fsync,
``os.replace``).

On start the directory is scanned: each file's prefix and header are read (not its payload) and
checked (kind, versions, fingerprint, name, length); the whole file's checksums are verified when it
is restored. A file that fails any check is skipped with one warning per file and process naming it
and why: it is never restored, never raises into a request and never changes an answer (the request
is prefilled as if the file were absent). Unusable files stay on disk (another model's files may
share the directory) but count against the size cap and are the first evicted.

Size cap: the entry files together stay within ``max_bytes``; writing evicts least recently used
files first (unusable ones before any). Use is recorded in the files' modification times (set on each
write and restore), so the order survives restarts.

Writes happen off the caller's thread: :meth:`PromptCacheStore.put_later` takes the state (the engine copies
it out of the cache on its own thread, ``ModelCache.save_unpacked``) and the store's thread serialises,
checksums and writes it, so a running stream waits neither for the disk nor for the hashing;
:meth:`PromptCacheStore.prefetch` reads a file there ahead of the ``read`` that a request's restore will do.
Everything that reads the store waits for the pending writes it could see: ``lookup`` for those whose
tokens could match, the other queries (``len``, ``total_bytes``, ``entries``, ``clear``, ``close``) and
:meth:`PromptCacheStore.flush` for all; the answers are those of writing at once.

One engine process per directory: the store holds an exclusive ``flock`` on ``DIR/LOCK`` while open
(where ``fcntl`` exists); a second store on the same directory, in this process or another, is refused
with a ``HebrusError`` naming the holder's pid until :meth:`PromptCacheStore.close`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import threading
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import CorruptStateError, HebrusError
from ..state import blob

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock (one process per directory is then the user's rule)
    fcntl = None

__all__ = ["PromptCacheStore", "StoredPrefix", "fingerprint", "check_directory", "KIND", "VERSION", "SUFFIX"]

KIND = "hebrus_torch.PromptCacheEntry"
VERSION = 2
SUFFIX = ".hpc"
LOCK_NAME = "LOCK"
_TMP_PREFIX = ".tmp-"
_SAMPLES = 64          # values of each parameter the fingerprint reads (evenly spaced)
_PREFETCHED = 4        # blobs read ahead and not yet taken that the store holds
_WARNED: set[str] = set()   # files this process has warned about (one warning per file and process)

COUNTERS = ("hits", "misses", "hit_tokens", "writes", "evictions", "skipped_files", "write_errors", "write_seconds")


@dataclass
class StoredPrefix:
    """One usable entry of the store: the state after ``tokens``, in ``path``."""

    path: Path
    tokens: tuple[int, ...]
    nbytes: int
    last_used: float
    chunk_extent: int = 0      # the writer's chunk extent (engine: the alignment rule), 0 without one


def fingerprint(model: torch.nn.Module, cache: Any) -> str:
    """sha256 hex naming what a saved state is valid for: the entry and blob format versions, the
    hebrus_torch version, the text model's config (without its path and transformers version), every
    holder's per-sequence config (dtypes, shapes, the QSA window), and each parameter's name, dtype,
    shape and 64 evenly spaced values (two checkpoints of one config differ there)."""
    import hebrus_torch

    from .runner import find_text_model

    text = find_text_model(model)
    config = {k: v for k, v in text.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version",)}
    holders = {}
    if getattr(cache, "qsa", None) is not None:
        holders["qsa"] = dict(cache.qsa._seq_config(), window=getattr(cache.qsa, "window", None))
    if getattr(cache, "ple", None) is not None:
        holders["ple"] = cache.ple._seq_config_meta()
    if getattr(cache, "gdn", None) is not None:
        holders["gdn"] = cache.gdn._seq_config_meta()
    h = hashlib.sha256()
    h.update(json.dumps({"entry_version": VERSION, "blob_version": blob.FORMAT_VERSION,
                         "hebrus_torch": hebrus_torch.__version__, "config": config, "holders": holders},
                        sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            h.update(f"\0{name}:{p.dtype}:{list(p.shape)}".encode())
            if flat.numel():
                idx = torch.linspace(0, flat.numel() - 1, min(flat.numel(), _SAMPLES)).round().long()
                h.update(blob.tensor_bytes(flat[idx.to(flat.device)]))
    return h.hexdigest()


def _warn_once(path: Path, why: str) -> None:
    key = str(path)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"hebrus prompt cache: skipping {path}: {why}", RuntimeWarning, stacklevel=3)


class PromptCacheStore:
    """The directory store of kept prefixes (see the module docstring).

    Args:
        directory: created if missing; one engine process at a time.
        fingerprint: :func:`fingerprint` of the model and cache the states are restored into.
        max_bytes: the entry files together stay within this many bytes.
        counters: an object with int attributes ``prompt_cache_<name>`` for each name in ``COUNTERS``
            (the engine's counters), or None for the store's own.

    Raises:
        HebrusError: another store holds the directory, or it cannot be created.
    """

    def __init__(self, directory: str | os.PathLike, fingerprint: str, max_bytes: int, counters: Any = None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise HebrusError(f"PromptCacheStore: max_bytes must be an int >= 1, got {max_bytes!r}")
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.counters = counters if counters is not None else types.SimpleNamespace(
            **{f"prompt_cache_{n}": 0 for n in COUNTERS})
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise HebrusError(f"prompt cache: cannot create the directory {self.directory}: {err}") from None
        self._lock = _lock(self.directory)
        self._entries: dict[str, StoredPrefix] = {}          # file name -> usable entry
        self._unusable: dict[str, tuple[int, float]] = {}    # file name -> (bytes, mtime): skipped files
        self._mutex = threading.Condition(threading.RLock())  # the two maps, the counters, the queue
        self._queue: collections.deque[tuple[tuple[int, ...], bytes | blob.Unpacked, int] | StoredPrefix] = collections.deque()
        """put_later's writes (tokens, blob, chunk extent) and prefetch's reads, in order"""
        self._prefetched: dict[str, bytes] = {}               # file name -> blob read ahead, oldest first
        self._writer: threading.Thread | None = None         # runs while the queue is not empty
        self._scan()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        self.flush()
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        """Bytes of every entry file of the directory (usable or not)."""
        self.flush()
        return self._total_bytes()

    def _total_bytes(self) -> int:
        with self._mutex:
            return sum(e.nbytes for e in self._entries.values()) + sum(n for n, _ in self._unusable.values())

    def entries(self) -> list[StoredPrefix]:
        """The usable entries, least recently used first."""
        self.flush()
        return sorted(self._entries.values(), key=lambda e: e.last_used)

    def lookup(self, tokens: Sequence[int], max_tokens: int, min_tokens: int = 1,
               accept: Callable[[StoredPrefix], bool] | None = None) -> StoredPrefix | None:
        """The longest usable entry whose tokens are the first n of ``tokens``, min_tokens <= n <= max_tokens
        (and that ``accept`` takes, where given). A pending write that could be such an entry is waited for."""
        self.flush(lambda t: min_tokens <= len(t) <= min(max_tokens, len(tokens)) and tuple(tokens[:len(t)]) == t)
        with self._mutex:
            return self._lookup(tokens, max_tokens, min_tokens, accept)

    def _lookup(self, tokens, max_tokens, min_tokens, accept) -> StoredPrefix | None:
        best = None     # (the first and last tokens reject most entries before the prefix is compared)
        for entry in self._entries.values():
            n = len(entry.tokens)
            if min_tokens <= n <= max_tokens and (best is None or n > len(best.tokens)) and len(tokens) >= n \
                    and tokens[n - 1] == entry.tokens[-1] and tokens[0] == entry.tokens[0] \
                    and tuple(tokens[:n]) == entry.tokens and (accept is None or accept(entry)):
                best = entry
        return best

    def read(self, entry: StoredPrefix) -> bytes | None:
        """The ModelCache blob of ``entry`` after checking the file's header (whose checksum binds the
        blob's own), or None (the file is then skipped with its one warning and no longer offered).
        ``ModelCache.restore`` verifies the blob itself. What :meth:`prefetch` read is taken (waited for
        while it is being read) instead of reading the file here."""
        name = entry.path.name
        with self._mutex:       # (the store thread's evictions wait: the file stays while it is read)
            while True:         # a read ahead still queued behind writes is done here instead; one under way is waited for
                at = next((i for i, item in enumerate(self._queue)
                           if isinstance(item, StoredPrefix) and item.path.name == name), None)
                if at is None:
                    break
                if at > 0:
                    del self._queue[at]
                    break
                self._mutex.wait()
            data = self._prefetched.pop(name, None)
            if data is not None and name in self._entries:
                self.touch(entry)
                return data
            return self._read(entry)

    def prefetch(self, entry: StoredPrefix) -> None:
        """Read ``entry``'s file on the store's thread, for a :meth:`read` to come (a request that will be
        restored from it); the last few reads are held until taken."""
        with self._mutex:
            name = entry.path.name
            if name in self._prefetched or any(isinstance(item, StoredPrefix) and item.path.name == name
                                               for item in self._queue):
                return
            self._enqueue(entry)

    def _read(self, entry: StoredPrefix) -> bytes | None:
        try:
            state = self._load(entry)
        except (OSError, CorruptStateError) as err:
            self.skip(entry, str(err))
            return None
        self.touch(entry)
        return state

    def _load(self, entry: StoredPrefix) -> bytes:
        """The checked blob of ``entry``'s file (OSError, CorruptStateError otherwise)."""
        meta, state = decode(entry.path.read_bytes())
        problem = self._meta_problem(meta, entry.path.name)
        if problem is None and tuple(meta["tokens"]) != entry.tokens:
            problem = "its tokens changed since the directory was scanned"
        if problem is not None:
            raise CorruptStateError(problem)
        return state

    # ------------------------------------------------------------------ changes
    def put_later(self, tokens: Sequence[int], state: bytes | blob.Unpacked, chunk_extent: int = 0) -> None:
        """:meth:`put` on the store's thread (the caller does not wait for the disk; a ``blob.Unpacked`` state is
        packed there too); its outcome is counted (``writes``, ``write_errors``) as put's is."""
        self._enqueue((tuple(int(t) for t in tokens), state, int(chunk_extent)))

    def _enqueue(self, item: tuple[tuple[int, ...], bytes | blob.Unpacked, int] | StoredPrefix) -> None:
        with self._mutex:
            self._queue.append(item)
            if self._writer is None:
                self._writer = threading.Thread(target=self._drain, name="hebrus-prompt-cache-io", daemon=True)
                self._writer.start()

    def flush(self, matching: Callable[[tuple[int, ...]], bool] | None = None) -> None:
        """Wait until the store's thread is done (with ``matching``: the pending writes whose tokens it takes)."""
        with self._mutex:
            while (self._queue if matching is None else
                   any(matching(item[0]) for item in self._queue if not isinstance(item, StoredPrefix))):
                self._mutex.wait()

    def _drain(self) -> None:
        while True:
            with self._mutex:
                if not self._queue:
                    self._writer = None
                    return
                item = self._queue[0]
            t0 = time.perf_counter()
            try:
                if isinstance(item, StoredPrefix):
                    self._fetch(item)
                else:
                    tokens, state, extent = item
                    self.put(tokens, state.pack() if isinstance(state, blob.Unpacked) else state, extent)
            except Exception:  # noqa: BLE001 - never expected (put counts its own OSError); a write is never fatal
                self._count("write_errors")
            finally:
                with self._mutex:
                    if not isinstance(item, StoredPrefix):
                        self._count("write_seconds", time.perf_counter() - t0)
                    self._queue.popleft()
                    self._mutex.notify_all()

    def _fetch(self, entry: StoredPrefix) -> None:
        """A prefetch: the blob kept for :meth:`read` (nothing if the file fails: read tries it again and skips
        it there, with its warning)."""
        try:
            data = self._load(entry)
        except (OSError, CorruptStateError):
            return
        with self._mutex:
            self._prefetched[entry.path.name] = data
            while len(self._prefetched) > _PREFETCHED:
                del self._prefetched[next(iter(self._prefetched))]

    def put(self, tokens: Sequence[int], state: bytes, chunk_extent: int = 0) -> bool:
        """Write the state after ``tokens`` (a ModelCache blob; ``chunk_extent``: the writer's, see
        :class:`StoredPrefix`); False if it was not written (larger than the cap, or the write failed: one
        warning, counted in ``write_errors``)."""
        tokens = tuple(int(t) for t in tokens)
        name = self._name(tokens)
        head = encode_header({"version": VERSION, "fingerprint": self.fingerprint, "tokens": list(tokens),
                              "chunk_extent": int(chunk_extent)}, state)
        nbytes = len(head) + len(state)
        if nbytes > self.max_bytes:
            return False
        with self._mutex:
            self._forget(name)
            while self._total_bytes() + nbytes > self.max_bytes and self._evict_one():
                pass
        path = self.directory / name
        tmp = self.directory / f"{_TMP_PREFIX}{name}.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(state)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.directory)
        except OSError as err:
            self._count("write_errors")
            _warn_once(path, f"cannot write it: {err}")
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        now = time.time()
        with self._mutex:
            self._entries[name] = StoredPrefix(path, tokens, nbytes, now, int(chunk_extent))
            self._count("writes")
        return True

    def note_write_error(self) -> None:
        """Count a state that could not be taken for writing (the caller's ``ModelCache.save`` refused)."""
        self._count("write_errors")

    def touch(self, entry: StoredPrefix) -> None:
        """Record a use of ``entry`` (it moves to the back of the eviction order, here and on disk)."""
        entry.last_used = time.time()
        with contextlib.suppress(OSError):
            os.utime(entry.path, (entry.last_used, entry.last_used))

    def skip(self, entry: StoredPrefix, why: str) -> None:
        """Stop offering ``entry`` (its file failed a check): one warning, counted in ``skipped_files``."""
        name = entry.path.name
        with self._mutex:
            if self._entries.pop(name, None) is None:
                return
            self._unusable[name] = (entry.nbytes, 0.0)
            self._count("skipped_files")
        _warn_once(entry.path, why)

    def clear(self) -> int:
        """Delete every entry file (usable or not); returns how many."""
        self.flush()
        self._prefetched.clear()
        names = list(self._entries) + list(self._unusable)
        for name in names:
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()
        self._entries.clear()
        self._unusable.clear()
        return len(names)

    def close(self) -> None:
        """Wait for the pending writes and release the directory (idempotent)."""
        if getattr(self, "_mutex", None) is not None:
            self.flush()
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.close()

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _count(self, name: str, n: float = 1) -> None:
        attr = f"prompt_cache_{name}"
        with self._mutex:       # (the store's thread counts too)
            setattr(self.counters, attr, getattr(self.counters, attr) + n)

    def _name(self, tokens: tuple[int, ...]) -> str:
        h = hashlib.sha256(self.fingerprint.encode() + b"\0" + json.dumps(list(tokens)).encode())
        return h.hexdigest()[:40] + SUFFIX

    def _meta_problem(self, meta: dict, name: str) -> str | None:
        """Why an entry's metadata makes it unusable here (None if it is usable)."""
        version = meta.get("version")
        if not blob.same(version, VERSION):
            return f"entry format version {blob.short(version)}; this build reads {VERSION}"
        if not blob.same(meta.get("fingerprint"), self.fingerprint):
            return (f"written for another model, config or hebrus_torch build (fingerprint "
                    f"{blob.short(meta.get('fingerprint'))}, this engine's {self.fingerprint[:16]}...)")
        tokens = meta.get("tokens")
        if not (isinstance(tokens, list) and tokens and all(type(t) is int and t >= 0 for t in tokens)):
            return "its tokens are not a non-empty list of token ids"
        size, digest = meta.get("state_bytes"), meta.get("state_sha256")
        if not (type(size) is int and size >= 0 and isinstance(digest, str)):
            return "its header lacks the state's length and checksum"
        if name != self._name(tuple(tokens)):
            return "its name does not match its tokens"
        extent = meta.get("chunk_extent")
        if not (type(extent) is int and extent >= 0):
            return "its header lacks the writer's chunk extent"
        return None

    def _scan(self) -> None:
        for path in sorted(self.directory.iterdir()):
            name = path.name
            if name.startswith(_TMP_PREFIX):     # a write cut short (a crash): never renamed into place
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if not name.endswith(SUFFIX) or not path.is_file():
                continue
            st = None
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    meta, head = blob.peek(f, KIND, st.st_size)
                problem = self._meta_problem(meta, name)
                if problem is None and head + meta["state_bytes"] != st.st_size:
                    problem = (f"truncated or extended: {st.st_size} bytes, its header says "
                               f"{head + meta['state_bytes']}")
            except (OSError, CorruptStateError) as err:
                problem = str(err)
            if problem is None:
                self._entries[name] = StoredPrefix(path, tuple(meta["tokens"]), st.st_size, st.st_mtime,
                                                   meta["chunk_extent"])
            else:
                self._unusable[name] = (st.st_size if st is not None else 0, st.st_mtime if st is not None else 0.0)
                self._count("skipped_files")
                _warn_once(path, problem)
        while self.total_bytes > self.max_bytes and self._evict_one():
            pass

    def _forget(self, name: str) -> None:
        self._entries.pop(name, None)
        self._unusable.pop(name, None)

    def _evict_one(self) -> bool:
        """Delete the least recently used file, unusable ones first; False if there is none."""
        if self._unusable:
            name = min(self._unusable, key=lambda n: self._unusable[n][1])
            self._unusable.pop(name)
        elif self._entries:
            name = min(self._entries, key=lambda n: self._entries[n].last_used)
            self._entries.pop(name)
        else:
            return False
        with contextlib.suppress(OSError):
            (self.directory / name).unlink()
        self._count("evictions")
        return True


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every platform opens directories)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def encode_header(meta: dict[str, Any], state: bytes) -> bytes:
    """The header blob of an entry file whose ModelCache blob is ``state`` (``meta``: version,
    fingerprint, tokens; the state's length and trailing sha256 are added)."""
    meta = dict(meta, state_bytes=len(state), state_sha256=bytes(state[-32:]).hex())
    return blob.pack(KIND, meta, {})


def decode(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header metadata, ModelCache blob) of an entry file's bytes, the header's checksum verified and the
    blob's length and trailing checksum matched against it; CorruptStateError naming what is wrong."""
    meta, head = blob.peek(io.BytesIO(data), KIND, len(data))
    meta, tensors = blob.unpack(data[:head], KIND)
    blob.expect(KIND, not tensors, f"the header holds tensors {sorted(tensors)}")
    state = data[head:]
    size, digest = meta.get("state_bytes"), meta.get("state_sha256")
    blob.expect(KIND, size == len(state), f"truncated or extended: the state has {len(state)} bytes, its "
                                          f"header says {blob.short(size)}")
    blob.expect(KIND, len(state) >= 32 and digest == state[-32:].hex(),
                "the state's checksum differs from the one its header recorded")
    return meta, state


def check_directory(directory: str | os.PathLike) -> str | None:
    """Why a store could not open ``directory`` now (it cannot be created, or another engine holds
    it), or None: a server's check at start, before its engine (built on the first request) opens it."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        _lock(Path(directory)).close()
    except (OSError, HebrusError) as err:
        return str(err)
    return None


def _lock(directory: Path):
    """An open file holding an exclusive flock on DIR/LOCK, with this process's pid in it."""
    path = directory / LOCK_NAME
    try:
        f = open(path, "a+")
    except OSError as err:
        raise HebrusError(f"prompt cache: cannot open {path}: {err}") from None
    if fcntl is None:
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        owner = f.read().strip() or "?"
        f.close()
        raise HebrusError(f"prompt cache: {directory} is in use by another engine (pid {owner}); one engine "
                          f"process per directory (close the other engine or give this one another "
                          f"directory)") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f
