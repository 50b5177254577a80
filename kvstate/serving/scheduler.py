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
the rows go on plain). A prefill that fails is retried job by job. A job
past its ``deadline`` ends with an error. Design: ``notes/serving.md``.
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
from ..core.records import CacheState, QuantizedState
from ..errors import KVStateError
from ..kinds.shared import fork, resident_bytes
from ..sampling import Sampling, row_keys
from ..speculative import rounds as speculative
from ..speculative.drafts import DraftModel
from . import grammar as grammars
from . import prefix_cache

__all__ = ["Job", "QueueFull", "Scheduler", "Stopped", "shares_prefixes"]

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
    scheduler's ``eos``. ``deadline``: a ``time.perf_counter()`` instant past
    which the job ends with an error (``None``: none). ``grammar``: a compiled
    grammar (``kvstate.serving.grammar.Grammars.compile``) every choice's reply
    keeps to; each choice's matcher (``matchers[i]``, made on admission) is row
    state, advanced with each token the choice emits.
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
        overlap: the rows' grammar masks are filled on the host while the device runs
            the round's forward (``mx.async_eval``, then the fill); off, the fill comes
            first and the forward runs after it (``notes/serving.md`` measures both).
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
        overlap: bool = True,
    ) -> None:
        self.model, self.eos = model, frozenset(eos)
        self.make = dict(make or {})
        self.window = window if drafter is not None else None  # the rule and its costs
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefix_cache, self.drafter, self.num_draft = prefix_cache, drafter, num_draft
        self.cache_completions = cache_completions
        self.forward = speculative.compiled(model) if compiled else None
        self.prefill_step_size, self.measure = prefill_step_size, measure
        self.overlap = overlap
        self.bytes_per_token: list = []
        self._queue: queue.Queue = queue.Queue()
        self._pending: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._stopped = False  # no more jobs: stop() was called
        self._then: Optional[Callable[[Scheduler], None]] = None
        self._thread: Optional[threading.Thread] = None
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
        return self._queue.qsize() + len(self._pending)

    def submit(self, job: Job) -> None:
        """Queue a job (thread-safe); ``QueueFull`` when ``max_queue`` jobs wait."""
        if job.n > self.max_batch:
            raise KVStateError(f"n: expected at most {self.max_batch} (the batch), got {job.n}")
        if self._stopped or (self._thread is not None and not self._thread.is_alive()):
            raise Stopped
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
        the scheduler itself) ends every job in flight, and the loop goes on empty."""
        while not self._stop.is_set():
            try:
                self.step(block=not self.active_rows)
            except Exception as exc:
                log.exception("scheduler fault; every job in flight ends")
                self._fail_all(_describe(exc))
        if self._then is not None:
            self._then(self)

    def _jobs(self) -> list:
        """Every job running, pending or queued, each once."""
        rows: list = [] if self.spec is None else [p[0] for p in self.spec.batch.payload]
        while True:
            try:
                self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return list(dict.fromkeys(rows + list(self._pending)))

    def _fail_all(self, message: str) -> None:
        """End every job (running, pending, queued) with ``message``; no rows stay."""
        jobs = self._jobs()
        self.spec = None
        self._pending.clear()
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
        if self.spec is not None:
            self._drop_cancelled()

    # --- admission --------------------------------------------------------------------

    def _admit(self, block: bool) -> None:
        """Take waiting jobs, oldest first, while their rows fit; prefill them together."""
        room = self.max_batch - self.active_rows
        jobs = []
        while room > 0:
            if not self._pending and not self._take(block):
                break
            block = False
            job = self._pending[0]
            if len(job.cancelled) == job.n:
                self._pending.popleft()
                continue
            if job.n > room:
                break  # it waits at the head for rows to leave
            jobs.append(self._pending.popleft())
            room -= job.n
        if jobs:
            self._start_isolated(jobs)

    def _take(self, block: bool) -> bool:
        """Move one job from the queue to the pending line; whether there was one."""
        try:
            self._pending.append(
                self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            )
        except queue.Empty:
            return False
        return True

    def _start_isolated(self, jobs: list) -> None:
        """``_start``; when it fails for several jobs, each alone, so a fault ends only
        the job it belongs to."""
        try:
            self._start(jobs)
        except Exception as exc:
            if len(jobs) == 1:
                log.warning("request %s failed in prefill: %s", jobs[0].id, _describe(exc))
                self._fail(jobs[0], _describe(exc))
                return
            for job in jobs:
                self._start_isolated([job])

    def _start(self, jobs: list) -> None:
        """Prefill the jobs' prompts in one call (reusing cached prefixes; one batched
        step gives every first token), sample, fork each job's choices, join the rows.
        Nothing changes where it raises (the leases it took are given back)."""
        prompts = [job.prompt for job in jobs]
        logits, states, leases, prefilled = self._prefill(prompts)
        try:
            new, first = self._rows_of(jobs, states, logits)
        except BaseException:
            for lease in leases:
                if lease is not None:
                    lease.release()
            raise
        for job, lease, ran in zip(jobs, leases, prefilled):
            job.leases = [lease] if lease is not None else []
            job.cached = len(job.prompt) - ran
        self.stats["prefilled"] += sum(prefilled)
        self.stats["prompt_tokens"] += sum(map(len, prompts))
        self.spec = new if self.spec is None else speculative.join(self.spec, new)
        B = self.spec.batch_size
        self._emit([(t,) for t in first], range(B - len(first), B))

    def _rows_of(self, jobs: list, states, logits) -> tuple:
        """``(Speculation, first tokens)``: the prefilled jobs' rows, their first tokens
        sampled and each job's choices forked."""
        prompts = [job.prompt for job in jobs]
        for job in jobs:
            job.matchers = (
                [grammars.matcher(job.grammar) for _ in range(job.n)] if job.grammar else []
            )
        batch = _first_tokens(jobs, states, logits)
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
        # a row with a grammar does not draft (its mask covers its window's first position)
        k = tuple(
            self.num_draft if self.drafter is not None and jobs[b].grammar is None else 0
            for b, _ in origin
        )
        return speculative.Speculation(batch, context, k, k, draft_states, self.window), first

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
        return logits, fork(states, 0, 0), [None] * len(prompts), [len(p) for p in prompts]

    # --- rounds -----------------------------------------------------------------------

    def _round(self) -> None:
        """One round over every row. Where building it raises, the rows are as they
        were: the faulty ones are found and end, the others run the round again."""
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
        try:  # reading the tokens runs the round on the device
            emitted = r.emitted
        except Exception as exc:  # the rows' records moved on: none can be kept
            log.warning("a round failed on the device: %s", _describe(exc))
            for job in {job for job, _ in spec.batch.payload}:
                self._fail(job, _describe(exc))
            self.spec = None
            return
        self._emit(emitted, range(spec.batch_size))

    def _try_round(self, spec, drafter) -> tuple:
        return speculative.step(
            self.model, spec, drafter=drafter, forward=self.forward, mask=self._mask(spec)
        )

    def _mask(self, spec) -> Optional[Callable]:
        """``step``'s ``mask`` for the rows of ``spec``: their matchers' bitmask, filled
        while the device runs the forward (``overlap``) or before it; ``None`` when no
        row has a grammar (the round builds no mask)."""
        matchers = [job.matchers[c] if job.matchers else None for job, c in spec.batch.payload]
        if not any(m is not None for m in matchers):
            return None

        def mask(logits):
            if self.overlap:
                mx.async_eval(logits)
            return grammars.fill(matchers, logits.shape[-1])

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

    def _emit(self, emitted, rows) -> None:
        """Hand each row's new tokens to its job; finished or cancelled rows leave."""
        payload = self.spec.batch.payload
        for toks, b in zip(emitted, rows):
            job, choice = payload[b]
            self._hand(job, choice, toks)
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
        fed): the next turn of its conversation reads them."""
        spec, cache = self.spec, cast(prefix_cache.PrefixCache, self.prefix_cache)
        context, held = spec.context, spec.states[0].lengths
        for b in rows:
            job, choice = spec.batch.payload[b]
            n = min(len(job.prompt) + job.generated[choice], held[b])
            if n > 0:
                cache.insert_row(context[b][:n], spec.states, b)

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
            job.tell("token", choice, t)
            ended = self._advance(job, choice, t)
            if job.error is not None:
                return
            stop = t in self.eos or t in job.stop or ended
            if stop or job.generated[choice] >= job.max_tokens:
                job.tell("done", choice, "stop" if stop else "length")
                job.cancel(choice)

    def _advance(self, job: Job, choice: int, token: int) -> bool:
        """The choice's matcher fed ``token``: whether its grammar terminated (the reply
        is complete). A token it refuses (the mask lets none through: a fault) ends
        the job with an error."""
        if not job.matchers:
            return False
        m = job.matchers[choice]
        if not m.accept_token(token):
            self._fail(job, f"the grammar refused token {token}")
            return False
        return m.is_terminated()


def shares_prefixes(model: nn.Module, make: Optional[dict] = None) -> bool:
    """Whether the model's records (made with ``make_states`` options ``make``) are
    dense or quantized: their prefixes share with no copy (``kvstate.kinds.shared``);
    other kinds' cache entries are copies with narrower reuse (``notes/serving.md``)."""
    states = bridge.make_states(model, 1, **(make or {}))
    return all(type(s) in (CacheState, QuantizedState) for s in states)


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
    bitmask = grammars.fill(
        [job.matchers[0] if job.matchers else None for job in jobs], logits.shape[-1]
    )
    if bitmask is not None:  # the first token keeps to the job's grammar too
        logits = grammars.apply_bitmask(logits, bitmask)
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
