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
``("done", i, "stop" | "length")``, ``("error", -1, message)``.

A fault ends only the requests it belongs to. Records are values, so a
round that raises leaves the rows as they were: the scheduler runs each row
alone to find the ones that fail, ends those jobs with an error, and runs
the round again for the others (a drafter that fails is switched off and
the rows go on plain). A prefill that fails is retried job by job; a prompt
prefilled over several rounds (``prefill_budget``) that fails ends its own
job. A job past its ``deadline`` ends with an error, whether it waits, is
being prefilled, runs or is parked (``kv_budget``). Design: ``notes/serving.md``.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any, Callable, Optional, cast

import attrs
import mlx.core as mx
import mlx.nn as nn

from .. import mlx_lm as bridge
from ..batch import Batch, sample_batch
from ..core import ops
from ..core.records import CacheState, QuantizedState
from ..errors import KVStateError
from ..kinds.shared import fork, resident_bytes, resident_records
from ..sampling import Sampling, row_keys
from ..speculative import rounds as speculative
from ..speculative.drafts import DraftModel
from . import budget, prefix_cache
from . import grammar as grammars
from .logits import Processed, needed, token_logprobs

__all__ = ["DEFAULT_PREFILL_BUDGET", "Job", "QueueFull", "Scheduler", "Stopped", "shares_prefixes"]

DEFAULT_PREFILL_BUDGET = budget.DEFAULT_PREFILL_BUDGET

log = logging.getLogger("kvstate.serve")

DEADLINE = "deadline exceeded"  # how the error of a job past its deadline begins
SHUTDOWN = "the server is shutting down"  # the error of the jobs a stop() ends


class QueueFull(Exception):
    """The scheduler's queue is full (the server answers 429)."""


class Stopped(Exception):
    """The scheduler is not running (the server answers 503)."""


@attrs.define(eq=False)
class Job:
    """One request on its way through the scheduler.

    ``emit(kind, choice, value)`` is called from the thread running ``step``
    with ``("token", i, token_id)``, ``("done", i, finish_reason)`` or
    ``("error", -1, message)`` (at most one error, after which the job hears
    nothing more). ``stop``: token ids that end a choice besides the
    scheduler's ``eos``. ``sampling``: further ``kv.Sampling`` fields (``top_k``,
    ``min_p``, the penalties, ``logit_bias``). ``logprobs``: how many top
    log-probabilities each token reports (``None``: none); each token's come as
    ``("logprob", i, (logprob, ((id, logprob), ...)))`` just before its token.
    ``deadline``: a ``time.perf_counter()`` instant past which the job ends with an
    error (``None``: none).
    ``grammar``: a compiled grammar (``kvstate.serving.grammar.Grammars.compile``)
    every choice's reply keeps to; each choice's matcher (``matchers[i]``, made on
    admission) is row state, advanced with each token the choice emits.
    """

    prompt: list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    n: int = 1
    emit: Callable[[str, int, Any], None] = lambda kind, i, value: None
    stop: frozenset = frozenset()
    sampling: dict = attrs.Factory(dict)
    logprobs: Optional[int] = None
    cancelled: set = attrs.Factory(set)  # choices the client no longer wants
    id: str = attrs.Factory(lambda: uuid.uuid4().hex[:24])
    submitted: float = attrs.Factory(time.perf_counter)
    deadline: Optional[float] = None
    error: Optional[str] = None  # why it failed, once it has
    grammar: Any = None  # a compiled grammar (kvstate.serving.grammar), or None
    matchers: list = attrs.Factory(list)  # per choice, its grammar's matcher (on admission)

    generated: list = attrs.Factory(lambda self: [0] * self.n, takes_self=True)
    cached: int = 0  # prompt tokens read from the prefix cache, not prefilled (set on admission)
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

    @property
    def finished(self) -> bool:
        return len(self.cancelled) == self.n

    def fail(self, message: str) -> None:
        """End every choice with ``("error", -1, message)`` (once; then nothing more)."""
        if self.error is None and not self.finished:
            self.error = message
            self.tell("error", -1, message)
        self.cancel()

    def tell(self, kind: str, choice: int, value) -> None:
        """``emit``, where a listener that raises ends the job, not the scheduler."""
        try:
            self.emit(kind, choice, value)
        except Exception:  # the listener is gone (its loop closed): nobody to tell
            self.cancel()


class Scheduler:
    """Continuous batching over one model: admits jobs, runs rounds, drops finished rows.

    A job of ``n`` choices prefills once and forks its row ``n - 1`` times
    (``kv.fork``: the copies share the prompt's keys and values). Prompts go
    through the prefix cache when there is one, so a prompt whose start was
    seen before prefills only the rest; a finished row's prompt and completion
    join it (the next turn of a conversation prefills only its new message),
    and ``job.cached`` tells how many prompt tokens it served. Each row's
    ``payload`` is ``(job, choice)``.

    Args:
        model: an mlx-lm model.
        eos: token ids that end a choice.
        max_batch: most rows decoding at once (a job of ``n`` choices is ``n`` rows).
        max_queue: most jobs waiting to be admitted; ``submit`` raises ``QueueFull`` past it.
        prefix_cache: a ``PrefixCache`` (``None``: prompts are prefilled whole).
        cache_completions: a finished row's prompt and completion join the prefix
            cache (the next turn of a conversation prefills only its new part);
            off, only prompts do.
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
        make: ``kvstate.mlx_lm.make_states`` options for the rows' records
            (``max_kv_size``: rings; ``kv_bits``, ``kv_group_size``: quantized), the
            draft model's too. Rings share no prefix: with them the prefix cache is off.
        prefill_budget: most prompt tokens run per round (chunked prefill interleaved
            with decode: a longer prompt continues over the next rounds while the rows
            decode; ``None``: every admitted prompt is prefilled whole before the next
            round). Models with ring layers prefill whole prompts (a ring's prompt
            cannot be split: ``prefix_cache.splits``).
        kv_budget: most KV bytes held between rounds (``nbytes``: the rows, the prefix
            cache, prompts in progress; ``None``: no bound). A job is admitted when its
            rows' projected bytes (prompt plus ``max_tokens`` per row) fit beside the
            others'; after every join and before every round the prefix cache's
            unpinned entries, then the newest rows (parked in host memory, resumed
            exactly) make room. A job that could never fit is refused by ``submit``.
            Not with a draft model.
        overlap: the rows' grammar masks are filled on the host while the device runs
            the round's forward (``mx.async_eval``, then the fill); off, the fill comes
            first and the forward runs after it (``notes/serving.md`` measures both).
        pipelined: a plain round's tokens are read one round late, while the device
            runs the next round (``_round``); off, each round is read as it ends.
    """

    def __init__(
        self,
        model: Any,
        eos: Iterable[int],
        *,
        max_batch: int = 32,
        max_queue: int = 64,
        prefix_cache: Optional[prefix_cache.PrefixCache] = None,
        cache_completions: bool = True,
        drafter: Any = None,
        num_draft: int = 4,
        window: Optional[speculative.Window] = None,
        compiled: bool = False,
        prefill_step_size: int = 512,
        measure: bool = False,
        make: Optional[dict] = None,
        prefill_budget: Optional[int] = DEFAULT_PREFILL_BUDGET,
        kv_budget: Optional[int] = None,
        overlap: bool = True,
        pipelined: bool = True,
    ) -> None:
        self.model, self.eos = model, frozenset(eos)
        self.make = dict(make or {})
        self.window = window if drafter is not None else None  # the rule and its costs
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefix_cache, self.drafter, self.num_draft = prefix_cache, drafter, num_draft
        self.cache_completions = cache_completions
        self.forward = speculative.compiled(model) if compiled else None
        self.prefill_step_size, self.measure = prefill_step_size, measure
        self.prefill_budget = budget.prefill_budget(model, prefill_budget, self.make)
        self._prefilling: list = []  # [(job, prefix_cache.Partial)], oldest first
        self.kv_budget = budget.kv_budget(kv_budget)
        if self.kv_budget is not None and isinstance(drafter, DraftModel):
            raise KVStateError("kv_budget: expected None with a draft model, got a byte budget")
        self.token_bytes = (
            budget.bytes_per_token(model, self.make) if self.kv_budget is not None else 0
        )
        self._parked: list = []  # budget.Parked rows, oldest first
        # ((job, choice), (token,), log-probabilities) of rows joined, not yet handed out
        self._first: list = []
        self.overlap = overlap
        self.pipelined = pipelined
        self._unread: Optional[tuple] = None  # (payload, Round, Processed): a round not read yet
        self.bytes_per_token: list = []
        self._queue: queue.Queue = queue.Queue()
        self._pending: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._stopped = False  # no more jobs: stop() was called
        self._then: Optional[Callable[[Scheduler], None]] = None
        self._thread: Optional[threading.Thread] = None
        self._processed: Optional[Processed] = None  # the last round's, when it had one
        self.spec: Any = None  # the rows in flight: a speculative.Speculation, or None
        self.stats = {
            "rounds": 0,
            "prefilled": 0,
            "prompt_tokens": 0,
            "drafted": 0,
            "accepted": 0,
            "peak_bytes": 0,
            "failed": 0,  # jobs ended by a fault or their deadline
            "drafter_failed": 0,  # 1 once the drafter failed and was switched off
            "parked": 0,  # rows parked to keep within kv_budget
        }

    # --- what callers see -----------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._stopped and self._thread is not None and self._thread.is_alive()

    @property
    def active_rows(self) -> int:
        spec = self.spec
        return 0 if spec is None else spec.batch_size

    @property
    def queued(self) -> int:
        """Jobs not decoding: waiting, with their prompts in progress, or parked rows."""
        return self._queue.qsize() + len(self._pending) + len(self._prefilling) + len(self._parked)

    def submit(self, job: Job) -> None:
        """Queue a job (thread-safe); ``QueueFull`` when ``max_queue`` jobs wait."""
        if job.n > self.max_batch:
            raise KVStateError(f"n: expected at most {self.max_batch} (the batch), got {job.n}")
        if self._stopped or (self._thread is not None and not self._thread.is_alive()):
            raise Stopped
        if self.kv_budget is not None and self._projected(job) > self.kv_budget:
            budget.refuse(self._projected(job), self.kv_budget, job.n, self.token_bytes)
        if self.queued >= self.max_queue:
            raise QueueFull
        self._queue.put(job)

    def step(self, block: bool = False) -> bool:
        """Admit what waits (waiting up to 50 ms for a job with ``block``), then run
        one round if any row is active. Returns whether a round ran."""
        self._expire()
        self._admit(block=block)
        if not self.active_rows:
            return False
        self._round()
        return True

    def nbytes(self) -> int:
        """KV bytes resident now: the rows (the draft model's too), the prefix cache,
        the prompts in progress and what parked rows still read on the device, each
        shared record counted once."""
        return resident_bytes(self._records(self.spec))

    def _records(self, spec) -> list:
        """Every device record held with ``spec`` as the rows (``nbytes``)."""
        records: list = []
        if spec is not None:
            records += list(spec.states) + list(spec.draft_states or ())
        if self.prefix_cache is not None:
            records += self.prefix_cache.records()
        records += [s for _, part in self._prefilling for s in part.states]
        return records + [r for p in self._parked for r in budget.device_records(p)]

    # --- the thread (the HTTP server) ------------------------------------------------

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._run, name="kvstate-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, then: Optional[Callable[[Scheduler], None]] = None) -> None:
        """Stop the thread; every job still queued or running hears an error.
        ``then(self)`` runs in the thread after its last round (MLX arrays made in a
        thread are evaluated in that thread: a prefix cache is saved there)."""
        self._stopped = True
        self._then = then
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        elif then is not None:
            then(self)
        self._fail_all(SHUTDOWN)

    def _run(self) -> None:
        """``step`` until stopped. A fault the isolation below did not place (a bug in
        the scheduler itself) ends every job in flight, and the loop goes on empty.

        Last, the thread frees MLX's state for it (``mx.clear_streams``: its streams,
        their compiled functions, its random state) while it still holds the
        interpreter. Left to the thread's exit, that state is freed after
        ``Thread.join`` has returned, and when the main thread is finalizing the
        interpreter by then, freeing it aborts the process ("terminate called
        without an active exception", status -6: ``notes/serving.md``)."""
        try:
            while not self._stop.is_set():
                try:
                    self.step(block=not self.active_rows)
                except Exception as exc:
                    log.exception("scheduler fault; every job in flight ends")
                    self._fail_all(_describe(exc))
            if self._then is not None:
                self._then(self)
        finally:
            _end_thread()

    def _jobs(self) -> list:
        """Every job running, pending or queued, each once."""
        rows: list = [] if self.spec is None else [p[0] for p in self.spec.batch.payload]
        rows += [job for job, _ in self._prefilling]
        rows += [p.spec.batch.payload[0][0] for p in self._parked]
        while True:
            try:
                self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return list(dict.fromkeys(rows + list(self._pending)))

    def _fail_all(self, message: str) -> None:
        """End every job (running, pending, queued) with ``message``; no rows stay."""
        jobs = self._jobs()
        self.spec, self._unread = None, None
        self._pending.clear()
        self._prefilling, self._parked, self._first = [], [], []
        for job in jobs:
            self._fail(job, message)

    def _fail(self, job: Job, message: str) -> None:
        """End ``job`` with an error and unpin what it read (its rows leave at the next
        ``_emit``, being cancelled)."""
        if job.error is None and not job.finished:
            self.stats["failed"] += 1
        job.fail(message)
        job.release()

    def _expire(self) -> None:
        """End the jobs past their deadline (running or waiting)."""
        now = time.perf_counter()
        for job in self._jobs():
            if job.deadline is not None and now > job.deadline and not job.finished:
                self._fail(job, f"{DEADLINE}: the request ran {now - job.submitted:.1f} s")
        self._drop_waiting()
        if self.spec is not None:
            self._drop_cancelled()

    def _drop_waiting(self) -> None:
        """Prompts in progress and parked rows of cancelled choices leave (a parked
        row's host copy with it); a job whose every choice ended unpins what it read."""
        ended = {job for job, _ in self._prefilling if job.finished}
        self._prefilling = [(job, part) for job, part in self._prefilling if not job.finished]
        keep = []
        for parked in self._parked:
            job, choice = parked.spec.batch.payload[0]
            if choice in job.cancelled:
                ended.add(job)
            else:
                keep.append(parked)
        self._parked = keep
        for job in ended:
            if job.finished:
                job.release()

    # --- admission --------------------------------------------------------------------

    def _admit(self, block: bool) -> None:
        """Parked rows back first, then the prompts in progress go on, then waiting
        jobs, oldest first, while their rows (and with a KV budget, their projected
        bytes) fit: whole prompts, prefilled together, while they fit in what is left
        of the prefill budget, and the next longer one started with the rest of it.
        Last, room is made for the round (``_make_room``)."""
        self._drop_waiting()
        self._resume()
        left = self._continue_prefills()
        room = self.max_batch - self.active_rows - self._reserved()
        block = block and not self._prefilling and not self._parked
        jobs: list = []
        while room > 0:
            job = self._head(block)
            if job is None or job.n > room or not self._fits(job, jobs):
                break  # (a job that does not fit waits at the head for rows to leave)
            block = False
            if len(job.prompt) > left:
                if left > 0:
                    self._begin_prefill(self._pending.popleft(), int(left))
                break
            jobs.append(self._pending.popleft())
            room -= job.n
            left -= len(job.prompt)
        if jobs:
            self._isolated(jobs, self._start)
        self._make_room()
        first, self._first = self._first, []
        if first:
            self._emit(first)

    def _reserved(self) -> int:
        """Rows held for prompts in progress and parked rows (they count against
        ``max_batch``: they join the batch)."""
        return sum(job.n for job, _ in self._prefilling) + len(self._parked)

    def _head(self, block: bool) -> Optional[Job]:
        """The oldest waiting job still wanted (jobs cancelled while waiting are
        dropped), or ``None``."""
        while self._pending or self._take(block):
            block = False
            job = self._pending[0]
            if not job.finished:
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

    def _isolated(self, items: list, start: Callable[[list], None]) -> None:
        """``start(items)``; when it fails for several items (jobs, or prompts whose
        prefill completed), each alone, so a fault ends only the job it belongs to."""
        try:
            start(items)
        except Exception as exc:
            if len(items) == 1:
                job = items[0] if isinstance(items[0], Job) else items[0][0]
                self._fault(job, "prefill", exc)
                return
            for item in items:
                self._isolated([item], start)

    def _fault(self, job: Job, stage: str, exc: Exception) -> None:
        log.warning("request %s failed in %s: %s", job.id, stage, _describe(exc))
        self._fail(job, _describe(exc))

    def _start(self, jobs: list) -> None:
        """Prefill the jobs' prompts in one call (reusing cached prefixes; one batched
        step gives every first token), then start their rows (``_join``). Nothing
        changes where it raises (the leases it took are given back)."""
        logits, states, leases, prefilled = self._prefill([job.prompt for job in jobs])
        for job, lease in zip(jobs, leases):
            job.leases = [lease] if lease is not None else []
        try:
            self._join(jobs, logits, states, prefilled)
        except BaseException:
            for job in jobs:
                job.release()
            raise

    def _join(self, jobs: list, logits, states, prefilled: list) -> None:
        """The prefilled jobs' rows join the batch: first tokens sampled, each job's
        choices forked. Their first tokens are handed out at the end of ``_admit``,
        once room is made (the rows joined may be parked at once). Nothing changes
        where it raises."""
        new, first, lps = self._rows_of(jobs, states, logits)
        spec = new if self.spec is None else speculative.join(self.spec, new)
        for job, ran in zip(jobs, prefilled):
            job.cached = len(job.prompt) - ran
        self.stats["prefilled"] += sum(prefilled)
        self.stats["prompt_tokens"] += sum(len(job.prompt) for job in jobs)
        self.spec = spec
        self._first += zip(new.batch.payload, [(t,) for t in first], lps or [()] * len(first))

    # --- chunked prefill (a prefill budget) -------------------------------------------

    def _begin_prefill(self, job: Job, tokens: int) -> None:
        """Start ``job``'s prompt (its cached prefix leased) and run ``tokens`` of it."""
        try:
            part = prefix_cache.begin(self.model, job.prompt, self.prefix_cache, **self.make)
        except Exception as exc:
            self._fault(job, "prefill", exc)
            return
        job.leases = [part.lease] if part.lease is not None else []
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
        of those that complete. A prompt whose forward fails ends its own job.
        Returns the tokens left."""
        going: list = []
        done: list = []
        for job, part in self._prefilling:
            n = min(left, part.rest)
            try:
                part = prefix_cache.advance(self.model, part, n, step_size=self.prefill_step_size)
            except Exception as exc:
                self._fault(job, "prefill", exc)
                continue
            left -= n
            (going if part.rest else done).append((job, part))
        self._prefilling = going
        settled = self._settled(done)
        if settled:
            self._isolated(settled, self._start_prefilled)
        return left

    def _settled(self, done: list) -> list:
        """``(job, row, part)`` of prompts whose last chunk ran: each prompt cached,
        its row re-pinned to the entry (``prefix_cache.settle``)."""
        out = []
        for job, part in done:
            try:
                states, lease = prefix_cache.settle(part, self.prefix_cache)
            except Exception as exc:
                self._fault(job, "prefill", exc)
                continue
            job.leases = [lease] if lease is not None else []
            out.append((job, fork(states, 0, 0), part))
        return out

    def _start_prefilled(self, settled: list) -> None:
        """The rows of settled prompts join the batch (``_join``)."""
        jobs = [job for job, _, _ in settled]
        logits = mx.concatenate([part.logits for _, _, part in settled], axis=0)
        states = bridge.merge_rows([row for _, row, _ in settled])
        self._join(jobs, logits, states, [part.ran for _, _, part in settled])

    def _rows_of(self, jobs: list, states, logits) -> tuple:
        """``(Speculation, first tokens, their log-probabilities)``: the prefilled jobs'
        rows, their first tokens sampled and each job's choices forked."""
        prompts = [job.prompt for job in jobs]
        for job in jobs:
            job.matchers = (
                [grammars.matcher(job.grammar) for _ in range(job.n)] if job.grammar else []
            )
        batch, proc = _first_tokens(jobs, states, logits)
        draft_states = None
        if isinstance(self.drafter, DraftModel):
            try:
                _, draft_states = bridge.prefill(
                    self.drafter.model,
                    prompts,
                    prefill_step_size=self.prefill_step_size,
                    **{**self.make, **self.drafter.make},
                )
                draft_states = fork(draft_states, 0, 0)  # (dense layers shared, as forked rows are)
            except Exception as exc:
                self._drop_drafter(exc)
        batch, draft_states, origin = _forked(jobs, batch, draft_states)
        first = cast(list, batch.tokens.tolist())  # [B]
        context = [list(jobs[b].prompt) + [t] for (b, _), t in zip(origin, first)]
        k = (self.num_draft if self.drafter is not None else 0,) * len(origin)
        tops = [job.logprobs for job, _ in batch.payload]
        lp = None if proc is None else proc.logprobs
        rows = None if lp is None else lp[mx.array([b for b, _ in origin])]
        lps = token_logprobs(rows, [(t,) for t in first], tops)
        spec = speculative.Speculation(batch, context, k, k, draft_states, self.window)
        return spec, first, lps

    def _prefill(self, prompts: list) -> tuple:
        """``(logits, states, leases, prefilled)``: through the prefix cache when
        there is one, else each prompt's own records (every family). Dense layers
        come back as ``SharedState`` either way (``kv.fork(states, 0, 0)``), the
        kind forked rows have, so every admission joins the rows in flight."""
        if self.prefix_cache is not None:
            return prefix_cache.prefill(
                self.model,
                prompts,
                self.prefix_cache,
                prefill_step_size=self.prefill_step_size,
                **self.make,
            )
        logits, states = bridge.prefill(
            self.model, prompts, prefill_step_size=self.prefill_step_size, **self.make
        )
        if self.kv_budget is not None and len(prompts) > 1:
            # each prompt its own record: prompts prefilled together share one as wide as
            # the longest, which outlives the rows that fit it and is more than their
            # projections (``budget.projected``: each prompt in its own growth steps)
            rows = [[ops.extract_row(s, b) for s in states] for b in range(len(prompts))]
            return logits, bridge.merge_rows([fork(r, 0, 0) for r in rows]), *_none(prompts)
        return logits, fork(states, 0, 0), *_none(prompts)

    # --- the KV byte budget ------------------------------------------------------------

    def _projected(self, job: Job) -> int:
        """The most KV bytes ``job``'s rows can hold (``budget.projected``: the prompt's
        record and each row's own columns, ``max_tokens`` and draft ones, in whole
        growth steps)."""
        draft = self.num_draft if self.drafter is not None else 0
        return job.n * budget.projected(len(job.prompt), job.max_tokens, self.token_bytes, draft)

    def _fits(self, job: Job, taking: list) -> bool:
        """Whether ``job``'s projected bytes fit beside those of the running, starting
        and taken (``taking``) jobs' rows, with no row parked; the prefix cache yields
        what it must."""
        if self.kv_budget is None:
            return True
        if self._parked:
            return False
        jobs = {p[0] for p in self.spec.batch.payload} if self.spec is not None else set()
        jobs.update([j for j, _ in self._prefilling] + taking + [job])
        need = sum(map(self._projected, jobs))
        if self.prefix_cache is not None:
            self.prefix_cache.shrink(max(self.kv_budget - need, 0))
            need += self.prefix_cache.nbytes
        return need <= self.kv_budget

    def _need(self, spec) -> int:
        """KV bytes held with ``spec`` as the rows once its next round appended: every
        record (``_records``, each once) plus the columns the round grows."""
        grow = 0 if spec is None else budget.grown_bytes(spec.states, 1 + max(spec.num_draft))
        return resident_bytes(self._records(spec)) + grow

    def _make_room(self) -> None:
        """Unpinned prefix-cache entries, then the newest rows (parked), until what the
        next round will hold fits the KV budget."""
        if self.kv_budget is None or self.spec is None:
            return
        while self._need(self.spec) > self.kv_budget:
            over = self._need(self.spec) - self.kv_budget
            cache = self.prefix_cache
            if cache is not None and cache.shrink(max(cache.nbytes - over, 0)):
                continue
            if self.spec.batch_size == 1:
                return  # the last row runs (its projection fits the budget alone)
            self._park(budget.newest(self.spec.batch.payload))

    def _park(self, b: int) -> None:
        """Row ``b`` out of the batch, its records in host memory (``budget.Parked``)."""
        one = speculative.leave(self.spec, [b])
        states = [ops.extract_row(s, 0) for s in one.batch.states]  # (compact copies)
        one = attrs.evolve(one, batch=attrs.evolve(one.batch, states=states))
        job, choice = one.batch.payload[0]
        placeholder = bridge.make_states(self.model, 1, **self.make)
        stay = [r for r in range(self.spec.batch_size) if r != b]
        rest = speculative.leave(self.spec, stay)
        # (prefixes that stay resident anyway: the rows', the cache's, prompts', parked rows')
        keep = frozenset(id(x) for r in self._records(rest) for x in resident_records(r))
        self._parked.append(budget.park(one, placeholder, (job.submitted, choice), keep))
        self._parked.sort(key=lambda p: p.order)
        self.spec = rest
        self.stats["parked"] += 1

    def _resume(self) -> None:
        """Parked rows back, oldest first, while the batch with them fits the KV budget
        (their records as they were: the tokens are those of a run never parked)."""
        while self._parked:
            row = budget.unpark(self._parked[0])
            spec = row if self.spec is None else speculative.join(self.spec, row)
            if self.spec is not None and self._need(spec) > cast(int, self.kv_budget):
                return
            self.spec = spec
            self._parked.pop(0)

    # --- rounds -----------------------------------------------------------------------

    def _round(self) -> None:
        """One round over every row. Where building it raises, the rows are as they
        were: the faulty ones are found and end, the others run the round again.

        Pipelined (``pipelined``), a plain round's tokens are handed to the device
        (``mx.async_eval``) and read one round later: the previous round's tokens are
        read and handed out while the device runs this one, as mlx-lm's
        ``BatchGenerator`` does, so the host's emission and the next round's graph
        overlap the device. A row that ended in the previous round has run one round
        more (its token is dropped). A drafting round (its drafter reads the contexts)
        or one whose rows have grammars or processors (their next round needs the last
        tokens on the host) hands out the previous round first and its own at once."""
        spec = cast(Any, self.spec)
        deferrable = self.pipelined and self.drafter is None and self._deferrable(spec)
        if not deferrable and self._unread is not None:
            self._hand_out(*self._take_unread())
            if self.spec is None:
                return
        try:
            spec, r = self._try_round(self.spec, self.drafter)
        except Exception as exc:
            if not self._isolate(exc):
                return
            spec, r = self._try_round(self.spec, self.drafter)
        self.spec = spec
        self.window = spec.window  # what it measured outlives the rows
        self.stats["rounds"] += 1
        self.stats["drafted"] += sum(r.drafted)
        self.stats["accepted"] += sum(r.accepted)
        this = (spec.batch.payload, r, self._processed)
        del spec  # (the round's input records held by nothing: its appends write in place)
        tokens = r.unread if deferrable else None
        if tokens is not None:  # to the device now; read at the next round
            mx.async_eval(tokens)
        if self._unread is not None:
            self._hand_out(*self._take_unread())
        if tokens is None:
            self._hand_out(*this)
        elif self.spec is not None:
            self._unread = this

    def _deferrable(self, spec) -> bool:
        """Whether a round of ``spec``'s rows may be read one round late: no row has a
        grammar (its mask needs the last token accepted) or processors or asks for
        log-probabilities (``Processed`` reads the contexts)."""
        payload = spec.batch.payload
        if any(job.matchers for job, _ in payload):
            return False
        return not needed(spec.batch.sampling, [job.logprobs for job, _ in payload])

    def _take_unread(self) -> tuple:
        out, self._unread = self._unread, None
        return cast(tuple, out)

    def _hand_out(self, payload: list, r, proc) -> None:
        """A round's tokens (read now: the round runs on the device if it has not) to
        the rows that ran it (``payload``); finished rows leave."""
        try:  # reading the tokens runs the round on the device
            emitted = r.emitted
            lps = None if proc is None else token_logprobs(proc.logprobs, emitted, proc.tops)
        except Exception as exc:  # the rows' records moved on: none can be kept
            log.warning("a round failed on the device: %s", _describe(exc))
            rows = [] if self.spec is None else self.spec.batch.payload
            for job in {job for job, _ in list(payload) + list(rows)}:
                self._fail(job, _describe(exc))
            self.spec, self._unread = None, None
            return
        self._emit(zip(payload, emitted, lps or [()] * len(emitted)))
        if self.spec is None:
            self._unread = None  # (every row it held has ended)

    def _try_round(self, spec, drafter) -> tuple:
        """One round; its forward through ``Processed`` when a row has processors or asks
        for log-probabilities (``self._processed``, the last round's). The rows' grammar
        mask goes with it: inside ``Processed`` (after the processors, before the
        log-probabilities), else through ``step``'s ``mask``."""
        forward = self.forward or speculative.eager(self.model)
        sampling, tops = spec.batch.sampling, [job.logprobs for job, _ in spec.batch.payload]
        mask = self._mask(spec)
        self._processed = None
        if needed(sampling, tops):
            contexts = spec.context if any(s.processed for s in sampling) else None
            forward = self._processed = Processed(forward, sampling, contexts, tops, mask)
            mask = None
        return speculative.step(self.model, spec, drafter=drafter, forward=forward, mask=mask)

    def _mask(self, spec) -> Optional[Callable]:
        """The rows' grammar mask, ``mask(logits, window) -> bitmask``: their matchers'
        words at each position of the verify window (stepping over the row's drafts
        and back: ``grammar.fill``), filled while the device runs the forward
        (``overlap``) or before it; ``None`` when no row has a grammar (the round
        builds no mask)."""
        matchers = [job.matchers[c] if job.matchers else None for job, c in spec.batch.payload]
        if not any(m is not None for m in matchers):
            return None

        def mask(logits, window):
            if self.overlap:
                mx.async_eval(logits)
            drafts = None
            if window is not None and window.shape[1] > 1:
                drafts = [row[1:] for row in cast(list, window.tolist())]
            return grammars.fill(matchers, logits.shape[-1], drafts)

        return mask

    def _drop_drafter(self, exc: Exception) -> None:
        """The drafter failed: it is switched off, and the rows go on plain."""
        log.warning("the drafter failed (%s); rounds go on plain", _describe(exc))
        self.drafter = None
        self.stats["drafter_failed"] = 1
        if self.spec is not None:
            self.spec = attrs.evolve(self.spec, draft_states=None)

    def _row_runs(self, spec, b: int) -> bool:
        """Whether row ``b`` alone runs a round."""
        return _runs(lambda: self._try_round(speculative.leave(spec, [b]), self.drafter))

    def _isolate(self, exc: Exception) -> bool:
        """After a round raised: a drafter that fails where plain rounds run is switched
        off; else each row runs alone, and the jobs of the rows that fail alone (every
        row, when none does) end with the error. Whether rows remain to run."""
        spec = self.spec
        if self.drafter is not None:
            plain = attrs.evolve(spec, draft_states=None)
            if _runs(lambda: self._try_round(plain, None)):
                self._drop_drafter(exc)
                return True
        faulty = [b for b in range(spec.batch_size) if not self._row_runs(spec, b)]
        for job in {spec.batch.payload[b][0] for b in faulty or range(spec.batch_size)}:
            log.warning("request %s failed in a round: %s", job.id, _describe(exc))
            self._fail(job, _describe(exc))
        self._drop_cancelled()
        return self.spec is not None

    def _emit(self, handouts: Iterable) -> None:
        """Hand each ``((job, choice), tokens, log-probabilities)`` its tokens (and their
        log-probabilities, where asked); finished or cancelled rows leave."""
        for (job, choice), toks, lps in handouts:
            self._hand(job, choice, toks, lps)
        if self.spec is None:
            return
        if self.measure:
            self._measure()
        self._drop_cancelled()

    def _drop_cancelled(self) -> None:
        """The rows of finished, cancelled or failed choices leave; a job whose every
        choice ended unpins what it read."""
        payload = self.spec.batch.payload
        stay = [b for b, (job, choice) in enumerate(payload) if choice not in job.cancelled]
        if len(stay) == len(payload):
            return
        for job in {job for job, _ in payload}:
            if len(job.cancelled) == job.n:
                job.release()
        if self.cache_completions and self.prefix_cache is not None:
            self._cache_finished(sorted(set(range(len(payload))) - set(stay)))
        if not stay:  # the batch empties: the rule keeps its last round's cost
            self.window = speculative.recorded(self.spec)
        self.spec = speculative.leave(self.spec, stay) if stay else None

    def _cache_finished(self, rows: list) -> None:
        """Each leaving row's prompt and completion join the prefix cache, up to its
        end and only as far as its records hold (its last token, pending, was never
        fed): the next turn of its conversation reads them. A row whose records ran
        past its completion (a pipelined round after it ended, a cancelled choice) and
        cannot be cut there (a recurrent state is a snapshot at its last token) adds
        no entry."""
        spec, cache = self.spec, cast(prefix_cache.PrefixCache, self.prefix_cache)
        context, first = spec.context, spec.states[0]
        for b in rows:
            job, choice = spec.batch.payload[b]
            held = prefix_cache.seen(first, b)
            n = min(len(job.prompt) + job.generated[choice], held)
            if n > 0 and (n == held or prefix_cache.row_cuts_freely(spec.states, b)):
                cache.insert_row(context[b][:n], spec.states, b)

    def _measure(self) -> None:
        """The bytes held now (before finished rows leave): the peak, and per token held."""
        resident = self.nbytes()
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], resident)
        tokens = sum(self.spec.lengths) - self.spec.batch_size  # (less each row's pending token)
        self.bytes_per_token.append(resident / max(tokens, 1))

    def _hand(self, job: Job, choice: int, tokens, lps=()) -> None:
        """``tokens`` to ``job``'s ``choice``, up to its end (a stop token or ``max_tokens``)."""
        for i, t in enumerate(tokens):
            if choice in job.cancelled:
                return
            job.generated[choice] += 1
            if i < len(lps):
                job.tell("logprob", choice, lps[i])
            job.tell("token", choice, t)
            ended = self._advance(job, choice, t)
            if job.error is not None:
                return
            stop = t in self.eos or t in job.stop or ended
            if stop or job.generated[choice] >= job.max_tokens:
                job.tell("done", choice, "stop" if stop else "length")
                job.cancel(choice)

    def _advance(self, job: Job, choice: int, token: int) -> bool:
        """The choice's matcher fed ``token``: whether its grammar ended (the reply is
        complete). A token it refuses (the mask lets none through: a fault) ends the
        job with an error."""
        if not job.matchers:
            return False
        try:
            return grammars.accept(job.matchers[choice], token)
        except KVStateError as exc:
            self._fail(job, str(exc))
            return False


def shares_prefixes(model: nn.Module, make: Optional[dict] = None) -> bool:
    """Whether the model's records (made with ``make_states`` options ``make``) are
    dense or quantized: their prefixes share with no copy (``kvstate.kinds.shared``);
    other kinds' cache entries are copies with narrower reuse (``notes/serving.md``)."""
    states = bridge.make_states(model, 1, **(make or {}))
    return all(type(s) in (CacheState, QuantizedState) for s in states)


def _first_tokens(jobs: list, states, logits) -> tuple:
    """``(batch, processed)``: the admitted jobs' rows as a ``Batch``, their first
    tokens sampled (after their processors, over their prompts); ``processed`` holds
    the log-probabilities (``None`` when no row has processors or asks for them)."""
    seeds = [job.seed if job.seed is not None else _random_seed() for job in jobs]
    sampling = [
        Sampling(temperature=job.temperature, top_p=job.top_p, **job.sampling) for job in jobs
    ]
    batch = Batch(
        states,
        mx.zeros((len(jobs),), mx.uint32),
        keys=row_keys(seeds),
        sampling=sampling,
        ids=[job.id for job in jobs],
        payload=[(job, 0) for job in jobs],
    )
    proc = None
    tops = [job.logprobs for job in jobs]
    matchers = [job.matchers[0] if job.matchers else None for job in jobs]
    mask = None
    if any(m is not None for m in matchers):  # the first token keeps to the job's grammar too

        def mask(lg, _window):
            return grammars.fill(matchers, lg.shape[-1])

    if needed(sampling, tops) or mask is not None:
        proc = Processed(lambda w, s: (None, s), sampling, [job.prompt for job in jobs], tops, mask)
        logits = proc.apply(logits[:, None, :], None)[:, 0, :]
    tokens, keys = sample_batch(logits, batch)
    return attrs.evolve(batch, tokens=tokens, keys=keys), proc


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


def _end_thread() -> None:
    """Free MLX's state of the calling thread (``mx.clear_streams``, MLX's own advice at
    the end of a thread that ran MLX work); the thread must run no MLX work after it."""
    clear = getattr(mx, "clear_streams", None)  # (older MLX has none)
    if clear is not None:
        clear()


def _none(prompts: list) -> tuple:
    """``(leases, prefilled)`` of prompts prefilled whole with no prefix cache."""
    return [None] * len(prompts), [len(p) for p in prompts]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _runs(thunk: Callable[[], tuple]) -> bool:
    """Whether a trial round builds and runs (its tokens read) without raising."""
    try:
        _, r = thunk()
        r.emitted  # noqa: B018 (reading them runs the round)
    except Exception:
        return False
    return True


def _random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")
