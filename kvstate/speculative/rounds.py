"""Batched speculative decoding with per-row acceptance, over bridge models.

mlx-lm speculates one stream at a time (its batch cache has one write index
and one ``trim`` for all rows). kvstate rows advance and roll back on their
own, so every row of a batch can speculate with its own draft length and
keep its own accepted count. One round (``step``)::

    row 0:  y  d1 d2 d3 d4        verify window: the unfed token y, then the draft
    row 1:  y  d1 .  .  .         (shorter drafts are padded; the pad is rolled back)
    row 2:  y  .  .  .  .         no draft: this row takes a plain step

    cp = checkpoint(states); logits, states = forward(target, window, states)
    accepted[b] = leading drafts the target agrees with (greedy or the rejection rule)
    states = rollback(states, cp, 1 + accepted)   # y and the accepted drafts stay
    row b emits d1..d_accepted[b] and the target's own next token (the new y)

The rows are a ``kv.Batch`` (``kvstate.mlx_lm.admit``) plus each row's
context and draft length: the target's records hold every context token but
the last, which is the batch's pending token (the next round's ``y``). Rows
join (``join``) and leave (``leave``) between rounds, each with its own draft
limit and its own ``kv.Sampling``. A round in which no row drafts is a plain
decode step (a window of one token).

Greedy rows (temperature 0) in float32 emit exactly the plain loop's tokens;
sampled rows use the standard rejection rule (accept draft ``x`` with
probability ``min(1, p(x)/q(x))``, else sample ``max(p - q, 0)``) with the
distribution ``kv.sample`` draws from, so their output has the target's
distribution. Decisions: ``notes/speculative.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Union, cast

import attrs
import mlx.core as mx

from .. import mlx_lm as bridge
from ..batch import Batch, sampling_arrays
from ..bridge.decoder import Decoder
from ..core import ops
from ..core.args import PerRowInts, per_row, row_list
from ..core.records import _tuple, derived, forwarded
from ..errors import bad, check
from ..sampling import (
    GREEDY_BELOW,
    Sampling,
    apply_bitmask,
    filter_logprobs,
    next_tokens,
    sample_arrays,
    split_keys,
    tempered,
)
from .drafts import DraftModel, Lookup, lookup, validate_drafter
from .window import Window, bucket, expected_accepted

if TYPE_CHECKING:
    from ..bridge.shells import Model

Drafter = Union[Lookup, DraftModel, None]  # what proposes each round's drafts

Forward = Callable  # (tokens [B, N], states) -> (logits [B, N, V], states)


class _Read:
    """A plain round's next tokens ``[B]``: read to the host once, when first needed.

    A plain round does not wait for the device inside ``step``: the caller drops
    the round's input records first (``spec, r = step(model, spec)``), so the
    device appends to them in place, as in a plain decode loop (waiting inside
    ``step`` would make every layer's append copy its record: ~0.5 ms a round on
    the H200 at B = 1). The tokens are read when ``Round.emitted`` or
    ``Speculation.context`` is, or by the next drafting ``step``, or by the
    ``step`` after next, whichever comes first: a caller that builds the next
    round before reading this one (``pipelined``) overlaps the host's graph
    building with the device, as a plain decode loop with ``mx.async_eval`` does.

    ``seconds`` is then the round's wall time: from its start, or from the
    previous round's tokens read when that came later (``after``: rounds
    overlapped, so a round is charged the interval between two reads, its
    throughput), to its tokens read.
    """

    __slots__ = ("tokens", "start", "B", "after", "_host", "seconds", "done")
    drafted: ClassVar[bool] = False  # a round in ``Speculation.unrecorded``: a plain one

    def __init__(self, tokens: mx.array, start: float, B: int, after: _Read | None = None):
        self.tokens, self.start, self.B, self.after = tokens, start, B, after
        self._host: tuple | None = None
        self.seconds = self.done = 0.0

    @property
    def read(self) -> bool:
        return self._host is not None

    def host(self) -> tuple:
        """The tokens as ints (the round's one sync, the first time)."""
        if self._host is None:
            begin = self.start
            if self.after is not None:  # the previous round first: its read ends where ours begins
                self.after.host()
                begin = max(begin, self.after.done)
                self.after = None
            mx.eval(self.tokens)
            self._host = tuple(cast(list, self.tokens.tolist()))
            self.done = time.perf_counter()
            self.seconds = self.done - begin
        return self._host


class _Context:
    """Rows' contexts with the tokens of the plain rounds since they were last built
    as tuples not appended yet: a ``Speculation.context`` that appends them (reading
    the last, ``_Read``, when nothing read it) when first looked at. ``before`` is the
    rows' contexts before those rounds (a tuple), ``reads`` the rounds (``_Read``s,
    oldest first; all but the last read, ``_settled``). A run of plain rounds appends
    its tokens to the whole contexts once (``rows``), not once a round: a context's
    tuple is ``O(len)`` to build."""

    __slots__ = ("before", "reads", "_rows")

    def __init__(self, before: tuple, reads: tuple):
        self.before, self.reads = before, reads
        self._rows: tuple | None = None

    @property
    def read(self) -> _Read:
        """The last plain round (its tokens maybe unread)."""
        return self.reads[-1]

    def __len__(self) -> int:
        return len(self.before)

    def rows(self) -> tuple:
        if self._rows is None:
            new = zip(*(r.host() for r in self.reads))  # per row, its tokens since before
            self._rows = tuple(c + t for c, t in zip(self.before, new))
        return self._rows

    def known(self) -> tuple:
        """The contexts less the last round's token (read or not)."""
        if len(self.reads) == 1:
            return self.before
        return _Context(self.before, self.reads[:-1]).rows()

    def then(self, read: _Read) -> _Context:
        """These contexts and one more plain round's tokens (after the tuples, where
        a round built them: a lookup's)."""
        if self._rows is not None:
            return _Context(self._rows, (read,))
        return _Context(self.before, self.reads + (read,))


def _contexts(c) -> tuple | _Context:
    return c if isinstance(c, _Context) else tuple(tuple(r) for r in c)


@attrs.frozen
class Speculation:
    """A batch of rows in flight (data only; ``step``, ``join``, ``leave`` make new ones).

    Attributes:
        batch: the target's ``kv.Batch``: its records hold ``context[b][:-1]``,
            its pending ``tokens`` are each row's last context token, and its
            per-row sampling parameters and PRNG keys drive drafting and
            verification.
        context: per row, every token so far (prompt, then output).
        num_draft: per row, how many tokens the next round drafts at most.
        max_draft: per row, the limit ``num_draft`` adapts under.
        draft_states: the draft model's records (one per layer, holding
            ``context[b][:-1 - draft_lag[b]]``), or ``None`` without one.
        window: the cost-aware window rule (``kvstate.speculative.window.Window``) and
            the round costs it measured; ``None``: every row drafts its
            ``num_draft`` (adapted by ``next_num_draft``).
        seen: per row, its decayed ``(accepted, tried)`` drafts (``Window.alpha``).
        draft_lag: per row, context tokens the draft model has not been fed
            (plain rounds do not run it; the next drafting round feeds them).
        unrecorded: the last rounds whose costs the window rule has not recorded
            yet: plain rounds with their tokens unread (``step`` records each once
            read) and a drafting round, priced once the round after it is read.
    """

    batch: Batch
    _context: tuple | _Context = attrs.field(alias="context", converter=_contexts)
    num_draft: tuple = attrs.field(converter=_tuple)
    max_draft: tuple = attrs.field(converter=_tuple)
    draft_states: tuple | None = attrs.field(
        default=None, converter=lambda s: None if s is None else tuple(s)
    )
    window: Window | None = None
    seen: tuple = attrs.field(
        default=attrs.Factory(lambda self: ((0.0, 0.0),) * len(self._context), takes_self=True),
        converter=lambda s: tuple(tuple(x) for x in s),
    )
    draft_lag: tuple = attrs.field(
        default=attrs.Factory(lambda self: (0,) * len(self._context), takes_self=True),
        converter=_tuple,
    )

    unrecorded: tuple = attrs.field(default=(), eq=False, repr=False)

    @property
    def context(self) -> tuple:
        """Per row, every token so far (prompt, then output): a plain round's
        last token is read from the device here if nothing read it yet."""
        c = self._context
        return c if isinstance(c, tuple) else c.rows()

    @property
    def batch_size(self) -> int:
        return len(self._context)

    @property
    def lengths(self) -> tuple:
        """Per row, the length of its context, without reading a plain round's
        tokens from the device (``context`` would wait for it)."""
        c = self._context
        if isinstance(c, tuple):
            return tuple(map(len, c))
        if c._rows is not None:
            return tuple(map(len, c._rows))
        return tuple(len(b) + len(c.reads) for b in c.before)

    states = forwarded("batch.states", "The target's records.")


@attrs.frozen
class Round:
    """What one round did, per row: tokens emitted, drafted and accepted."""

    _emitted: tuple | _Read = attrs.field(alias="emitted")
    drafted: tuple
    accepted: tuple
    width: int  # the verify window (1 + the longest draft; wider when padded: Window.pad)

    @property
    def emitted(self) -> tuple:
        """Per row, the tokens the round emitted (a plain round's are read here
        from the device if nothing read them yet)."""
        e = self._emitted
        return e if isinstance(e, tuple) else tuple((t,) for t in e.host())

    @property
    def unread(self) -> mx.array | None:
        """A plain round's next tokens ``[B]`` on the device while nothing has read
        them yet (a caller may ``mx.async_eval`` them, then build the next round
        before reading these: ``step``'s pipelining); ``None`` once read, or for a
        drafting round (read inside ``step``)."""
        e = self._emitted
        return None if isinstance(e, tuple) or e.read else e.tokens


# --- distributions and the acceptance rules ------------------------------------------


def probabilities(
    logits: mx.array, temperature: mx.array, top_p: mx.array, top_k: mx.array, min_p: mx.array
) -> mx.array:
    """The distribution ``kv.sample_arrays`` draws from, per row and position.

    ``logits`` ``[B, V]`` or ``[B, N, V]``; the parameters ``[B]``, one per row
    (``kvstate.batch.sampling_arrays``). A row at temperature 0 (below
    ``kvstate.sampling.GREEDY_BELOW``) gets the one-hot of its argmax (the greedy
    sampler, as a distribution); other rows the softmax of their filtered
    log-probabilities over the temperature (``kvstate.sampling.tempered``).
    """
    shape = logits.shape
    B, V = shape[0], shape[-1]
    N = 1 if logits.ndim == 2 else shape[1]
    x = logits.astype(mx.float32).reshape(B * N, V)
    t, tp, tk, mp = (mx.repeat(a, N, axis=0) for a in (temperature, top_p, top_k, min_p))
    kept = filter_logprobs(x - mx.logsumexp(x, axis=-1, keepdims=True), tp, tk, mp)
    greedy, scaled = tempered(kept, t)
    soft = mx.softmax(scaled, axis=-1)
    hard = (mx.arange(V)[None, :] == mx.argmax(x, axis=-1)[:, None]).astype(mx.float32)
    return mx.where(greedy[:, None], hard, soft).reshape(shape)


def accept_greedy(drafts: Sequence[Sequence[int]], target: Sequence[Sequence[int]]) -> tuple:
    """Greedy verification: per row, the leading drafts equal to the target's argmax.

    Args:
        drafts: per row, its draft tokens ``d_1..d_k``.
        target: per row, the target's argmax at each window position (at
            least ``k + 1``: position ``i`` predicts the token after ``d_i``).

    Returns:
        ``(accepted, next_tokens)``: per row the accepted count ``a`` and the
        target's token after the accepted drafts (``target[b][a]``).
    """
    accepted, nxt = [], []
    for d, t in zip(drafts, target):
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        accepted.append(a)
        nxt.append(int(t[a]))
    return tuple(accepted), tuple(nxt)


def accept_sampled(
    drafts: mx.array,
    counts: mx.array,
    p: mx.array,
    q: mx.array | None,
    uniform: mx.array,
    keys: mx.array,
) -> tuple:
    """The rejection rule of speculative sampling, for every row at once.

    Draft ``i`` of row ``b`` is accepted with probability
    ``min(1, p_i(x) / q_i(x))`` (``uniform * q < p``) while every earlier one
    was; at the first rejection the next token is drawn from
    ``max(p_i - q_i, 0)`` (normalized), and when all ``counts[b]`` drafts are
    accepted, from ``p`` after them. Each emitted token then has the target's
    distribution. With one-hot ``p`` and ``q`` (greedy rows) this is greedy
    verification.

    Args:
        drafts: int32 ``[B, K]`` draft tokens (columns past ``counts[b]`` are ignored).
        counts: int32 ``[B]``: drafts per row, ``<= K``.
        p: ``[B, K + 1, V]`` the target's probabilities at each window position.
        q: ``[B, K, V]`` the draft's probabilities, or ``None`` for a
            deterministic draft (prompt lookup: ``q`` is one-hot at the draft).
        uniform: ``[B, K]`` uniform draws in ``[0, 1)``.
        keys: ``[B, 2]`` uint32, one PRNG key per row for the next token.

    Returns:
        ``(accepted, next_token)``: ``[B]`` arrays.
    """
    B, K = drafts.shape
    accepted = mx.zeros((B,), mx.int32)
    q_a = mx.zeros_like(p[:, 0])
    if K:
        px = mx.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]
        qx = 1.0 if q is None else mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        ok = (uniform * qx < px) & (mx.arange(K)[None, :] < counts[:, None])
        accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
        at = mx.minimum(accepted, K - 1)
        if q is None:
            x = mx.take_along_axis(drafts, at[:, None], axis=1)  # [B, 1]
            q_a = (mx.arange(p.shape[-1])[None, :] == x).astype(p.dtype)
        else:
            q_a = mx.take_along_axis(q, at[:, None, None], axis=1)[:, 0]
        q_a = mx.where((accepted < counts)[:, None], q_a, 0.0)
    p_a = mx.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    r = mx.maximum(p_a - q_a, 0.0)
    r = mx.where(r.sum(axis=-1, keepdims=True) > 0, r, p_a)  # p == q: nothing to correct
    ones = mx.ones((B,), mx.float32)
    nxt, _ = sample_arrays(mx.log(r), keys, ones, ones, mx.zeros((B,), mx.int32), 0 * ones)
    return accepted, nxt


# --- forward functions --------------------------------------------------------------


def eager(model: Model) -> Forward:
    """``(tokens, states) -> (logits [B, N, V], states)`` through ``kvstate.mlx_lm.forward``."""
    return lambda tokens, states: bridge.forward(model, tokens, states)


def compiled(model: Model) -> Forward:
    """The same through one ``kvstate.mlx_lm.Decoder`` (one trace per window width
    and capacity bucket)."""
    decoder = Decoder(model)

    def run(tokens, states):
        return decoder(tokens, states)

    run.decoder = decoder  # type: ignore[attr-defined]  # a function attribute
    return run


# --- the batch: start, join, leave -----------------------------------------------------


def start(
    target: Model,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Drafter = None,
    num_draft: int | Sequence[int] = 4,
    window: Window | None = None,
    sampling: Sampling | Sequence[Sampling] | None = None,
    seeds: Sequence[int] | None = None,
    ids: Sequence[Any] | None = None,
    payload: Sequence[Any] | None = None,
    **make: Any,
) -> Speculation:
    """Prefill ``prompts`` and sample every row's first token (``kvstate.mlx_lm.admit``).

    Args:
        target: the mlx-lm model whose output is kept.
        prompts: token ids per row.
        drafter: ``None``, ``Lookup()`` or ``DraftModel(model)``; a draft
            model is prefilled on the prompts too.
        num_draft: most drafted tokens per row per round (int or one per row).
        window: ``Window()`` chooses each round's width from measured cost and
            each row's running acceptance (``notes/speculative.md``); ``None``:
            every row drafts up to its adapted ``num_draft`` each round.
        sampling, seeds, ids, payload: per-row data of the ``kv.Batch``
            (default greedy, seeds ``0 .. B-1``).
        make: ``make_states`` options for the target's records.
    """
    drafter = validate_drafter(drafter)
    check(len(prompts) >= 1, "prompts", "at least one prompt", "none")
    if window is not None and not isinstance(window, Window):
        raise bad("window", "None or a kvstate.speculative.Window", type(window).__name__)
    limit = per_row(num_draft, len(prompts), "num_draft")
    batch = bridge.admit(
        target, prompts, sampling=sampling, seeds=seeds, ids=ids, payload=payload, **make
    )
    draft_states = None
    if isinstance(drafter, DraftModel):
        _, draft_states = bridge.prefill(drafter.model, prompts, **drafter.make)
    first = cast(list, batch.tokens.tolist())  # [B]
    return Speculation(
        batch, [list(p) + [t] for p, t in zip(prompts, first)], limit, limit, draft_states, window
    )


def join(spec: Speculation, *others: Speculation) -> Speculation:
    """``others``' rows join after ``spec``'s, in order (one ``kv.merge_rows`` of the
    batches and of the draft records, however many join: each merge copies the
    rows' records).

    The batch keeps ``spec``'s window rule and measured costs (else the first of
    ``others`` that has one) and ``spec``'s last rounds still to record."""
    check(len(others) >= 1, "others", "at least one Speculation to join", 0)
    for i, other in enumerate(others):
        check(
            (spec.draft_states is None) == (other.draft_states is None),
            f"others[{i}].draft_states",
            "draft records exactly when spec has them",
            other.draft_states is not None,
        )
    every = (spec, *others)
    drafts = None
    if spec.draft_states is not None:
        drafts = ops.merge_rows([s.draft_states for s in every])
    rule = next((s.window for s in every if s.window is not None), None)

    def cat(name):
        return tuple(x for s in every for x in getattr(s, name))

    return Speculation(
        ops.merge_rows([s.batch for s in every]),
        cat("context"),
        cat("num_draft"),
        cat("max_draft"),
        drafts,
        rule,
        cat("seen"),
        cat("draft_lag"),
        spec.unrecorded,  # its own B: recorded by the next step as measured
    )


def leave(spec: Speculation, rows: PerRowInts) -> Speculation:
    """Keep ``rows`` (in that order); the others leave."""
    rows = row_list(rows, spec.batch_size)
    drafts = None
    if spec.draft_states is not None:
        drafts = ops.filter_rows(spec.draft_states, rows)

    def pick(t):
        return tuple(t[r] for r in rows)

    return Speculation(
        ops.filter_rows(spec.batch, rows),
        pick(spec.context),
        pick(spec.num_draft),
        pick(spec.max_draft),
        drafts,
        spec.window,
        pick(spec.seen),
        pick(spec.draft_lag),
        spec.unrecorded,
    )


# --- one round ---------------------------------------------------------------------------


def next_num_draft(k: int, drafted: int, accepted: int, limit: int) -> int:
    """The row's next draft length: two more after a fully accepted draft, one
    fewer after a rejection (at least 1), unchanged when nothing was drafted."""
    if drafted == 0:
        return k
    if accepted == drafted:
        return min(k + 2, limit)
    return max(k - 1, 1)


def _width(rule: Window | None, B: int, K: int, widest: int, entry: bool) -> int:
    """The verify window of a round whose longest draft is ``K``: ``1 + K``, or wider
    where the rule measured a wider width cheaper (``Window.pad``)."""
    return 1 + K if rule is None or K == 0 else rule.pad(B, 1 + K, widest, entry)


def _propose_lookup(
    context: tuple, drafter: Lookup, asked: Sequence[int], min_ngram: int | None = None
) -> list:
    lo = drafter.min_ngram if min_ngram is None else min_ngram
    return [
        lookup(c, k, max_ngram=drafter.max_ngram, min_ngram=lo) if k else []
        for c, k in zip(context, asked)
    ]


def _ride(rows, late: bool, drafter: Lookup, ride: list, host: list, guess: list | None) -> tuple:
    """Rows riding in a round's paid columns: each row with ``ride[b] > 0`` (no draft
    of its own) takes up to that many tokens from a lookup down to ``ride_ngram``
    (a shorter, weaker match: it costs nothing where the window is wide anyway).
    Returns ``(host, guess, riders)``: the drafts, the late guesses (``None`` when not
    late) and per row whether it rides."""
    if late:
        extra, more = _propose_late(rows, drafter, ride, drafter.ride_ngram)
        base = guess if guess is not None else [None] * len(host)
        guess = [m if r else g for g, m, r in zip(base, more, ride)]
    else:
        extra = _propose_lookup(_rows(rows), drafter, ride, drafter.ride_ngram)
    host = [e if r else d for d, e, r in zip(host, extra, ride)]
    return host, guess, tuple(bool(r and e) for e, r in zip(extra, ride))


def _propose_late(
    rows: _Context, drafter: Lookup, asked: Sequence[int], min_ngram: int | None = None
) -> tuple:
    """Lookup one round late: ``(drafts, guesses)`` from each row's context less its
    last token (a pipelined plain round's, still on the device: nothing is read).
    A row's lookup of ``k + 1`` tokens guesses that last token (its first) and
    drafts the ``k`` after it; the drafts count only where the guess was right,
    which ``step`` checks once it has read the token (the verify is built by then).
    A row with no guess (a lookup of fewer than two tokens) drafts nothing."""
    found = _propose_lookup(rows.known(), drafter, [k + 1 if k else 0 for k in asked], min_ngram)
    return [f[1:] for f in found], [f[0] if len(f) > 1 else None for f in found]


def _confirmed(host: list, found: tuple, guess: list, rows: tuple) -> tuple:
    """``(host, found)`` once a late lookup's guesses (``_propose_late``) can be checked
    against the rows' last tokens, read: a row whose guess was wrong drafted nothing
    (its drafts, already in the verify window, ride as pad and are rolled back)."""
    hit = [g == c[-1] for g, c in zip(guess, rows)]
    host = [d if h else [] for d, h in zip(host, hit)]
    return host, tuple(f if h else 0 for f, h in zip(found, hit))


CATCH_UP = 8  # the draft model's catch-up block width (``_catch_up``)


def _catch_up(drafter: DraftModel, spec: Speculation, context: tuple, tail: int = 1) -> list:
    """The draft records fed each row's lagged context tokens (the plain rounds'
    tokens) in blocks of ``CATCH_UP`` columns, right-padded, each block's pad rolled
    back. ``context``: each row's tokens but its last ``tail`` (1: the context; 0:
    the context less its last token, a pipelined round's still unread: the records
    never hold that token before the round, it is the first draft step's input, so
    it need not be read).

    Every block is ``[B, CATCH_UP]``, whatever the lag: every new block shape is a
    new kernel set for the device (graph tracing, kernel selection, on CUDA
    first-use compilation: the H200 took 29.8 s for the draft model's first
    ``[8, 64]`` block and 12.6 ms for the next), and a lag can take any value. One
    width is one compilation per batch size; a lag past ``CATCH_UP`` (the draft model
    not paying: plain rounds for a while) takes one more forward per ``CATCH_UP``
    tokens, milliseconds against a compilation's seconds. A lag after a drafting
    round is a few plain rounds: one block. Decision: ``notes/speculative.md``.
    """
    assert spec.draft_states is not None  # a model drafter's rows: start/join fill them
    states, lag = list(spec.draft_states), spec.draft_lag
    for start in range(0, max(lag), CATCH_UP):
        counts = [max(0, min(CATCH_UP, n - start)) for n in lag]
        block = mx.array(
            [
                list(c[len(c) - tail - n + start : len(c) - tail - n + start + k])
                + [0] * (CATCH_UP - k)
                for c, n, k in zip(context, lag, counts)
            ],
            dtype=mx.uint32,
        )
        cp = ops.checkpoint(states)
        _, fed = bridge.forward(drafter.model, block, states)
        full = min(counts) == CATCH_UP
        states = fed if full else bridge.rollback(drafter.model, fed, cp, counts, block)
    return states


def _propose_model(spec: Speculation, drafter: DraftModel, states, K, params, keys, sampled):
    """Draft ``K`` tokens for every row, one draft step each, sampled with each
    row's own parameters and keys (``keys`` ``[B, K + 2, 2]``).

    Returns ``(drafts [B, K] on the device, q [B, K, V] or None, draft states
    after feeding y, d_1..d_{K-1})``.
    """
    y = spec.batch.tokens
    drafts, qs = [], []
    for j in range(K):
        logits, states = bridge.step(drafter.model, y, states)
        if sampled:
            qs.append(probabilities(logits, *params))
        y, _ = next_tokens(logits, keys[:, j] if sampled else None, params)
        drafts.append(y)
    return mx.stack(drafts, axis=1), (mx.stack(qs, axis=1) if qs else None), states


def _settle_model(drafter: DraftModel, states, anchors, drafts, accepted):
    """Bring the draft records back to each row's context minus its last token:
    the anchor plus ``y`` and the accepted drafts. Rows that accepted all
    ``K`` drafts need ``d_K`` fed first (one more draft step for the batch).

    The draft took its tokens one at a time, so a ring layer comes back by
    ``commit`` (decode by position); dense layers roll back.
    """
    K = drafts.shape[1]
    if K and max(accepted) == K:
        _, states = bridge.step(drafter.model, drafts[:, -1], states)
    keep = [1 + a for a in accepted]
    return [ops.commit(s, a, keep) for s, a in zip(states, anchors)]


def _asked(spec: Speculation, drafter, rule: Window | None, alphas, entry: bool) -> tuple:
    """Each row's draft request before drafting: its adapted ``num_draft``
    without a window rule; with one, ``min(max_draft, W - 1)`` for the width
    the rule picks when every row had its whole limit at hand (a bound:
    ``W = 1`` means no row drafts and the round is a plain step)."""
    if drafter is None:
        return (0,) * spec.batch_size
    if rule is None:
        return spec.num_draft
    widest = 1 + max(spec.max_draft)
    bound = rule.choose(spec.batch_size, alphas, spec.max_draft, widest, entry)
    return tuple(min(m, bound - 1) for m in spec.max_draft)


def recorded(spec: Speculation) -> Window | None:
    """``spec``'s window rule with its last rounds' costs recorded where ``step``
    has not recorded them yet (plain rounds' tokens read now if nothing read
    them; a drafting round with no plain round read after it as charged so far,
    ``_charge``): what a caller keeps when the rows stop."""
    for r in spec.unrecorded:
        if not r.drafted:
            r.host()
    rule, rest = _record_read(spec.window, spec.unrecorded)
    return _flush(rule, rest)


@attrs.frozen
class _Drafted:
    """A drafting round's sample, held until the plain round after it is read
    (``_record_read``); ``_charge`` says what it is charged.

    Attributes:
        B: the round's rows.
        W: its window width.
        seconds: its own time: from its start (or, drafting late, from the read of
            the plain round before it) to its end.
        excess: the time over the plain median of the plain rounds it broke,
            charged so far (``_charge``).
        entry: it followed a plain round. Under ``Window.hysteresis`` it is held
            until the first plain round after its run of drafting rounds is read,
            and that round is charged to it (the run's later rounds are charged
            their own time): entering pays for leaving.
    """

    B: int
    W: int
    seconds: float
    excess: float = 0.0
    entry: bool = False
    drafted: ClassVar[bool] = True  # (``_Read.drafted``: a plain round)


def _charge(rule: Window | None, drafted: _Drafted, broken: _Read) -> tuple:
    """``(rule, drafted)`` once a plain round whose pipelining ``drafted`` broke is read.

    The rule for pricing a drafting round. It cannot pipeline (the host needs its
    acceptance before it builds the next round), and it breaks the plain rounds'
    pipeline on both sides: the plain round before it when it drafts late (built
    while the device runs that round, it reads it only once its verify is handed
    over, so that round's interval holds its graph building), and the plain round
    after it (built only after its acceptance is read: nothing to overlap). A
    drafting round is charged its own time plus, for each plain round it broke, that
    round's time over the plain median (what it costs in a plain pipeline):
    ``max(0, seconds + excess)``, recorded once the plain round after it is read (or
    as it stands, ``_flush``, when none is). A broken round is no plain sample (it
    ticks the rule's clock), not even where the plain median is stale: the plain
    rounds the rule then runs measure it, the first of them broken, the next ones
    pipelined (a broken round's time as a plain sample put the H200's plain median
    at twice the plain loop's). Where the rows changed bucket between them the
    broken round is recorded as a plain sample of its own bucket, as timed."""
    if rule is None:
        return None, drafted
    if bucket(broken.B) != bucket(drafted.B):
        return rule.record(broken.B, 1, broken.seconds), drafted
    plain = rule.measured(broken.B, 1)
    if plain is None:  # stale: no excess to charge, and no plain sample
        return rule.tick(broken.B), drafted
    excess = drafted.excess + broken.seconds - plain
    return rule.tick(broken.B), attrs.evolve(drafted, excess=excess)


def _record_read(rule: Window | None, rounds: tuple) -> tuple:
    """``(rule, rest)``: ``rule`` with the rounds of ``rounds`` that can be priced
    recorded, oldest first; ``rest``: the others (a round's ``_Read`` reads the
    one before it first, so the read ones lead).

    A plain round is priced once its tokens are read. A drafting round
    (``_Drafted``) is priced once the plain round after it is read (``_charge``);
    under ``Window.hysteresis`` a run's entry round waits in ``rounds`` with its
    run's last round, and the plain round after the run is charged to it."""
    n = 0
    while n < len(rounds):
        r = rounds[n]
        if r.drafted:
            j = n + 1  # the round after the drafting rounds held here
            while j < len(rounds) and rounds[j].drafted:
                j += 1
            if j == len(rounds) or not rounds[j].read:
                break
            rule, r = _charge(rule, r, rounds[j])
            rule, n = _flush(rule, (r,) + rounds[n + 1 : j]), j + 1
            continue
        if not r.read:
            break
        if rule is not None:
            rule = rule.record(r.B, 1, r.seconds)
        n += 1
    return rule, rounds[n:]


def _flush(rule: Window | None, rounds: tuple) -> Window | None:
    """``rule`` with the drafting rounds in ``rounds`` recorded as charged so far
    (``_charge``): a plain round after one was read (``_record_read``), or none
    will be (``_record_read``'s ``rest``: another drafting round came next, or
    the rows stopped)."""
    for r in rounds:
        if r.drafted and rule is not None:
            rule = rule.record(r.B, r.W, max(0.0, r.seconds + r.excess), r.entry)
    return rule


SETTLE = 32  # plain rounds whose tokens a _Context holds at most before they are appended


def _settled(spec: Speculation) -> tuple:
    """``(context, last)`` at a round's start, without waiting for the last round:
    a plain round two rounds back is read now (if nothing read it: at most one
    round is left in flight behind the one being built, as a plain decode loop
    with ``mx.async_eval`` keeps it); the last round's tokens, when still unread,
    are handed to the device (``mx.async_eval``: the caller has dropped that
    round's input records by now, so the appends write in place) and returned as
    ``last``, to be read after this round is built. ``context`` is a tuple, or a
    ``_Context`` (``_rows`` makes its tuple where a round needs it): a run of plain
    rounds appends their tokens once, up to ``SETTLE`` rounds at a time."""
    c = spec._context
    if not isinstance(c, _Context):
        return c, None
    if len(c.reads) > 1:
        c.reads[-2].host()  # (a no-op when read: the round two back)
    if len(c.reads) > SETTLE:
        c = _Context(_Context(c.before, c.reads[:-1]).rows(), c.reads[-1:])
    if c.read.read:
        return c, None
    mx.async_eval(c.read.tokens)
    return c, c.read


def _rows(rows: tuple | _Context) -> tuple:
    """The rows' contexts as tuples (every plain round's token read)."""
    return rows if isinstance(rows, tuple) else rows.rows()


def _submit(*models) -> None:
    """Hand the records' planes to the device (``mx.async_eval``), no wait: a drafting
    round's rollback (the dropped columns cleared) then runs while the host builds
    the next round, instead of in front of the next round's forward. The input
    records of the rollback (the verify's output) are held by nothing else by now,
    so its writes are in place."""
    mx.async_eval([p for states in models for s in states for p in getattr(s, "planes", ())])


def _round_keys(keys: mx.array, K: int) -> tuple:
    """``(round_keys [B, K + 2, 2], carry [B, 2])`` for a round that drafts: each row's
    key split (``split_keys``), its ``use`` half split into the round's ``K + 2`` keys
    (``K`` draft-model samples, the uniforms, the next token)."""
    use, carry = split_keys(keys)
    return mx.vmap(lambda k: mx.random.split(k, K + 2))(use), carry


def step(
    target: Model,
    spec: Speculation,
    *,
    drafter: Drafter = None,
    forward: Forward | None = None,
    mask: Callable[[mx.array], mx.array | None] | None = None,
) -> tuple[Speculation, Round]:
    """One speculative round for every row: draft, verify in one target forward, roll back.

    Each row verifies with its own ``kv.Sampling``: rows at temperature 0 by
    greedy verification, the others by the rejection rule, with their own
    PRNG keys (a batch with sampled rows advances its keys once per round; a
    greedy batch's keys are left as they are: nothing draws from them). With a
    window rule (``spec.window``) the round is only as wide as pays; a round in
    which no row drafts is a plain decode step, operation for operation (tested
    on the device graph): one forward of ``[B, 1]`` and the argmax (or, with
    sampled rows, ``kv.sample_arrays``, as ``kvstate.mlx_lm.advance``); no
    lookup, checkpoint, rollback or draft-model step; and it does not wait for
    the device: its tokens are read when ``Round.emitted`` or ``spec.context``
    first needs them, or by the next drafting ``step``, or by the ``step`` after
    next, after the caller dropped ``spec`` (so the records' appends write in
    place, as in a plain decode loop). A caller may build the next round before
    reading this one's tokens (``pipelined``): the next ``step`` hands this one
    to the device (``mx.async_eval``) and, when it is a plain round too, builds
    its graph while the device runs this one, as a plain decode loop with
    ``mx.async_eval`` does; no ``step`` then waits for the device.

    Args:
        target: the mlx-lm model (for the default ``forward``).
        spec: the rows in flight.
        drafter: the ``Lookup`` or ``DraftModel`` the rows were started with
            (``None``: a plain decode step for every row).
        forward: ``(tokens [B, N], states) -> (logits [B, N, V], states)``;
            default ``eager(target)``; ``compiled(target)`` for a compiled verify.
        mask: ``mask(logits, window)`` is called once the forward of the verify
            window ``[B, N]`` (each row's pending token, its drafts, pad) is built and
            returns the rows' grammar bitmask ``[B, N, ceil(V/32)]`` int32, position
            ``i`` of row ``b`` the words its grammar allows after the window's first
            ``i + 1`` tokens (``[B, 1, ...]``: one row of words for every position;
            ``None``: no row is constrained). The logits are masked
            (``kvstate.sampling.apply_bitmask``) before verification and sampling, so a
            draft its grammar forbids is rejected and every emitted token keeps to it.
            The pending tokens must be the ones the caller's grammars last consumed
            (their round read: not pipelined). It may ``mx.async_eval(logits)``
            first, to fill on the host while the device runs the forward
            (``kvstate.serving.grammar``).

    Returns:
        ``(new_spec, Round)``: the rows after the round, and per row the
        emitted tokens (the accepted drafts, then the target's token).
    """
    drafter, draft_model = _step_args(spec, drafter)
    forward = forward or eager(target)
    t0 = time.perf_counter()
    rows, last = _settled(spec)  # the rows' contexts so far (the last round maybe unread)
    rule, unrecorded = _record_read(spec.window, spec.unrecorded)
    batch, B = spec.batch, spec.batch_size
    sampled, alphas, entry, asked, Kmax, params = _plan(spec, drafter, draft_model, rule)
    # The last round unread (pipelined): the round is built from what the host knows,
    # the rows' contexts less that round's token (still on the device), and reads it
    # once the verify is handed over; a round that ends plain reads nothing.
    late = last is not None
    drafting = _Drafted(B, 1, 0.0, entry=entry)  # its sample if it drafts (W, seconds: at its end)
    (
        drafts_dev,
        q,
        dstates,
        anchors,
        round_keys,
        carry,
        host,
        guess,
        riders,
        found,
        counts,
        width,
    ) = _draft(
        spec, drafter, draft_model, rows, late, asked, rule, alphas, entry, Kmax, params, sampled
    )
    K = max(counts)
    window = _window(batch.tokens, drafts_dev, K, width, B)
    cp = ops.checkpoint(batch.states) if K else None
    logits, states = forward(window, list(batch.states))
    logits = _masked(logits, mask, window)  # the rows' grammars: what they forbid is never emitted
    if K and last is not None:  # drafted late: the verify to the device, then the last
        # round read (it ran while this round was built)
        mx.async_eval(logits)
        rows = cast(_Context, rows).rows()
        rule, unrecorded, drafting = _late_read(rule, unrecorded, drafting, last)
        t0, last = max(t0, last.done), None  # its own time from that read
        if guess is not None:  # a late lookup's guesses, checked now
            host, found, counts = _confirmed_late(host, found, guess, rows)
    if K == 0:  # a plain round: exactly a plain decode step's operations (tested)
        # as a plain decode step makes them: greedy rows only: the argmax, keys
        # untouched; else kv.sample_arrays (what kvstate.mlx_lm.advance runs)
        pending, carry = next_tokens(logits[:, -1, :], batch.keys, params)
        read, accepted = _Read(pending, t0, B, last), (0,) * B  # read after the caller drops spec
    elif not sampled:
        drafts, accepted, nxt, pending = _accept_greedy_round(logits, drafts_dev, host, counts)
    else:
        drafts, accepted, nxt, pending = _accept_sampled_round(
            logits, drafts_dev, counts, q, params, round_keys, Kmax, width
        )
    keep = [1 + a for a in accepted]
    if min(keep) < width:  # a pad or a rejected draft to give back
        assert cp is not None  # K > 0: taken above
        # Every layer back to y and the accepted drafts (a recurrent layer keeping
        # part of the window replays it from the checkpoint: notes/kinds.md).
        states = bridge.rollback(target, states, cp, keep, window)
    draft_states, lag = _draft_records(
        spec, draft_model, Kmax, dstates, anchors, drafts_dev, accepted
    )
    if K:  # the rollbacks to the device now: it runs them while the host goes on
        _submit(states, draft_states if draft_model is not None and Kmax else ())
    num_draft, seen = _adapted(spec, rule, counts, accepted, asked, found, riders)
    batch = _next_batch(batch, states, pending, carry)
    emitted: tuple | _Read
    context: tuple | _Context
    if K == 0:  # read later (``_Read``); a later step records its cost
        context = rows.then(read) if isinstance(rows, _Context) else _Context(rows, (read,))
        unrecorded = unrecorded + (read,)
        emitted = read
    else:
        emitted = tuple(tuple(d[:a]) + (t,) for d, a, t in zip(drafts, accepted, nxt))
        context = tuple(c + e for c, e in zip(_rows(rows), emitted))
        rule, unrecorded = _drafted_end(rule, entry, unrecorded, drafting, width, t0)
    new = derived(
        spec,
        batch=batch,
        _context=context,
        num_draft=num_draft,
        draft_states=draft_states,
        window=rule,
        seen=seen,
        draft_lag=lag,
        unrecorded=unrecorded,
    )
    return new, Round(emitted, counts, accepted, width)


def _masked(logits: mx.array, mask, window: mx.array) -> mx.array:
    """``logits`` ``[B, N, V]`` with ``mask(logits, window)``'s words ``[B, N | 1, W]``
    applied at each position."""
    bitmask = None if mask is None else mask(logits, window)
    return logits if bitmask is None else apply_bitmask(logits, bitmask)


def _step_args(spec: Speculation, drafter: Drafter) -> tuple:
    """Check ``step``'s rows and drafter (a ``DraftModel`` exactly when the rows hold
    draft records).

    Returns:
        ``(drafter, draft_model)``: the drafter validated, and it again where it is a
        ``DraftModel`` (else ``None``).
    """
    drafter = validate_drafter(drafter)
    if not isinstance(spec, Speculation):
        raise bad(
            "spec", "a Speculation (kvstate.speculative.start makes one)", type(spec).__name__
        )
    draft_model = drafter if isinstance(drafter, DraftModel) else None
    check(
        (draft_model is not None) == (spec.draft_states is not None),
        "drafter",
        "a DraftModel exactly when the rows hold draft records",
        type(drafter).__name__,
    )
    return drafter, draft_model


def _plan(spec: Speculation, drafter, draft_model, rule: Window | None) -> tuple:
    """What a round asks before drafting.

    Returns:
        ``(sampled, alphas, entry, asked, Kmax, params)``: whether any row samples,
        each row's acceptance estimate under the rule, whether the round follows a
        plain round (or none: an entry into drafting, ``Window.hysteresis``), each
        row's draft request (``_asked``), the draft model's steps (0 without one),
        and the rows' sampling arrays (``None``: every row greedy).
    """
    sampled = any(s.temperature >= GREEDY_BELOW for s in spec.batch.sampling)
    alphas = [rule.alpha(x) for x in spec.seen] if rule is not None else []
    # after a plain round (or none): an entry into drafting (``Window.hysteresis``)
    entry = not (spec.unrecorded and spec.unrecorded[-1].drafted)
    asked = _asked(spec, drafter, rule, alphas, entry)
    Kmax = max(asked) if draft_model is not None else 0
    params = sampling_arrays(spec.batch) if sampled else None
    return sampled, alphas, entry, asked, Kmax, params


class _Drafts(NamedTuple):
    """A round's drafts (``_draft``), as ``step`` unpacks them."""

    drafts_dev: mx.array | None  # [B, K] on the device (None: no row drafts)
    q: mx.array | None  # the draft model's probabilities (sampled rows), else None
    dstates: list | None  # the draft model's records after drafting, else None
    anchors: list | None  # their anchors (``ops.anchor``), else None
    round_keys: mx.array | None  # the round's keys (sampled rows drafting), else None
    carry: mx.array  # the rows' keys after the round
    host: list | None  # the drafts on the host (None: the draft model's, on the device)
    guess: list | None  # a late lookup's guess of each row's unread last token, else None
    riders: tuple  # per row: its drafts ride in paid columns (``Lookup.ride_ngram``)
    found: tuple  # per row: the drafts found
    counts: tuple  # per row: the drafts in the round
    width: int  # the verify window's width


def _draft(
    spec: Speculation,
    drafter,
    draft_model,
    rows,
    late: bool,
    asked: tuple,
    rule,
    alphas,
    entry: bool,
    Kmax: int,
    params,
    sampled: bool,
) -> _Drafts:
    """A round's drafts: from the draft model where it drafts (``Kmax > 0``), else on
    the host (a lookup, or none)."""
    if draft_model is not None and Kmax:
        return _draft_by_model(spec, draft_model, rows, late, asked, rule, entry, params, sampled)
    return _draft_on_host(spec, drafter, rows, late, asked, rule, alphas, entry, sampled)


def _draft_by_model(
    spec: Speculation,
    draft_model: DraftModel,
    rows,
    late: bool,
    asked: tuple,
    rule,
    entry: bool,
    params,
    sampled: bool,
) -> _Drafts:
    """A round's drafts from the draft model: its records caught up on the rows'
    contexts (less the unread last token when ``late``), then ``max(asked)`` draft
    steps; the width wider than the drafts where that measured cheaper."""
    B, Kmax = spec.batch_size, max(asked)
    round_keys, carry = None, spec.batch.keys  # greedy rows: nothing draws from the keys
    if sampled:
        round_keys, carry = _round_keys(spec.batch.keys, Kmax)
    known = cast(_Context, rows).known() if late else _rows(rows)  # late: less its last
    dstates = _catch_up(draft_model, spec, known, 0 if late else 1)
    anchors = [ops.anchor(s) for s in dstates]
    drafts_dev, q, dstates = _propose_model(
        spec, draft_model, dstates, Kmax, params, round_keys, sampled
    )
    width = _width(rule, B, Kmax, 1 + max(spec.max_draft), entry)
    return _Drafts(
        drafts_dev,
        q,
        dstates,
        anchors,
        round_keys,
        carry,
        None,
        None,
        (False,) * B,
        asked,
        asked,
        width,
    )


def _draft_on_host(
    spec: Speculation,
    drafter,
    rows,
    late: bool,
    asked: tuple,
    rule: Window | None,
    alphas,
    entry: bool,
    sampled: bool,
) -> _Drafts:
    """A round's drafts on the host: a lookup for the rows that ask (none without a
    ``Lookup``), cut to the width the rule picks for them, and riders in the paid
    columns."""
    B = spec.batch_size
    widest = 1 + max(spec.max_draft)  # the widest window a round may run
    host: list = [[]] * B  # no row asks: the context is not read
    guess: list | None = None
    riders: tuple = (False,) * B
    if isinstance(drafter, Lookup) and any(asked):
        if late:  # drafts from the rows' contexts less the unread last token
            host, guess = _propose_late(cast(_Context, rows), drafter, asked)
        else:
            host = _propose_lookup(_rows(rows), drafter, asked)
    found = tuple(len(d) for d in host)
    if rule is not None and any(found):  # the width for the drafts at hand (once)
        chosen = rule.choose(B, alphas, found, widest, entry)
        host = [d[: chosen - 1] for d in host]
    counts = tuple(len(d) for d in host)
    width = _width(rule, B, max(counts), widest, entry)
    if width > 1 and isinstance(drafter, Lookup) and drafter.ride_ngram < drafter.min_ngram:
        # the round's columns are paid: rows without a draft take a shorter match's
        ride = [width - 1 if a and not c else 0 for a, c in zip(asked, counts)]
        if any(ride):
            host, guess, riders = _ride(rows, late, drafter, ride, host, guess)
            counts = tuple(len(d) for d in host)
    K = max(counts)
    keys = spec.batch.keys
    round_keys, carry = _round_keys(keys, 0) if sampled and K else (None, keys)
    drafts_dev = mx.array([d + [0] * (K - len(d)) for d in host], mx.uint32) if K else None
    return _Drafts(
        drafts_dev, None, None, None, round_keys, carry, host, guess, riders, found, counts, width
    )


def _window(tokens: mx.array, drafts_dev, K: int, width: int, B: int) -> mx.array:
    """The verify window ``[B, width]``: each row's last token, its drafts (padded
    past its count to ``K``), then pad columns past every draft."""
    window = tokens[:, None].astype(mx.uint32)
    if K:  # pads past counts
        assert drafts_dev is not None  # [B, K]: drafted above
        window = mx.concatenate([window, drafts_dev.astype(mx.uint32)], axis=1)
    if width > 1 + K:  # pad columns past every draft: rolled back as a short draft's
        window = mx.concatenate([window, mx.zeros((B, width - 1 - K), mx.uint32)], axis=1)
    return window


def _late_read(rule: Window | None, unrecorded: tuple, drafting: _Drafted, last: _Read) -> tuple:
    """``(rule, unrecorded, drafting)`` once the last round, read late, is recorded and
    charged to this drafting round (the plain round it read late)."""
    rule, unrecorded = _record_read(rule, tuple(r for r in unrecorded if r is not last))
    rule, drafting = _charge(rule, drafting, last)
    return rule, unrecorded, drafting


def _confirmed_late(host, found: tuple, guess: list, rows: tuple) -> tuple:
    """``(host, found, counts)`` once a late lookup's guesses are checked (``_confirmed``)."""
    assert host is not None  # (a lookup round: drafted on the host)
    host, found = _confirmed(host, found, guess, rows)
    return host, found, tuple(len(d) for d in host)


def _accept_greedy_round(logits: mx.array, drafts_dev, host, counts: tuple) -> tuple:
    """Greedy verification of a drafting round (the target's argmax, read).

    Returns:
        ``(drafts, accepted, nxt, pending)``: each row's drafts, the drafts it
        accepted, its next token on the host and on the device.
    """
    target_tokens = mx.argmax(logits, axis=-1)
    mx.eval(target_tokens, *([drafts_dev] if host is None else []))
    drafts = host if host is not None else [d[:c] for d, c in zip(drafts_dev.tolist(), counts)]
    accepted, nxt = accept_greedy(drafts, cast(list, target_tokens.tolist()))
    return drafts, accepted, nxt, mx.array(nxt, dtype=mx.uint32)


def _accept_sampled_round(
    logits: mx.array, drafts_dev, counts: tuple, q, params, round_keys, Kmax: int, width: int
) -> tuple:
    """Verification of a drafting round with sampled rows, by the rejection rule
    (``accept_sampled``) on each row's own keys, read.

    Returns:
        ``(drafts, accepted, nxt, pending)``: each row's drafts, the drafts it
        accepted, its next token on the host and on the device.
    """
    assert params is not None and round_keys is not None  # sampled rows: made above
    K = max(counts)
    p = probabilities(logits if width == 1 + K else logits[:, : 1 + K], *params)
    uniform = mx.vmap(lambda k: mx.random.uniform(shape=(K,), key=k))(round_keys[:, Kmax])
    acc, nx = accept_sampled(
        drafts_dev.astype(mx.int32),
        mx.array(counts, mx.int32),
        p,
        q,
        uniform,
        round_keys[:, Kmax + 1],
    )
    mx.eval(acc, nx, drafts_dev)
    drafts = [d[:c] for d, c in zip(drafts_dev.tolist(), counts)]
    return drafts, tuple(acc.tolist()), tuple(nx.tolist()), nx


def _draft_records(
    spec: Speculation, draft_model, Kmax: int, dstates, anchors, drafts_dev, accepted
) -> tuple:
    """``(draft_states, lag)`` after the round: the draft model's records settled on the
    accepted drafts where it drafted; after a plain round, one more token to catch up."""
    draft_states, lag = spec.draft_states, spec.draft_lag
    if draft_model is not None and Kmax:
        draft_states = _settle_model(draft_model, dstates, anchors, drafts_dev, accepted)
        lag = (0,) * len(accepted)
    elif draft_model is not None:  # a plain round: the draft model catches up when it next drafts
        lag = tuple(n + 1 for n in lag)
    return (None if draft_states is None else tuple(draft_states)), lag


def _adapted(
    spec: Speculation, rule: Window | None, counts, accepted, asked, found, riders
) -> tuple:
    """``(num_draft, seen)`` after the round: without a rule each row's adapted draft
    length; with one, each row's acceptance observed."""
    if rule is None:
        num_draft = tuple(
            next_num_draft(k, c, a, m)
            for k, c, a, m in zip(spec.num_draft, counts, accepted, spec.max_draft)
        )
        return num_draft, spec.seen
    seen = tuple(  # a rider's draft is no evidence on the row's own drafts
        rule.observe(x, 0 if r else c, 0 if r else a, k > 0 and f == 0)
        for x, c, a, k, f, r in zip(spec.seen, counts, accepted, asked, found, riders)
    )
    return spec.num_draft, seen


def _next_batch(batch, states, pending: mx.array, carry: mx.array):
    """The rows' batch after the round: the records ``forward`` returned, this round's
    tokens (``uint32``) and keys.

    Derived from the valid rows in flight: not converted or checked again, as a
    plain step's records are not (every round builds them).
    """
    if pending.dtype != mx.uint32:
        pending = pending.astype(mx.uint32)
    return derived(batch, states=tuple(states), tokens=pending, keys=carry)


def _drafted_end(
    rule: Window | None, entry: bool, unrecorded: tuple, drafting: _Drafted, width: int, t0
) -> tuple:
    """``(rule, unrecorded)`` at a drafting round's end: a drafting round before this
    one, with no plain round after it, recorded as charged so far (its run's entry
    round held, under hysteresis, while the run goes on); this one's sample waits for
    the round after it (``_record_read``)."""
    hold = rule is not None and rule.hysteresis and not entry
    deferred = [not r.drafted or (hold and r.entry) for r in unrecorded]
    rule = _flush(rule, tuple(r for r, d in zip(unrecorded, deferred) if not d))
    kept = tuple(r for r, d in zip(unrecorded, deferred) if d)
    elapsed = max(0.0, time.perf_counter() - t0)
    drafting = attrs.evolve(drafting, W=width, seconds=elapsed)
    return rule, kept + ((drafting,) if rule is not None else ())


__all__ = [
    "DraftModel",
    "Lookup",
    "Round",
    "Speculation",
    "Window",
    "accept_greedy",
    "accept_sampled",
    "compiled",
    "eager",
    "expected_accepted",
    "join",
    "leave",
    "next_num_draft",
    "probabilities",
    "recorded",
    "start",
    "step",
]
