"""A real ``kvstate serve`` app on a free localhost port, in a thread, for the tests."""

import asyncio
import threading
import time
import urllib.request

import openai

from kvstate.serving.engine import KVStateEngine, Request
from kvstate.serving.engine import serve as generate
from kvstate.serving.http import make_app

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "What color is the sky on a clear day?",
]


class Server:
    """An aiohttp server for ``make_app`` on a free localhost port, in a thread."""

    def __init__(self, loaded, **options):
        from aiohttp import web

        self.app, self.scheduler = make_app(loaded, **options)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=kw.pop("api_key", "none"),
            max_retries=0,
            timeout=kw.pop("timeout", 120),
            **kw,
        )

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def messages(q):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


def greedy_reference(smollm, questions, max_tokens):
    """What `kvstate generate` (its engine) answers greedily, as text per question."""
    tok = smollm.tokenizer
    reqs = [
        Request(i, tuple(tok.chat(messages(q))), max_tokens, stop=tok.eos_ids)
        for i, q in enumerate(questions)
    ]
    done, _ = generate(KVStateEngine(smollm.model), reqs, batch_size=8)
    return [tok.decode(list(c.tokens)) for c in done]


def wait_healthy(url: str, proc, timeout: float = 120, detail=lambda: "", poll: float = 0.2):
    """Wait until a server process at ``url`` answers ``/health``; fails when ``proc``
    exits or ``timeout`` seconds pass first (``detail()`` says why, e.g. its log)."""
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return
        except OSError:
            assert proc.poll() is None and time.time() < deadline, detail()
            time.sleep(poll)


def record_kinds(server: Server) -> list:
    """The record types each round of ``server``'s scheduler runs on, gathered as it
    runs (its ``_round`` wrapped)."""
    seen: list = []
    step = server.scheduler._round

    def spy():
        seen.extend(type(x) for x in server.scheduler.spec.states)
        step()

    server.scheduler._round = spy
    return seen
