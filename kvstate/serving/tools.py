"""Tool calls: the request's ``tools`` and ``tool_choice`` validated, and the calls a
model writes parsed out of its text, whole or streamed.

A chat template family writes calls in its own markup; ``family_of`` picks the
parser from the template's source (as mlx-lm and vLLM do):

    [TOOL_CALLS]        in the template: ``mistral``  [TOOL_CALLS][{"name", "arguments"}]
                                                     or [TOOL_CALLS]name[ARGS]{...}
    <|python_tag|>      in the template: ``llama3``   {"name", "parameters"} (the whole
                                                     reply, or after <|python_tag|>)
    anything else:                       ``hermes``   <tool_call>{"name", "arguments"}
                                                     </tool_call> (Qwen, Hermes; the form
                                                     tools are described in to templates
                                                     that do not render them)

``ToolStream`` takes a choice's text as it comes and returns content deltas and
calls. Text that is, or could still become, the opening of a call (a prefix of
``<tool_call>``, a reply starting with ``{``) is held back; from an opening on,
the text is a tool region, parsed when the choice ends. A region that does not
parse is released as content: nothing is lost, and markup never streams as
content. Every decision depends on the whole text so far, never on how it was
split into deltas: any chunking gives the same content and calls.
"""

from __future__ import annotations

import json
import re
import uuid
from types import MappingProxyType
from typing import Any, Callable, Optional, Union

import attrs

from .grammar import Grammar
from .request import BadRequest, _short

__all__ = [
    "FAMILIES",
    "Family",
    "ToolStream",
    "choice_of",
    "family_of",
    "message",
    "options",
    "parse",
    "step",
    "tool_grammar",
    "tools_of",
]


# --- the request side ---------------------------------------------------------------


def tools_of(body: dict) -> Optional[list]:
    """``tools``: a list of ``{"type": "function", "function": {"name": str,
    "description"?: str, "parameters"?: object, "strict"?: bool}}``; ``None`` when
    absent. Raises ``BadRequest`` naming the field, what it expects and what it got."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest(f"'tools' must be a list of function tools, got {_short(tools)}", "tools")
    return [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]


def _tool(tool: Any, at: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        got = tool.get("type") if isinstance(tool, dict) else tool
        raise BadRequest(f"'{at}.type' must be 'function', got {_short(got)}", f"{at}.type")
    if set(tool) - {"type", "function"}:
        extra = sorted(set(tool) - {"type", "function"})[0]
        raise BadRequest(f"'{at}': unknown field '{extra}'", f"{at}.{extra}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"'{at}.function' must be an object, got {_short(fn)}", f"{at}.function")
    return {"type": "function", "function": _function(fn, f"{at}.function")}


FUNCTION_FIELDS = MappingProxyType(
    {"name": str, "description": str, "parameters": dict, "strict": bool}
)


def _function(fn: dict, at: str) -> dict:
    for key, value in fn.items():
        kind = FUNCTION_FIELDS.get(key)
        if kind is None:
            raise BadRequest(f"'{at}': unknown field '{key}'", f"{at}.{key}")
        if not isinstance(value, kind):
            want = {"str": "a string", "dict": "an object", "bool": "a boolean"}[kind.__name__]
            raise BadRequest(f"'{at}.{key}' must be {want}, got {_short(value)}", f"{at}.{key}")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise BadRequest(
            f"'{at}.name' must be a string of 1 to 64 letters, digits, '_', '.' or '-', "
            f"got {_short(name)}",
            f"{at}.name",
        )
    return dict(fn)


CHOICES = "'auto', 'none', 'required' or {'type': 'function', 'function': {'name': str}}"

# A choice as ``tool_grammar`` takes it: "auto", "none", "required", or ("function", name).
Choice = Union[str, tuple]


def choice_of(body: dict, tools: Optional[list]) -> Choice:
    """``tool_choice``: ``"auto"`` (the default with tools), ``"none"``, ``"required"``
    or a named function ``{"type": "function", "function": {"name": str}}`` (returned as
    ``("function", name)``; the name one of the ``tools``). ``required`` and a named
    function are enforced by a grammar (``tool_grammar``)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice != "none" and not tools:
            raise BadRequest(f"'tool_choice' is '{choice}' but no 'tools' are given", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(fn, dict)
        or choice.get("type") != "function"
        or set(choice) != {"type", "function"}
        or set(fn) != {"name"}
    ):
        raise BadRequest(f"'tool_choice' must be {CHOICES}, got {_short(choice)}", "tool_choice")
    names = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in names:
        raise BadRequest(
            f"'tool_choice.function.name' must name one of the tools {names}, "
            f"got {_short(fn['name'])}",
            "tool_choice",
        )
    return ("function", fn["name"])


def parallel_of(body: dict) -> bool:
    """``parallel_tool_calls``: a boolean (default true); false keeps the first call."""
    value = body.get("parallel_tool_calls", True)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise BadRequest(
            f"'parallel_tool_calls' must be a boolean, got {_short(value)}", "parallel_tool_calls"
        )
    return value


def options(body: dict, template: str, special: Optional[dict] = None) -> tuple:
    """A chat request's ``(tools for the template, parser family or None, parallel,
    grammar or None)``: with ``tool_choice: "none"`` the template gets no tools and
    nothing is parsed; ``required`` and a named function give the reply's grammar
    (``tool_grammar``; ``special``: the tokenizer's special tokens, text to id)."""
    tools = tools_of(body)
    choice, parallel = choice_of(body, tools), parallel_of(body)
    if choice == "none":
        return None, None, parallel, None
    family = family_of(template)
    return tools, family, parallel, tool_grammar(tools, choice, family, parallel, special)


# --- tool_choice as a grammar -------------------------------------------------------


def tool_grammar(
    tools: Optional[list],
    choice: Choice,
    family: "Family",
    parallel: bool = True,
    special: Optional[dict] = None,
) -> Optional[Grammar]:
    """The grammar a tool choice constrains the reply to (``None``: free text).

    The one mapping from a tool choice to decoding, for every endpoint: OpenAI's
    ``tool_choice`` (``choice_of``) and Anthropic's (``any`` is ``"required"``,
    ``{"type": "tool", "name": n}`` is ``("function", n)``).

    - ``"auto"``, ``"none"``: ``None`` (the model may write text or calls).
    - ``"required"``: one call of any tool (one or more, one after another, when
      ``parallel``); ``("function", name)``: exactly one call of that tool.

    The calls are written in the family's own markup (the form its parser reads:
    Hermes ``<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>``, Llama 3
    ``{"name": .., "parameters": ..}``, Mistral ``[TOOL_CALLS][{"name": ..,
    "arguments": ..}]``), with each tool's arguments following its ``parameters``
    schema (an empty object without one); a tool with ``strict: true`` has every
    object of its schema closed (``additionalProperties: false`` where the schema
    says nothing: only the listed properties, OpenAI's strict mode). A marker that
    is one of the tokenizer's ``special`` tokens is written as that token.

    Args:
        tools: the request's tools (``tools_of``).
        choice: ``"auto"``, ``"none"``, ``"required"`` or ``("function", name)``.
        family: the template's call markup (``family_of``).
        parallel: whether ``"required"`` may make several calls.
        special: the tokenizer's special tokens, text to id.
    """
    if choice in ("auto", "none") or not tools:
        return None
    fns = [t["function"] for t in tools]
    if isinstance(choice, tuple):
        fns = [f for f in fns if f["name"] == choice[1]]
        parallel = False
    args_key = "parameters" if family.name == "llama3" else "arguments"
    calls = [_call_schema(f, args_key) for f in fns]
    # a parameters schema's own definitions move to the root its "#/$defs/.." refs name
    defs = {k: {n: d for c in calls for n, d in c.pop(k, {}).items()} for k in DEFS}
    call = {"anyOf": calls} if len(calls) > 1 else calls[0]
    root = {k: v for k, v in defs.items() if v}
    special = special or {}
    if family.name == "mistral":
        many = {} if parallel else {"maxItems": 1}
        array = {"type": "array", "items": call, "minItems": 1, **many, **root}
        opens = _literal("[TOOL_CALLS]", special)
        lark = f"start: {opens} calls\ncalls: %json {_embedded(array)}\n"
    elif family.name == "llama3":
        more = ' ("; " call)*' if parallel else ""
        lark = f"start: call{more}\ncall: %json {_embedded({**call, **root})}\n"
    else:
        opens, closes = _literal("<tool_call>", special), _literal("</tool_call>", special)
        more = ' ("\\n" call)*' if parallel else ""
        lark = (
            f"start: call{more}\n"
            f'call: {opens} "\\n" body "\\n" {closes}\n'
            f"body: %json {_embedded({**call, **root})}\n"
        )
    return Grammar("lark", lark, "tool_choice")


# The calls' JSON as chat templates write it (``{"name": "f", "arguments": {...}}``).
CALL_JSON = MappingProxyType(
    {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
)


DEFS = ("$defs", "definitions")


def _call_schema(fn: dict, args_key: str) -> dict:
    """One call of ``fn``: ``{"name": fn's name, args_key: its parameters}`` (the
    parameters' definitions beside, at the call's root)."""
    params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
    if fn.get("strict"):
        params = _closed(params)
    defs = {k: params.pop(k) for k in DEFS if isinstance(params.get(k), dict)}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
        **defs,
    }


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does
    not set it (a copy)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k in NESTED else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {n: _closed(s) for n, s in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and (
        "additionalProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out


NESTED = frozenset({"items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else"})


def _embedded(schema: dict) -> str:
    """A JSON schema as llguidance's Lark ``%json`` takes it, with the calls' JSON form."""
    return json.dumps({**schema, "x-guidance": dict(CALL_JSON)})


def _literal(marker: str, special: dict) -> str:
    """A Lark terminal for ``marker``: the special token when it is one, else its text."""
    token = special.get(marker)
    return f"<[{token}]>" if token is not None else json.dumps(marker)


# --- the families -------------------------------------------------------------------


@attrs.frozen
class Family:
    """How one template family writes calls.

    ``opens``: markers that open a tool region anywhere in the reply; ``starts``:
    ones that open it only as the reply's first non-blank text; ``region``: the
    region's text to ``(calls, leftover content)``, raising ``ValueError`` when it is
    not calls."""

    name: str
    opens: tuple
    starts: tuple
    region: Callable[[str], tuple]


def _call(obj: Any, args_key: str = "arguments") -> dict:
    """``{"name", "arguments"}`` (a JSON string) from a parsed call object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a call: {obj!r}")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"arguments not an object: {args!r}")
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _objects(text: str) -> list:
    """The JSON values of ``text``, one after another (blank, ``;`` or ``,`` between)."""
    decoder, at = json.JSONDecoder(), 0
    out: list = []
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at == len(text):
            return out
        value, at = decoder.raw_decode(text, at)
        out.append(value)


HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def _hermes(region: str) -> tuple:
    calls = [_call(json.loads(body)) for body in HERMES.findall(region)]
    return calls, HERMES.sub("", region).strip()


def _llama3(region: str) -> tuple:
    body = region.removeprefix("<|python_tag|>")
    objs = _objects(body)
    if not objs:
        raise ValueError("no call")
    return [_call(o, "parameters") for o in objs], ""


MISTRAL_HEADER = re.compile(r"\s*([\w.-]+)\s*\[ARGS\]\s*")


def _mistral(region: str) -> tuple:
    body = region.replace("[TOOL_CALLS]", " ").strip()
    if body.startswith("["):
        values = _objects(body)
        calls = [_call(o) for v in values for o in (v if isinstance(v, list) else [v])]
        if not calls:
            raise ValueError("no call")
        return calls, ""
    return _mistral_headers(body), ""


def _mistral_headers(body: str) -> list:
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        head = MISTRAL_HEADER.match(body, at)
        if head is None:
            raise ValueError(f"not a call at {at}: {body[at : at + 20]!r}")
        args, at = decoder.raw_decode(body, head.end())
        calls.append(_call({"name": head.group(1), "arguments": args}))
        while at < len(body) and body[at].isspace():
            at += 1
    if not calls:
        raise ValueError("no call")
    return calls


FAMILIES = MappingProxyType(
    {
        "hermes": Family("hermes", ("<tool_call>",), (), _hermes),
        "llama3": Family("llama3", ("<|python_tag|>",), ("{",), _llama3),
        "mistral": Family("mistral", ("[TOOL_CALLS]",), ("[",), _mistral),
    }
)


def family_of(template: str) -> Family:
    """The parser for a chat template's source (the module docstring's table)."""
    if "[TOOL_CALLS]" in template:
        return FAMILIES["mistral"]
    if "<|python_tag|>" in template:
        return FAMILIES["llama3"]
    return FAMILIES["hermes"]


# --- the reply side -----------------------------------------------------------------


def _held(text: str, markers: tuple) -> int:
    """Where the longest suffix of ``text`` that is a proper prefix of a marker starts
    (``len(text)`` when none is)."""
    for at in range(max(len(text) - max(map(len, markers)) + 1, 0), len(text)):
        if any(m.startswith(text[at:]) for m in markers):
            return at
    return len(text)


def scan(text: str, family: Family) -> tuple:
    """``(safe, region)`` for the reply so far: content up to ``safe`` can be released;
    ``region`` is where a tool region opens (``None``: none yet)."""
    blank = len(text) - len(text.lstrip())
    head = text[blank:]
    if any(head.startswith(s) for s in family.starts):
        return 0, blank
    if not head or any(s.startswith(head) for s in family.starts):
        return 0, None
    found = [at for at in (text.find(m) for m in family.opens) if at >= 0]
    if found:
        at = min(found)
        return len(text[:at].rstrip()), at
    safe = _held(text, family.opens)
    return len(text[:safe].rstrip()), None


@attrs.define
class ToolStream:
    """One choice's text in, ``("content", str)`` and ``("call", {"id", "name",
    "arguments"})`` events out. ``parallel=False`` keeps only the first call."""

    family: Family
    parallel: bool = True
    text: str = ""
    released: int = 0
    calls: list = attrs.field(factory=list)
    content: str = ""  # released so far

    def push(self, delta: str) -> list:
        """Add text; the content that can be released now."""
        self.text += delta
        safe, _ = scan(self.text, self.family)
        return self._content(safe)

    def finish(self) -> list:
        """At the end of the choice: the calls of its tool region (and content left)."""
        _, region = scan(self.text, self.family)
        if region is None:
            return self._content(len(self.text))
        try:
            calls, rest = self.family.region(self.text[region:])
        except (ValueError, json.JSONDecodeError):
            return self._content(len(self.text))
        calls = calls if self.parallel else calls[:1]
        self.calls = [{"id": "call_" + uuid.uuid4().hex[:24], **c} for c in calls]
        self.content += rest
        events = [("content", rest)] if rest else []
        return events + [("call", c) for c in self.calls]

    def _content(self, upto: int) -> list:
        if upto <= self.released:
            return []
        delta, self.released = self.text[self.released : upto], upto
        self.content += delta
        return [("content", delta)]


def parse(text: str, family: Family, parallel: bool = True) -> tuple:
    """``(content, calls)`` of a whole reply: what ``ToolStream`` gives in one push."""
    stream = ToolStream(family, parallel)
    events = stream.push(text) + stream.finish()
    content = "".join(v for k, v in events if k == "content")
    return content, [v for k, v in events if k == "call"]


# --- OpenAI's shapes ----------------------------------------------------------------


def step(stream: ToolStream, delta: str, finish: Optional[str]) -> tuple:
    """``(deltas, finish)``: a choice's new text (and its finish reason, at its end) as
    streamed chat deltas: ``{"content": str}``, and per call ``{"tool_calls": [{index,
    id, type, function: {name, arguments: ""}}]}`` then its arguments. A choice that
    stopped on calls finishes with ``"tool_calls"``."""
    events = stream.push(delta) if delta else []
    if finish is not None:
        events += stream.finish()
        if stream.calls and finish == "stop":
            finish = "tool_calls"
    out: list = []
    for kind, value in events:
        if kind == "content":
            out.append({"content": value})
        else:
            out += _call_deltas(stream.calls.index(value), value)
    return out, finish


def _call_deltas(index: int, call: dict) -> list:
    head = {"name": call["name"], "arguments": ""}
    first = {"index": index, "id": call["id"], "type": "function", "function": head}
    args = {"index": index, "function": {"arguments": call["arguments"]}}
    return [{"tool_calls": [first]}, {"tool_calls": [args]}]


def message(stream: Optional[ToolStream], text: str) -> dict:
    """A whole reply's assistant message: its content, and its ``tool_calls`` (content
    ``None`` when it holds only calls)."""
    if stream is None:
        return {"role": "assistant", "content": text}
    if not stream.calls:
        return {"role": "assistant", "content": stream.content}
    calls = [
        {"id": c["id"], "type": "function", "function": {k: c[k] for k in ("name", "arguments")}}
        for c in stream.calls
    ]
    return {"role": "assistant", "content": stream.content or None, "tool_calls": calls}
