"""The scheduler's budgets: chunked prefill interleaved with decode (``prefill_budget``)
and the KV byte budget (``kv_budget``: admission, parking, refusal)."""

import os

import pytest
from test_faults import POISON, Faulty

from kvstate.serving.prefix_cache import PrefixCache
from kvstate.serving.scheduler import DEADLINE, Job, Scheduler
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
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

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


#: A long answer, then two short ones joining when it has 200 tokens: their suffixes are
#: left-padded to its width, more than their projections (one suffix step each).
PADDED = ((1, 20, 250, 200), (2, 20, 10, 1), (3, 30, 10, 1))


def _padded(sched, outs: list) -> list:
    """Submit ``PADDED`` to ``sched`` (each followed by its steps); the jobs."""
    jobs = []
    for seed, n, m, steps in PADDED:
        got: dict = {}
        jobs.append(Job(_prompt(seed, n), m, seed=0, emit=_sink(got)))
        outs.append(got)
        sched.submit(jobs[-1])
        for _ in range(steps):
            sched.step()
    return jobs


def _projections(model) -> int:
    per = budget.bytes_per_token(model)
    return sum(budget.projected(n, m, per) for _, n, m, _ in PADDED)


def test_parked_rows_resume_with_the_tokens_of_an_unconstrained_run(model):
    """A budget that the rows' projections fit but their padded batch outgrows parks
    the newest rows, which resume exactly (their own prefill records parked with them)."""
    limit = _projections(model)
    sched = Scheduler(model, (), max_batch=8, kv_budget=limit, prefill_budget=None, measure=True)
    outs: list = []
    jobs = _padded(sched, outs)
    _drain(sched, jobs)
    assert sched.stats["parked"] >= 1  # the budget bit: the control for what follows
    assert sched.stats["peak_bytes"] <= sched.kv_budget
    for job, got in zip(jobs, outs):
        assert "error" not in got and got[0] == _greedy_alone(model, job.prompt, job.max_tokens)


class BudgetMachine(RuleBasedStateMachine):
    """submit / step / cancel against a small KV budget, with or without a prefix cache
    and chunked prefill: the bytes held never pass it (the chunk a join or a round's
    growth allocates included), and every request's greedy tokens are those of an
    unconstrained run (a prefix of them when cancelled)."""

    model = llama_model(seed=3, layers=2)
    per = budget.bytes_per_token(model)

    def __init__(self):
        super().__init__()
        self.sched: Scheduler | None = None
        self.jobs: list = []

    @initialize(cached=st.booleans(), chunk=st.sampled_from([None, 48]))
    def start(self, cached, chunk):
        note(f"start {cached=} {chunk=}")
        self.sched = Scheduler(
            self.model,
            (),
            max_batch=4,
            kv_budget=3 * budget.STEP * self.per,
            prefill_budget=chunk,
            prefix_cache=PrefixCache(1 << 22) if cached else None,
            measure=True,
        )

    @rule(
        seed=st.integers(0, 5),
        length=st.integers(2, 180),
        max_tokens=st.integers(1, 90),
        n=st.sampled_from([1, 1, 2]),
    )
    def submit(self, seed, length, max_tokens, n):
        job, got = _collecting(_prompt(seed, length), max_tokens, n)
        note(f"submit {seed=} {length=} {max_tokens=} {n=}")
        if n * budget.projected(length, max_tokens, self.per) > self.sched.kv_budget:
            with pytest.raises(KVStateError, match="kv_budget"):
                self.sched.submit(job)  # it could never fit: refused, nothing queued
            return
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
        if self.sched is not None:
            assert self.sched.stats["peak_bytes"] <= self.sched.kv_budget
            assert self.sched.nbytes() <= self.sched.kv_budget

    def teardown(self):
        if self.sched is None:
            return
        while self.sched.active_rows or self.sched.queued:
            self.sched.step()
        assert self.sched.stats["peak_bytes"] <= self.sched.kv_budget
        for job, got, prompt, max_tokens in self.jobs:
            want = _greedy_alone(self.model, prompt, max_tokens)
            for tokens in got.values():
                if job.cancelled and len(tokens) < max_tokens:
                    assert tokens == want[: len(tokens)]
                else:
                    assert tokens == want


TestBudgetMachine = BudgetMachine.TestCase
TestBudgetMachine.settings = settings(
    max_examples=int(os.environ.get("BUDGET_MACHINE_EXAMPLES", 8)),
    stateful_step_count=12,
    deadline=None,
)


# --- faults, deadlines and cancellation while part-prefilled or parked ----------------


def _sink(got: dict):
    def emit(kind, i, value):
        if kind == "token":
            got.setdefault(i, []).append(value)
        elif kind == "error":
            got["error"] = value

    return emit


def _drain(sched, jobs, limit=2000):
    for _ in range(limit):
        if all(job.finished for job in jobs) and not (sched.active_rows or sched.queued):
            return
        sched.step()
    raise AssertionError("a job never ended")


def test_a_fault_in_a_part_prefilled_prompt_ends_only_its_job(model):
    """A prompt prefilled over rounds fails in its third chunk: its job ends with the
    error and gives its lease back; the row decoding meanwhile and a prompt admitted
    after it give the tokens of a run with no fault."""
    poisoned = _prompt(7, 150)
    poisoned[100] = POISON
    asks = [(_prompt(4, 20), 30), (poisoned, 10), (_prompt(6, 60), 20)]
    cache = PrefixCache(1 << 24)
    sched = Scheduler(Faulty(model), (), max_batch=8, prefill_budget=40, prefix_cache=cache)
    outs, jobs = [], []
    for prompt, m in asks:
        got: dict = {}
        jobs.append(Job(list(prompt), m, seed=0, emit=_sink(got)))
        outs.append(got)
        sched.submit(jobs[-1])
        sched.step()
    assert sched._prefilling == [] or jobs[1] in [j for j, _ in sched._prefilling]
    _drain(sched, jobs)
    assert "poisoned input" in outs[1]["error"] and 0 not in outs[1]
    for (prompt, m), got in zip([asks[0], asks[2]], [outs[0], outs[2]]):
        assert "error" not in got and got[0] == _greedy_alone(model, prompt, m)
    assert cache.pinned == 0
    assert sched.stats["failed"] == 1


def _parking(model, **options):
    """A scheduler with a row parked (``PADDED`` against their projections' sum):
    ``(scheduler, jobs, outs)``."""
    limit = _projections(model)
    sched = Scheduler(model, (), max_batch=8, kv_budget=limit, prefill_budget=None, **options)
    outs: list = []
    jobs = _padded(sched, outs)
    for _ in range(300):
        if sched._parked:
            return sched, jobs, outs
        sched.step()
    raise AssertionError("no row was parked: the budget did not bite")


def test_a_parked_job_past_its_deadline_is_told_and_its_snapshot_freed(model):
    sched, jobs, outs = _parking(model)
    parked = sched._parked[0].spec.batch.payload[0][0]
    parked.deadline = 0.0  # (perf_counter instants are positive: it is past)
    sched.step()
    assert outs[jobs.index(parked)]["error"].startswith(DEADLINE)
    assert all(p.spec.batch.payload[0][0] is not parked for p in sched._parked)
    _drain(sched, jobs)
    for job, got in zip(jobs, outs):
        if job is not parked:
            assert got[0] == _greedy_alone(model, job.prompt, job.max_tokens)


def test_a_cancelled_parked_job_leaves_and_its_snapshot_is_freed(model):
    sched, jobs, outs = _parking(model)
    parked = sched._parked[0].spec.batch.payload[0][0]
    parked.cancel()  # the client went away
    sched.step()
    assert all(p.spec.batch.payload[0][0] is not parked for p in sched._parked)
    assert "error" not in outs[jobs.index(parked)]
    _drain(sched, jobs)
    for job, got in zip(jobs, outs):
        if job is not parked:
            assert got[0] == _greedy_alone(model, job.prompt, job.max_tokens)


# --- many clients against a budget too small for all of them ----------------------------


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prefix-cache"])
def test_many_clients_against_a_small_budget_get_the_unconstrained_answers(model, cached):
    """24 requests (long and short prompts, long answers, some with n = 2) at once
    against a budget less than half of what they hold unbounded: none fails, the bytes
    held never pass the budget (admission waits; rows are parked and resumed where
    the batch outgrows it), and every answer equals that of a run with no budget."""
    per = budget.bytes_per_token(model)
    asks = [
        (_prompt(s, 20 + (37 * s) % 220), 40 + (53 * s) % 160, 2 if s % 5 == 0 else 1)
        for s in range(24)
    ]

    def serve(**options):
        cache = PrefixCache(1 << 24) if cached else None
        sched = Scheduler(model, (), max_batch=16, prefix_cache=cache, measure=True, **options)
        outs, jobs = [], []
        for prompt, m, n in asks:
            got: dict = {}
            jobs.append(Job(list(prompt), m, n=n, seed=0, emit=_sink(got)))
            outs.append(got)
            sched.submit(jobs[-1])
        _drain(sched, jobs, limit=5000)
        return outs, sched

    free, unbound = serve(prefill_budget=64)
    limit = 6 * budget.STEP * per
    assert unbound.stats["peak_bytes"] > 2 * limit  # too small for all of them at once
    tight, sched = serve(prefill_budget=64, kv_budget=limit)
    assert all("error" not in got for got in tight)
    assert tight == free
    assert sched.stats["peak_bytes"] <= limit
    assert sched.stats["failed"] == 0


# --- every family -------------------------------------------------------------------------


def _families():
    import tiny_hybrid as th
    import tiny_models as tm

    return {
        "llama": lambda: tm.llama_model(),
        "gemma3": lambda: tm.gemma3_model(sliding_window=64),
        "llama4": lambda: th.llama4_model(),
        "mamba2": lambda: th.mamba2_model(),
        "lfm2": lambda: th.lfm2_model(),
        "qwen3_next": lambda: th.qwen3_next_model(),
        "falcon_h1": lambda: th.falcon_h1_model(),
    }


@pytest.mark.parametrize("family", sorted(_families()))
def test_every_family_gives_the_same_tokens_chunked_and_within_a_kv_budget(family):
    """Prompts of 30-140 tokens (n = 2 for one), prefilled in 16-token pieces and
    within a KV budget of about two rows, with the prefix cache: the greedy tokens of
    whole-prompt prefill with no budget, and the bytes held within the budget."""
    m = _families()[family]()
    asks = [(_prompt(s, 30 + 55 * s), 12, 2 if s == 1 else 1) for s in range(3)]
    whole, _ = _run(m, asks, prefill_budget=None)
    limit = 2 * budget.projected(140, 12, budget.bytes_per_token(m))
    cache = PrefixCache(1 << 24)
    got, sched = _run(m, asks, prefill_budget=16, kv_budget=limit, prefix_cache=cache, measure=True)
    assert got == whole
    assert sched.stats["peak_bytes"] <= limit
    assert cache.pinned == 0
