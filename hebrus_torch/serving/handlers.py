"""transformers serve's endpoint handlers, checked first and, on the continuous-batching path, answered here.

:class:`HebrusChatCompletionHandler`, :class:`HebrusCompletionHandler` and :class:`HebrusResponseHandler` are
transformers' handlers whose body is checked before the model is touched (:mod:`.validation`: a 400 naming the
parameter) and whose requests carry their OpenAI options on their ``GenerationConfig`` (:mod:`.options`). On
the batching path, chat completions and completions are answered by :func:`full_response` /
:func:`stream_response` (``n`` choices, log-probabilities, stop strings cut off, laid out by
:mod:`.openai_format`); the Responses API keeps transformers' layout. On the sequential path
(``--no-continuous-batching``) the handlers are transformers' and refuse what that path would ignore.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from dataclasses import dataclass
from typing import Any

from transformers.cli.serving import chat_completion as tf_chat_completion
from transformers.cli.serving import completion as tf_completion
from transformers.cli.serving import response as tf_response

from . import options as request_options
from .bridge import HebrusCBGenerateManager
from .openai_format import (Choice, StopTrimmer, chat_body, chat_chunk, chat_logprobs, completion_body,
                            completion_chunk, completion_logprobs, sse, usage)
from .options import Options
from .structured import compile_for
from .validation import check_body, check_responses_body, http_error
from .validation import request_options as body_options

__all__ = ["Call", "compile_structured", "full_response", "stream_response", "HebrusChatCompletionHandler",
           "HebrusCompletionHandler", "HebrusResponseHandler"]


@dataclass
class Call:
    """What transformers' handler passes to its ``_streaming`` / ``_non_streaming``."""

    kind: str                      # "chat", "completion" or "responses"
    handler: Any                   # the Hebrus*Handler
    request_id: str
    model: Any
    processor: Any
    model_id: str
    inputs: dict
    gen_config: Any
    gen_manager: HebrusCBGenerateManager
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


async def compile_structured(call: Call) -> None:
    """Compile the request's ``response_format`` / forcing ``tool_choice`` (if any) with the served tokenizer,
    off the event loop (a cold schema takes milliseconds, a tokenizer's first one about a second), before anything
    is queued: a 400 names what cannot be compiled. The compiled constraint travels in the request's options."""
    if not call.options.structured.asked:
        return
    compiled = await asyncio.to_thread(compile_for, call.options.structured, call.processor, call.model,
                                       call.gen_config.eos_token_id)
    call.options = dataclasses.replace(call.options, constraint=compiled)
    request_options.attach(call.gen_config, call.options)


async def full_response(call: Call) -> Any:
    """The JSON response with ``n`` choices, once every choice finished (a refused request is a 400, a failed
    choice a 500, or a 503 when the engine died)."""
    from fastapi.responses import JSONResponse
    from transformers.cli.serving.utils import parse_assistant_message

    await compile_structured(call)
    n = call.options.n
    queue, input_ids, cancel = await call.gen_manager.generate_choices(call.inputs, call.gen_config,
                                                                       call.request_id, streaming=False)
    outputs = await call.gen_manager.final_outputs(queue, n, cancel, call.request_id)
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


async def stream_response(call: Call) -> Any:
    """The SSE response: chunks of every choice as they come, each with its ``index`` (and, when asked, the
    log-probabilities of the tokens it carries); each choice ends with a chunk holding its finish reason, the
    last of them with ``usage`` (all choices' tokens). The choices are queued before this returns (a request
    the engine refuses is a 400, not a stream)."""
    from fastapi.responses import StreamingResponse
    from transformers.cli.serving.utils import ReasoningText, ToolCall, response_events_to_chunks

    await compile_structured(call)
    n, options, chat = call.options.n, call.options, call.kind == "chat"
    queue, input_ids, cancel = await call.gen_manager.generate_choices(call.inputs, call.gen_config,
                                                                       call.request_id, streaming=True)
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
            cancel()       # the client went away (the request-end hook cancels too, whatever happens here)
            raise

    return StreamingResponse(events(), media_type="text/event-stream")


# ------------------------------------------------------------------------------------------- the handlers
class _Checked:
    """What the three handlers add to transformers' (mixed in before transformers' handler class)."""

    kind = ""          # "chat", "completion" or "responses"

    async def handle_request(self, body: dict, request_id: str):
        response = await super().handle_request(body, request_id)
        # on the batching path _streaming hands back a coroutine: the response once the engine took the request
        return await response if inspect.isawaitable(response) else response

    def _validate_request(self, body: dict) -> None:
        check_body(body, self.kind)
        super()._validate_request(body)

    def _options(self, body: dict) -> Options:
        """The request's OpenAI options (the body was checked by ``_validate_request``)."""
        return body_options(body, self.kind)

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        options = self._options(body)
        # OpenAI's frequency_penalty and logit_bias are the engine's (transformers would map the first to a
        # repetition penalty, which is not OpenAI's, and the second to a sequence bias the engine has not)
        body = {k: v for k, v in body.items() if k not in ("frequency_penalty", "logit_bias")}
        gen_config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
        if not use_cb:
            beyond = options.beyond_transformers
            if beyond:
                raise http_error(400, f"`{beyond[0]}` needs continuous batching (this server runs "
                                      f"--no-continuous-batching)")
            return gen_config
        return request_options.attach(gen_config, options)

    def _call(self, name: str, args: tuple, kwargs: dict) -> Call | None:
        """The call's :class:`Call` on the batching path, else None."""
        bound = inspect.signature(getattr(super(), name)).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if not isinstance(a["gen_manager"], HebrusCBGenerateManager):
            return None
        return Call(self.kind, self, a["request_id"], a["model"], a["processor"], a["model_id"], a["inputs"],
                    a["gen_config"], a["gen_manager"], request_options.of(a["gen_config"]), a.get("tools"))

    def _streaming(self, *args, **kwargs):
        call = self._call("_streaming", args, kwargs)
        if call is None:
            return super()._streaming(*args, **kwargs)
        return stream_response(call)

    async def _non_streaming(self, *args, **kwargs):
        call = self._call("_non_streaming", args, kwargs)
        if call is None:
            return await super()._non_streaming(*args, **kwargs)
        return await full_response(call)


class HebrusChatCompletionHandler(_Checked, tf_chat_completion.ChatCompletionHandler):
    """transformers' ``/v1/chat/completions`` handler, checked, with ``n`` choices and log-probabilities."""

    kind = "chat"


class HebrusCompletionHandler(_Checked, tf_completion.CompletionHandler):
    """transformers' ``/v1/completions`` handler, checked, with ``n`` choices, log-probabilities and
    ``response_format`` (which transformers' completions schema lacks)."""

    kind = "completion"

    def _validate_request(self, body: dict) -> None:
        check_body(body, self.kind)
        super(_Checked, self)._validate_request({k: v for k, v in body.items() if k != "response_format"})


_RESPONSE_FIELDS = frozenset(getattr(tf_response.ResponseHandler._valid_params_class, "__mutable_keys__", ()))


class HebrusResponseHandler(_Checked, tf_response.ResponseHandler):
    """transformers' ``/v1/responses`` handler, checked (every refusal a 400, unknown fields included); what it
    would ignore (``top_logprobs``, ``include``, ...) is refused (``validation.RESPONSES_REFUSED``)."""

    kind = "responses"

    def _validate_request(self, body: dict) -> None:
        check_responses_body(body, _RESPONSE_FIELDS)
        super(_Checked, self)._validate_request(body)

    def _options(self, body: dict) -> Options:
        return Options(seed=body.get("seed"))

    def _streaming(self, *args, **kwargs):
        response = super(_Checked, self)._streaming(*args, **kwargs)    # transformers' layout, our bridge
        call = self._call("_streaming", args, kwargs)
        if call is None:
            return response

        async def once_accepted():
            await call.gen_manager.accepted(call.request_id)
            return response
        return once_accepted()

    async def _non_streaming(self, *args, **kwargs):
        return await super(_Checked, self)._non_streaming(*args, **kwargs)
