"""Continuous batched generation: requests in, completions out.

One scheduler (``serve``) drives an *engine*, the cache side of generation.
Each decode step it admits the requests that have arrived (prefilled
together in one batch, then joined to the running batch), samples one token
for every active row, and drops the rows that finished (end of sequence or
``max_tokens``)::

    step:      0   1   2   3   4   5   6   7   8
    req 0:     P   d   d   d   d   x                 P prefill + join
    req 1:     P   d   d   d   d   d   d   x         d one decode step
    req 2:                 P   d   d   x             x finished, filtered out

A ``Request`` is a frozen record of what was asked; a ``Completion`` of what
came back (tokens, why it stopped, time to first token). Engines implement
``prefill``, ``join``, ``step``, ``leave`` and ``nbytes``: ``KVStateEngine``
on kvstate records through ``kvstate.mlx_lm``, ``MlxLmEngine`` on mlx-lm's
own batch caches the way its ``BatchGenerator`` drives them. Sampling is
``kv.sample`` with one PRNG key per request (a request's tokens do not
depend on which other rows share its batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import mlx.core as mx

from .. import sampling
from ..core.records import CacheState, QuantizedState


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
    ``finish`` (``"stop"`` or ``"length"``), seconds from its arrival to its first
    token (``ttft``) and to its last (``seconds``)."""

    request: Request
    tokens: tuple
    finish: str
    ttft: float
    seconds: float


class _Row:
    """Host bookkeeping of one active request (the scheduler's, never shared)."""

    __slots__ = ("request", "start", "tokens", "ttft")

    def __init__(self, request, start):
        self.request, self.tokens, self.start, self.ttft = request, [], start, None

    def done(self) -> bool:
        r = self.request
        return len(self.tokens) >= r.max_tokens or (bool(self.tokens) and self.tokens[-1] in r.stop)

    def extend(self, tokens):
        """Take the tokens a decode round emitted, up to the end of the request."""
        for t in tokens:
            if self.done():
                return
            self.tokens.append(t)


def serve(
    engine,
    requests: Sequence[Request],
    batch_size: int,
    *,
    on_finish: Callable[[Completion], None] | None = None,
    progress=None,
) -> tuple:
    """Run every request to completion.

    Args:
        engine: the cache side (``KVStateEngine`` or ``MlxLmEngine``).
        requests: what to serve; at most ``batch_size`` rows are decoded at once,
            the rest wait for a row to leave.
        on_finish: called with each ``Completion`` as its request finishes.
        progress: called as ``progress(tokens, active, queued)`` after each step.

    Returns:
        ``(completions in the order of requests, stats)``; ``stats`` has
        ``seconds``, ``steps`` and ``bytes_per_token`` (cache bytes over the
        tokens the rows hold, averaged over decode steps).
    """
    pending = sorted(requests, key=lambda r: r.arrival)
    done: dict = {}
    active: list = []
    batch, keys, t, per_tok = None, None, 0, []
    arrived: dict = {}
    start = time.perf_counter()

    def finish(row):
        c = Completion(
            row.request,
            tuple(row.tokens),
            "stop" if row.tokens[-1] in row.request.stop else "length",
            row.ttft,
            time.perf_counter() - row.start,
        )
        done[row.request.id] = c
        if on_finish:
            on_finish(c)

    while pending or active:
        now = time.perf_counter()
        for r in pending:
            if r.arrival > t:
                break
            arrived.setdefault(r.id, now)
        admit: list = []
        while pending and pending[0].arrival <= t and len(active) + len(admit) < batch_size:
            admit.append(pending.pop(0))
        if admit:
            logits, fresh = engine.prefill([list(r.prompt) for r in admit])
            first, fresh_keys = _sample(logits, sampling.row_keys([r.seed for r in admit]), admit)
            now = time.perf_counter()
            rows = [_Row(r, arrived[r.id]) for r in admit]
            for row, tok in zip(rows, first):
                row.tokens.append(tok)
                row.ttft = now - row.start
            joined = [i for i, row in enumerate(rows) if not row.done()]
            for row in rows:
                if row.done():
                    finish(row)
            if joined:
                if len(joined) < len(rows):
                    fresh = engine.leave(fresh, joined)
                    fresh_keys = fresh_keys[mx.array(joined)]
                batch = fresh if batch is None else engine.join(batch, fresh)
                keys = fresh_keys if keys is None else mx.concatenate([keys, fresh_keys])
                active += [rows[i] for i in joined]
            else:
                _drop(engine, fresh)
        if not active:  # idle until the next arrival
            t = max(t + 1, pending[0].arrival) if pending else t
            continue
        tokens = mx.array([row.tokens[-1] for row in active], dtype=mx.int32)
        requests_ = [row.request for row in active]
        if hasattr(engine, "decode"):  # several tokens per row and round (speculative)
            emitted, batch, keys = engine.decode(batch, tokens, keys, requests_)
        else:
            logits, batch = engine.step(batch, tokens)
            nxt, keys = _sample(logits, keys, requests_)
            emitted = [[tok] for tok in nxt]
        for row, toks in zip(active, emitted):
            row.extend(toks)
        held = sum(len(row.request.prompt) + len(row.tokens) - 1 for row in active)
        per_tok.append(engine.nbytes(batch) / held)
        keep = [i for i, row in enumerate(active) if not row.done()]
        for row in active:
            if row.done():
                finish(row)
        if len(keep) < len(active):
            active = [active[i] for i in keep]
            if keep:
                batch = engine.leave(batch, keep)
            else:
                _drop(engine, batch)
                batch = None
            keys = keys[mx.array(keep)] if keep else None
        t += 1
        if progress:
            progress(
                sum(len(c.tokens) for c in done.values()) + sum(len(row.tokens) for row in active),
                len(active),
                len(pending),
            )
    stats = {
        "seconds": time.perf_counter() - start,
        "steps": t,
        "bytes_per_token": sum(per_tok) / max(len(per_tok), 1),
    }
    return [done[r.id] for r in requests], stats


def _drop(engine, batch) -> None:
    """Every row of ``batch`` leaves: an engine holding per-row resources (prefix-cache
    leases) releases them (``engine.drop``); ``None`` is the empty batch."""
    drop = getattr(engine, "drop", None)
    if drop is not None:
        drop(batch)
    return None


def _sample(logits, keys, requests) -> tuple:
    """Each row's next token (host ints) and next key, with its request's settings."""
    params = None  # every row greedy: no key is used or advanced
    if any(r.temperature != 0 for r in requests):
        params = sampling.parameters(
            len(requests),
            temperature=[r.temperature for r in requests],
            top_p=[r.top_p for r in requests],
        )
    tokens, keys = sampling.next_tokens(logits, keys, params)
    return tokens.tolist(), keys


# --- engines: kvstate records, and mlx-lm's own caches --------------------------------


class _Leased(list):
    """A batch's records (one per layer) and, per row, the prefix-cache lease
    it holds (``None`` for none): leases leave with their rows."""

    __slots__ = ("leases",)

    def __init__(self, records, leases):
        super().__init__(records)
        self.leases = list(leases)


class KVStateEngine:
    """Rows are kvstate records, driven through ``kvstate.mlx_lm``.

    ``prefill`` runs the admitted prompts as one batch
    (``kvstate.mlx_lm.prefill``: right-padded, chunked, padding trimmed).
    With a ``prefix_cache`` (a ``kvstate.serving.prefix_cache.PrefixCache``) each
    prompt reuses the longest cached prefix instead and runs only the rest
    (``kvstate.serving.prefix_cache.prefill``); rows are then ``SharedState``s that
    read the cached records without copying them, and each row pins its
    entry until it leaves. ``prompt_tokens``/``prefilled`` count the prompt
    tokens asked for and run; ``peak_bytes`` the most KV bytes held (rows
    and cache, each shared record once). A model with sliding-window layers
    runs without the cache (rings do not share prefixes).
    """

    name = "kvstate"

    def __init__(
        self, model, compiled: bool = False, prefill_step_size: int = 512, prefix_cache=None
    ):
        from .. import mlx_lm as bridge

        self.model, self.bridge, self.prefill_step_size = model, bridge, prefill_step_size
        self._step: Callable[..., tuple] = bridge.step  # or a compiled step, same call
        if compiled:
            self._step = bridge.make_step(model)  # step(model, tokens, states) -> (logits, states)
            self.name = "kvstate (compiled)"
        self.budget = None if prefix_cache is None else prefix_cache.max_bytes
        if self.budget is not None and not all(
            type(s) in (CacheState, QuantizedState) for s in bridge.make_states(model, 1)
        ):
            self.budget = None  # sliding-window rings do not share prefixes (notes/kinds.md)
        self.reset()

    def reset(self):
        """Fresh counters, and an empty prefix cache of the same budget."""
        from .prefix_cache import PrefixCache

        self.cache = None if self.budget is None else PrefixCache(self.budget)
        self.prompt_tokens = self.prefilled = self.peak_bytes = 0

    def prefill(self, prompts):
        self.prompt_tokens += sum(map(len, prompts))
        if self.cache is None:
            self.prefilled += sum(map(len, prompts))
            return self.bridge.prefill(
                self.model, prompts, prefill_step_size=self.prefill_step_size
            )
        from .prefix_cache import prefill

        logits, states, leases, ran = prefill(
            self.model, prompts, self.cache, prefill_step_size=self.prefill_step_size
        )
        self.prefilled += sum(ran)
        return logits, _Leased(states, leases)

    def join(self, batch, rows):
        joined = self.bridge.extend(batch, rows)
        if self.cache is None:
            return joined
        return _Leased(joined, batch.leases + rows.leases)

    def step(self, batch, tokens):
        logits, states = self._step(self.model, tokens, batch)
        return logits, (states if self.cache is None else _Leased(states, batch.leases))

    def leave(self, batch, keep):
        kept = self.bridge.filter_rows(batch, keep)
        if self.cache is None:
            return kept
        stay = set(keep)
        for i, lease in enumerate(batch.leases):
            if i not in stay and lease is not None:
                lease.release()
        return _Leased(kept, [batch.leases[i] for i in keep])

    def drop(self, batch):
        """Release the leases of every row of ``batch`` (they all leave)."""
        for lease in getattr(batch, "leases", ()):
            if lease is not None:
                lease.release()

    def nbytes(self, batch):
        from ..kinds.shared import held_bytes

        held = held_bytes(list(batch) + ([] if self.cache is None else self.cache.records()))
        self.peak_bytes = max(self.peak_bytes, held)
        return held


class MlxLmEngine:
    """Rows are mlx-lm's batch caches, driven as its ``BatchGenerator`` drives them.

    ``prefill``: mlx-lm's ``PromptProcessingBatch`` on every prompt but its
    last token (right-padded, chunked, then turned into left padding), then
    the last tokens as one decode step; models with sliding-window layers
    run each whole prompt alone and merge the caches, as kvstate does for
    them (``kvstate.mlx_lm.prefill``). ``join`` and ``leave`` are mlx-lm's
    in-place ``extend`` and ``filter``.
    """

    name = "mlx-lm"

    def __init__(self, model, prefill_step_size: int = 512):
        from mlx_lm.models import cache

        self.model, self.cache, self.prefill_step_size = model, cache, prefill_step_size
        self.rings = any(
            isinstance(c, cache.RotatingKVCache) for c in cache.make_prompt_cache(model)
        )

    def prefill(self, prompts):
        if self.rings:
            rows = []
            for p in prompts:
                caches = self.cache.make_prompt_cache(self.model)
                rows.append((self.model(mx.array([p]), cache=caches)[:, -1, :], caches))
            merged = [type(cs[0]).merge(list(cs)) for cs in zip(*(c for _, c in rows))]
            return mx.concatenate([lg for lg, _ in rows]), merged
        from mlx_lm.generate import PromptProcessingBatch

        batch = PromptProcessingBatch(
            self.model,
            list(range(len(prompts))),
            [self.cache.make_prompt_cache(self.model) for _ in prompts],
            prefill_step_size=self.prefill_step_size,
        )
        if any(len(p) > 1 for p in prompts):
            batch.prompt([p[:-1] for p in prompts])
        caches = batch.prompt_cache
        last = mx.array([[p[-1]] for p in prompts], dtype=mx.int32)
        return self.model(last, cache=caches)[:, -1, :], caches

    def join(self, batch, rows):
        for b, r in zip(batch, rows):
            b.extend(r)  # in place, as mlx-lm's BatchGenerator does
        return batch

    def step(self, batch, tokens):
        return self.model(tokens[:, None], cache=batch)[:, -1, :], batch

    def leave(self, batch, keep):
        for b in batch:
            b.filter(mx.array(keep))
        return batch

    def nbytes(self, batch):
        held = sum(c.nbytes for c in batch)
        self.peak_bytes = max(getattr(self, "peak_bytes", 0), held)
        return held

    def reset(self):
        self.peak_bytes = 0


def _read_later(r):
    """A round's emitted tokens per row, read when first iterated: after ``serve``
    has dropped the old batch, so that a plain round's appends write in place
    (``kvstate.speculative._Read``)."""
    for e in r.emitted:
        yield list(e)


class SpeculativeEngine:
    """Rows speculate (``kvstate.speculative``): each round drafts, verifies every
    row's window in one target forward and emits each row's accepted tokens.

    The scheduler's pending tokens, keys and requests are the truth: ``decode``
    puts them into the ``Speculation`` (a row just prefilled gets its first
    token there) and returns several tokens per row. ``drafted`` and
    ``accepted`` count the draft tokens over a run.
    """

    name = "kvstate (speculative)"

    def __init__(
        self,
        model,
        drafter,
        num_draft: int,
        prefill_step_size: int = 512,
        compiled: bool = False,
        window=None,
    ):
        from .. import mlx_lm as bridge
        from ..speculative import rounds as speculative

        self.model, self.bridge, self.sp = model, bridge, speculative
        # the cost-aware window rule and what it measured: kept across batches
        self.window = window
        self.drafter, self.num_draft, self.prefill_step_size = drafter, num_draft, prefill_step_size
        self.forward = speculative.compiled(model) if compiled else None
        if compiled:
            self.name = "kvstate (speculative, compiled)"
        self.drafted = self.accepted = self.peak_bytes = 0

    def prefill(self, prompts):
        bridge, sp = self.bridge, self.sp
        logits, states = bridge.prefill(
            self.model, prompts, prefill_step_size=self.prefill_step_size
        )
        draft = None
        if isinstance(self.drafter, sp.DraftModel):
            _, draft = bridge.prefill(
                self.drafter.model, prompts, prefill_step_size=self.prefill_step_size
            )
        B = len(prompts)
        batch = sp.Batch(states, mx.zeros((B,), mx.uint32))
        return logits, sp.Speculation(
            batch, prompts, (self.num_draft,) * B, (self.num_draft,) * B, draft, self.window
        )

    def join(self, batch, rows):
        return self.sp.join(batch, rows)

    def leave(self, batch, keep):
        return self.sp.leave(batch, keep)

    def decode(self, spec, tokens, keys, requests):
        sp = self.sp
        pending = tokens.tolist()
        context = [
            c if len(c) > len(r.prompt) else c + (t,)
            for c, t, r in zip(spec.context, pending, requests)
        ]
        params = [sampling.Sampling(temperature=r.temperature, top_p=r.top_p) for r in requests]
        if keys is None:
            keys = sampling.row_keys([r.seed for r in requests])
        batch = attrs.evolve(
            spec.batch, tokens=tokens.astype(mx.uint32), keys=keys, sampling=params
        )
        spec = attrs.evolve(spec, batch=batch, context=context)
        spec, r = sp.step(self.model, spec, drafter=self.drafter, forward=self.forward)
        self.window = spec.window
        self.drafted += sum(r.drafted)
        self.accepted += sum(r.accepted)
        return _read_later(r), spec, spec.batch.keys

    def nbytes(self, spec):
        held = sum(s.nbytes for s in spec.states) + sum(s.nbytes for s in (spec.draft_states or ()))
        self.peak_bytes = max(self.peak_bytes, held)
        return held

    def reset(self):
        self.drafted = self.accepted = self.peak_bytes = 0
