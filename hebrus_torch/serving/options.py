"""The OpenAI parameters of one request that transformers serve does not carry; they travel with the request
(on its ``GenerationConfig``, :func:`attach` / :func:`of`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .structured import Structured

__all__ = ["Options", "attach", "of"]

_ATTRIBUTE = "hebrus_options"


@dataclass(frozen=True)
class Options:
    """The OpenAI parameters of one request that transformers serve does not carry (checked by
    :mod:`hebrus_torch.serving.validation`).

    Attributes:
        n: choices (>= 1).
        logprobs: chat: ``logprobs: true``; completions: ``logprobs`` given (an int 0..5).
        top_logprobs: alternatives per token (chat: ``top_logprobs``; completions: ``logprobs``).
        logit_bias: token id -> bias.
        presence_penalty, frequency_penalty: OpenAI's (the engine's, not transformers' repetition penalty).
        seed: the request's seed (choice i's is derived from it, ``manager.choice_seed``).
        structured: ``response_format`` and a forced ``tool_choice`` (:mod:`.structured`).
        constraint: their ``CompiledConstraint``, once compiled with the served tokenizer (``structured.compile_for``).
    """

    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    structured: Structured = field(default_factory=Structured)
    constraint: Any = None

    def engine_kwargs(self) -> dict[str, Any]:
        """What ``HebrusBatchingManager.open_request`` takes for these (defaults left out)."""
        kwargs: dict[str, Any] = {}
        if self.n != 1:
            kwargs["num_return_sequences"] = self.n
        if self.logprobs:
            kwargs.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.logit_bias:
            kwargs["logit_bias"] = dict(self.logit_bias)
        if self.presence_penalty:
            kwargs["presence_penalty"] = float(self.presence_penalty)
        if self.frequency_penalty:
            kwargs["frequency_penalty"] = float(self.frequency_penalty)
        if self.constraint is not None:
            kwargs["constraint"] = self.constraint
        return kwargs

    @property
    def beyond_transformers(self) -> list[str]:
        """The parameters set here that transformers' own (sequential) path would ignore."""
        names = [("n", self.n != 1), ("logprobs", self.logprobs), ("logit_bias", bool(self.logit_bias)),
                 ("presence_penalty", bool(self.presence_penalty)),
                 ("frequency_penalty", bool(self.frequency_penalty)),
                 ("response_format", self.structured.constraint is not None),
                 ("tool_choice", self.structured.tool is not None)]
        return [name for name, on in names if on]


def attach(gen_config: Any, options: Options) -> Any:
    """``gen_config`` (one request's own GenerationConfig) carrying ``options``."""
    setattr(gen_config, _ATTRIBUTE, options)
    return gen_config


def of(gen_config: Any) -> Options:
    """The options a request's GenerationConfig carries (the defaults when none were attached)."""
    return getattr(gen_config, _ATTRIBUTE, None) or Options()
