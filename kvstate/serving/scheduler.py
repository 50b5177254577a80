"""The scheduler: continuous batching, written once.

Every way kvstate generates many requests runs through ``Scheduler``: the
HTTP server (one thread calls ``step`` in a loop), ``kvstate generate`` and
``kvstate.engine.serve`` (which call ``step`` themselves, admitting requests
as they arrive). Each ``step`` admits the waiting jobs whose rows fit, runs
one round over every row, hands each row's new tokens to its job, and drops
the rows that finished or were cancelled::

    submit(job) ──▶ queue ──▶ step():  admit   prefill the new prompts together
                                                (prefix cache), sample their first
                                                tokens, fork a job's n choices, join
                                       round   one decode step, or a speculative
                                                round (drafter), for every row
                                       emit    tokens to their jobs; finished and
                                                cancelled rows leave

The rows are one ``kvstate.speculative.Speculation``: with no drafter a
round is a plain decode step (the same device work as ``kvstate.mlx_lm.step``);
with ``Lookup()`` or ``DraftModel(m)`` it drafts and verifies per row.
``compiled`` runs each round's forward through ``kvstate.speculative.compiled``.
A job talks back through ``emit(kind, choice, value)``: ``("token", i, id)``,
``("done", i, "stop" | "length")``, ``("error", -1, message)``. Design:
``notes/serving.md``.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any, Callable, Optional, cast

import attrs
import mlx.core as mx

from .. import mlx_lm as bridge
from ..batch import Batch, sample_batch
from ..core import ops
from ..core.records import CacheState, QuantizedState
from ..errors import KVStateError
from ..kinds.shared import SharedState, fork, resident_bytes
from ..sampling import Sampling, row_keys
from ..speculative import rounds as speculative
from ..speculative.drafts import DraftModel
from . import budget, prefix_cache

__all__ = ["DEFAULT_PREFILL_BUDGET", "Job", "QueueFull", "Scheduler"]

DEFAULT_PREFILL_BUDGET = budget.DEFAULT_PREFILL_BUDGET


class QueueFull(Exception):
    """The scheduler's queue is full (the server answers 429)."""


@attrs.define(eq=False)
class Job:
    """One request on its way through the scheduler.

    ``emit(kind, choice, value)`` is called from the thread running ``step``
    with ``("token", i, token_id)``, ``("done", i, finish_reason)`` or
    ``("error", -1, message)``. ``stop``: token ids that end a choice besides
    the scheduler's ``eos``.
    """

    prompt: list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    n: int = 1
    emit: Callable[[str, int, Any], None] = lambda kind, i, value: None
    stop: frozenset = frozenset()
    cancelled: set = attrs.Factory(set)  # choices the client no longer wants
    id: str = attrs.Factory(lambda: uuid.uuid4().hex[:24])
    submitted: float = attrs.Factory(time.perf_counter)

    generated: list = attrs.Factory(lambda self: [0] * self.n, takes_self=True)
    leases: list = attrs.Factory(list)  # prefix-cache entries the rows read

    def release(self) -> None:
        """Unpin the prefix-cache entries (the scheduler, when the last row left)."""
        leases, self.leases = self.leases, []
        for lease in leases:
            if lease is not None:  # (prefix_cache.prefill gives None for a row it did not cache)
                lease.release()

    def cancel(self, choice: Optional[int] = None) -> None:
        """Stop one choice (a stop string matched) or all of them (client gone)."""
        self.cancelled.update(range(self.n) if choice is None else (choice,))


class Scheduler:
    """Continuous batching over one model: admits jobs, runs rounds, drops finished rows.

    A job of ``n`` choices prefills once and forks its row ``n - 1`` times
    (``kv.fork``: the copies share the prompt's keys and values). Prompts go
    through the prefix cache when there is one, so a prompt whose start was
    seen before prefills only the rest. Each row's ``payload`` is
    ``(job, choice)``.

    Args:
        model: an mlx-lm model.
        eos: token ids that end a choice.
        max_batch: most rows decoding at once (a job of ``n`` choices is ``n`` rows).
        max_queue: most jobs waiting to be admitted; ``submit`` raises ``QueueFull`` past it.
        prefix_cache: a ``PrefixCache`` (``None``: prompts are prefilled whole).
        drafter: ``None``, ``Lookup()`` or ``DraftModel(model)``.
        num_draft: most drafted tokens per row per round.
        window: ``kvstate.speculative.Window()``: each round only as wide as its
            measured cost pays, its measurements kept across batches
            (``self.window``); ``None``: every row drafts up to ``num_draft``.
        compiled: run each round's forward compiled (``speculative.compiled``).
        measure: after each round, the KV bytes held (rows and prefix cache) into
            ``stats["peak_bytes"]`` and, over the tokens the rows hold, into
            ``bytes_per_token`` (one entry a round); off, a round measures nothing.
        prefill_step_size: prompt tokens per prefill forward (longer prompts are chunked).
        prefill_budget: most prompt tokens run per round (chunked prefill interleaved
            with decode: a longer prompt continues over the next rounds while the rows
            decode; ``None``: every admitted prompt is prefilled whole before the next
            round). Models with ring layers prefill whole prompts (a ring cannot be
            split).
        kv_budget: most KV bytes the rows and the prefix cache hold (``None``: no
            bound). A job is admitted when its rows' projected bytes (prompt plus
            ``max_tokens`` per row) fit beside the running ones'; before a round the
            prefix cache's unpinned entries, then the newest rows (parked in host
            memory, resumed exactly) make room. A job that could never fit is refused
            by ``submit``. Not with a draft model.
    """

    def __init__(
        self,
        model: Any,
        eos: Iterable[int],
        *,
        max_batch: int = 32,
        max_queue: int = 64,
        prefix_cache: Optional[prefix_cache.PrefixCache] = None,
        drafter: Any = None,
        num_draft: int = 4,
        window: Optional[speculative.Window] = None,
        compiled: bool = False,
        prefill_step_size: int = 512,
        prefill_budget: Optional[int] = DEFAULT_PREFILL_BUDGET,
        kv_budget: Optional[int] = None,
        measure: bool = False,
    ) -> None:
        self.model, self.eos = model, frozenset(eos)
        self.window = window if drafter is not None else None  # the rule and its costs
        self.max_batch, self.max_queue = max_batch, max_queue
        if prefix_cache is not None and not _shares_prefixes(model):
            prefix_cache = None  # rings, recurrent or chunked layers share no prefix (yet)
        self.prefix_cache, self.drafter, self.num_draft = prefix_cache, drafter, num_draft
        self.forward = speculative.compiled(model) if compiled else None
        self.prefill_step_size, self.measure = prefill_step_size, measure
        self.prefill_budget = budget.prefill_budget(model, prefill_budget)
        self._prefilling: list = []  # [(job, prefix_cache.Partial)], oldest first
        self.kv_budget = budget.kv_budget(kv_budget)
        if self.kv_budget is not None and isinstance(drafter, DraftModel):
            raise KVStateError("kv_budget: expected None with a draft model, got a byte budget")
        self.token_bytes = budget.bytes_per_token(model) if self.kv_budget is not None else 0
        self._parked: list = []  # budget.Parked rows, oldest first
        self.bytes_per_token: list = []
        self._queue: queue.Queue = queue.Queue()
        self._pending: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.spec: Any = None  # the rows in flight: a speculative.Speculation, or None
        self.stats = {
            "rounds": 0,
            "prefilled": 0,
            "prompt_tokens": 0,
            "drafted": 0,
            "accepted": 0,
            "peak_bytes": 0,
            "parked": 0,
        }

    # --- what callers see -----------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def active_rows(self) -> int:
        spec = self.spec
        return 0 if spec is None else spec.batch_size

    @property
    def queued(self) -> int:
        """Jobs admitted by no round yet: waiting, or with their prompts in progress."""
        return self._queue.qsize() + len(self._pending) + len(self._prefilling) + len(self._parked)

    def submit(self, job: Job) -> None:
        """Queue a job (thread-safe); ``QueueFull`` when ``max_queue`` jobs wait."""
        if job.n > self.max_batch:
            raise KVStateError(f"n: expected at most {self.max_batch} (the batch), got {job.n}")
        if self.kv_budget is not None and self._projected(job) > self.kv_budget:
            budget.refuse(self._projected(job), self.kv_budget, job.n, self.token_bytes)
        if self.queued >= self.max_queue:
            raise QueueFull
        self._queue.put(job)

    def step(self, block: bool = False) -> bool:
        """Admit what waits (waiting up to 50 ms for a job with ``block``), then run
        one round if any row is active. Returns whether a round ran."""
        self._admit(block=block)
        if not self.active_rows:
            return False
        self._round()
        return True

    def nbytes(self) -> int:
        """KV bytes resident now: the rows (the draft model's too) and the prefix cache,
        each shared record counted once."""
        records: list = []
        if self.spec is not None:
            records += list(self.spec.states) + list(self.spec.draft_states or ())
        if self.prefix_cache is not None:
            records += self.prefix_cache.records()
        return resident_bytes(records)

    # --- the thread (the HTTP server) ------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._run, name="kvstate-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.step(block=not self.active_rows)
        except Exception as exc:  # say why to every waiting client, then stop
            for job in self._jobs():
                job.emit("error", -1, f"{type(exc).__name__}: {exc}")
            raise

    def _jobs(self) -> list:
        rows: list = [] if self.spec is None else [p[0] for p in self.spec.batch.payload]
        rows += [job for job, _ in self._prefilling]
        rows += [p.spec.batch.payload[0][0] for p in self._parked]
        return list(dict.fromkeys(rows + list(self._pending)))

    # --- admission --------------------------------------------------------------------

    def _admit(self, block: bool) -> None:
        """Take waiting jobs, oldest first, while their rows fit; prefill them together.

        With a prefill budget, the prompts in progress continue first; then
        whole prompts are taken while they fit in what is left of the budget,
        and the next longer one starts with the rest of it.
        """
        self._resume()
        left = self._continue_prefills()
        room = self.max_batch - self.active_rows - sum(job.n for job, _ in self._prefilling)
        block = block and not self._prefilling
        jobs = []
        while room > 0:
            job = self._head(block)
            if job is None or job.n > room or not self._fits(job):
                break  # (a job that does not fit waits at the head for rows to leave)
            block = False
            if self.prefill_budget is not None and len(job.prompt) > left:
                if left > 0:
                    self._begin_prefill(self._pending.popleft(), int(left))
                break
            jobs.append(self._pending.popleft())
            room -= job.n
            left -= len(job.prompt)
        if jobs:
            self._start(jobs)
        self._make_room()

    def _head(self, block: bool) -> Optional[Job]:
        """The oldest waiting job that is still wanted (jobs cancelled while waiting are
        dropped), or ``None``."""
        while self._pending or self._take(block):
            block = False
            job = self._pending[0]
            if len(job.cancelled) < job.n:
                return job
            self._pending.popleft()
        return None

    def _take(self, block: bool) -> bool:
        """Move one job from the queue to the pending line; whether there was one."""
        try:
            self._pending.append(
                self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            )
        except queue.Empty:
            return False
        return True

    def _start(self, jobs: list) -> None:
        """Prefill the jobs' prompts in one call (reusing cached prefixes; one batched
        step gives every first token), then start their rows (``_join``)."""
        prompts = [job.prompt for job in jobs]
        logits, states, leases, prefilled = self._prefill(prompts)
        for job, lease in zip(jobs, leases):
            job.leases = [lease] if lease is not None else []
        self.stats["prefilled"] += sum(prefilled)
        self.stats["prompt_tokens"] += sum(map(len, prompts))
        self._join(jobs, logits, states)

    def _join(self, jobs: list, logits, states) -> None:
        """Sample the jobs' first tokens, fork each job's choices, join the rows."""
        prompts = [job.prompt for job in jobs]
        batch = _first_tokens(jobs, states, logits)
        draft_states = None
        if isinstance(self.drafter, DraftModel):
            _, draft_states = bridge.prefill(
                self.drafter.model, prompts, prefill_step_size=self.prefill_step_size
            )
        batch, draft_states, origin = _forked(jobs, batch, draft_states)
        first = cast(list, batch.tokens.tolist())  # [B]
        context = [list(jobs[b].prompt) + [t] for (b, _), t in zip(origin, first)]
        k = (self.num_draft if self.drafter is not None else 0,) * len(origin)
        new = speculative.Speculation(batch, context, k, k, draft_states, self.window)
        self.spec = new if self.spec is None else speculative.join(*_one_kind(self.spec, new))
        B = self.spec.batch_size
        self._emit([(t,) for t in first], range(B - len(origin), B))

    # --- chunked prefill (a prefill budget) -------------------------------------------

    def _begin_prefill(self, job: Job, tokens: int) -> None:
        """Start ``job``'s prompt (its cached prefix leased) and run ``tokens`` of it."""
        part = prefix_cache.begin(self.model, job.prompt, self.prefix_cache)
        self._prefilling.append((job, part))
        self._advance_prefills(tokens)

    def _continue_prefills(self) -> float:
        """Run the budget's tokens of the prompts in progress, oldest first; returns
        what is left of the budget (``inf`` without one)."""
        if self.prefill_budget is None:
            return float("inf")
        return self._advance_prefills(self.prefill_budget)

    def _advance_prefills(self, left: int) -> int:
        """Spend up to ``left`` prompt tokens on the prompts in progress; start the rows
        of those that complete. Returns the tokens left."""
        going: list = []
        done: list = []
        for job, part in self._prefilling:
            if len(job.cancelled) == job.n:  # the client went away mid-prompt
                if part.lease is not None:
                    part.lease.release()
                continue
            n = min(left, part.rest)
            part = prefix_cache.advance(self.model, part, n, step_size=self.prefill_step_size)
            left -= n
            (done if not part.rest else going).append((job, part))
        self._prefilling = going
        if done:
            self._start_prefilled(done)
        return left

    def _start_prefilled(self, done: list) -> None:
        """The rows of prompts whose last chunk ran: cached, then started (``_join``)."""
        jobs, rows = [], []
        for job, part in done:
            states, lease = prefix_cache.settle(part, self.prefix_cache)
            job.leases = [lease] if lease is not None else []
            jobs.append(job)
            rows.append(states)
            self.stats["prefilled"] += part.ran
            self.stats["prompt_tokens"] += len(part.prompt)
        logits = mx.concatenate([part.logits for _, part in done], axis=0)
        self._join(jobs, logits, bridge.merge_rows(rows))

    def _prefill(self, prompts: list) -> tuple:
        """``(logits, states, leases, prefilled)``: through the prefix cache when
        there is one, else each prompt's own records (every family)."""
        if self.prefix_cache is not None:
            return prefix_cache.prefill(
                self.model, prompts, self.prefix_cache, prefill_step_size=self.prefill_step_size
            )
        logits, states = bridge.prefill(
            self.model, prompts, prefill_step_size=self.prefill_step_size
        )
        return logits, states, [None] * len(prompts), [len(p) for p in prompts]

    # --- the KV byte budget ------------------------------------------------------------

    def _projected(self, job: Job) -> int:
        """The most KV bytes ``job``'s rows can hold: prompt and ``max_tokens`` per row,
        in whole growth steps."""
        return job.n * budget.projected(len(job.prompt) + job.max_tokens, self.token_bytes)

    def _fits(self, job: Job) -> bool:
        """Whether ``job``'s projected bytes fit beside the running, starting and parked
        rows' (parked rows resume first); the prefix cache yields what it must."""
        if self.kv_budget is None:
            return True
        if self._parked:
            return False
        running = {p[0] for p in self.spec.batch.payload} if self.spec is not None else set()
        running.update(job for job, _ in self._prefilling)
        need = sum(map(self._projected, running | {job}))
        if self.prefix_cache is not None:
            self.prefix_cache.shrink(max(self.kv_budget - need, 0))
            need += self.prefix_cache.nbytes
        return need <= self.kv_budget

    def _need(self, spec) -> int:
        """KV bytes held once ``spec``'s next round appended: its records and the
        prefix cache's (each record once), plus the columns the round grows."""
        records = list(spec.states) if spec is not None else []
        if self.prefix_cache is not None:
            records += self.prefix_cache.records()
        grow = 0 if spec is None else budget.grown_bytes(spec.states, 1 + max(spec.num_draft))
        return resident_bytes(records) + grow

    def _make_room(self) -> None:
        """Before a round: unpinned prefix-cache entries, then the newest rows (parked),
        until what the round will hold fits the KV budget."""
        if self.kv_budget is None or self.spec is None:
            return
        while self._need(self.spec) > self.kv_budget:
            over = self._need(self.spec) - self.kv_budget
            cache = self.prefix_cache
            if cache is not None and cache.shrink(max(cache.nbytes - over, 0)):
                continue
            if self.spec.batch_size == 1:
                return  # the last row runs (admitted within the budget alone)
            self._park(budget.newest(self.spec.batch.payload))

    def _park(self, b: int) -> None:
        """Row ``b`` out of the batch, its records in host memory (``budget.Parked``)."""
        one = speculative.leave(self.spec, [b])
        states = [ops.extract_row(s, 0) for s in one.batch.states]  # (compact copies)
        one = attrs.evolve(one, batch=attrs.evolve(one.batch, states=states))
        job, choice = one.batch.payload[0]
        placeholder = bridge.make_states(self.model, 1)
        self._parked.append(budget.park(one, placeholder, (job.submitted, choice)))
        self._parked.sort(key=lambda p: p.order)
        stay = [r for r in range(self.spec.batch_size) if r != b]
        self.spec = speculative.leave(self.spec, stay)
        self.stats["parked"] += 1

    def _resume(self) -> None:
        """Parked rows back, oldest first, while the batch with them fits the budget
        (their records as they were: the tokens are those of a run never parked)."""
        while self._parked:
            parked = self._parked[0]
            job, choice = parked.spec.batch.payload[0]
            if choice in job.cancelled:
                self._parked.pop(0)
                continue
            row = budget.unpark(parked)
            spec = row if self.spec is None else speculative.join(*_one_kind(self.spec, row))
            if self.spec is not None and self._need(spec) > cast(int, self.kv_budget):
                return
            self.spec = spec
            self._parked.pop(0)

    # --- rounds -----------------------------------------------------------------------

    def _round(self) -> None:
        self.spec, r = speculative.step(
            self.model, self.spec, drafter=self.drafter, forward=self.forward
        )
        self.window = self.spec.window  # what it measured outlives the rows
        self.stats["rounds"] += 1
        self.stats["drafted"] += sum(r.drafted)
        self.stats["accepted"] += sum(r.accepted)
        self._emit(r.emitted, range(self.spec.batch_size))

    def _emit(self, emitted, rows) -> None:
        """Hand each row's new tokens to its job; finished or cancelled rows leave."""
        payload = self.spec.batch.payload
        for toks, b in zip(emitted, rows):
            job, choice = payload[b]
            self._hand(job, choice, toks)
        if self.measure:
            self._measure()
        stay = [b for b, (job, choice) in enumerate(payload) if choice not in job.cancelled]
        if len(stay) == len(payload):
            return
        for job in {job for job, _ in payload}:
            if len(job.cancelled) == job.n:
                job.release()
        if not stay:  # the batch empties: the rule keeps its last round's cost
            self.window = speculative.recorded(self.spec)
        self.spec = speculative.leave(self.spec, stay) if stay else None

    def _measure(self) -> None:
        """The bytes held now (before finished rows leave): the peak, and per token held."""
        resident = self.nbytes()
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], resident)
        tokens = sum(len(c) - 1 for c in self.spec.context)  # (less each row's pending token)
        self.bytes_per_token.append(resident / max(tokens, 1))

    def _hand(self, job: Job, choice: int, tokens) -> None:
        """``tokens`` to ``job``'s ``choice``, up to its end (a stop token or ``max_tokens``)."""
        for t in tokens:
            if choice in job.cancelled:
                return
            job.generated[choice] += 1
            job.emit("token", choice, t)
            stop = t in self.eos or t in job.stop
            if stop or job.generated[choice] >= job.max_tokens:
                job.emit("done", choice, "stop" if stop else "length")
                job.cancel(choice)


def _shares_prefixes(model) -> bool:
    """Whether the prefix cache can hold the model's records (dense and quantized
    layers: ``kvstate.kinds.shared``)."""
    return all(type(s) in (CacheState, QuantizedState) for s in bridge.make_states(model, 1))


def _first_tokens(jobs: list, states, logits) -> Batch:
    """The admitted jobs' rows as a ``Batch``, their first tokens sampled."""
    seeds = [job.seed if job.seed is not None else _random_seed() for job in jobs]
    batch = Batch(
        states,
        mx.zeros((len(jobs),), mx.uint32),
        keys=row_keys(seeds),
        sampling=[Sampling(temperature=job.temperature, top_p=job.top_p) for job in jobs],
        ids=[job.id for job in jobs],
        payload=[(job, 0) for job in jobs],
    )
    tokens, keys = sample_batch(logits, batch)
    return attrs.evolve(batch, tokens=tokens, keys=keys)


def _forked(jobs: list, batch: Batch, draft_states) -> tuple:
    """Each job's ``n - 1`` further choices forked from its row (sharing its prompt's
    keys and values): ``(batch, draft_states, origin)``, ``origin[row] = (job, choice)``."""
    origin = [(b, 0) for b in range(len(jobs))]
    for b, job in enumerate(jobs):
        if job.n > 1:
            batch = fork(batch, b, job.n - 1)
            if draft_states is not None:
                draft_states = fork(draft_states, b, job.n - 1)
            origin += [(b, c) for c in range(1, job.n)]
    return attrs.evolve(batch, payload=[(jobs[b], c) for b, c in origin]), draft_states, origin


def _one_kind(*specs) -> tuple:
    """``specs`` with their rows of one kind: where a fork made some shared
    (``SharedState``) and others are dense, the dense ones read as shared rows too."""
    if len({type(s.states[0]) for s in specs}) == 1:
        return specs
    return tuple(
        attrs.evolve(s, batch=attrs.evolve(s.batch, states=_as_shared(s.states))) for s in specs
    )


def _as_shared(states) -> list:
    return [s if isinstance(s, SharedState) else fork(s, 0, 0) for s in states]


def _random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")
