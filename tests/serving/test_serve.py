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

from _http import Server  # noqa: E402

from kvstate.serving.engine import KVStateEngine, Request  # noqa: E402
from kvstate.serving.engine import serve as generate  # noqa: E402
from kvstate.serving.prefix_cache import PrefixCache  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "What color is the sky on a clear day?",
]


@pytest.fixture(scope="module")
def server(smollm):
    s = Server(smollm, max_batch=16, max_queue=32, prefix_cache=PrefixCache(64 << 20))
    yield s
    s.close()


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
    assert [m.id for m in client.models.list().data] == [smollm.name]
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


def test_the_kvstate_serve_command(smollm):
    """The command, with --draft ngram: greedy text equals kvstate generate's (no draft)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    want = greedy_reference(smollm, QUESTIONS[:1], 12)[0]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstate",
            "serve",
            "--port",
            str(port),
            "--float32",
            "--draft",
            "ngram",
            "--num-draft",
            "3",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as h:
                    assert json.load(h)["status"] == "ok"
                    break
            except OSError:
                assert proc.poll() is None and time.time() < deadline
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.chat.completions.create(
            model="x", max_tokens=12, temperature=0, messages=messages(QUESTIONS[0])
        )
        assert r.choices[0].message.content == want
        assert "Paris" in want
    finally:
        proc.terminate()
        proc.wait(30)
