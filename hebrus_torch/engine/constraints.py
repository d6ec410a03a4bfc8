"""Structured output: a request's tokens constrained to a grammar (a JSON schema, any JSON object), with
llguidance (docs/serving.md says why that engine).

- :class:`Constraint`: what a request asks for (``Constraint.json_schema(schema)``, ``Constraint.json_object()``,
  ``Constraint.lark(grammar)``); hashable, the key of the compile cache.
- :func:`compile_constraint`: a Constraint compiled against a tokenizer and the model's vocabulary width, or a
  :class:`ConstraintError` naming what is wrong (a schema llguidance cannot compile, one too large). Cached by
  (tokenizer, width, end tokens, constraint): a schema seen before costs a dictionary lookup.
- :class:`GrammarState`: one request's matcher (``Request.constraint``). The engine advances it with the tokens
  appended to the request (``outputs._append``: after the step's transaction committed, so a step undone and
  retried leaves it as it was), checks a request's drafts against it before the step is planned
  (:func:`grammar_drafts`) and, inside the step, masks the logits rows of every constrained request
  (:func:`mask_logits`): the masks of all of them are computed on the host while the device runs the
  forward, then uploaded in one copy and applied with one ``index_put`` on the device, before sampling and
  verification read the logits. A step without constrained rows does none of this.

A verification row of k drafts wants k + 1 masks: the grammar's state after each prefix of its drafts (the
matcher is advanced through them and rolled back inside llguidance's executor). The drafts were cut at the
first token the grammar refuses (:func:`grammar_drafts`), so every one of them has a mask.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy
import torch

from .sampling import BadRequestError

if TYPE_CHECKING:
    from .logits_layout import LogitsLayout
    from .requests import Request
    from .scheduler import ScheduledChunk

__all__ = ["Constraint", "CompiledConstraint", "ConstraintError", "GrammarState", "compile_constraint",
           "grammar_drafts", "mask_logits", "MaskBuffer", "end_token_ids", "MAX_SCHEMA_BYTES", "COMPILE_CACHE_SIZE",
           "JSON_OPTIONS"]

MAX_SCHEMA_BYTES = 64 * 1024      # a schema's JSON text longer than this is refused ("too large")
COMPILE_CACHE_SIZE = 256          # compiled constraints kept per (tokenizer, vocabulary width, end tokens)
MAX_GRAMMAR_SYMBOLS = 200_000     # llguidance's max_grammar_size for one request's grammar (its default: 500k)

# JSON as compact as json.dumps(separators=(",", ":")) unless the schema's "x-guidance" says otherwise: free
# whitespace lets a model pad forever, and a bounded schema then forces the end of the output.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ConstraintError(BadRequestError):
    """A constraint that cannot be used: a schema llguidance cannot compile, one too large, a tokenizer it
    cannot read. Its message names the problem (a server answers it with a 400)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ConstraintError("structured output needs llguidance (pip install 'hebrus_torch[serve]')") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a request's output must be.

    Attributes:
        kind: ``"json_schema"`` (``source``: the schema as canonical JSON text), ``"json_object"`` (any JSON
            object; ``source`` empty) or ``"lark"`` (``source``: a grammar in llguidance's Lark dialect).
        source: the schema's compact JSON text (equal schemas share one compiled grammar), or the grammar.
        name: a label for messages (OpenAI's ``json_schema.name``, a tool's name); not part of the cache key.
    """

    kind: str
    source: str = ""
    name: str = field(default="", compare=False)

    @classmethod
    def json_schema(cls, schema: dict | str | bool, name: str = "") -> "Constraint":
        """The output must be JSON valid against ``schema`` (a dict, True, or its JSON text).

        Raises:
            ConstraintError: not a JSON schema object, or longer than ``MAX_SCHEMA_BYTES`` as JSON text.
        """
        what = f"schema {name!r}" if name else "the schema"
        if isinstance(schema, str):
            if len(schema.encode()) > MAX_SCHEMA_BYTES:
                raise ConstraintError(f"{what} is too large: {len(schema.encode())} bytes of JSON (at most "
                                      f"{MAX_SCHEMA_BYTES})")
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise ConstraintError(f"{what} is not valid JSON: {err}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ConstraintError(f"{what} must be a JSON object, got {type(schema).__name__}")
        try:
            # (keys kept in their order: the grammar writes an object's properties in the schema's order)
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ConstraintError(f"{what} is not JSON: {err}") from None
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise ConstraintError(f"{what} is too large: {len(text.encode())} bytes of JSON (at most "
                                  f"{MAX_SCHEMA_BYTES})")
        return cls("json_schema", text, name)

    @classmethod
    def json_object(cls) -> "Constraint":
        """The output must be a JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def lark(cls, grammar: str, name: str = "") -> "Constraint":
        """The output must match ``grammar``, in llguidance's Lark dialect (``%json {schema}`` embeds a JSON schema:
        how a server constrains a tool call to its chat format).

        Raises:
            ConstraintError: not a string, or longer than ``MAX_SCHEMA_BYTES``.
        """
        if not isinstance(grammar, str):
            raise ConstraintError(f"a Lark grammar must be a string, got {type(grammar).__name__}")
        if len(grammar.encode()) > MAX_SCHEMA_BYTES:
            raise ConstraintError(f"the grammar{f' for {name!r}' if name else ''} is too large: "
                                  f"{len(grammar.encode())} bytes (at most {MAX_SCHEMA_BYTES})")
        return cls("lark", grammar, name)

    def schema(self) -> dict:
        """The JSON schema this constraint compiles (a json_object's is ``{"type": "object"}``)."""
        return json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A constraint's grammar, checked against one tokenizer: what each request's matcher is built from.

    Attributes:
        constraint: what was compiled.
        grammar: llguidance's grammar (JSON text).
        tokenizer: the ``llguidance.LLTokenizer`` it was checked against.
        vocab_size: the width of the logits its masks cover (the model's vocabulary, maybe wider than the
            tokenizer's: the ids beyond the tokenizer's are never allowed).
        end_tokens: the ids that end the output once the grammar is complete (the tokenizer's EOS and the ones
            given to :func:`compile_constraint`).
        seconds: what compiling it took (0 when it came from the cache).
        template: the grammar's matcher at its start, which each request's is a copy of (a copy shares the
            parsed grammar and the lexer's states built so far: tens of microseconds instead of a rebuild in
            milliseconds, and later requests' masks find the states earlier ones built).
    """

    constraint: Constraint
    grammar: str
    tokenizer: Any
    vocab_size: int
    end_tokens: frozenset[int]
    seconds: float = 0.0
    template: Any = field(default=None, repr=False)

    def state(self) -> "GrammarState":
        """A fresh matcher for one request."""
        return GrammarState(self)


def _limits():
    return _llguidance().LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


class GrammarState:
    """One request's position in its grammar (an ``llguidance.LLMatcher``).

    ``advance`` moves it with the request's tokens; ``failure`` says why the request cannot go on (the matcher
    refused a token, or the grammar allowed no token of the vocabulary). Once the grammar is complete its mask
    allows the end tokens (and, when it takes nothing more, only them): the request ends with one, as it would
    with its EOS, speculating or not. ``finished`` is True once an end token was taken, or when the grammar
    takes nothing more and there is no end token to take.
    """

    def __init__(self, compiled: CompiledConstraint):
        self.compiled = compiled
        if compiled.template is not None:
            with _lock:        # (one thread at a time in the template; its copies are the requests' own)
                self.matcher = compiled.template.deep_copy()
        else:
            self.matcher = _llguidance().LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0, limits=_limits())
        self.ended = False
        self.failure: str | None = None
        if self.matcher.is_error():
            self.failure = f"the grammar failed: {self.matcher.get_error()}"

    @property
    def finished(self) -> bool:
        return self.ended or (not self.compiled.end_tokens and self.failure is None and self.matcher.is_stopped())

    def ends_with(self, token: int) -> bool:
        """Whether ``token`` ends the output (an end token: the mask allows one only where the grammar is
        complete)."""
        return token in self.compiled.end_tokens

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume the tokens appended to the request (an end token the grammar accepts ends it).

        Raises:
            ConstraintError: a token the grammar refuses (the request fails with it).
        """
        for token in tokens:
            if self.failure is not None:
                break
            if token in self.compiled.end_tokens and self.matcher.is_accepting():
                self.ended = True
                break
            if not self.matcher.consume_token(int(token)):
                self.failure = f"the grammar refused token {int(token)}: {self.matcher.get_error()}"
        if self.failure is not None:
            raise ConstraintError(f"structured output: {self.failure}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar takes from here, in order."""
        if self.failure is not None or self.ended or not tokens:
            return 0
        n = self.matcher.validate_tokens([int(t) for t in tokens])
        return min(n, len(tokens))


# ------------------------------------------------------------------------------------------------ compiling
_lock = threading.Lock()
# tokenizer -> {(width, end tokens): (LLTokenizer, its compile cache: Constraint -> CompiledConstraint)}
_tokenizers: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer: Any, vocab_size: int, end_tokens: frozenset[int]) -> tuple[Any, OrderedDict]:
    llg = _llguidance()
    backend = getattr(tokenizer, "tokenizer", tokenizer)        # a processor's tokenizer
    key = (vocab_size, end_tokens)
    with _lock:
        per = _tokenizers.setdefault(backend, {})
        found = per.get(key)
    if found is not None:
        return found
    if getattr(backend, "backend_tokenizer", None) is None:
        raise ConstraintError(f"structured output needs a fast (Rust-backed) Hugging Face tokenizer, got "
                              f"{type(backend).__name__}")
    eos = sorted(end_tokens)
    try:
        ll = llg.hf.from_tokenizer(backend, n_vocab=vocab_size, eos_token=eos or None)
    except Exception as err:  # noqa: BLE001 - llguidance's own reason
        raise ConstraintError(f"structured output: llguidance cannot read the tokenizer ({vocab_size} ids): "
                              f"{err}") from None
    with _lock:
        found = per.setdefault(key, (ll, OrderedDict()))
    return found


def end_token_ids(tokenizer: Any, extra: Iterable[int] = ()) -> frozenset[int]:
    """The tokenizer's EOS id and ``extra`` (a generation config's EOS ids), negatives dropped."""
    backend = getattr(tokenizer, "tokenizer", tokenizer)
    ids = set(int(t) for t in extra if int(t) >= 0)
    eos = getattr(backend, "eos_token_id", None)
    if isinstance(eos, int) and eos >= 0:
        ids.add(eos)
    return frozenset(ids)


def compile_constraint(constraint: Constraint, tokenizer: Any, vocab_size: int,
                       end_tokens: Iterable[int] = ()) -> CompiledConstraint:
    """``constraint`` compiled for ``tokenizer`` (a fast Hugging Face tokenizer, or a processor holding one)
    and logits of ``vocab_size`` columns; ``end_tokens`` (EOS ids) end the output once the grammar is complete,
    with the tokenizer's EOS. Cached: a constraint compiled before for the same tokenizer, width and end tokens
    comes back at once (its ``seconds`` then 0).

    Raises:
        ConstraintError: naming the problem (the schema's, or a grammar too large for llguidance's limits).
    """
    if not isinstance(constraint, Constraint):
        raise ConstraintError(f"a constraint must be a Constraint, got {type(constraint).__name__}")
    llg = _llguidance()
    ends = end_token_ids(tokenizer, end_tokens)
    ll, cache = _ll_tokenizer(tokenizer, int(vocab_size), ends)
    with _lock:
        hit = cache.get(constraint)
        if hit is not None:
            cache.move_to_end(constraint)
            return dataclasses.replace(hit, seconds=0.0)
    t0 = time.perf_counter()
    what = (f"{'grammar' if constraint.kind == 'lark' else 'schema'} {constraint.name!r}" if constraint.name else
            "the grammar" if constraint.kind == "lark" else "the schema")
    try:
        grammar = (llg.LLMatcher.grammar_from_lark(constraint.source) if constraint.kind == "lark" else
                   llg.LLMatcher.grammar_from_json_schema(constraint.schema(), defaults=JSON_OPTIONS))
    except (ValueError, TypeError) as err:
        raise ConstraintError(f"{what} cannot be compiled: {err}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll, limits=_limits())
    if is_error:
        raise ConstraintError(f"{what} cannot be compiled: {messages[0] if messages else 'unknown error'}")
    matcher = llg.LLMatcher(ll, grammar, log_level=0, limits=_limits())
    if matcher.is_error():
        raise ConstraintError(f"{what} cannot be compiled: {matcher.get_error()}")
    compiled = CompiledConstraint(constraint, grammar, ll, int(vocab_size), ends, time.perf_counter() - t0, matcher)
    with _lock:
        cache[constraint] = compiled
        while len(cache) > COMPILE_CACHE_SIZE:
            cache.popitem(last=False)
    return compiled


# ---------------------------------------------------------------------------------------------- in the step
def grammar_drafts(drafts: dict["Request", list[int]]) -> dict["Request", list[int]]:
    """``drafts`` with each constrained request's cut at the first token its grammar refuses (requests left
    without drafts are dropped): a verification row then wants a mask at every position."""
    out = {}
    for req, draft in drafts.items():
        state = req.constraint
        if state is not None:
            draft = draft[:state.valid_prefix(draft)]
        if draft:
            out[req] = draft
    return out


_executor = None
_BIT_VALUES: dict[torch.device, torch.Tensor] = {}     # per device: 1, 2, 4, ..., 128 (uint8)


def _ll_executor():
    global _executor
    if _executor is None:
        _executor = _llguidance().LLExecutor(MASK_THREADS)
    return _executor


class MaskBuffer:
    """The step's masks on the host, one flat int32 tensor: ``rows * words`` mask words (row after row, bit j of
    word w: token 32 w + j allowed), then the ``rows`` logits rows they mask. Pinned when the device is CUDA
    (the upload is then asynchronous). Reused from step to step: each step's one read of the device comes
    after its upload, so the next step never writes into a buffer still in flight."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None

    def take(self, rows: int, words: int, device: torch.device) -> torch.Tensor:
        size = rows * (words + 1)
        t = self.tensor
        if t is None or t.numel() < size or t.is_pinned() != (device.type == "cuda"):
            t = torch.empty(max(size, 8 * (words + 1)), dtype=torch.int32, pin_memory=device.type == "cuda")
            self.tensor = t
        return t[:size]


def mask_logits(chunks: Sequence["ScheduledChunk"], layout: "LogitsLayout", logits: torch.Tensor,
                buffer: MaskBuffer) -> torch.Tensor:
    """Mask the logits rows of the step's constrained requests in place (tokens their grammar refuses at -inf);
    ``logits`` Tensor[n, V] float32 on the device, laid out by ``layout``; ``buffer``: the engine's own (one per
    engine thread). Returns ``logits``.

    The other choices of a prompt (forks) sample their first token from their parent's row: a fork carries its
    parent's constraint (``Engine.submit`` checks), whose state there is the grammar's start for both.
    A row whose grammar failed, or allows no token of the vocabulary, is left unmasked and its request
    records why (it fails when its token is applied; the others go on)."""
    wanted = []          # (state, first logits row, drafts)
    for i, chunk in enumerate(chunks):
        state = chunk.request.constraint
        if state is None or not layout.wanted[i]:
            continue
        wanted.append((state, layout.starts[i], list(chunk.drafts) if chunk.drafts else []))
    if not wanted:
        return logits
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    rows = sum(1 + len(d) for _, _, d in wanted)
    host = buffer.take(rows, words, logits.device)
    bits, index = host[:rows * words].view(rows, words), host[rows * words:]
    bits.fill_(-1)
    at, jobs, plain, drafted = 0, [], [], []
    for state, start, drafts in wanted:
        index[at:at + 1 + len(drafts)] = torch.arange(start, start + 1 + len(drafts), dtype=torch.int32)
        if state.failure is None and not state.ended:
            jobs.append((state, at, len(drafts)))
            if drafts:
                drafted.append((state.matcher, at, drafts, state.compiled.end_tokens))
            else:
                plain.append((state.matcher, at))
        at += 1 + len(drafts)
    _fill(plain, drafted, bits)
    allowed_any = bits.ne(0).any(dim=1)
    for state, first, k in jobs:
        if state.matcher.is_error():
            state.failure = f"the grammar failed: {state.matcher.get_error()}"
        elif not bool(allowed_any[first:first + 1 + k].all()):
            state.failure = "the grammar allows no token of the vocabulary here"
        else:
            continue
        bits[first:first + 1 + k] = -1          # unmasked: the request fails alone after the step
    if logits.device.type == "cpu":
        return _mask_on_host(logits, bits, index, vocab)
    return _mask_uploaded(logits, host, rows, words, vocab)


def _mask_on_host(logits: torch.Tensor, bits: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """CPU logits: the bits unpacked with numpy (little-endian: token t is bit t % 8 of byte t // 8) and each row
    masked in place (measured: a gather / masked_fill / scatter of all rows costs more than the rows' own fills)."""
    refused = numpy.unpackbits(bits.numpy().view(numpy.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    for r, row in enumerate(index.tolist()):
        logits[row].masked_fill_(torch.from_numpy(refused[r]), float("-inf"))
    return logits


def _mask_uploaded(logits: torch.Tensor, host: torch.Tensor, rows: int, words: int, vocab: int) -> torch.Tensor:
    """Device logits: the host buffer (bits, then rows) uploaded in one copy, the bits unpacked on the device and
    the rows masked with one ``index_put``."""
    upload = host.to(logits.device, non_blocking=True)  # the step's one upload of masks
    bytes_ = upload[:rows * words].view(torch.uint8).view(rows, words * 4, 1)
    powers = _BIT_VALUES.get(logits.device)
    if powers is None:
        powers = _BIT_VALUES.setdefault(logits.device,
                                        2 ** torch.arange(8, dtype=torch.uint8, device=logits.device))
    refused = (bytes_ & powers).view(rows, words * 32)[:, :vocab] == 0
    where = upload[rows * words:].long()
    logits[where] = logits[where].masked_fill(refused, float("-inf"))
    return logits


MASK_THREADS = 0
"""0: the engine's thread computes the masks, row after row (llguidance drops the GIL); n > 0: llguidance's pool of
n threads does (worth it where cores are free; on the shared 2-core machine of benchmarks/RESULTS.md it was
slower: its threads wait for a core)."""


def _fill(plain: list, drafted: list, bits: torch.Tensor) -> None:
    """Each ``(matcher, row)`` of ``plain`` writes its mask into ``bits[row]``; each ``(matcher, row, drafts, end
    tokens)`` of ``drafted`` its mask and, advanced through each prefix of its drafts up to an end token, the next
    ones into the rows after (and is rolled back)."""
    row_bytes, ptr = bits.shape[1] * 4, bits.data_ptr()
    if MASK_THREADS > 0:
        executor = _ll_executor()
        if plain:
            executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, bits.shape[0])
        if drafted:
            cut = [(m, r, d[:next((i for i, t in enumerate(d) if t in e), len(d))]) for m, r, d, e in drafted]
            executor.unsafe_compute_mask_ptr_with_draft_token(cut, ptr, row_bytes, bits.shape[0])
        return
    for matcher, row in plain:
        matcher.unsafe_compute_mask_ptr(ptr + row * row_bytes, row_bytes)
    for matcher, row, drafts, ends in drafted:
        taken = 0
        try:
            matcher.unsafe_compute_mask_ptr(ptr + row * row_bytes, row_bytes)
            for j, token in enumerate(drafts):
                if token in ends or not matcher.consume_token(int(token)):
                    break     # an end token ends the request: no row after it is read (and llguidance's rollback
                    #           past one does not restore the state); a refused draft: never, drafts were checked
                taken += 1
                matcher.unsafe_compute_mask_ptr(ptr + (row + 1 + j) * row_bytes, row_bytes)
        finally:
            if taken:
                matcher.rollback(taken)

