"""The request surface: which OpenAI fields a request may carry, messages, sampling.

``kvstate.serving.http.parse`` validates a body with these; each function
raises ``BadRequest`` naming the field, what it expects and what it got.
Every field OpenAI defines for ``/v1/chat/completions`` and
``/v1/completions`` is in exactly one of three sets: implemented
(``CHAT_FIELDS``, ``COMPLETION_FIELDS``), accepted as metadata with no effect
on the reply (``METADATA``), or refused when set (``REFUSED``, with the
reason the 400 gives). A field in none of them (a typo, another server's
extension) is a 400 too: nothing a client sends is silently ignored. The
decisions and their reasons are in ``notes/serving.md``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from .grammar import Grammar

__all__ = [
    "BadRequest",
    "ServerError",
    "check_fields",
    "grammar_of",
    "messages_of",
    "prompts_of",
    "sampling_of",
    "stop_ids_of",
    "tops_of",
]


class BadRequest(Exception):
    """A request the server refuses with 4xx and an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        status: int = 400,
    ) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    kind = "invalid_request_error"

    def body(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class ServerError(BadRequest):
    """A request the server could not complete (5xx): a fault in its prefill or
    rounds (500), its deadline (504), the scheduler not running (503)."""

    kind = "server_error"

    def __init__(self, message: str, code: str = "internal_error", status: int = 500) -> None:
        super().__init__(message, None, code, status)


# The sampling fields both endpoints implement (mlx-lm's and vLLM's extensions included).
SAMPLING = {
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "repetition_context_size", "logit_bias", "stop", "stop_token_ids",
}  # fmt: skip
# Structured output: OpenAI's field, vLLM's (``structured_outputs``, the older ``guided_*``).
STRUCTURED = {
    "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_grammar", "guided_choice",
}  # fmt: skip
COMMON = (
    SAMPLING | STRUCTURED | {"model", "n", "max_tokens", "stream", "stream_options", "logprobs"}
)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
CHAT_FIELDS |= {"tools", "tool_choice", "parallel_tool_calls"}  # (serving/tools.py)
COMPLETION_FIELDS = COMMON | {"prompt"}

# Accepted and validated, with no effect on the reply: identifiers OpenAI uses for abuse
# monitoring and caching hints (the prefix cache needs none), tags of stored completions.
METADATA = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict}

NOT_YET = "is not supported yet"
# Refused when set to anything but the listed harmless values: field -> (allowed, why).
REFUSED: dict = {
    "best_of": ((1,), "is not supported (only best_of 1: each choice is returned)"),
    "echo": ((False,), "is not supported (the prompt is not echoed back)"),
    "suffix": (("",), "is not supported (no fill-in-the-middle)"),
    "store": ((False,), "is not supported (completions are not stored)"),
    "service_tier": (("auto", "default"), "must be 'auto' or 'default' (one tier)"),
    "modalities": ((["text"],), "must be ['text'] (text output only)"),
    "audio": ((), "is not supported (text output only)"),
    "prediction": ((), "is not supported (predicted outputs)"),
    "reasoning_effort": ((), "is not supported (the model has no reasoning budget)"),
    "verbosity": ((), "is not supported"),
    "web_search_options": ((), "is not supported (no web search)"),
    "functions": ((), "is not supported (deprecated by OpenAI; use tools)"),
    "function_call": ((), "is not supported (deprecated by OpenAI; use tool_choice)"),
}


def check_fields(body: dict, chat: bool) -> None:
    """Every field of ``body`` implemented, metadata of the right type, or refused (400)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if name in known:
            continue
        if name in METADATA:
            if value is not None and not isinstance(value, METADATA[name]):
                kind = METADATA[name].__name__
                raise BadRequest(f"'{name}' must be a {kind}, got {value!r}", name)
        elif name in REFUSED:
            allowed, why = REFUSED[name]
            if value is not None and value not in allowed:
                raise BadRequest(f"'{name}' {why}, got {_short(value)}", name, "unsupported")
        else:
            where = "/v1/chat/completions" if chat else "/v1/completions"
            raise BadRequest(f"unknown field '{name}' for {where}", name, "unknown_field")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- messages -----------------------------------------------------------------------

ROLES = ("system", "developer", "user", "assistant", "tool")


def messages_of(body: dict) -> list:
    """``messages`` as the chat template takes them: content a string (text parts
    joined), an assistant's ``tool_calls`` with their arguments as objects (as
    Hugging Face templates expect), a tool message's ``tool_call_id``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: Any, at: str) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else m
        raise BadRequest(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}", at)
    role = m["role"]
    allowed = {"role", "content", "name"} | {
        "assistant": {"tool_calls", "refusal"},
        "tool": {"tool_call_id"},
    }.get(role, set())
    extra = sorted(set(m) - allowed)
    if extra:
        raise BadRequest(f"{at}: field '{extra[0]}' is not allowed on a {role} message", at)
    out: dict = {"role": role, "content": _content(m.get("content"), f"{at}.content", m)}
    if m.get("name") is not None:
        out["name"] = _string(m["name"], f"{at}.name")
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{at}.tool_calls")
    if role == "tool":
        out["tool_call_id"] = _string(m.get("tool_call_id"), f"{at}.tool_call_id")
    return out


def _string(value: Any, at: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{at}' must be a non-empty string, got {value!r}", at)
    return value


def _content(content: Any, at: str, m: dict) -> str:
    """A string, or a list of ``{"type": "text", "text": str}`` parts (joined); ``None``
    only on an assistant message with ``tool_calls``."""
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant" and m.get("tool_calls"):
        return ""
    if not isinstance(content, list) or not content:
        raise BadRequest(f"'{at}' must be a string or a non-empty list of text parts", at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise BadRequest(
                f"'{at}[{j}]' must be {{'type': 'text', 'text': str}} (text parts only), "
                f"got type {kind!r}",
                at,
                "unsupported_content",
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(calls: Any, at: str) -> list:
    if not isinstance(calls, list) or not calls:
        raise BadRequest(f"'{at}' must be a non-empty list of tool calls", at)
    return [_tool_call(c, f"{at}[{j}]") for j, c in enumerate(calls)]


def _tool_call(call: Any, at: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise BadRequest(f"'{at}' must be {{'type': 'function', 'function': {{...}}}}", at)
    name = _string(fn.get("name"), f"{at}.function.name")
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise BadRequest(
            f"'{at}.function.arguments' must be a JSON object in a string, got {_short(args)}",
            f"{at}.function.arguments",
        )
    out = {"type": "function", "function": {"name": name, "arguments": parsed}}
    if call.get("id") is not None:
        out["id"] = _string(call["id"], f"{at}.id")
    return out


# --- prompts ------------------------------------------------------------------------


def prompts_of(body: dict, encode: Callable[[str], list]) -> list:
    """``prompt``: a string, a list of token ids, or a list of either (one choice per
    prompt); the token ids of each prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(
            "'prompt' must be a non-empty string, a list of token ids, or a list of those",
            "prompt",
        )
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str) and p:
            out.append(encode(p))
        elif _ids(p):
            out.append(list(p))
        else:
            raise BadRequest(
                f"'prompt[{i}]' must be a non-empty string or list of token ids, got {_short(p)}",
                "prompt",
            )
    return out


def _ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def check_ids(prompts: list, vocab: int) -> None:
    """Every token id of the prompts in ``[0, vocab)``."""
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"'prompt[{i}]' has token id {bad[0]}, outside the vocabulary [0, {vocab})",
                "prompt",
            )


# --- sampling -----------------------------------------------------------------------


def number(body: dict, name: str, default, low, high, *, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise BadRequest(
            f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name
        )
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be in [{low}, {high}], got {value!r}", name)
    return value


def sampling_of(body: dict, vocab: int) -> dict:
    """The ``kv.Sampling`` fields beyond temperature, top_p and seed, as OpenAI and
    mlx-lm name them (``repetition_context_size`` is ``Sampling.context_size``)."""
    return {
        "top_k": number(body, "top_k", 0, 0, vocab, integer=True),
        "min_p": float(number(body, "min_p", 0.0, 0.0, 1.0)),
        "presence_penalty": float(number(body, "presence_penalty", 0.0, -2.0, 2.0)),
        "frequency_penalty": float(number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
        "repetition_penalty": float(number(body, "repetition_penalty", 1.0, 1e-3, 100.0)),
        "context_size": number(body, "repetition_context_size", 20, 1, 4096, integer=True),
        "logit_bias": _logit_bias(body.get("logit_bias"), vocab),
    }


def _logit_bias(bias: Any, vocab: int) -> tuple:
    """``{"token id": bias in [-100, 100]}``: keys are token ids of the vocabulary."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest(f"'logit_bias' must be an object {{token id: bias}}, got {bias!r}")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab or str(token) != str(key).strip():
            raise BadRequest(
                f"'logit_bias' key {key!r} must be a token id in [0, {vocab})", "logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"'logit_bias[{key}]' must be a number, got {value!r}", "logit_bias")
        if not -100 <= value <= 100:
            raise BadRequest(
                f"'logit_bias[{key}]' must be in [-100, 100], got {value}", "logit_bias"
            )
        out.append((token, float(value)))
    return tuple(sorted(out))


def stop_ids_of(body: dict, vocab: int) -> frozenset:
    """``stop_token_ids`` (vLLM's): token ids that end a choice (the token is kept)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return frozenset()
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
    ):
        raise BadRequest(
            f"'stop_token_ids' must be a list of token ids in [0, {vocab}), got {_short(ids)}",
            "stop_token_ids",
        )
    return frozenset(ids)


def tops_of(body: dict, chat: bool) -> Optional[int]:
    """How many top log-probabilities each token reports (``None``: no logprobs).

    Chat: ``logprobs: bool`` and ``top_logprobs`` in [0, 20] (only with logprobs);
    completions: ``logprobs`` an int in [0, 20] (OpenAI's legacy form, up to 5 there)."""
    if not chat:
        top = number(body, "logprobs", None, 0, 20, integer=True)
        return top
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest(f"'logprobs' must be a boolean, got {logprobs!r}", "logprobs")
    top = number(body, "top_logprobs", None, 0, 20, integer=True)
    if top is not None and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if logprobs else None


# --- structured output (kvstate.serving.grammar) ------------------------------------

# vLLM's names: ``structured_outputs`` (current), the ``guided_*`` fields (before v0.12)
_STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
_GUIDED = {f"guided_{k}": v for k, v in _STRUCTURED.items()}


def grammar_of(body: dict) -> Optional[Grammar]:
    """The grammar a request asks its reply to keep to: OpenAI's ``response_format``
    (``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs``
    (``json``, ``regex``, ``grammar``, ``choice``) or its older ``guided_*`` fields;
    ``None`` for none. At most one of them; a 400 names the field that is wrong."""
    asked = [
        k for k in ("response_format", "structured_outputs", *_GUIDED) if body.get(k) is not None
    ]
    if len(asked) > 1:
        raise BadRequest(f"at most one of {asked} may be given", asked[1])
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        return _response_format(body[name])
    if name == "structured_outputs":
        return _structured_outputs(body[name])
    return _grammar_from(_GUIDED[name], body[name], name)


def _response_format(rf: Any) -> Optional[Grammar]:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text" and set(rf) == {"type"}:
        return None
    if kind == "json_object" and set(rf) == {"type"}:
        return Grammar("json_object")
    if kind != "json_schema" or set(rf) != {"type", "json_schema"}:
        raise BadRequest(
            "'response_format' must be {'type': 'text'}, {'type': 'json_object'} or "
            f"{{'type': 'json_schema', 'json_schema': {{...}}}}, got {rf!r}"[:400],
            "response_format",
        )
    js = rf["json_schema"]
    ok = (
        isinstance(js, dict)
        and isinstance(js.get("name"), str)
        and 0 < len(js["name"]) <= 64
        and isinstance(js.get("schema", {}), dict)
        and isinstance(js.get("strict", False), (bool, type(None)))
        and set(js) <= {"name", "schema", "strict", "description"}
    )
    if not ok:
        raise BadRequest(
            "'response_format.json_schema' must be {'name': str (1-64 chars), 'schema': "
            f"object, 'strict': bool, 'description': str}}, got {js!r}"[:400],
            "response_format",
        )
    return Grammar("json_schema", js.get("schema", {}), "response_format")


def _structured_outputs(so: Any) -> Grammar:
    if not isinstance(so, dict) or len(so) != 1 or next(iter(so)) not in _STRUCTURED:
        raise BadRequest(
            f"'structured_outputs' must hold exactly one of {list(_STRUCTURED)}, got {so!r}"[:400],
            "structured_outputs",
        )
    key, value = next(iter(so.items()))
    return _grammar_from(_STRUCTURED[key], value, "structured_outputs")


def _grammar_from(kind: str, value: Any, arg: str) -> Grammar:
    """A ``Grammar`` of ``kind`` from a vLLM field's value (a 400 naming ``arg``)."""
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    ok = {
        "json_schema": isinstance(value, dict),
        "regex": isinstance(value, str) and bool(value),
        "grammar": isinstance(value, str) and bool(value),
        "choice": isinstance(value, list)
        and bool(value)
        and all(isinstance(c, str) and c for c in value),
    }[kind]
    if not ok:
        want = {
            "json_schema": "a JSON schema (an object, or its JSON text)",
            "regex": "a non-empty regex string",
            "grammar": "a non-empty EBNF grammar string",
            "choice": "a non-empty list of non-empty strings",
        }[kind]
        raise BadRequest(f"'{arg}' must give {want}, got {value!r}"[:400], arg)
    return Grammar(kind, tuple(value) if kind == "choice" else value, arg)
