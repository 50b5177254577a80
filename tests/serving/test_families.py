"""`kvstate serve` on every model family: tiny random models of each (dense, ring,
chunked, recurrent, hybrid, composite) behind a real aiohttp server, called with
the real `openai` client. Greedy replies must equal what the scheduler gives the
same prompts with no prefix cache and one row per request (`kvstate generate`'s
engine), for ``n = 1`` and ``n = 2``, with the prefix cache on."""

import threading

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai", reason="the serve tests call the server with openai")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")

import tiny_hybrid as th  # noqa: E402
import tiny_models as tm  # noqa: E402
from test_serve import Server  # noqa: E402

from kvstate import mlx_lm as bridge  # noqa: E402
from kvstate.models.load import Loaded  # noqa: E402
from kvstate.serving import prefix_cache  # noqa: E402
from kvstate.serving.engine import KVStateEngine, Request  # noqa: E402
from kvstate.serving.engine import serve as generate  # noqa: E402
from kvstate.serving.prefix_cache import PrefixCache  # noqa: E402
from kvstate.serving.scheduler import Job, Scheduler  # noqa: E402
from kvstate.speculative.drafts import DraftModel  # noqa: E402

SYSTEM = "You are a terse assistant."
TOKENS = 6

# One builder per family, each at the tokenizer's vocabulary. gemma3's window is
# 64 here so that chat prompts fit inside it and the ring entries are reused.
FAMILIES = {
    "llama": lambda v: tm.llama_model(vocab=v),
    "gemma3": lambda v: tm.gemma3_model(sliding_window=64, vocab=v),
    "llama4": lambda v: th.llama4_model(vocab=v),
    "mamba2": lambda v: th.mamba2_model(vocab=v),
    "lfm2": lambda v: th.lfm2_model(vocab=v),
    "qwen3_next": lambda v: th.qwen3_next_model(vocab=v),
    "falcon_h1": lambda v: th.falcon_h1_model(vocab=v),
}


@pytest.fixture(scope="module")
def loaded(smollm):
    """Per family, a tiny model with the real model's tokenizer (built on first use)."""
    vocab = smollm.model.args.vocab_size
    made: dict = {}

    def get(name):
        if name not in made:
            made[name] = Loaded(FAMILIES[name](vocab), smollm.tokenizer, f"tiny-{name}")
        return made[name]

    return get


def messages(q):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


def reference(model, tok, prompts):
    """The greedy texts the scheduler gives each prompt alone: no prefix cache, one row."""
    reqs = [Request(i, tuple(p), TOKENS, stop=tok.eos_ids) for i, p in enumerate(prompts)]
    done, _ = generate(KVStateEngine(model), reqs, batch_size=1)
    return [tok.decode(list(c.tokens)) for c in sorted(done, key=lambda c: c.request.id)]


def ask(server, q, n=1):
    r = server.client().chat.completions.create(
        model="x", messages=messages(q), max_tokens=TOKENS, temperature=0, n=n
    )
    return [c.message.content for c in r.choices]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_serves_n1_and_n2_greedy_equal_to_the_scheduler_alone(loaded, family):
    m = loaded(family)
    tok = m.tokenizer
    first = messages("Name a color.")
    second = first + [
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    want = reference(m.model, tok, [tok.chat(first), tok.chat(second)])
    s = Server(m, max_batch=4, max_queue=8, prefix_cache=PrefixCache(64 << 20))
    try:
        client = s.client()
        got = client.chat.completions.create(
            model="x", messages=first, max_tokens=TOKENS, temperature=0
        )
        assert [c.message.content for c in got.choices] == want[:1]
        # the next turn starts with the first prompt: served from the prefix cache
        before = s.scheduler.stats["prefilled"]
        got = client.chat.completions.create(
            model="x", messages=second, max_tokens=TOKENS, temperature=0, n=2
        )
        assert [c.message.content for c in got.choices] == [want[1]] * 2
        ran = s.scheduler.stats["prefilled"] - before
        assert ran < len(tok.chat(second)), f"{family}: the cached first turn was run again"
    finally:
        s.close()


def test_two_families_served_in_one_process_at_once(loaded):
    """A ring model and a recurrent one, each with its own app and scheduler, asked
    concurrently: each answers as it does alone."""
    names = ("gemma3", "mamba2")
    questions = ["Name a color.", "What is 2 + 2?"]
    want = {
        name: reference(
            loaded(name).model,
            loaded(name).tokenizer,
            [loaded(name).tokenizer.chat(messages(q)) for q in questions],
        )
        for name in names
    }
    servers = {
        name: Server(loaded(name), max_batch=4, prefix_cache=PrefixCache(16 << 20))
        for name in names
    }
    got: dict = {}

    def one(name, i):
        got[name, i] = ask(servers[name], questions[i % 2], n=1 + i // 2)

    try:
        threads = [threading.Thread(target=one, args=(n, i)) for n in names for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for s in servers.values():
            s.close()
    for name in names:
        for i in range(4):
            assert got[name, i] == [want[name][i % 2]] * (1 + i // 2), (name, i)


def test_a_draft_model_with_n2_forks_its_draft_rows():
    """A drafter's states fork with the rows (shared dense rows, which ``kv.anchor``
    takes); the choices equal the scheduler's without a drafter, and a later job
    joins the rows in flight."""
    model, draft = tm.llama_model(), tm.llama_model(seed=5, layers=1)
    jobs = [(tm.prompt(1, 12), 1), (tm.prompt(2, 9), 2)]

    def run(**kw):
        s = Scheduler(model, [], max_batch=4, **kw)
        out = []
        for p, n in jobs:
            toks: list = [[] for _ in range(n)]
            out.append(toks)
            s.submit(Job(p, 8, n=n, emit=lambda k, c, v, t=toks: k == "token" and t[c].append(v)))
            s.step()
        while s.step():
            pass
        return out, s.stats

    want, _ = run()
    got, stats = run(drafter=DraftModel(draft), num_draft=3)
    assert got == want
    assert stats["drafted"] > 0
    assert got[1][0] == got[1][1]


@pytest.mark.parametrize(
    "name, make, follow, hits",
    [
        # a recurrent entry is a snapshot at its end: reused only by a prompt holding all of it
        ("mamba2", th.mamba2_model, lambda a: a + [5, 6], 12),
        ("mamba2", th.mamba2_model, lambda a: a[:8] + [5, 6], 0),
        ("falcon_h1", th.falcon_h1_model, lambda a: a[:8] + [5, 6], 0),
        ("qwen3_next", th.qwen3_next_model, lambda a: a + [5], 12),
        # dense and chunked entries (no front dropped) are read cut to any prefix
        ("llama4", th.llama4_model, lambda a: a[:8] + [5, 6], 8),
        # a ring is reused only while the whole prompt fits in its window (8)
        ("gemma3", tm.gemma3_model, lambda a: a[:6] + [5, 6], 6),
        ("gemma3", tm.gemma3_model, lambda a: a + [5, 6], 0),
    ],
)
def test_the_prefix_cache_reuses_what_each_kind_can_give_exactly(name, make, follow, hits):
    """``prefix_cache.prefill`` on a second prompt after a first one: it reuses
    ``hits`` tokens, and its logits and next greedy steps equal
    ``kvstate.mlx_lm.prefill``'s of the second prompt alone."""
    model = make()
    a = tm.prompt(1, 12)
    cache = PrefixCache(16 << 20)
    prefix_cache.prefill(model, [a], cache)
    b = follow(a)
    logits, states, leases, ran = prefix_cache.prefill(model, [b], cache)
    assert ran == [len(b) - hits]
    want, ref = bridge.prefill(model, [b])
    for _ in range(3):
        assert mx.allclose(logits, want, atol=1e-4).item(), float(mx.abs(logits - want).max())
        t = mx.argmax(want, -1)
        assert (mx.argmax(logits, -1) == t).all().item()
        logits, states = bridge.step(model, t, states)
        want, ref = bridge.step(model, t, ref)
    for lease in leases:
        if lease is not None:
            lease.release()
