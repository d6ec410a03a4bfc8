"""OpenAI's response layout for the continuous-batching path: ``n`` choices, log-probabilities, stop strings cut
off; chat (``/v1/chat/completions``) and legacy completions (``/v1/completions``), streamed and not.

Nothing here touches the engine: :class:`Choice` turns one choice's ``GenerationOutput`` objects (tokens,
``logprobs``, ``top_logprobs``, ``finish_reason``) into text pieces and log-probability entries, and the
``*_body`` / ``*_chunk`` functions lay them out as OpenAI does.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .options import Options

__all__ = ["StopTrimmer", "Choice", "chat_logprobs", "chat_body", "chat_chunk", "completion_logprobs",
           "completion_body", "completion_chunk", "usage", "sse"]


class StopTrimmer:
    """Cuts a text stream before the first occurrence of any stop string (which is not returned), holding
    back, while streaming, the tail that could still begin one."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit after ``text`` arrived (nothing once a stop string was seen)."""
        if self.stopped:
            return ""
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._pending, self.stopped = self._pending[:cut], "", True
            return out
        if not self.hold:
            out, self._pending = self._pending, ""
            return out
        out, self._pending = self._pending[:-self.hold], self._pending[-self.hold:]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def cut(self, text: str) -> str:
        """The whole text cut before its first stop string."""
        return self.feed(text) + self.flush()


class Choice:
    """One choice's stream: new tokens from each ``GenerationOutput`` become decoded text and, when asked,
    one log-probability entry per token (``(token text, logprob, [(text, logprob)...])``, most likely
    alternatives first)."""

    def __init__(self, index: int, tokenizer: Any, options: Options, stops: tuple[str, ...],
                 skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.index = index
        self._tokenizer = tokenizer
        self._stream = DecodeStream([], skip_special_tokens=skip_special_tokens)
        self._options = options
        self.trimmer = StopTrimmer(stops)
        self.tokens: list[int] = []
        self.text_length = 0              # decoded characters so far (before trimming): text_offset
        self.finished = False
        self._reason: str | None = None

    def token_text(self, token: int) -> str:
        return self._tokenizer.decode([token])

    def advance(self, output: Any) -> tuple[str, list[tuple[str, float, list]], list[int]]:
        """(decoded text, log-probability entries, text offsets) of the tokens ``output`` adds."""
        new = list(output.generated_tokens[len(self.tokens):])
        first = len(self.tokens)
        self.tokens += new
        pieces, offsets = [], []
        rust = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        for token in new:
            piece = self._stream.step(rust, token)
            text = self.token_text(token)
            # where the token's own text starts (after a separator the decoder put before it, e.g. a space)
            offsets.append(self.text_length + (len(piece) - len(text) if piece and piece.endswith(text) else 0))
            if piece:
                pieces.append(piece)
                self.text_length += len(piece)
        entries = []
        if self._options.logprobs:
            lps = output.logprobs[first:first + len(new)]
            tops = getattr(output, "top_logprobs", [])[first:first + len(new)]
            for j, (token, lp) in enumerate(zip(new, lps)):
                top = tops[j] if j < len(tops) else ()
                entries.append((self.token_text(token), lp, [(self.token_text(t), v) for t, v in top]))
        self._reason = getattr(output, "finish_reason", None)
        self.finished = output.is_finished()
        return "".join(pieces), entries, offsets

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" (EOS or a stop string) or "length" (max_tokens, or the cache's capacity)."""
        return "length" if self._reason == "length" and not self.trimmer.stopped else "stop"


# ----------------------------------------------------------------------------------------- chat layout
def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[tuple[str, float, list]]) -> dict:
    """OpenAI's ``choices[i].logprobs`` of a chat completion."""
    return {"content": [{"token": t, "logprob": lp, "bytes": _bytes(t),
                         "top_logprobs": [{"token": a, "logprob": v, "bytes": _bytes(a)} for a, v in top]}
                        for t, lp, top in entries]}


def chat_body(request_id: str, model_id: str, choices: list[dict], usage: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_id,
            "choices": choices, "usage": usage}


def chat_chunk(request_id: str, model_id: str, index: int, delta: dict, *, logprobs: dict | None = None,
               finish_reason: str | None = None, usage: dict | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_id,
             "system_fingerprint": "", "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


# ---------------------------------------------------------------------------------- completions layout
def completion_logprobs(entries: list[tuple[str, float, list]], offsets: list[int]) -> dict:
    """OpenAI's legacy ``choices[i].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the
    ``logprobs`` most likely tokens plus the chosen one, token text -> log-probability) and ``text_offset``
    (each token's character offset in the choice's text)."""
    tops = []
    for t, lp, top in entries:
        d = {a: v for a, v in top}
        d.setdefault(t, lp)
        tops.append(d)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": tops, "text_offset": list(offsets)}


def completion_body(request_id: str, model_id: str, choices: list[dict], usage: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_id,
            "choices": choices, "usage": usage}


def completion_chunk(request_id: str, model_id: str, index: int, text: str, *, logprobs: dict | None = None,
                     finish_reason: str | None = None, usage: dict | None = None) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_id,
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
