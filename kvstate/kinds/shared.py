"""Shared prefixes: ``SharedState`` rows that read an immutable prefix, then their own suffix.

``kv.fork(state, row, n)`` gives ``state``'s rows followed by ``n`` rows that
start as copies of ``row``, copying no key or value: every row reads a
window of a *prefix* record (a dense record that is never written again, so
sharing it is safe) and then its own *suffix* rows, where its appends go::

    prefixes[0] (a CacheState, never written):   row 0:  p p p p p p p p
                                                  row 1:  q q q q q
    row 0 of the SharedState:  source 0, prefix_row 0, shared 8  | suffix row 0:  a a
    row 1:                     source 0, prefix_row 0, shared 8  | suffix row 1:  b
    row 2:                     source 0, prefix_row 0, shared 5  | suffix row 2:  c c c
    row 3:                     source 0, prefix_row 1, shared 5  | suffix row 3:  (none)

Row ``b`` holds ``shared[b]`` tokens of prefix row ``prefix_row[b]`` of
``prefixes[source[b]]`` (its first ``shared[b]`` tokens) followed by the
tokens its suffix row holds. Appends write the suffix; ``trim`` and
``rollback`` shorten the suffix first and then the row's view of the
prefix (row 2 above was trimmed into its prefix); ``filter_rows``,
``extract_row`` and ``merge_rows`` move suffix rows and the row map, and
keep referring to the very same prefix records.

Attention is a *cascade* (``attend``): the rows that read one prefix row
have their queries folded into one matmul against that prefix's keys, so a
prefix is read once per step whatever the number of rows sharing it; each
row's suffix is read as usual; the two partial softmaxes are merged by
their log-sum-exp. ``materialize`` builds the same rows as a plain dense
record (a per-row copy of the prefix): the reference semantics, and what
the mlx-lm bridge hands a model that wants key and value columns. The
design, the alternatives and the measurements are in ``notes/kinds.md``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from functools import singledispatch
from typing import Any

import attrs
import mlx.core as mx

from ..compiled import boundary as compiled
from ..compiled import buckets as _buckets
from ..core import ops
from ..core.args import as_int, per_row, row_count, row_index, row_list
from ..core.invariants import validate
from ..core.masks import rows_mask
from ..core.records import (
    CacheState,
    Checkpoint,
    ChunkedState,
    CompositeState,
    QuantizedState,
    RecurrentState,
    RotatingState,
    _Rows,
    _tuple,
    _tuple_of_ints,
    derived,
    forwarded,
    share_row_ids,
    with_row_ids,
)
from ..errors import bad, check
from ..kernels import cuda as kernels
from . import rows as _rows

__all__ = ["SharedState", "cascade_attention", "fork", "materialize", "views_of", "view_arrays"]


@attrs.frozen
class SharedState:
    """Rows that read a window of a shared prefix record, then their own suffix.

    Attributes:
        prefixes: the shared records (``CacheState`` or ``QuantizedState``, all
            of one kind), never written by any function here.
        source: per row, the index in ``prefixes`` of the record it reads.
        prefix_row: per row, the row of that record it reads.
        shared: per row, how many of that prefix row's tokens it reads (its
            first ones; at most what the prefix row holds).
        suffix: the rows' own tokens (a dense record of the prefixes' kind,
            ``B`` rows); appends write here.
    """

    prefixes: tuple = attrs.field(converter=_tuple)
    source: tuple = attrs.field(converter=_tuple_of_ints)
    prefix_row: tuple = attrs.field(converter=_tuple_of_ints)
    shared: tuple = attrs.field(converter=_tuple_of_ints)
    suffix: Any = attrs.field()  # a dense record of the prefixes' kind (_Rows)

    batch_size = forwarded("suffix.batch_size")
    left_pad = forwarded("suffix.left_pad", "The suffix's padding (a Checkpoint compares it).")
    row_ids = forwarded("suffix.row_ids", "The rows' identities: its suffix rows' (invariants).")
    step = forwarded("suffix.step")
    planes = forwarded("suffix.planes", "The suffix's planes (the arrays appends write).")
    capacity = forwarded("suffix.capacity", "The suffix's capacity (a compiled step's buckets).")

    @property
    def lengths(self) -> tuple:
        """Per row, the tokens it holds (prefix view plus suffix)."""
        return tuple(map(operator.add, self.shared, self.suffix.lengths))

    @property
    def aligned(self) -> bool:
        lengths = self.lengths
        return lengths.count(lengths[0]) == len(lengths)

    @property
    def width(self) -> int:
        """Columns ``fetch`` returns (the materialized layout)."""
        return max(self.shared, default=0) + self.suffix.width

    @property
    def nbytes(self) -> int:
        """Bytes this record holds, each shared prefix counted once."""
        return resident_bytes([self])

    def __attrs_post_init__(self):
        validate(self)


def with_suffix(state: SharedState, suffix) -> SharedState:
    """``state`` with new suffix rows of the same kind and batch (an append's
    result): the row map is unchanged, so it is not checked again (the
    decode hot path builds one per layer per step)."""
    return derived(state, suffix=suffix)


def resident_bytes(records) -> int:
    """Bytes resident in ``records`` (any kinds, e.g. every layer of every batch and
    cache entry alive), each record counted once however many rows or
    ``SharedState``s read it."""
    seen, total = set(), 0
    for r in records:
        for x in resident_records(r):
            if id(x) not in seen:
                seen.add(id(x))
                total += x.nbytes
    return total


def resident_records(record) -> tuple:
    """The records whose bytes ``record`` keeps resident: a ``SharedState``'s prefixes
    and suffix (each counted once however many hold it), any other record itself."""
    return (*record.prefixes, record.suffix) if isinstance(record, SharedState) else (record,)


@validate.register
def validate_shared(state: SharedState) -> SharedState:
    """Host invariants of a ``SharedState`` (its constructor runs them): one
    ``source``/``prefix_row``/``shared`` entry per suffix row, prefixes of the
    suffix's kind, each row reading a row of a prefix and at most what it holds.
    The suffix and the prefixes were validated when they were made."""
    kind = type(state.suffix)
    check(
        kind in (CacheState, QuantizedState),
        "suffix",
        "a CacheState or QuantizedState",
        kind.__name__,
    )
    B = state.batch_size
    for name in ("source", "prefix_row", "shared"):
        n = len(getattr(state, name))
        check(n == B, f"{name}", f"{B} entries (one per suffix row)", n)
    for i, p in enumerate(state.prefixes):
        check(
            type(p) is kind,
            f"prefixes[{i}]",
            f"a {kind.__name__} like the suffix",
            type(p).__name__,
        )
    for b, (s, r, n) in enumerate(zip(state.source, state.prefix_row, state.shared)):
        check(
            0 <= s < len(state.prefixes),
            f"source[{b}]",
            f"an index in [0, {len(state.prefixes)})",
            s,
        )
        p = state.prefixes[s]
        check(0 <= r < p.batch_size, f"prefix_row[{b}]", f"a row of prefixes[{s}]", r)
        check(
            0 <= n <= p.lengths[r],
            f"shared[{b}]",
            f"in [0, {p.lengths[r]}] (tokens prefix row {r} holds)",
            n,
        )
    return state


# --- fork -------------------------------------------------------------------------------


SUFFIX_STEP = 64
"""Default growth step of the suffix rows ``fork`` makes (a copy costs at most one
such block per row, whatever the prefix's own ``step``)."""


@singledispatch
def fork(state: Any, row: int, n: int, *, step: int | None = None) -> Any:
    """``state``'s rows followed by ``n`` new rows that start as copies of ``row``.

    No key or value is copied for a dense record: the result is a
    ``SharedState`` whose rows all read ``state`` itself as their prefix
    (``state`` is immutable, so nothing can change what they read). For a
    ``SharedState``, the new rows share the row's prefix and copy only its
    own suffix (the tokens it wrote since it was forked). ``n`` may be 0 (a
    dense record turned into a ``SharedState``, e.g. to merge it with
    forked rows). A list or tuple of records (one per layer) gives the same
    container. The input is left unchanged.

    Rows of the other kinds (``RotatingState``, ``ChunkedState``,
    ``RecurrentState``, ``CompositeState``) share nothing: their new rows are
    copies of ``row`` (``fork_copied``), and ``n = 0`` gives ``state`` itself.

    Args:
        state: a record of any kind, or a list of them.
        row: the row to copy, in ``[0, B)``.
        n: how many copies, ``>= 0``; ``B + n`` at most
            ``kvstate.core.invariants.MAX_ROWS``.
        step: growth step of the new suffix rows (forking a dense record;
            default ``min(state.step, SUFFIX_STEP)``): each row's own tokens
            cost at most one partly filled block of this many columns.
    """
    if isinstance(state, (list, tuple)):  # (one model's layers: one set of row ids)
        return type(state)(share_row_ids([fork(s, row, n, step=step) for s in state]))
    raise bad("state", "a kvstate record (or a list of them)", type(state).__name__)


def _fork_args(state, row, n):
    row = row_index(row, state.batch_size)
    return row, row_count(n, "n", existing=state.batch_size)


def _empty_like(state: _Rows, batch_size: int, step: int | None = None) -> _Rows:
    """``batch_size`` empty rows of ``state``'s kind and quantization."""
    empty = _rows.with_planes(state, (), lengths=(0,) * batch_size, left_pad=(0,) * batch_size)
    return empty if step is None or step == state.step else attrs.evolve(empty, step=step)


@fork.register
def fork_rows(state: _Rows, row, n, *, step=None):
    row, n = _fork_args(state, row, n)
    check(
        type(state) in (CacheState, QuantizedState),
        "state",
        "a CacheState or QuantizedState",
        type(state).__name__,
    )
    if step is None:
        step = min(state.step, SUFFIX_STEP)
    step = as_int(step, "step")
    check(step >= 1, "step", ">= 1", step)
    B = state.batch_size
    rows = tuple(range(B)) + (row,) * n
    return SharedState(
        (state,),
        (0,) * (B + n),
        rows,
        tuple(state.lengths[r] for r in rows),
        _empty_like(state, B + n, step),
    )


def fork_copied(state, row, n, *, step=None):
    """``fork`` of a kind no row can share (a ring evicts what a prefix record
    would have to keep, a recurrent row folds its tokens into one state, a
    chunked row drops its front): ``row`` copied ``n`` times (``extract_row``,
    then ``merge_rows``), O(the row's state) each. ``step`` is not used."""
    row, n = _fork_args(state, row, n)
    if n == 0:
        return state
    copy = ops.extract_row(state, row)
    return ops.merge_rows([state] + [copy] * n)


for _kind in (RotatingState, ChunkedState, RecurrentState, CompositeState):
    fork.register(_kind, fork_copied)


@fork.register
def fork_shared(state: SharedState, row, n, *, step=None):
    row, n = _fork_args(state, row, n)
    if n == 0:
        return state
    suffix = state.suffix
    if suffix.lengths[row]:
        copy = ops.extract_row(suffix, row)
        suffix = ops.merge_rows([suffix] + [copy] * n)
    else:
        B = suffix.batch_size
        suffix = (
            ops.merge_rows([suffix, _empty_like(suffix, n)])
            if suffix.planes
            else _empty_like(suffix, B + n)
        )
    return SharedState(
        state.prefixes,
        state.source + (state.source[row],) * n,
        state.prefix_row + (state.prefix_row[row],) * n,
        state.shared + (state.shared[row],) * n,
        suffix,
    )


# --- append / positions / lengths -----------------------------------------------------------


def _first_tokens(state: SharedState, k, v):
    """New tokens for suffix rows that hold none yet must fit the prefixes' geometry."""
    if not state.suffix.planes:
        _rows.validate_tokens(state, k, v)


@ops.append.register
def append_shared(state: SharedState, k, v):
    _first_tokens(state, k, v)
    return with_suffix(state, ops.append(state.suffix, k, v))


def update_suffix(state: SharedState, k, v, plans=None) -> tuple:
    """Append to the suffix rows: ``(new_state, suffix keys, suffix values)``, the
    suffix's own read (what the cascade reads; the bridge's routed shells)."""
    _first_tokens(state, k, v)
    suffix, sk, sv = ops.update_and_read(state.suffix, k, v, plans)
    return with_suffix(state, suffix), sk, sv


@ops.update_and_read.register
def update_and_read_shared(state: SharedState, k, v, plans=None):
    """The suffix rows take the tokens (sharing the forward's plans); the read
    is the materialized rows."""
    state, _, _ = update_suffix(state, k, v, plans)
    return (state, *ops.fetch(state))


@ops.positions.register
def positions_shared(state: SharedState):
    return None if state.aligned else mx.array(state.lengths, dtype=mx.int32)


@_rows.geometry.register
def geometry_shared(state: SharedState):
    geo = _rows.geometry(state.suffix)
    return geo if geo is not None else _rows.geometry(state.prefixes[0])


def _cut(state: SharedState, target: tuple) -> SharedState:
    """Rows shortened to ``target`` tokens: the suffix first, then the prefix view.

    When no row keeps a token of its own (nor any padding: the rows' layout
    is then unchanged), the suffix keeps no planes (as a fork of a prompt
    has none): the next append starts fresh ones of the
    suffix's step instead of writing into planes another record may hold
    (a prefix cache entry's compacted suffix: a copy, of its exact width).
    Measured on the H200: cached requests whose lease read such planes took
    100-200 ms each against ~40 ms for a fresh suffix (notes/kinds.md)."""
    suffix_len = state.suffix.lengths
    new_shared = tuple(min(s, t) for s, t in zip(state.shared, target))
    cut = tuple(m - max(0, t - s) for m, s, t in zip(suffix_len, state.shared, target))
    suffix = ops.trim(state.suffix, cut)
    if suffix.planes and not any(suffix.lengths) and not any(suffix.left_pad):
        suffix = _empty_like(suffix, suffix.batch_size)
    return attrs.evolve(state, shared=new_shared, suffix=suffix)


@ops.trim.register
def trim_shared(state: SharedState, n):
    n = per_row(n, state.batch_size, "n")
    have = state.lengths
    for b, (m, h) in enumerate(zip(n, have)):
        check(m <= h, f"n for row {b}", f"<= {h} (tokens the row holds)", m)
    return _cut(state, tuple(h - m for h, m in zip(have, n)))


@ops.checkpoint.register
def checkpoint_shared(state: SharedState):
    return Checkpoint(state.lengths, state.left_pad, row_ids=state.row_ids)


@ops.rollback.register
def rollback_shared(state: SharedState, checkpoint, keep=0):
    target = _rows.checkpoint_target(state, checkpoint, keep)
    for b, (t, have) in enumerate(zip(target, state.lengths)):
        check(t <= have, f"checkpoint + keep for row {b}", f"<= {have} (tokens the row holds)", t)
    return _cut(state, target)


@ops.anchor.register
def anchor_shared(state: SharedState):
    """A checkpoint, as for dense rows: a shared row's rollback is free (the
    suffix is dense and the prefix is never written)."""
    return checkpoint_shared(state)


@ops.commit.register
def commit_shared(state: SharedState, anchor, keep=0):
    return rollback_shared(state, anchor, keep)


# --- rows: filter, extract, merge ---------------------------------------------------------


def _reindex(prefixes, source, prefix_row, shared, suffix) -> SharedState:
    """A ``SharedState`` keeping only the prefixes some row reads (by identity, in order)."""
    keep: list = []
    index: dict = {}
    for s in source:
        p = prefixes[s]
        if id(p) not in index:
            index[id(p)] = len(keep)
            keep.append(p)
    return SharedState(
        tuple(keep), tuple(index[id(prefixes[s])] for s in source), prefix_row, shared, suffix
    )


@ops.filter_rows.register
def filter_rows_shared(state: SharedState, rows):
    rows = row_list(rows, state.batch_size)
    return _reindex(
        state.prefixes,
        [state.source[r] for r in rows],
        tuple(state.prefix_row[r] for r in rows),
        tuple(state.shared[r] for r in rows),
        ops.filter_rows(state.suffix, rows),
    )


@ops.extract_row.register
def extract_row_shared(state: SharedState, row):
    """A one-row ``SharedState``: a compact copy of the row's suffix, still
    sharing its prefix record (which it pins, being shared by definition)."""
    row = row_index(row, state.batch_size)
    return _reindex(
        state.prefixes,
        [state.source[row]],
        (state.prefix_row[row],),
        (state.shared[row],),
        ops.extract_row(state.suffix, row),
    )


@ops.merge_same_kind.register
def merge_rows_shared(first: SharedState, states):
    kinds = {type(s.suffix) for s in states}
    check(
        len(kinds) == 1, "states suffix kinds", "one record kind", sorted(k.__name__ for k in kinds)
    )
    geos = [_rows.geometry(s) for s in states]
    ref = next((g for g in geos if g is not None), None)
    for i, g in enumerate(geos):
        check(g is None or g == ref, f"states[{i}] geometry (H, Dk, Dv, dtype)", ref, g)
    prefixes, source, offset = [], [], 0
    for s in states:
        prefixes += s.prefixes
        source += [x + offset for x in s.source]
        offset += len(s.prefixes)
    suffixes = [s.suffix for s in states]
    if any(x.planes for x in suffixes):
        suffix = ops.merge_rows(suffixes)
    else:  # (every suffix empty: nothing to pad or copy)
        suffix = _empty_like(suffixes[0], sum(x.batch_size for x in suffixes))
    return _reindex(
        prefixes,
        source,
        tuple(x for s in states for x in s.prefix_row),
        tuple(x for s in states for x in s.shared),
        suffix,
    )


# --- materialized reads: fetch, masks -----------------------------------------------------------


def _layout(state: SharedState):
    """``(P, left_pad, ends)`` of the materialized rows (see ``materialize``)."""
    P = max(state.shared, default=0)
    left_pad = tuple(P + lp - s for lp, s in zip(state.suffix.left_pad, state.shared))
    ends = tuple(P + e for e in state.suffix.ends)
    return P, left_pad, ends


def _gather_prefix(state: SharedState, plane_index: int, starts, width: int):
    """Per row, ``width`` columns of its prefix row beginning ``starts[b]`` columns
    before the row's first prefix token (clipped; columns outside the row's
    prefix view hold whatever the clip reads, never exposed)."""
    parts, order = [], []
    for s, p in enumerate(state.prefixes):
        rows = [b for b in range(state.batch_size) if state.source[b] == s]
        if not rows:
            continue
        plane = p.planes[plane_index]
        C = plane.shape[2]
        first = [p.left_pad[state.prefix_row[b]] - starts[b] for b in rows]
        cols = mx.clip(
            mx.array(first, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)[None],
            0,
            C - 1,
        )
        taken = plane[mx.array([state.prefix_row[b] for b in rows], dtype=mx.int32)]
        index = mx.broadcast_to(
            cols[:, None, :, None], (len(rows), plane.shape[1], width, plane.shape[3])
        )
        parts.append(mx.take_along_axis(taken, index, axis=2))
        order += rows
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if order != list(range(state.batch_size)):
        inverse = [0] * len(order)
        for i, b in enumerate(order):
            inverse[b] = i
        out = out[mx.array(inverse, dtype=mx.int32)]
    return out


def materialize(state: SharedState) -> CacheState | QuantizedState:
    """The same rows as a plain dense record (a per-row copy of each prefix view).

    Row ``b``'s suffix keeps its columns, shifted right by ``P = max(shared)``;
    its prefix view is placed just before its first suffix column, so the
    row is one contiguous run ``[P + suffix.left_pad[b] - shared[b],
    P + suffix.ends[b])``. This is the reference every ``SharedState`` read
    is tested against, and the columns the mlx-lm bridge hands a model.
    """
    if not isinstance(state, SharedState):
        raise bad("state", "a SharedState (kv.fork's result)", type(state).__name__)
    P, left_pad, _ = _layout(state)
    suffix = state.suffix
    lengths = state.lengths
    if not suffix.planes:
        if P == 0:
            return _rows.with_planes(suffix, ())
        W = P
        shifted = None
    else:
        W = P + suffix.width
        shifted = _rows.columns(suffix.planes, suffix.width)
    starts = left_pad  # the first prefix token of row b goes to column left_pad[b]
    planes = []
    nplanes = len(state.prefixes[0].planes) if P else len(suffix.planes)
    hide: Any = None  # set when both the prefixes and the suffix have columns
    if shifted is not None and P:
        split = mx.array([P + lp for lp in suffix.left_pad], dtype=mx.int32)
        hide = (mx.arange(W, dtype=mx.int32)[None] < split[:, None])[:, None, :, None]
    for i in range(nplanes):
        if P:
            pre = _gather_prefix(state, i, starts, W)
        if shifted is None:
            planes.append(pre)
        elif not P:
            planes.append(shifted[i])
        else:
            s = shifted[i]
            pad = mx.zeros((s.shape[0], s.shape[1], P, s.shape[3]), s.dtype)
            planes.append(mx.where(hide, pre, mx.concatenate([pad, s], axis=2)))
    return _rows.with_planes(suffix, tuple(planes), lengths=lengths, left_pad=left_pad)


@ops.fetch.register
def fetch_shared(state: SharedState):
    check(
        _rows.geometry(state) is not None,
        "state",
        "a state holding keys (append first)",
        "an empty state",
    )
    return ops.fetch(materialize(state))


def _materialized_rows(state: SharedState):
    """A keyless dense record with the materialized layout (for masks: host ints only)."""
    _, left_pad, ends = _layout(state)
    rows = CacheState((0,) * len(ends), (0,) * len(ends), state.step)
    return derived(rows, lengths=tuple(e - p for e, p in zip(ends, left_pad)), left_pad=left_pad)


@ops.next_mask.register
def next_mask_shared(state: SharedState, n, *, memo=None, window=None, array=False):
    return ops.next_mask(_materialized_rows(state), n, memo=memo, window=window, array=array)


# --- the cascade read ---------------------------------------------------------------------------


def readable(state: SharedState) -> tuple:
    """The prefix records holding keys, in the order a read takes them: by shape
    (rows, capacity), so one set of shapes is one trace whatever order rows
    joined in (an empty record is read by no row: its rows' ``shared`` is 0)."""
    prefixes = state.prefixes
    if len(prefixes) == 1:  # (forks of a prompt, a prefix cache entry: every decode step)
        return prefixes if prefixes[0].planes else ()
    return tuple(prefixes[i] for i in _read_order(_records_key(state)))


def _records_key(state: SharedState) -> tuple:
    """Per prefix record, what the read's order and the row map depend on:
    whether it holds keys, its rows, its capacity and its rows' first columns
    (one record: whether it holds keys and its first columns; it is read
    first whatever its shape: a decode step asks once per layer)."""
    prefixes = state.prefixes
    if len(prefixes) == 1:
        p = prefixes[0]
        return ((bool(p.planes), 0, 0, p.left_pad),)
    return tuple((bool(p.planes), p.batch_size, p.capacity, p.left_pad) for p in prefixes)


@functools.lru_cache(maxsize=256)
def _read_order(records: tuple) -> tuple:
    """Indices of the records holding keys, by (rows, capacity) (stable)."""
    held = [i for i, r in enumerate(records) if r[0]]
    return tuple(sorted(held, key=lambda i: records[i][1:3]))


def prefix_planes(state: SharedState) -> tuple:
    """The planes a read takes: ``readable(state)``'s, in that order. A trace
    depends on their count and shapes only: rows joining that read records
    of shapes already present (a cached system prompt, forks) trace nothing,
    and a set of shapes seen before reuses its trace."""
    records = readable(state)
    if len(records) == 1:  # (every decode step of forks and cached prompts)
        return records[0].planes
    return tuple(x for p in records for x in p.planes)


def layout_key(state: SharedState) -> tuple:
    """What the row map of ``views_of(state)`` depends on, hashable: the rows'
    ``source``/``prefix_row``/``shared`` and per prefix record ``_records_key``.
    Every layer of a forward has the same key (its records differ, their
    shapes and rows do not), so the map is built once per layout."""
    return (state.source, state.prefix_row, state.shared, _records_key(state))


def views_of(state: SharedState) -> tuple:
    """Per row, ``(source, prefix_row, start, shared)``: the record it reads (its
    index in ``readable(state)``; -1, row 0, for an empty record), that
    record's row, the row's first column there (its ``left_pad``) and how
    many columns it reads. Host ints; the cascade takes them as int32
    ``[B]`` arrays (``view_arrays``), so a new layout (a fork, a filter, an
    admission) changes no shape and no compiled trace. Memoized by
    ``layout_key`` (a decode step asks once per layer)."""
    return _views(layout_key(state))


@functools.lru_cache(maxsize=256)
def _views(key: tuple) -> tuple:
    source_of, prefix_row, shared, records = key
    index = [-1] * len(records)
    for at, i in enumerate(_read_order(records)):
        index[i] = at
    source = tuple(index[s] for s in source_of)
    rows = tuple(0 if s < 0 else r for s, r in zip(source, prefix_row))
    starts = tuple(0 if s < 0 else records[t][3][r] for s, t, r in zip(source, source_of, rows))
    return (source, rows, starts, shared)


def view_arrays(state: SharedState) -> tuple:
    """``views_of(state)`` as four int32 ``[B]`` arrays, built once per row map
    (``layout_key``) and kept: decoding never changes the map (an append keeps
    it, ``with_suffix``), so a decode loop builds them once, not once per step
    (the eager bridge's reads and the compiled decoder's positions take the
    same arrays every step, every layer)."""
    return _view_arrays(layout_key(state))


@functools.lru_cache(maxsize=64)
def _view_arrays(key: tuple) -> tuple:
    # (built from host lists: arrays holding their data, never lazy results; a
    # kept lazy array is bound to the stream of the thread that made it, d7c42ec)
    return tuple(mx.array(v, dtype=mx.int32) for v in _views(key))


@compiled.position_arrays.register(SharedState)
def position_arrays_shared(state, host=None):
    # the suffix's (ends, left_pad), new each step; the row map's arrays, kept
    suffix = compiled.host_positions(state.suffix) if host is None else host[:2]
    return compiled.position_arrays(state.suffix, suffix) + view_arrays(state)


def same_layout(a: SharedState, b: SharedState) -> bool:
    """Whether two layers' rows have one layout (what their offsets and read arrays
    derive from), checked without building or hashing it: the very same suffix
    ``lengths`` tuple (one shared append plan gives every layer of a forward the
    same object), suffixes of one kind with equal ``left_pad``, and equal maps
    (``shared``, ``prefix_row``, ``source``) and prefix first columns."""
    sa, sb = a.suffix, b.suffix
    return (
        sa.lengths is sb.lengths
        and type(sa) is type(sb)
        and sa.left_pad == sb.left_pad
        and a.shared == b.shared
        and a.prefix_row == b.prefix_row
        and a.source == b.source
        and _records_key(a) == _records_key(b)
    )


class PerLayout:
    """One value per layout of the layers of one forward: ``get(state, build)``
    gives the last layer's value when ``same_layout`` holds, else
    ``build(state)`` (the rule stated once; one of these per kind of value)."""

    __slots__ = ("_state", "_value")

    def __init__(self) -> None:
        self._state: SharedState | None = None
        self._value: Any = None

    def get(self, state: SharedState, build) -> Any:
        last = self._state
        if last is None or not same_layout(last, state):
            self._value = build(state)
            self._state = state
        return self._value


class Layouts:
    """The int32 arrays the shared reads of one forward take: the suffix rows'
    ``left_pad``/``ends`` (``positions``: the forward's ``compiled.Positions`` when
    given) and the row map (``view_arrays``, kept across forwards), once per
    layout of its layers (``PerLayout``). The eager bridge keeps one per forward
    (``kvstate.mlx_lm``); ``read`` makes its own when given none."""

    __slots__ = ("_arrays", "_positions")

    def __init__(self, positions: compiled.Positions | None = None) -> None:
        self._arrays = PerLayout()
        self._positions = compiled.Positions() if positions is None else positions

    def arrays(self, state: SharedState) -> tuple:
        """``(left_pad, ends, source, rows, start, shared)`` of ``state``'s read: the
        suffix's ``positions``, then the row map's arrays."""
        return self._arrays.get(state, self._build)

    def _build(self, state: SharedState) -> tuple:
        return (*self.positions(state.suffix), *view_arrays(state))

    def positions(self, suffix) -> tuple:
        """``(left_pad, ends)`` of ``suffix`` rows as int32 ``[B]`` arrays."""
        ends, left_pad = self._positions(suffix)  # (compiled.host_positions's order)
        return left_pad, ends


def _partial(q, k, v, mask, scale):
    """Unnormalised attention of ``q`` ``[B, H, R, D]`` (``R``: query rows, the
    query heads sharing a KV head folded in) over ``k``/``v`` ``[B, H, S, D]``.

    Returns ``(o [B, H, R, Dv], m [B, H, R, 1], l [B, H, R, 1])`` in float32:
    ``o = sum_j exp(s_j - m) v_j``, ``l = sum_j exp(s_j - m)`` over the
    visible ``j``, ``m`` their maximum score (``-inf`` where none is visible,
    then ``o = l = 0``). MLX's fused SDPA does not return the log-sum-exp,
    so the partial statistics are computed here.
    """
    s = (q.astype(mx.float32) * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
    if mask is not None:
        s = mx.where(mask, s, -mx.inf)
    m = mx.max(s, axis=-1, keepdims=True)
    safe = mx.where(m == -mx.inf, 0.0, m)
    p = mx.exp(s - safe)
    return p @ v.astype(mx.float32), m, mx.sum(p, axis=-1, keepdims=True)


def _merge(a, b):
    """Two partial softmaxes ``(o, m, l)`` of the same queries as one (log-sum-exp)."""
    (o1, m1, l1), (o2, m2, l2) = a, b
    top = mx.maximum(m1, m2)
    safe = mx.where(top == -mx.inf, 0.0, top)
    c1, c2 = mx.exp(m1 - safe), mx.exp(m2 - safe)
    return o1 * c1 + o2 * c2, top, l1 * c1 + l2 * c2


def cascade_attention(
    q: mx.array,
    prefix_kv: Sequence[tuple[mx.array, mx.array]],
    views: Sequence[mx.array],
    suffix_kv: tuple[mx.array, mx.array],
    suffix_mask: mx.array | None,
    *,
    scale: float,
) -> mx.array:
    """Attention of ``q`` ``[B, Hq, N, D]`` over each row's prefix view then its suffix.

    Args:
        q: the queries; row ``b``'s ``N`` queries stand after its prefix view.
        prefix_kv: per prefix record, its ``(keys, values)`` planes
            ``[P, H, Cp, D]`` (whole: never copied or cut).
        views: int32 ``[B]`` arrays ``(source, prefix_row, start, shared)``
            (``view_arrays``): row ``b`` reads columns ``[start, start +
            shared)`` of row ``prefix_row`` of record ``source``.
        suffix_kv: ``(keys, values)`` ``[B, H, W, D]`` of the suffix rows.
        suffix_mask: bool ``[B|1, 1, N, W]``, True where a query may read a
            suffix column (or ``None``: every column).
        scale: the softmax scale.

    A one-row prefix record (a forked prompt, a prefix cache entry) is read
    once for every row: the queries of all rows (and of the query heads
    sharing a KV head) are folded into one ``[1, H, B*rep*N, D]`` matmul
    against it, each row masked to its own view (rows of other records see
    nothing there). A record of ``P > 1`` rows is read per row
    (``take`` of the row each reads: a per-row copy of that record). The
    partial softmaxes are merged by their log-sum-exp. Only the number of
    prefix records and the arrays' shapes are static: traceable
    (``mx.compile``) with one trace for every layout of the rows.
    """
    B, Hq, N, D = q.shape
    H = suffix_kv[0].shape[1]
    rep = Hq // H
    R = rep * N
    qf = q.reshape(B, H, R, D)
    acc = _partial(
        qf, *suffix_kv, None if suffix_mask is None else _fold_mask(suffix_mask, rep), scale
    )
    source, rows, start, shared = views
    lo = start[:, None]
    for s, (k, v) in enumerate(prefix_kv):
        P, _, C, _ = k.shape
        cols = mx.arange(C, dtype=mx.int32)[None]
        visible = (cols >= lo) & (cols < lo + shared[:, None])  # [B, C]
        if len(prefix_kv) > 1:
            visible = visible & (source == s)[:, None]
        if P == 1:
            qg = qf.transpose(1, 0, 2, 3).reshape(1, H, B * R, D)
            mask = mx.broadcast_to(visible[:, None, :], (B, R, C)).reshape(1, 1, B * R, C)
            part = tuple(
                x.reshape(H, B, R, -1).transpose(1, 0, 2, 3)
                for x in _partial(qg, k, v, mask, scale)
            )
        else:
            idx = mx.clip(rows, 0, P - 1)  # (rows reading another record: masked out)
            part = _partial(qf, k[idx], v[idx], visible[:, None, None, :], scale)
        acc = _merge(acc, part)
    o, _, total = acc
    return (o / total).reshape(B, Hq, N, -1).astype(q.dtype)


def _fold_mask(mask, rep):
    """A ``[B|1, 1, N, W]`` mask for queries folded as ``[B, H, rep*N, D]``."""
    if mask.shape[1] != 1:
        raise bad("suffix_mask heads", 1, mask.shape[1])
    Bm, _, N, W = mask.shape
    return mx.broadcast_to(mask[:, :, None], (Bm, 1, rep, N, W)).reshape(Bm, 1, rep * N, W)


def prefix_read(
    q, suffix_kv, left_pad, ends, prefix_kv, views, *, scale, suffix_mask=None, written=()
):
    """The shared rows' read of ``q`` (the suffix already holds the queries' tokens):
    ``(out, suffix planes)``.

    ``left_pad``/``ends``: int32 ``[B]`` arrays of the suffix rows (after the
    write). The route is ``kernels.decode_read``'s, decided while tracing:
    where the split-K kernel with a prefix source reads (MLX's CUDA backend,
    the shapes it covers) and the rows read one prefix record, one
    ``ragged_attention`` call reads prefix and suffix (the unshared read's
    launches); with ``written`` (a compiled step's suffix write:
    ``compiled.Traced.written``, the planes before it and the new tokens)
    and the route ``"fused"``, ``kernels.write_and_read`` does the write in
    that launch too, as for unshared rows, and its planes are returned in
    place of ``suffix_kv`` (the scatter's, which the graph then drops).
    Otherwise ``cascade_attention`` with ``suffix_mask`` (built from
    ``left_pad`` and ``ends`` when not given). Traceable.
    """
    route = kernels.decode_read(q.shape[2], q, suffix_kv[0], written=bool(written), prefix=True)
    if len(prefix_kv) == 1 and route != "masked":
        _, rows, start, shared = views
        prefix = (*prefix_kv[0], rows, start, shared)
        if route == "fused":
            (k0, v0), (kn, vn) = written
            out, *planes = kernels.write_and_read(
                q, k0, v0, kn, vn, left_pad, ends, scale=scale, prefix=prefix
            )
            return out, tuple(planes)
        out = kernels.ragged_attention(q, *suffix_kv, left_pad, ends, scale=scale, prefix=prefix)
        return out, suffix_kv
    if suffix_mask is None:
        suffix_mask = rows_mask(q.shape[2], left_pad, ends, suffix_kv[0].shape[2])
    return cascade_attention(q, prefix_kv, views, suffix_kv, suffix_mask, scale=scale), suffix_kv


@ops.attend.register
def attend_shared(state: SharedState, q, *, scale: float, memo=None, window=None):
    check(
        type(state.suffix) is CacheState,
        "state",
        "a SharedState of CacheState rows "
        "(quantized shared rows are read through kv.fetch / materialize)",
        f"{type(state.suffix).__name__} rows",
    )
    check(window is None, "window", "None (shared prefixes have no windowed read yet)", window)
    n = _rows.validate_queries(state, q, scale=scale, window=None)
    short = min(state.suffix.lengths)
    check(
        n <= short,
        "q tokens (shape[2])",
        f"<= {short}, the fewest suffix tokens a row holds (append the queries' tokens first)",
        n,
    )
    return read(state, q, scale=scale)


_TRACES = [0]


def traces() -> int:
    """How many times the compiled read (``read``) has been traced in this process."""
    return _TRACES[0]


def read(state: SharedState, q, *, scale: float, layouts: Layouts | None = None):
    """The cascade read behind ``attend``, without its argument checks (the
    bridge calls it with the model's own queries).

    The suffix is read over its whole capacity (a per-row mask built inside
    the read from the rows' ``left_pad``/``ends``, or none where the kernel
    reads). A decode read (at most ``kernels.MAX_QUERIES`` queries per row)
    runs as one ``mx.compile``'d function per scale: the rows' layout
    (which prefix row each reads, from which column, how many tokens) goes
    in as int32 arrays (``view_arrays``), so the trace depends only on the
    shapes (batch, queries, suffix capacity bucket, the prefix records'
    shapes) and the number of prefix records: a decode loop traces once per
    capacity bucket, and a fork, filter or admission that keeps those
    shapes traces nothing (measured: ``notes/kinds.md``). A wider read (a
    prompt's uncached rest, prefilled over a cached prefix) runs the same
    function uncompiled: its width is the request's, so a compiled read
    would trace once per prompt length.

    ``layouts``: the forward's ``Layouts`` (its arrays are equal for every
    layer; default: built for this call).
    """
    if layouts is None:
        layouts = Layouts()
    suffix = state.suffix
    scale = float(scale)
    # (compiled even where the read is one kernel launch: replaying the trace costs
    # less host time than the launch's Python, measured: notes/kinds.md)
    fn = _compiled_read(scale) if q.shape[2] <= kernels.MAX_QUERIES else _read_fn(scale)
    return fn(q, suffix.keys, suffix.values, *layouts.arrays(state), *prefix_planes(state))


def _read_fn(scale: float):
    """The shared read for one softmax scale, over ``read``'s flat arguments."""

    def fn(q, suffix_k, suffix_v, left_pad, ends, *arrays):
        views, prefix = arrays[:4], arrays[4:]
        pairs = [(prefix[i], prefix[i + 1]) for i in range(0, len(prefix), 2)]
        out, _ = prefix_read(q, (suffix_k, suffix_v), left_pad, ends, pairs, views, scale=scale)
        return out

    return fn


@functools.lru_cache(maxsize=16)
def _compiled_read(scale: float):
    """``_read_fn(scale)`` compiled (shapes and the number of prefix records are
    what it traces again for; ``traces`` counts)."""
    fn = _read_fn(scale)

    def counted(*args):
        _TRACES[0] += 1  # Python runs only while tracing
        return fn(*args)

    return mx.compile(counted)


def dense_attend_reference(state: SharedState, q, *, scale: float):
    """``kv.attend`` on ``materialize(state)``: the materialising read (one per-row
    copy of the prefix per call), kept for tests and the benchmark."""
    return ops.attend(materialize(state), q, scale=scale)


# --- the compile boundary (kvstate.compiled): the suffix is written, the prefixes read only ---


@attrs.frozen
class SharedSpec(compiled.Spec):
    """The static half of a ``SharedState``: the suffix's ``Spec``, the row map
    and, per prefix record, what the map's arrays depend on
    (``_records_key``). It holds no record: the prefix records stay beside it,
    in the record it was taken of (``rebuild``'s ``like``), so the layers of
    one layout (each reading its own prefix records) share one ``SharedSpec``
    in the compiled decoder, as unshared layers share one ``Spec``.

    Its ``key`` holds the suffix's key and the number of prefix records the
    read takes (``prefix_planes``); never the row map (its int32 arrays are
    positions) nor the records' shapes (``mx.compile`` keys on shapes itself).
    """

    suffix: Any = None
    rows: tuple = ()
    records: tuple = ()
    slots: int = 0

    @property
    def static(self) -> tuple:
        return (
            ("suffix", self.suffix.key),
            ("prefixes", (2,) * self.slots),  # (planes per record read)
        )

    def replace(self, suffix=None, **fields) -> "SharedSpec":
        check(not fields, "fields", "suffix (the suffix's host fields)", sorted(fields))
        return attrs.evolve(self, suffix=self.suffix.replace(**(suffix or {})))

    def rebuild(self, planes: tuple, *, trusted: bool = False, like=None) -> SharedState:
        """``like``: the ``SharedState`` this spec was taken of (or one reading
        the same prefix records with this row map): the rebuilt rows read its
        prefix records. ``trusted``: ``like`` is the record the step read, so
        its row map is this spec's (the decoder's own step)."""
        if not isinstance(like, SharedState):
            raise bad(
                "like",
                "the SharedState the spec was taken of (a SharedSpec holds no prefix records)",
                type(like).__name__,
            )
        suffix = self.suffix.rebuild(planes, trusted=trusted)
        if trusted:
            return with_suffix(like, suffix)
        source, prefix_row, shared = self.rows
        return SharedState(like.prefixes, source, prefix_row, shared, suffix)


@compiled.spec_of.register(SharedState)
def spec_of_shared(state):
    suffix = compiled.spec_of(state.suffix)
    return SharedSpec(
        SharedState,
        (),
        (("suffix", sum(c or 1 for _, c in suffix.arrays)),),
        same_end=suffix.same_end,
        suffix=suffix,
        rows=(state.source, state.prefix_row, state.shared),
        records=_records_key(state),
        slots=len(readable(state)),
    )


@with_row_ids.register(SharedState)
def with_row_ids_shared(state, ids):
    return with_suffix(state, with_row_ids(state.suffix, ids))


@compiled.host_positions.register(SharedState)
def host_positions_shared(state):
    # the suffix's (ends, left_pad), then the row map: (source, prefix_row, start, shared)
    return compiled.host_positions(state.suffix) + views_of(state)


@compiled.held_planes.register(SharedState)
def read_only_planes_shared(state):
    return prefix_planes(state)


@compiled.prepare.register(SharedState)
def prepare_shared(state, n: int = 1):
    """The suffix in its bucket (a suffix holding no planes yet, e.g. just
    forked, gets zero planes of the prefixes' geometry and one bucket)."""
    check(
        type(state.suffix) is CacheState,
        "state",
        "a SharedState of CacheState rows (quantized shared rows: kvstate.mlx_lm.forward/step)",
        f"{type(state.suffix).__name__} rows",
    )
    suffix = state.suffix
    if not suffix.planes:
        geo = _rows.geometry(state)
        check(geo is not None, "state", "a state holding keys (append first)", "an empty state")
        H, Dk, Dv, dtype = geo
        B, C = suffix.batch_size, _rows.round_up(max(as_int(n, "n"), 1), suffix.step)
        planes = (mx.zeros((B, H, C, Dk), dtype), mx.zeros((B, H, C, Dv), dtype))
        suffix = _rows.with_planes(suffix, planes)
    prepared = compiled.prepare(suffix, n)
    if prepared is state.suffix:  # (the record itself: a decoder knows its Spec already)
        return state
    return with_suffix(state, prepared)


@compiled.advanced.register(SharedState)
def advanced_shared(state, n: int = 1) -> dict:
    return {"suffix": compiled.advanced(state.suffix, n)}


def _suffix_view(view: compiled.Traced) -> compiled.Traced:
    """The suffix's own view (its proto's ``suffix`` is the suffix's ``Spec.key``)."""
    proto: Any = view.proto
    return compiled.Traced.of((view.planes, view.positions[:2]), proto.suffix)


@compiled.traced_offset.register(SharedState)
def traced_offset_shared(proto, view: compiled.Traced, ctx: compiled.TraceContext):
    ends, lp, *_, shared = view.positions
    return ctx.shared(("shared-offset",), (ends, lp, shared), lambda: ends - lp + shared)


@compiled.traced_update.register(SharedState)
def traced_update_shared(proto, view: compiled.Traced, k, v, ctx: compiled.TraceContext):
    sview = _suffix_view(view)
    new, keys, values = compiled.traced_update(sview.proto, sview, k, v, ctx)
    out = attrs.evolve(
        view, planes=new.planes, positions=new.positions + view.positions[2:], written=new.written
    )
    return out, keys, values


@compiled.traced_mask.register(SharedState)
def traced_mask_shared(proto, view, n: int, window, ctx):
    return None  # the read (traced_read) builds its own suffix mask


@compiled.traced_read.register(SharedState)
def traced_read_shared(proto, view: compiled.Traced, q, scale, ctx: compiled.TraceContext):
    ends, lp, source, rows, start, shared = view.positions  # (after the write)
    N, C = q.shape[2], view.capacity
    read_only = view.held  # (keys, values) per record read: prefix_planes
    pairs = [(read_only[i], read_only[i + 1]) for i in range(0, len(read_only), 2)]
    mask = ctx.shared(("shared-mask", N, C), (ends, lp), lambda: rows_mask(N, lp, ends, C))
    views = (source, rows, start, shared)
    out, planes = prefix_read(
        q, view.planes, lp, ends, pairs, views, scale=scale, suffix_mask=mask, written=view.written
    )
    return out, attrs.evolve(view, planes=planes, written=())


@_buckets.blank_rows.register(SharedState)
def blank_rows_shared(state, n: int):
    """``n`` rows reading no prefix token, with empty suffix rows (batch padding)."""
    suffix = _buckets.blank_rows(state.suffix, n)
    if suffix is None:
        return None
    return SharedState(state.prefixes[:1], (0,) * n, (0,) * n, (0,) * n, suffix)
