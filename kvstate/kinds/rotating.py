"""Sliding-window rings: ``RotatingState`` (layout pictured in ``kvstate.core.records``).

A row behaves exactly as mlx-lm's ``RotatingKVCache(max_size, keep)``:

* Before appending ``N`` tokens a row drops its oldest non-kept positions
  until it holds at most ``max_size - 1``, then holds all ``N`` (one rule
  for mlx-lm's in-place ``N == 1`` path and its concatenating ``N > 1`` path).
* A query sees, in the temporal order of what its row holds, itself and
  the ``w - 1`` entries before it (``w = window or max_size``): what
  mlx-lm's ``make_mask`` + ``update_and_fetch`` show the model. Counting
  held entries rather than positions only differs once the kept prefix and
  the newest positions are no longer contiguous, and there mlx-lm counts
  entries too.

Rows are independent rings in one ``[B, H, C, D]`` buffer, so a batch equals
each row run alone, ``keep`` included. Positions decide columns
(``col(p)``), so a write needs only the row's length: no write index to
carry, and the index math below takes ``mx.array`` lengths as readily as
host ints (the compiled path).

The model read (``read``, ``update_and_read``) is the buffer's columns
``[0, read_width)`` in ring order, with a mask laid out over those columns
(``next_mask`` before the append, the same mask as ``attend`` after it);
``fetch`` gathers the held entries into temporal order. Decisions and their
reasons: ``notes/kinds.md``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..compiled import boundary as compiled
from ..core import ops
from ..core.args import PerRowInts, as_int, per_row, row_count, row_index, row_list
from ..core.invariants import (
    check_counts,
    check_float,
    check_int,
    check_plane,
    clear_columns,
    clear_hidden,
    cleared,
    distinct_row_ids,
    validate,
)
from ..core.masks import MaskKey, lease
from ..core.records import Checkpoint, RotatingState, derived, row_ids_of, rows_of
from ..errors import bad, check
from ..kernels.stock import scatter_writer
from . import rows as _rows

# --- construction -------------------------------------------------------------


def _check_ring(max_size, keep, step):
    max_size = as_int(max_size, "max_size")
    check(max_size >= 1, "max_size", ">= 1", max_size)
    keep = as_int(keep, "keep")
    check(0 <= keep < max_size, "keep", f"in [0, max_size={max_size})", keep)
    step = as_int(step, "step")
    check(step >= 1, "step", ">= 1", step)
    return max_size, keep, step


def rotating(
    batch_size: int = 1, *, max_size: int, keep: int = 0, step: int = 256
) -> RotatingState:
    """An empty ``RotatingState``: ``batch_size`` rings of ``max_size`` positions.

    Args:
        max_size: positions each row keeps (mlx-lm ``RotatingKVCache.max_size``).
        keep: first positions never evicted, ``0 <= keep < max_size``.
        step: capacity grows in multiples of this until it reaches ``max_size``.
    """
    batch_size = row_count(batch_size, "batch_size")
    max_size, keep, step = _check_ring(max_size, keep, step)
    return RotatingState(
        (0,) * batch_size, (0,) * batch_size, max_size=max_size, keep=keep, step=step
    )


# --- the layout math (numpy on the host, or mx inside compiled code) -------------


def _xp(x):
    return mx if isinstance(x, mx.array) else np


def column_of(p, keep: int, capacity: int):
    """``col(p)``: the column that position ``p`` (ints or an array) lives at."""
    L = max(capacity - keep, 1)
    xp = _xp(p)
    return xp.where(p < keep, p, keep + (p - keep) % L)


def _ranks(lengths, held, keep: int, capacity: int, width: int):
    """Per row and column ``[B, width]``: does the column hold a position, and
    its rank (index in the row's temporal order). ``lengths``/``held``: ``[B]``."""
    xp = _xp(lengths)
    n = lengths[:, None]
    h = held[:, None]
    nk = xp.minimum(n, keep)
    start = n - (h - nk)
    L = max(capacity - keep, 1)
    c = xp.arange(width)[None, :]
    s0 = (start - keep) % L
    r = (c - keep - s0) % L
    in_keep = c < keep
    holds = xp.where(in_keep, c < nk, r < h - nk)
    rank = xp.where(in_keep, c, nk + r)
    return holds, rank


def _position_of_rank(rank, lengths, held, keep: int):
    """Position of the entry at temporal ``rank`` (``[B, W]``) of each row."""
    xp = _xp(rank)
    n = lengths[:, None]
    nk = xp.minimum(n, keep)
    start = n - (held[:, None] - nk)
    return xp.where(rank < nk, rank, start + (rank - nk))


def ring_mask(n: int, lengths, held, *, keep: int, capacity: int, width: int, window: int):
    """The bool mask ``[B, 1, n, width]`` over ring columns ``[0, width)``.

    The ``n`` queries of row ``b`` are its last ``n`` held entries; query
    ``i`` (temporal rank ``held[b] - n + i``) sees a column iff the column
    holds an entry of rank ``r`` with ``rank - window < r <= rank``.
    ``lengths``/``held`` are host sequences or int32 ``[B]`` arrays, so the
    mask can be built inside compiled code.
    """
    ln = lengths if isinstance(lengths, mx.array) else mx.array(lengths, dtype=mx.int32)
    hd = held if isinstance(held, mx.array) else mx.array(held, dtype=mx.int32)
    holds, rank = _ranks(ln, hd, keep, capacity, width)
    q = (hd[:, None] - n + mx.arange(n, dtype=mx.int32)[None, :])[:, :, None]  # [B, n, 1]
    r = rank[:, None, :]
    mask = holds[:, None, :] & (r <= q) & (q - r < window)
    return mask[:, None]


# --- bookkeeping: the eviction rule, on host ints or arrays --------------------------


def _kept(n, h, max_size: int, keep: int, lo, hi):
    nk = lo(n, keep)
    return nk + lo(h - nk, hi(max_size - 1 - nk, 0))


def kept_after_eviction(lengths, held, *, max_size: int, keep: int):
    """What each row still holds once it has dropped its oldest non-kept
    positions down to ``max_size - 1`` (the kept prefix stays): the ring's
    one eviction rule, applied before every append.

    ``lengths``/``held``: host tuples of ints (a tuple comes back) or int
    arrays, numpy or ``mx`` (traced inside a compiled step).
    """
    if isinstance(lengths, tuple):
        return tuple([_kept(n, h, max_size, keep, min, max) for n, h in zip(lengths, held)])
    xp = _xp(lengths)
    return _kept(lengths, held, max_size, keep, xp.minimum, xp.maximum)


def _plan(state: RotatingState, N: int):
    """Host bookkeeping of appending ``N`` tokens to every row.

    Returns ``(lengths, held, kept, capacity)``: the new lengths and held
    counts, what each row still holds of the old tokens after eviction, and
    the capacity the new buffer gets.
    """
    kept = kept_after_eviction(state.lengths, state.held, max_size=state.max_size, keep=state.keep)
    lengths = tuple(n + N for n in state.lengths)
    held = tuple(k + N for k in kept)
    need = max(held, default=0)
    C = state.capacity
    if need > C:
        C = min(_rows.round_up(need, state.step), max(state.max_size, need))
    elif C > max(state.max_size, need):
        C = max(state.max_size, need)  # a block made the ring wider: shrink back
    return lengths, held, kept, C


def advance(lengths, held, n: int, *, max_size: int, keep: int):
    """``(lengths, held)`` after appending ``n`` tokens, as arrays (numpy or mx).

    ``append``'s host bookkeeping (``kept_after_eviction``) for code that
    keeps the rows' positions in arrays (a compiled decode step).
    """
    kept = kept_after_eviction(lengths, held, max_size=max_size, keep=keep)
    return lengths + n, kept + n


def ring_writer(lengths, N: int, *, keep: int, capacity: int):
    """How ``N`` new tokens ``[B, H, N, D]`` are written at each row's next
    columns ``col(lengths[b] + i)``: a function ``write(plane, new)``.

    ``lengths``: the rows' tokens seen before the write, host ints (eager
    appends) or an int32 ``[B]`` array (traced in a compiled step). The
    capacity must already hold the rows after the append (``append`` and the
    compile boundary lay the ring out on the host first). Rows writing one
    run of columns together take one ``slice_update``; otherwise a per-row
    scatter, its index shared by every plane.
    """
    if isinstance(lengths, mx.array):
        pos = lengths[:, None] + mx.arange(N, dtype=lengths.dtype)[None, :]
        return scatter_writer(column_of(pos, keep, capacity)[:, None, :, None])
    host = np.array(lengths, np.int64).reshape(-1, 1) + np.arange(N)[None, :]
    return columns_writer(column_of(host, keep, capacity).tolist())


def columns_writer(cols):
    """``write(plane, new)`` putting ``new`` ``[B, H, N, D]`` at per-row host
    columns ``cols`` (``[B][N]`` ints): one ``slice_update`` when every row
    writes one run of columns together, else a scatter."""
    if not cols:  # no rows
        return lambda plane, new: plane
    first, N = cols[0], len(cols[0])
    if all(c == first for c in cols) and first == list(range(first[0], first[0] + N)):
        start = mx.array([first[0]], dtype=mx.int32)
        return lambda plane, new: mx.slice_update(plane, new, start, (2,))
    return scatter_writer(mx.array(cols, dtype=mx.int32)[:, None, :, None])


def read_width(state: RotatingState) -> int:
    """Columns ``read`` returns: ``min(capacity, max(lengths))``.

    A row whose length fits in the capacity has never wrapped, so all it
    holds lies below its length; beyond that, every column may hold data.
    """
    return min(state.capacity, max(state.lengths, default=0))


# --- moving data ----------------------------------------------------------------


def _relayout(planes, lengths, held, keep: int, old_c: int, new_c: int):
    """Planes of capacity ``new_c`` holding the same entries at their new columns."""
    if not planes or old_c == new_c:
        return tuple(planes)
    if old_c == 0:
        return tuple(mx.zeros((p.shape[0], p.shape[1], new_c, p.shape[3]), p.dtype) for p in planes)
    if max(lengths, default=0) <= min(old_c, new_c):
        # No row has wrapped: col(p) = p under both capacities.
        return _rows.resize(planes, new_c)
    ln, hd = np.array(lengths, np.int64), np.array(held, np.int64)
    holds, rank = _ranks(ln, hd, keep, new_c, new_c)
    src = column_of(_position_of_rank(rank, ln, hd, keep), keep, old_c)
    src = np.where(holds, src, 0).astype(np.int32)
    return cleared(_gather(planes, src), holds)  # unheld columns: zeros (invariants.py)


def _gather(planes, src):
    """Each plane's columns ``src`` (``[B, W]`` host ints), per row."""
    idx = mx.array(src, dtype=mx.int32)[:, None, :, None]
    return tuple(
        mx.take_along_axis(
            p, mx.broadcast_to(idx, (p.shape[0], p.shape[1], idx.shape[2], p.shape[3])), axis=2
        )
        for p in planes
    )


# --- append / read / fetch ---------------------------------------------------------


@ops.append.register
def append_ring(state: RotatingState, k, v):
    _rows.validate_tokens(state, k, v)
    N = k.shape[2]
    lengths, held, kept, C = _plan(state, N)
    if state.keys is None:
        planes = tuple(mx.zeros((x.shape[0], x.shape[1], C, x.shape[3]), x.dtype) for x in (k, v))
    else:
        planes = _relayout(state.planes, state.lengths, kept, state.keep, state.capacity, C)
    write = ring_writer(state.lengths, N, keep=state.keep, capacity=C)
    keys, values = (write(p, x) for p, x in zip(planes, (k, v)))
    return derived(state, lengths=lengths, held=held, keys=keys, values=values)


def read(state: RotatingState):
    """``(keys, values)`` the model attends over: columns ``[0, read_width)``, ring order.

    This is what ``next_mask`` (before an append) and ``attend`` lay their
    masks over. mlx-lm's ring also hands the model its buffer in ring order.
    These may be the record's own arrays: read them, never hand them to code
    that assigns into arrays (mlx-lm's caches do: use ``fetch`` there).
    """
    check(state.keys is not None, "state", "a state holding keys (append first)", "an empty state")
    w = read_width(state)
    keys: Any = state.keys
    values: Any = state.values
    if w == state.capacity:
        return keys, values
    return keys[:, :, :w, :], values[:, :, :w, :]


@ops.update_and_read.register
def update_and_read(state: RotatingState, k, v, plans=None):
    """Append, then read: ``(new_state, keys, values)`` for an mlx-lm cache shell.

    The bridge's ``update_and_fetch(k, v)`` returns ``keys, values`` from
    here; its ``make_mask(N, window_size)``, called before, answers
    ``ops.next_mask(state, N, memo=..., window=window_size)``, whose mask is
    laid out over exactly these columns. ``attend`` on ``new_state`` is this
    read under that mask.
    """
    new = ops.append(state, k, v)
    keys, values = read(new)
    return new, keys, values


@ops.fetch.register
def fetch_ring(state: RotatingState):
    """``(keys, values)`` ``[B, H, width, D]``: each row's held entries in temporal
    order; rows holding fewer are left-padded with zeros so every row ends at ``width``.

    Always new arrays (a gather), never the record's buffers, so they can be
    handed to an mlx-lm cache, which writes into the arrays it holds.
    """
    check(state.keys is not None, "state", "a state holding keys (append first)", "an empty state")
    W = state.width
    ln, hd = np.array(state.lengths, np.int64), np.array(state.held, np.int64)
    rank = np.arange(W)[None, :] - (W - hd)[:, None]
    pad = rank < 0
    src = column_of(
        _position_of_rank(np.maximum(rank, 0), ln, hd, state.keep), state.keep, state.capacity
    )
    out = _gather(state.planes, np.where(pad, 0, src))
    if pad.any():
        keepm = mx.array(~pad)[:, None, :, None]
        out = tuple(mx.where(keepm, x, mx.zeros((), x.dtype)) for x in out)
    return out


def from_temporal(
    keys: mx.array,
    values: mx.array,
    *,
    lengths: PerRowInts,
    max_size: int,
    keep: int = 0,
    held: PerRowInts | None = None,
    step: int = 256,
) -> RotatingState:
    """A ``RotatingState`` holding ``keys``/``values`` ``[B, H, S, D]`` given in temporal order.

    Row ``b`` holds its last ``held[b]`` columns (default: all ``S``) and has
    seen ``lengths[b]`` tokens, as ``fetch`` lays rows out; so
    ``from_temporal(*fetch(s), lengths=s.lengths, held=s.held, ...)`` rebuilds
    ``s``. An mlx-lm ``RotatingKVCache`` converts with its temporal-order
    buffer, ``offset`` and ``keep``.
    """
    _rows.check_kv("keys", keys, "values", values)
    max_size, keep, step = _check_ring(max_size, keep, step)
    B, _, S, _ = keys.shape
    check(B >= 1, "keys batch size", ">= 1", B)
    lengths = per_row(lengths, B, "lengths")
    held = per_row(S if held is None else held, B, "held")
    for b, (n, h) in enumerate(zip(lengths, held)):
        check(h <= min(n, S), f"held[{b}]", f"<= min(lengths[{b}]={n}, stored columns={S})", h)
        if n <= keep:
            check(h == n, f"held[{b}]", f"{n} (a row inside its kept prefix holds it all)", h)
        else:
            check(h >= keep, f"held[{b}]", f">= keep={keep} (the kept prefix is never evicted)", h)
    C = max(held)
    ln, hd = np.array(lengths, np.int64), np.array(held, np.int64)
    holds, rank = _ranks(ln, hd, keep, C, C)
    src = np.where(holds, S - hd[:, None] + rank, 0)
    planes = _gather((keys, values), src)
    return RotatingState(
        lengths, held, max_size=max_size, keep=keep, step=step, keys=planes[0], values=planes[1]
    )


@ops.positions.register
def positions_ring(state: RotatingState):
    return None if len(set(state.lengths)) <= 1 else mx.array(state.lengths, dtype=mx.int32)


@_rows.geometry.register
def geometry_ring(state: RotatingState):
    return _rows.kv_geometry(state.keys, state.values)


# --- masks and attention ------------------------------------------------------------


def _window(state, window):
    if window is None:
        return state.max_size
    w = as_int(window, "window")
    check(w >= 1, "window", ">= 1", w)
    return w


def _read_mask(
    lengths, held, capacity: int, state: RotatingState, n: int, memo, w: int, array: bool = False
):
    """The mask for the last ``n`` entries of rows ``lengths``/``held`` over the
    read of a ring of ``capacity`` (``state`` gives ``keep`` and ``max_size``).

    No array when none is needed (unless ``array``): one query seeing every
    read column (each row holds ``width`` entries, all inside the window)
    gets ``None``; several queries over rows that hold everything they have
    seen, in order from column 0, get ``"causal"``.
    """
    width = min(capacity, max(lengths, default=0))
    if not array and n == 1 and all(h == width for h in held) and w >= width:
        return None, None
    if not array and n > 1 and all(h == width for h in held) and lengths == held and w >= width:
        return "causal", None
    family = "ring" if w == state.max_size else "ring-window"
    key = MaskKey(family, (n, lengths, held, state.keep, capacity, width, w))
    lease_ = lease(
        memo,
        key,
        lambda: ring_mask(
            n, lengths, held, keep=state.keep, capacity=capacity, width=width, window=w
        ),
    )
    return lease_.mask, lease_


@ops.next_mask.register
def next_mask_ring(state: RotatingState, n, *, memo=None, window=None, array=False):
    n = _rows.next_count(n, memo)
    lengths, held, _, capacity = _plan(state, n)
    return _read_mask(lengths, held, capacity, state, n, memo, _window(state, window), array)


@ops.attend.register
def attend_ring(state: RotatingState, q, *, scale: float, memo=None, window=None):
    n = _rows.validate_queries(state, q, scale=scale, window=window, memo=memo, holds=state.held)
    w = _window(state, window)
    keys, values = read(state)
    return _rows.under_mask(
        _read_mask(state.lengths, state.held, state.capacity, state, n, memo, w),
        lambda mask: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask),
    )


# --- trim, checkpoint, rollback ---------------------------------------------------------


def _trim_to(state: RotatingState, target, arg: str) -> RotatingState:
    """Rows back to ``target`` tokens seen, where the ring still holds what that needs.

    Going back to ``t`` tokens is exact when the row then holds what any
    later append reads of its past: its kept prefix and the newest
    ``max_size - 1 - keep`` positions before ``t`` (or all of them). That is
    every ``t`` when nothing was evicted, ``t <= keep``, or
    ``t - start >= max_size - 1 - keep``; anything else was evicted and
    cannot come back.
    """
    keep, ms = state.keep, state.max_size
    held = []
    for b, (t, n, h, s) in enumerate(zip(target, state.lengths, state.held, state.starts)):
        check(t <= n, f"{arg} for row {b}", f"<= {n} (tokens the row has seen)", t)
        if t <= keep or h == n:  # inside the kept prefix, or nothing was evicted
            held.append(t)
            continue
        lowest = s + max(0, ms - 1 - keep)
        if t < lowest:
            raise bad(
                f"{arg} for row {b}",
                f">= {lowest} or <= {keep} (the ring holds positions {s}..{n - 1}, and "
                f"the next append needs the {ms - 1 - keep} before it)",
                t,
            )
        held.append(keep + t - s)
    keys, values = clear_columns(state.planes, _dropped_columns(state, target)) or (None, None)
    return derived(state, lengths=tuple(target), held=tuple(held), keys=keys, values=values)


def _dropped_columns(state: RotatingState, target) -> list:
    """Per row, the columns of the held positions at or after ``target``."""
    keep, C, out = state.keep, state.capacity, []
    for t, n, s in zip(target, state.lengths, state.starts):
        nk = min(keep, n)
        pos = list(range(t, nk)) + list(range(max(t, s), n))
        out.append(column_of(np.array(pos, np.int64), keep, C).tolist() if pos else [])
    return out


@ops.trim.register
def trim_ring(state: RotatingState, n):
    return _trim_to(
        state, _rows.trimmed_lengths(state, n, "tokens the row has seen"), "lengths - n"
    )


@ops.checkpoint.register
def checkpoint_ring(state: RotatingState):
    """Tokens seen per row (``Checkpoint.lengths``); ring rows never pad."""
    return Checkpoint(state.lengths, state.left_pad, row_ids=state.row_ids)


@ops.rollback.register
def rollback_ring(state: RotatingState, checkpoint, keep=0):
    return _trim_to(state, _rows.checkpoint_target(state, checkpoint, keep), "checkpoint + keep")


@ops.anchor.register
def anchor_ring(state: RotatingState):
    return state  # single-token appends overwrite what a longer rollback needs


@ops.commit.register
def commit_ring(state: RotatingState, anchor, keep=0):
    """Decode by position: ``anchor`` (the earlier ring) plus the first
    ``keep[b]`` positions ``state`` appended since, written one position at
    a time, so each row ends exactly as single-token decoding leaves it::

        anchor (C = 8):  0 1 | 2 3 4 5 6 7   held 8 (positions 2..9 at col(p))
        state:  4 draft tokens appended one at a time overwrote positions 4..7
        commit(state, anchor, 2): anchor + positions 10, 11 copied from state
                         at col(10), col(11): positions 4, 5 evicted, 6..11 held

    The kept positions are read from ``state`` (they must still be there:
    each is among the newest ``capacity - keep`` it wrote). The capacity
    only grows (as the single-token appends would have grown it). With a
    ``Checkpoint`` as ``anchor`` this is ``rollback``.
    """
    if isinstance(anchor, Checkpoint):
        return ops.rollback(state, anchor, keep)
    if not isinstance(anchor, RotatingState):
        raise bad(
            "anchor",
            "a Checkpoint or a RotatingState (kv.anchor of an earlier record)",
            type(anchor).__name__,
        )
    B, ms, kp = state.batch_size, state.max_size, state.keep
    check(anchor.batch_size == B, "anchor batch size", B, anchor.batch_size)
    _rows.check_checkpoint_rows(state, anchor, "anchor")
    check(
        (anchor.max_size, anchor.keep) == (ms, kp),
        "anchor (max_size, keep)",
        (ms, kp),
        (anchor.max_size, anchor.keep),
    )
    keep = per_row(keep, B, "keep")
    La = max(state.capacity - kp, 1)
    for b, (k, n0, n) in enumerate(zip(keep, anchor.lengths, state.lengths)):
        check(
            n0 + k <= n, f"anchor + keep for row {b}", f"<= {n} (tokens the row has seen)", n0 + k
        )
        if k:
            oldest = max(n0, kp)
            check(
                n - La <= oldest or n0 + k <= kp,
                f"keep for row {b}",
                f"positions still in the ring (from {n - La}; the state holds "
                f"{state.capacity} columns)",
                f"positions {n0}..{n0 + k - 1}",
            )
    lengths, held = list(anchor.lengths), list(anchor.held)
    for b, k in enumerate(keep):
        for _ in range(k):
            h = _kept(lengths[b], held[b], ms, kp, min, max) + 1
            lengths[b], held[b] = lengths[b] + 1, h
    K = max(keep)
    if K == 0:
        return anchor
    check(
        anchor.keys is not None and state.keys is not None,
        "anchor",
        "a ring holding keys (append first)",
        "an empty ring",
    )
    need, C = max(held), anchor.capacity
    planes = anchor.planes
    if need > C:
        new_c = min(_rows.round_up(need, anchor.step), max(ms, need))
        planes = _relayout(planes, anchor.lengths, anchor.held, kp, C, new_c)
        C = new_c
    # Slot j of row b is position anchor.lengths[b] + j; a row's slots past its
    # keep repeat its last kept slot (equal writes to one column), and a row
    # keeping nothing writes back what it holds.
    k = np.array(keep)[:, None]
    slot = np.minimum(np.arange(K)[None, :], np.maximum(k - 1, 0))
    pos = np.array(anchor.lengths, np.int64)[:, None] + slot
    dst = column_of(pos, kp, C)
    new = _gather(state.planes, column_of(pos, kp, state.capacity))
    old = _gather(planes, dst)
    mask = mx.array(k > 0)[:, None, :, None]
    write = columns_writer(dst.tolist())
    keys, values = (write(p, mx.where(mask, x, o)) for p, x, o in zip(planes, new, old))
    return derived(anchor, lengths=tuple(lengths), held=tuple(held), keys=keys, values=values)


# --- rows: merge, filter, extract --------------------------------------------------------


@ops.filter_rows.register
def filter_rows_ring(state: RotatingState, rows):
    rows = row_list(rows, state.batch_size)
    fields = ("lengths", "held", "keys", "values")
    return derived(
        state,
        **{f: rows_of(getattr(state, f), rows) for f in fields},
        row_ids=distinct_row_ids(rows_of(row_ids_of(state), rows)),
    )


@ops.extract_row.register
def extract_row_ring(state: RotatingState, row):
    """One row with a compact copy of what it holds (capacity = held; pins nothing)."""
    row = row_index(row, state.batch_size)
    one = derived(
        state,
        lengths=(state.lengths[row],),
        held=(state.held[row],),
        keys=None,
        values=None,
        row_ids=(row_ids_of(state)[row],),
    )
    if state.keys is None:
        return one
    h = state.held[row]
    planes = _relayout(
        tuple(p[row : row + 1] for p in state.planes),
        one.lengths,
        one.held,
        state.keep,
        state.capacity,
        h,
    )
    keys, values = (mx.contiguous(p) for p in planes)
    return derived(one, keys=keys, values=values)


@ops.merge_same_kind.register
def merge_rows_ring(first: RotatingState, states):
    _rows.check_same_geometry(states, ("max_size", "keep"))
    C = max(s.capacity for s in states)
    full = [s for s in states if s.keys is not None]
    keys = values = None
    if full:
        ref = full[0]
        parts = []
        for s in states:
            if s.keys is None:
                parts.append(
                    tuple(
                        mx.zeros((s.batch_size, p.shape[1], C, p.shape[3]), p.dtype)
                        for p in ref.planes
                    )
                )
            else:
                parts.append(_relayout(s.planes, s.lengths, s.held, s.keep, s.capacity, C))
        keys = mx.concatenate([p[0] for p in parts], axis=0)
        values = mx.concatenate([p[1] for p in parts], axis=0)
    return derived(
        first,
        lengths=sum((s.lengths for s in states), ()),
        held=sum((s.held for s in states), ()),
        keys=keys,
        values=values,
        row_ids=distinct_row_ids(sum((s.row_ids for s in states), ())),
    )


# --- the compile boundary (kvstate.compiled) for rings -----------------------------------


@compiled.host_positions.register
def host_positions_ring(state: RotatingState):
    return (state.lengths, state.held)


@compiled.with_capacity.register
def with_capacity_ring(state: RotatingState, capacity: int):
    capacity = compiled.check_capacity(state, capacity)
    if state.capacity == capacity:
        return state
    check(capacity >= state.width, "capacity", f">= {state.width} (entries a row holds)", capacity)
    keys, values = _relayout(
        state.planes, state.lengths, state.held, state.keep, state.capacity, capacity
    )
    return derived(state, keys=keys, values=values)


@compiled.prepare.register
def prepare_ring(state: RotatingState, n: int = 1):
    n = compiled.check_room(state, n)
    _, _, kept, C = _plan(state, n)
    if C == state.capacity:
        return state
    keys, values = _relayout(state.planes, state.lengths, kept, state.keep, state.capacity, C)
    return derived(state, held=kept, keys=keys, values=values)


@compiled.advanced.register
def advanced_ring(state: RotatingState, n: int = 1) -> dict:
    lengths, held, _, _ = _plan(state, n)
    return {"lengths": lengths, "held": held}


@compiled.traced_offset.register
def traced_offset_ring(proto: RotatingState, view: compiled.Traced, ctx: compiled.TraceContext):
    return view.positions[0]


def _ring_after(proto, view, n, ctx):
    lengths, held = view.positions
    return ctx.shared(
        ("ring-after", n, proto.keep, proto.max_size),
        (lengths, held),
        lambda: advance(lengths, held, n, max_size=proto.max_size, keep=proto.keep),
    )


@compiled.traced_update.register
def traced_update_ring(
    proto: RotatingState, view: compiled.Traced, k, v, ctx: compiled.TraceContext
):
    _rows.check_geometry(
        _rows.geometry(derived(proto, keys=view.planes[0], values=view.planes[1])), k, v
    )
    N = k.shape[2]  # a block (a verify window) holds up to max_size + N - 1, as append does
    lengths, _ = view.positions
    C = view.capacity
    write = ctx.shared(
        ("ring-write", N, proto.keep, C),
        (lengths,),
        lambda: ring_writer(lengths, N, keep=proto.keep, capacity=C),
    )
    planes = (write(view.planes[0], k), write(view.planes[1], v))
    after = _ring_after(proto, view, N, ctx)
    return compiled.Traced(proto, planes, after, view.same_end), planes[0], planes[1]


@compiled.traced_mask.register
def traced_mask_ring(
    proto: RotatingState, view: compiled.Traced, n: int, window, ctx: compiled.TraceContext
):
    lengths, held = view.positions
    C, w = view.capacity, window or proto.max_size

    def build():
        ln, hd = _ring_after(proto, view, n, ctx)
        return ring_mask(n, ln, hd, keep=proto.keep, capacity=C, width=C, window=w)

    return ctx.shared(("ring-mask", n, w, C, proto.keep), (lengths, held), build)


# --- invariants (kvstate.core.invariants) ---------------------------------------------------------


@validate.register
def validate_ring(state: RotatingState):
    """Counts per row, ``held <= lengths`` with the kept prefix held, ``0 <=
    keep < max_size``, and planes ``[B, H, C, D]`` of one float dtype with
    every row's held entries fitting in ``C``."""
    B = check_counts(state, "state", ("lengths", "held"))
    max_size = check_int(state.max_size, "state.max_size", 1)
    keep = check_int(state.keep, "state.keep", 0, max_size - 1)
    check_int(state.step, "state.step", 1)
    _check_held(state, keep)
    keys, values = state.keys, state.values
    if keys is None or values is None:
        _check_planeless(state)
        return state
    _check_ring_planes(state, B, keys, values)
    return state


def _check_held(state: RotatingState, keep: int) -> None:
    """Check each row's ``held`` against its ``lengths`` and the kept prefix."""
    for b, (n, h) in enumerate(zip(state.lengths, state.held)):
        if h > n:
            raise bad(f"state.held[{b}]", f"<= lengths[{b}] = {n} (tokens the row has seen)", h)
        if n <= keep and h != n:
            raise bad(f"state.held[{b}]", f"{n} (a row inside its kept prefix holds it all)", h)
        if n > keep and h < keep:
            raise bad(f"state.held[{b}]", f">= keep = {keep} (the kept prefix is never evicted)", h)


def _check_planeless(state: RotatingState) -> None:
    """Check a state missing a plane: both planes ``None`` and every length zero."""
    keys, values = state.keys, state.values
    if keys is not None or values is not None:
        raise bad(
            "state.keys and state.values",
            "both set or both None",
            f"{type(keys).__name__} and {type(values).__name__}",
        )
    if any(state.lengths):
        raise bad("state.lengths", "zeros before the first append (no planes)", state.lengths)


def _check_ring_planes(state: RotatingState, B: int, keys: mx.array, values: mx.array) -> None:
    """Check the planes: ``[B, H, C, D]`` of one float dtype, every row's held fitting in ``C``."""
    _, H, C, _ = check_plane("state.keys", keys, B)
    check_plane("state.values", values, B, C, H)
    check_float("state.keys", keys.dtype)
    if values.dtype != keys.dtype:
        raise bad("state.values dtype", f"{keys.dtype} as keys", values.dtype)
    for b, h in enumerate(state.held):
        if h > C:
            raise bad(f"state.held[{b}]", f"<= {C} (the capacity)", h)


@clear_hidden.register
def _clear_ring(state: RotatingState):
    if state.keys is None or min(state.held, default=0) == state.capacity:
        return state
    C = state.capacity
    holds, _ = _ranks(
        np.array(state.lengths, np.int64), np.array(state.held, np.int64), state.keep, C, C
    )
    planes = state.planes
    new = cleared(planes, holds)
    return state if new is planes else derived(state, keys=new[0], values=new[1])
