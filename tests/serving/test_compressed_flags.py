"""`--kv-budget`/`--kv-policy` (compressed records) through `kvstate generate` and
`kvstate serve`: refused combinations, the options reaching the scheduler, and rows
served end to end on compressed records (a tiny llama with SmolLM2's tokenizer)."""

import json

import pytest

pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")
pytest.importorskip("openai", reason="the serve tests call the server with openai")

from _server import Server, record_kinds  # noqa: E402

from kvstate import cli  # noqa: E402
from kvstate.core.records import CompressedState  # noqa: E402
from kvstate.models.gguf import Loaded  # noqa: E402
from kvstate.models.load import tiny_llama  # noqa: E402
from kvstate.serving import http  # noqa: E402
from kvstate.serving.engine import KVStateEngine, Request  # noqa: E402
from kvstate.serving.engine import serve as generate  # noqa: E402

LONG = [{"role": "user", "content": "Tell me about the sea, the sky and the mountains."}]


@pytest.fixture(scope="module")
def tiny(smollm):
    V = smollm.model.args.vocab_size
    model = tiny_llama(0, layers=2, hidden=128, heads=2, kv_heads=1, head_dim=64, vocab=V)
    return Loaded(model, smollm.tokenizer, "tiny llama, SmolLM2 tokenizer")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--kv-policy", "h2o"], "--kv-policy needs --kv-budget"),
        (["generate", "--kv-budget", "10"], "--kv-budget must be >= 20"),
        (["serve", "--kv-budget", "64", "--max-kv-size", "64"], "--kv-budget and --max-kv-size"),
        (["generate", "--kv-budget", "64", "--kv-bits", "8"], "--kv-budget and --kv-bits"),
        (["serve", "--kv-budget", "64", "--prefix-cache-mb", "64"], "--prefix-cache-mb 0"),
    ],
)
def test_refused_combinations(monkeypatch, capsys, argv, message):
    """A user error: one line naming it on stderr, exit status 2, nothing served."""
    monkeypatch.setattr(http, "run", lambda *a, **k: pytest.fail("served"))
    assert cli.main([*argv, "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_serve_flags_reach_the_scheduler(monkeypatch):
    got: dict = {}
    monkeypatch.setattr(http, "run", lambda loaded, **options: got.update(options))
    monkeypatch.setattr(http, "check_port", lambda host, port: None)
    assert cli.main(["serve", "--model", "tiny", "--kv-budget", "64", "--kv-policy", "h2o"]) == 0
    assert got["make"] == {"kv_budget": 64, "policy": "h2o"}
    assert got["prefix_cache"] is None  # compressed rows are not shared: the cache is off
    assert cli.main(["serve", "--model", "tiny", "--kv-budget", "64"]) == 0
    assert got["make"] == {"kv_budget": 64, "policy": "sinks"}


def test_generate_runs_on_compressed_records(capsys):
    argv = ["generate", "--model", "tiny", "--requests", "2", "--gen-len", "4", "--json"]
    assert cli.main([*argv, "--quiet", "--kv-budget", "24", "--kv-policy", "h2o"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(r["generated_tokens"] == 4 for r in rows)


def reference(loaded, messages, max_tokens, make):
    prompt = tuple(loaded.tokenizer.chat(messages))
    done, _ = generate(KVStateEngine(loaded.model, make=make), [Request(0, prompt, max_tokens)], 1)
    return loaded.tokenizer.decode(list(done[0].tokens))


def test_serve_answers_on_compressed_records(tiny):
    make = {"kv_budget": 20, "policy": "h2o"}
    s = Server(tiny, make=make)
    seen = record_kinds(s)
    try:
        r = s.client().chat.completions.create(
            model="x", messages=LONG, max_tokens=10, temperature=0
        )
        got = r.choices[0].message.content
    finally:
        s.close()
    assert set(seen) == {CompressedState}
    assert got == reference(tiny, LONG, 10, make)
