"""Fault isolation in the scheduler: a fault at any stage ends only the job it belongs
to, the others finish with the tokens they get without it, and nothing stays pinned."""

from __future__ import annotations

import time

import pytest
from _faults import MARK, failing_sampler
from tiny_models import VOCAB, llama_model

from kvstate.serving import scheduler as sched_mod
from kvstate.serving.prefix_cache import PrefixCache
from kvstate.serving.scheduler import DEADLINE, SHUTDOWN, Job, Scheduler, Stopped
from kvstate.speculative.drafts import DraftModel, Lookup, truncated

POISON = VOCAB - 1  # a prompt holding it fails in the model's forward (Faulty)


class Faulty:
    """A model whose forward raises when a poisoned token is among its inputs."""

    def __init__(self, model, poison=POISON):
        self.model, self.poison = model, poison

    def __call__(self, inputs, cache=None, **kw):
        if self.poison in inputs.reshape(-1).tolist():
            raise ValueError("poisoned input")
        return self.model(inputs, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def prompts(n=4, length=6):
    return [[(7 * i + 3 * j + 1) % (VOCAB - 2) for j in range(length + i)] for i in range(n)]


def run(scheduler, jobs_prompts, *, max_tokens=6, per_job=None):
    """Submit one job per prompt, step until every job ended; per job ``(tokens, error)``."""
    out = {}
    jobs = []
    for i, p in enumerate(jobs_prompts):
        got: dict = {"tokens": [], "error": None, "done": None}

        def emit(kind, choice, value, got=got):
            if kind == "token":
                got["tokens"].append(value)
            elif kind == "done":
                got["done"] = value
            else:
                got["error"] = value

        kw = dict((per_job or {}).get(i, {}))
        jobs.append(Job(prompt=p, max_tokens=max_tokens, emit=emit, **kw))
        out[i] = got
    for job in jobs:
        scheduler.submit(job)
    for _ in range(200):
        scheduler.step()
        if all(j.finished for j in jobs) and not scheduler.active_rows:
            break
    assert all(j.finished for j in jobs), "a job never ended"
    return [(o["tokens"], o["error"]) for o in out.values()]


@pytest.fixture(scope="module")
def model():
    return llama_model()


@pytest.fixture(scope="module")
def clean(model):
    """The greedy tokens of every prompt with no fault anywhere."""
    return run(Scheduler(model, (), max_batch=8), prompts())


def test_a_prompt_that_fails_in_prefill_ends_alone(model, clean):
    cache = PrefixCache(1 << 24)
    bad = prompts()
    bad[1] = bad[1][:3] + [POISON] + bad[1][3:]
    got = run(Scheduler(Faulty(model), (), max_batch=8, prefix_cache=cache), bad)
    assert got[1][0] == [] and "poisoned input" in got[1][1]
    assert [g for i, g in enumerate(got) if i != 1] == [c for i, c in enumerate(clean) if i != 1]
    assert cache.pinned == 0  # the failed prefill's lease went back, the others' too


def test_a_failing_sampler_ends_only_its_job(model, clean, monkeypatch):
    failing_sampler(monkeypatch, "sampler failed")
    s = Scheduler(model, (), max_batch=8)
    got = run(s, prompts(), per_job={2: dict(temperature=MARK)})
    assert "sampler failed" in got[2][1]
    assert [g for i, g in enumerate(got) if i != 2] == [c for i, c in enumerate(clean) if i != 2]
    assert s.stats["failed"] == 1


def test_a_round_that_fails_for_one_row_ends_that_job_and_the_rest_go_on(model, clean, monkeypatch):
    real = sched_mod.speculative.step
    victim: list = []

    def step(target, spec, **kw):
        if any(job is victim[0] for job, _ in spec.batch.payload) and victim[0].generated[0] >= 2:
            raise ValueError("row fault")
        return real(target, spec, **kw)

    monkeypatch.setattr(sched_mod.speculative, "step", step)
    s = Scheduler(model, (), max_batch=8)
    real_submit = s.submit

    def submit(job):  # the third job is the victim
        if len(victim) == 0 and job.prompt == prompts()[2]:
            victim.append(job)
        real_submit(job)

    s.submit = submit
    got = run(s, prompts())
    assert got[2] == (clean[2][0][:2], "ValueError: row fault")
    assert [g for i, g in enumerate(got) if i != 2] == [c for i, c in enumerate(clean) if i != 2]


def test_a_killed_drafter_is_switched_off_and_the_tokens_stay_exact(model, clean):
    calls = {"n": 0}
    draft = truncated(model, 1)

    class Killed:
        def __init__(self, m):
            self.m = m

        def __call__(self, *a, **kw):
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("draft model killed")
            return self.m(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.m, name)

    s = Scheduler(model, (), max_batch=8, drafter=DraftModel(Killed(draft)), num_draft=3)
    got = run(s, prompts())
    assert got == clean  # greedy speculation is exact, and so are the plain rounds after
    assert s.stats["drafter_failed"] == 1 and s.drafter is None and calls["n"] > 3


def test_a_lookup_drafter_that_raises_is_switched_off(model, clean, monkeypatch):
    monkeypatch.setattr(
        sched_mod.speculative, "_propose_lookup", lambda *a, **k: 1 / 0, raising=True
    )
    s = Scheduler(model, (), max_batch=8, drafter=Lookup(min_ngram=1), num_draft=2)
    assert run(s, prompts()) == clean
    assert s.stats["drafter_failed"] == 1


def test_deadlines_and_listeners_that_raise(model, clean):
    s = Scheduler(model, (), max_batch=8)
    late = {1: dict(deadline=time.perf_counter() - 1)}
    got = run(s, prompts(), per_job=late)
    assert got[1][1].startswith(DEADLINE)
    assert [g for i, g in enumerate(got) if i != 1] == [c for i, c in enumerate(clean) if i != 1]

    def broken(kind, choice, value):
        raise ConnectionError("listener gone")

    job = Job(prompt=prompts()[0], max_tokens=4, emit=broken)
    s.submit(job)
    others = run(s, prompts()[1:])  # admitted with it; it is cancelled, they go on
    assert job.finished and others == clean[1:]


def test_a_fault_outside_any_job_fails_those_in_flight_and_the_thread_goes_on(model, clean):
    s = Scheduler(model, (), max_batch=8)
    real_admit = s._admit
    armed = {"on": True}

    def admit(block):
        real_admit(block)
        if armed["on"] and s.active_rows:
            armed["on"] = False
            raise RuntimeError("scheduler bug")

    s._admit = admit
    errors: list = []
    first = Job(prompt=prompts()[0], max_tokens=4, emit=lambda k, i, v: errors.append((k, v)))
    s.start()
    try:
        s.submit(first)
        for _ in range(200):
            if first.finished:
                break
            time.sleep(0.02)
        assert ("error", "RuntimeError: scheduler bug") in errors
        tokens: list = []
        again = Job(prompt=prompts()[0], max_tokens=6, emit=lambda k, i, v: tokens.append((k, v)))
        s.submit(again)
        for _ in range(500):
            if again.finished:
                break
            time.sleep(0.02)
        assert [v for k, v in tokens if k == "token"] == clean[0][0]
        assert s.alive
    finally:
        s.stop()
    assert not s.alive


def test_stop_tells_every_queued_job_and_refuses_new_ones(model):
    s = Scheduler(model, (), max_batch=1)
    heard: list = []
    jobs = [
        Job(prompt=p, max_tokens=50, emit=lambda k, i, v: heard.append((k, v))) for p in prompts(3)
    ]
    for j in jobs:
        s.submit(j)
    s.step()  # one runs, two wait
    s.stop()
    assert all(j.finished for j in jobs)
    assert [v for k, v in heard if k == "error"] == [SHUTDOWN] * 3
    with pytest.raises(Stopped):
        s.submit(Job(prompt=[1, 2], max_tokens=2))
