"""`kvstate serve` on the real model, called with the real `openai` client over localhost."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the serve tests call the server with openai")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")

from _server import QUESTIONS, Server, greedy_reference, messages  # noqa: E402

from kvstate.serving.engine import KVStateEngine, Request  # noqa: E402
from kvstate.serving.engine import serve as generate  # noqa: E402
from kvstate.serving.http import model_id  # noqa: E402
from kvstate.serving.prefix_cache import PrefixCache  # noqa: E402


@pytest.fixture(scope="module")
def server(smollm):
    s = Server(smollm, max_batch=16, max_queue=32, prefix_cache=PrefixCache(64 << 20))
    yield s
    s.close()


def test_chat_and_completion_greedy_equal_kvstate_generate(server, smollm):
    client = server.client()
    want = greedy_reference(smollm, QUESTIONS[:2], 24)
    for q, w in zip(QUESTIONS[:2], want):
        r = client.chat.completions.create(
            model="x", messages=messages(q), max_tokens=24, temperature=0
        )
        assert r.choices[0].message.content == w
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == len(smollm.tokenizer.chat(messages(q)))
    assert "Paris" in want[0]
    # streaming gives the same text, in deltas
    stream = client.chat.completions.create(
        model="x", messages=messages(QUESTIONS[0]), max_tokens=24, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == want[0]
    # /v1/completions takes raw text (here: the chat prompt rendered by hand)
    prompt = smollm.tokenizer._render(messages(QUESTIONS[0]))
    r = client.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want[0]
    stream = client.completions.create(
        model="x", prompt=prompt, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want[0]


def test_models_health_and_stop_strings(server, smollm):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [model_id(smollm.name)]
    with urllib.request.urlopen(server.url + "/health") as h:
        health = json.load(h)
    assert health["status"] == "ok" and health["queued"] == 0
    assert set(health["mlx_mib"]) == {"active", "cache", "peak"}
    assert health["mlx_mib"]["active"] > 0  # the model's weights
    full = greedy_reference(smollm, QUESTIONS[:1], 24)[0]
    cut = full.index("Paris")
    r = server.client().chat.completions.create(
        model="x", messages=messages(QUESTIONS[0]), max_tokens=24, temperature=0, stop=["Paris"]
    )
    assert r.choices[0].message.content == full[:cut]
    assert r.choices[0].finish_reason == "stop"


def test_n_samples_share_the_prompt_and_seed_is_reproducible(server):
    client = server.client()
    kw = dict(
        model="x",
        messages=messages("Tell me a short story."),
        max_tokens=12,
        temperature=1.0,
        n=4,
        seed=5,
    )
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in b.choices]  # same seed, same samples
    assert len(set(texts)) > 1  # each choice has its own key


def test_16_concurrent_streaming_clients_get_their_own_text(server, smollm):
    questions = [QUESTIONS[i % 4] for i in range(16)]
    want = dict(zip(QUESTIONS, greedy_reference(smollm, QUESTIONS, 16)))
    got = [None] * 16

    def one(i):
        stream = server.client().chat.completions.create(
            model="x", messages=messages(questions[i]), max_tokens=16, temperature=0, stream=True
        )
        got[i] = "".join(c.choices[0].delta.content or "" for c in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == [want[q] for q in questions]


def test_a_client_killed_mid_stream_frees_its_row_and_stalls_nobody(server, smollm):
    want = greedy_reference(smollm, QUESTIONS[:1], 16)[0]
    body = json.dumps(
        {
            "model": "x",
            "messages": messages("Write a long poem about the sea."),
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    assert s.recv(4096).startswith(b"HTTP/1.1 200")  # streaming has begun
    s.close()  # the client dies mid-stream
    r = server.client(timeout=120).chat.completions.create(
        model="x", messages=messages(QUESTIONS[0]), max_tokens=16, temperature=0
    )
    assert r.choices[0].message.content == want
    deadline = time.time() + 30
    while server.scheduler.active_rows and time.time() < deadline:
        time.sleep(0.1)
    assert server.scheduler.active_rows == 0  # the dead client's row left, long before 400


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
        ({"messages": "hi"}, 400, "messages"),
        ({"prompt": ""}, 400, "prompt"),
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_style_4xx(server, body, status, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    req = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == status
    err = json.load(e.value)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="x", messages=[], max_tokens=4)


def test_a_full_queue_answers_429(smollm):
    s = Server(smollm, max_batch=1, max_queue=1)
    try:
        with pytest.raises(openai.BadRequestError, match="at most 1"):  # n > the batch: 400
            s.client().chat.completions.create(
                model="x", messages=messages("Hi"), n=2, max_tokens=2
            )
        slow = threading.Thread(
            target=lambda: s.client().chat.completions.create(
                model="x", messages=messages("Write a long poem."), max_tokens=60, temperature=0
            )
        )
        slow.start()
        while not s.scheduler.active_rows:
            time.sleep(0.02)
        waiting = threading.Thread(
            target=lambda: s.client().chat.completions.create(
                model="x", messages=messages("Hi"), max_tokens=2, temperature=0
            )
        )
        waiting.start()
        while not s.scheduler.queued:
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError):
            s.client().chat.completions.create(model="x", messages=messages("Hi"), max_tokens=2)
        slow.join(300)
        waiting.join(300)
    finally:
        s.close()


def test_greedy_rows_with_prompt_lookup_drafts_give_the_plain_text(smollm):
    """--draft ngram: the batch speculates (per-row acceptance) and greedy text is unchanged."""
    from kvstate.speculative.drafts import Lookup

    want = greedy_reference(smollm, QUESTIONS, 16)
    s = Server(
        smollm, max_batch=8, prefix_cache=PrefixCache(64 << 20), drafter=Lookup(), num_draft=3
    )
    assert ask_at_once(s, QUESTIONS, 16) == want
    assert s.scheduler.stats["drafted"] > 0  # rows did draft


def ask_at_once(s, questions, max_tokens):
    """Every question from its own client thread at once (greedy); the answers;
    the server is closed after."""
    got = [None] * len(questions)
    try:

        def one(i):
            r = s.client().chat.completions.create(
                model="x", messages=messages(questions[i]), max_tokens=max_tokens, temperature=0
            )
            got[i] = r.choices[0].message.content

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        s.close()
    return got


def test_serve_rounds_go_through_the_cost_aware_window(smollm):
    """``window=Window()`` (``kvstate serve``'s default with a drafter): every round
    the scheduler runs is timed into the one rule, which outlives the rows
    (kept across batches), and greedy text is unchanged."""
    from kvstate.speculative.drafts import Lookup
    from kvstate.speculative.rounds import Window

    want = greedy_reference(smollm, QUESTIONS, 12)
    s = Server(smollm, max_batch=8, drafter=Lookup(), num_draft=3, window=Window(samples=1))
    assert ask_at_once(s, QUESTIONS, 12) == want
    window = s.scheduler.window
    assert s.scheduler.spec is None and isinstance(window, Window)  # every row left
    assert sum(window.rounds.values()) == s.scheduler.stats["rounds"] > 0


@pytest.mark.parametrize("flags, cost", [([], True), (["--draft-window", "fixed"], False)])
def test_serve_command_passes_the_draft_window(monkeypatch, flags, cost):
    """``kvstate serve --draft ngram`` hands the scheduler a ``Window`` (default
    ``--draft-window cost``), ``--draft-window fixed`` none."""
    from kvstate import cli
    from kvstate.serving import http as server
    from kvstate.speculative.rounds import Window

    got = {}
    monkeypatch.setattr(server, "run", lambda loaded, **options: got.update(options))
    assert cli.main(["serve", "--model", "tiny", "--draft", "ngram", *flags]) == 0
    assert isinstance(got["window"], Window) == cost and (cost or got["window"] is None)


class ServeProcess:
    """``python -m kvstate serve --float32 FLAGS`` on a free port, until ``stop``
    (SIGTERM: a graceful shutdown); ``err`` is its stderr once stopped."""

    def __init__(self, *flags):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "kvstate", "serve", "--port", str(self.port), "--float32"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([*cmd, *flags], stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + 180
        while True:
            try:
                url = f"http://127.0.0.1:{self.port}/health"
                with urllib.request.urlopen(url, timeout=2) as h:
                    assert json.load(h)["status"] == "ok"
                    break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise AssertionError(f"kvstate serve did not start: {self.err}") from None
                time.sleep(0.5)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none")

    def stop(self):
        self.proc.terminate()
        _, self.err = self.proc.communicate(timeout=60)
        return self.proc.returncode


def test_the_kvstate_serve_command(smollm):
    """The command, with --draft ngram: greedy text equals kvstate generate's (no draft)."""
    want = greedy_reference(smollm, QUESTIONS[:1], 12)[0]
    server = ServeProcess("--draft", "ngram", "--num-draft", "3")
    try:
        r = server.client.chat.completions.create(
            model="x", max_tokens=12, temperature=0, messages=messages(QUESTIONS[0])
        )
        assert r.choices[0].message.content == want
        assert "Paris" in want
    finally:
        server.stop()


def reference(smollm, conversation, max_tokens):
    """The greedy reply to ``conversation`` with no prefix cache (`kvstate generate`'s engine)."""
    tok = smollm.tokenizer
    reqs = [Request(0, tuple(tok.chat(conversation)), max_tokens, stop=tok.eos_ids)]
    done, _ = generate(KVStateEngine(smollm.model), reqs, batch_size=1)
    return tok.decode(list(done[0].tokens))


def test_a_second_turn_reads_the_first_reply_from_the_cache(server, smollm):
    """The reply of turn 1 joins the prefix cache: turn 2 (its prompt renders that reply
    through the chat template) is served its whole history but a few tokens from the
    cache, reports them in usage (whole, and streamed with include_usage), and answers
    what it answers with no cache."""
    client = server.client()
    chat = [
        {"role": "system", "content": "You are a tour guide. Answer briefly."},
        {"role": "user", "content": "Which city should I visit in Spain?"},
    ]
    r1 = client.chat.completions.create(model="x", messages=chat, max_tokens=24, temperature=0)
    before = r1.usage.prompt_tokens + r1.usage.completion_tokens
    chat += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "What should I eat there?"},
    ]
    kw = dict(model="x", messages=chat, max_tokens=16, temperature=0)
    r2 = client.chat.completions.create(**kw)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # the whole history but the reply's last token or two (never fed, or rendered
    # differently by the template): a prompt-only cache would serve about half
    assert 0.9 * before <= cached < r2.usage.prompt_tokens
    assert r2.choices[0].message.content == reference(smollm, chat, 16)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.prompt_tokens == r2.usage.prompt_tokens
    assert usage.completion_tokens == r2.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - 1  # a repeat
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == r2.choices[0].message.content


@pytest.mark.slow(reason="starts the real-model server twice (about 20 s here)")
def test_prefix_cache_dir_keeps_the_cache_across_a_restart(tmp_path):
    ask = dict(model="x", messages=messages(QUESTIONS[2]), max_tokens=4, temperature=0)
    first = ServeProcess("--prefix-cache-dir", str(tmp_path))
    try:
        r = first.client.chat.completions.create(**ask)
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # a fresh, empty cache
    finally:
        first.stop()
    assert "entries saved to" in first.err
    (saved,) = tmp_path.iterdir()
    second = ServeProcess("--prefix-cache-dir", str(tmp_path))
    try:
        r = second.client.chat.completions.create(**ask)
        assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    finally:
        second.stop()
    assert f"entries from {saved}" in second.err


def test_a_prefix_cache_file_of_another_model_is_refused_with_a_message(tmp_path, rng):
    """``--prefix-cache-dir``: the file at this model's name holds another model's cache
    (or is no cache at all): the server says so and starts with an empty cache."""
    import io

    import mlx.core as mx

    import kvstate as kv
    from kvstate import cli

    args = cli._parser().parse_args(
        ["serve", "--model", "tiny", "--prefix-cache-dir", str(tmp_path)]
    )
    identity = cli._identity(args, None)
    path = cli.prefix_cache_file(tmp_path, identity)
    k = mx.array(rng.standard_normal((1, 2, 3, 4)).astype("float32"))
    for made_for in ("another model", identity):
        other = PrefixCache(1 << 20, identity=made_for)
        other.insert([1, 2, 3], [kv.append(kv.empty(1), k, k)])
        other.save(path)
        err = io.StringIO()
        cache, _ = cli._serve_cache_dir(args, PrefixCache(1 << 20), err)
        assert len(cache) == (made_for == identity) and cache.identity == identity
        assert ("not loaded" in err.getvalue()) == (made_for != identity)
    assert "another model" not in err.getvalue() and "1 prefix cache entries" in err.getvalue()
    path.write_bytes(b"not a safetensors file")
    err = io.StringIO()
    cache, save = cli._serve_cache_dir(args, PrefixCache(1 << 20), err)
    assert len(cache) == 0 and "not loaded" in err.getvalue()
