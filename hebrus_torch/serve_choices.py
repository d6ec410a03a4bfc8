"""The OpenAI response of ``python -m hebrus_torch.serve`` on the continuous-batching path: ``n`` choices,
log-probabilities, stop strings cut off; chat (``/v1/chat/completions``) and legacy completions
(``/v1/completions``), streamed and not.

transformers' handlers build one choice without log-probabilities and return a stop string inside the
text; :mod:`hebrus_torch.serve` routes every request of the batching path here instead. Each choice is an
engine request (choice 0 the request itself, choice i its child ``<id>__child#<i-1>``: a fork of its
prompt, docs/engine.md); the engine's ``GenerationOutput`` carries the tokens, their log-probabilities and
top alternatives (``top_logprobs``) and the finish reason (``finish_reason``). Nothing here touches the
engine: :class:`Choice` turns one choice's outputs into text pieces and log-probability entries, and the
``*_body`` / ``*_chunk`` functions lay them out as OpenAI does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Options", "Choice", "StopTrimmer", "chat_body", "chat_chunk", "completion_body", "completion_chunk",
           "sse"]


@dataclass(frozen=True)
class Options:
    """The OpenAI parameters of one request that transformers serve does not carry (checked by serve).

    Attributes:
        n: choices (>= 1).
        logprobs: chat: ``logprobs: true``; completions: ``logprobs`` given (an int 0..5).
        top_logprobs: alternatives per token (chat: ``top_logprobs``; completions: ``logprobs``).
        logit_bias: token id -> bias.
        presence_penalty, frequency_penalty: OpenAI's (the engine's, not transformers' repetition penalty).
        seed: the request's seed (choice i's is derived from it, ``manager.choice_seed``).
    """

    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """What ``HebrusBatchingManager.add_request`` takes for these (defaults left out)."""
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
        return kwargs

    @property
    def beyond_transformers(self) -> list[str]:
        """The parameters set here that transformers' own (sequential) path would ignore."""
        names = [("n", self.n != 1), ("logprobs", self.logprobs), ("logit_bias", bool(self.logit_bias)),
                 ("presence_penalty", bool(self.presence_penalty)),
                 ("frequency_penalty", bool(self.frequency_penalty))]
        return [name for name, on in names if on]


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


# ------------------------------------------------------------------------------------------ the drivers
@dataclass
class Call:
    """What transformers' handler passes to its ``_streaming`` / ``_non_streaming``."""

    kind: str                      # "chat" or "completion"
    handler: Any                   # the ChatCompletionHandler / CompletionHandler
    request_id: str
    model: Any
    processor: Any
    model_id: str
    inputs: dict
    gen_config: Any
    gen_manager: Any               # serve's HebrusCBGenerateManager
    options: Options
    tools: Any = None

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def stops(self) -> tuple[str, ...]:
        stops = getattr(self.gen_config, "stop_strings", None) or ()
        return (stops,) if isinstance(stops, str) else tuple(stops)

    def parser(self) -> Any:
        if self.kind != "chat":
            return None
        from transformers.cli.serving.utils import build_response_parser

        return build_response_parser(self.processor, self.model, self.inputs["input_ids"], tools=self.tools)


def _raise_for(call: Call, output: Any) -> None:
    from transformers.cli.serving.utils import CBWorkerDeadError

    cb = call.gen_manager._cb
    if cb is not None and cb.background_thread_status.fatal_error is not None:
        raise CBWorkerDeadError(f"CB worker died during request {call.request_id}: {output.error}")
    raise RuntimeError(f"CB generation failed for {output.request_id}: {output.error}")


async def full_response(call: Call) -> Any:
    """The JSON response with ``n`` choices, once every choice finished."""
    import asyncio

    from fastapi.responses import JSONResponse
    from transformers.cli.serving.utils import parse_assistant_message

    n = call.options.n
    queue, input_ids, cancel = call.gen_manager.generate_choices(call.inputs, call.gen_config, call.request_id, n,
                                                                 streaming=False)
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < n:
            index, output = await queue.get()
            if output.error is not None:
                cancel()
                _raise_for(call, output)
            if output.is_finished():
                outputs[index] = output
    except asyncio.CancelledError:      # the task was cancelled (shutdown): free the choices' state
        cancel()
        raise
    choices, completion_tokens = [], 0
    for index in range(n):
        output = outputs[index]
        choice = Choice(index, call.tokenizer, call.options, call.stops)
        _, entries, offsets = choice.advance(output)
        text = choice.trimmer.cut(call.tokenizer.decode(output.generated_tokens, skip_special_tokens=True))
        completion_tokens += len(output.generated_tokens)
        if call.kind == "chat":
            content, reasoning, tool_calls = parse_assistant_message(
                call.processor, call.model, output.generated_tokens, input_ids=input_ids, cleaned_content=text,
                tools=call.tools)
            if tool_calls:
                tool_calls = [{"id": f"{call.request_id}_tool_call_{i}", "type": "function",
                               "function": {"name": tc.name, "arguments": tc.arguments}}
                              for i, tc in enumerate(tool_calls)]
            message = {"role": "assistant", "content": StopTrimmer(call.stops).cut(content) if content else content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            choices.append({"index": index, "message": message,
                            "finish_reason": "tool_calls" if tool_calls else choice.finish_reason,
                            "logprobs": chat_logprobs(entries) if call.options.logprobs else None})
        else:
            choices.append({"index": index, "text": text, "finish_reason": choice.finish_reason,
                            "logprobs": completion_logprobs(entries, offsets) if call.options.logprobs else None})
    use = usage(len(input_ids), completion_tokens)
    body = (chat_body if call.kind == "chat" else completion_body)(call.request_id, call.model_id, choices, use)
    return JSONResponse(body, media_type="application/json")


def stream_response(call: Call) -> Any:
    """The SSE response: chunks of every choice as they come, each with its ``index`` (and, when asked, the
    log-probabilities of the tokens it carries); each choice ends with a chunk holding its finish reason, the
    last of them with ``usage`` (all choices' tokens). The choices are queued before this returns (a request
    the engine refuses is a 400, not a stream)."""
    import asyncio

    from fastapi.responses import StreamingResponse
    from transformers.cli.serving.utils import ReasoningText, ToolCall, response_events_to_chunks

    n, options, chat = call.options.n, call.options, call.kind == "chat"
    queue, input_ids, cancel = call.gen_manager.generate_choices(call.inputs, call.gen_config, call.request_id, n,
                                                                 streaming=True)
    parsers = [call.parser() for _ in range(n)]
    choices = [Choice(i, call.tokenizer, options, call.stops, skip_special_tokens=parsers[i] is None)
               for i in range(n)]
    rid, model_id = call.request_id, call.model_id

    def content_chunk(i: int, text: str, entries: list, offsets: list) -> dict:
        if chat:
            return chat_chunk(rid, model_id, i, {"content": text},
                              logprobs=chat_logprobs(entries) if options.logprobs else None)
        return completion_chunk(rid, model_id, i, text,
                                logprobs=completion_logprobs(entries, offsets) if options.logprobs else None)

    async def events():
        try:
            if chat:
                for i in range(n):
                    yield sse(chat_chunk(rid, model_id, i, {"role": "assistant", "content": ""}))
            done, tokens, tool_calls = 0, 0, [0] * n
            while done < n:
                index, output = await queue.get()
                choice, parser = choices[index], parsers[index]
                if choice.finished:
                    continue
                if output.error is not None:
                    cancel()
                    yield f"data: {json.dumps({'error': output.error})}\n\n"
                    return
                text, entries, offsets = choice.advance(output)
                parts = []
                items = [text] if parser is None else response_events_to_chunks(parser.feed(text)) if text else []
                if choice.finished and parser is not None:
                    try:
                        items += response_events_to_chunks(parser.finalize()[1])
                    except (ValueError, RuntimeError):    # ended inside a structured field (as transformers)
                        pass
                content = ""
                for item in items:
                    if isinstance(item, ToolCall) and chat:
                        parts.append(chat_chunk(rid, model_id, index, {"tool_calls": [{
                            "index": tool_calls[index], "id": f"{rid}_tool_call_{tool_calls[index]}",
                            "type": "function", "function": {"name": item.name, "arguments": item.arguments}}]}))
                        tool_calls[index] += 1
                    elif isinstance(item, ReasoningText) and chat:
                        parts.append(chat_chunk(rid, model_id, index, {"reasoning_content": str(item)}))
                    else:
                        content += choice.trimmer.feed(str(item))
                if choice.finished:
                    content += choice.trimmer.flush()
                if content or entries:
                    parts.insert(0, content_chunk(index, content, entries, offsets))
                if choice.finished:
                    done += 1
                    tokens += len(choice.tokens)
                    reason = "tool_calls" if tool_calls[index] else choice.finish_reason
                    use = usage(len(input_ids), tokens) if done == n else None
                    parts.append(chat_chunk(rid, model_id, index, {}, finish_reason=reason, usage=use) if chat else
                                 completion_chunk(rid, model_id, index, "", finish_reason=reason, usage=use))
                if parts:
                    yield "".join(sse(p) for p in parts)
        except (GeneratorExit, asyncio.CancelledError):
            cancel()       # the client went away (serve's request-end hook cancels too, whatever happens here)
            raise

    return StreamingResponse(events(), media_type="text/event-stream")
