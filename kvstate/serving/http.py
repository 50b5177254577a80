"""``kvstate serve``: an OpenAI-compatible HTTP server on kvstate records.

One continuous batch serves every connection. The HTTP side (aiohttp, on
the event loop) parses and validates requests, turns token events into
OpenAI-shaped replies (JSON or server-sent events) and applies stop
strings; the model side (``Scheduler``, one thread) owns the batch::

    HTTP handlers ──submit(job)──▶ queue ──▶ Scheduler thread
         ▲                                   │ admit: prefill, join (extend)
         └──── events (token, done) ◀────────┤ step:  one token per row
               via loop.call_soon_threadsafe │ leave: finished or cancelled rows

A job is one request; its ``n`` choices are ``n`` rows. A client that goes
away cancels its job, and its rows leave the batch at the next step. When
``max_queue`` jobs are waiting, a new request is answered 429 at once (no
hidden wait). Every request is parsed, validated and tokenized in a worker
thread, before anything is queued, so a 4 MB prompt does not stall the
other streams and a bad value is a 400, never a fault in the scheduler.
A request that fails in the scheduler gets an OpenAI-shaped 500 (or an
error event, when streamed); a request past its deadline gets 504; when the
scheduler is not running, every request and ``/health`` get 503. The
scheduler is ``kvstate.serving.scheduler`` (the one every generation path
runs); this module is the HTTP side. Decisions are in ``notes/serving.md``.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import threading
import time
from typing import Any, Callable, Optional

import attrs

from .. import mlx_lm as bridge
from ..errors import KVStateError, bad
from .grammar import Grammar, Grammars
from .metrics import Metrics
from .scheduler import DEADLINE, SHUTDOWN, Job, QueueFull, Scheduler, Stopped

# --- request parsing ------------------------------------------------------------------


class BadRequest(Exception):
    """A request the server refuses with 4xx and an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        status: int = 400,
    ):
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

    def __init__(self, message: str, code: str = "internal_error", status: int = 500):
        super().__init__(message, None, code, status)


def _number(body: dict, name: str, default, low, high, *, integer=False):
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


@attrs.frozen
class Params:
    """What a request asks for, validated."""

    prompt: list  # token ids
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    n: int
    stop: tuple
    stream: bool
    chat: bool
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    grammar: Any = None  # a Grammar (response_format, structured_outputs); Api compiles it


def parse(
    body: Any,
    *,
    chat: bool,
    tokenize: Callable,
    context: int,
    max_tokens_default: int = 256,
    max_n: int = 16,
) -> Params:
    """Validate an OpenAI request body; raises ``BadRequest`` naming the field.

    Every field is checked here, on the HTTP side, before anything is queued:
    a value the scheduler would refuse (a seed out of range) is a 400, never a
    fault in the scheduler's thread."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = _chat_prompt(body, tokenize) if chat else _text_prompt(body, tokenize)
    max_tokens = _max_tokens(body, len(prompt), context, max_tokens_default, chat)
    return Params(
        prompt=list(prompt),
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        seed=_seed(body),
        n=_number(body, "n", 1, 1, max_n, integer=True),
        stop=_stop(body),
        stream=_stream(body),
        chat=chat,
        include_usage=_include_usage(body),
        grammar=requested_grammar(body),
    )


def _chat_prompt(body: dict, tokenize: Callable) -> list:
    """The token ids of ``messages`` through the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("system", "user", "assistant")
            or not isinstance(m.get("content"), str)
        ):
            raise BadRequest(
                f"messages[{i}] must be {{'role': system|user|assistant, 'content': str}}",
                "messages",
            )
    return tokenize(messages=[{"role": m["role"], "content": m["content"]} for m in messages])


def _text_prompt(body: dict, tokenize: Callable) -> list:
    """The token ids of ``prompt`` (a completion request)."""
    text = body.get("prompt")
    if not isinstance(text, str) or not text:
        raise BadRequest("'prompt' must be a non-empty string", "prompt")
    return tokenize(text=text)


def _max_tokens(body: dict, prompt: int, context: int, default: int, chat: bool) -> int:
    """``max_tokens`` (or ``max_completion_tokens``), within what the context leaves."""
    default = max(1, min(default, context - prompt))
    max_tokens = _number(body, "max_tokens", default, 1, context, integer=True)
    if "max_completion_tokens" in body:
        max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, context, integer=True)
    if prompt + max_tokens > context:
        raise BadRequest(
            f"the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) "
            f"exceeds the context of {context} tokens",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    return max_tokens


def _stop(body: dict) -> tuple:
    """``stop``: a non-empty string or a list of at most 4 (an empty one would end
    every reply at once)."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str) and stop:
        return (stop,)
    if isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        return tuple(stop)
    raise BadRequest("'stop' must be a non-empty string or a list of at most 4 of them", "stop")


def _stream(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {stream!r}", "stream")
    return stream


def _include_usage(body: dict) -> bool:
    """``stream_options``: ``{"include_usage": bool}``, only with ``stream`` (as OpenAI)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool) or set(options) - {"include_usage"}:
        raise BadRequest(
            f"'stream_options' must be {{'include_usage': bool}}, got {options!r}", "stream_options"
        )
    return usage


def _seed(body: dict) -> Optional[int]:
    """``seed``: an int in ``[0, 2**64)`` (what ``kv.row_keys`` takes) or none."""
    seed = body.get("seed")
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise BadRequest(f"'seed' must be an integer in [0, 2**64), got {seed!r}", "seed")
    return seed


# --- structured output (kvstate.serving.grammar) ------------------------------------

# vLLM's names: ``structured_outputs`` (current), the ``guided_*`` fields (before v0.12)
_STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
_GUIDED = {f"guided_{k}": v for k, v in _STRUCTURED.items()}


def requested_grammar(body: dict) -> Optional[Grammar]:
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
    return _grammar_of(_GUIDED[name], body[name], name)


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
    return _grammar_of(_STRUCTURED[key], value, "structured_outputs")


def _grammar_of(kind: str, value: Any, arg: str) -> Grammar:
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


# --- text out -------------------------------------------------------------------------


class TextStream:
    """Token ids in, text deltas out, with stop strings applied.

    Byte-level BPE can split one character over several tokens, so text is
    released only when it does not end inside a character, and the tail that
    could still be the start of a stop string is held back.
    """

    def __init__(self, decode: Callable[[list], str], stop: tuple = ()):
        self.decode, self.stop = decode, stop
        self.tokens: list = []
        self.text = ""  # released so far
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token: int) -> str:
        """Add one token; returns the new text that may be released."""
        self.tokens.append(token)
        full = self.decode(self.tokens)
        if full.endswith("\ufffd"):
            return ""
        for s in self.stop:
            at = full.find(s, max(len(self.text) - len(s), 0))
            if at >= 0:
                self.stopped = True
                return self._release(full[:at])
        return self._release(full[: max(len(full) - self._hold, 0)])

    def flush(self) -> str:
        """At the end: release what was held back (no stop string matched)."""
        return "" if self.stopped else self._release(self.decode(self.tokens))

    def _release(self, upto: str) -> str:
        if len(upto) <= len(self.text):
            return ""
        delta, self.text = upto[len(self.text) :], upto
        return delta


# --- the HTTP side --------------------------------------------------------------------


def _error(exc: BadRequest):
    from aiohttp import web

    return web.json_response(exc.body(), status=exc.status)


class Api:
    """aiohttp handlers over a running ``Scheduler``.

    ``timeout``: seconds a request may take from its arrival (its deadline: the
    scheduler ends it there, and the handler stops waiting a little after).
    ``control_tokens``: whether message content may carry special tokens
    (``<|im_start|>``); by default it is encoded as text."""

    def __init__(
        self,
        scheduler,
        tokenizer,
        *,
        model_id: str,
        context: int,
        timeout: float = 600.0,
        control_tokens: bool = False,
        watch: Optional[Callable[[Job, Params], None]] = None,
        vocab_size: Optional[int] = None,
    ):
        self.scheduler, self.tok = scheduler, tokenizer
        self.model_id, self.context = model_id, context
        self.timeout, self.control_tokens = timeout, control_tokens
        self.created = int(time.time())
        self.watch = watch or (lambda job, params: None)  # sees each job before it is queued
        self.vocab_size = vocab_size  # the model's logits (None: no structured output)
        self._grammars: Optional[Grammars] = None
        self._grammars_made = threading.Lock()

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request):
        import mlx.core as mx
        from aiohttp import web

        s = self.scheduler
        return web.json_response(
            {
                "status": "ok" if s.alive else "stopped",
                "failed": s.stats["failed"],
                "active_rows": s.active_rows,
                "queued": s.queued,
                "rounds": s.stats["rounds"],
                # MLX's memory, MiB: arrays alive, freed buffers kept for reuse, peak
                "mlx_mib": {
                    "active": mx.get_active_memory() / 2**20,
                    "cache": mx.get_cache_memory() / 2**20,
                    "peak": mx.get_peak_memory() / 2**20,
                },
            },
            status=200 if s.alive else 503,
        )

    async def models(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_id,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kvstate",
                    }
                ],
            }
        )

    async def chat(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    def _tokenize(self, *, messages=None, text=None) -> list:
        if messages is not None:
            return self.tok.chat(messages, control_tokens=self.control_tokens)
        return self.tok.encode(text)

    def _parse(self, raw: bytes, chat: bool) -> Params:
        """The body decoded, validated and tokenized, its grammar compiled (in a worker
        thread)."""
        p = parse(_json(raw), chat=chat, tokenize=self._tokenize, context=self.context)
        if p.grammar is None:
            return p
        try:
            return attrs.evolve(p, grammar=self.grammars().compile(p.grammar))
        except KVStateError as exc:
            raise BadRequest(str(exc), p.grammar.arg) from None

    def grammars(self) -> Grammars:
        """The grammar compiler, made at the first request that needs it (importing
        xgrammar takes seconds: a server never asked for structured output skips it)."""
        if self.vocab_size is None:
            raise KVStateError("structured output: expected a model's vocab_size, got none")
        with self._grammars_made:
            if self._grammars is None:
                self._grammars = Grammars(self.tok, self.vocab_size)
            return self._grammars

    async def _complete(self, request, *, chat: bool):
        """One completion request: parsed, queued, then answered whole or streamed."""
        arrived = time.perf_counter()
        try:
            raw = await request.read()
            p = await asyncio.get_running_loop().run_in_executor(None, self._parse, raw, chat)
            job, events = self._submit(p, arrived)
        except BadRequest as exc:
            return _error(exc)
        kind = "chat.completion" if chat else "text_completion"
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + job.id,
            "created": int(time.time()),
            "model": self.model_id,
        }
        reply = _Reply(job, p, self.tok.decode)
        try:
            if p.stream:
                return await self._streamed(request, reply, events, head, kind)
            while not reply.finished:
                reply.take(await _next(events, job))
            return _whole(reply, head, kind)
        except ServerError as exc:
            return _error(exc)
        finally:
            job.cancel()  # no-op for finished choices; frees rows of a vanished client

    def _submit(self, p: Params, arrived: float) -> tuple:
        """``(job, events)``: the job queued, its events hopped onto this event loop."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind, i, value):
            loop.call_soon_threadsafe(events.put_nowait, (kind, i, value))

        job = Job(
            prompt=p.prompt,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            n=p.n,
            emit=emit,
            submitted=arrived,
            deadline=arrived + self.timeout,
            grammar=p.grammar,
        )
        self.watch(job, p)
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise BadRequest(
                "the server is at capacity; retry later", code="queue_full", status=429
            ) from None
        except Stopped:
            raise ServerError(
                "the server is not running (shutting down or stopped)", "unavailable", 503
            ) from None
        except KVStateError as exc:  # n larger than the batch (--max-batch)
            raise BadRequest(str(exc), "n") from None
        return job, events

    async def _streamed(self, request, reply: "_Reply", events, head: dict, kind: str):
        """Server-sent events: a chat's role first, each delta as it comes, each
        choice's finish reason, then ``[DONE]``."""
        from aiohttp import web

        chat = reply.params.chat
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if chat:
            for i in range(reply.params.n):
                role = {"role": "assistant", "content": ""}
                await self._send(response, head, kind, i, role, None, chat)
        while not reply.finished:
            try:
                taken = reply.take(await _next(events, reply.job))
            except ServerError as exc:  # the headers are out: the error as the last event
                await response.write(b"data: " + json.dumps(exc.body()).encode() + b"\n\n")
                break
            if taken is None:
                continue
            i, delta, finish = taken
            if delta:
                await self._send(response, head, kind, i, delta, None, chat)
            if finish is not None:
                await self._send(response, head, kind, i, "", finish, chat)
        if reply.params.include_usage:  # OpenAI's last chunk: no choices, the usage
            chunk = {**head, "object": kind + ".chunk" if chat else kind, "choices": []}
            await _event(response, {**chunk, "usage": _usage(reply)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _send(self, response, head, kind, i, delta, finish, chat):
        if chat:
            choice = {
                "index": i,
                "delta": delta
                if isinstance(delta, dict)
                else ({"content": delta} if delta else {}),
                "finish_reason": finish,
            }
        else:
            choice = {"index": i, "text": delta, "finish_reason": finish, "logprobs": None}
        chunk = {**head, "object": kind + ".chunk" if chat else kind, "choices": [choice]}
        await _event(response, chunk)


async def _event(response, chunk: dict) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


def _json(raw: bytes) -> Any:
    """The request body as JSON; a 400 for anything else (nesting too deep included)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None


GRACE = 5.0  # seconds a handler waits past its job's deadline for the scheduler's word


async def _next(events: asyncio.Queue, job: Job) -> tuple:
    """The job's next event; a 504 if none comes by its deadline (and a grace)."""
    if job.deadline is None:
        return await events.get()
    left = job.deadline + GRACE - time.perf_counter()
    try:
        return await asyncio.wait_for(events.get(), max(left, 0.0))
    except asyncio.TimeoutError:
        raise ServerError("the request's deadline passed", "timeout", 504) from None


class _Reply:
    """A request's choices as text: each choice's stop strings applied, its finish
    reason once it has one."""

    def __init__(self, job: Job, params: Params, decode: Callable):
        self.job, self.params = job, params
        self.texts = [TextStream(decode, params.stop) for _ in range(params.n)]
        self.finish: list = [None] * params.n

    @property
    def finished(self) -> bool:
        return None not in self.finish

    def take(self, event: tuple) -> Optional[tuple]:
        """One scheduler event: ``(choice, text delta, finish reason or None)``, or
        ``None`` for an event of a choice that already finished."""
        what, i, value = event
        if what == "error":
            raise ServerError(value, *_status_of(value))
        if self.finish[i] is not None:
            return None
        if what == "token":
            delta = self.texts[i].push(value)
            if self.texts[i].stopped:
                self.job.cancel(i)
                self.finish[i] = "stop"
        else:  # done
            delta = self.texts[i].flush()
            self.finish[i] = value
        return i, delta, self.finish[i]


def _status_of(error: str) -> tuple:
    """``(code, HTTP status)`` of a scheduler's error message."""
    if error.startswith(DEADLINE):
        return "timeout", 504
    if error.startswith(SHUTDOWN):
        return "unavailable", 503
    return "internal_error", 500


def _whole(reply: _Reply, head: dict, kind: str):
    """The non-streamed reply: every choice's text and finish reason, and usage."""
    from aiohttp import web

    p = reply.params
    choices = []
    for i, t in enumerate(reply.texts):
        c: dict = {"index": i, "finish_reason": reply.finish[i]}
        if p.chat:
            c["message"] = {"role": "assistant", "content": t.text}
        else:
            c["text"], c["logprobs"] = t.text, None
        choices.append(c)
    return web.json_response({**head, "object": kind, "choices": choices, "usage": _usage(reply)})


def _usage(reply: _Reply) -> dict:
    """OpenAI's usage: prompt and completion tokens, and the prompt tokens the prefix
    cache served (``prompt_tokens_details.cached_tokens``)."""
    prompt = len(reply.params.prompt)
    completion = sum(len(t.tokens) for t in reply.texts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reply.job.cached},
    }


# --- running it -----------------------------------------------------------------------


def context_of(model, default: int = 8192) -> int:
    """The model's context length (``max_position_embeddings``), else ``default``."""
    args = getattr(model, "args", None)
    return int(getattr(args, "max_position_embeddings", None) or default)


def make_app(
    loaded,
    *,
    context: Optional[int] = None,
    api_key: Optional[str] = None,
    timeout: float = 600.0,
    control_tokens: bool = False,
    on_stop: Optional[Callable[[Scheduler], None]] = None,
    **options,
):
    """``(aiohttp app, scheduler)`` for a loaded model; the scheduler stops with the app,
    then ``on_stop(scheduler)`` runs in its thread (``kvstate serve --prefix-cache-dir``
    saves the prefix cache there: no round runs any more).

    ``api_key``: every ``/v1`` route needs ``Authorization: Bearer <api_key>``
    (``require_key``). ``GET /metrics`` serves Prometheus metrics and each
    request is logged (``kvstate.serving.metrics``). ``timeout`` and
    ``control_tokens`` are ``Api``'s; ``options`` go to ``Scheduler``
    (``max_batch``, ``max_queue``, ``prefix_cache``, ``drafter``, ``num_draft``,
    ``window``, ``make``)."""
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise bad("timeout", "seconds > 0", repr(timeout))
    if loaded.tokenizer is None:
        raise KVStateError("kvstate serve needs a model with a tokenizer (not --model tiny)")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise KVStateError(f"api_key: expected None or a non-empty str, got {api_key!r}")
    _probe(loaded.model, options.get("make"))
    scheduler = Scheduler(loaded.model, loaded.tokenizer.eos_ids, **options)
    metrics = Metrics(scheduler)
    api = Api(
        scheduler,
        loaded.tokenizer,
        model_id=loaded.name,
        context=context or context_of(loaded.model),
        timeout=float(timeout),
        control_tokens=control_tokens,
        watch=metrics.watch,
        vocab_size=getattr(getattr(loaded.model, "args", None), "vocab_size", None),
    )
    app = api.app()
    app.router.add_get("/metrics", metrics.scrape)
    app.middlewares.append(metrics.middleware)
    if api_key is not None:
        app.middlewares.append(require_key(api_key))

    async def start(app):
        scheduler.start()

    async def stop(app):
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, on_stop)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app, scheduler


def _probe(model, make: Optional[dict]) -> None:
    """Records the model cannot write (a quantization group wider than its head
    dim, ...) are refused here, with ``make`` named, not by the scheduler's thread
    at the first request: one token is prefilled into them."""
    if not make:
        return
    try:
        bridge.prefill(model, [[0]], **make)
    except KVStateError as e:
        raise KVStateError(f"make={make}: {e}") from None


def require_key(key: str):
    """aiohttp middleware: a ``/v1`` request without ``Authorization: Bearer <key>``
    gets 401 with OpenAI's error body (``code: "invalid_api_key"``); the header is
    compared in constant time. ``/health`` and ``/metrics`` stay open."""
    from aiohttp import web

    want = f"Bearer {key}".encode()

    @web.middleware
    async def check(request, handler):
        if not request.path.startswith("/v1"):
            return await handler(request)
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, want):
            return await handler(request)
        exc = BadRequest(
            "missing or incorrect API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            status=401,
        )
        return web.json_response(exc.body(), status=401, headers={"WWW-Authenticate": "Bearer"})

    return check


def check_port(host: str, port: int) -> None:
    """Exit with one line (no traceback) when ``host:port`` cannot be listened on."""
    import socket

    if not 1 <= port <= 65535:
        raise SystemExit(f"kvstate serve: --port must be in [1, 65535], got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        if e.errno not in _LISTEN_ERRORS:
            raise
        raise SystemExit(_listen_error(host, port, e)) from None


_LISTEN_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def _listen_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"kvstate serve: port {port} on {host} is in use"
    return f"kvstate serve: cannot listen on {host}:{port}: {e.strerror or e}"


def run(loaded, *, host: str = "127.0.0.1", port: int = 8080, log=None, **options) -> None:
    """Serve until SIGINT or SIGTERM; ``options`` as ``make_app``'s.

    aiohttp's ``run_app`` turns either signal into a graceful exit: it stops
    listening, lets the requests in flight finish (up to 60 s), then stops the
    scheduler. A port that cannot be listened on exits with one line."""
    from aiohttp import web

    app, _ = make_app(loaded, **options)
    try:
        web.run_app(
            app,
            host=host,
            port=port,
            handler_cancellation=True,
            shutdown_timeout=60.0,
            print=(lambda msg: print(msg, file=log, flush=True)) if log else None,
        )
    except OSError as e:
        if e.errno not in _LISTEN_ERRORS:
            raise
        raise SystemExit(_listen_error(host, port, e)) from None
