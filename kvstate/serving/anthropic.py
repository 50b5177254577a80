"""Anthropic's Messages API (``POST /v1/messages``) on the OpenAI request path.

A Messages body is validated here and turned into the chat-completions body it
means (``openai_body``); ``kvstate.serving.http`` then parses that with the one
request parser (template, tools, sampling, grammar), queues it on the one
scheduler, and hands the reply back here to be shaped as Anthropic's message,
stream events or error. Nothing is decided twice: which ``tool_choice`` works is
``tools.choice_of``'s decision, reached through the mapping in ``CHOICES``.

    Anthropic                          chat completions
    system (str | text blocks)         a first system message
    user text blocks                   a user message (text joined)
    user tool_result blocks            tool messages (tool_call_id = tool_use_id)
    assistant text + tool_use blocks   content + tool_calls (input as JSON)
    tools[].input_schema               tools[].function.parameters
    tool_choice auto|any|tool|none     "auto" | "required" | named function | "none"
    stop_sequences                     stop strings (any number)
    output_config.format json_schema   response_format json_schema

Decisions and what is refused: ``notes/serving.md`` ("The Anthropic Messages API").
"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any, Optional

from .request import BadRequest, _short

__all__ = [
    "CHOICES",
    "Blocks",
    "error_body",
    "is_messages",
    "message",
    "openai_body",
    "stop_reason",
    "usage",
]

FIELDS = frozenset({
    "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "metadata", "tools", "tool_choice", "output_config",
    "cache_control", "service_tier", "thinking",
})  # fmt: skip
COUNT_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "output_config", "cache_control"}
) | {"thinking"}
# Refused unless set to the listed harmless values: field -> (allowed, why).
REFUSED = MappingProxyType(
    {
        "thinking": (
            ({"type": "disabled"},),
            "is not supported (the model has no thinking budget)",
        ),
        "service_tier": (("auto", "standard_only"), "must be 'auto' or 'standard_only' (one tier)"),
    }
)


def is_messages(path: str) -> bool:
    """Whether ``path`` is one of this API's routes (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# --- errors -------------------------------------------------------------------------

KINDS = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
        504: "timeout_error",
    }
)


def error_body(exc: BadRequest) -> dict:
    """Anthropic's error body for a refusal or failure of any status."""
    kind = KINDS.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(exc)}}


# --- the request --------------------------------------------------------------------


def openai_body(body: Any, *, count: bool = False) -> tuple:
    """``(chat-completions body, stop sequences)`` of a Messages body (or, ``count``, a
    ``count_tokens`` body); raises ``BadRequest`` naming the field in Anthropic's terms."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_fields(body, COUNT_FIELDS if count else FIELDS, count)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(f"'model' must be a non-empty string, got {_short(model)}", "model")
    out: dict = {"model": model, "messages": _messages(body)}
    if not count:
        out.update(_sampling(body))
    _cache_control(body.get("cache_control"), "cache_control")
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        choice, parallel = _tool_choice(body["tool_choice"])
        out["tool_choice"] = choice
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    if body.get("output_config") is not None:
        out.update(_output_config(body["output_config"]))
    return out, () if count else _stop_sequences(body.get("stop_sequences"))


def _sampling(body: dict) -> dict:
    """``max_tokens`` (required), the sampling fields and ``stream``, checked by the chat
    parser but for Anthropic's ranges; ``metadata`` checked."""
    if "max_tokens" not in body:
        raise BadRequest("'max_tokens' is required", "max_tokens")
    out = {"max_tokens": body["max_tokens"]}
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            out[name] = _unit(body[name], name, 1.0)
    for name in ("top_k", "stream"):
        if body.get(name) is not None:
            out[name] = body[name]
    _metadata(body.get("metadata"))
    return out


def _check_fields(body: dict, known: frozenset, count: bool) -> None:
    for name, value in body.items():
        if name in REFUSED:
            allowed, why = REFUSED[name]
            if value is not None and value not in allowed:
                raise BadRequest(f"'{name}' {why}, got {_short(value)}", name, "unsupported")
        elif name not in known:
            where = "/v1/messages/count_tokens" if count else "/v1/messages"
            raise BadRequest(f"unknown field '{name}' for {where}", name, "unknown_field")


def _unit(value: Any, name: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [0, {high}], got {_short(value)}", name)
    return value


def _metadata(metadata: Any) -> None:
    """``metadata``: ``{"user_id": str | null}``, accepted with no effect."""
    if metadata is None:
        return
    ok = isinstance(metadata, dict) and set(metadata) <= {"user_id"}
    if not ok or not isinstance(metadata.get("user_id"), (str, type(None))):
        raise BadRequest(
            f"'metadata' must be {{'user_id': str}}, got {_short(metadata)}", "metadata"
        )


def _cache_control(value: Any, at: str) -> None:
    """A prompt-caching breakpoint: accepted with no effect (the prefix cache needs none)."""
    if value is None:
        return
    ok = isinstance(value, dict) and value.get("type") == "ephemeral"
    if not ok or set(value) - {"type", "ttl"} or value.get("ttl", "5m") not in ("5m", "1h"):
        raise BadRequest(
            f"'{at}' must be {{'type': 'ephemeral', 'ttl'?: '5m' | '1h'}}, got {_short(value)}", at
        )


def _stop_sequences(stops: Any) -> tuple:
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(
            f"'stop_sequences' must be a list of non-empty strings, got {_short(stops)}",
            "stop_sequences",
        )
    return tuple(dict.fromkeys(stops))


def _output_config(config: Any) -> dict:
    """``output_config.format`` (a JSON schema) as OpenAI's ``response_format``."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(config, dict) or set(config) - {"format"}:
        extra = sorted(set(config) - {"format"}) if isinstance(config, dict) else ["?"]
        raise BadRequest(
            f"'output_config' may only carry 'format' ('output_config.{extra[0]}' is not "
            f"supported), got {_short(config)}",
            "output_config",
        )
    if fmt is None:
        return {}
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or set(fmt)
        != {
            "type",
            "schema",
        }
    ):
        raise BadRequest(
            "'output_config.format' must be {'type': 'json_schema', 'schema': object}, "
            f"got {_short(fmt)}",
            "output_config.format",
        )
    schema = {"name": "output", "schema": fmt["schema"]}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


# --- messages -----------------------------------------------------------------------


def _messages(body: dict) -> list:
    out = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            out.append({"role": "system", "content": system})
        else:
            out.append({"role": "system", "content": _texts(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise BadRequest(f"'{at}.role' must be 'user' or 'assistant', got {_short(role)}", at)
        if set(m) - {"role", "content"}:
            raise BadRequest(
                f"'{at}': unknown field '{sorted(set(m) - {'role', 'content'})[0]}'", at
            )
        blocks = _blocks(m.get("content"), f"{at}.content")
        out += _user(blocks, at) if role == "user" else [_assistant(blocks, at)]
    if messages[-1]["role"] == "assistant":
        raise BadRequest(
            f"'messages[{len(messages) - 1}]': a last assistant message (a prefill for the "
            "reply to continue) is not supported; end with a user message",
            f"messages[{len(messages) - 1}]",
            "unsupported",
        )
    return out


def _blocks(content: Any, at: str) -> list:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise BadRequest(f"'{at}' must be a string or a non-empty list of content blocks", at)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise BadRequest(f"'{at}[{j}]' must be a content block with a 'type'", f"{at}[{j}]")
    return content


def _text(block: dict, at: str) -> str:
    if set(block) - {"type", "text", "cache_control", "citations"}:
        extra = sorted(set(block) - {"type", "text", "cache_control", "citations"})[0]
        raise BadRequest(f"'{at}': unknown field '{extra}'", f"{at}.{extra}")
    if not isinstance(block.get("text"), str):
        raise BadRequest(f"'{at}.text' must be a string, got {_short(block.get('text'))}", at)
    if block.get("citations"):
        raise BadRequest(f"'{at}.citations' is not supported", f"{at}.citations", "unsupported")
    _cache_control(block.get("cache_control"), f"{at}.cache_control")
    return block["text"]


def _texts(blocks: Any, at: str) -> str:
    """Text blocks joined (``system``, a ``tool_result``'s content); others are a 400."""
    if not isinstance(blocks, list):
        raise BadRequest(f"'{at}' must be a string or a list of text blocks", at)
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text":
            _unsupported(kind, f"{at}[{j}]", "text")
    return "".join(_text(b, f"{at}[{j}]") for j, b in enumerate(blocks))


def _unsupported(kind: Any, at: str, allowed: str) -> None:
    raise BadRequest(
        f"'{at}.type' {_short(kind)} is not supported (text output and input only: "
        f"{allowed} blocks)",
        f"{at}.type",
        "unsupported_content",
    )


def _user(blocks: list, at: str) -> list:
    """A user turn: runs of text blocks as user messages, tool results as tool messages,
    in their order."""
    out: list = []
    for j, b in enumerate(blocks):
        where = f"{at}.content[{j}]"
        if b["type"] == "text":
            text = _text(b, where)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif b["type"] == "tool_result":
            out.append(_tool_result(b, where))
        else:
            _unsupported(b["type"], where, "text and tool_result")
    return out


def _tool_result(b: dict, at: str) -> dict:
    extra = set(b) - {"type", "tool_use_id", "content", "is_error", "cache_control"}
    if extra:
        raise BadRequest(f"'{at}': unknown field '{sorted(extra)[0]}'", f"{at}.{sorted(extra)[0]}")
    use_id = b.get("tool_use_id")
    if not isinstance(use_id, str) or not use_id:
        raise BadRequest(f"'{at}.tool_use_id' must be a non-empty string", f"{at}.tool_use_id")
    content = b.get("content", "")
    text = content if isinstance(content, str) else _texts(content, f"{at}.content")
    is_error = b.get("is_error", False)
    if not isinstance(is_error, bool):
        raise BadRequest(f"'{at}.is_error' must be a boolean, got {_short(is_error)}", at)
    _cache_control(b.get("cache_control"), f"{at}.cache_control")
    # the template has no error flag: the model reads it in the content
    return {"role": "tool", "tool_call_id": use_id, "content": ERROR + text if is_error else text}


ERROR = "Error: "  # what a tool_result with is_error: true starts with, as the model reads it


def _assistant(blocks: list, at: str) -> dict:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        where = f"{at}.content[{j}]"
        if b["type"] == "text":
            texts.append(_text(b, where))
        elif b["type"] == "tool_use":
            calls.append(_tool_use(b, where))
        else:
            _unsupported(b["type"], where, "text and tool_use")
    out: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_use(b: dict, at: str) -> dict:
    extra = set(b) - {"type", "id", "name", "input", "cache_control"}
    if extra:
        raise BadRequest(f"'{at}': unknown field '{sorted(extra)[0]}'", f"{at}.{sorted(extra)[0]}")
    for key, kind in (("id", str), ("name", str), ("input", dict)):
        if not isinstance(b.get(key), kind) or not b[key] and kind is str:
            want = "an object" if kind is dict else "a non-empty string"
            raise BadRequest(
                f"'{at}.{key}' must be {want}, got {_short(b.get(key))}", f"{at}.{key}"
            )
    _cache_control(b.get("cache_control"), f"{at}.cache_control")
    fn = {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}
    return {"id": b["id"], "type": "function", "function": fn}


# --- tools --------------------------------------------------------------------------

TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})


def _tools(tools: Any) -> list:
    """Client tools as OpenAI function tools (``tools.tools_of`` validates the rest)."""
    if not isinstance(tools, list):
        raise BadRequest(f"'tools' must be a list of tools, got {_short(tools)}", "tools")
    out = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"'{at}' must be a tool object, got {_short(t)}", at)
        if t.get("type", "custom") not in ("custom", None):
            raise BadRequest(
                f"'{at}.type' {_short(t['type'])} is not supported (server tools run on "
                "Anthropic's side; only client tools with an input_schema)",
                f"{at}.type",
                "unsupported",
            )
        if set(t) - TOOL_FIELDS:
            extra = sorted(set(t) - TOOL_FIELDS)[0]
            raise BadRequest(f"'{at}': unknown field '{extra}'", f"{at}.{extra}")
        schema = t.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise BadRequest(
                f"'{at}.input_schema' must be a JSON schema object with type 'object', "
                f"got {_short(schema)}",
                f"{at}.input_schema",
            )
        _cache_control(t.get("cache_control"), f"{at}.cache_control")
        # OpenAI's order (name, description, parameters): templates render the dict as is
        fn = {"name": t.get("name"), **{k: t[k] for k in ("description",) if k in t}}
        fn.update({"parameters": schema, **{k: t[k] for k in ("strict",) if k in t}})
        out.append({"type": "function", "function": fn})
    return out


# Anthropic's tool_choice types and the OpenAI tool_choice each means: the one mapping;
# whether a choice is served is ``tools.choice_of``'s decision.
CHOICES = MappingProxyType(
    {
        "auto": lambda c: "auto",
        "any": lambda c: "required",
        "tool": lambda c: {"type": "function", "function": {"name": c.get("name")}},
        "none": lambda c: "none",
    }
)


def _tool_choice(choice: Any) -> tuple:
    """``(OpenAI tool_choice, parallel_tool_calls or None)``."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if not isinstance(kind, str) or kind not in CHOICES or set(choice) - allowed:
        raise BadRequest(
            "'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', "
            f"'name': str}}, with 'disable_parallel_tool_use'?: bool; got {_short(choice)}",
            "tool_choice",
        )
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise BadRequest("'tool_choice.name' must be a string", "tool_choice.name")
    off = choice.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise BadRequest(
            f"'tool_choice.disable_parallel_tool_use' must be a boolean, got {_short(off)}",
            "tool_choice.disable_parallel_tool_use",
        )
    return CHOICES[kind](choice), None if off is None else not off


def named(exc: BadRequest, body: dict) -> BadRequest:
    """An error of the chat-completions parser, its field named as this API names it."""
    param = exc.param or ""
    if param.startswith("tools[") and ".function." in param:
        param = param.replace(".function.parameters", ".input_schema").replace(".function", "")
    message = str(exc).replace(".function.parameters", ".input_schema").replace(".function.", ".")
    if param.startswith("tool_choice") and isinstance(body, dict):
        choice, _ = _tool_choice(body.get("tool_choice"))
        message += (
            f" (tool_choice {_short(body.get('tool_choice'))} is the chat API's {_short(choice)})"
        )
    if param == "response_format":
        param, message = "output_config.format", message.replace("response_format", "output_config")
    out = type(exc)(message, param or None, exc.code, exc.status)
    return out


# --- the reply ----------------------------------------------------------------------


def stop_reason(finish: Optional[str], matched: Optional[str]) -> str:
    """Anthropic's ``stop_reason`` of a choice's finish reason (and the stop sequence it
    matched, if any)."""
    if finish == "length":
        return "max_tokens"
    if finish == "tool_calls":
        return "tool_use"
    return "stop_sequence" if matched is not None else "end_turn"


def usage(prompt: int, cached: int, output: int) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens the prefix cache did not
    serve, ``cache_read_input_tokens`` those it did (their sum is the prompt)."""
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def tool_id(call_id: str) -> str:
    """A tool call's id as Anthropic writes them (``toolu_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def message(
    head: dict, openai_message: dict, reason: Optional[str], stop: Optional[str], use: dict
) -> dict:
    """The whole reply: ``head`` (id, model), the OpenAI assistant message's content and
    tool calls as content blocks (``message_start`` holds one with none, and no reason)."""
    content: list = []
    if openai_message.get("content"):
        content.append({"type": "text", "text": openai_message["content"]})
    for call in openai_message.get("tool_calls") or []:
        fn = call["function"]
        args = json.loads(fn["arguments"])
        content.append(
            {"type": "tool_use", "id": tool_id(call["id"]), "name": fn["name"], "input": args}
        )
    return {
        **head,
        "type": "message",
        "role": "assistant",
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": use,
    }


class Blocks:
    """A streamed reply's events: the chat-completions deltas (text, or the tool-call
    deltas ``tools.step`` gives) in, Anthropic's ``(event, data)`` pairs out, each content
    block opened, filled and closed in order; one ``ping`` after the first block opens."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index
        self.open: Optional[str] = None  # its type
        self.pinged = False

    def push(self, delta: Any) -> list:
        out: list = []
        for d in delta if isinstance(delta, list) else [delta]:
            if isinstance(d, str):
                d = {"content": d}
            if d.get("content"):
                out += self._start({"type": "text", "text": ""}, "text")
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for call in d.get("tool_calls") or []:
                fn = call.get("function", {})
                if "id" in call:
                    use = {"type": "tool_use", "id": tool_id(call["id"]), "name": fn["name"]}
                    out += self._start({**use, "input": {}}, "tool_use", new=True)
                if fn.get("arguments"):
                    out.append(
                        self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                    )
        return out

    def finish(self, reason: str, stop: Optional[str], use: dict) -> list:
        out = self._close()
        if not self.pinged:
            out.append(("ping", {"type": "ping"}))
        delta = {"stop_reason": reason, "stop_sequence": stop}
        out.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": use}))
        return out + [("message_stop", {"type": "message_stop"})]

    def _start(self, block: dict, kind: str, new: bool = False) -> list:
        if self.open == kind and not new:
            return []
        out = self._close()
        self.index, self.open = self.index + 1, kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        out.append(("content_block_start", start))
        if not self.pinged:
            self.pinged = True
            out.append(("ping", {"type": "ping"}))
        return out

    def _delta(self, delta: dict) -> tuple:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": self.index,
            "delta": delta,
        }

    def _close(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]
