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

The device holds the keys, K/V planes and pooled rows (buffers: ``.to`` moves them). ``cell_pos``,
``cell_ref``, ``group_ref``, the transaction flags and the runs are host bookkeeping (CPU tensors on any
device, the same tensors as the device's on a CPU cache): allocation, the SPEC §4 checks and planning
decide from them without waiting for the device, and the kernels get the index tensors they need
uploaded (``_dev``, ``_upload``). A ``ReservedChunk`` carries its cells and positions on the device and,
privately, on the host.

Layout
------
``QSACache`` is a thin composition of one module per concern, each a mixin over the same buffers:
``runs`` (the run rules: contiguity, window starts, groups + tail; run records), ``allocator`` (cells and
group rows with refcounts), ``pooling`` (group rows, pending groups, rebuilds), ``lifecycle``
(reserve/write, window eviction, remove/rewind/shift/copy/fork/keep), ``planning`` (``plan``,
``ReservedChunk``, ``QSAPlan``), ``persistence`` (blobs, state dicts, digest) and ``transactions`` (undo
log, savepoints, commit hooks). This module holds construction, the kernel call that pools, and device
moves.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import HebrusError
from ..state.args import as_int, check_cast
from ..state.handles import SeqHandle, SlotTable
from ..state.layer_views import LayerViews
from ..state.plain_attrs import PlainAttrs
from ..state.transaction import Transactional
from .allocator import _Allocator
from .lifecycle import _Lifecycle
from .ops import qsa_pool, qsa_select  # noqa: F401  (qsa_pool is called here; qsa_select stays importable)
from .persistence import _HOLDER_FORMAT, _HOLDER_VERSION, _SEQ_KIND, _Persistence  # noqa: F401
from .planning import QSAPlan, ReservedChunk, _Planning
from .pooling import _Pooling
from .runs import MAX_POSITION, HoleInSavedStateError, _Buf, _Run, _RunTable, _Vec  # noqa: F401  (re-exported)
from .transactions import _STATE_TENSORS, _Savepoint, _Transactions, _Txn  # noqa: F401

__all__ = ["QSACache", "QSAPlan", "ReservedChunk", "HoleInSavedStateError", "MAX_POSITION"]

_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _FLOAT_DTYPES.items()}


class QSACache(PlainAttrs, _Persistence, _Planning, _Lifecycle, _Pooling, _Allocator, _Transactions,
               torch.nn.Module, Transactional):
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
            run keeps between ``window - r + 1`` and ``window`` positions once full; until its chunk
            is planned a sequence may hold up to ``window`` positions plus that chunk, so size
            ``capacity`` for the window plus the largest chunk. A single chunk longer than ``window``
            for one sequence is refused.
    """

    # Bookkeeping set on every transaction and operation, never a parameter, buffer or module (state/plain_attrs.py).
    _PLAIN_ATTRS = frozenset({"_txn", "_txn_depth_owner", "_cells_version", "_ref_version", "_free_count",
                              "_chunk_checked", "_plan_rows_memo", "_cell_head", "_row_head"})

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
        # Device data: keys, K/V planes and pooled rows (buffers: ``.to`` moves them).
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
        # Bookkeeping: on the host whatever the device (plain attributes, so ``.to`` leaves them there).
        # The allocator and the SPEC §4 checks decide from these without reading the device back; a
        # kernel that needs an index gets it uploaded (``_dev``). On a CPU cache they are the only copy.
        host = torch.device("cpu")
        self.cell_pos = torch.full((C,), -1, dtype=torch.int64, device=host)
        self.cell_ref = torch.zeros(C, dtype=torch.int32, device=host)
        self.group_ref = torch.zeros(gcap, dtype=torch.int32, device=host)
        # Transaction-only bookkeeping (all False / unused outside a transaction).
        self._unwritten = torch.zeros((L, C), dtype=torch.bool, device=host)
        self._pending = torch.zeros((L, gcap), dtype=torch.bool, device=host)
        self._pend_cells = torch.zeros((gcap, r), dtype=torch.int64, device=host)
        self._pend_pos = torch.zeros(gcap, dtype=torch.int64, device=host)
        self._freed_cells = torch.zeros(C, dtype=torch.bool, device=host)
        self._freed_rows = torch.zeros(gcap, dtype=torch.bool, device=host)
        self.slots = SlotTable(max_sequences, "QSACache")
        self._runs: dict[int, _Run] = _RunTable()
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}    # (_zero_of: a fill's value)
        self._fresh_flags: dict[int, torch.Tensor] = {}   # T -> Tensor[T] bool of True (step_plan's, read only)
        self._cells_version = 0       # counts writes of cell_pos / cell_ref (see _layout_key)
        self._ref_version = 0         # counts writes of cell_ref (free_cells' count is kept under it)
        self._free_count: tuple | None = None        # (cell_ref, _ref_version, cells free then)
        self._chunk_checked: tuple | None = None     # the last chunk whose cells passed _check_chunk, by layout
        self._no_pool: dict[int, list[torch.Tensor]] = {}   # step_plan's empty pool inputs, per compress ratio
        self._arrays: dict[int, tuple[torch.Tensor, Any]] = {}   # _array's numpy views of the host tables, by id
        self._layer_views = LayerViews()                     # StepPlan.layer_args' views of the planes
        self._plan_rows_memo: tuple | None = None    # the last chunk's layer-independent plan rows, by layout
        self._cell_head = 0
        self._row_head = 0
        self._txn: _Txn | None = None
        self._alloc_generator: torch.Generator | None = None   # tests: scrambled cell allocation

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
        from ..models.qwen4_exp.forward import find_text_model     # here: the model package imports this one

        text = find_text_model(model, "QSACache.from_transformers")
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

    @property
    def device(self) -> torch.device:
        """Where the keys, K/V planes and pooled rows live (the bookkeeping is on the host)."""
        return self.keys.device

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor (an index, positions) where a device tensor needs it: uploaded (the host does
        not wait for the copy), or ``t`` itself on a CPU cache."""
        return t if t.device == self.keys.device else t.to(self.keys.device)

    def _upload(self, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Host tensors where the device needs them: one host-to-device copy per dtype, returned as views
        of it in their shapes (nothing waits); on a CPU cache the tensors themselves."""
        dev = self.keys.device
        if dev.type == "cpu":
            return host
        out: list[torch.Tensor | None] = [None] * len(host)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(host):
            by_dtype.setdefault(t.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = torch.cat([host[i].reshape(-1) for i in idx]).to(dev)
            at = 0
            for i in idx:
                n = host[i].numel()
                out[i] = flat[at:at + n].view(host[i].shape)
                at += n
        return tuple(out)

    def free_cells(self) -> int:
        """Cells no sequence references (host bookkeeping: no read of the device). Counted once and then kept up
        to date by the allocator (:meth:`_free_count_known`); recounted whenever something else wrote ``cell_ref``."""
        known = self._free_count_known()
        if known is not None:
            return known
        count = int((self.cell_ref == 0).sum())
        self._free_count = (self.cell_ref, self._ref_version, count)
        return count

    def _free_count_known(self) -> int | None:
        """The free-cell count as of the last write of ``cell_ref``, when it was kept since; else None."""
        memo = self._free_count
        if memo is not None and memo[0] is self.cell_ref and memo[1] == self._ref_version:
            return memo[2]
        return None

    def _keep_free_count(self, before: int | None, change: int) -> None:
        """After the allocator's write of ``cell_ref`` that changed the free cells by ``change``: the count kept, when
        it was known before the write (``before``, from :meth:`_free_count_known`)."""
        if before is not None:
            self._free_count = (self.cell_ref, self._ref_version, before + change)

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
        """Host int64 [0, n)."""
        return torch.arange(n, dtype=torch.int64)

    def _pool(self, layer: int, gcells: torch.Tensor, gpos: torch.Tensor, *, keys: torch.Tensor | None = None,
              cell_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled keys (on the device) of groups ``gcells`` [G, r] at ``gpos`` [G] (host int64) for one layer,
        of the published keys and positions, or of ``keys`` [C, D] (device) and ``cell_pos`` [C] (host) not
        published yet.

        On a CPU cache the kernel reads the pool directly. Elsewhere the positions are host data: the
        groups' keys are gathered into [G*r, D] and the kernel gets their positions uploaded (it checks
        each group's contiguity from them as before) and local cell indices; it reads the same values,
        so the pooled keys are the same bitwise."""
        keys = self.keys[layer] if keys is None else keys
        cell_pos = self.cell_pos if cell_pos is None else cell_pos
        if keys.device == cell_pos.device:
            return qsa_pool(keys, cell_pos, gcells.to(torch.int32), gpos, self.norm_weight[layer], self.eps,
                            self.inv_freq)
        g, r = gcells.shape
        flat = gcells.reshape(-1)
        local = torch.arange(g * r, dtype=torch.int32).reshape(g, r)
        flat, pos, gpos, local = self._upload(flat, cell_pos[flat], gpos, local)
        return qsa_pool(keys.index_select(0, flat), pos, local, gpos, self.norm_weight[layer], self.eps, self.inv_freq)

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
        dev = self.keys.device
        self.norm_weight = nw.to(dev)
        self.inv_freq = inv.to(dev)
        self.dtype = self.keys.dtype
        # (the bookkeeping and the runs' cells and rows stay on the host)
        if self.dtype != old_dtype or dev != old_device:
            # Pooled groups are derived state: re-derive them where (and in the dtype) they now live, so they
            # keep equalling a rebuild on this device bitwise (kernels of two devices round differently).
            rows = [run.groups.tensor() for run in self._runs.values()]
            if rows:
                rows = torch.unique(torch.cat(rows))
                if rows.numel():
                    at = self._dev(rows)
                    for layer in range(self.num_layers):
                        self.pooled[layer, at] = self._pool(layer, self._pend_cells[rows], self._pend_pos[rows])
        return self

    def extra_repr(self) -> str:
        return (f"capacity={self.capacity}, num_layers={self.num_layers}, head_dim={self.head_dim}, "
                f"r={self.compress_ratio}, dtype={self.dtype}, kv={self.has_kv}, window={self.window}")
