"""The scheduler's budgets: chunked prefill interleaved with decode (``prefill_budget``)
and the KV byte budget (``kv_budget``: admission, parking, refusal)."""

import pytest

from kvstate.serving.prefix_cache import PrefixCache
from kvstate.serving.scheduler import Job, Scheduler
from tests.tiny_models import VOCAB, llama_model


@pytest.fixture(scope="module")
def model():
    return llama_model(seed=3, layers=2)


def _prompt(seed: int, n: int) -> list:
    return [(seed * 31 + 7 * i + i * i) % (VOCAB - 1) + 1 for i in range(n)]


def _run(model, asks, rounds_between=1, **options):
    """Submit ``asks`` (``(prompt, max_tokens, n)``) one every ``rounds_between`` steps;
    step until all are done. Returns each job's tokens per choice, and the scheduler."""
    sched = Scheduler(model, (), max_batch=8, max_queue=64, **options)
    out, jobs = [], []
    for prompt, max_tokens, n in asks:
        got: dict = {c: [] for c in range(n)}
        out.append(got)

        def emit(kind, i, value, got=got):
            if kind == "token":
                got[i].append(value)
            assert kind != "error", value

        jobs.append(Job(list(prompt), max_tokens, n=n, seed=0, emit=emit))
    waiting = list(jobs)
    while waiting or sched.active_rows or sched.queued:
        if waiting:
            sched.submit(waiting.pop(0))
        for _ in range(rounds_between):
            sched.step()
    return out, sched


ASKS = [
    (_prompt(1, 9), 12, 1),
    (_prompt(2, 150), 6, 2),
    (_prompt(3, 40), 10, 1),
    (_prompt(1, 70), 5, 3),
]


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("budget", [1, 16, 64])
def test_chunked_prefill_gives_the_tokens_of_whole_prompt_prefill(model, cached, budget):
    cache = (lambda: PrefixCache(1 << 24)) if cached else (lambda: None)
    whole, _ = _run(model, ASKS, prefill_budget=None, prefix_cache=cache(), prefill_step_size=32)
    chunked, sched = _run(
        model, ASKS, prefill_budget=budget, prefix_cache=cache(), prefill_step_size=32
    )
    assert chunked == whole
    assert all(len(v) == ask[1] for got, ask in zip(chunked, ASKS) for v in got.values())
    assert sched.stats["prompt_tokens"] == sum(len(p) * 1 for p, _, _ in ASKS)


def test_a_round_runs_at_most_the_budget_of_prompt_tokens(model, monkeypatch):
    """A long prompt arriving while rows decode is spread over rounds: no round runs
    more than the budget of prompt tokens, and the rows get a token every round."""
    from kvstate.serving import prefix_cache as pc

    ran: list = []
    real = pc.advance

    def counting(model_, part, n, **kw):
        ran[-1] += n
        return real(model_, part, n, **kw)

    monkeypatch.setattr(pc, "advance", counting)
    sched = Scheduler(model, (), max_batch=8, prefill_budget=24)
    seen: list = []
    sched.submit(Job(_prompt(5, 8), 400, emit=lambda k, i, v: seen.append(k)))
    sched.step()
    sched.submit(Job(_prompt(6, 200), 50))
    tokens_before = 0
    for _ in range(12):
        ran.append(0)
        tokens_before = seen.count("token")
        assert sched.step()
        assert seen.count("token") == tokens_before + 1  # the running row never stalls
        assert ran[-1] <= 24
    assert sum(ran) >= 200 - 24  # the long prompt went through in budget-sized pieces
    assert sched.active_rows == 2
