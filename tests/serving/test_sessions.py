"""Agent sessions: a finished request's prompt and completion join the prefix cache, so
the next turn of its conversation prefills only its new part, with the same tokens."""

from __future__ import annotations

import pytest
from tiny_models import llama_model

from kvstate.serving.prefix_cache import PrefixCache
from kvstate.serving.scheduler import Job, Scheduler
from kvstate.speculative.drafts import Lookup

FIRST = [1, 2, 3, 4, 5] * 4  # (repeats: prompt lookup has something to draft)
EXTRA = [50, 51, 52]  # the next turn's new message


@pytest.fixture(scope="module")
def model():
    return llama_model()


def ask(scheduler: Scheduler, prompt: list, max_tokens: int = 8, **job) -> tuple:
    """``(tokens of each choice, job)``: the job run to its end, greedy unless asked."""
    n = job.get("n", 1)
    out: list = [[] for _ in range(n)]
    j = Job(
        prompt=prompt,
        max_tokens=max_tokens,
        emit=lambda kind, i, v: out[i].append(v) if kind == "token" else None,
        **job,
    )
    scheduler.submit(j)
    while scheduler.step():
        pass
    return out, j


def scheduler(model, cache=True, drafter=None, **kw) -> Scheduler:
    prefix = PrefixCache(1 << 24) if cache else None
    return Scheduler(model, (), prefix_cache=prefix, drafter=drafter, num_draft=3, **kw)


@pytest.mark.parametrize("drafter", [None, Lookup()], ids=["plain", "ngram"])
def test_the_next_turn_prefills_only_its_new_part_with_the_same_tokens(model, drafter):
    s = scheduler(model, drafter=drafter)
    (out1,), job1 = ask(s, FIRST)
    assert job1.cached == 0 and len(out1) == 8
    assert drafter is None or s.stats["accepted"] > 0  # drafts were fed
    # One entry: the prompt and the completion as far as the row's records hold them
    # (the last token was sampled, never fed, unless a draft fed it); the prompt's own
    # entry, a strict prefix of it, gave way.
    (entry,) = s.prefix_cache._entries
    whole = tuple(FIRST + out1)
    assert whole[: len(entry)] == entry and len(whole) - 1 <= len(entry) <= len(whole)
    before = s.stats["prefilled"]
    second = FIRST + out1 + EXTRA
    (out2,), job2 = ask(s, second)
    assert job2.cached == len(entry)
    assert s.stats["prefilled"] - before == len(second) - len(entry) <= len(EXTRA) + 1
    # the control: only prompts cached, the second turn prefills the whole reply again
    p = scheduler(model, drafter=drafter, cache_completions=False)
    ask(p, FIRST)
    before = p.stats["prefilled"]
    (plain2,), plain_job = ask(p, second)
    assert plain_job.cached == len(FIRST) and p.stats["prefilled"] - before == len(out1) + 3
    # exactness: the tokens of a scheduler with no prefix cache at all
    none = scheduler(model, cache=False, drafter=drafter)
    assert ask(none, FIRST)[0] == [out1]
    assert ask(none, second)[0] == [out2] == [plain2]
    assert s.prefix_cache.pinned == 0  # every lease released


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serial"])
def test_each_choice_joins_the_cache(model, pipelined):
    """Each choice's entry is what its row's records hold: the prompt and the completion
    less its last token (sampled, never fed) when rounds are read as they end; the
    whole completion when pipelined, where a finished row runs one round more (that
    round fed the last token; its own sampled token is dropped)."""
    s = scheduler(model, pipelined=pipelined)
    outs, _ = ask(s, FIRST, 6, n=2, temperature=1.0, seed=3)
    assert outs[0] != outs[1]
    held = len(outs[0]) - (0 if pipelined else 1)
    entries = set(s.prefix_cache._entries)
    assert entries == {tuple(FIRST + o[:held]) for o in outs}  # the prompt's entry gave way
    (_,), job = ask(s, FIRST + outs[1] + EXTRA, 2)
    assert job.cached == len(FIRST) + held


def test_a_full_cache_keeps_what_running_rows_read(model):
    """A budget of 0: every entry is dropped once no row reads it, and the next turn
    prefills whole (the cache yields to running rows, never the other way round)."""
    s = Scheduler(model, (), prefix_cache=PrefixCache(0))
    (out1,), _ = ask(s, FIRST)
    assert len(s.prefix_cache) == 0
    (_,), job = ask(s, FIRST + out1 + EXTRA)
    assert job.cached == 0


@pytest.mark.parametrize("end", ["cancel", "cancel-first", "eos"])
def test_a_recurrent_row_that_ran_past_its_completion_adds_no_entry(end):
    """A mamba2 row that ended mid-answer (cancelled, or at a stop token, which is not
    part of the completion) has run past its completion (pipelined: one round more); a
    recurrent state cannot be cut back, so its completion joins no entry (cutting it
    would raise), the job ends without an error and the scheduler serves the next one."""
    from tiny_hybrid import mamba2_model

    model = mamba2_model()
    (free,), _ = ask(scheduler(model), FIRST, 6)
    eos = (free[2],) if end == "eos" else ()
    s = Scheduler(model, eos, prefix_cache=PrefixCache(1 << 24))
    events: list = []

    def emit(kind, i, v):
        events.append(kind)
        if kind == "token" and events.count("token") == {"cancel": 2}.get(end, 1):
            job.cancel() if end != "eos" else None

    job = Job(prompt=FIRST, max_tokens=6, emit=emit, n=2 if end == "cancel-first" else 1)
    s.submit(job)
    while s.step():
        pass
    assert "error" not in events and job.error is None, events
    (out,), after = ask(s, FIRST, 3)
    assert len(out) == 3 and after.error is None
