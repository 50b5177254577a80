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
hidden wait). Decisions are in ``notes/serving.md``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable, Optional, cast

import attrs

from ..errors import KVStateError

# --- jobs and events ------------------------------------------------------------------


class QueueFull(Exception):
    """The scheduler's queue is full: the server answers 429."""


@attrs.define(eq=False)
class Job:
    """One request on its way through the scheduler.

    ``emit(kind, choice, value)`` is called from the scheduler thread with
    ``("token", i, token_id)``, ``("done", i, finish_reason)`` or
    ``("error", -1, message)``; the HTTP side hops it onto the event loop.
    """

    prompt: list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    n: int = 1
    emit: Callable[[str, int, Any], None] = lambda kind, i, value: None
    cancelled: set = attrs.Factory(set)  # choices the client no longer wants
    id: str = attrs.Factory(lambda: uuid.uuid4().hex[:24])
    submitted: float = attrs.Factory(time.perf_counter)

    generated: list = attrs.Factory(lambda self: [0] * self.n, takes_self=True)
    leases: list = attrs.Factory(list)  # prefix-cache entries the rows read

    def release(self) -> None:
        """Unpin the prefix-cache entries (the scheduler, when the last row left)."""
        leases, self.leases = self.leases, []
        for lease in leases:
            if lease is not None:  # (prefix_cache.prefill gives None for a row it did not cache)
                lease.release()

    def cancel(self, choice: Optional[int] = None) -> None:
        """Stop one choice (a stop string matched) or all of them (client gone)."""
        self.cancelled.update(range(self.n) if choice is None else (choice,))


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
        except BadRequest as exc:  # n larger than the batch (--max-batch)
            return _error(exc)
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


# --- the model side -------------------------------------------------------------------


class Scheduler:
    """One thread that owns the batch: admits jobs, runs rounds, drops finished rows.

    The rows are a ``kvstate.speculative.Speculation``: with no drafter a
    round is one plain decode step; with ``Lookup()`` or ``DraftModel(m)`` it
    drafts and verifies per row. Prompts go through the prefix cache
    (``kvstate.serving.prefix_cache.prefill``), so a prompt whose start was seen
    before prefills only the rest; a job of ``n`` choices prefills once and
    forks its row ``n - 1`` times (``kv.fork``: the copies share the
    prompt's keys and values). Each row's ``payload`` is ``(job, choice)``.

    Args:
        model: an mlx-lm model.
        eos: token ids that end a choice.
        max_batch: most rows decoding at once (a job of ``n`` choices is ``n`` rows).
        max_queue: most jobs waiting to be admitted; ``submit`` raises ``QueueFull`` past it.
        prefix_cache: a ``PrefixCache`` (``None``: prompts are prefilled whole).
        drafter: ``None``, ``Lookup()`` or ``DraftModel(model)``.
        num_draft: most drafted tokens per row per round.
        window: ``kvstate.speculative.Window()``: each round only as wide as its
            measured cost pays (``notes/speculative.md``), its measurements kept
            across batches (``self.window``); ``None``: every row drafts up to
            ``num_draft`` each round.
    """

    def __init__(
        self,
        model,
        eos,
        *,
        max_batch: int = 32,
        max_queue: int = 64,
        prefix_cache=None,
        drafter=None,
        num_draft: int = 4,
        window=None,
    ):
        self.model, self.eos = model, frozenset(eos)
        self.window = window if drafter is not None else None  # the rule and its costs
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefix_cache, self.drafter, self.num_draft = prefix_cache, drafter, num_draft
        self._queue: queue.Queue = queue.Queue()
        self._pending: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.spec: Any = None  # the rows in flight: a speculative.Speculation, or None
        self.stats = {"rounds": 0, "prefilled": 0, "prompt_tokens": 0, "drafted": 0, "accepted": 0}

    # the HTTP side's view
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def active_rows(self) -> int:
        spec = self.spec
        return 0 if spec is None else spec.batch_size

    @property
    def queued(self) -> int:
        return self._queue.qsize() + len(self._pending)

    def submit(self, job: Job) -> None:
        """Queue a job (thread-safe); ``QueueFull`` when ``max_queue`` jobs wait."""
        if job.n > self.max_batch:
            raise BadRequest(f"'n' must be at most {self.max_batch} (the batch), got {job.n}", "n")
        if self.queued >= self.max_queue:
            raise QueueFull
        self._queue.put(job)

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._run, name="kvstate-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit(block=not self.active_rows)
                if self.active_rows:
                    self._round()
        except Exception as exc:  # say why to every waiting client, then stop
            for job in self._jobs():
                job.emit("error", -1, f"{type(exc).__name__}: {exc}")
            raise

    def _jobs(self) -> list:
        rows: list = [] if self.spec is None else [p[0] for p in self.spec.batch.payload]
        return list(dict.fromkeys(rows + list(self._pending)))

    def _admit(self, block: bool) -> None:
        """Take waiting jobs, oldest first, while their rows fit; prefill them together."""
        room = self.max_batch - self.active_rows
        jobs = []
        while room > 0:
            if not self._pending:
                try:
                    self._pending.append(
                        self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
                    )
                except queue.Empty:
                    break
                block = False
            job = self._pending[0]
            if len(job.cancelled) == job.n:
                self._pending.popleft()
                continue
            if job.n > room:
                break  # it waits at the head for rows to leave
            jobs.append(self._pending.popleft())
            room -= job.n
        if jobs:
            self._start(jobs)

    def _start(self, jobs: list) -> None:
        """Prefill the jobs' prompts in one call (reusing cached prefixes; one batched
        step gives every first token), sample, fork each job's choices, join the batch."""
        import mlx.core as mx

        import kvstate as kv

        from .. import mlx_lm as bridge
        from ..batch import sample_batch
        from ..speculative import rounds as speculative
        from ..speculative.drafts import DraftModel
        from . import prefix_cache

        prompts = [job.prompt for job in jobs]
        logits, states, leases, prefilled = prefix_cache.prefill(
            self.model, prompts, self.prefix_cache
        )
        for job, lease in zip(jobs, leases):
            job.leases = [lease] if lease is not None else []
        self.stats["prefilled"] += sum(prefilled)
        self.stats["prompt_tokens"] += sum(map(len, prompts))
        seeds = [job.seed if job.seed is not None else _random_seed() for job in jobs]
        batch = kv.Batch(
            states,
            mx.zeros((len(jobs),), mx.uint32),
            keys=kv.row_keys(seeds),
            sampling=[kv.Sampling(temperature=job.temperature, top_p=job.top_p) for job in jobs],
            ids=[job.id for job in jobs],
            payload=[(job, 0) for job in jobs],
        )
        tokens, keys = sample_batch(logits, batch)
        batch = attrs.evolve(batch, tokens=tokens, keys=keys)
        draft_states = None
        if isinstance(self.drafter, DraftModel):
            _, draft_states = bridge.prefill(self.drafter.model, prompts)
        origin = [(b, 0) for b in range(len(jobs))]  # per row: (job, choice)
        for b, job in enumerate(jobs):  # a job's choices share its prompt's rows (kv.fork)
            if job.n > 1:
                batch = kv.fork(batch, b, job.n - 1)
                if draft_states is not None:
                    draft_states = kv.fork(draft_states, b, job.n - 1)
                origin += [(b, c) for c in range(1, job.n)]
        batch = attrs.evolve(batch, payload=[(jobs[b], c) for b, c in origin])
        first = cast(list, batch.tokens.tolist())  # [B]
        context = [list(jobs[b].prompt) + [t] for (b, _), t in zip(origin, first)]
        k = (self.num_draft if self.drafter is not None else 0,) * len(origin)
        new = speculative.Speculation(batch, context, k, k, draft_states, self.window)
        self.spec = new if self.spec is None else speculative.join(self.spec, new)
        B = self.spec.batch_size
        self._emit([(t,) for t in first], range(B - len(origin), B))

    def _round(self) -> None:
        from ..speculative import rounds as speculative

        self.spec, r = speculative.step(self.model, self.spec, drafter=self.drafter)
        self.window = self.spec.window  # what it measured outlives the rows
        self.stats["rounds"] += 1
        self.stats["drafted"] += sum(r.drafted)
        self.stats["accepted"] += sum(r.accepted)
        self._emit(r.emitted, range(self.spec.batch_size))

    def _emit(self, emitted, rows) -> None:
        """Hand each row's new tokens to its job; finished or cancelled rows leave."""
        from ..speculative import rounds as speculative

        payload = self.spec.batch.payload
        for toks, b in zip(emitted, rows):
            job, choice = payload[b]
            for t in toks:
                if choice in job.cancelled:
                    break
                job.generated[choice] += 1
                job.emit("token", choice, t)
                if t in self.eos or job.generated[choice] >= job.max_tokens:
                    job.emit("done", choice, "stop" if t in self.eos else "length")
                    job.cancel(choice)
        keep = [b for b, (job, choice) in enumerate(payload) if choice not in job.cancelled]
        if len(keep) < len(payload):
            for job in {job for job, _ in payload}:
                if len(job.cancelled) == job.n:
                    job.release()
            if not keep:  # the batch empties: the rule keeps its last round's cost
                self.window = speculative.recorded(self.spec)
            self.spec = speculative.leave(self.spec, keep) if keep else None


def _random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


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
