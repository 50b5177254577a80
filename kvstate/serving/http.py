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
hidden wait). The scheduler is ``kvstate.serving.scheduler`` (the one every
generation path runs); this module is the HTTP side. Decisions are in
``notes/serving.md``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Optional

import attrs

from ..errors import KVStateError
from .scheduler import Job, QueueFull, Scheduler

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

    def body(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }


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


def parse(
    body: Any,
    *,
    chat: bool,
    tokenize: Callable,
    context: int,
    max_tokens_default: int = 256,
    max_n: int = 16,
) -> Params:
    """Validate an OpenAI request body; raises ``BadRequest`` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if chat:
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
        prompt = tokenize(messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("'prompt' must be a non-empty string", "prompt")
        prompt = tokenize(text=text)
    default = max(1, min(max_tokens_default, context - len(prompt)))
    max_tokens = _number(body, "max_tokens", default, 1, context, integer=True)
    if "max_completion_tokens" in body:
        max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, context, integer=True)
    if len(prompt) + max_tokens > context:
        raise BadRequest(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
            f"exceeds the context of {context} tokens",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stop = tuple(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {stream!r}", "stream")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}", "seed")
    return Params(
        prompt=list(prompt),
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        seed=seed,
        n=_number(body, "n", 1, 1, max_n, integer=True),
        stop=stop,
        stream=stream,
        chat=chat,
    )


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
    """aiohttp handlers over a running ``Scheduler``."""

    def __init__(self, scheduler, tokenizer, *, model_id: str, context: int):
        self.scheduler, self.tok = scheduler, tokenizer
        self.model_id, self.context = model_id, context
        self.created = int(time.time())

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
                "active_rows": s.active_rows,
                "queued": s.queued,
                "rounds": s.stats["rounds"],
                # MLX's memory, MiB: arrays alive, freed buffers kept for reuse, peak
                "mlx_mib": {
                    "active": mx.get_active_memory() / 2**20,
                    "cache": mx.get_cache_memory() / 2**20,
                    "peak": mx.get_peak_memory() / 2**20,
                },
            }
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
            return self.tok.chat(messages)
        return self.tok.encode(text)

    async def _complete(self, request, *, chat: bool):
        from aiohttp import web

        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BadRequest("the request body is not valid JSON") from None
            p = parse(body, chat=chat, tokenize=self._tokenize, context=self.context)
        except BadRequest as exc:
            return _error(exc)
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
        )
        try:
            self.scheduler.submit(job)
        except QueueFull:
            return _error(
                BadRequest("the server is at capacity; retry later", code="queue_full", status=429)
            )
        except KVStateError as exc:  # n larger than the batch (--max-batch)
            return _error(BadRequest(str(exc), "n"))
        kind = "chat.completion" if chat else "text_completion"
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + job.id,
            "created": int(time.time()),
            "model": self.model_id,
        }
        texts = [TextStream(self.tok.decode, p.stop) for _ in range(p.n)]
        finish: list = [None] * p.n
        response: Any = None  # a web.StreamResponse when streaming
        try:
            if p.stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
                if chat:
                    for i in range(p.n):
                        await self._send(
                            response,
                            head,
                            kind,
                            i,
                            {"role": "assistant", "content": ""},
                            None,
                            chat,
                        )
            while None in finish:
                what, i, value = await events.get()
                if what == "error":
                    raise RuntimeError(value)
                if finish[i] is not None:
                    continue
                delta = ""
                if what == "token":
                    delta = texts[i].push(value)
                    if texts[i].stopped:
                        job.cancel(i)
                        finish[i] = "stop"
                else:  # done
                    delta = texts[i].flush()
                    finish[i] = value
                if p.stream and delta:
                    await self._send(response, head, kind, i, delta, None, chat)
                if p.stream and finish[i] is not None:
                    await self._send(response, head, kind, i, "", finish[i], chat)
            if p.stream:
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            usage = {
                "prompt_tokens": len(p.prompt),
                "completion_tokens": sum(len(t.tokens) for t in texts),
            }
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            choices = []
            for i, t in enumerate(texts):
                c: dict = {"index": i, "finish_reason": finish[i]}
                if chat:
                    c["message"] = {"role": "assistant", "content": t.text}
                else:
                    c["text"], c["logprobs"] = t.text, None
                choices.append(c)
            return web.json_response({**head, "object": kind, "choices": choices, "usage": usage})
        finally:
            job.cancel()  # no-op for finished choices; frees rows of a vanished client

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
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


# --- running it -----------------------------------------------------------------------


def context_of(model, default: int = 8192) -> int:
    """The model's context length (``max_position_embeddings``), else ``default``."""
    args = getattr(model, "args", None)
    return int(getattr(args, "max_position_embeddings", None) or default)


def make_app(loaded, *, context: Optional[int] = None, **options):
    """``(aiohttp app, scheduler)`` for a loaded model; the scheduler stops with the app.

    ``options`` go to ``Scheduler`` (``max_batch``, ``max_queue``, ``prefix_cache``,
    ``drafter``, ``num_draft``, ``window``)."""
    if loaded.tokenizer is None:
        raise KVStateError("kvstate serve needs a model with a tokenizer (not --model tiny)")
    scheduler = Scheduler(loaded.model, loaded.tokenizer.eos_ids, **options)
    api = Api(
        scheduler,
        loaded.tokenizer,
        model_id=loaded.name,
        context=context or context_of(loaded.model),
    )
    app = api.app()

    async def start(app):
        scheduler.start()

    async def stop(app):
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app, scheduler


def run(loaded, *, host: str = "127.0.0.1", port: int = 8080, log=None, **options) -> None:
    """Serve until interrupted; ``options`` as ``make_app``'s."""
    from aiohttp import web

    app, _ = make_app(loaded, **options)
    web.run_app(
        app,
        host=host,
        port=port,
        handler_cancellation=True,
        print=(lambda msg: print(msg, file=log, flush=True)) if log else None,
    )
