"""A mixed serving soak: `kvstate serve` per model family under every kind of client.

One real `kvstate serve` app per family (``http.run``, the command's own serving path,
each in its own process on a free localhost port): a dense tiny llama, a gemma3 with
sliding-window (ring) layers, a recurrent mamba2, a chunked llama4, a composite
falcon_h1 (``--families``), and the real SmolLM2-135M-Instruct (float32) as
``smollm``. The tiny models are the tests' seeded random ones at SmolLM2's vocabulary,
with its tokenizer and chat template, so their requests take milliseconds. Every
server has a prefix cache (``--prefix-cache-mb``, ring and recurrent records
included), ``--max-batch``, a ``--request-timeout`` deadline below the client's.

``--clients`` concurrent clients (spread over the servers) each send one request
after another, a random mix: chat and text completions through the real ``openai``
client (streamed or not, greedy or seeded, ``n`` 1 or 2, stop strings), multi-turn
sessions (each turn resends the history and the reply: prefix hits), clients that
drop the connection mid-stream, requests cancelled before their reply, bad requests
through raw aiohttp (``seed`` -1 and 2**64, 100k-deep JSON, ``"stop": ""``, wrong
types, a 2 MB prompt, a 5 MB body, unknown fields, broken JSON), and injected
faults: a failing first-token sampler, a round that fails for one row, a forward
that fails in one prompt's prefill. The faults are hooks the server process
installs (as ``tests/_faults.py`` does): each fires only for a request that marks
itself (a temperature of 0.5 or 0.25, a poison word in its prompt).

Every request ends in exactly one outcome: ``ok``, ``expected`` (the error its kind
must get, OpenAI-shaped), ``unexpected`` (any other error or shape), ``hang`` (no
answer within ``--timeout``), ``lost`` (the connection closed with no terminal
answer: no finish reason, no ``[DONE]``), ``disconnected`` / ``cancelled`` (the
client left on purpose). After the load, each server must be idle (no rows, no
queue), a sample of the greedy replies (``--check`` per server) is sent again alone
to the idle server and must give the same text, and SIGTERM must drain each server
to exit 0. Every ``--sample`` seconds each server's ``/health`` (it must answer
200), resident memory (psutil), MLX memory and the KV bytes it holds (``/metrics``,
rows and prefix cache: told, not judged) are read; memory is "flat" when,
after ``--warmup``, the median of the last third of the samples is within
``--flat`` of the first third's.

    python -m benchmarks soak --minutes 30 --clients 16 --json soak.json
    python -m benchmarks soak --minutes 2 --clients 6 --families llama mamba2

The exit status is 1 when anything failed (a hang, a lost request, an unexpected
error, a mismatch, a health failure, a busy idle server, memory not flat, an
unclean exit). The servers' own output goes to log files whose paths are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SAMPLER_MARK = 0.5  # a request at this temperature fails in its first-token sampler
ROUND_MARK = 0.25  # ... in a round, once its row has 2 tokens
POISON = "zqxjpoison"  # a prompt holding this word fails in the model's forward (prefill)
FAULTS = {
    "sampler": "injected sampler fault",
    "round": "injected round fault",
    "prefill": "injected prefill fault",
}
TINY = ("llama", "gemma3", "mamba2", "llama4", "falcon_h1", "lfm2", "qwen3_next")

SYSTEM = "You are a terse assistant. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Recommend a classic novel.",
    "What is a haiku?",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is the largest ocean?",
]


# --- the server side: one process per family -------------------------------------------


class Faulty:
    """The model, but its forward raises for an input row holding ``poison`` (token ids
    in order): only a prefill can hold it, a decode step feeds one token a row."""

    def __init__(self, model, poison: list):
        self.model, self.poison = model, poison

    def __call__(self, inputs, cache=None, **kw):
        n = len(self.poison)
        if inputs.ndim == 2 and inputs.shape[1] >= n:
            for row in inputs.tolist():
                if any(row[i : i + n] == self.poison for i in range(len(row) - n + 1)):
                    raise RuntimeError(FAULTS["prefill"])
        return self.model(inputs, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def install_faults() -> None:
    """The scheduler's first-token sampler fails for a batch holding a row at
    ``SAMPLER_MARK``; a round fails while a row at ``ROUND_MARK`` holds 2 tokens or more
    (the scheduler's own names are replaced, as ``tests/_faults.py`` does)."""
    from kvstate.serving import scheduler as sched

    sample, step = sched.sample_batch, sched.speculative.step

    def faulty_sample(logits, batch):
        if any(s.temperature == SAMPLER_MARK for s in batch.sampling):
            raise RuntimeError(FAULTS["sampler"])
        return sample(logits, batch)

    def faulty_step(target, spec, **kw):
        for job, _ in spec.batch.payload:
            if job.temperature == ROUND_MARK and job.generated[0] >= 2:
                raise RuntimeError(FAULTS["round"])
        return step(target, spec, **kw)

    sched.sample_batch = faulty_sample
    sched.speculative.step = faulty_step


def tiny(family: str, vocab: int):
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_hybrid as th
    import tiny_models as tm

    if family == "llama":
        return tm.llama_model(vocab=vocab)
    if family == "gemma3":  # a window of 64: chat prompts wrap its rings
        return tm.gemma3_model(sliding_window=64, vocab=vocab)
    return th.MODELS[family](vocab=vocab)


def serve(args) -> None:
    """``--serve FAMILY --port P``: one server, faults installed, until SIGTERM."""
    import logging

    from kvstate.models import gguf
    from kvstate.models import load as models
    from kvstate.models.load import Loaded
    from kvstate.serving import http
    from kvstate.serving.prefix_cache import PrefixCache

    family = args.serve
    if family == "smollm":
        loaded = models.load_model(None, dequantize=True)
    else:
        _, meta = gguf.read(models.fetch())
        tok = gguf.tokenizer(meta)
        vocab = len(meta["tokenizer.ggml.tokens"])
        loaded = Loaded(tiny(family, vocab), tok, f"tiny-{family}")
    import mlx.core as mx

    mx.eval(loaded.model.parameters())  # (a GGUF's layers are dequantized lazily)
    poison = loaded.tokenizer.encode(POISON)[1:]  # (its first piece merges with what precedes)
    loaded = Loaded(Faulty(loaded.model, poison), loaded.tokenizer, loaded.name)
    install_faults()
    log = logging.getLogger("kvstate.serve")
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.INFO)
    mb = args.prefix_cache_mb * (8 if family == "smollm" else 1)
    http.run(
        loaded,
        host="127.0.0.1",
        port=args.port,
        log=sys.stderr,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        timeout=args.request_timeout,
        prefix_cache=PrefixCache(mb << 20) if mb else None,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(family: str, args, logdir: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks", "soak", "--serve", family, "--port", str(port)]
    cmd += ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue)]
    cmd += ["--request-timeout", str(args.request_timeout)]
    cmd += ["--prefix-cache-mb", str(args.prefix_cache_mb)]
    log = logdir / f"{family}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    return dict(family=family, proc=proc, url=f"http://127.0.0.1:{port}", log=log)


def wait_up(server: dict, seconds: float = 300) -> None:
    import urllib.request

    deadline = time.time() + seconds
    while True:
        try:
            with urllib.request.urlopen(server["url"] + "/health", timeout=2):
                return
        except OSError as e:
            if server["proc"].poll() is not None or time.time() > deadline:
                raise SystemExit(
                    f"the {server['family']} server did not start; see {server['log']}"
                ) from e
            time.sleep(0.3)


# --- the client side ---------------------------------------------------------------------


class Tally:
    """Every request's one outcome, by kind, and what the checks need."""

    def __init__(self, seed: int, keep: int):
        self.started: Counter = Counter()
        self.outcomes: Counter = Counter()  # (kind, outcome)
        self.examples: dict = defaultdict(list)  # outcome -> first few (kind, server, why)
        self.greedy: dict = defaultdict(list)  # server -> reservoir of (route, body, texts)
        self.greedy_seen: Counter = Counter()
        self.latency: list = []
        self.cached = [0, 0]  # session turns after the first: cached tokens, prompt tokens
        self.rng = random.Random(seed)
        self.keep = keep

    def end(self, kind: str, server: str, outcome: str, why: str = "") -> None:
        self.outcomes[kind, outcome] += 1
        if (
            outcome in ("unexpected", "hang", "lost", "mismatch")
            and len(self.examples[outcome]) < 8
        ):
            self.examples[outcome].append(f"{kind} on {server}: {why}"[:400])

    def greedy_reply(self, server: str, route: str, body: dict, texts: list) -> None:
        """Reservoir-sample a greedy request and its reply for the replay check."""
        self.greedy_seen[server] += 1
        pool, seen = self.greedy[server], self.greedy_seen[server]
        item = (route, body, texts)
        if len(pool) < self.keep:
            pool.append(item)
        elif self.rng.random() < self.keep / seen:
            pool[self.rng.randrange(self.keep)] = item


def openai_shaped(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


def chat_body(rng: random.Random, *, greedy=None, question=None) -> dict:
    greedy = rng.random() < 0.7 if greedy is None else greedy
    body: dict = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question or rng.choice(QUESTIONS)},
        ],
        "max_tokens": rng.randint(4, 24),
        "temperature": 0.0 if greedy else 0.8,
    }
    if not greedy:
        body["seed"] = rng.randrange(2**32)
    if rng.random() < 0.15:
        body["n"] = 2
    if rng.random() < 0.1:
        body["stop"] = [rng.choice([".", " the", "e"])]
    return body


async def call_openai(client, route: str, body: dict, stream: bool) -> dict:
    """One request through the openai client: ``{"texts", "finish", "usage"}``; raises
    what the client raises."""
    if route == "chat":
        create = client.chat.completions.create
    else:
        create = client.completions.create
    kw = dict(body, model="x")
    if not stream:
        r = await create(**kw)
        texts = [(c.message.content if route == "chat" else c.text) or "" for c in r.choices]
        return dict(texts=texts, finish=[c.finish_reason for c in r.choices], usage=r.usage)
    n = body.get("n", 1)
    texts, finish, usage = [""] * n, [None] * n, None
    s = await create(**kw, stream=True, stream_options={"include_usage": True})
    async for chunk in s:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            delta = (c.delta.content if route == "chat" else c.text) or ""
            texts[c.index] += delta
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return dict(texts=texts, finish=finish, usage=usage)


def status_error(e) -> tuple:
    """``(status, OpenAI-shaped)`` of an ``openai.APIStatusError``."""
    try:
        shaped = openai_shaped(e.response.json())
    except Exception:
        shaped = False
    return e.status_code, shaped


class Soak:
    def __init__(self, args, servers: list):
        import openai

        self.openai = openai
        self.args = args
        self.servers = servers
        self.tally = Tally(args.seed, args.check)
        self.clients = {
            s["family"]: openai.AsyncOpenAI(
                base_url=s["url"] + "/v1", api_key="none", max_retries=0, timeout=args.timeout + 30
            )
            for s in servers
        }
        self.health: Counter = Counter()
        self.health_worst = 0.0
        self.samples: dict = {s["family"]: [] for s in servers}
        self.big = ("The quick brown fox jumps over the lazy dog. " * 45_000)[:2_000_000]

    # -- one request of each kind --

    async def bounded(self, kind: str, server: dict, coro) -> None:
        """Run one request's coroutine, which records its own outcome; no answer within
        ``--timeout`` is a hang."""
        self.tally.started[kind] += 1
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(coro, self.args.timeout)
        except asyncio.TimeoutError:
            self.tally.end(kind, server["family"], "hang", f"no answer in {self.args.timeout} s")
        except Exception as e:  # a bug in the soak itself, or what it did not foresee
            self.tally.end(kind, server["family"], "unexpected", f"{type(e).__name__}: {e}")
        self.tally.latency.append(time.perf_counter() - t0)

    async def normal(self, kind, server, rng, route="chat", body=None, fault=None) -> dict | None:
        """A chat or text completion; a fault request must get its injected error."""
        oa, name = self.openai, server["family"]
        if body is None:
            body = chat_body(rng)
            if route == "completion":
                body = {k: v for k, v in body.items() if k not in ("messages",)} | {
                    "prompt": body["messages"][1]["content"]
                }
        stream = rng.random() < 0.5
        try:
            r = await call_openai(self.clients[name], route, body, stream)
        except oa.APIStatusError as e:
            status, shaped = status_error(e)
            if fault and status == 500 and shaped and FAULTS[fault] in e.message:
                self.tally.end(kind, name, "expected")
            elif kind == "session" and status == 400 and "context_length_exceeded" in str(e):
                self.tally.end(kind, name, "expected")  # the conversation outgrew the model
            else:
                self.tally.end(kind, name, "unexpected", f"{status} shaped={shaped}: {e.message}")
            return None
        except oa.APITimeoutError as e:
            self.tally.end(kind, name, "hang", repr(e))
            return None
        except oa.APIConnectionError as e:
            self.tally.end(kind, name, "lost", f"connection: {e!r}")
            return None
        except oa.APIError as e:  # an error event in a stream
            if fault and FAULTS[fault] in e.message:
                self.tally.end(kind, name, "expected")
            else:
                self.tally.end(kind, name, "unexpected", f"stream error event: {e.message}")
            return None
        if None in r["finish"]:
            self.tally.end(kind, name, "lost", f"no finish reason (stream={stream}): {r['finish']}")
            return None
        if fault:  # the fault must have fired, unless the reply ended before it could
            early = fault == "round" and all(len(t) <= 2 for t in r["texts"])
            if not early:
                self.tally.end(kind, name, "unexpected", f"the {fault} fault did not fire: {r}")
                return None
        self.tally.end(kind, name, "ok")
        if body.get("temperature") == 0.0:
            self.tally.greedy_reply(name, route, body, r["texts"])
            if len(set(r["texts"])) > 1:
                self.tally.end(kind, name, "mismatch", f"greedy choices differ: {r['texts']}")
        return r

    async def session(self, server, rng) -> None:
        """A conversation of 3-8 greedy turns; each resends the history and the reply."""
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(rng.randint(3, 8)):
            messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
            body = {
                "messages": list(messages),
                "max_tokens": rng.randint(8, 24),
                "temperature": 0.0,
            }
            box: list = []

            async def one(body=body, box=box):
                box.append(await self.normal("session", server, rng, body=body))

            await self.bounded("session", server, one())
            r = box[0] if box else None
            if r is None:
                return
            usage = r["usage"]
            if turn and usage is not None:
                details = usage.prompt_tokens_details
                self.tally.cached[0] += (details.cached_tokens or 0) if details else 0
                self.tally.cached[1] += usage.prompt_tokens
            messages.append({"role": "assistant", "content": r["texts"][0]})

    async def disconnect(self, session, server, rng) -> None:
        """A stream the client drops after its first chunks."""
        name = server["family"]
        body = dict(chat_body(rng), max_tokens=rng.randint(40, 120), stream=True)
        async with session.post(server["url"] + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                self.tally.end("disconnect", name, "unexpected", f"{r.status}: {await r.text()}")
                return
            seen, leave_after = 0, rng.randint(1, 4)
            async for line in r.content:
                if line.startswith(b"data: "):
                    seen += 1
                    if line.startswith(b"data: [DONE]"):
                        self.tally.end("disconnect", name, "ok")  # it ended first
                        return
                    if seen >= leave_after:
                        break
            r.close()  # the connection goes, mid-stream
        self.tally.end("disconnect", name, "disconnected")

    async def cancel(self, server, rng) -> None:
        """A request the client cancels before its reply comes."""
        name = server["family"]
        body = dict(chat_body(rng), max_tokens=rng.randint(40, 120))
        task = asyncio.ensure_future(
            call_openai(self.clients[name], "chat", body, rng.random() < 0.5)
        )
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        if task.done():
            try:
                task.result()
                self.tally.end("cancel", name, "ok")
            except Exception as e:
                self.tally.end("cancel", name, "unexpected", repr(e))
            return
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        self.tally.end("cancel", name, "cancelled")

    def bad_body(self, rng) -> tuple:
        """``(what, route, raw body, statuses it may get)``."""
        good = dict(chat_body(rng, greedy=True), max_tokens=4)
        choices = [
            ("seed -1", dict(good, seed=-1)),
            ("seed 2**64", dict(good, seed=2**64)),
            ("stop ''", dict(good, stop="")),
            ("temperature 'hot'", dict(good, temperature="hot")),
            ("messages 'hi'", dict(good, messages="hi")),
            ("max_tokens -5", dict(good, max_tokens=-5)),
            ("n 0", dict(good, n=0)),
            ("stream 'yes'", dict(good, stream="yes")),
            ("top_p 2", dict(good, top_p=2)),
            ("messages []", dict(good, messages=[])),
            ("role 'wizard'", dict(good, messages=[{"role": "wizard", "content": "hi"}])),
        ]
        r = rng.random()
        if r < 0.08:
            return "deep JSON", "chat", b"[" * 100_000 + b"]" * 100_000, (400,)
        if r < 0.14:
            return "broken JSON", "chat", b'{"messages": [', (400,)
        if r < 0.19:  # tokenized (seconds of a worker thread), then refused: too long
            body = {"prompt": self.big, "max_tokens": 1}
            return "2 MB prompt", "completion", json.dumps(body).encode(), (400,)
        if r < 0.22:  # past the server's 4 MB body limit
            body = {"prompt": self.big * 3, "max_tokens": 1}
            return "6 MB body", "completion", json.dumps(body).encode(), (413,)
        if r < 0.28:  # refused: a field OpenAI does not define is named in a 400
            body = dict(good, foo="bar")
            return "unknown field", "chat", json.dumps(body).encode(), (400,)
        if r < 0.35:  # accepted: fields the server implements or takes by name
            body = dict(good, logit_bias={"50": 1}, user="soak")
            return "known fields", "chat", json.dumps(body).encode(), (200,)
        what, body = rng.choice(choices)
        return what, "chat", json.dumps(body).encode(), (400,)

    async def bad(self, session, server, rng) -> None:
        name = server["family"]
        what, route, raw, want = self.bad_body(rng)
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        headers = {"Content-Type": "application/json"}
        async with session.post(server["url"] + path, data=raw, headers=headers) as r:
            text = await r.text()
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if r.status not in want:
            self.tally.end("bad", name, "unexpected", f"{what}: {r.status} {text[:200]}")
        elif r.status == 200:
            ok = isinstance(body, dict) and body.get("choices")
            self.tally.end("bad", name, "ok" if ok else "unexpected", f"{what}: {text[:200]}")
        elif not openai_shaped(body):
            self.tally.end(
                "bad", name, "unexpected", f"{what}: {r.status} not OpenAI-shaped: {text[:200]}"
            )
        else:
            self.tally.end("bad", name, "expected")

    async def fault(self, server, rng) -> None:
        which = rng.choice(list(FAULTS))
        body = chat_body(rng, greedy=False)
        body.pop("stop", None)
        body["max_tokens"] = max(body["max_tokens"], 8)
        if which == "sampler":
            body["temperature"] = SAMPLER_MARK
        elif which == "round":
            body["temperature"] = ROUND_MARK
        else:
            body["messages"][1]["content"] = f"Please say {POISON} twice."
        await self.normal("fault", server, rng, body=body, fault=which)

    # -- the load --

    def server_of(self, i: int) -> dict:
        """Client ``i``'s server: one client each first, then the tiny ones in turn
        (the real model, on a CPU, serves one client's mix and no more)."""
        if i < len(self.servers):
            return self.servers[i]
        tiny = [s for s in self.servers if s["family"] != "smollm"] or self.servers
        return tiny[(i - len(self.servers)) % len(tiny)]

    async def warm(self) -> None:
        """One short greedy request per server before the clock starts (not counted)."""
        for s in self.servers:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            await call_openai(self.clients[s["family"]], "chat", dict(body, temperature=0.0), False)

    async def client(self, i: int, session, stop_at: float) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        server = self.server_of(i)
        kinds = ["chat", "completion", "session", "disconnect", "cancel", "bad", "fault"]
        weights = [30, 8, 10, 8, 6, 16, 12]
        while time.perf_counter() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            if kind == "session":
                await self.session(server, rng)
                continue
            if kind in ("chat", "completion"):
                coro = self.normal(kind, server, rng, route=kind)
            elif kind == "disconnect":
                coro = self.disconnect(session, server, rng)
            elif kind == "cancel":
                coro = self.cancel(server, rng)
            elif kind == "bad":
                coro = self.bad(session, server, rng)
            else:
                coro = self.fault(server, rng)
            await self.bounded(kind, server, coro)

    async def monitor(self, session, t0: float, stop: asyncio.Event) -> None:
        """Every ``--sample`` s: each server's /health, RSS and MLX memory."""
        import psutil

        procs = {s["family"]: psutil.Process(s["proc"].pid) for s in self.servers}
        last_print = 0.0
        while not stop.is_set():
            for s in self.servers:
                name = s["family"]
                h0 = time.perf_counter()
                mlx = None
                try:
                    timeout = self.openai_timeout(10)
                    async with session.get(s["url"] + "/health", timeout=timeout) as r:
                        status = r.status
                        mlx = (await r.json()).get("mlx_mib")
                except Exception as e:
                    status = type(e).__name__
                took = time.perf_counter() - h0
                self.health_worst = max(self.health_worst, took)
                self.health[status] += 1
                try:
                    rss = procs[name].memory_info().rss / 2**20
                except psutil.Error:
                    rss = float("nan")
                kv = await self.kv_mib(session, s["url"])
                self.samples[name].append(
                    (time.perf_counter() - t0, rss, mlx and mlx["active"], mlx and mlx["cache"], kv)
                )
            now = time.perf_counter() - t0
            if now - last_print >= self.args.print_every:
                last_print = now
                done = sum(self.tally.outcomes.values())
                bad: Counter = Counter()
                for (_, k), v in self.tally.outcomes.items():
                    if k in ("unexpected", "hang", "lost"):
                        bad[k] += v
                mem = " ".join(
                    f"{n}={x[1]:.0f}/{x[2] or 0:.0f}/{x[3] or 0:.0f}/{x[4] or 0:.1f}"
                    for n, x in ((n, self.samples[n][-1]) for n in self.samples)
                )
                print(
                    f"  {now:6.0f} s  {done} ended  problems {dict(bad) or 0}  "
                    f"MiB rss/mlx active/mlx cache/kv {mem}",
                    flush=True,
                )
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample)
            except asyncio.TimeoutError:
                pass

    async def kv_mib(self, session, url: str):
        """The KV bytes the scheduler holds (rows and prefix cache; ``/metrics``), MiB."""
        try:
            async with session.get(url + "/metrics", timeout=self.openai_timeout(10)) as r:
                text = await r.text()
        except Exception:
            return None
        for line in text.splitlines():
            if line.startswith("kvstate_kv_bytes "):
                return float(line.split()[1]) / 2**20
        return None

    @staticmethod
    def openai_timeout(seconds):
        import aiohttp

        return aiohttp.ClientTimeout(total=seconds)

    async def run(self) -> dict:
        import aiohttp

        await self.warm()
        t0 = time.perf_counter()
        stop_at = t0 + 60 * self.args.minutes
        stop = asyncio.Event()
        async with aiohttp.ClientSession(
            timeout=self.openai_timeout(self.args.timeout + 30)
        ) as session:
            monitor = asyncio.ensure_future(self.monitor(session, t0, stop))
            await asyncio.gather(
                *(self.client(i, session, stop_at) for i in range(self.args.clients))
            )
            load_s = time.perf_counter() - t0
            stop.set()
            await monitor
            idle = await self.idle(session)
            replays = await self.replay()
        return dict(load_s=load_s, idle=idle, replays=replays)

    async def idle(self, session) -> dict:
        """Each server's rows and queue once the load ended (waiting up to 20 s)."""
        out = {}
        for s in self.servers:
            deadline = time.perf_counter() + 20
            while True:
                async with session.get(s["url"] + "/health") as r:
                    h = await r.json()
                if (h["active_rows"], h["queued"]) == (0, 0) or time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.5)
            out[s["family"]] = dict(
                active_rows=h["active_rows"], queued=h["queued"], failed=h["failed"]
            )
        return out

    async def replay(self) -> dict:
        """The sampled greedy requests again, one at a time on the idle server."""
        checked = mismatched = 0
        for s in self.servers:
            name = s["family"]
            for route, body, texts in self.tally.greedy[name]:
                checked += 1
                try:
                    r = await call_openai(self.clients[name], route, body, False)
                except Exception as e:  # an error where the load got a reply
                    mismatched += 1
                    self.tally.end("replay", name, "mismatch", f"{body}: {texts!r} alone {e!r}")
                    continue
                if r["texts"] != texts:
                    mismatched += 1
                    self.tally.end(
                        "replay", name, "mismatch", f"{body}: {texts!r} alone {r['texts']!r}"
                    )
        return dict(checked=checked, mismatched=mismatched)


def flat(samples: list, warmup: float, tol: float, col: int) -> dict:
    """The medians of the first and last thirds after the warm-up, and whether the last
    is within ``tol`` of the first."""
    xs = [s[col] for s in samples if s[0] >= warmup and s[col] is not None and s[col] == s[col]]
    if len(xs) < 3:
        return dict(samples=len(xs), flat=None)
    k = len(xs) // 3
    first, last = statistics.median(xs[:k]), statistics.median(xs[-k:])
    ok = abs(last - first) <= tol * max(first, 1e-9)
    return dict(samples=len(xs), first=round(first, 1), last=round(last, 1), flat=ok)


def stop_servers(servers: list) -> dict:
    """SIGTERM each server; its exit status once it drained (None: it did not exit in 90 s)."""
    for s in servers:
        if s["proc"].poll() is None:
            s["proc"].send_signal(signal.SIGTERM)
    out = {}
    for s in servers:
        try:
            out[s["family"]] = s["proc"].wait(90)
        except subprocess.TimeoutExpired:
            s["proc"].kill()
            out[s["family"]] = None
    return out


def soak(args) -> dict:
    """The whole soak: start the servers, run the load and the checks, stop them; the
    result (counts, memory, verdict) as a dict."""
    logdir = Path(tempfile.mkdtemp(prefix="soak_"))
    servers = [start(f, args, logdir) for f in args.families]
    try:
        for s in servers:
            wait_up(s)
        print(f"soak: servers up ({', '.join(args.families)}); logs in {logdir}", flush=True)
        s = Soak(args, servers)
        r = asyncio.run(s.run())
    finally:
        exits = stop_servers(servers)
    t = s.tally
    kinds = sorted(t.started)
    outcomes = ["ok", "expected", "unexpected", "hang", "lost", "disconnected", "cancelled"]
    by_kind = {k: {o: t.outcomes[k, o] for o in outcomes} for k in kinds}
    for k in kinds:
        by_kind[k]["sent"] = t.started[k]
    totals = {o: sum(v for (_, oo), v in t.outcomes.items() if oo == o) for o in outcomes}
    totals["sent"] = sum(t.started.values())
    totals["mismatch"] = sum(v for (_, oo), v in t.outcomes.items() if oo == "mismatch")
    # every request sent ended in exactly one outcome: any other count is lost
    ended = sum(totals[o] for o in outcomes)
    totals["lost"] += max(totals["sent"] - ended, 0)
    memory = {}
    warmup = args.warmup if args.warmup is not None else 0.2 * 60 * args.minutes
    for name, samples in s.samples.items():
        rss = [x[1] for x in samples]
        memory[name] = dict(
            rss_start=round(rss[0], 1) if rss else None,
            rss_end=round(rss[-1], 1) if rss else None,
            rss_peak=round(max(rss), 1) if rss else None,
            rss_flat=flat(samples, warmup, args.flat, 1),
            mlx_active_flat=flat(samples, warmup, args.flat, 2),
            mlx_cache_last=samples[-1][3] if samples else None,
            kv_flat=flat(samples, warmup, args.flat, 4),  # (told, not judged: rows come and go)
            kv_peak=round(max((x[4] or 0 for x in samples), default=0), 2),
        )
    problems = []
    for key in ("unexpected", "hang", "lost", "mismatch"):
        if totals[key]:
            problems.append(f"{totals[key]} {key}")
    bad_health = sum(v for k, v in s.health.items() if k != 200)
    if bad_health:
        problems.append(f"{bad_health} /health answers not 200")
    for name, idle in r["idle"].items():
        if idle["active_rows"] or idle["queued"]:
            problems.append(f"{name} not idle after the load: {idle}")
    for name, m in memory.items():
        for col in ("rss_flat", "mlx_active_flat"):
            if m[col]["flat"] is False:
                problems.append(f"{name} {col[:-5]} not flat: {m[col]}")
    for name, code in exits.items():
        if code != 0:
            problems.append(f"{name} exited {code} on SIGTERM")
    cached, prompt = t.cached
    lat = sorted(t.latency)
    return dict(
        minutes=args.minutes,
        load_s=round(r["load_s"], 1),
        clients=args.clients,
        families=args.families,
        by_kind=by_kind,
        totals=totals,
        replays=r["replays"],
        session_cached_fraction=round(cached / prompt, 3) if prompt else None,
        latency_s=dict(
            median=round(statistics.median(lat), 3) if lat else None,
            max=round(lat[-1], 2) if lat else None,
        ),
        health=dict(
            polls=sum(s.health.values()), not_200=bad_health, slowest_s=round(s.health_worst, 2)
        ),
        idle=r["idle"],
        memory=memory,
        exits=exits,
        examples=dict(t.examples),
        problems=problems,
        passed=not problems,
        logs=str(logdir),
    )


def report(res: dict) -> None:
    cols = ["sent", "ok", "expected", "unexpected", "hang", "lost", "disconnected", "cancelled"]
    print(
        f"\nsoak: {res['load_s'] / 60:.1f} min of load, {res['clients']} clients, "
        f"{', '.join(res['families'])}"
    )
    print("| kind | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for k, row in res["by_kind"].items():
        print(f"| {k} | " + " | ".join(str(row[c]) for c in cols) + " |")
    tot = res["totals"]
    print("| all | " + " | ".join(str(tot[c]) for c in cols) + " |")
    print(
        f"greedy replays alone: {res['replays']['checked']} checked, "
        f"{res['replays']['mismatched']} differ; mismatches in all: {tot['mismatch']}"
    )
    print(
        f"session turns after the first: {res['session_cached_fraction']} of prompt tokens cached"
    )
    print(f"request latency median {res['latency_s']['median']} s, max {res['latency_s']['max']} s")
    h = res["health"]
    print(f"/health: {h['polls']} polls, {h['not_200']} not 200, slowest {h['slowest_s']} s")
    for name, m in res["memory"].items():
        print(
            f"  {name}: rss start {m['rss_start']} end {m['rss_end']} peak {m['rss_peak']} MiB; "
            f"after warm-up rss {m['rss_flat']}, mlx active {m['mlx_active_flat']}, "
            f"kv {m['kv_flat']} (peak {m['kv_peak']}); "
            f"idle {res['idle'][name]}; exit {res['exits'][name]}"
        )
    for what, xs in res["examples"].items():
        for x in xs:
            print(f"  {what}: {x}")
    print("PASSED" if res["passed"] else "FAILED: " + "; ".join(res["problems"]))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="minutes of load (30)")
    ap.add_argument(
        "--clients", type=int, default=16, help="concurrent clients, over all servers (16)"
    )
    ap.add_argument(
        "--families",
        nargs="+",
        default=["llama", "gemma3", "mamba2", "llama4", "smollm"],
        choices=[*TINY, "smollm"],
        help="one server each (llama gemma3 mamba2 llama4 smollm)",
    )
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="a request with no answer by then is a hang, s"
    )
    ap.add_argument(
        "--request-timeout", type=float, default=90.0, help="the servers' deadline, s (90)"
    )
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=8,
        help="each tiny server's prefix cache; smollm's is 8x (8)",
    )
    ap.add_argument(
        "--check", type=int, default=12, help="greedy replies replayed alone, per server (12)"
    )
    ap.add_argument(
        "--sample", type=float, default=5.0, help="seconds between memory/health samples (5)"
    )
    ap.add_argument(
        "--print-every", type=float, default=60.0, help="seconds between progress lines (60)"
    )
    ap.add_argument(
        "--warmup", type=float, default=None, help="seconds before memory counts (20%% of the run)"
    )
    ap.add_argument(
        "--flat",
        type=float,
        default=0.10,
        help="flat: last third's median within this of the first's",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the result here as JSON")
    ap.add_argument("--serve", choices=[*TINY, "smollm"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.serve:
        serve(args)
        return
    res = soak(args)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {args.json}")
    if not res["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
