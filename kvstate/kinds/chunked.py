"""Chunked local attention: ``ChunkedState``, mlx-lm's ``ChunkedKVCache``, batched.

The dense row layout (``kvstate.core.records``) with the oldest tokens dropped
from the front. One row, ``chunk_size = 4``, after 10 tokens and a
``trim_front``::

    position:   .  .  .  .  6  7  8  9          start = 6, lengths = 4
    column:     0  1  2  3  4  5  6  7          left_pad = 4 (then sliced off
                                                 when every row shares it)

The chunk rule (mlx-lm's ``ChunkedKVCache`` with llama4's chunk mask): a
query at position ``p`` sees the held positions ``j <= p`` with ``j //
chunk_size == p // chunk_size``. ``trim_front`` (mlx-lm's
``maybe_trim_front``, which the model calls before each forward) keeps the
last ``chunk_size`` tokens of each row: every later query's chunk starts
inside them. Rows advance independently, as dense rows do; appends, fetch,
trim and row moves are the dense code, with ``start`` carried along.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..compiled import boundary as compiled
from ..core import ops
from ..core.args import as_int, per_row, row_index, row_list
from ..core.invariants import check_counts, check_int, clear_columns, validate
from ..core.masks import MaskKey, lease
from ..core.records import Checkpoint, ChunkedState, derived
from ..errors import bad, check
from . import dense as _dense
from . import rows as _rows

__all__ = ["chunk_mask", "chunked_state", "trim_front"]


def chunked_state(batch_size: int = 1, *, chunk_size: int, step: int = 256) -> ChunkedState:
    """An empty ``ChunkedState`` of ``batch_size`` rows.

    Args:
        chunk_size: the attention chunk (mlx-lm ``ChunkedKVCache(chunk_size)``).
        step: capacity grows in multiples of this.
    """
    base = _dense.empty(batch_size, step=step)
    chunk_size = as_int(chunk_size, "chunk_size")
    check(chunk_size >= 1, "chunk_size", ">= 1", chunk_size)
    return ChunkedState(
        base.lengths, base.left_pad, base.step, start=base.lengths, chunk_size=chunk_size
    )


@validate.register(ChunkedState)
def validate_chunked(state):
    """The dense checks, one ``start`` per row, ``chunk_size >= 1``."""
    _dense.validate_dense(state)
    check_counts(state, "state", ("start",))
    check_int(state.chunk_size, "state.chunk_size", 1)
    return state


@_rows.geometry.register(ChunkedState)
def _geometry_chunked(state):
    if state.keys is None:
        return None
    return (state.keys.shape[1], state.keys.shape[3], state.values.shape[3], state.keys.dtype)


@_rows.to_planes.register(ChunkedState)
def _to_planes_chunked(state, k, v):
    return (k, v)


@_rows.with_planes.register(ChunkedState)
def _with_planes_chunked(state, planes, **changes):
    keys, values = planes if planes else (None, None)
    return derived(state, keys=keys, values=values, **changes)


def trim_front(state: ChunkedState) -> ChunkedState:
    """Rows holding more than ``chunk_size`` tokens drop the oldest (mlx-lm's
    ``maybe_trim_front``); padding columns every row then shares are sliced off."""
    cs = state.chunk_size
    drop = [max(0, n - cs) for n in state.lengths]
    if not any(drop):
        return state
    lengths = tuple(n - d for n, d in zip(state.lengths, drop))
    start = tuple(s + d for s, d in zip(state.start, drop))
    left_pad = [p + d for p, d in zip(state.left_pad, drop)]
    shared = min(left_pad)
    planes = state.planes
    if shared:
        planes = tuple(p[:, :, shared:, :] for p in planes)
    return _rows.with_planes(
        state, planes, lengths=lengths, start=start, left_pad=tuple(p - shared for p in left_pad)
    )


# --- reading -------------------------------------------------------------------------


def _bounds(n: int, left_pad, ends, offsets, chunk_size: int):
    """Per row and query, the first and last visible column (host ints)."""
    lo, hi = [], []
    for lp, e, o in zip(left_pad, ends, offsets):
        for i in range(n):
            col, pos = e - n + i, o - n + i
            lo.append(max(lp, col - pos % chunk_size))
            hi.append(col)
    return tuple(lo), tuple(hi)


def chunk_mask(
    n: int, left_pad: Sequence[int], ends: Sequence[int], offsets: Sequence[int], chunk_size: int
) -> mx.array:
    """The bool mask ``[B, 1, n, max(ends)]`` of the chunk rule.

    Query ``i`` of row ``b`` stands at column ``ends[b] - n + i`` and position
    ``offsets[b] - n + i``; it sees the columns from its chunk's first held
    position (never before ``left_pad[b]``) up to itself.
    """
    B = len(ends)
    lo, hi = _bounds(n, left_pad, ends, offsets, chunk_size)
    cols = mx.arange(max(ends), dtype=mx.int32)
    lo = mx.array(lo, dtype=mx.int32).reshape(B, 1, n, 1)
    hi = mx.array(hi, dtype=mx.int32).reshape(B, 1, n, 1)
    return (cols >= lo) & (cols <= hi)


def _read_mask(n, left_pad, ends, offsets, chunk_size, memo):
    key = MaskKey("chunk", (n, tuple(left_pad), tuple(ends), tuple(offsets), chunk_size))
    lease_ = lease(memo, key, lambda: chunk_mask(n, left_pad, ends, offsets, chunk_size))
    return lease_.mask, lease_


@ops.fetch.register(ChunkedState)
def fetch_chunked(state):
    check(state.keys is not None, "state", "a state holding keys (append first)", "an empty state")
    return _rows.columns(state.planes, state.width)


@ops.positions.register(ChunkedState)
def positions_chunked(state):
    offsets = state.offsets
    return None if len(set(offsets)) <= 1 else mx.array(offsets, dtype=mx.int32)


@ops.next_mask.register(ChunkedState)
def next_mask_chunked(state, n, *, memo=None, window=None, array=False):
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    check(window is None, "window", "None (a chunked layer's window is its chunk)", window)
    lp = state.left_pad
    ends = tuple(e + n for e in state.ends)
    offsets = tuple(o + n for o in state.offsets)
    return _read_mask(n, lp, ends, offsets, state.chunk_size, memo)


@ops.attend.register(ChunkedState)
def attend_chunked(state, q, *, scale: float, memo=None, window=None):
    check(window is None, "window", "None (a chunked layer's window is its chunk)", window)
    n = _rows.validate_queries(state, q, scale=scale, window=None)
    keys, values = fetch_chunked(state)
    return _rows.under_mask(
        _read_mask(n, state.left_pad, state.ends, state.offsets, state.chunk_size, memo),
        lambda mask: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask),
    )


# --- checkpoint, rollback ---------------------------------------------------------------


@ops.checkpoint.register(ChunkedState)
def checkpoint_chunked(state):
    """Tokens seen per row (``offsets``): a later ``trim_front`` moves columns, not positions."""
    return Checkpoint(state.offsets, (0,) * state.batch_size, row_ids=state.row_ids)


def _rolled_back(b: int, t: int, start: int, offset: int, cs: int):
    """``(start, lengths)`` of row ``b`` back at ``t`` tokens seen, or refused.

    Exact when the row still holds every position of ``t``'s chunk before
    ``t`` (``[t // cs * cs, t)``), all that a later query can read of its
    past. One forward after a checkpoint always leaves that (its
    ``trim_front`` keeps the last ``chunk_size`` tokens); a later forward
    may have dropped them.
    """
    check(
        t <= offset,
        f"checkpoint + keep for row {b}",
        f"<= {offset} (the tokens the row has seen)",
        t,
    )
    first = t // cs * cs
    if start <= first:
        return start, t - start
    if t == first:  # a chunk starts at t: nothing before it is read again
        return t, 0
    raise bad(
        f"checkpoint + keep for row {b}",
        f">= {start} or a multiple of chunk_size={cs} (positions {first}..{start - 1} "
        "of its chunk were dropped by a later trim_front)",
        t,
    )


@ops.rollback.register(ChunkedState)
def rollback_chunked(state, checkpoint, keep=0):
    if not isinstance(checkpoint, Checkpoint):
        raise bad("checkpoint", "a Checkpoint", type(checkpoint).__name__)
    check(
        checkpoint.batch_size == state.batch_size,
        "checkpoint batch size",
        state.batch_size,
        checkpoint.batch_size,
    )
    _rows.check_checkpoint_rows(state, checkpoint)
    keep = per_row(keep, state.batch_size, "keep")
    rows = [
        _rolled_back(b, c + k, s, o, state.chunk_size)
        for b, (c, k, s, o) in enumerate(zip(checkpoint.lengths, keep, state.start, state.offsets))
    ]
    lengths = tuple(r[1] for r in rows)
    # a row keeps its first columns: those after them are dropped, and cleared
    # (a rejected draft's NaN or inf never reaches a read: notes/core.md)
    drop = [range(p + m, p + n) for p, m, n in zip(state.left_pad, lengths, state.lengths)]
    return _rows.with_planes(
        state, clear_columns(state.planes, drop), start=tuple(r[0] for r in rows), lengths=lengths
    )


# --- rows: filter, extract, merge ---------------------------------------------------------


@ops.filter_rows.register(ChunkedState)
def filter_rows_chunked(state, rows):
    rows = row_list(rows, state.batch_size)
    out = ops.filter_rows.dispatch(_rows._Rows)(state, rows)
    return derived(out, start=tuple(state.start[r] for r in rows))


@ops.extract_row.register(ChunkedState)
def extract_row_chunked(state, row):
    row = row_index(row, state.batch_size)
    out = ops.extract_row.dispatch(_rows._Rows)(state, row)
    return derived(out, start=(state.start[row],))


@ops.merge_same_kind.register(ChunkedState)
def merge_chunked(first, states):
    _rows.check_same_geometry(states, ("chunk_size",))
    out = ops.merge_same_kind.dispatch(_rows._Rows)(first, states)
    return derived(out, start=sum((s.start for s in states), ()))


@compiled.prepare.register(ChunkedState)
def prepare_chunked(state, n: int = 1):
    """Refused: the model reading a chunked layer (llama4) builds its chunk mask
    from ``start_position`` and ``offset`` as Python ints, which a trace would
    freeze (one trace per token); decode it with ``kvstate.mlx_lm.step``."""
    raise bad(
        "state",
        "a record the compiled decoder can trace (llama4 reads its chunk "
        "position as a Python int: decode with kvstate.mlx_lm.step)",
        "a ChunkedState",
    )
