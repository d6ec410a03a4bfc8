"""Requests in: the validation and defaults of ``Engine.make_request`` (token ids, lengths, sampling, EOS,
stop strings, speculation, structured output), and the coercion of token-id inputs. Nothing here touches the cache.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import operator
from typing import Any, Iterable, Sequence

import torch

from .requests import Request
from .sampling import BadRequestError, SamplingParams
from .speculative import MAX_DRAFT_TOKENS, SpeculativeConfig

__all__ = ["build_request", "speculative_config", "grammar_state", "token_ids", "id_set"]


def build_request(engine: Any, rid: str, prompt: Sequence[int], *, max_new_tokens: int | None = None,
                  sampling: SamplingParams | None = None, eos_token_id: int | Iterable[int] | None = None,
                  stop_strings: Sequence[str] | None = None, streaming: bool = False,
                  record_timestamps: bool = False, user_data: Any = None,
                  speculative: SpeculativeConfig | int | None = None, constraint: Any = None) -> Request:
    """Request ``rid`` validated against ``engine`` (its ``vocab_size``, ``config``, ``generation_config``
    for the defaults, ``text_config``, ``tokenizer`` and ``drafter``).

    Raises:
        BadRequestError: naming the request and what is wrong.
    """
    tokens = token_ids(prompt, f"engine: request {rid!r}: the prompt")
    if not tokens:
        raise BadRequestError(f"engine: request {rid!r}: the prompt is empty")
    bad = [t for t in tokens if not 0 <= t < engine.vocab_size]
    if bad:
        raise BadRequestError(f"engine: request {rid!r}: token ids {bad[:5]} lie outside the vocabulary "
                              f"[0, {engine.vocab_size})")
    gen = engine.generation_config
    if max_new_tokens is None:
        max_new_tokens = getattr(gen, "max_new_tokens", None)
        if max_new_tokens is None:
            max_length = getattr(gen, "max_length", None)
            max_new_tokens = max_length - len(tokens) if max_length else 20
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BadRequestError(f"engine: request {rid!r}: max_new_tokens must be an int >= 1, got "
                              f"{max_new_tokens!r}")
    if len(tokens) + 1 > engine.config.capacity_tokens:
        raise BadRequestError(f"engine: request {rid!r}: a prompt of {len(tokens)} tokens does not fit the "
                              f"cache ({engine.config.capacity_tokens} token positions)")
    if sampling is None:
        sampling = SamplingParams.from_generation_config(gen)
    if not isinstance(sampling, SamplingParams):
        raise BadRequestError(f"engine: request {rid!r}: sampling must be SamplingParams, got "
                              f"{type(sampling).__name__}")
    outside = [t for t, _ in sampling.logit_bias if t >= engine.vocab_size]
    if outside:
        raise BadRequestError(f"engine: request {rid!r}: logit_bias token ids {outside[:5]} lie outside the "
                              f"vocabulary [0, {engine.vocab_size})")
    if eos_token_id is None:
        eos_token_id = getattr(gen, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(engine.text_config, "eos_token_id", None)
    eos = id_set(eos_token_id, f"engine: request {rid!r}: eos_token_id")
    stops = tuple(stop_strings or getattr(gen, "stop_strings", None) or ())
    if isinstance(stop_strings, str):
        stops = (stop_strings,)
    if stops and engine.tokenizer is None:
        raise BadRequestError(f"engine: request {rid!r}: stop strings need the engine's tokenizer")
    spec = speculative_config(engine, speculative, f"engine: request {rid!r}")
    state = grammar_state(engine, constraint, eos, f"engine: request {rid!r}")
    return Request(rid, tokens, max_new_tokens, sampling, eos, stops, streaming, record_timestamps,
                   user_data=user_data, speculative=spec, constraint=state)


def grammar_state(engine: Any, constraint: Any, eos: frozenset[int], what: str) -> Any:
    """A request's matcher (``constraints.GrammarState``) for ``constraint``: a ``Constraint`` (compiled here with
    the engine's tokenizer, ``eos`` ending the output) or a ``CompiledConstraint`` made for the engine's
    vocabulary width; None for None."""
    if constraint is None:
        return None
    from .constraints import CompiledConstraint, Constraint, ConstraintError, compile_constraint

    if isinstance(constraint, Constraint):
        if engine.tokenizer is None:
            raise BadRequestError(f"{what}: a constraint needs the engine's tokenizer (or a CompiledConstraint)")
        try:
            constraint = compile_constraint(constraint, engine.tokenizer, engine.vocab_size, eos)
        except ConstraintError as err:
            raise ConstraintError(f"{what}: {err}") from None
    if not isinstance(constraint, CompiledConstraint):
        raise BadRequestError(f"{what}: constraint must be a Constraint or a CompiledConstraint, got "
                              f"{type(constraint).__name__}")
    if constraint.vocab_size != engine.vocab_size:
        raise BadRequestError(f"{what}: the constraint was compiled for {constraint.vocab_size} token ids, the "
                              f"model has {engine.vocab_size}")
    return constraint.state()


def speculative_config(engine: Any, value: SpeculativeConfig | int | None, what: str) -> SpeculativeConfig:
    """How a request speculates: ``value``, else the engine's default (``EngineConfig.speculative``, then the
    generation config's prompt lookup, or its assistant settings where the engine has a drafter). An int is
    that many drafts by prompt lookup, or by the MTP block where the engine's default method is ``"mtp"``."""
    if value is None:
        value = engine.config.speculative
    if value is None:
        gen = engine.generation_config
        value = getattr(gen, "prompt_lookup_num_tokens", None) or 0
        if value and engine.drafter is None:
            return SpeculativeConfig(min(int(value), MAX_DRAFT_TOKENS), max_ngram=int(
                getattr(gen, "max_matching_ngram_size", None) or 3))
        if engine.drafter is not None:
            value = min(int(getattr(gen, "num_assistant_tokens", None) or value or 5), MAX_DRAFT_TOKENS)
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{what}: speculative must be a SpeculativeConfig, an int or None, got {value!r}")
    default = engine.config.speculative
    if default is not None and default.method == "mtp" and value:     # (an MTP engine: that many MTP drafts,
        return dataclasses.replace(default, num_draft_tokens=value)   # every other setting the engine's)
    return SpeculativeConfig(value)


def token_ids(value: Any, what: str) -> list[int]:
    """``value`` as a list of Python ints: a sequence (list, tuple, range, a 1-D NumPy array) of integers or
    a 1-D integer tensor. Anything else is refused, never converted (``"123"`` is not ``[1, 2, 3]``, and
    ``5.9`` is not ``5``).

    Raises:
        BadRequestError: naming ``what`` and what was wrong.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise BadRequestError(f"{what} must be a 1-D integer tensor of token ids, got a {value.dim()}-D "
                                  f"{value.dtype} tensor")
        return [int(t) for t in value.tolist()]
    ndim = getattr(value, "ndim", None)
    if isinstance(value, (str, bytes, bytearray)) or not (isinstance(value, collections.abc.Sequence)
                                                         or ndim == 1):
        raise BadRequestError(f"{what} must be a sequence of integer token ids, got {type(value).__name__}")
    out = []
    for i, t in enumerate(value):
        if isinstance(t, bool) or type(t).__name__ == "bool_":
            raise BadRequestError(f"{what}: element {i} is a bool ({t!r}), not a token id")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise BadRequestError(f"{what}: element {i} is {t!r} ({type(t).__name__}), not an integer token id") \
                from None
    return out


def id_set(value: int | Iterable[int] | None, what: str = "eos_token_id") -> frozenset[int]:
    """Token ids (negative ones dropped: "no EOS"); a single id or a sequence / 1-D tensor of them."""
    if value is None:
        return frozenset()
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.reshape(1)
    if not isinstance(value, (torch.Tensor, collections.abc.Sequence)) or isinstance(value, (str, bytes)):
        value = [value]
    return frozenset(t for t in token_ids(value, what) if t >= 0)
