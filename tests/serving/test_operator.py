"""What an operator expects of `kvstate serve`: KV record flags, an API key, Prometheus
metrics, a log line per request, a clear error for a taken port, a drain on SIGTERM.

Most tests serve a tiny random llama with the real model's tokenizer and vocabulary
(fast on the CPU; its text is noise, but greedy tokens are compared exactly); the
SIGTERM test runs the real command on the real model."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the serve tests call the server with openai")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")
parser = pytest.importorskip("prometheus_client.parser", reason="/metrics is prometheus-client's")

from _server import Server, record_kinds, wait_healthy  # noqa: E402

from kvstate import cli  # noqa: E402
from kvstate.core.records import QuantizedState, RotatingState  # noqa: E402
from kvstate.kinds.shared import resident_records  # noqa: E402
from kvstate.models.gguf import Loaded  # noqa: E402
from kvstate.models.load import tiny_llama  # noqa: E402
from kvstate.serving import http  # noqa: E402
from kvstate.serving.engine import KVStateEngine, Request  # noqa: E402
from kvstate.serving.engine import serve as generate  # noqa: E402
from kvstate.serving.http import model_id  # noqa: E402
from kvstate.serving.prefix_cache import PrefixCache  # noqa: E402
from kvstate.speculative.drafts import Lookup  # noqa: E402

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Tell me about the sea, the sky and the mountains."}]


@pytest.fixture(scope="module")
def tiny(smollm):
    """A tiny llama (head dim 64: quantization groups fit) with SmolLM2's tokenizer."""
    V = smollm.model.args.vocab_size
    model = tiny_llama(0, layers=2, hidden=128, heads=2, kv_heads=1, head_dim=64, vocab=V)
    return Loaded(model, smollm.tokenizer, "tiny llama, SmolLM2 tokenizer")


def reference(loaded, messages, max_tokens, make):
    """Greedy tokens of the same prompt through `kvstate generate`'s engine."""
    prompt = tuple(loaded.tokenizer.chat(messages))
    done, _ = generate(KVStateEngine(loaded.model, make=make), [Request(0, prompt, max_tokens)], 1)
    return loaded.tokenizer.decode(list(done[0].tokens))


def ask(server, messages, max_tokens=12, **kw):
    r = server.client(**kw).chat.completions.create(
        model="x", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r


def metrics(server) -> dict:
    """``{sample name: {labels as a sorted tuple: value}}`` of GET /metrics."""
    with urllib.request.urlopen(server.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


# --- --kv-bits, --kv-group-size, --max-kv-size ------------------------------------------


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32)])
def test_kv_bits_serve_quantized_records_end_to_end(tiny, bits, group):
    make = {"kv_bits": bits, "kv_group_size": group}
    s = Server(tiny, prefix_cache=PrefixCache(16 << 20), make=make)
    try:
        got = ask(s, CHAT, 12).choices[0].message.content
        kinds = {type(x) for r in s.scheduler.prefix_cache.records() for x in resident_records(r)}
    finally:
        s.close()
    assert got == reference(tiny, CHAT, 12, make)
    assert kinds == {QuantizedState}  # the cached prompt's records, as the rows held them
    q = next(x for r in s.scheduler.prefix_cache.records() for x in resident_records(r))
    assert (q.bits, q.group_size) == (bits, group)


def test_max_kv_size_serves_ring_records_end_to_end(tiny):
    make = {"max_kv_size": 8, "ring_full_layers": True}
    s = Server(tiny, make=make)
    seen = record_kinds(s)
    try:
        got = ask(s, LONG, 10).choices[0].message.content
    finally:
        s.close()
    assert set(seen) == {RotatingState}
    assert got == reference(tiny, LONG, 10, make)
    assert got != reference(tiny, LONG, 10, {})  # 8 tokens of a longer prompt: not dense


def test_records_the_model_cannot_write_are_refused_at_start(smollm):
    model = tiny_llama(0, layers=1, hidden=64, heads=2, kv_heads=1)  # head dim 32
    loaded = Loaded(model, smollm.tokenizer, "tiny")
    with pytest.raises(http.KVStateError, match="group_size=64"):
        http.make_app(loaded, make={"kv_bits": 8, "kv_group_size": 64})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--kv-bits", "8", "--max-kv-size", "16"], "rings are not quantized"),
        (["serve", "--kv-group-size", "32"], "--kv-group-size needs --kv-bits"),
        (["generate", "--max-kv-size", "4"], "--max-kv-size must be >= 5"),
        (["generate", "--compare", "--kv-bits", "8"], "--compare runs mlx-lm"),
        (["serve", "--max-kv-size", "16", "--prefix-cache-mb", "64"], "--prefix-cache-mb 0"),
        (["serve", "--api-key", " "], "set but empty"),
        (["serve", "--port", "0"], "--port must be in"),
    ],
)
def test_flag_combinations_that_cannot_work_are_refused(monkeypatch, capsys, argv, message):
    """A user error: one line naming it on stderr, exit status 2, nothing served."""
    monkeypatch.setattr(http, "run", lambda *a, **k: pytest.fail("served"))
    assert cli.main([*argv, "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_serve_flags_reach_the_scheduler(monkeypatch):
    """--max-kv-size: rings, the prefix cache off (said, not dropped); --kv-bits: quantized,
    the cache on; --api-key and $KVSTATE_API_KEY reach the app."""
    got: dict = {}
    monkeypatch.setattr(http, "run", lambda loaded, **options: got.update(options))
    monkeypatch.setattr(http, "check_port", lambda host, port: None)
    assert cli.main(["serve", "--model", "tiny", "--max-kv-size", "16"]) == 0
    assert got["make"] == {"max_kv_size": 16, "ring_full_layers": True}
    assert got["prefix_cache"] is None and got["api_key"] is None
    monkeypatch.setenv("KVSTATE_API_KEY", "from-env")
    assert cli.main(["serve", "--model", "tiny", "--kv-bits", "4"]) == 0
    assert got["make"] == {"kv_bits": 4, "kv_group_size": 64}
    assert got["prefix_cache"].max_bytes == 256 << 20 and got["api_key"] == "from-env"
    assert cli.main(["serve", "--model", "tiny", "--api-key", "flag"]) == 0
    assert got["api_key"] == "flag"


def test_generate_takes_the_same_kv_flags(capsys):
    argv = ["generate", "--model", "tiny", "--requests", "2", "--gen-len", "4", "--json"]
    assert cli.main([*argv, "--quiet", "--max-kv-size", "8"]) == 0
    rings = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert cli.main([*argv, "--quiet", "--kv-bits", "8", "--kv-group-size", "32"]) == 0
    quant = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rings) == len(quant) == 2
    assert all(r["generated_tokens"] == 4 for r in rings + quant)


# --- --api-key ------------------------------------------------------------------------


def test_api_key_guards_v1_and_leaves_health_and_metrics_open(tiny):
    s = Server(tiny, api_key="sekret")
    try:
        for key in ("none", "sekret2", "Sekret"):
            with pytest.raises(openai.AuthenticationError) as e:
                ask(s, CHAT, 2, api_key=key)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="none").models.list()
        assert ask(s, CHAT, 2, api_key="sekret").choices[0].finish_reason == "length"
        assert [m.id for m in s.client(api_key="sekret").models.list().data] == [
            model_id(tiny.name)
        ]
        for path in ("/health", "/metrics"):
            with urllib.request.urlopen(s.url + path) as r:
                assert r.status == 200
        m = metrics(s)["kvstate_requests_total"]
        assert m[(("route", "/v1/chat/completions"), ("status", "401"))] == 3
        assert m[(("route", "/v1/models"), ("status", "401"))] == 1
    finally:
        s.close()
    with pytest.raises(http.KVStateError, match="api_key"):
        http.make_app(tiny, api_key="")


# --- /metrics and the log line -----------------------------------------------------------


def test_metrics_count_requests_tokens_latency_and_the_prefix_cache(tiny, caplog):
    s = Server(tiny, prefix_cache=PrefixCache(16 << 20))
    caplog.set_level(logging.INFO, logger="kvstate.serve")
    try:
        replies = [ask(s, CHAT, 6), ask(s, CHAT, 6), ask(s, LONG, 5)]
        with pytest.raises(openai.BadRequestError):
            s.client().chat.completions.create(model="x", messages=[], max_tokens=2)
        m = metrics(s)
        nbytes = s.scheduler.nbytes()
    finally:
        s.close()
    route = (("route", "/v1/chat/completions"),)
    requests = m["kvstate_requests_total"]
    assert requests[(*route, ("status", "200"))] == 3
    assert requests[(*route, ("status", "400"))] == 1
    prompt = sum(r.usage.prompt_tokens for r in replies)
    assert m["kvstate_prompt_tokens_total"][()] == prompt
    assert m["kvstate_completion_tokens_total"][()] == 6 + 6 + 5
    assert m["kvstate_time_to_first_token_seconds_count"][()] == 3
    assert m["kvstate_inter_token_latency_seconds_count"][()] == 5 + 5 + 4  # a sample a round
    assert m["kvstate_request_duration_seconds_count"][()] == 3
    assert m["kvstate_prefix_cache_lookups_total"][()] == 3
    assert m["kvstate_prefix_cache_hits_total"][()] >= 1  # the repeated chat
    assert 0 < m["kvstate_prefix_cache_cached_tokens_total"][()] < prompt
    assert m["kvstate_queue_depth"][()] == 0 and m["kvstate_active_rows"][()] == 0
    assert m["kvstate_kv_bytes"][()] == nbytes > 0  # the cached prompts
    assert m["kvstate_prefix_cache_entries"][()] >= 2
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstate.serve"]
    assert len(lines) == 4  # the /metrics scrape is logged at DEBUG only
    first = dict(kv.split("=", 1) for kv in lines[0].split())
    assert first["id"] == replies[0].id.removeprefix("chatcmpl-")
    assert first["route"] == "/v1/chat/completions" and first["status"] == "200"
    assert int(first["prompt_tokens"]) == replies[0].usage.prompt_tokens
    assert first["completion_tokens"] == "6" and first["finish"] == "length"
    assert first["cached_tokens"] == "0" and float(first["ttft_s"]) <= float(first["seconds"])
    second = dict(kv.split("=", 1) for kv in lines[1].split())
    assert int(second["cached_tokens"]) > 0
    bad = dict(kv.split("=", 1) for kv in lines[3].split())
    assert bad["status"] == "400" and bad["id"] == "-" and bad["finish"] == "-"


def test_metrics_report_draft_acceptance_and_apps_do_not_share_series(tiny):
    a, b = Server(tiny, drafter=Lookup(), num_draft=3), Server(tiny)
    try:
        ask(a, LONG, 16)
        ma, mb = metrics(a), metrics(b)
        stats = a.scheduler.stats
    finally:
        a.close()
        b.close()
    assert ma["kvstate_draft_tokens_total"][()] == stats["drafted"] > 0
    assert ma["kvstate_draft_accepted_tokens_total"][()] == stats["accepted"]
    assert ma["kvstate_rounds_total"][()] == stats["rounds"]
    assert ma["kvstate_completion_tokens_total"][()] == 16
    assert mb["kvstate_completion_tokens_total"][()] == 0  # b served nothing
    assert "kvstate_requests_total" not in mb or not mb["kvstate_requests_total"]


# --- the port, SIGTERM ------------------------------------------------------------------


def test_a_taken_port_is_one_line_and_a_nonzero_exit(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "kvstate", "serve", "--model", "tiny", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0
        assert proc.stderr.strip() == f"kvstate serve: port {port} on 127.0.0.1 is in use"
        with pytest.raises(SystemExit, match=f"port {port} on 127.0.0.1 is in use"):
            http.run(tiny, port=port)  # the same line where aiohttp binds (after a race)


@pytest.mark.slow(reason="starts the real command on the real model (about 10 s)")
def test_sigterm_drains_the_request_in_flight_then_exits_0(smollm):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstate", "serve", "--port", str(port), "--float32"],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, poll=0.3)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="x", messages=LONG, max_tokens=40, temperature=0, stream=True
        )
        chunks = iter(stream)
        text = next(chunks).choices[0].delta.content or ""  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        finish = None
        for c in chunks:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
        assert finish == "length" and text  # all 40 tokens came after the signal
        assert proc.wait(60) == 0
        log = proc.stderr.read()
        assert "status=200" in log and "completion_tokens=40" in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
