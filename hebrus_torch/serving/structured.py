"""Structured output on the OpenAI endpoints: ``response_format`` and a forced ``tool_choice`` read from the body
(:func:`read`, at validation: a malformed one is a 400 naming it) and compiled with the served tokenizer
(:func:`compile_for`, before anything is queued: a schema llguidance cannot compile, or one too large, is a 400
naming the problem). The engine then masks every step of the request (``engine/constraints.py``).

- ``response_format: {"type": "json_object"}``: the output is a JSON object; ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}``: JSON valid against the schema; ``{"type": "text"}``: nothing.
- ``tool_choice: "required"`` or ``{"type": "function", "function": {"name": ...}}`` (with ``tools``): the output
  is one tool call in the chat format of the tokenizer's ``response_template`` (its ``tool_calls`` field: the
  open and close markers around ``{"name": ..., "arguments": {...}}``), the arguments valid against the tool's
  ``parameters`` schema; transformers' parser then answers it as ``tool_calls``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hebrus_torch.engine.constraints import JSON_OPTIONS, Constraint, ConstraintError, compile_constraint

__all__ = ["Structured", "read", "compile_for", "tool_call_grammar"]


@dataclass(frozen=True)
class Structured:
    """What a request's body asks of its output's form (checked, not compiled).

    Attributes:
        constraint: ``response_format``'s (None: free text).
        tool: ``tool_choice``: None (auto, none, absent), ``"required"`` (one call of any tool) or a tool's name.
        tools: the body's ``tools`` (their ``function`` objects), for ``tool``.
    """

    constraint: Constraint | None = None
    tool: str | None = None
    tools: tuple[dict, ...] = ()

    @property
    def asked(self) -> bool:
        return self.constraint is not None or self.tool is not None


def _error(message: str):
    from .validation import http_error

    return http_error(400, message)


def read(body: dict, kind: str) -> Structured:
    """``response_format``, ``tool_choice`` and ``tools`` of a chat (``kind`` "chat") or completions body, checked;
    a 400 naming what is malformed."""
    constraint = _response_format(body.get("response_format"))
    tools, tool = (), None
    if kind == "chat":
        tools = _tools(body.get("tools"))
        tool = _tool_choice(body.get("tool_choice"), tools)
    if constraint is not None and tool is not None:
        raise _error("`response_format` and a forced `tool_choice` cannot be combined (the output is either the "
                     "response's JSON or one tool call)")
    return Structured(constraint, tool, tools)


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _error(f"`response_format` must be an object with a string `type`, got {value!r:.80}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise _error(f"`response_format.type` must be \"text\", \"json_object\" or \"json_schema\", got {kind!r:.40}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _error("`response_format.json_schema` must be an object with a `name` and a `schema`")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise _error(f"`response_format.json_schema.name` must be 1 to 64 letters, digits, '_' or '-', got "
                     f"{name!r:.80}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _error(f"`response_format.json_schema.schema` must be a JSON schema object, got "
                     f"{type(schema).__name__}")
    try:
        return Constraint.json_schema(schema, name=name)
    except ConstraintError as err:
        raise _error(f"`response_format.json_schema`: {err}") from None


def _tools(value: Any) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _error("`tools` must be a list of tools")
    out = []
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _error(f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                         f"\"parameters\": {{...}}}}}}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise _error(f"`tools[{i}].function.parameters` must be a JSON schema object")
        out.append(fn)
    return tuple(out)


def _tool_choice(value: Any, tools: tuple[dict, ...]) -> str | None:
    if value is None or value in ("auto", "none"):
        return None
    if value == "required":
        if not tools:
            raise _error("`tool_choice` = \"required\" needs `tools`")
        return "required"
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise _error(f"`tool_choice` must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                     f"\"function\": {{\"name\": ...}}}}, got {value!r:.80}")
    if name not in [t["name"] for t in tools]:
        raise _error(f"`tool_choice` names the function {name!r:.64}, which is not among `tools`")
    return name


def _literal(field: dict, key: str) -> str | None:
    """A response template's literal marker (``open`` / ``close``), or ``open_pattern`` without its leading
    ``\\s*`` when the rest is a plain literal."""
    if isinstance(field.get(key), str):
        return field[key]
    pattern = field.get(f"{key}_pattern")
    if isinstance(pattern, str):
        rest = re.sub(r"^(\\s\*)+", "", pattern)
        if rest and re.escape(re.sub(r"\\(.)", r"\1", rest)) == rest:
            return re.sub(r"\\(.)", r"\1", rest)
    return None


def tool_call_grammar(template: dict | None, tools: tuple[dict, ...], tool: str) -> Constraint:
    """The grammar of one tool call (``tool``: ``"required"``, any of ``tools``, or one tool's name) in the chat
    format of ``template`` (a tokenizer's ``response_template``).

    Raises:
        a 400 when the template has no tool calls this can write (its ``tool_calls`` field must be JSON
        ``{"name", "arguments"}`` between literal markers).
    """
    field = ((template or {}).get("fields") or {}).get("tool_calls")
    if not isinstance(field, dict):
        raise _error("a forced `tool_choice` needs the served tokenizer's `response_template` with a `tool_calls` "
                     "field (transformers parses tool calls with it); this model's has none")
    opening, closing = _literal(field, "open"), _literal(field, "close")
    transform = field.get("transform")
    if (opening is None or closing is None or field.get("content") != "json"
            or transform not in (None, {"type": "function", "function": "{content}"})):
        raise _error("a forced `tool_choice` is not supported for this model's tool-call format (its "
                     "`response_template` must wrap JSON {\"name\", \"arguments\"} in literal markers)")
    chosen = [t for t in tools if tool == "required" or t["name"] == tool]
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": t.get("parameters", {"type": "object"})},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls}, **{"x-guidance": JSON_OPTIONS})
    # the markers on lines of their own around the call, as Qwen's format writes them
    grammar = (f"start: {json.dumps(opening + chr(10))} call {json.dumps(chr(10) + closing)}\n"
               f"call: %json {json.dumps(schema)}\n")
    try:
        return Constraint.lark(grammar, name=tool)
    except ConstraintError as err:
        raise _error(f"`tools`: {err}") from None


def compile_for(structured: Structured, processor: Any, model: Any, eos_token_ids: Any) -> Any:
    """The request's ``CompiledConstraint`` for the served tokenizer and model (None when nothing is asked), or
    a 400 naming why it cannot be compiled."""
    if not structured.asked:
        return None
    from transformers.cli.serving.utils import get_response_template

    constraint = structured.constraint
    if structured.tool is not None:
        constraint = tool_call_grammar(get_response_template(processor, model), structured.tools, structured.tool)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    eos = [] if eos_token_ids is None else [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
    try:
        return compile_constraint(constraint, getattr(processor, "tokenizer", processor), int(config.vocab_size), eos)
    except ConstraintError as err:
        where = "`tools`" if structured.tool is not None else "`response_format`"
        raise _error(f"{where}: {err}") from None
