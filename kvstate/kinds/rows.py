"""Row machinery shared by every record kind with the dense row layout.

``CacheState`` and ``QuantizedState`` (and any later kind that lays its rows
out as pictured in ``kvstate.core.records``) share everything here: validation of
new tokens and queries, growth, the column writer, append plans, masks over
padded rows, and moving rows (trim, rollback, filter, extract, merge). It all
works plane by plane (two planes for ``CacheState``, six for
``QuantizedState``), so moving rows and columns never looks inside a plane:
quantized bytes are moved, never requantized.

What differs per kind is three ``singledispatch`` hooks registered beside
the kind: ``geometry`` (heads, head dims, dtype), ``to_planes`` (new tokens
in the kind's storage format) and ``with_planes`` (rebuild the record).
"""

from __future__ import annotations

import operator
from functools import lru_cache, singledispatch
from typing import Any, NamedTuple, Optional

import mlx.core as mx
import numpy as np

from ..compiled import boundary as compiled
from ..core import ops
from ..core.args import as_int, check_scale, per_row, row_index, row_list
from ..core.invariants import (
    _clear_indices,
    check_counts,
    check_float,
    check_int,
    clear_at,
    clear_columns,
    clear_hidden,
    cleared,
    distinct_row_ids,
)
from ..core.masks import check_memo, lease, rows_key, rows_mask
from ..core.records import CacheState, Checkpoint, QuantizedState, _Rows, row_ids_of, rows_of
from ..errors import bad, check
from ..kernels.stock import column_writer


def round_up(n: int, step: int) -> int:
    """The smallest multiple of ``step`` that holds ``n``."""
    return -(-n // step) * step


# --- per-kind hooks -------------------------------------------------------------


@singledispatch
def geometry(state):
    """``(H, Dk, Dv, dtype)`` of the stored rows, or ``None`` before the first append."""
    raise NotImplementedError(type(state).__name__)


def kv_geometry(keys: Any, values: Any):
    """``(H, Dk, Dv, dtype)`` of ``[B, H, C, D]`` key and value planes (``None``: no planes)."""
    if keys is None:
        return None
    return (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)


@singledispatch
def to_planes(state, k, v) -> tuple:
    """New tokens ``k``, ``v`` as planes in this record's storage format.

    Reads only the record's static fields (``group_size``, ``bits``), so the
    compiled step calls it on a row-less record of the same kind.
    """
    raise NotImplementedError(type(state).__name__)


@singledispatch
def with_planes(state, planes, **changes):
    """A copy of ``state`` holding ``planes`` (and any field ``changes``)."""
    raise NotImplementedError(type(state).__name__)


# --- validation of new tokens -------------------------------------------------------


def check_kv(arg_k, k, arg_v, v):
    """``k``/``v`` are rank-4 arrays of one batch, heads, length and dtype."""
    # Messages are formatted only on failure: this runs on every append.
    for arg, x in ((arg_k, k), (arg_v, v)):
        if not isinstance(x, mx.array):
            raise bad(arg, "an mx.array [B, H, N, D]", type(x).__name__)
        if x.ndim != 4:
            raise bad(f"{arg} rank", "4 ([B, H, N, D])", f"{x.ndim} {list(x.shape)}")
    ks, vs = k.shape, v.shape
    if vs[:3] != ks[:3]:
        raise bad(f"{arg_v} shape[:3]", f"{list(ks[:3])} as {arg_k}", list(vs[:3]))
    if v.dtype != k.dtype:
        raise bad(f"{arg_v} dtype", f"{k.dtype} as {arg_k}", v.dtype)


def fits(k, v, B: int, H: int, Dk: int, Dv: int, dtype) -> bool:
    """Whether new tokens ``k``, ``v`` fit rows of this batch and geometry: one
    comparison of shapes and dtypes (it runs on every append, every layer);
    ``validate_tokens`` names what does not fit."""
    if type(k) is not mx.array or type(v) is not mx.array:
        return False
    ks = k.shape
    return (
        len(ks) == 4
        and ks[0] == B
        and ks[1] == H
        and ks[3] == Dk
        and ks[2] >= 1
        and v.shape == (B, H, ks[2], Dv)
        and k.dtype == dtype
        and v.dtype == dtype
    )


def validate_tokens(state, k, v):
    """Host checks of new tokens against the record's batch and geometry."""
    geo = geometry(state)
    if geo is not None and fits(k, v, state.batch_size, *geo):
        return
    check_kv("k", k, "v", v)
    B, N = k.shape[0], k.shape[2]
    check(B == state.batch_size, "k batch size", state.batch_size, B)
    check(N >= 1, "k tokens (shape[2])", ">= 1", N)
    check_float("k", k.dtype)
    if geo is not None:
        check_geometry(geo, k, v)


def check_geometry(geo, k, v) -> None:
    """New tokens ``k``, ``v`` have the heads, head dims and dtype ``geo`` =
    ``(H, Dk, Dv, dtype)`` of the rows they go to. Shapes only, so it also
    runs on traced arrays (a compiled step checks while it traces: a model
    of another geometry is refused, not broadcast)."""
    H, Dk, Dv, dtype = geo
    check(k.shape[1] == H, "k heads (shape[1])", H, k.shape[1])
    check(k.shape[3] == Dk, "k head dim (shape[3])", Dk, k.shape[3])
    check(v.shape[3] == Dv, "v head dim (shape[3])", Dv, v.shape[3])
    check(k.dtype == dtype, "k dtype", dtype, k.dtype)


# --- capacity and writes (host ints or traced arrays) ---------------------------------


def resize(planes, capacity: int) -> tuple:
    """Planes of exactly ``capacity`` columns: zero columns appended, or the
    columns past ``capacity`` dropped (the caller checks nothing held is lost).

    Every capacity change of the row layout goes through here: append growth,
    the compile boundary's buckets, and a ring that has not wrapped.
    """
    C = planes[0].shape[2] if planes else capacity
    if C == capacity:
        return tuple(planes)
    if capacity < C:
        return tuple(p[:, :, :capacity, :] for p in planes)
    return tuple(
        mx.concatenate(
            [p, mx.zeros((p.shape[0], p.shape[1], capacity - C, p.shape[3]), p.dtype)], axis=2
        )
        for p in planes
    )


class AppendPlan:
    """What appending ``n`` tokens does to rows of one layout, from host ints alone.

    The new ``lengths``, the width after the append, the capacity to grow
    to, and the column writer: none of it depends on the planes' heads or
    head dims, so every record with the same rows and capacity (every layer
    of a model, in one forward) shares one plan through ``Plans``.
    """

    __slots__ = (
        "lengths",
        "left_pad",
        "step",
        "capacity",
        "n",
        "width",
        "grow",
        "write",
        "new_lengths",
    )

    def __init__(self, lengths: tuple, left_pad: tuple, step: int, capacity: int, n: int):
        self.lengths, self.left_pad, self.step, self.capacity, self.n = (
            lengths,
            left_pad,
            step,
            capacity,
            n,
        )
        ends = tuple(map(operator.add, left_pad, lengths))
        self.width = need = max(ends, default=0) + n
        self.new_lengths = tuple([m + n for m in lengths])
        self.grow = round_up(need, step) if need > capacity else 0  # the new capacity
        self.write = column_writer(ends, n)

    def apply(self, state, planes, new, rebuild=None):
        """``state`` with ``new`` planes written into ``planes`` (grown first if needed).

        ``rebuild``: the kind's ``with_planes`` when the caller knows it (the
        hot path skips the dispatch).
        """
        if self.grow:
            planes = resize(planes, self.grow)
        write = self.write
        return (rebuild or with_planes)(
            state, tuple([write(p, x) for p, x in zip(planes, new)]), lengths=self.new_lengths
        )


class Plans:
    """The ``AppendPlan``s of one batch of appends (the bridge: one forward).

    Every layer of a decode step holds the same rows, and after one shared
    plan their records hold the very same ``lengths`` and ``left_pad``
    tuples, so the last plan is found by identity, without hashing.
    """

    __slots__ = ("_last", "_by_key")

    def __init__(self):
        self._last = None
        self._by_key = {}

    def get(self, state, capacity: int, n: int) -> AppendPlan:
        plan = self._last
        if (
            plan is not None
            and plan.lengths is state.lengths
            and plan.left_pad is state.left_pad
            and plan.capacity == capacity
            and plan.n == n
            and plan.step == state.step
        ):
            return plan
        key = (state.lengths, state.left_pad, state.step, capacity, n)
        plan = self._by_key.get(key)
        if plan is None:
            plan = self._by_key[key] = AppendPlan(*key)
        self._last = plan
        return plan


def plan_for(state, n: int, plans: Optional[Plans]) -> AppendPlan:
    """The plan for appending ``n`` tokens to ``state`` (from ``plans`` when given)."""
    if plans is None:
        return AppendPlan(state.lengths, state.left_pad, state.step, state.capacity, n)
    return plans.get(state, state.capacity, n)


@ops.append.register
def append_rows(state: _Rows, k, v):
    validate_tokens(state, k, v)
    new = to_planes(state, k, v)
    planes = state.planes
    if not planes:
        B, need = state.batch_size, state.width + k.shape[2]
        C = round_up(need, state.step)
        planes = tuple(mx.zeros((B, x.shape[1], C, x.shape[3]), x.dtype) for x in new)
    return plan_for(state, k.shape[2], None).apply(state, planes, new)


@ops.update_and_read.register
def update_and_read_rows(state: _Rows, k, v, plans: Optional[Plans] = None):
    state = ops.append(state, k, v)
    return (state, *ops.fetch(state))


def columns(planes, width: int) -> tuple:
    """Each plane over columns ``[0, width)``."""
    if not planes or planes[0].shape[2] == width:
        return tuple(planes)
    return tuple(p[:, :, :width, :] for p in planes)


@ops.positions.register
def positions_rows(state: _Rows):
    return None if state.aligned else mx.array(state.lengths, dtype=mx.int32)


# --- masks and attention -------------------------------------------------------------


def rows_read_mask(n: int, left_pad: tuple, ends: tuple, memo, window, array=False):
    """``(mask, lease_or_None)`` for ``n`` queries of rows ending at ``ends``.

    Aligned rows with no window need no array (unless ``array``): ``None``
    for one query, ``"causal"`` (the fused kernel's bottom-right mode) for
    several. Release the lease once the read is built.
    """
    if (
        not array
        and window is None
        and (not ends or ends.count(ends[0]) == len(ends))
        and not any(left_pad)
    ):
        return (None if n == 1 else "causal"), None  # aligned
    key = rows_key(n, left_pad, ends, window)
    lease_ = lease(memo, key, lambda: rows_mask(n, left_pad, ends, max(ends, default=0), window))
    return lease_.mask, lease_


def next_count(n, memo) -> int:
    """``next_mask``'s arguments checked on the host: ``n`` as a positive int
    (returned), ``memo`` a ``MaskMemo`` when given."""
    if memo is not None:
        check_memo(memo)
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    return n


@ops.next_mask.register
def next_mask_rows(state: _Rows, n, *, memo=None, window=None, array=False):
    n = next_count(n, memo)
    # The rows after n more tokens, from host ints alone (no record is built).
    left_pad = state.left_pad
    ends = tuple([p + m + n for p, m in zip(left_pad, state.lengths)])
    return rows_read_mask(n, left_pad, ends, memo, window, array)


def read_mask(state: _Rows, n: int, memo=None, window=None):
    """The mask ``attend`` uses for ``n`` queries at the rows' ends: ``(mask, lease)``."""
    return rows_read_mask(n, state.left_pad, state.ends, memo, window)


def under_mask(mask_and_lease, read):
    """``read(mask)``, then release the mask's lease (if any) whatever happens."""
    mask, lease_ = mask_and_lease
    try:
        return read(mask)
    finally:
        if lease_ is not None:
            lease_.release()


@singledispatch
def sdpa(state, q, keys, values, *, scale: float, mask):
    """The attention read of ``q`` over this kind's fetched ``keys``/``values``
    under ``mask`` (default: MLX's fused SDPA; quantized rows have their own
    ``attend``, through ``_quantized.read_route``)."""
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


@ops.attend.register
def attend_rows(state: _Rows, q, *, scale: float, memo=None, window=None):
    n = validate_queries(state, q, scale=scale, window=window, memo=memo)
    keys, values = ops.fetch(state)
    return under_mask(
        read_mask(state, n, memo, window),
        lambda mask: sdpa(state, q, keys, values, scale=scale, mask=mask),
    )


def validate_queries(state, q, *, scale, window, memo=None, holds=None) -> int:
    """Host checks of ``attend``'s arguments against any record; returns ``N``.

    ``holds``: the tokens each row can be read at (default ``lengths``; a
    ring passes what it still holds). ``memo`` is checked even when the read
    needs no mask (a wrong memo is an error, not ignored).
    """
    if memo is not None:
        check_memo(memo)
    geo = geometry(state)
    check(geo is not None, "state", "a state holding keys (append first)", "an empty state")
    H, dk, _, dtype = geo
    check_scale(scale)
    if not isinstance(q, mx.array):
        raise bad("q", "an mx.array [B, Hq, N, D]", type(q).__name__)
    check(q.ndim == 4, "q rank", "4 ([B, Hq, N, D])", f"{q.ndim} {list(q.shape)}")
    check(q.shape[0] == state.batch_size, "q batch size", state.batch_size, q.shape[0])
    check(q.shape[3] == dk, "q head dim (shape[3])", dk, q.shape[3])
    check(
        q.shape[1] % H == 0, "q heads (shape[1])", f"a multiple of {H} (the KV heads)", q.shape[1]
    )
    check(q.dtype == dtype, "q dtype", dtype, q.dtype)
    n = q.shape[2]
    check(n >= 1, "q tokens (shape[2])", ">= 1", n)
    short = min(state.lengths if holds is None else holds, default=n)
    check(
        n <= short,
        "q tokens (shape[2])",
        f"<= {short}, the fewest tokens a row holds (queries are each row's last N)",
        n,
    )
    if window is not None:
        w = as_int(window, "window")
        check(w >= 1, "window", ">= 1", w)
    return n


# --- lengths: trim, checkpoint, rollback ----------------------------------------------


def trimmed_lengths(state, n, counted: str = "tokens the row holds") -> tuple:
    """Each row's length after ``trim(state, n)``: ``n`` checked per row
    against ``state.lengths`` (what a row's length counts: ``counted``)."""
    n = per_row(n, state.batch_size, "n")
    for b, (m, have) in enumerate(zip(n, state.lengths)):
        check(m <= have, f"n for row {b}", f"<= {have} ({counted})", m)
    return tuple(h - m for h, m in zip(state.lengths, n))


@ops.trim.register
def trim_rows(state: _Rows, n):
    return _shorten(state, trimmed_lengths(state, n))


def _shorten(state, lengths: tuple):
    """``state`` holding ``lengths`` (each ``<=`` what its row holds), the
    dropped columns cleared (``invariants.clear_columns``)."""
    drop, hidden = _dropped(state.left_pad, state.lengths, lengths, state.capacity)
    return with_planes(state, clear_columns(state.planes, drop, hidden), lengths=lengths)


# Every layer of a model has the same rows, so a rollback, trim or checkpoint of all
# its layers works each of these out once (host work per layer, every speculative
# round): pure functions of host ints, the last layout remembered (lru_cache(1)).


@lru_cache(maxsize=1)
def _dropped(left_pad: tuple, lengths: tuple, new: tuple, C: int) -> tuple:
    """``(drop, hidden)`` for ``clear_columns``: each row's dropped columns, and a
    column of its own past its end or in its padding (hidden: zeros), where the
    clear writes its zero when the row drops nothing (one kernel per plane)."""
    drop = tuple(range(p + m, p + n) for p, m, n in zip(left_pad, new, lengths))
    hidden = tuple(
        p + n if p + n < C else (p - 1 if p else None) for p, n in zip(left_pad, lengths)
    )
    return drop, hidden


@lru_cache(maxsize=1)
def _checkpoint(lengths: tuple, left_pad: tuple, row_ids) -> Checkpoint:
    return Checkpoint(lengths, left_pad, row_ids=row_ids)  # a value: no arrays


@ops.checkpoint.register
def checkpoint_rows(state: _Rows):
    return _checkpoint(state.lengths, state.left_pad, state.row_ids)


def check_checkpoint_rows(state, cp, arg: str = "checkpoint") -> None:
    """``cp`` (a checkpoint, or a ring's anchor record) was taken of ``state``'s
    rows, in this order (``row_ids``; ``kvstate.core.invariants``)."""
    if cp.row_ids is None:
        raise bad(
            arg,
            "one kv.checkpoint took of this record's rows (with row_ids)",
            "a checkpoint without row ids",
        )
    if cp.row_ids != state.row_ids:
        raise bad(
            f"{arg} rows (row_ids)",
            f"{state.row_ids} (this record's rows, in order)",
            f"{cp.row_ids} (taken before a merge, filter or reorder, or of another record)",
        )


def checkpoint_target(state, cp, keep):
    """The rows' target lengths for ``rollback`` (every record kind checks this way)."""
    if not isinstance(cp, Checkpoint):
        raise bad("checkpoint", "a Checkpoint", type(cp).__name__)
    check(
        cp.batch_size == state.batch_size, "checkpoint batch size", state.batch_size, cp.batch_size
    )
    check_checkpoint_rows(state, cp)
    check(
        cp.left_pad == state.left_pad,
        "checkpoint left_pad",
        f"{state.left_pad} (the state's row layout)",
        cp.left_pad,
    )
    keep = per_row(keep, state.batch_size, "keep")
    return tuple(c + k for c, k in zip(cp.lengths, keep))


class _Layout(NamedTuple):
    """A record's rows as ``checkpoint_target`` reads them (host values only)."""

    lengths: tuple
    left_pad: tuple
    row_ids: Any
    batch_size: int


def check_checkpoint(state, cp, keep):
    """Validated target lengths for a dense ``rollback``: within what each row holds
    (worked out once for the layers of a model: the same rows, checkpoint and keep)."""
    if type(cp) is Checkpoint and (
        type(keep) is int or (type(keep) in (tuple, list) and all(type(k) is int for k in keep))
    ):
        keep = keep if type(keep) is int else tuple(keep)
        return _rollback_target(state.lengths, state.left_pad, state.row_ids, cp, keep)
    return _check_target(state, cp, keep)


def _check_target(state, cp, keep) -> tuple:
    target = checkpoint_target(state, cp, keep)
    for b, (t, have) in enumerate(zip(target, state.lengths)):
        check(t <= have, f"checkpoint + keep for row {b}", f"<= {have} (tokens the row holds)", t)
    return target


@lru_cache(maxsize=1)
def _rollback_target(lengths: tuple, left_pad: tuple, row_ids, cp: Checkpoint, keep) -> tuple:
    return _check_target(_Layout(lengths, left_pad, row_ids, len(lengths)), cp, keep)


# The last rollback's layout: ``(lengths, left_pad, row_ids, capacity, checkpoint,
# keep, (target, clear indices))``. A model's layers after one shared append hold the
# very same ``lengths`` and ``row_ids`` (their ``left_pad`` equal tuples), and
# ``kv.checkpoint`` gives them one ``Checkpoint`` (``_checkpoint``), so rolling back
# every layer to one ``keep`` is checked and worked out once (immutable host values:
# the same values, the same answer; matched by identity first), not once per layer
# (a speculative round rolls back every layer).
_LAST_ROLLBACK: tuple = ()


def _same(a, b) -> bool:
    return a is b or a == b


@ops.rollback.register
def rollback_rows(state: _Rows, checkpoint, keep=0):
    last = _LAST_ROLLBACK
    if (
        last
        and _same(last[0], state.lengths)
        and _same(last[1], state.left_pad)
        and _same(last[2], state.row_ids)
        and last[3] == state.capacity
        and (last[4] is checkpoint or type(checkpoint) is Checkpoint and last[4] == checkpoint)
        and type(keep) is type(last[5])
        and _same(last[5], keep)
    ):
        target, cleared = last[6]
        return with_planes(state, clear_at(state.planes, *cleared), lengths=target)
    target = check_checkpoint(state, checkpoint, keep)
    if type(checkpoint) is not Checkpoint or type(keep) not in (int, tuple):
        return _shorten(state, target)
    drop, hidden = _dropped(state.left_pad, state.lengths, target, state.capacity)
    cleared = _clear_indices(drop, hidden)
    _remember(state, checkpoint, keep, (target, cleared))
    return with_planes(state, clear_at(state.planes, *cleared), lengths=target)


def _remember(state, checkpoint, keep, worked) -> None:
    global _LAST_ROLLBACK
    _LAST_ROLLBACK = (
        state.lengths,
        state.left_pad,
        state.row_ids,
        state.capacity,
        checkpoint,
        keep,
        worked,
    )


@ops.anchor.register
def anchor_rows(state: _Rows):
    return ops.checkpoint(state)


@ops.commit.register
def commit_rows(state: _Rows, anchor, keep=0):
    return ops.rollback(state, anchor, keep)


# --- rows: merge, filter, extract ----------------------------------------------------


@ops.filter_rows.register
def filter_rows_rows(state: _Rows, rows):
    rows = row_list(rows, state.batch_size)
    lp = [state.left_pad[r] for r in rows]
    shared = min(lp, default=0)
    planes = tuple(rows_of(p, rows) for p in state.planes)
    if shared:
        # Padding that every survivor shares is dead weight: slice it off.
        planes = tuple(p[:, :, shared:, :] for p in planes)
    return with_planes(
        state,
        planes,
        lengths=rows_of(state.lengths, rows),
        left_pad=tuple(p - shared for p in lp),
        row_ids=distinct_row_ids(rows_of(row_ids_of(state), rows)),
    )


@ops.extract_row.register
def extract_row_rows(state: _Rows, row):
    row = row_index(row, state.batch_size)
    start, n = state.left_pad[row], state.lengths[row]
    planes = tuple(mx.contiguous(p[row : row + 1, :, start : start + n, :]) for p in state.planes)
    return with_planes(
        state, planes, lengths=(n,), left_pad=(0,), row_ids=(row_ids_of(state)[row],)
    )


def check_same_geometry(states, fields=()):
    """Merging needs one geometry (heads, head dims, dtype, and ``fields``)."""
    ref = None
    for i, s in enumerate(states):
        for f in fields:
            check(
                getattr(s, f) == getattr(states[0], f),
                f"states[{i}].{f}",
                getattr(states[0], f),
                getattr(s, f),
            )
        geo = geometry(s)
        if geo is None:
            continue
        if ref is None:
            ref = (i, geo)
        elif geo != ref[1]:
            raise bad(
                f"states[{i}] geometry (H, Dk, Dv, dtype)", f"{ref[1]} as states[{ref[0]}]", geo
            )
    return ref


def merge_planes(states, width: int, step: int):
    """Stack the inputs' rows, each input shifted right to end at ``width``."""
    full = [s for s in states if s.planes]
    if not full:
        return ()
    B = sum(s.batch_size for s in states)
    C = round_up(width, step)
    template = full[0].planes
    planes = [mx.zeros((B, p.shape[1], C, p.shape[3]), p.dtype) for p in template]
    row = 0
    for s in states:
        if s.planes:
            shift = width - s.width
            for i, p in enumerate(columns(s.planes, s.width)):
                planes[i] = mx.slice_update(planes[i], p, mx.array([row, shift], mx.int32), (0, 2))
        row += s.batch_size
    return tuple(planes)


@ops.merge_same_kind.register
def merge_rows_rows(first: _Rows, states):
    extra = ("group_size", "bits") if hasattr(first, "bits") else ()
    check_same_geometry(states, extra)
    width = max(s.width for s in states)
    lengths, left_pad = [], []
    for s in states:
        shift = width - s.width
        lengths += s.lengths
        left_pad += [p + shift for p in s.left_pad]
    planes = merge_planes(states, width, first.step)
    return with_planes(
        first,
        planes,
        lengths=tuple(lengths),
        left_pad=tuple(left_pad),
        row_ids=distinct_row_ids(sum((s.row_ids for s in states), ())),
    )


# --- invariants (kvstate.core.invariants) for the padded row layout ----------------------------


def validate_rows(state: Any) -> tuple:  # a padded-rows record with keys/values planes
    """The checks every padded-row kind shares: ``(B, ends)``, ``ends`` ``None``
    before the first append (no planes: then no row may hold a column)."""
    B = check_counts(state, "state", ("lengths", "left_pad"))
    check_int(state.step, "state.step", 1)
    ends = state.ends
    if state.keys is None or state.values is None:
        if state.keys is not None or state.values is not None:
            raise bad(
                "state.keys and state.values",
                "both set or both None",
                f"{type(state.keys).__name__} and {type(state.values).__name__}",
            )
        if any(ends):
            raise bad(
                "state.lengths and state.left_pad",
                "zeros before the first append (no planes hold columns)",
                f"lengths {state.lengths}, left_pad {state.left_pad}",
            )
        return B, None
    return B, ends


def check_ends(state, C: int) -> None:
    """Every row ends inside the capacity ``C`` (where its next append writes)."""
    for b, e in enumerate(state.ends):
        if e > C:
            raise bad(f"state row {b} end (left_pad + lengths)", f"<= {C} (the capacity)", e)


@clear_hidden.register
def clear_hidden_rows(state: _Rows):
    planes = state.planes
    if not planes or (not any(state.left_pad) and min(state.ends, default=0) == planes[0].shape[2]):
        return state
    c = np.arange(planes[0].shape[2])[None, :]
    lp, ends = np.array(state.left_pad)[:, None], np.array(state.ends)[:, None]
    new = cleared(planes, (c >= lp) & (c < ends))
    return state if new is planes else with_planes(state, new)


# --- the compile boundary (kvstate.compiled) for the padded row layout ----------------


@compiled.host_positions.register
def host_positions_rows(state: _Rows):
    return (state.ends, state.left_pad)  # ends: the column the next token goes to


@compiled.with_capacity.register
def with_capacity_rows(state: _Rows, capacity: int):
    capacity = compiled.check_capacity(state, capacity)
    if state.capacity == capacity:
        return state
    check(capacity % state.step == 0, "capacity", f"a multiple of step={state.step}", capacity)
    check(capacity >= state.width, "capacity", f">= {state.width} (the stored width)", capacity)
    planes = resize(state.planes, capacity)
    if capacity < state.capacity:
        planes = tuple(mx.contiguous(p) for p in planes)  # (do not pin the old buffer)
    return with_planes(state, planes)


@compiled.prepare.register
def prepare_rows(state: _Rows, n: int = 1):
    n = compiled.check_room(state, n)
    need, C = state.width + n, state.capacity
    if C >= need and C % state.step == 0:
        return state
    return compiled.with_capacity(state, round_up(need, state.step))


@compiled.room.register(CacheState)
@compiled.room.register(QuantizedState)
def room_rows(state: _Rows) -> int:
    C = state.capacity  # (prepare_rows: as it is while C % step == 0 and C >= width + n)
    return C - state.width if C % state.step == 0 else 0  # (no planes: C = 0)


@compiled.advanced.register
def advanced_rows(state: _Rows, n: int = 1) -> dict:
    return {"lengths": tuple(m + n for m in state.lengths)}


@compiled.traced_offset.register
def traced_offset_rows(proto: _Rows, view: compiled.Traced, ctx: compiled.TraceContext):
    ends, lp = view.positions
    return ctx.shared(("rows-offset",), (ends, lp), lambda: ends - lp)


@compiled.traced_update.register
def traced_update_rows(proto: _Rows, view: compiled.Traced, k, v, ctx: compiled.TraceContext):
    check_geometry(geometry(with_planes(proto, view.planes)), k, v)
    ends, lp = view.positions
    N = k.shape[2]
    slice_write = view.same_end and ctx.same_end_slice
    write = ctx.shared(
        ("rows-write", N, slice_write),
        (ends,),
        lambda: column_writer(ends, N, slice_write=slice_write),
    )
    new = to_planes(proto, k, v)
    planes = tuple([write(p, x) for p, x in zip(view.planes, new)])
    after = ctx.shared(("rows-after", N), (ends,), lambda: ends + N)
    written_record = with_planes(proto, planes)
    written = (view.planes, new) if len(planes) == 2 else ()  # (dense planes: a fusable write)
    after_view = compiled.Traced(proto, planes, (after, lp), view.same_end, written=written)
    return after_view, written_record.keys, written_record.values


@compiled.traced_mask.register
def traced_mask_rows(
    proto: _Rows, view: compiled.Traced, n: int, window, ctx: compiled.TraceContext
):
    ends, lp = view.positions
    C = view.capacity
    return ctx.shared(
        ("rows-mask", n, window, C), (ends, lp), lambda: rows_mask(n, lp, ends + n, C, window)
    )
