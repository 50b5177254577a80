"""Requests in, completions out: batch generation on the one scheduler.

``serve(engine, requests, batch_size)`` runs every request to completion.
Requests arrive at decode steps (``Request.arrival``); each step admits those
that have arrived while rows are free, decodes one round for every row and
drops the rows that finished (a stop token or ``max_tokens``)::

    step:      0   1   2   3   4   5   6   7   8
    req 0:     P   d   d   d   d   x                 P prefill + join
    req 1:     P   d   d   d   d   d   d   x         d one decode round
    req 2:                 P   d   d   x             x finished, filtered out

A ``Request`` is a frozen record of what was asked; a ``Completion`` of what
came back (tokens, why it stopped, time to first token). The kvstate engines
(``KVStateEngine``, ``SpeculativeEngine``) are configurations of the one
scheduler, ``kvstate.serving.scheduler.Scheduler``, which the HTTP server
runs too; ``MlxLmEngine`` runs mlx-lm's own ``BatchGenerator`` on the same
requests, the reference ``kvstate generate --compare`` measures against.
Sampling is ``kv.sample`` with one PRNG key per request (a request's tokens
do not depend on which other rows share its batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import attrs
import mlx.core as mx

from .prefix_cache import PrefixCache
from .scheduler import DEFAULT_PREFILL_BUDGET, Job, Scheduler


@attrs.frozen
class Request:
    """One request: its prompt's token ids and how to sample its completion.

    ``arrival`` is the decode step at which it arrives; ``text`` is the
    prompt as the user wrote it (for display), ``stop`` the token ids that
    end it (the model's end of sequence).
    """

    id: int
    prompt: tuple
    max_tokens: int
    text: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    arrival: int = 0
    stop: tuple = ()


@attrs.frozen
class Completion:
    """What a request got: ``tokens`` (the stop token included when it ended at one),
    ``finish`` (``"stop"``, ``"length"``, or ``"error"`` with the reason in
    ``error``: a fault in its prefill or rounds ended it, the others went on),
    seconds from its arrival to its first token (``ttft``) and to its last
    (``seconds``)."""

    request: Request
    tokens: tuple
    finish: str
    ttft: float
    seconds: float
    error: str | None = None


Progress = Optional[Callable[[int, int, int], None]]  # progress(tokens, active, queued)


def serve(
    engine,
    requests: Sequence[Request],
    batch_size: int,
    *,
    on_finish: Callable[[Completion], None] | None = None,
    progress: Progress = None,
) -> tuple:
    """Run every request to completion.

    Args:
        engine: ``KVStateEngine``, ``SpeculativeEngine`` or ``MlxLmEngine``.
        requests: what to serve; at most ``batch_size`` rows are decoded at once,
            the rest wait for a row to leave.
        on_finish: called with each ``Completion`` as its request finishes.
        progress: called as ``progress(tokens, active, queued)`` after each step.

    Returns:
        ``(completions in the order of requests, stats)``; ``stats`` has
        ``seconds``, ``steps``, ``bytes_per_token`` (cache bytes resident over the
        tokens the rows hold, averaged over decode steps: padding and spare
        capacity included), and the two phases as mlx-lm's ``BatchGenerator``
        counts them: ``prompt_tokens_run`` and ``prefill_s`` (prompt tokens run
        through the model, and the wall time of the calls that run them and sample
        each row's first token), ``generated`` and ``decode_s`` (tokens emitted by
        decode rounds, and the wall time of those rounds). Under continuous
        batching the phases interleave; each call is timed on its own, so
        ``prefill_s + decode_s`` is at most ``seconds``.
    """
    return engine.serve(requests, batch_size, on_finish=on_finish, progress=progress)


class _Track:
    """What one request got so far (the ``emit`` of its job)."""

    def __init__(self, request: Request, on_done: Callable[[Completion], None]):
        self.request, self.on_done = request, on_done
        self.arrived = time.perf_counter()
        self.tokens: list = []
        self.ttft = 0.0

    def emit(self, kind: str, choice: int, value: Any) -> None:
        if kind == "token":
            if not self.tokens:
                self.ttft = time.perf_counter() - self.arrived
            self.tokens.append(value)
        else:  # "done", or "error" (the value is why)
            seconds = time.perf_counter() - self.arrived
            finish, error = (value, None) if kind == "done" else ("error", value)
            done = Completion(self.request, tuple(self.tokens), finish, self.ttft, seconds, error)
            self.on_done(done)


class _Run:
    """One ``serve`` call's bookkeeping: arrivals, completions, step count, stats."""

    def __init__(self, requests, on_finish, progress: Progress):
        self.pending = sorted(requests, key=lambda r: r.arrival)
        self.order = [r.id for r in requests]
        self.done: dict = {}
        self.on_finish, self.progress = on_finish, progress
        self.steps, self.tokens = 0, 0
        self.per_token: list = []
        self.phases: dict = {}
        self.start = time.perf_counter()

    def finish(self, c: Completion) -> None:
        self.done[c.request.id] = c
        if self.on_finish:
            self.on_finish(c)

    def arrived(self) -> list:
        """The requests whose arrival step has come, taken from the pending line."""
        out = []
        while self.pending and self.pending[0].arrival <= self.steps:
            out.append(self.pending.pop(0))
        return out

    def idle(self) -> None:
        """No row is active: jump to the next arrival."""
        self.steps = max(self.steps + 1, self.pending[0].arrival) if self.pending else self.steps

    def stepped(self, active: int, queued: int) -> None:
        self.steps += 1
        if self.progress:
            self.progress(self.tokens, active, queued + len(self.pending))

    def result(self) -> tuple:
        stats = {
            "seconds": time.perf_counter() - self.start,
            "steps": self.steps,
            "bytes_per_token": sum(self.per_token) / max(len(self.per_token), 1),
            **self.phases,
        }
        return [self.done[i] for i in self.order], stats


def _job(request: Request, run: _Run) -> Job:
    track = _Track(request, run.finish)

    def emit(kind, choice, value):
        run.tokens += kind == "token"
        track.emit(kind, choice, value)

    return Job(
        prompt=list(request.prompt),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        emit=emit,
        stop=frozenset(request.stop),
    )


# --- engines: configurations of the scheduler, and mlx-lm's BatchGenerator -----------


class _Timed(Scheduler):
    """The scheduler with its two phases timed, as mlx-lm's ``BatchGenerator`` times
    its own: ``prefill_s`` the wall time of admissions (prompt chunks run, first
    tokens sampled and read), ``decode_s`` that of rounds (every row's next tokens,
    read back, so the round has run on the device)."""

    prefill_s = decode_s = 0.0
    decoded = 0  # tokens handed out by rounds
    _rounding = 0  # 1 while a round runs: first tokens, handed out at admission, are not decode's

    def _admit(self, block: bool) -> None:
        t = time.perf_counter()
        try:
            super()._admit(block)
        finally:
            self.prefill_s += time.perf_counter() - t

    def _round(self) -> None:
        t, self._rounding = time.perf_counter(), 1
        try:
            super()._round()
        finally:
            self.decode_s += time.perf_counter() - t
            self._rounding = 0

    def _hand(self, job: Job, choice: int, tokens, lps=()) -> None:
        before = job.generated[choice]
        super()._hand(job, choice, tokens, lps)
        self.decoded += (job.generated[choice] - before) * self._rounding

    def phases(self) -> dict:
        """``serve``'s phase figures (``prompt_tokens_run``, ``prefill_s``,
        ``generated``, ``decode_s``)."""
        return {
            "prompt_tokens_run": self.stats["prefilled"],
            "prefill_s": self.prefill_s,
            "generated": self.decoded,
            "decode_s": self.decode_s,
        }


class KVStateEngine:
    """Rows are kvstate records, run by the scheduler (``Scheduler``).

    With a ``prefix_cache`` (a ``PrefixCache``; each run starts from a copy of
    its entries: none for a new cache, a document's for ``kvstate
    cache-prompt``'s file, so every run starts alike) each prompt reuses the
    longest cached prefix and prefills only the rest; rows then read the cached records without
    copying them. ``prompt_tokens``/``prefilled`` count the prompt tokens
    asked for and run in the last run; ``peak_bytes`` the most KV bytes
    resident (rows and cache, each shared record once). A model with
    sliding-window layers runs without the cache (rings do not share
    prefixes). ``compiled``: each round's forward compiled. ``make``:
    ``make_states`` options for the rows' records (``Scheduler``'s).
    """

    name = "kvstate"

    def __init__(
        self,
        model,
        compiled: bool = False,
        prefill_step_size: int = 512,
        prefix_cache=None,
        make: Optional[dict] = None,
        prefill_budget: Optional[int] = DEFAULT_PREFILL_BUDGET,
    ):
        self.model, self.compiled, self.prefill_step_size = model, compiled, prefill_step_size
        self.make = dict(make or {})
        self.prefill_budget = prefill_budget
        if compiled:
            self.name = "kvstate (compiled)"
        self.start_cache = prefix_cache  # each run starts from a copy of its entries
        self.reset()

    def reset(self) -> None:
        """Fresh counters."""
        self.cache: Optional[PrefixCache] = None
        self.prompt_tokens = self.prefilled = self.peak_bytes = 0
        self.drafted = self.accepted = 0

    def scheduler(self, batch_size: int, jobs: int) -> _Timed:
        """A scheduler of this configuration for one run (an empty prefix cache)."""
        cache = None if self.start_cache is None else self.start_cache.copy()
        return _Timed(
            self.model,
            (),
            max_batch=batch_size,
            max_queue=max(jobs, 1),
            prefix_cache=cache,
            compiled=self.compiled,
            prefill_step_size=self.prefill_step_size,
            prefill_budget=self.prefill_budget,
            measure=True,
            make=self.make,
        )

    def serve(self, requests, batch_size, *, on_finish=None, progress: Progress = None) -> tuple:
        """``serve(self, ...)``: the requests through one scheduler of this configuration."""
        run = _Run(requests, on_finish, progress)
        sched = self.scheduler(batch_size, len(requests))
        while run.pending or sched.active_rows or sched.queued:
            for r in run.arrived():
                sched.submit(_job(r, run))
            if not sched.step():
                run.idle()
                continue
            run.stepped(sched.active_rows, sched.queued)
        run.per_token, run.phases = sched.bytes_per_token, sched.phases()
        self._took(sched)
        return run.result()

    def _took(self, sched: Scheduler) -> None:
        """The run's counters, from its scheduler."""
        st = sched.stats
        self.cache = sched.prefix_cache  # the last run's prefix cache (None: none)
        self.prompt_tokens, self.prefilled = st["prompt_tokens"], st["prefilled"]
        self.peak_bytes = st["peak_bytes"]
        self.drafted, self.accepted = st["drafted"], st["accepted"]


class SpeculativeEngine(KVStateEngine):
    """Rows speculate (``kvstate.speculative``): each round drafts, verifies every
    row's window in one target forward and emits each row's accepted tokens.
    ``drafted`` and ``accepted`` count the draft tokens of the last run; the
    cost-aware ``window`` rule keeps what it measured across runs."""

    name = "kvstate (speculative)"

    def __init__(
        self,
        model,
        drafter,
        num_draft: int,
        prefill_step_size: int = 512,
        compiled: bool = False,
        window=None,
        make: Optional[dict] = None,
    ):
        super().__init__(model, compiled=compiled, prefill_step_size=prefill_step_size, make=make)
        self.name = "kvstate (speculative, compiled)" if compiled else "kvstate (speculative)"
        self.drafter, self.num_draft, self.window = drafter, num_draft, window

    def scheduler(self, batch_size: int, jobs: int) -> _Timed:
        return _Timed(
            self.model,
            (),
            max_batch=batch_size,
            max_queue=max(jobs, 1),
            drafter=self.drafter,
            num_draft=self.num_draft,
            window=self.window,
            compiled=self.compiled,
            prefill_step_size=self.prefill_step_size,
            measure=True,
            make=self.make,
        )

    def _took(self, sched: Scheduler) -> None:
        super()._took(sched)
        self.window = sched.window


class MlxLmEngine:
    """mlx-lm's own ``BatchGenerator`` on the same requests: the reference.

    Requests are inserted as they arrive (a generator step counts as a decode
    step); greedy rows sample with ``sample`` (the argmax), others with
    mlx-lm's ``make_sampler(temperature, top_p)`` (mlx-lm's random stream,
    so sampled tokens differ from kvstate's keyed ones). ``peak_bytes``:
    the most bytes resident in its caches.
    """

    name = "mlx-lm"

    def __init__(self, model, prefill_step_size: int = 512):
        self.model, self.prefill_step_size = model, prefill_step_size
        self.reset()

    def reset(self) -> None:
        self.peak_bytes = 0

    def sample(self, logprobs: mx.array) -> mx.array:
        """A greedy row's next token."""
        return mx.argmax(logprobs, axis=-1)

    def _sampler(self, request: Request):
        if request.temperature == 0:
            return self.sample
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(request.temperature, request.top_p)

    def serve(self, requests, batch_size, *, on_finish=None, progress: Progress = None) -> tuple:
        """``serve(self, ...)``: the requests through mlx-lm's ``BatchGenerator``."""
        from mlx_lm.generate import BatchGenerator

        run = _Run(requests, on_finish, progress)
        stops = sorted({t for r in requests for t in r.stop})
        gen = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in stops],
            completion_batch_size=batch_size,
            prefill_batch_size=batch_size,
            prefill_step_size=self.prefill_step_size,
        )
        tracks: dict = {}
        try:
            with gen.stats() as counted:
                while run.pending or tracks:
                    self._insert(gen, run, tracks)
                    if not tracks:
                        run.idle()
                        continue
                    _, generated = gen.next()
                    self._measure(gen, tracks, run)
                    self._emit(generated, tracks, run)
                    run.stepped(len(tracks), 0)
        finally:
            gen.close()
        run.phases = {  # mlx-lm's own counters (``BatchGenerator.stats``)
            "prompt_tokens_run": counted.prompt_tokens,
            "prefill_s": counted.prompt_time,
            "generated": counted.generation_tokens,
            "decode_s": counted.decode_time,
        }
        return run.result()

    def _insert(self, gen, run: _Run, tracks: dict) -> None:
        """Insert the requests that have arrived."""
        arrived = run.arrived()
        if arrived:
            uids = gen.insert(
                [list(r.prompt) for r in arrived],
                max_tokens=[r.max_tokens for r in arrived],
                samplers=[self._sampler(r) for r in arrived],
            )
            for uid, r in zip(uids, arrived):
                tracks[uid] = _Track(r, run.finish)

    def _emit(self, generated, tracks: dict, run: _Run) -> None:
        """Each response's token to its request; finished requests end."""
        for resp in generated:
            track = tracks[resp.uid]
            track.emit("token", 0, int(resp.token))
            run.tokens += 1
            if resp.finish_reason is not None:
                track.emit("done", 0, resp.finish_reason)
                del tracks[resp.uid]

    def _measure(self, gen, tracks: dict, run: _Run) -> None:
        """Bytes resident in its caches (mlx-lm's own count), and per token."""
        resident = gen.prompt_cache_nbytes
        self.peak_bytes = max(self.peak_bytes, resident)
        tokens = sum(len(t.request.prompt) + len(t.tokens) for t in tracks.values())
        run.per_token.append(resident / max(tokens, 1))
