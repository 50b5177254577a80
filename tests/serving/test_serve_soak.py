"""The mixed serving soak (``python -m benchmarks soak``) for a few seconds on the tiny
dense model, and what it found: a body past the size limit is an OpenAI-shaped 413, and
a streamed request that ends in an error event is logged as ``finish=error``."""

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the soak's clients are the openai client")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")
pytest.importorskip("psutil", reason="the soak reads the servers' memory with psutil")

from _faults import MARK, failing_sampler  # noqa: E402
from _server import Server, messages, wait_healthy  # noqa: E402

from kvstate.models.gguf import Loaded  # noqa: E402
from kvstate.models.load import tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_soak_ends_every_request(tmp_path):
    """15 s of the mix (faults, disconnects, cancels, bad bodies, sessions) on one
    server: every request got its answer (no hang, none lost, no unexpected error),
    the faults fired and ended only their own requests, greedy replies replayed
    alone are equal, and the server is idle afterwards."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "benchmarks", "soak", "--minutes", "0.25", "--clients", "4"]
    cmd += ["--families", "llama", "--check", "4", "--sample", "2", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    totals, kinds = res["totals"], res["by_kind"]
    assert totals["sent"] > 20, res
    problems = {k: totals[k] for k in ("unexpected", "hang", "lost", "mismatch")}
    assert problems == dict.fromkeys(problems, 0), (res["examples"], run.stdout[-3000:])
    assert kinds["fault"]["expected"] > 0 and kinds["bad"]["expected"] > 0, kinds
    assert res["replays"]["checked"] > 0 and res["replays"]["mismatched"] == 0
    assert res["idle"]["llama"]["active_rows"] == res["idle"]["llama"]["queued"] == 0
    assert res["health"]["not_200"] == 0


def _load(url: str, stop: threading.Event) -> None:
    """One client: streamed chat requests, one after another, until ``stop``."""
    body = {"model": "x", "messages": messages("Tell me about the sea."), "max_tokens": 48}
    data = json.dumps({**body, "stream": True, "temperature": 0.7}).encode()
    while not stop.is_set():
        req = urllib.request.Request(
            url + "/v1/chat/completions", data, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
        except OSError:  # (refused or cut once the drain began)
            time.sleep(0.05)


@pytest.mark.slow(reason="starts two real server processes (about 15 s)")
def test_a_server_terminated_under_load_exits_0(tmp_path):
    """SIGTERM while 4 clients stream: the server drains and exits 0, for a dense and a
    recurrent model. (It could abort at exit, status -6, "terminate called without an
    active exception": the scheduler thread's MLX state was freed after its join
    returned, while the interpreter finalized; it is freed in the thread now.)"""
    for family in ("llama", "mamba2"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        log = tmp_path / f"{family}.log"
        cmd = [sys.executable, "-m", "benchmarks", "soak", "--serve", family, "--port", str(port)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        url, stop = f"http://127.0.0.1:{port}", threading.Event()
        clients = [threading.Thread(target=_load, args=(url, stop)) for _ in range(4)]
        try:
            wait_healthy(url, proc, detail=log.read_text)
            for c in clients:
                c.start()
            time.sleep(2.0)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(90)
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
            for c in clients:
                c.join(70)
        text = log.read_text()
        assert "status=200" in text, text[-2000:]  # (it was under load)
        assert code == 0 and "terminate called" not in text, (family, code, text[-2000:])


@pytest.fixture(scope="module")
def tiny(smollm):
    V = smollm.model.args.vocab_size
    return Loaded(tiny_llama(0, layers=1, vocab=V), smollm.tokenizer, "tiny")


def test_a_body_past_the_size_limit_is_an_openai_shaped_413(tiny):
    """aiohttp's own 413 is plain text; the server answers OpenAI's error shape."""
    s = Server(tiny, max_batch=2)
    try:
        body = json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1}).encode()
        req = urllib.request.Request(
            s.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 413
        error = json.load(e.value)["error"]
        assert error["code"] == "request_too_large" and "larger than" in error["message"]
    finally:
        s.close()


def test_a_stream_that_ends_in_an_error_is_logged_as_an_error(tiny, monkeypatch, caplog):
    """A streamed request's status is 200 before its fault: its log line says error."""
    failing_sampler(monkeypatch, "injected sampler fault")
    s = Server(tiny, max_batch=2)
    with caplog.at_level(logging.INFO, logger="kvstate.serve"):
        try:
            stream = s.client().chat.completions.create(
                model="x", messages=messages("hi"), max_tokens=4, temperature=MARK, stream=True
            )
            with pytest.raises(Exception, match="injected sampler fault"):
                list(stream)
        finally:
            s.close()  # (the handler logs once it returned)
    lines = [r.getMessage() for r in caplog.records if "route=/v1/chat" in r.getMessage()]
    assert len(lines) == 1 and "status=200" in lines[0] and "finish=error" in lines[0], lines


def test_a_finished_chunked_row_joins_the_prefix_cache_as_far_as_it_has_seen():
    """A chunked row's ``lengths`` count only its current chunk: the entry a finished
    request leaves must hold the tokens it has seen. (It held the chunk's count of
    tokens on the row's whole state, and every later prompt sharing that start failed
    in prefill; the soak found it on llama4.) Later prompts get what they get with
    no prefix cache."""
    import tiny_hybrid as th

    from kvstate.serving.prefix_cache import PrefixCache, seen
    from kvstate.serving.scheduler import Job, Scheduler

    model = th.llama4_model()  # chunks of 8

    def run(s, prompt):
        out: dict = {"tokens": [], "error": None}

        def emit(kind, i, value):
            if kind == "token":
                out["tokens"].append(value)
            elif kind == "error":
                out["error"] = value

        s.submit(Job(prompt=prompt, max_tokens=13, emit=emit))
        while s.step():
            pass
        return out["tokens"], out["error"]

    first = [(7 * j + 1) % 120 + 1 for j in range(32)]
    later = [first, first[:20] + [5, 6, 7], first[:9] + [9, 8]]
    cached = Scheduler(model, (), max_batch=4, prefix_cache=PrefixCache(8 << 20))
    got = [run(cached, p) for p in [first, *later]]
    want = [run(Scheduler(model, (), max_batch=4), p) for p in [first, *later]]
    assert got == want and all(e is None for _, e in got)
    for key, entry in cached.prefix_cache._entries.items():
        assert all(seen(s, 0) == len(key) for s in entry.states)
