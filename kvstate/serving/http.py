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
import re
import threading
import time
from typing import Any, Callable, Optional

import attrs

from .. import mlx_lm as bridge
from ..errors import KVStateError, bad
from . import anthropic, request, tools
from .grammar import Grammars
from .metrics import Metrics
from .request import BadRequest, ServerError, number
from .scheduler import DEADLINE, SHUTDOWN, Job, QueueFull, Scheduler, Stopped

# --- request parsing ------------------------------------------------------------------


@attrs.frozen
class Params:
    """What a request asks for, validated."""

    prompts: list  # token ids, one list per prompt (a chat: one)
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    n: int
    stop: tuple
    stream: bool
    chat: bool
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    sampling: dict = attrs.field(factory=dict)  # further kv.Sampling fields (request.sampling_of)
    stop_ids: frozenset = frozenset()  # stop_token_ids
    logprobs: Optional[int] = None  # top log-probabilities per token; None: no logprobs
    grammar: Any = (
        None  # a Grammar (response_format, structured_outputs, tool_choice); Api compiles it
    )
    tools: tuple = (None, None, True)  # (template tools, parser family, parallel): tools.options

    @property
    def prompt(self) -> list:
        """The first prompt's token ids (a chat's only one)."""
        return self.prompts[0]

    @property
    def choices(self) -> int:
        """Choices in the reply: ``n`` per prompt."""
        return self.n * len(self.prompts)


def parse(
    body: Any,
    *,
    chat: bool,
    tokenize: Callable,
    context: int,
    max_tokens_default: int = 256,
    max_n: int = 16,
    vocab: int = 2**31 - 1,
    template: str = "",
    special: Optional[dict] = None,
) -> Params:
    """Validate an OpenAI request body; raises ``BadRequest`` naming the field.

    Every field is checked here, on the HTTP side, before anything is queued:
    a value the scheduler would refuse (a seed out of range) is a 400, never a
    fault in the scheduler's thread; a field the server does not implement is a
    400 too (``kvstate.serving.request``). ``special``: the tokenizer's special
    tokens (text to id), for the markup of a forced tool call (``tools.tool_grammar``)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request.check_fields(body, chat)
    tooling = tools.options(body, template, special) if chat else (None, None, True, None)
    grammar = request.grammar_of(body)
    if tooling[3] is not None and grammar is not None:
        raise BadRequest(
            "'tool_choice' constrains the reply to tool "
            f"calls: it cannot be combined with '{grammar.arg}'",
            "tool_choice",
        )
    if chat:
        prompts = [chat_prompt(body, tokenize, tooling)]
    else:
        prompts = request.prompts_of(body, lambda text: tokenize(text=text))
        request.check_ids(prompts, vocab)
    longest = max(prompts, key=len)
    max_tokens = _max_tokens(body, len(longest), context, max_tokens_default, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {model!r}", "model")
    return Params(
        prompts=[list(p) for p in prompts],
        max_tokens=max_tokens,
        temperature=float(number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(number(body, "top_p", 1.0, 0.0, 1.0)),
        seed=_seed(body),
        n=number(body, "n", 1, 1, max_n, integer=True),
        stop=_stop(body),
        stream=_stream(body),
        chat=chat,
        include_usage=_include_usage(body),
        sampling=request.sampling_of(body, vocab),
        stop_ids=request.stop_ids_of(body, vocab),
        logprobs=request.tops_of(body, chat),
        grammar=tooling[3] or grammar,
        tools=tooling[:3],
    )


def chat_prompt(body: dict, tokenize: Callable, tooling: tuple) -> list:
    """A chat body's prompt token ids: its messages (and the tools ``tools.options`` gave
    for the template) through the chat template."""
    given = {"tools": tooling[0]} if tooling[0] else {}
    return tokenize(messages=request.messages_of(body), **given)


def _max_tokens(body: dict, prompt: int, context: int, default: int, chat: bool) -> int:
    """``max_tokens`` (or ``max_completion_tokens``), within what the context leaves."""
    default = max(1, min(default, context - prompt))
    max_tokens = number(body, "max_tokens", default, 1, context, integer=True)
    if "max_completion_tokens" in body:
        max_tokens = number(body, "max_completion_tokens", max_tokens, 1, context, integer=True)
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
        self.matched: Optional[str] = None  # the stop string that ended the text
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
                self.stopped, self.matched = True, s
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


def _error(exc: BadRequest, path: str = ""):
    """The error response: Anthropic's shape on its routes, OpenAI's elsewhere."""
    from aiohttp import web

    body = anthropic.error_body(exc) if anthropic.is_messages(path) else exc.body()
    return web.json_response(body, status=exc.status)


def model_id(name: str) -> str:
    """A model id clients can put in a URL: ``name`` with each run of characters other
    than letters, digits, ``.``, ``_`` and ``-`` made one ``-``
    (``SmolLM2-135M-Instruct (Q4_1 GGUF)`` is ``SmolLM2-135M-Instruct-Q4_1-GGUF``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _json_errors():
    """aiohttp middleware: an unknown path (404) or method (405) answers a JSON error
    body (``_error``'s), not aiohttp's plain text."""
    from aiohttp import web

    @web.middleware
    async def check(request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status not in (404, 405):
                raise
            what = "path" if exc.status == 404 else "method"
            error = BadRequest(
                f"unknown {what}: {request.method} {request.path}",
                code="not_found" if exc.status == 404 else "method_not_allowed",
                status=exc.status,
            )
            response = _error(error, request.path)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response

    return check


json_errors = _json_errors()


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
        vocab: int = 2**31 - 1,
        aliases: tuple = (),
        timeout: float = 600.0,
        control_tokens: bool = False,
        watch: Optional[Callable[[Job, Params], None]] = None,
        vocab_size: Optional[int] = None,
    ):
        self.scheduler, self.tok = scheduler, tokenizer
        self.model_id, self.context, self.vocab = model_id, context, vocab
        self.aliases = (model_id, *aliases)  # names /v1/models/{id} answers to
        self.timeout, self.control_tokens = timeout, control_tokens
        self.created = int(time.time())
        self.watch = watch or (lambda job, params: None)  # sees each job before it is queued
        self.vocab_size = vocab_size  # the model's logits (None: no structured output)
        self._grammars: Optional[Grammars] = None
        self._grammars_made = threading.Lock()

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=4 * 1024 * 1024, middlewares=[json_errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{id:.+}", self.model)
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

    def _model(self) -> dict:
        created, owner = self.created, "kvstate"
        return {"id": self.model_id, "object": "model", "created": created, "owned_by": owner}

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [self._model()]})

    async def model(self, request):
        """``/v1/models/{id}``: the served model (by its id or the name it was loaded
        under), else OpenAI's 404 ``model_not_found``."""
        from aiohttp import web

        name = request.match_info["id"]
        if name not in self.aliases:
            exc = BadRequest(
                f"the model '{name}' does not exist; this server serves '{self.model_id}'",
                "model",
                "model_not_found",
                404,
            )
            return _error(exc)
        return web.json_response(self._model())

    async def chat(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    def _tokenize(self, *, messages=None, text=None, tools=None) -> list:
        if messages is not None:
            return self.tok.chat(messages, control_tokens=self.control_tokens, tools=tools)
        return self.tok.encode(text)

    def _parse(self, raw: bytes, chat: bool) -> Params:
        """The body decoded, validated and tokenized, its grammar compiled (in a worker
        thread)."""
        return self._parsed(_json(raw), chat)

    def _parsed(self, body: Any, chat: bool) -> Params:
        p = parse(
            body,
            chat=chat,
            tokenize=self._tokenize,
            context=self.context,
            vocab=self.vocab,
            template=self.tok.template,
            special=self.tok.special_tokens,
        )
        if p.grammar is None:
            return p
        try:
            return attrs.evolve(p, grammar=self.grammars().compile(p.grammar))
        except KVStateError as exc:
            raise BadRequest(str(exc), p.grammar.arg) from None

    def grammars(self) -> Grammars:
        """The grammar compiler, made at the first request that needs it (a server
        never asked for structured output never builds the tokenizer's grammar view)."""
        if self.vocab_size is None:
            raise KVStateError("structured output: expected a model's vocab_size, got none")
        with self._grammars_made:
            if self._grammars is None:
                self._grammars = Grammars(self.tok, self.vocab_size)
            return self._grammars

    async def _read(self, request) -> bytes:
        from aiohttp import web

        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:  # aiohttp's own answer is plain text
            raise BadRequest(
                f"the request body is larger than {request.client_max_size} bytes",
                code="request_too_large",
                status=413,
            ) from None

    async def _accept(self, request, parse: Callable[[bytes], Params]) -> tuple:
        """``(params, jobs, events)``: the body read, ``parse``d in a worker thread, its
        jobs queued."""
        arrived = time.perf_counter()
        raw = await self._read(request)
        p = await asyncio.get_running_loop().run_in_executor(None, parse, raw)
        return (p, *self._submit(p, arrived))

    async def _complete(self, request, *, chat: bool):
        """One completion request: parsed, queued, then answered whole or streamed."""
        try:
            p, jobs, events = await self._accept(request, lambda raw: self._parse(raw, chat))
        except BadRequest as exc:
            return _error(exc)
        kind = "chat.completion" if chat else "text_completion"
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + jobs[0].id,
            "created": int(time.time()),
            "model": self.model_id,
        }
        reply = _Reply(jobs, p, self.tok.decode)
        try:
            if p.stream:
                return await self._streamed(request, reply, events, head, kind)
            while not reply.finished:
                reply.take(await _next(events, reply.job))
            return _whole(reply, head, kind)
        except ServerError as exc:
            return _error(exc)
        finally:
            reply.cancel()  # no-op for finished choices; frees rows of a vanished client

    # --- Anthropic's Messages API (kvstate.serving.anthropic) --------------------------

    def _parse_messages(self, raw: bytes) -> Params:
        """A Messages body as the chat-completions request it means, parsed by the one
        parser (its errors named as Anthropic names the fields)."""
        body = _json(raw)
        chat, stops = anthropic.openai_body(body)
        try:
            return attrs.evolve(self._parsed(chat, True), stop=stops)
        except BadRequest as exc:
            raise anthropic.named(exc, body) from None

    async def messages(self, request):
        """``POST /v1/messages``: Anthropic's message, whole or as its stream events."""
        from aiohttp import web

        try:
            p, jobs, events = await self._accept(request, self._parse_messages)
        except BadRequest as exc:
            return _error(exc, request.path)
        head = {"id": "msg_" + jobs[0].id, "model": self.model_id}
        reply = _Reply(jobs, p, self.tok.decode)
        try:
            if p.stream:
                return await self._streamed_message(request, reply, events, head)
            while not reply.finished:
                reply.take(await _next(events, reply.job))
            message = tools.message(reply.tools[0], reply.texts[0].text)
            return web.json_response(anthropic.message(head, message, *_ending(reply)))
        except ServerError as exc:
            return _error(exc, request.path)
        finally:
            reply.cancel()

    async def _streamed_message(self, request, reply: "_Reply", events, head: dict):
        """Anthropic's events: ``message_start`` once the job is admitted (its cached
        tokens known; a failure before is a plain error response), the content blocks
        (``anthropic.Blocks``), ``message_delta`` and ``message_stop``; a failure after
        the headers is an ``error`` event."""
        from aiohttp import web

        taken = reply.take(await _next(events, reply.job))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        text = reply.texts[0]
        use = anthropic.usage(len(reply.params.prompt), reply.job.cached, len(text.tokens))
        start = anthropic.message(head, {}, None, None, use)
        await _sse(response, "message_start", {"type": "message_start", "message": start})
        blocks = anthropic.Blocks()
        try:
            while True:
                if taken is not None:
                    for name, data in blocks.push(taken[1]):
                        await _sse(response, name, data)
                    if taken[2] is not None:
                        break
                taken = reply.take(await _next(events, reply.job))
        except ServerError as exc:
            await _sse(response, "error", anthropic.error_body(exc))
        else:
            for name, data in blocks.finish(*_ending(reply)):
                await _sse(response, name, data)
        await response.write_eof()
        return response

    async def count_tokens(self, request):
        """``POST /v1/messages/count_tokens``: the prompt's tokens, as ``messages`` would
        render it."""
        from aiohttp import web

        try:
            raw = await self._read(request)
            n = await asyncio.get_running_loop().run_in_executor(None, self._count, raw)
        except BadRequest as exc:
            return _error(exc, request.path)
        return web.json_response({"input_tokens": n})

    def _count(self, raw: bytes) -> int:
        body = _json(raw)
        chat, _ = anthropic.openai_body(body, count=True)
        try:
            return len(chat_prompt(chat, self._tokenize, tools.options(chat, self.tok.template)))
        except BadRequest as exc:
            raise anthropic.named(exc, body) from None

    def _submit(self, p: Params, arrived: float) -> tuple:
        """``(jobs, events)``: one job per prompt queued, their events hopped onto this
        event loop (prompt ``k``'s choice ``i`` is the reply's choice ``k * n + i``)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emitter(k: int):
            def emit(kind, i, value):
                at = i if i < 0 else k * p.n + i
                loop.call_soon_threadsafe(events.put_nowait, (kind, at, value))

            return emit

        jobs = [
            Job(
                prompt=prompt,
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                seed=p.seed,
                n=p.n,
                emit=emitter(k),
                stop=p.stop_ids,
                sampling=p.sampling,
                grammar=p.grammar,
                logprobs=p.logprobs,
                submitted=arrived,
                deadline=arrived + self.timeout,
            )
            for k, prompt in enumerate(p.prompts)
        ]
        for k, job in enumerate(jobs):
            self.watch(job, attrs.evolve(p, prompts=[job.prompt]))
            try:
                self._queue(job)
            except BadRequest:
                for queued in jobs[:k]:
                    queued.cancel()
                raise
        return jobs, events

    def _queue(self, job: Job) -> None:
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
        except KVStateError as exc:  # n past --max-batch, or rows past --kv-budget-gb
            raise BadRequest(str(exc), str(exc).split(":", 1)[0]) from None

    async def _streamed(self, request, reply: "_Reply", events, head: dict, kind: str):
        """Server-sent events: a chat's role first, each delta as it comes (with the
        log-probabilities of the tokens since the last one, where asked), each choice's
        finish reason, then ``[DONE]``."""
        from aiohttp import web

        chat = reply.params.chat
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if chat:
            for i in range(reply.params.choices):
                role = {"role": "assistant", "content": ""}
                await self._send(response, head, kind, i, role, None, reply)
        while not reply.finished:
            try:
                taken = reply.take(await _next(events, reply.job))
            except ServerError as exc:  # the headers are out: the error as the last event
                await response.write(b"data: " + json.dumps(exc.body()).encode() + b"\n\n")
                break
            if taken is None:
                continue
            i, delta, finish = taken
            for d in delta if isinstance(delta, list) else [delta]:  # (tool-call deltas)
                if d:
                    await self._send(response, head, kind, i, d, None, reply)
            if finish is not None:
                await self._send(response, head, kind, i, "", finish, reply)
        if reply.params.include_usage:  # OpenAI's last chunk: no choices, the usage
            chunk = {**head, "object": kind + ".chunk" if chat else kind, "choices": []}
            await _event(response, {**chunk, "usage": _usage(reply)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _send(self, response, head, kind, i, delta, finish, reply: "_Reply"):
        chat = reply.params.chat
        lp = reply.logprobs_since(i) if reply.params.logprobs is not None else None
        if chat:
            choice = {
                "index": i,
                "delta": delta
                if isinstance(delta, dict)
                else ({"content": delta} if delta else {}),
                "finish_reason": finish,
                "logprobs": lp,
            }
        else:
            choice = {"index": i, "text": delta, "finish_reason": finish, "logprobs": lp}
        chunk = {**head, "object": kind + ".chunk" if chat else kind, "choices": [choice]}
        await _event(response, chunk)


async def _event(response, chunk: dict) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


async def _sse(response, name: str, data: dict) -> None:
    """A named server-sent event (Anthropic's streams name each one)."""
    await response.write(f"event: {name}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n")


def _ending(reply: "_Reply") -> tuple:
    """A one-choice reply's ``(stop_reason, stop_sequence, usage)`` in Anthropic's terms."""
    text = reply.texts[0]
    reason = anthropic.stop_reason(reply.finish[0], text.matched)
    stop = text.matched if reason == "stop_sequence" else None
    return (
        reason,
        stop,
        anthropic.usage(len(reply.params.prompt), reply.job.cached, len(text.tokens)),
    )


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
    reason once it has one, its tokens' log-probabilities where asked. Prompt ``k``'s
    choice ``i`` (job ``k``) is choice ``k * n + i``."""

    def __init__(self, jobs: list, params: Params, decode: Callable):
        self.jobs, self.params, self.decode = jobs, params, decode
        self.texts = [TextStream(decode, params.stop) for _ in range(params.choices)]
        self.finish: list = [None] * params.choices
        self.logprobs: list = [[] for _ in range(params.choices)]  # (id, logprob, top)
        self._sent = [0] * params.choices  # log-probabilities streamed so far
        self._next_lp: list = [None] * params.choices
        _, family, parallel = params.tools  # tool calls parsed out of each choice's text
        self.tools = [family and tools.ToolStream(family, parallel) for _ in self.texts]

    @property
    def job(self) -> Job:
        """The first job (every job of a request has the same deadline)."""
        return self.jobs[0]

    def cancel(self, i: Optional[int] = None) -> None:
        if i is None:
            for job in self.jobs:
                job.cancel()
        else:
            self.jobs[i // self.params.n].cancel(i % self.params.n)

    @property
    def finished(self) -> bool:
        return None not in self.finish

    def take(self, event: tuple) -> Optional[tuple]:
        """One scheduler event: ``(choice, text delta, finish reason or None)``, or
        ``None`` for a log-probability or an event of a choice that already finished."""
        what, i, value = event
        if what == "error":
            raise ServerError(value, *_status_of(value))
        if self.finish[i] is not None:
            return None
        if what == "logprob":
            self._next_lp[i] = value
            return None
        if what == "token":
            if self._next_lp[i] is not None:
                self.logprobs[i].append((value, *self._next_lp[i]))
                self._next_lp[i] = None
            delta = self.texts[i].push(value)
            if self.texts[i].stopped:
                self.cancel(i)
                self.finish[i] = "stop"
        else:  # done
            delta = self.texts[i].flush()
            self.finish[i] = value
        if self.tools[i]:
            delta, self.finish[i] = tools.step(self.tools[i], delta, self.finish[i])
        return i, delta, self.finish[i]

    def logprobs_since(self, i: int) -> Optional[dict]:
        """The log-probabilities of choice ``i``'s tokens not streamed yet, in the reply's
        shape (``None`` when there are none)."""
        new, self._sent[i] = self.logprobs[i][self._sent[i] :], len(self.logprobs[i])
        return logprobs_body(new, self.decode, self.params.chat) if new else None


def logprobs_body(entries: list, decode: Callable, chat: bool) -> dict:
    """OpenAI's ``logprobs`` of a choice from ``(id, logprob, ((id, logprob), ...))``:
    chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``, or completions'
    legacy ``{tokens, token_logprobs, top_logprobs, text_offset}``."""

    def text(t: int) -> str:
        return decode([t])

    if chat:
        return {
            "content": [
                {
                    **_token(text(t), lp),
                    "top_logprobs": [_token(text(u), ulp) for u, ulp in top],
                }
                for t, lp, top in entries
            ],
            "refusal": None,
        }
    tokens = [text(t) for t, _, _ in entries]
    offsets = [sum(map(len, tokens[:k])) for k in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{text(u): ulp for u, ulp in top} for _, _, top in entries],
        "text_offset": offsets,
    }


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


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
        c: dict = {"index": i, "finish_reason": reply.finish[i], "logprobs": None}
        if p.logprobs is not None:
            c["logprobs"] = logprobs_body(reply.logprobs[i], reply.decode, p.chat)
        if p.chat:
            c["message"] = tools.message(reply.tools[i], t.text)
        else:
            c["text"] = t.text
        choices.append(c)
    return web.json_response({**head, "object": kind, "choices": choices, "usage": _usage(reply)})


def _usage(reply: _Reply) -> dict:
    """OpenAI's usage: prompt and completion tokens, and the prompt tokens the prefix
    cache served (``prompt_tokens_details.cached_tokens``)."""
    prompt = sum(map(len, reply.params.prompts))
    completion = sum(len(t.tokens) for t in reply.texts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(job.cached for job in reply.jobs)},
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
        model_id=model_id(loaded.name),
        aliases=(loaded.name,),
        vocab=_vocab(loaded.model),
        context=context or context_of(loaded.model),
        timeout=float(timeout),
        control_tokens=control_tokens,
        watch=metrics.watch,
        vocab_size=_vocab(loaded.model),
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


def _vocab(model) -> int:
    """The model's vocabulary size: ``model.args.vocab_size``, or its
    ``text_config``'s for the multimodal wrappers (llama4, gemma3, ...)."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for where in (args, text):
        size = _field(where, "vocab_size")
        if isinstance(size, int):
            return size
    raise KVStateError("kvstate serve needs a model whose args (or text_config) carry vocab_size")


def _field(where, name: str):
    """``where[name]`` for a dict, ``where.name`` otherwise (``None`` if absent)."""
    return where.get(name) if isinstance(where, dict) else getattr(where, name, None)


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
    """aiohttp middleware: a ``/v1`` request without ``Authorization: Bearer <key>`` or
    ``x-api-key: <key>`` (Anthropic's header) gets 401 with the route's error body
    (OpenAI's ``code: "invalid_api_key"``, Anthropic's ``authentication_error``); both
    headers are compared in constant time. ``/health`` and ``/metrics`` stay open."""
    from aiohttp import web

    bearer, plain = f"Bearer {key}".encode(), key.encode()

    @web.middleware
    async def check(request, handler):
        if not request.path.startswith("/v1"):
            return await handler(request)
        headers = request.headers
        given = headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        other = headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
        # both compared, always: the time taken does not tell which header was close
        by_bearer, by_key = hmac.compare_digest(given, bearer), hmac.compare_digest(other, plain)
        if by_bearer or by_key:
            return await handler(request)
        exc = BadRequest(
            "missing or incorrect API key: send 'Authorization: Bearer <key>' or "
            "'x-api-key: <key>'",
            code="invalid_api_key",
            status=401,
        )
        response = _error(exc, request.path)
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

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
