"""QSACache: per-sequence contiguous runs over physical cells, raw indexer keys, optional K/V planes and
the pooled groups derived from them (SPEC §3–§5).

Model
-----
* A pool of ``capacity`` physical **cells**. ``cell_pos[c]`` is the logical position held by cell ``c``
  (``-1`` when free) and ``cell_ref[c]`` how many sequences reference it (cells are shared after
  ``copy``/``fork``, llama.cpp-style; a sequence that appends gets fresh cells for its new tokens, and a
  ``shift`` of shared cells copies them first).
* Per attention layer: raw indexer keys ``keys[l] [capacity, D]`` and, when configured, the main
  attention planes ``k_cache[l] [capacity, Hkv, Dh]`` and ``v_cache[l] [capacity, Hkv, Dv]``.
* Per sequence (addressed by :class:`SeqHandle`) one contiguous run of positions ``[p0, p0 + n)``:
  its cells in position order and the pooled-group rows of its ``n // r`` complete groups, anchored at
  ``p0``. Group ``g`` covers positions ``[p0 + r*g, p0 + r*g + r)``. Grouping is by logical position,
  never by physical adjacency: cells may be anywhere in the pool, in any order.
* Pooled groups live in a row pool ``pooled[l] [group_capacity, D]`` shared by all layers'
  bookkeeping (a group row index means the same group in every layer); rows are refcounted, because
  ``copy``/``fork`` share them too. The row pool grows on demand (it is derived state, never a reason
  for a ``CapacityError``).

Appends only ever pool the groups they complete (O(1) pooled work per appended token). Any
operation that moves the anchor by a number of positions that is not a multiple of ``r`` (remove a
prefix, ``shift``, ``restore``, window eviction) rebuilds that sequence's groups for all layers; moving
it by a multiple of ``r`` keeps the surviving groups (their pooled keys depend only on their tokens and
absolute positions, so they equal a rebuild bitwise).

Transactions
------------
Every mutating method runs inside a transaction (its own one via ``atomic`` when none is open)
and inside a savepoint: all changes to bookkeeping tensors and to content that is visible to
``digest()`` go through an undo log, so a failing operation — even in the middle of a user's
transaction — leaves the holder bitwise as it was (``digest()`` unchanged), and a rolled-back
transaction restores the pre-block state. Cells reserved in a transaction are *unwritten* per layer
until ``write`` fills them; groups that contain unwritten cells are *pending* for that layer and are
pooled by the ``write`` that completes them. ``digest()`` treats unwritten keys and pending groups as
zeros. At commit, any cell still unwritten for a layer is zero-filled and its pending groups pooled,
so a committed holder never holds uninitialised data; this runs before any holder of the block
publishes (``_txn_prepare``), so a kernel that refuses there rolls the whole block back.

State and devices
-----------------
``save``/``restore`` move one sequence (raw keys, K/V, positions; pooled groups are rebuilt on
restore); ``state_dict``/``load_state_dict`` the whole holder (plain tensors plus JSON-like
``_extra_state`` with a sha256; ``check_state_dict``/``publish_state_dict`` split validation from
publishing for a ModelCache). Pooled groups are always re-derived where they are published: on
restore, on load and after ``.to(device/dtype)``, so they equal a full rebuild on the device they
live on. Positions are 1-D text positions (Qwen4Exp's multimodal 3-D positions are not supported).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import CapacityError, CorruptStateError, HebrusError, HoleError, NonSuccessorError
from ..state import blob as _blob
from ..state.args import as_int, check_cast
from ..state.handles import SeqHandle, SlotTable, generation_problem
from ..state.transaction import Transactional, atomic
from .ops import qsa_pool, qsa_select

__all__ = ["QSACache", "QSAPlan", "ReservedChunk", "HoleInSavedStateError"]

_SEQ_KIND = "hebrus_torch.QSACache.sequence"
# Positions are int64: a run may reach, never pass, the largest one.
MAX_POSITION = 2**63 - 1
_HOLDER_FORMAT = "hebrus_torch.QSACache"
_HOLDER_VERSION = 1
_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _FLOAT_DTYPES.items()}


class HoleInSavedStateError(CorruptStateError, HoleError):
    """A saved sequence or state dict whose positions are not one contiguous run: corrupt state that
    describes a hole. It is both a :class:`CorruptStateError` and a :class:`HoleError`."""


# --------------------------------------------------------------------------------------------------
# Persistent append-only int64 vectors (cells of a run, group rows of a run)
# --------------------------------------------------------------------------------------------------

class _Buf:
    __slots__ = ("data", "claimed")

    def __init__(self, data: torch.Tensor, claimed: int):
        self.data = data
        self.claimed = claimed


class _Vec:
    """An immutable view ``buf.data[start:start+n]``. ``extend`` appends in place (amortised O(k)) when
    this view ends where the buffer's claimed region ends, and copies otherwise, so views shared by
    several runs (fork, savepoints) never see each other's appends."""

    __slots__ = ("buf", "start", "n")

    def __init__(self, buf: _Buf, start: int, n: int):
        self.buf, self.start, self.n = buf, start, n

    @staticmethod
    def empty(device: torch.device) -> "_Vec":
        return _Vec(_Buf(torch.empty(0, dtype=torch.int64, device=device), 0), 0, 0)

    @staticmethod
    def of(t: torch.Tensor) -> "_Vec":
        t = t.to(torch.int64).contiguous()
        return _Vec(_Buf(t.clone(), t.numel()), 0, t.numel())

    def tensor(self) -> torch.Tensor:
        return self.buf.data[self.start:self.start + self.n]

    def __len__(self) -> int:
        return self.n

    def extend(self, new: torch.Tensor) -> "_Vec":
        k = new.numel()
        if k == 0:
            return self
        end = self.start + self.n
        data = self.buf.data
        if self.buf.claimed == end and end + k <= data.numel():
            data[end:end + k] = new
            self.buf.claimed = end + k
            return _Vec(self.buf, self.start, self.n + k)
        size = max(16, 2 * (self.n + k))
        fresh = torch.empty(size, dtype=torch.int64, device=data.device)
        fresh[:self.n] = self.tensor()
        fresh[self.n:self.n + k] = new
        return _Vec(_Buf(fresh, self.n + k), 0, self.n + k)

    def drop_front(self, k: int) -> "_Vec":
        return _Vec(self.buf, self.start + k, self.n - k)

    def truncate(self, n: int) -> "_Vec":
        return _Vec(self.buf, self.start, n)


@dataclass(frozen=True)
class _Run:
    """One sequence's run: positions ``[p0, p0+n)`` in ``cells`` (len n), groups in ``groups`` (len n//r).
    An empty run keeps ``p0`` as the default first position of its next append."""

    p0: int
    n: int
    cells: _Vec
    groups: _Vec


# --------------------------------------------------------------------------------------------------
# Public result types
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ReservedChunk:
    """Cells reserved for one packed chunk (rows = sequences, in the order given to ``reserve``).

    Attributes:
        handles: the sequence of each row.
        cu_seqlens: Tensor[B+1] int32, row boundaries in the packed token order.
        cells: Tensor[T] int64, physical cell of each packed token.
        positions: Tensor[T] int64, logical position of each packed token.
    """

    handles: tuple[SeqHandle, ...]
    cu_seqlens: torch.Tensor
    cells: torch.Tensor
    positions: torch.Tensor
    _owner: int = field(default=0, repr=False, compare=False)
    _txn: object = field(default=None, repr=False, compare=False)
    _starts: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    _anchors: tuple[int, ...] | None = field(default=None, repr=False, compare=False)   # row p0 at reserve

    @property
    def num_tokens(self) -> int:
        return int(self.cells.shape[0])

    @property
    def counts(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


@dataclass(frozen=True, eq=False)
class QSAPlan:
    """The selection of one chunk's queries for one layer (SPEC §3).

    Attributes:
        selected_groups: Tensor[T, top_k] int32, selected group indices within each query's sequence,
            ascending, -1 padded.
        q_groups: Tensor[T] int32, complete groups visible to each query.
        token_cells: Tensor[T, W] int32, W = top_k*r + r - 1: physical cells of the selected groups'
            tokens in ascending group (position) order, then the raw tail, then -1 padding.
        token_positions: Tensor[T, W] int64, the logical position of each entry of token_cells (-1 pad).
        positions: Tensor[T] int64, the position of each query.
        q_rows: Tensor[T] int64, the chunk row (sequence) of each query.
    """

    selected_groups: torch.Tensor
    q_groups: torch.Tensor
    token_cells: torch.Tensor
    token_positions: torch.Tensor
    positions: torch.Tensor
    q_rows: torch.Tensor
    compress_ratio: int
    top_k: int

    @property
    def cells(self) -> torch.Tensor:
        """Alias of ``token_cells``."""
        return self.token_cells

    def mask(self, key_cells: torch.Tensor, key_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The selection as a boolean mask over a key layout.

        Args:
            key_cells: Tensor[Tk] int64, the physical cell held by each key column (-1 for a column
                that holds no cell, e.g. padding).
            key_rows: optional Tensor[Tk] int, the chunk row each key column belongs to. Give it when
                the layout packs several sequences that share cells (fork/copy): a query then matches
                only columns of its own row.

        Returns:
            Tensor[T, Tk] bool: ``mask[t, j]`` is True when query t attends to key column j.
        """
        key_cells = key_cells.to(device=self.token_cells.device, dtype=torch.int64)
        t, tk = self.token_cells.shape[0], key_cells.shape[0]
        if t == 0 or tk == 0:
            return torch.zeros((t, tk), dtype=torch.bool, device=key_cells.device)
        table = torch.sort(self.token_cells.to(torch.int64), dim=1).values.contiguous()       # [T, W]
        values = key_cells[None, :].expand(t, tk).contiguous()
        idx = torch.searchsorted(table, values).clamp(max=table.shape[1] - 1)
        hit = (table.gather(1, idx) == values) & (values >= 0)
        if key_rows is not None:
            key_rows = key_rows.to(device=hit.device, dtype=torch.int64)
            hit &= key_rows[None, :] == self.q_rows[:, None]
        return hit


# --------------------------------------------------------------------------------------------------
# Transaction bookkeeping
# --------------------------------------------------------------------------------------------------

_STATE_TENSORS = ("cell_pos", "cell_ref", "keys", "k_cache", "v_cache", "pooled", "group_ref",
                  "_unwritten", "_pending", "_pend_cells", "_pend_pos", "_freed_cells", "_freed_rows")


class _Txn:
    def __init__(self) -> None:
        self.token = object()
        self.log: list[tuple[torch.Tensor, Any, torch.Tensor]] = []
        self.new_cells: list[torch.Tensor] = []                 # cells reserved in this transaction
        self.pending: list[list[torch.Tensor]] = []             # per layer: rows that may be pending
        self.evict: dict[int, int] = {}                         # window: slot -> p0 once its chunk is planned
        self.base: _Savepoint | None = None
        self.prepared: tuple[torch.Tensor | None, list[tuple[int, torch.Tensor]]] = (None, [])


@dataclass
class _Savepoint:
    log_len: int
    runs: dict[int, _Run]
    generation: list[int]
    live: list[bool]
    heads: tuple[int, int]
    tensors: dict[str, torch.Tensor | None]
    new_cells: list[torch.Tensor]
    pending: list[list[torch.Tensor]]
    evict: dict[int, int]
    dtype: torch.dtype


# --------------------------------------------------------------------------------------------------
# The holder
# --------------------------------------------------------------------------------------------------

class QSACache(torch.nn.Module, Transactional):
    """Per-sequence contiguous runs of cached tokens for Qwen4Exp's QSA indexer (SPEC §3–§4).

    Args:
        capacity: number of physical cells (tokens) shared by all sequences.
        num_layers: number of indexed-attention layers held (cache layer indices ``0..L-1``).
        head_dim: indexer head dim D.
        norm_weight: Tensor[L, D] or a list of L Tensor[D]: each layer's ``k_layernorm.weight``
            (applied as ``1 + w``); stored in float32.
        eps: RMSNorm epsilon.
        inv_freq: Tensor[R/2] float32 rotary inverse frequencies shared by all layers (R <= D).
        compress_ratio: r, tokens per group.
        max_sequences: number of sequence slots.
        dtype: dtype of the raw keys, pooled keys and K/V planes.
        device: where every tensor lives.
        kv_heads, kv_head_dim, v_head_dim: when ``kv_heads`` is given, the holder also keeps main
            attention planes K [capacity, Hkv, Dh] and V [capacity, Hkv, Dv] per layer that follow
            the same cells (``v_head_dim`` defaults to ``kv_head_dim``).
        window: when set, a query at position p sees the run as it stands after the tokens up to p,
            with whole groups (multiples of r, so the anchor stays aligned and the surviving groups
            are kept as they are) evicted from the front until at most ``window`` positions remain
            (SPEC §3): the same for every cut of the stream. ``reserve`` evicts at once what no query
            of its chunk sees (those cells can hold the new tokens) and the rest once the chunk's
            queries are planned (at commit, or at the sequence's next lifecycle operation), so the
            run keeps between ``window - r + 1`` and ``window`` positions once full. A single chunk
            longer than ``window`` for one sequence is refused.
    """

    layer_ids: list[int]

    def __init__(self, capacity: int, *, num_layers: int, head_dim: int,
                 norm_weight: torch.Tensor | Sequence[torch.Tensor], eps: float, inv_freq: torch.Tensor,
                 compress_ratio: int = 4, max_sequences: int = 64, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, kv_heads: int | None = None,
                 kv_head_dim: int | None = None, v_head_dim: int | None = None, window: int | None = None):
        torch.nn.Module.__init__(self)
        device = torch.device(device) if device is not None else torch.device("cpu")
        if capacity < 1 or num_layers < 1 or head_dim < 1 or compress_ratio < 1:
            raise HebrusError(f"QSACache: capacity ({capacity}), num_layers ({num_layers}), head_dim ({head_dim}) "
                              f"and compress_ratio ({compress_ratio}) must all be >= 1")
        if dtype not in _DTYPE_NAMES:
            raise HebrusError(f"QSACache: dtype must be float32, float16 or bfloat16, got {dtype}")
        if window is not None and window < compress_ratio:
            raise HebrusError(f"QSACache: window ({window}) must be >= compress_ratio ({compress_ratio})")
        if isinstance(norm_weight, torch.Tensor):
            nw = norm_weight.detach()
        else:
            nw = torch.stack([w.detach().to(torch.float32).cpu() for w in norm_weight])
        if tuple(nw.shape) != (num_layers, head_dim):
            raise HebrusError(f"QSACache: norm_weight must be [num_layers={num_layers}, head_dim={head_dim}], "
                              f"got {list(nw.shape)}")
        inv_freq = inv_freq.detach()
        if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or 2 * inv_freq.shape[0] > head_dim:
            raise HebrusError(f"QSACache: inv_freq must be a float32 vector of at most head_dim/2 = {head_dim // 2} "
                              f"entries, got {inv_freq.dtype} {list(inv_freq.shape)}")
        if kv_heads is None and (kv_head_dim is not None or v_head_dim is not None):
            raise HebrusError("QSACache: kv_head_dim / v_head_dim need kv_heads")
        if kv_heads is not None:
            if kv_head_dim is None or kv_heads < 1 or kv_head_dim < 1:
                raise HebrusError("QSACache: kv_heads needs a positive kv_head_dim")
            v_head_dim = kv_head_dim if v_head_dim is None else v_head_dim
        self.capacity = int(capacity)
        self.num_layers = int(num_layers)
        self.head_dim = int(head_dim)
        self.compress_ratio = int(compress_ratio)
        self.max_sequences = int(max_sequences)
        self.eps = float(eps)
        self.dtype = dtype
        # Plain ints or None: the config is saved as JSON and compared with exact types on restore.
        self.kv_heads = None if kv_heads is None else as_int("QSACache: kv_heads", kv_heads)
        self.kv_head_dim = None if kv_head_dim is None else as_int("QSACache: kv_head_dim", kv_head_dim)
        self.v_head_dim = None if v_head_dim is None else as_int("QSACache: v_head_dim", v_head_dim)
        self.window = window
        self.layer_ids = list(range(num_layers))
        self.top_k: int | None = None       # budget // r when built from a model config
        r = self.compress_ratio
        gcap = max(1, capacity // r + max_sequences)
        L, C = self.num_layers, self.capacity
        self.register_buffer("norm_weight", nw.to(device=device, dtype=torch.float32).clone(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.to(device=device).clone(), persistent=False)
        self.register_buffer("cell_pos", torch.full((C,), -1, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("cell_ref", torch.zeros(C, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("keys", torch.zeros((L, C, head_dim), dtype=dtype, device=device), persistent=False)
        if kv_heads is not None:
            self.register_buffer("k_cache", torch.zeros((L, C, kv_heads, kv_head_dim), dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer("v_cache", torch.zeros((L, C, kv_heads, v_head_dim), dtype=dtype, device=device),
                                 persistent=False)
        else:
            self.k_cache = None
            self.v_cache = None
        self.register_buffer("pooled", torch.zeros((L, gcap, head_dim), dtype=dtype, device=device), persistent=False)
        self.register_buffer("group_ref", torch.zeros(gcap, dtype=torch.int32, device=device), persistent=False)
        # Transaction-only bookkeeping (all False / unused outside a transaction).
        self.register_buffer("_unwritten", torch.zeros((L, C), dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("_pending", torch.zeros((L, gcap), dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("_pend_cells", torch.zeros((gcap, r), dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("_pend_pos", torch.zeros(gcap, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("_freed_cells", torch.zeros(C, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("_freed_rows", torch.zeros(gcap, dtype=torch.bool, device=device), persistent=False)
        self.slots = SlotTable(max_sequences, "QSACache")
        self._runs: dict[int, _Run] = {}
        self._cell_head = 0
        self._row_head = 0
        self._txn: _Txn | None = None
        self._alloc_generator: torch.Generator | None = None   # tests: scrambled cell allocation

    # ------------------------------------------------------------------------------------------
    # Construction from transformers
    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_transformers(cls, model: torch.nn.Module, *, capacity_tokens: int, max_sequences: int = 64,
                          with_kv: bool = False, window: int | None = None) -> "QSACache":
        """Build a cache for a transformers Qwen4Exp model (``Qwen4ExpForCausalLM``, ``Qwen4ExpTextModel``
        or a model that wraps one as ``.model`` / ``.language_model``).

        One cache layer per ``"indexed_attention"`` layer, in model order; ``layer_ids[i]`` is the model
        layer index of cache layer ``i`` (see :meth:`layer_index`). Norm weights come from each layer's
        ``self_attn.indexer.k_layernorm.weight``, eps from ``config.rms_norm_eps``, inv_freq from the
        model's ``rotary_emb.inv_freq`` (the indexer ropes pooled keys with the main rotary cos/sin).
        With ``with_kv`` the holder also keeps the main attention K/V planes
        (``num_key_value_heads`` x ``head_dim``). dtype and device follow the model's parameters.
        """
        text = _find_text_model(model)
        config = text.config
        layer_ids = [i for i, t in enumerate(config.layer_types) if t == "indexed_attention"]
        if not layer_ids:
            raise HebrusError("QSACache.from_transformers: the model has no indexed_attention layer")
        indexers = [text.layers[i].self_attn.indexer for i in layer_ids]
        rotary = text.rotary_emb
        if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            raise HebrusError("QSACache.from_transformers: rotary attention_scaling != 1 is not supported "
                              "(qsa_pool ropes with plain cos/sin)")
        rope_type = getattr(rotary, "rope_type", "default")
        for kind in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
            if "dynamic" in str(kind) or kind == "longrope":   # transformers' dynamic_rope_update rule
                raise HebrusError(f"QSACache.from_transformers: rope_type {kind!r} rewrites inv_freq as the "
                                  "context grows, and the cache ropes with the frequencies it copies once "
                                  "(the transformers drop-in re-pools instead)")
        param = next(text.parameters())
        dtype = param.dtype if param.dtype in _DTYPE_NAMES else torch.float32
        kv = {}
        if with_kv:
            kv = dict(kv_heads=config.num_key_value_heads, kv_head_dim=config.head_dim)
        cache = cls(capacity_tokens, num_layers=len(layer_ids), head_dim=config.indexer_head_dim,
                    norm_weight=[ix.k_layernorm.weight.detach().float() for ix in indexers],
                    eps=float(config.rms_norm_eps), inv_freq=rotary.inv_freq.detach().float(),
                    compress_ratio=config.indexer_compress_ratio, max_sequences=max_sequences,
                    dtype=dtype, device=param.device, window=window, **kv)
        cache.layer_ids = layer_ids
        cache.top_k = config.indexer_budget // config.indexer_compress_ratio
        return cache

    def layer_index(self, model_layer: int) -> int:
        """The cache layer that holds model layer ``model_layer`` (see ``layer_ids``)."""
        try:
            return self.layer_ids.index(model_layer)
        except ValueError:
            raise HebrusError(f"QSACache: model layer {model_layer} is not an indexed layer "
                              f"(indexed layers: {self.layer_ids})") from None

    # ------------------------------------------------------------------------------------------
    # Small helpers
    # ------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.cell_pos.device

    @property
    def has_kv(self) -> bool:
        return self.kv_heads is not None

    @property
    def group_capacity(self) -> int:
        return int(self.group_ref.shape[0])

    def _seq_config(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "head_dim": self.head_dim, "compress_ratio": self.compress_ratio,
                "dtype": _DTYPE_NAMES[self.dtype], "kv_heads": self.kv_heads, "kv_head_dim": self.kv_head_dim,
                "v_head_dim": self.v_head_dim}

    def _config(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "num_layers": self.num_layers, "head_dim": self.head_dim,
                "compress_ratio": self.compress_ratio, "max_sequences": self.max_sequences,
                "dtype": _DTYPE_NAMES[self.dtype], "kv_heads": self.kv_heads, "kv_head_dim": self.kv_head_dim,
                "v_head_dim": self.v_head_dim}

    def _slot(self, seq: SeqHandle) -> int:
        return self.slots.check(seq)

    def _handle(self, slot: int) -> SeqHandle:
        return SeqHandle(slot, int(self.slots.generation[slot]))

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise HebrusError(f"QSACache: layer {layer!r} outside [0, {self.num_layers})")
        return layer

    def _arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------------------------------
    # Undo log, savepoints, transaction hooks
    # ------------------------------------------------------------------------------------------

    def _set(self, tensor: torch.Tensor, idx: Any, value: Any) -> None:
        """``tensor[idx] = value`` with the old values recorded in the undo log."""
        txn = self._txn
        assert txn is not None, "QSACache mutation outside a transaction"
        txn.log.append((tensor, idx, tensor[idx].clone()))
        tensor[idx] = value

    def _log_content(self, cells: torch.Tensor) -> None:
        """Record every layer's content of ``cells`` (keys, K, V, unwritten flags) in the undo log."""
        if cells.numel() == 0:
            return
        txn = self._txn
        for name in ("keys", "k_cache", "v_cache", "_unwritten"):
            t = getattr(self, name)
            if t is not None:
                txn.log.append((t, (slice(None), cells), t[:, cells].clone()))

    def _savepoint(self) -> _Savepoint:
        txn = self._txn
        return _Savepoint(
            log_len=len(txn.log), runs=dict(self._runs), generation=self.slots.generation.tolist(),
            live=self.slots.live.tolist(), heads=(self._cell_head, self._row_head),
            tensors={name: getattr(self, name) for name in _STATE_TENSORS},
            new_cells=list(txn.new_cells), pending=[list(p) for p in txn.pending], evict=dict(txn.evict),
            dtype=self.dtype)

    def _restore(self, sp: _Savepoint) -> None:
        txn = self._txn
        for tensor, idx, old in reversed(txn.log[sp.log_len:]):
            tensor[idx] = old
        del txn.log[sp.log_len:]
        self._runs = dict(sp.runs)
        self.slots.load(sp.generation, sp.live)
        self._cell_head, self._row_head = sp.heads
        for name, t in sp.tensors.items():
            if getattr(self, name) is not t:
                setattr(self, name, t)
        self.dtype = sp.dtype
        txn.new_cells = list(sp.new_cells)
        txn.pending = [list(p) for p in sp.pending]
        txn.evict = dict(sp.evict)

    def _txn_begin(self) -> None:
        txn = _Txn()
        txn.pending = [[] for _ in range(self.num_layers)]
        self._txn = txn
        try:
            txn.base = self._savepoint()
        except BaseException:
            self._txn = None      # no transaction began: nothing may refuse work as "inside" one
            raise

    def _txn_prepare(self) -> None:
        """The fallible part of a commit, undoably: zero-fill cells never written for some layer and pool
        every pending group (a kernel may still refuse here; the block is then rolled back)."""
        txn = self._txn
        for slot in sorted(txn.evict):
            self._settle(slot)
        cells = torch.unique(torch.cat(txn.new_cells)) if txn.new_cells else None
        if cells is not None:
            live = cells[self.cell_ref[cells] > 0]
            for layer in range(self.num_layers):
                miss = live[self._unwritten[layer, live]]
                if miss.numel():
                    for name in ("keys", "k_cache", "v_cache"):
                        t = getattr(self, name)
                        if t is not None:
                            self._set(t, (layer, miss), 0)
        pooled: list[tuple[int, torch.Tensor]] = []
        for layer in range(self.num_layers):
            if txn.pending[layer]:
                rows = torch.unique(torch.cat(txn.pending[layer]))
                rows = rows[self._pending[layer, rows]]
                if rows.numel():
                    self._set(self.pooled, (layer, rows),
                              self._pool(layer, self._pend_cells[rows], self._pend_pos[rows]))
                    pooled.append((layer, rows))
        txn.prepared = (cells, pooled)

    def _txn_commit(self) -> None:
        """Clear the transaction's flags. The undo log is kept until ``_txn_finish`` (every flag was set
        through it), so a rollback still undoes the whole block."""
        cells, pooled = self._txn.prepared
        if cells is not None:
            self._unwritten[:, cells] = False
        for layer, rows in pooled:
            self._pending[layer, rows] = False
        self._freed_cells.zero_()
        self._freed_rows.zero_()

    def _txn_finish(self) -> None:
        """Drop the undo log."""
        txn, self._txn = self._txn, None
        del txn.log[:]

    def _txn_rollback(self) -> None:
        txn = self._txn
        try:
            if txn is not None and txn.base is not None:
                self._restore(txn.base)
        finally:
            self._txn = None

    def _txn_savepoint(self) -> _Savepoint:
        return self._savepoint()

    def _txn_restore(self, savepoint: _Savepoint) -> None:
        self._restore(savepoint)

    def _op(self):
        """One atomic operation: its own transaction when none is open, else between savepoints."""
        return atomic(self)

    # ------------------------------------------------------------------------------------------
    # Allocation and release of cells and group rows
    # ------------------------------------------------------------------------------------------

    def _pick(self, free: torch.Tensor, count: int, head: int, precious: torch.Tensor) -> torch.Tensor:
        idx = torch.nonzero(free).flatten()
        if self._alloc_generator is not None:
            perm = torch.randperm(idx.numel(), generator=self._alloc_generator).to(idx.device)
            idx = idx[perm]
        else:
            idx = torch.cat((idx[idx >= head], idx[idx < head]))
        p = precious[idx]
        if bool(p.any()):  # prefer cells whose content nobody may need back on rollback
            idx = torch.cat((idx[~p], idx[p]))
        return idx[:count]

    def _alloc_cells(self, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        free = self.cell_ref == 0
        nfree = int(free.sum())
        if nfree < count:
            raise CapacityError(f"QSACache: {count} cells needed but only {nfree} of {self.capacity} are free "
                                f"(cell capacity exhausted)")
        chosen = self._pick(free, count, self._cell_head, self._freed_cells)
        self._log_content(chosen[self._freed_cells[chosen]])
        self._cell_head = (int(chosen[-1]) + 1) % self.capacity
        self._set(self.cell_ref, chosen, 1)
        if bool(self._unwritten[:, chosen].any()):
            self._set(self._unwritten, (slice(None), chosen), False)
        return chosen

    def _grow_rows(self, needed: int) -> None:
        old = self.group_capacity
        new = max(2 * old, old + needed)

        def grown(t: torch.Tensor, dim: int, fill: Any) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = new - old
            pad = torch.full(shape, fill, dtype=t.dtype, device=t.device)
            return torch.cat((t, pad), dim=dim)

        self.pooled = grown(self.pooled, 1, 0)
        self.group_ref = grown(self.group_ref, 0, 0)
        self._pending = grown(self._pending, 1, False)
        self._pend_cells = grown(self._pend_cells, 0, 0)
        self._pend_pos = grown(self._pend_pos, 0, 0)
        self._freed_rows = grown(self._freed_rows, 0, False)

    def _alloc_rows(self, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        free = self.group_ref == 0
        nfree = int(free.sum())
        if nfree < count:
            self._grow_rows(count - nfree)
            free = self.group_ref == 0
        chosen = self._pick(free, count, self._row_head, self._freed_rows)
        pre = chosen[self._freed_rows[chosen]]
        if pre.numel():
            txn = self._txn
            for name in ("pooled", "_pending"):
                t = getattr(self, name)
                txn.log.append((t, (slice(None), pre), t[:, pre].clone()))
        self._row_head = (int(chosen[-1]) + 1) % self.group_capacity
        self._set(self.group_ref, chosen, 1)
        return chosen

    def _release_cells(self, cells: torch.Tensor) -> None:
        if cells.numel() == 0:
            return
        self._set(self.cell_ref, cells, self.cell_ref[cells] - 1)
        dead = cells[self.cell_ref[cells] == 0]
        if dead.numel():
            self._set(self.cell_pos, dead, -1)
            self._set(self._freed_cells, dead, True)
            self._set(self._unwritten, (slice(None), dead), False)

    def _release_rows(self, rows: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        self._set(self.group_ref, rows, self.group_ref[rows] - 1)
        dead = rows[self.group_ref[rows] == 0]
        if dead.numel():
            self._set(self._freed_rows, dead, True)
            self._set(self._pending, (slice(None), dead), False)

    def _release_run(self, run: _Run) -> None:
        self._release_rows(run.groups.tensor())
        self._release_cells(run.cells.tensor())

    def _share_run(self, run: _Run) -> None:
        cells, rows = run.cells.tensor(), run.groups.tensor()
        if cells.numel():
            self._set(self.cell_ref, cells, self.cell_ref[cells] + 1)
        if rows.numel():
            self._set(self.group_ref, rows, self.group_ref[rows] + 1)

    # ------------------------------------------------------------------------------------------
    # Pooling
    # ------------------------------------------------------------------------------------------

    def _pool(self, layer: int, gcells: torch.Tensor, gpos: torch.Tensor, *, keys: torch.Tensor | None = None,
              cell_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled keys of groups ``gcells`` [G, r] at ``gpos`` [G] for one layer (of the published keys and
        positions, or of ``keys`` [C, D] and ``cell_pos`` [C] not published yet)."""
        return qsa_pool(self.keys[layer] if keys is None else keys, self.cell_pos if cell_pos is None else cell_pos,
                        gcells.to(torch.int32), gpos, self.norm_weight[layer], self.eps, self.inv_freq)

    def _define_groups(self, rows: torch.Tensor, gcells: torch.Tensor, gpos: torch.Tensor) -> None:
        """Give fresh rows their groups; pool at once for every layer whose cells are all written,
        leave the others pending for that layer."""
        if rows.numel() == 0:
            return
        self._set(self._pend_cells, rows, gcells)
        self._set(self._pend_pos, rows, gpos)
        txn = self._txn
        for layer in range(self.num_layers):
            unwritten = self._unwritten[layer][gcells].any(dim=1)
            ready = ~unwritten
            if bool(ready.any()):
                r_rows = rows[ready]
                self.pooled[layer, r_rows] = self._pool(layer, gcells[ready], gpos[ready])
            if bool(unwritten.any()):
                p_rows = rows[unwritten]
                self._set(self._pending, (layer, p_rows), True)
                txn.pending[layer].append(p_rows)

    def _resolve_pending(self, layer: int) -> None:
        """Pool this layer's pending groups whose cells are now all written."""
        txn = self._txn
        if not txn.pending[layer]:
            return
        rows = torch.unique(torch.cat(txn.pending[layer]))
        rows = rows[self._pending[layer, rows]]
        if rows.numel() == 0:
            txn.pending[layer] = []
            return
        ready = ~self._unwritten[layer][self._pend_cells[rows]].any(dim=1)
        r_rows = rows[ready]
        if r_rows.numel():
            pooled = self._pool(layer, self._pend_cells[r_rows], self._pend_pos[r_rows])
            self.pooled[layer, r_rows] = pooled        # pending rows: content invisible, no undo needed
            self._set(self._pending, (layer, r_rows), False)
        txn.pending[layer] = [rows[~ready]] if bool((~ready).any()) else []

    def _groups_for(self, run: _Run, g0: int, g1: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.compress_ratio
        gcells = run.cells.tensor()[r * g0:r * g1].reshape(-1, r)
        gpos = run.p0 + r * torch.arange(g0, g1, dtype=torch.int64, device=self.device)
        return gcells, gpos

    def _rebuild(self, run: _Run) -> _Run:
        """Fresh group rows for the whole run (anchored at its p0); the old rows are released."""
        self._release_rows(run.groups.tensor())
        g = run.n // self.compress_ratio
        rows = self._alloc_rows(g)
        gcells, gpos = self._groups_for(run, 0, g)
        self._define_groups(rows, gcells, gpos)
        return _Run(run.p0, run.n, run.cells, _Vec.of(rows))

    def _drop_prefix(self, run: _Run, k: int) -> _Run:
        """Remove the first k positions; keep the surviving groups when k is a multiple of r."""
        if k <= 0:
            return run
        r = self.compress_ratio
        if k >= run.n:
            self._release_run(run)
            return _Run(run.p0 + run.n, 0, _Vec.empty(self.device), _Vec.empty(self.device))
        self._release_cells(run.cells.tensor()[:k])
        cells = run.cells.drop_front(k)
        if k % r == 0:
            self._release_rows(run.groups.tensor()[:k // r])
            return _Run(run.p0 + k, run.n - k, cells, run.groups.drop_front(k // r))
        moved = _Run(run.p0 + k, run.n - k, cells, run.groups)
        return self._rebuild(moved)

    def _drop_suffix(self, run: _Run, keep: int) -> _Run:
        """Keep the first ``keep`` positions (the anchor does not move: no rebuild)."""
        if keep >= run.n:
            return run
        if keep <= 0:
            self._release_run(run)
            return _Run(run.p0, 0, _Vec.empty(self.device), _Vec.empty(self.device))
        g = keep // self.compress_ratio
        self._release_rows(run.groups.tensor()[g:])
        self._release_cells(run.cells.tensor()[keep:])
        return _Run(run.p0, keep, run.cells.truncate(keep), run.groups.truncate(g))

    def _start_empty_run_at(self, seq: SeqHandle, p: int) -> None:
        """Make ``p`` the default first position of an empty sequence (ModelCache: after a rewind to a
        PLE snapshot before the run's first position)."""
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            run = self._runs[slot]
            if run.n:
                raise HebrusError(f"QSACache: {seq} is not empty (holds [{run.p0}, {run.p0 + run.n - 1}])")
            self._runs[slot] = _Run(as_int("QSACache: p", p), 0, run.cells, run.groups)

    def _window_start(self, p0: int, p: int) -> int:
        """The first visible position of a query at ``p`` over a run anchored at ``p0`` (SPEC §3): with a
        window, whole groups are evicted from the front until at most ``window`` positions remain."""
        if self.window is None:
            return p0
        over = p - p0 + 1 - self.window
        r = self.compress_ratio
        return p0 if over <= 0 else p0 + r * -(-over // r)

    def _settle(self, slot: int) -> None:
        """Apply the window eviction a planned chunk left for this slot (see ``reserve``)."""
        txn = self._txn
        if txn is None or slot not in txn.evict:
            return
        target = txn.evict.pop(slot)
        run = self._runs[slot]
        self._runs[slot] = self._drop_prefix(run, target - run.p0)

    def _view(self, slot: int) -> _Run:
        """The slot's run as the cache holds it after its chunks: a pending window eviction applied to the
        view only (the cells stay held for the chunk's queries until the eviction is settled)."""
        run = self._runs[slot]
        txn = self._txn
        if txn is None or slot not in txn.evict:
            return run
        k = txn.evict[slot] - run.p0
        return _Run(run.p0 + k, run.n - k, run.cells.drop_front(k), run.groups.drop_front(k // self.compress_ratio))

    # ------------------------------------------------------------------------------------------
    # Lifecycle
    # ------------------------------------------------------------------------------------------

    def new_sequence(self, handle: SeqHandle | None = None) -> SeqHandle:
        """Claim a slot for an empty sequence (run ``(0, 0)``). With ``handle``, adopt exactly that slot
        and generation (how a ModelCache makes its holders share handles)."""
        with self._op():
            handle = self.slots.claim(handle)
            self._runs[handle.slot] = _Run(0, 0, _Vec.empty(self.device), _Vec.empty(self.device))
            return handle

    def free(self, seq: SeqHandle) -> None:
        """Release the sequence's cells and groups and its slot; ``seq`` is stale afterwards."""
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            self._release_run(self._runs.pop(slot))
            self.slots.release(seq)

    def reset(self, seq: SeqHandle) -> SeqHandle:
        """Empty the sequence and bump its generation; returns the new handle (the old one is stale)."""
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            self._release_run(self._runs[slot])
            self.slots.release(seq)
            handle = self.slots.claim(SeqHandle(slot, int(self.slots.generation[slot])))
            self._runs[slot] = _Run(0, 0, _Vec.empty(self.device), _Vec.empty(self.device))
            return handle

    def run(self, seq: SeqHandle) -> tuple[int, int]:
        """``(p0, n)``: the sequence holds positions ``[p0, p0 + n)``. For an empty sequence p0 is the
        default first position of its next append."""
        r = self._view(self._slot(seq))
        return r.p0, r.n

    def cells_of(self, seq: SeqHandle) -> torch.Tensor:
        """Tensor[n] int64: the physical cell of each position of the run, in position order."""
        return self._view(self._slot(seq)).cells.tensor().clone()

    def groups_of(self, seq: SeqHandle) -> torch.Tensor:
        """Tensor[n // r] int64: the pooled row (in ``pooled[layer]``) of each complete group, in order."""
        return self._view(self._slot(seq)).groups.tensor().clone()

    def pooled_of(self, seq: SeqHandle, layer: int) -> torch.Tensor:
        """Tensor[n // r, D]: the pooled keys of the sequence's complete groups for ``layer``."""
        return self.pooled[self._layer(layer)][self._view(self._slot(seq)).groups.tensor()].clone()

    def keys_of(self, seq: SeqHandle, layer: int) -> torch.Tensor:
        """Tensor[n, D]: the raw keys of the run for ``layer`` in position order."""
        return self.keys[self._layer(layer)][self._view(self._slot(seq)).cells.tensor()].clone()

    def sequences(self) -> list[SeqHandle]:
        """Live handles, in slot order."""
        return self.slots.live_handles()

    def reserve(self, seqs: Sequence[SeqHandle], counts: Sequence[int],
                first_positions: Sequence[int | None] | None = None) -> ReservedChunk:
        """Take cells for a packed chunk: row i holds ``counts[i]`` new tokens of ``seqs[i]``.

        Row i's positions are ``frontier + 1, ...`` of its sequence; for an empty sequence they start at
        ``first_positions[i]`` when given (any position >= 0: left padding, an evicted prefix) else at
        its run's p0. A first position given for a non-empty sequence must be ``frontier + 1``
        (``NonSuccessorError``). With a ``window``, each query of the chunk sees the window of its own
        position (SPEC §3): positions no query of the chunk sees are evicted first (their cells can hold
        the new tokens); the rest of the eviction takes effect once the chunk's queries are planned (at
        commit, or at the next lifecycle operation on the sequence). ``CapacityError``
        when the pool has too few free cells. Keys are written per layer with :meth:`write` inside the
        same transaction (cells never written are zero at commit).

        Returns:
            ReservedChunk with cu_seqlens [B+1] int32, cells [T] int64 and positions [T] int64.
        """
        seqs = list(seqs)
        counts = [int(c) for c in counts]
        if len(counts) != len(seqs):
            raise HebrusError(f"QSACache.reserve: {len(seqs)} sequences but {len(counts)} counts")
        if first_positions is not None and len(first_positions) != len(seqs):
            raise HebrusError(f"QSACache.reserve: {len(seqs)} sequences but {len(first_positions)} first positions")
        with self._op():
            slots = [self._slot(s) for s in seqs]
            if len(set(slots)) != len(slots):
                raise HebrusError(f"QSACache.reserve: a sequence appears twice in one chunk: {seqs}")
            for slot in slots:
                self._settle(slot)
            r = self.compress_ratio
            evict: dict[int, int] = {}
            starts: list[int] = []
            anchors: list[int] = []
            runs: list[_Run] = []
            for i, (seq, slot, count) in enumerate(zip(seqs, slots, counts)):
                if count < 0:
                    raise HebrusError(f"QSACache.reserve: negative count {count} for {seq}")
                run = self._runs[slot]
                first = None if first_positions is None else first_positions[i]
                if first is not None:
                    first = as_int(f"QSACache.reserve: the first position of {seq}", first)
                if run.n > 0:
                    start = run.p0 + run.n
                    if first is not None and count > 0 and int(first) != start:
                        raise NonSuccessorError(
                            f"QSACache.reserve: {seq} holds positions [{run.p0}, {start - 1}]; its next token must "
                            f"be at position {start} (frontier + 1), got positions [{int(first)}, "
                            f"{int(first) + count - 1}] (successor rule)")
                else:
                    start = run.p0 if first is None else int(first)
                    if start < 0:
                        raise HebrusError(f"QSACache.reserve: {seq} first position {start} is negative")
                if start + count - 1 > MAX_POSITION:
                    raise HebrusError(f"QSACache.reserve: {count} tokens of {seq} from position {start} would pass "
                                      f"the largest position {MAX_POSITION} (int64)")
                if self.window is not None and count > 0:
                    if count > self.window:
                        raise HebrusError(f"QSACache.reserve: {count} tokens for {seq} exceed the window of "
                                          f"{self.window} positions")
                    base = run.p0 if run.n else start
                    first_p0 = self._window_start(base, start)
                    last_p0 = self._window_start(base, start + count - 1)
                    if run.n and first_p0 > run.p0:        # no query of the chunk sees these
                        run = self._drop_prefix(run, first_p0 - run.p0)
                        self._runs[slot] = run
                    if last_p0 > first_p0:
                        evict[slot] = last_p0
                if run.n == 0 and count > 0:
                    run = _Run(start, 0, run.cells, run.groups)
                starts.append(start)
                runs.append(run)
                anchors.append(run.p0)
            total = sum(counts)
            cells = self._alloc_cells(total)
            counts_t = torch.tensor(counts, dtype=torch.int64, device=self.device)
            cu = torch.zeros(len(seqs) + 1, dtype=torch.int64, device=self.device)
            if seqs:
                cu[1:] = torch.cumsum(counts_t, 0)
            # (a row of 0 tokens after a run that ends at the largest position starts past it: it gives
            # no position, so any start in range will do)
            starts_t = torch.tensor([min(x, MAX_POSITION) for x in starts], dtype=torch.int64, device=self.device)
            offs = self._arange(total) - torch.repeat_interleave(cu[:-1], counts_t, output_size=total)
            positions = torch.repeat_interleave(starts_t, counts_t, output_size=total) + offs
            if total:
                self._set(self.cell_pos, cells, positions)
                self._set(self._unwritten, (slice(None), cells), True)
                self._txn.new_cells.append(cells)
            # New complete groups of every row, allocated and defined in one go.
            new_runs: list[_Run] = []
            n_groups: list[int] = []
            bounds = cu.tolist()
            for i, (slot, run) in enumerate(zip(slots, runs)):
                grown = _Run(run.p0, run.n + counts[i], run.cells.extend(cells[bounds[i]:bounds[i + 1]]), run.groups)
                new_runs.append(grown)
                n_groups.append(grown.n // r - run.n // r)
            rows = self._alloc_rows(sum(n_groups))
            gcells, gpos, at = [], [], 0
            for i, (slot, run) in enumerate(zip(slots, new_runs)):
                g0 = run.n // r - n_groups[i]
                c, p = self._groups_for(run, g0, g0 + n_groups[i])
                gcells.append(c)
                gpos.append(p)
                self._runs[slot] = _Run(run.p0, run.n, run.cells, run.groups.extend(rows[at:at + n_groups[i]]))
                at += n_groups[i]
            if rows.numel():
                self._define_groups(rows, torch.cat(gcells), torch.cat(gpos))
            self._txn.evict.update(evict)
            return ReservedChunk(tuple(seqs), cu.to(torch.int32), cells, positions, id(self), self._txn.token,
                                 tuple(starts), tuple(anchors))

    def _check_run(self, seq: SeqHandle, run: _Run, what: str) -> None:
        """HoleError unless the run's cells hold exactly positions p0, p0+1, ... (vectorised)."""
        cells = run.cells.tensor()
        got = self.cell_pos[cells]
        bad = got != run.p0 + self._arange(run.n)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0])
            raise HoleError(f"QSACache.{what}: {seq} run [{run.p0}, {run.p0 + run.n - 1}] has cell {int(cells[j])} at "
                            f"position {int(got[j])} where {run.p0 + j} is required (a hole inside the run is not "
                            f"padding)")

    def _check_chunk(self, chunk: ReservedChunk, what: str) -> list[int]:
        if not isinstance(chunk, ReservedChunk) or chunk._owner != id(self):
            raise HebrusError(f"QSACache.{what}: the chunk was not reserved by this cache")
        slots = [self._slot(h) for h in chunk.handles]
        if chunk.num_tokens:
            pos_now = self.cell_pos[chunk.cells]
            bad = (pos_now != chunk.positions) | (self.cell_ref[chunk.cells] <= 0)
            if bool(bad.any()):
                i = int(torch.nonzero(bad)[0])
                raise HoleError(f"QSACache.{what}: chunk token {i} (position {int(chunk.positions[i])}) is no longer "
                                f"held by cell {int(chunk.cells[i])} (cell holds {int(pos_now[i])}): the run changed "
                                f"since reserve")
        return slots

    def write(self, layer: int, chunk: ReservedChunk, keys: torch.Tensor, k: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> None:
        """Write one layer's raw indexer keys (and K/V when configured) into the chunk's cells and pool
        the groups this chunk completes for that layer (O(new groups) pooled work).

        Args:
            layer: cache layer index.
            chunk: a chunk reserved in the current transaction.
            keys: Tensor[T, D] raw indexer keys (projection output: no norm, no RoPE), packed like the chunk.
            k: Tensor[T, Hkv, Dh] main attention keys (required iff the cache keeps K/V).
            v: Tensor[T, Hkv, Dv] main attention values (required iff the cache keeps K/V).
        """
        layer = self._layer(layer)
        with self._op():
            if self._txn.token is not chunk._txn:
                raise HebrusError("QSACache.write: the chunk was reserved in another transaction (already "
                                  "committed or rolled back); reserve and write inside one transaction, or use append")
            self._check_chunk(chunk, "write")
            t = chunk.num_tokens
            if keys.shape != (t, self.head_dim):
                raise HebrusError(f"QSACache.write: keys must be [T={t}, D={self.head_dim}], got {list(keys.shape)}")
            if self.has_kv:
                if k is None or v is None:
                    raise HebrusError("QSACache.write: this cache keeps K/V planes; pass k and v")
                if k.shape != (t, self.kv_heads, self.kv_head_dim) or v.shape != (t, self.kv_heads, self.v_head_dim):
                    raise HebrusError(f"QSACache.write: k must be [{t}, {self.kv_heads}, {self.kv_head_dim}] and v "
                                      f"[{t}, {self.kv_heads}, {self.v_head_dim}], got {list(k.shape)} and "
                                      f"{list(v.shape)}")
            elif k is not None or v is not None:
                raise HebrusError("QSACache.write: this cache keeps no K/V planes (construct it with kv_heads)")
            if t == 0:
                return
            cells = chunk.cells
            written = cells[~self._unwritten[layer, cells]]   # a rewrite: keep the old content for undo
            if written.numel():
                txn = self._txn
                for name in ("keys", "k_cache", "v_cache"):
                    tt = getattr(self, name)
                    if tt is not None:
                        txn.log.append((tt, (layer, written), tt[layer, written].clone()))
            # The cache carries no autograd history: activations that require grad are stored detached.
            self.keys[layer].index_copy_(0, cells, keys.detach().to(device=self.device, dtype=self.dtype))
            if self.has_kv:
                self.k_cache[layer].index_copy_(0, cells, k.detach().to(device=self.device, dtype=self.dtype))
                self.v_cache[layer].index_copy_(0, cells, v.detach().to(device=self.device, dtype=self.dtype))
            if written.numel():
                self._repool_touching(layer, written)
            self._set(self._unwritten, (layer, cells), False)
            self._resolve_pending(layer)

    def _repool_touching(self, layer: int, cells: torch.Tensor) -> None:
        """After a rewrite of already written cells, re-pool (with undo) every live group of this layer
        that contains one of them."""
        mark = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        mark[cells] = True
        rows = []
        for run in self._runs.values():
            g = run.groups.tensor()
            if g.numel():
                gc = run.cells.tensor()[:g.numel() * self.compress_ratio].reshape(-1, self.compress_ratio)
                rows.append(g[mark[gc].any(dim=1)])
        if not rows:
            return
        rows = torch.unique(torch.cat(rows))
        rows = rows[~self._pending[layer, rows]]
        if rows.numel():
            self._set(self.pooled, (layer, rows), self._pool(layer, self._pend_cells_of(rows), self._pend_pos[rows]))

    def _pend_cells_of(self, rows: torch.Tensor) -> torch.Tensor:
        return self._pend_cells[rows]

    def append(self, seq: SeqHandle, keys_per_layer: Sequence[torch.Tensor], first_position: int | None = None,
               k: Sequence[torch.Tensor] | None = None, v: Sequence[torch.Tensor] | None = None) -> ReservedChunk:
        """Reserve ``n`` positions for one sequence and write every layer: ``keys_per_layer[l]`` is
        Tensor[n, D]; ``k[l]`` / ``v[l]`` Tensor[n, Hkv, Dh] / [n, Hkv, Dv] when K/V are kept."""
        if len(keys_per_layer) != self.num_layers:
            raise HebrusError(f"QSACache.append: {len(keys_per_layer)} key tensors for {self.num_layers} layers")
        if self.has_kv and (k is None or v is None or len(k) != self.num_layers or len(v) != self.num_layers):
            raise HebrusError("QSACache.append: this cache keeps K/V planes; pass k and v for every layer")
        n = int(keys_per_layer[0].shape[0])
        with self._op():
            chunk = self.reserve([seq], [n], [first_position])
            for layer in range(self.num_layers):
                self.write(layer, chunk, keys_per_layer[layer], None if k is None else k[layer],
                           None if v is None else v[layer])
            return chunk

    def remove(self, seq: SeqHandle, p0: int, p1: int) -> None:
        """llama.cpp ``seq_rm``: drop positions ``[p0, p1)`` (``p0 < 0`` means 0, ``p1 < 0`` means "to the
        end"). Only a prefix, a suffix or the whole run may go; a middle range would leave a hole and
        raises ``HoleError``. Removing a prefix moves the anchor: groups are rebuilt (kept as they are
        when the prefix length is a multiple of r)."""
        p0, p1 = as_int("QSACache.remove: p0", p0), as_int("QSACache.remove: p1", p1)
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            run = self._runs[slot]
            a = max(p0, 0)
            b = math.inf if p1 < 0 else p1
            s, e = run.p0, run.p0 + run.n
            if run.n == 0 or b <= a or b <= s or a >= e:
                return
            if a <= s and b >= e:
                self._runs[slot] = self._drop_suffix(run, 0)
            elif a <= s:
                self._runs[slot] = self._drop_prefix(run, int(b) - s)
            elif b >= e:
                self._runs[slot] = self._drop_suffix(run, a - s)
            else:
                raise HoleError(f"QSACache.remove: {seq} holds positions [{s}, {e - 1}]; removing [{a}, {int(b) - 1}] "
                                f"would leave a hole inside the run (only a prefix, a suffix or all may be removed)")

    def rewind(self, seq: SeqHandle, p: int) -> None:
        """Drop positions >= p (``remove(seq, p, -1)``)."""
        self.remove(seq, max(as_int("QSACache.rewind: p", p), 0), -1)

    def shift(self, seq: SeqHandle, p0: int, p1: int, delta: int) -> None:
        """llama.cpp ``seq_add``: add ``delta`` to positions in ``[p0, p1)`` (``p1 < 0``: to the end). Only a
        range covering the whole run keeps it contiguous; a partial shift raises ``HoleError``. The
        groups are re-roped, i.e. rebuilt at the new positions. Cells shared with another sequence are
        copied first (copy on write)."""
        p0, p1 = as_int("QSACache.shift: p0", p0), as_int("QSACache.shift: p1", p1)
        delta = as_int("QSACache.shift: delta", delta)
        with self._op():
            slot = self._slot(seq)
            self._settle(slot)
            run = self._runs[slot]
            a = max(p0, 0)
            b = math.inf if p1 < 0 else p1
            s, e = run.p0, run.p0 + run.n
            if run.n == 0 or delta == 0 or b <= a or b <= s or a >= e:
                return
            if not (a <= s and b >= e):
                raise HoleError(f"QSACache.shift: {seq} holds positions [{s}, {e - 1}]; shifting only [{max(a, s)}, "
                                f"{min(int(b) if b != math.inf else e, e) - 1}] by {delta} would break the run "
                                f"(only whole-run shifts keep it contiguous)")
            if s + delta < 0:
                raise HebrusError(f"QSACache.shift: {seq} shifted by {delta} would start at position {s + delta} < 0")
            if e - 1 + delta > MAX_POSITION:
                raise HebrusError(f"QSACache.shift: {seq} shifted by {delta} would end at position {e - 1 + delta}, "
                                  f"past the largest position {MAX_POSITION} (int64)")
            self._check_run(seq, run, "shift")
            cells = run.cells.tensor()
            positions = s + delta + self._arange(run.n)
            if bool((self.cell_ref[cells] > 1).any()):
                fresh = self._alloc_cells(run.n)
                for name in ("keys", "k_cache", "v_cache"):
                    t = getattr(self, name)
                    if t is not None:
                        t[:, fresh] = t[:, cells]       # fresh cells: invisible until published below
                self._set(self._unwritten, (slice(None), fresh), self._unwritten[:, cells])
                self._txn.new_cells.append(fresh)
                self._release_cells(cells)
                cells_vec = _Vec.of(fresh)
                cells = fresh
            else:
                cells_vec = run.cells
            self._set(self.cell_pos, cells, positions)
            self._runs[slot] = self._rebuild(_Run(s + delta, run.n, cells_vec, run.groups))

    def copy(self, src: SeqHandle, dst: SeqHandle) -> None:
        """llama.cpp ``seq_cp``: ``dst``'s run becomes ``src``'s, sharing its cells and groups (each side
        gets fresh cells for what it appends later)."""
        with self._op():
            s_slot, d_slot = self._slot(src), self._slot(dst)
            if s_slot == d_slot:
                return
            self._settle(s_slot)
            self._settle(d_slot)
            self._release_run(self._runs[d_slot])
            run = self._runs[s_slot]
            self._share_run(run)
            self._runs[d_slot] = run

    def fork(self, src: SeqHandle) -> SeqHandle:
        """A new sequence sharing ``src``'s run."""
        with self._op():
            self._slot(src)
            handle = self.new_sequence()
            self.copy(src, handle)
            return handle

    def keep(self, seq: SeqHandle) -> None:
        """llama.cpp ``seq_keep``: free every other sequence."""
        with self._op():
            slot = self._slot(seq)
            for h in self.slots.live_handles():
                if h.slot != slot:
                    self.free(h)

    # ------------------------------------------------------------------------------------------
    # Planning
    # ------------------------------------------------------------------------------------------

    def plan(self, layer: int, chunk: ReservedChunk, q: torch.Tensor, top_k: int) -> QSAPlan:
        """Select, for each chunk token as a query at its position p, the top-k groups of the visible run
        ``[p0, p]`` and return them with the tail as physical cells (one ``qsa_select`` call).

        With a window, each query's visible run starts at its own position's window start (SPEC §3),
        and its groups (``q_groups``, ``selected_groups``) are anchored there.

        Args:
            layer: cache layer index (its keys for this chunk must have been written).
            chunk: the chunk whose tokens are the queries (reserved in this or an earlier transaction;
                the runs must still hold its tokens).
            q: Tensor[T, Hq, D] indexer queries, normed and roped by the model.
            top_k: groups to keep per query (budget / r).

        Raises:
            HoleError when a visible run is not contiguous (checked over every cell before selecting).
        """
        layer = self._layer(layer)
        if top_k < 1:
            raise HebrusError(f"QSACache.plan: top_k must be >= 1, got {top_k}")
        slots = self._check_chunk(chunk, "plan")
        t = chunk.num_tokens
        if q.dim() != 3 or q.shape[0] != t or q.shape[2] != self.head_dim:
            raise HebrusError(f"QSACache.plan: q must be [T={t}, Hq, D={self.head_dim}], got {list(q.shape)}")
        r = self.compress_ratio
        dev = self.device
        if bool(self._unwritten[layer, chunk.cells].any()):
            raise HebrusError(f"QSACache.plan: layer {layer} keys of this chunk are not written yet; call write first")
        counts = chunk.counts
        b = len(slots)
        starts = list(chunk._starts) if chunk._starts is not None else \
            [int(chunk.positions[o]) if c else 0 for o, c in zip(chunk.cu_seqlens[:-1].tolist(), counts)]
        p0_list, nvis_list, vis, grp = [], [], [], []
        for i, slot in enumerate(slots):
            run = self._runs[slot]
            nvis = starts[i] + counts[i] - run.p0 if counts[i] else 0
            if counts[i] and (starts[i] < run.p0 or nvis > run.n):
                raise HoleError(f"QSACache.plan: {chunk.handles[i]} holds [{run.p0}, {run.p0 + run.n - 1}] but the "
                                f"chunk queries positions [{starts[i]}, {starts[i] + counts[i] - 1}]")
            p0_list.append(run.p0)
            nvis_list.append(nvis)
            vis.append(run.cells.tensor()[:nvis])
            grp.append(run.groups.tensor()[:nvis // r])
        if t == 0:
            empty = torch.empty((0, top_k * r + r - 1), dtype=torch.int64, device=dev)
            return QSAPlan(torch.empty((0, top_k), dtype=torch.int32, device=dev),
                           torch.empty(0, dtype=torch.int32, device=dev), empty.to(torch.int32), empty,
                           chunk.positions.clone(), torch.empty(0, dtype=torch.int64, device=dev), r, int(top_k))
        # Contiguity of every visible run, all rows at once.
        vis_cells = torch.cat(vis)
        nv = torch.tensor(nvis_list, dtype=torch.int64, device=dev)
        p0s = torch.tensor(p0_list, dtype=torch.int64, device=dev)
        base = torch.cumsum(nv, 0) - nv
        total = vis_cells.numel()
        expected = (torch.repeat_interleave(p0s - base, nv, output_size=total) + self._arange(total))
        got = self.cell_pos[vis_cells]
        bad = got != expected
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0])
            i = int(torch.searchsorted(base, torch.tensor([j], device=dev), right=True)[0]) - 1
            raise HoleError(f"QSACache.plan: {chunk.handles[i]} run starting at {p0_list[i]} has cell "
                            f"{int(vis_cells[j])} at position {int(got[j])} where {int(expected[j])} is required "
                            f"(a hole inside the run is not padding)")
        counts_t = torch.tensor(counts, dtype=torch.int64, device=dev)
        q_rows = torch.repeat_interleave(torch.arange(b, device=dev), counts_t, output_size=t)
        q_base, row_p0 = base[q_rows], p0s[q_rows]
        if bool((vis_cells[q_base + chunk.positions - row_p0] != chunk.cells).any()):
            raise HoleError("QSACache.plan: the chunk's cells no longer match its sequences' runs")
        # Each query's own visible run [q_p0, p] (SPEC §3): with a window, whole groups past the row's
        # anchor are evicted until at most `window` positions remain.
        if self.window is None:
            q_p0 = row_p0
        else:
            anchors = list(chunk._anchors) if chunk._anchors is not None else p0_list
            anchor = torch.tensor(anchors, dtype=torch.int64, device=dev)[q_rows]
            over = chunk.positions - anchor + 1 - self.window
            q_p0 = anchor + r * torch.clamp(-torch.div(-over, r, rounding_mode="floor"), min=0)
            lost = (q_p0 < row_p0) | ((q_p0 - row_p0) % r != 0)
            if bool(lost.any()):
                j = int(torch.nonzero(lost)[0])
                i = int(q_rows[j])
                raise HoleError(f"QSACache.plan: the query of {chunk.handles[i]} at position "
                                f"{int(chunk.positions[j])} sees [{int(q_p0[j])}, {int(chunk.positions[j])}] but the "
                                f"run now starts at {p0_list[i]} (evicted or moved since reserve: plan a windowed "
                                f"chunk in the transaction that reserved it)")
        q_skip = (q_p0 - row_p0) // r           # the row's groups before the query's anchor
        # Pooled rows of each row's visible groups, -1 past the end.
        gcounts = [g.numel() for g in grp]
        flat = torch.cat(grp)
        max_g = max(gcounts + [1])
        seq_groups = torch.full((b, max_g), -1, dtype=torch.int64, device=dev)
        if flat.numel():
            if bool(self._pending[layer, flat].any()):
                raise HebrusError(f"QSACache.plan: some groups of layer {layer} are not pooled yet (keys of an "
                                  f"earlier chunk not written for this layer)")
            gc = torch.tensor(gcounts, dtype=torch.int64, device=dev)
            g_rows = torch.repeat_interleave(torch.arange(b, device=dev), gc, output_size=flat.numel())
            g_cols = self._arange(flat.numel()) - torch.repeat_interleave(torch.cumsum(gc, 0) - gc, gc,
                                                                          output_size=flat.numel())
            seq_groups[g_rows, g_cols] = flat
        # One selection row per (row, anchor) pair: the row's groups from the query's anchor on.
        key = q_rows * (max_g + 1) + q_skip
        pairs, sel_row = torch.unique(key, return_inverse=True)
        cols = (pairs % (max_g + 1))[:, None] + self._arange(max_g)[None, :]
        sel_groups = torch.where(cols < max_g, seq_groups[(pairs // (max_g + 1))[:, None], cols.clamp(max=max_g - 1)],
                                 -1)
        nvis_q = chunk.positions - q_p0 + 1
        q_groups = (nvis_q // r).to(torch.int32)
        selected = qsa_select(q, self.pooled[layer], sel_groups.to(torch.int32), sel_row.to(torch.int32), q_groups,
                              int(top_k))
        # Token offsets within the query's run: selected groups' tokens, then the tail, then -1 padding.
        sel = selected.to(torch.int64)
        g_offs = (r * sel[:, :, None] + torch.arange(r, device=dev)).reshape(t, -1)
        g_offs = torch.where(sel.repeat_interleave(r, dim=1) >= 0, g_offs, -1)
        t_offs = r * q_groups.to(torch.int64)[:, None] + torch.arange(r - 1, device=dev)[None, :]
        t_offs = torch.where(t_offs < nvis_q[:, None], t_offs, -1)
        offs = torch.cat((g_offs, t_offs), dim=1)
        order = torch.sort((offs < 0).to(torch.int8), dim=1, stable=True).indices
        offs = offs.gather(1, order)
        valid = offs >= 0
        at = (q_base + q_p0 - row_p0)[:, None] + offs.clamp(min=0)
        token_cells = torch.where(valid, vis_cells[at], -1)
        token_positions = torch.where(valid, offs + q_p0[:, None], -1)
        return QSAPlan(selected_groups=selected, q_groups=q_groups, token_cells=token_cells.to(torch.int32),
                       token_positions=token_positions, positions=chunk.positions.clone(), q_rows=q_rows,
                       compress_ratio=r, top_k=int(top_k))

    # ------------------------------------------------------------------------------------------
    # Saved state: one sequence
    # ------------------------------------------------------------------------------------------

    def _check_clean(self, what: str, runs: Sequence[_Run]) -> None:
        if self._txn is None:
            return
        for run in runs:
            cells, rows = run.cells.tensor(), run.groups.tensor()
            if bool(self._unwritten[:, cells].any()) or bool(self._pending[:, rows].any()):
                raise HebrusError(f"QSACache.{what}: the transaction has cells not written yet; write every layer "
                                  f"of the reserved chunks first")

    def save(self, seq: SeqHandle) -> bytes:
        """The sequence's run, raw keys and K/V as a checksummed blob (no pickle). Pooled groups are
        derived state: ``restore`` rebuilds them."""
        run = self._view(self._slot(seq))
        self._check_clean("save", [run])
        self._check_run(seq, run, "save")
        cells = run.cells.tensor()
        tensors = {"positions": self.cell_pos[cells], "keys": self.keys[:, cells]}
        if self.has_kv:
            tensors["k"] = self.k_cache[:, cells]
            tensors["v"] = self.v_cache[:, cells]
        meta = {"config": self._seq_config(), "p0": run.p0, "n": run.n}
        return _blob.pack(_SEQ_KIND, meta, tensors)

    def restore(self, seq: SeqHandle | None, blob: bytes) -> SeqHandle:
        """Restore a blob of :meth:`save`. ``seq=None`` restores into a new sequence; a free slot's handle
        (e.g. one a ModelCache issued) is claimed via ``new_sequence(handle)``; a live handle has its run
        replaced. Everything (format, checksum, config, shapes, dtypes, contiguity) is validated
        before anything changes: ``CorruptStateError`` (``HoleInSavedStateError`` for a hole)."""
        return self._restore_decoded(seq, self._decode_seq(blob))

    def _decode_seq(self, blob: bytes) -> tuple[int, int, dict[str, torch.Tensor]]:
        """``(p0, n, tensors)`` of a blob of :meth:`save`, completely validated (CorruptStateError)."""
        meta, tensors = _blob.unpack(blob, _SEQ_KIND)
        kind = "QSACache.restore"
        _blob.expect(kind, _blob.same(meta.get("config"), self._seq_config()),
                     f"blob was saved by a cache configured {_blob.short(meta.get('config'))}, this one is "
                     f"{self._seq_config()}")
        p0, n = meta.get("p0"), meta.get("n")
        _blob.expect(kind, type(p0) is int and type(n) is int and p0 >= 0 and 0 <= n <= self.capacity
                     and p0 + n - 1 <= MAX_POSITION, f"bad run p0={_blob.short(p0)} n={_blob.short(n)} (integers, "
                                                     f"0 <= n <= capacity, p0 >= 0, p0 + n - 1 <= {MAX_POSITION})")
        want = {"positions": ((n,), torch.int64), "keys": ((self.num_layers, n, self.head_dim), self.dtype)}
        if self.has_kv:
            want["k"] = ((self.num_layers, n, self.kv_heads, self.kv_head_dim), self.dtype)
            want["v"] = ((self.num_layers, n, self.kv_heads, self.v_head_dim), self.dtype)
        _blob.expect(kind, set(tensors) == set(want), f"tensors {sorted(tensors)} != {sorted(want)}")
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            _blob.expect(kind, tuple(t.shape) == shape and t.dtype == dtype,
                         f"tensor {name} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
        expected = p0 + torch.arange(n, dtype=torch.int64)
        bad = tensors["positions"] != expected
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0])
            raise HoleInSavedStateError(f"{kind}: saved run [{p0}, {p0 + n - 1}] holds position "
                                        f"{int(tensors['positions'][j])} where {p0 + j} is required (a hole)")
        return p0, n, tensors

    def _restore_decoded(self, seq: SeqHandle | None, decoded: tuple[int, int, dict[str, torch.Tensor]]) -> SeqHandle:
        """Publish what :meth:`_decode_seq` validated (see :meth:`restore`)."""
        p0, n, tensors = decoded
        expected = p0 + torch.arange(n, dtype=torch.int64)
        with self._op():
            if seq is None:
                seq = self.new_sequence()
            else:
                if not isinstance(seq, SeqHandle):
                    raise HebrusError(f"QSACache.restore: expected a SeqHandle or None, got {type(seq).__name__}")
                if 0 <= seq.slot < self.max_sequences and bool(self.slots.live[seq.slot]):
                    self._slot(seq)
                    self._settle(seq.slot)
                    run = self._runs[seq.slot]
                    self._release_run(run)
                    self._runs[seq.slot] = _Run(0, 0, _Vec.empty(self.device), _Vec.empty(self.device))
                else:
                    seq = self.new_sequence(seq)
            cells = self._alloc_cells(n)
            dev = self.device
            if n:
                self._set(self.cell_pos, cells, expected.to(dev))
                self.keys[:, cells] = tensors["keys"].to(dev)
                if self.has_kv:
                    self.k_cache[:, cells] = tensors["k"].to(dev)
                    self.v_cache[:, cells] = tensors["v"].to(dev)
            run = _Run(p0, n, _Vec.of(cells), _Vec.empty(dev))
            self._runs[seq.slot] = self._rebuild(run)
            return seq

    # ------------------------------------------------------------------------------------------
    # Whole-holder state
    # ------------------------------------------------------------------------------------------

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        if self._txn is not None:
            raise HebrusError("QSACache.state_dict cannot run inside a transaction (its changes are not published)")
        self._check_clean("state_dict", list(self._runs.values()))
        live_slots = sorted(self._runs)
        seq_p0 = torch.zeros(self.max_sequences, dtype=torch.int64)
        seq_n = torch.zeros(self.max_sequences, dtype=torch.int64)
        cells, rows = [], []
        for slot in live_slots:
            run = self._runs[slot]
            seq_p0[slot], seq_n[slot] = run.p0, run.n
            cells.append(run.cells.tensor().cpu())
            rows.append(run.groups.tensor().cpu())
        free = self.cell_ref == 0
        keys = self.keys.clone()
        keys[:, free] = 0
        out = {"cell_pos": self.cell_pos.clone(), "cell_ref": self.cell_ref.clone(), "keys": keys}
        if self.has_kv:
            k, v = self.k_cache.clone(), self.v_cache.clone()
            k[:, free] = 0
            v[:, free] = 0
            out["k_cache"], out["v_cache"] = k, v
        pooled = self.pooled.clone()
        pooled[:, self.group_ref == 0] = 0
        out.update({
            "pooled": pooled, "group_ref": self.group_ref.clone(),
            "generation": self.slots.generation.clone(), "live": self.slots.live.clone(),
            "seq_p0": seq_p0, "seq_n": seq_n,
            "seq_cells": torch.cat(cells) if cells else torch.empty(0, dtype=torch.int64),
            "seq_groups": torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64),
            "norm_weight": self.norm_weight.clone(), "inv_freq": self.inv_freq.clone(),
        })
        return out

    @staticmethod
    def _checksum(tensors: dict[str, torch.Tensor]) -> str:
        return _blob.digest_of(sorted(tensors.items()))

    def get_extra_state(self) -> dict[str, Any]:
        """JSON-like metadata saved under ``_extra_state``: format, version, config and a sha256 of all
        the holder's state tensors."""
        return self._extra_state_for(self._state_tensors())

    def _extra_state_for(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"format": _HOLDER_FORMAT, "version": _HOLDER_VERSION, "config": self._config(),
                "heads": [self._cell_head, self._row_head], "checksum": self._checksum(tensors)}

    def set_extra_state(self, state: Any) -> None:
        raise HebrusError("QSACache: load the whole holder with load_state_dict")

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401 (nn.Module hook)
        tensors = self._state_tensors()
        for name, t in tensors.items():
            destination[prefix + name] = t
        destination[prefix + "_extra_state"] = self._extra_state_for(tensors)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.__dict__.pop("_loaded_by_owner", False):  # a ModelCache over it has just loaded it
            return
        # torch passes strict=True here, whatever its caller asked for: keys under our prefix are checked strictly.
        ours = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        self.load_state_dict(ours, strict=True)

    def _state_keys(self) -> set[str]:
        """The keys of this holder's state dict."""
        names = ["cell_pos", "cell_ref", "keys", "pooled", "group_ref", "generation", "live", "seq_p0",
                 "seq_n", "seq_cells", "seq_groups", "norm_weight", "inv_freq"]
        if self.has_kv:
            names += ["k_cache", "v_cache"]
        return {*names, "_extra_state"}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Everything ``load_state_dict`` validates (format, version, config, checksum, shapes, dtypes,
        refcounts, contiguity, handle table), without changing anything. Raises ``CorruptStateError``."""
        self._validate_state(self._as_dict(state_dict))

    def publish_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Publish a state dict that :meth:`check_state_dict` accepted (validated again; atomic)."""
        self._publish_state(self._validate_state(self._as_dict(state_dict)))

    @staticmethod
    def _as_dict(state_dict: Any) -> dict[str, Any]:
        if not isinstance(state_dict, dict):
            raise CorruptStateError(f"QSACache.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        return dict(state_dict)

    def _load_state(self, sd: dict[str, Any]) -> None:
        self._publish_state(self._validate_state(sd))

    def _validate_state(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The candidate of a state dict, completely validated (CorruptStateError otherwise)."""
        kind = "QSACache.load_state_dict"
        expect = _blob.expect
        extra = sd.get("_extra_state")
        expect(kind, isinstance(extra, dict), "missing or malformed _extra_state")
        expect(kind, _blob.same(extra.get("format"), _HOLDER_FORMAT)
               and _blob.same(extra.get("version"), _HOLDER_VERSION),
               f"format {_blob.short(extra.get('format'))} version {_blob.short(extra.get('version'))}, expected "
               f"{_HOLDER_FORMAT!r} version {_HOLDER_VERSION}")
        expect(kind, _blob.same(extra.get("config"), self._config()),
               f"state of a cache configured {_blob.short(extra.get('config'))}, this one is {self._config()}")
        names = self._state_keys() - {"_extra_state"}
        _blob.known_entries(kind, sd, self._state_keys(), strict=True)
        tensors = {k: v for k, v in sd.items() if k != "_extra_state"}
        expect(kind, set(tensors) == names, f"the state dict lacks {sorted(names - set(tensors))}")
        _blob.check_tensors(kind, tensors)
        C, L, D, S, r = self.capacity, self.num_layers, self.head_dim, self.max_sequences, self.compress_ratio
        gcap = tensors["group_ref"].shape[0] if tensors["group_ref"].dim() == 1 else -1
        want = {"cell_pos": ((C,), torch.int64), "cell_ref": ((C,), torch.int32), "keys": ((L, C, D), self.dtype),
                "pooled": ((L, gcap, D), self.dtype), "group_ref": ((gcap,), torch.int32),
                "generation": ((S,), torch.int64), "live": ((S,), torch.bool),
                "seq_p0": ((S,), torch.int64), "seq_n": ((S,), torch.int64),
                "norm_weight": (tuple(self.norm_weight.shape), torch.float32),
                "inv_freq": (tuple(self.inv_freq.shape), torch.float32)}
        if self.has_kv:
            want["k_cache"] = ((L, C, self.kv_heads, self.kv_head_dim), self.dtype)
            want["v_cache"] = ((L, C, self.kv_heads, self.v_head_dim), self.dtype)
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            expect(kind, tuple(t.shape) == shape and t.dtype == dtype,
                   f"{name} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
        expect(kind, gcap >= 1, "group_ref must have at least one row")
        for name in ("seq_cells", "seq_groups"):
            expect(kind, tensors[name].dim() == 1 and tensors[name].dtype == torch.int64, f"{name} must be int64 [N]")
        # Shapes, dtypes and devices are known good: now the bytes can be read.
        tensors = {k: v.detach().cpu() for k, v in tensors.items()}
        expect(kind, extra.get("checksum") == self._checksum(tensors), "checksum mismatch: modified or truncated")
        expect(kind, torch.equal(tensors["norm_weight"], self.norm_weight.cpu())
               and torch.equal(tensors["inv_freq"], self.inv_freq.cpu()),
               "norm_weight / inv_freq differ from this cache's (state of another model)")
        gen, live = tensors["generation"], tensors["live"]
        p0s, ns = tensors["seq_p0"], tensors["seq_n"]
        problem = generation_problem(gen.tolist(), live.tolist())
        expect(kind, problem is None, f"the slot table is invalid: {problem}")
        expect(kind, bool((p0s >= 0).all()) and bool((ns >= 0).all()), "negative p0 or n")
        expect(kind, bool((p0s - 1 <= MAX_POSITION - ns).all()), f"a run passes the largest position {MAX_POSITION}")
        expect(kind, bool((ns[~live] == 0).all()) and bool((p0s[~live] == 0).all()), "a free slot holds a run")
        live_slots = torch.nonzero(live).flatten().tolist()
        seq_cells, seq_groups = tensors["seq_cells"], tensors["seq_groups"]
        expect(kind, seq_cells.numel() == int(ns.sum()), f"seq_cells has {seq_cells.numel()} entries for "
                                                         f"{int(ns.sum())} positions")
        expect(kind, seq_groups.numel() == int((ns // r).sum()), "seq_groups does not match the runs' group counts")
        expect(kind, bool(((seq_cells >= 0) & (seq_cells < C)).all()), "seq_cells outside [0, capacity)")
        expect(kind, bool(((seq_groups >= 0) & (seq_groups < gcap)).all()), "seq_groups outside the row pool")
        cell_pos, cell_ref, group_ref = tensors["cell_pos"], tensors["cell_ref"], tensors["group_ref"]
        expect(kind, torch.equal(torch.bincount(seq_cells, minlength=C).to(torch.int32), cell_ref),
               "cell_ref does not count the runs' references")
        expect(kind, torch.equal(torch.bincount(seq_groups, minlength=gcap).to(torch.int32), group_ref),
               "group_ref does not count the runs' group rows")
        expect(kind, bool((cell_pos[cell_ref == 0] == -1).all()), "a free cell holds a position")
        runs: dict[int, tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        row_def_cells = torch.full((gcap, r), -1, dtype=torch.int64)
        row_def_pos = torch.full((gcap,), -1, dtype=torch.int64)
        at_c = at_g = 0
        for slot in live_slots:
            p0, n = int(p0s[slot]), int(ns[slot])
            cells = seq_cells[at_c:at_c + n]
            rows = seq_groups[at_g:at_g + n // r]
            at_c += n
            at_g += n // r
            expect(kind, torch.unique(cells).numel() == n, f"slot {slot} lists a cell twice")
            # Rows shared with other slots are checked against their definition below; one slot naming the
            # same row for two of its groups would make both groups read one pooled key.
            expect(kind, torch.unique(rows).numel() == rows.numel(), f"slot {slot} lists a pooled group row twice")
            bad = cell_pos[cells] != p0 + torch.arange(n)
            if bool(bad.any()):
                j = int(torch.nonzero(bad)[0])
                raise HoleInSavedStateError(f"{kind}: slot {slot} run [{p0}, {p0 + n - 1}] has cell {int(cells[j])} "
                                            f"at position {int(cell_pos[cells[j]])} where {p0 + j} is required")
            g = n // r
            gcells = cells[:g * r].reshape(g, r)
            gpos = p0 + r * torch.arange(g)
            known = row_def_pos[rows] >= 0
            expect(kind, bool((row_def_cells[rows][known] == gcells[known]).all())
                   and bool((row_def_pos[rows][known] == gpos[known]).all()),
                   f"slot {slot} shares a group row with a sequence whose group differs")
            row_def_cells[rows] = gcells
            row_def_pos[rows] = gpos
            runs[slot] = (p0, n, cells, rows)
        heads = extra.get("heads", [0, 0])
        expect(kind, isinstance(heads, list) and len(heads) == 2 and all(type(h) is int for h in heads),
               f"bad allocation heads {_blob.short(heads)} (two integers)")
        return {"tensors": tensors, "gen": gen, "live": live, "runs": runs, "row_def_cells": row_def_cells,
                "row_def_pos": row_def_pos, "heads": heads, "gcap": gcap}

    def _publish_state(self, cand: dict[str, Any]) -> None:
        """Publish a validated candidate, re-deriving the pooled groups."""
        self._swap_state(self._prepare_state(cand))

    def _prepare_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Validate a state dict and build everything its publish needs (see ``_prepare_state``)."""
        return self._prepare_state(self._validate_state(self._as_dict(state_dict)))

    def _prepare_state(self, cand: dict[str, Any]) -> dict[str, Any]:
        """The fallible part of publishing a validated candidate, before anything is published: every
        tensor on this cache's device, the runs, the slot table and the pooled groups re-derived."""
        tensors, gen, live, runs = cand["tensors"], cand["gen"], cand["live"], cand["runs"]
        row_def_cells, row_def_pos = cand["row_def_cells"], cand["row_def_pos"]
        heads, gcap = cand["heads"], cand["gcap"]
        L, C = self.num_layers, self.capacity
        dev = self.device

        def fresh(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device=dev).copy_(t)

        new = {name: fresh(tensors[name]) for name in ("cell_pos", "cell_ref", "keys", "pooled", "group_ref")}
        if self.has_kv:
            new["k_cache"], new["v_cache"] = fresh(tensors["k_cache"]), fresh(tensors["v_cache"])
        new["_pending"] = torch.zeros((L, gcap), dtype=torch.bool, device=dev)
        new["_pend_cells"] = row_def_cells.clamp(min=0).to(dev)
        new["_pend_pos"] = row_def_pos.clamp(min=0).to(dev)
        new["_freed_rows"] = torch.zeros(gcap, dtype=torch.bool, device=dev)
        new["_unwritten"] = torch.zeros((L, C), dtype=torch.bool, device=dev)
        new["_freed_cells"] = torch.zeros(C, dtype=torch.bool, device=dev)
        used = torch.nonzero(row_def_pos >= 0).flatten().to(dev)
        if used.numel():
            new["pooled"][:, used] = torch.stack(
                [self._pool(layer, new["_pend_cells"][used], new["_pend_pos"][used], keys=new["keys"][layer],
                            cell_pos=new["cell_pos"]) for layer in range(L)])
        return {"tensors": new, "generation": [int(g) for g in gen.tolist()], "live": [bool(v) for v in live.tolist()],
                "runs": {slot: _Run(p0, n, _Vec.of(cells.to(dev)), _Vec.of(rows.to(dev)))
                         for slot, (p0, n, cells, rows) in runs.items()},
                "heads": (heads[0] % C, heads[1] % gcap)}

    def _swap_state(self, prepared: dict[str, Any]) -> None:
        """Publish what ``_prepare_state`` built: reference assignments only, nothing that can fail. Inside
        an open transaction its rollback restores the previous references (its savepoints keep them)."""
        for name, tensor in prepared["tensors"].items():
            setattr(self, name, tensor)
        self.slots.assign(prepared["generation"], prepared["live"])
        self._runs = prepared["runs"]
        self._cell_head, self._row_head = prepared["heads"]
        if self._txn is not None:   # what the open transaction staged refers to the state just replaced
            self._txn.new_cells = []
            self._txn.pending = [[] for _ in range(self.num_layers)]
            self._txn.evict = {}

    _swap_state_dict = _swap_state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a whole-holder state dict (validated completely before anything is published; pooled
        groups are re-derived from the raw keys). Raises ``CorruptStateError``.

        Keys this holder does not save are refused with ``strict=True``; ``strict=False`` leaves them out
        and returns them as ``unexpected_keys``. No key may be missing either way."""
        sd, unexpected = _blob.known_entries("QSACache.load_state_dict", self._as_dict(state_dict),
                                             self._state_keys(), strict)
        self._load_state(sd)
        return torch.nn.modules.module._IncompatibleKeys([], unexpected)

    # ------------------------------------------------------------------------------------------
    # Device / dtype moves
    # ------------------------------------------------------------------------------------------

    def _check_apply(self, fn) -> None:
        """What ``_apply`` refuses before anything changes (ModelCache checks both holders first)."""
        if self._txn is not None:
            raise HebrusError("QSACache: cannot move or cast the cache inside a transaction")
        check_cast("QSACache", fn, self.keys.dtype, self.keys.device)

    def _apply(self, fn, recurse: bool = True):
        self._check_apply(fn)
        nw, inv = self.norm_weight, self.inv_freq
        old_dtype, old_device = self.keys.dtype, self.keys.device
        super()._apply(fn, recurse)
        dev = self.cell_pos.device
        self.norm_weight = nw.to(dev)
        self.inv_freq = inv.to(dev)
        self.dtype = self.keys.dtype
        moved: dict[int, _Buf] = {}

        def mv(vec: _Vec) -> _Vec:
            buf = moved.get(id(vec.buf))
            if buf is None:
                buf = moved[id(vec.buf)] = _Buf(vec.buf.data.to(dev), vec.buf.claimed)
            return _Vec(buf, vec.start, vec.n)

        self._runs = {s: _Run(run.p0, run.n, mv(run.cells), mv(run.groups)) for s, run in self._runs.items()}
        if self.dtype != old_dtype or dev != old_device:
            # Pooled groups are derived state: re-derive them where (and in the dtype) they now live, so they
            # keep equalling a rebuild on this device bitwise (kernels of two devices round differently).
            rows = [run.groups.tensor() for run in self._runs.values()]
            if rows:
                rows = torch.unique(torch.cat(rows))
                if rows.numel():
                    for layer in range(self.num_layers):
                        self.pooled[layer, rows] = self._pool(layer, self._pend_cells[rows], self._pend_pos[rows])
        return self

    # ------------------------------------------------------------------------------------------
    # Digest
    # ------------------------------------------------------------------------------------------

    def _run_parts(self, tag: str, run: _Run) -> list[tuple[str, Any]]:
        cells, rows = run.cells.tensor(), run.groups.tensor()
        parts: list[tuple[str, Any]] = [(f"{tag}.run", [run.p0, run.n]), (f"{tag}.pos", self.cell_pos[cells])]
        unwritten = self._unwritten[:, cells]
        for name in ("keys", "k_cache", "v_cache"):
            t = getattr(self, name)
            if t is not None:
                c = t[:, cells]
                mask = unwritten.reshape(*unwritten.shape, *([1] * (c.dim() - 2)))
                parts.append((f"{tag}.{name}", torch.where(mask, torch.zeros((), dtype=c.dtype), c)))
        pooled = self.pooled[:, rows]
        pending = self._pending[:, rows][..., None]
        parts.append((f"{tag}.pooled", torch.where(pending, torch.zeros((), dtype=pooled.dtype), pooled)))
        return parts

    def digest(self, seq: SeqHandle | None = None) -> str:
        """sha256 of public state. ``seq=None``: the whole holder (config, every slot's generation and live
        flag, every live run with its positions, raw keys, K/V and pooled groups in logical order).
        With ``seq``: that sequence's content only (run, positions, keys, K/V, pooled), independent of
        its slot, so a restored copy digests like the original. Physical cell and row indices and free
        cells' contents are excluded."""
        if seq is not None:
            return _blob.digest_of(self._run_parts("seq", self._view(self._slot(seq))))
        parts: list[tuple[str, Any]] = [("config", self._config()), ("generation", self.slots.generation),
                                        ("live", self.slots.live)]
        for slot in sorted(self._runs):
            parts += self._run_parts(f"slot{slot}", self._view(slot))
        return _blob.digest_of(parts)

    def extra_repr(self) -> str:
        return (f"capacity={self.capacity}, num_layers={self.num_layers}, head_dim={self.head_dim}, "
                f"r={self.compress_ratio}, dtype={self.dtype}, kv={self.has_kv}, window={self.window}")


def _find_text_model(model: torch.nn.Module) -> torch.nn.Module:
    seen = 0
    m = model
    while seen < 4:
        if hasattr(m, "layers") and hasattr(m, "rotary_emb") and hasattr(m, "config"):
            return m
        for attr in ("model", "language_model", "text_model"):
            if hasattr(m, attr) and isinstance(getattr(m, attr), torch.nn.Module):
                m = getattr(m, attr)
                break
        else:
            break
        seen += 1
    raise HebrusError(f"QSACache.from_transformers: cannot find a Qwen4Exp text model in {type(model).__name__}")
