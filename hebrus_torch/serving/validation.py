"""Checking a request body before the model is touched: what transformers would answer with a 500 (or accept
silently) is a 400 naming the parameter. Chat completions and completions (:func:`check_body`, which also
reads the OpenAI parameters transformers does not carry, :func:`request_options`) and the Responses API
(:func:`check_responses_body`)."""

from __future__ import annotations

import math
from typing import Any

from hebrus_torch.engine.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS

from . import structured
from .options import Options

__all__ = ["http_error", "check_body", "request_options", "check_content_part", "check_responses_body",
           "MAX_CHOICES", "MAX_LEGACY_LOGPROBS", "TEXT_PART_TYPES", "RESPONSES_REFUSED"]


def http_error(status: int, message: str):
    """A FastAPI ``HTTPException`` (answered as ``{"detail": message}``)."""
    from fastapi import HTTPException

    return HTTPException(status_code=status, detail=message)


def check_body(body: Any, kind: str) -> Options:
    """The request's :class:`~hebrus_torch.serving.options.Options`, or a 400 naming the problem for a body
    transformers would answer with a 500 (or accept silently)."""
    if not isinstance(body, dict):
        raise http_error(400, "the request body must be a JSON object")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise http_error(400, "`messages` must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise http_error(400, f"`messages[{i}]` must be an object with a string `role`")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise http_error(400, f"`messages[{i}].content` must be a string or a list of content parts")
            if isinstance(content, list) and "tool_calls" not in m:   # (transformers ignores it beside tool calls)
                for j, part in enumerate(content):
                    check_content_part(part, f"messages[{i}].content[{j}]")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise http_error(400, "`prompt` must be a non-empty string")
    _check_lengths(body, ("max_tokens", "max_completion_tokens"))
    _check_sampling(body)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                            and all(isinstance(s, str) for s in stop))):
        raise http_error(400, "`stop` must be a string or a list of strings")
    _refuse_asked(body, _UNSUPPORTED, "")
    return request_options(body, kind)


# OpenAI parameters whose non-default values the serving path would otherwise ignore silently (transformers
# serve logs them once and answers as if they were absent): refused with a 400 instead. name -> the value
# that means "not asked for" (None: any falsy value).
_UNSUPPORTED: dict[str, Any] = {"best_of": 1, "echo": None, "suffix": None}
MAX_CHOICES = 16                # the most choices (`n`) one request may ask for
MAX_LEGACY_LOGPROBS = 5         # OpenAI's cap on the legacy completions' `logprobs`


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def request_options(body: dict, kind: str) -> Options:
    """n, logprobs, top_logprobs, logit_bias, presence_penalty, frequency_penalty, seed, response_format and
    tool_choice (:mod:`.structured`), checked."""
    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise http_error(400, f"`n` must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise http_error(400, f"`logprobs` must be a boolean, got {logprobs!r}")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise http_error(400, f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
        if top and not logprobs:
            raise http_error(400, f"`top_logprobs` = {top} needs `logprobs` = true")
        want, top = bool(logprobs), int(top or 0)
    else:
        if top is not None:
            raise http_error(400, "`top_logprobs` is not a parameter of /v1/completions (use `logprobs`: 0..5)")
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LEGACY_LOGPROBS):
            raise http_error(400, f"`logprobs` must be an integer in [0, {MAX_LEGACY_LOGPROBS}], got {logprobs!r}")
        want, top = logprobs is not None, int(logprobs or 0)
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise http_error(400, f"`logit_bias` must be an object mapping token ids to biases, got {bias!r:.60}")
    bad_keys = [k for k in bias if not (isinstance(k, str) and k.isascii() and k.isdigit())]
    if bad_keys:
        raise http_error(400, f"`logit_bias` keys must be token ids (strings of digits), got {bad_keys[:5]!r:.120}")
    bad_values = {k: v for k, v in bias.items() if not _is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
    if bad_values:
        raise http_error(400, f"`logit_bias` values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                               f"got {dict(list(bad_values.items())[:5])!r:.120}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY):
            raise http_error(400, f"`{name}` must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        penalties[name] = float(value or 0)
    return Options(n=n, logprobs=want, top_logprobs=top, logit_bias={int(k): float(v) for k, v in bias.items()},
                   seed=body.get("seed"), structured=structured.read(body, kind), **penalties)


TEXT_PART_TYPES = ("text", "input_text", "output_text")


def check_content_part(part: Any, where: str) -> None:
    """A 400 naming ``where`` unless ``part`` is a text content part, ``{"type": "text", "text": "..."}``.

    transformers' message parsing indexes ``part["type"]`` and ``part["text"]`` unchecked (a number, a bare
    string, a part without ``type`` or a text part without ``text`` was a 500) and, for a text-only model,
    drops image/audio/video parts silently; the served model is text-only, so those are refused too.
    """
    if not isinstance(part, dict):
        raise http_error(400, f"`{where}` must be a content part object such as "
                               f'{{"type": "text", "text": "..."}}, got {type(part).__name__} {part!r:.40}')
    kind = part.get("type")
    if not isinstance(kind, str):
        raise http_error(400, f"`{where}.type` must be a string (\"text\"), got {kind!r:.40}")
    if kind not in TEXT_PART_TYPES:
        raise http_error(400, f"`{where}.type` is {kind!r:.40}: the served model is text-only "
                               f"(content parts of type {', '.join(TEXT_PART_TYPES)})")
    if not isinstance(part.get("text"), str):
        raise http_error(400, f"`{where}.text` must be a string, got {part.get('text')!r:.40}")


def _check_lengths(body: dict, names: tuple[str, ...]) -> None:
    for name in names:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise http_error(400, f"`{name}` must be an integer >= 1, got {value!r}")


def _check_sampling(body: dict) -> None:
    """``temperature``, ``top_p`` and ``seed`` (every endpoint)."""
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not 0 <= temperature <= 100):
        raise http_error(400, f"`temperature` must be a number >= 0, got {temperature!r}")
    top_p = body.get("top_p")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise http_error(400, f"`top_p` must be a number in (0, 1], got {top_p!r}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise http_error(400, f"`seed` must be an integer, got {seed!r}")


def _refuse_asked(body: dict, unsupported: dict[str, Any], where: str) -> None:
    """A 400 for each parameter of ``unsupported`` (name -> the value meaning "not asked for"; None: any falsy
    value) that the body sets to something else."""
    for name, default in unsupported.items():
        value = body.get(name)
        if not (value is None or (default is None and not value) or (default is not None and value == default)):
            raise http_error(400, f"`{name}` = {value!r:.80} is not supported{where} by this server (transformers "
                                   f"serve would ignore it); see docs/serving.md for the parameters it honours")


# The Responses API's parameters that transformers serve accepts and ignores, refused when set (name -> the
# value that means "not asked for", as _UNSUPPORTED): log-probabilities (`top_logprobs`; `include` with
# "message.output_text.logprobs": /v1/chat/completions serves them), the other `include` items, background runs
# and continuing a stored response (this server stores none).
RESPONSES_REFUSED: dict[str, Any] = {"top_logprobs": 0, "include": None, "background": None,
                                     "previous_response_id": None}


def check_responses_body(body: Any, allowed: frozenset[str] | set[str]) -> None:
    """A 400 naming the problem for a ``/v1/responses`` body with fields outside ``allowed`` (the Responses
    API's schema; transformers answers those 422), a bad ``input``, ``max_output_tokens``, ``temperature``,
    ``top_p`` or ``seed``, or a parameter of :data:`RESPONSES_REFUSED`."""
    if not isinstance(body, dict):
        raise http_error(400, "the request body must be a JSON object")
    unexpected = sorted(set(body) - set(allowed))
    if unexpected:
        raise http_error(400, f"unexpected fields for /v1/responses: {unexpected!r:.200}")
    inp = body.get("input")
    if not (isinstance(inp, str) and inp) and not (isinstance(inp, list) and inp):
        raise http_error(400, "`input` must be a non-empty string or a non-empty list of input items")
    _check_lengths(body, ("max_output_tokens",))
    _check_sampling(body)
    _refuse_asked(body, RESPONSES_REFUSED, " on /v1/responses")
