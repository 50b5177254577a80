"""Record invariants: one validation per record kind, and row identities.

``validate(state)`` checks every number a record holds against each other
and against its arrays (the row layout of ``kvstate.core.records``: counts per
row, non-negative lengths and padding, rows ending inside the capacity,
planes of one batch, rank, capacity and dtype). Each record kind registers
its check beside its operations (``dense``, ``quantized``, ``rotating``).

Where it runs: wherever numbers enter from outside — a record's constructor
(``kv.CacheState(...)``, ``attrs.evolve``), ``kv.load``,
``from_prompt_cache``, ``unflatten``, a hand-made ``Checkpoint`` — and never
again for records that kvstate's pure functions derive from valid records:
those are built by ``records.derived``, which skips the check (the hot path
of every append). The hypothesis tests in ``tests/core/test_invariants.py`` check
that every public call returns records that pass ``validate``.

Row identities: every row of every record has an id (``row_ids``), drawn
from one process-wide counter. Operations that keep rows keep their ids
(append, trim, rollback, unflatten); operations that move rows carry the
ids of the rows they keep (``filter_rows``, ``merge_rows``, ``extract_row``)
and a row that appears a second time (``filter_rows(s, [0, 0])``) is a new
row with a new id. A ``Checkpoint`` stores the ids, so ``rollback`` refuses
a checkpoint whose rows were reordered, filtered or merged since, or that
belongs to another record's history. Decisions: ``notes/core.md``.
"""

from __future__ import annotations

import itertools
from functools import lru_cache, singledispatch
from typing import Any

import mlx.core as mx

from ..errors import bad

# Row bookkeeping becomes int32 position arrays (RoPE offsets, compiled
# writes); anything larger than this cannot be a real position.
MAX_POSITION = 2**31 - 1

# The most rows a constructor or ``fork`` makes from a count: far above any batch
# one device decodes, low enough that the host bookkeeping stays a few MB.
MAX_ROWS = 2**16

# Host bytes a row costs before any array (measured on ``kv.empty``): a slot in
# ``lengths`` and one in ``left_pad`` (8 bytes each), a row id (a slot and a 28-byte int).
ROW_BYTES = 52

_NEXT_ROW = itertools.count(1)


def fresh_row_ids(n: int) -> tuple:
    """``n`` row ids never handed out before in this process."""
    return tuple(itertools.islice(_NEXT_ROW, n))


def distinct_row_ids(ids: tuple) -> tuple:
    """``ids`` with each repeat after the first replaced by a fresh id.

    A row that appears twice in one record (``filter_rows(s, [0, 0])``,
    ``merge_rows([s, s])``) is two rows from then on: they may diverge.
    """
    if len(set(ids)) == len(ids):
        return ids
    seen, out = set(), []
    for i in ids:
        out.append(i if i not in seen else next(_NEXT_ROW))
        seen.add(out[-1])
    return tuple(out)


@singledispatch
def validate(state: Any) -> Any:
    """Raise ``KVStateError`` unless ``state`` satisfies its kind's invariants.

    Returns ``state``. Host-side only: shapes, dtypes and host ints, never
    an array's contents.
    """
    raise bad("state", "a kvstate record", type(state).__name__)


@singledispatch
def clear_hidden(state: Any) -> Any:
    """``state`` with zeros in every column no row can read (padding, stale
    tails, unheld ring columns, spare capacity); the same record when it
    has no such column.

    Every record constructor runs it (arrays from outside may hold anything
    there: ``from_arrays``, ``load``, ``from_prompt_cache``, a user's own
    record); kvstate's pure functions never leave anything but zeros there
    (``notes/core.md``), so a NaN or inf a row does not hold cannot
    reach its attention output (``0 * NaN`` in the read).
    """
    raise bad("state", "a kvstate record", type(state).__name__)


def cleared(planes, visible):
    """Each plane ``[B, H, C, *]`` with zeros where ``visible`` (host bool
    ``[B, C]``) is False; the planes themselves when nothing is hidden."""
    import numpy as np

    if not planes or bool(np.all(visible)):
        return tuple(planes)
    mask = mx.array(np.asarray(visible, dtype=bool))[:, None, :, None]
    return tuple(mx.where(mask, p, mx.zeros((), p.dtype)) for p in planes)


def clear_columns(planes, cols, hidden=None):
    """Each plane ``[B, H, C, *]`` with zeros written at row ``b``'s columns
    ``cols[b]`` (host ints, each in ``[0, C)``).

    Columns a row drops (``trim``, ``rollback``) are cleared as they are
    dropped: one scatter of a zero per plane at ``[B, 1, M, 1]`` indices
    (``M``: the most columns one row drops), in place when nothing else holds
    the plane (one kernel per plane: a speculative round rolls back every
    layer). A row dropping fewer repeats its first column. A row dropping
    none writes its zero at ``hidden[b]``, a column of its own that already
    holds zeros (a column no row can read: kvstate leaves only zeros there);
    where a row dropping none has none (``hidden`` ``None`` or
    ``hidden[b]`` ``None``) it writes back what its column 0 holds (a gather
    and a select more per plane).
    """
    cols = tuple(c if type(c) is range else tuple(c) for c in cols)
    # a model's layers drop alike: worked out once (the last layout remembered)
    return clear_at(planes, *_clear_indices(cols, None if hidden is None else tuple(hidden)))


def clear_at(planes, index, none, M: int) -> tuple:
    """``clear_columns`` from its worked-out indices (``_clear_indices``: a caller that
    clears many records of one layout works them out once); planes of one shape
    (a layer's keys and values) share one broadcast index."""
    if not planes or M == 0:
        return tuple(planes)
    out = []
    shape: Any = None
    at: Any = None
    zeros: Any = None
    dtype: Any = None
    for p in planes:
        if shape is None or p.shape[1] != shape[1] or p.shape[3] != shape[3]:
            shape, zeros = (p.shape[0], p.shape[1], M, p.shape[3]), None
            at = mx.broadcast_to(index, shape)
        if none is not None:
            old = mx.take_along_axis(p, at, axis=2)
            new = mx.where(none, old, mx.zeros(shape, p.dtype))
        else:
            if zeros is None or p.dtype != dtype:
                zeros, dtype = mx.broadcast_to(_zero(p.dtype), shape), p.dtype
            new = zeros
        out.append(mx.put_along_axis(p, at, new, axis=2))
    return tuple(out)


@lru_cache(maxsize=None)
def _zero(dtype) -> mx.array:
    """A 0 of ``dtype`` (one host-made array per dtype, not one per plane)."""
    return mx.array(0, dtype)


@lru_cache(maxsize=1)
def _clear_indices(cols: tuple, hidden) -> tuple:
    """``(index [B, 1, M, 1] int32, none [B, 1, 1, 1] bool or None, M)`` for ``clear_columns``."""
    M = max(map(len, cols), default=0)
    if M == 0:
        return None, None, 0
    idx, none = [], []
    for b, c in enumerate(cols):
        c = list(c)
        if not c and hidden is not None and hidden[b] is not None:
            c = [hidden[b]]
        idx.append(c + c[:1] * (M - len(c)) if c else [0] * M)
        none.append(not c)
    # built at their final shapes from host lists: arrays with their data, no lazy
    # op (a cached lazy array is bound to the stream of the thread that made it, and
    # another thread's use of the same layout fails to evaluate it)
    index = mx.array([[[[i] for i in row]] for row in idx], dtype=mx.int32)
    return index, (mx.array([[[[n]]] for n in none]) if any(none) else None), M


# --- checks shared by the kinds -------------------------------------------------------


def check_int(value, arg: str, low: int = 0, high: int = MAX_POSITION) -> int:
    """``value`` is a Python int (not a bool) in ``[low, high]``."""
    if type(value) is not int:
        raise bad(arg, "an int", f"{type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise bad(arg, f"an int in [{low}, {high}]", value)
    return value


def check_counts(state, arg: str, fields) -> int:
    """Every per-row tuple in ``fields`` has one int per row, each in range;
    ``row_ids`` has one distinct int per row. Returns the batch size."""
    B = len(state.lengths)
    for name in fields:
        values = getattr(state, name)
        if type(values) is not tuple:
            raise bad(f"{arg}.{name}", "a tuple of ints", type(values).__name__)
        if len(values) != B:
            raise bad(f"{arg}.{name}", f"{B} values (one per row, as lengths)", len(values))
        for b, v in enumerate(values):
            check_int(v, f"{arg}.{name}[{b}]")
    ids = state.row_ids
    if type(ids) is not tuple or len(ids) != B or any(type(i) is not int for i in ids):
        raise bad(f"{arg}.row_ids", f"{B} ints (one per row)", repr(ids))
    if len(set(ids)) != B:
        raise bad(f"{arg}.row_ids", "distinct ids (one row each)", ids)
    return B


def check_plane(arg: str, x, B: int, C=None, H=None) -> tuple:
    """``x`` is an ``mx.array`` ``[B, H, C, *]`` (``C``/``H`` when given); its shape."""
    if type(x) is not mx.array:
        raise bad(arg, "an mx.array [B, H, C, D]", type(x).__name__)
    shape = x.shape
    if len(shape) != 4:
        raise bad(f"{arg} rank", "4 ([B, H, C, D])", f"{len(shape)} {list(shape)}")
    if shape[0] != B:
        raise bad(f"{arg} batch (shape[0])", f"{B} (one per row)", shape[0])
    if H is not None and shape[1] != H:
        raise bad(f"{arg} heads (shape[1])", H, shape[1])
    if C is not None and shape[2] != C:
        raise bad(f"{arg} capacity (shape[2])", C, shape[2])
    if shape[1] < 1 or shape[3] < 1:
        raise bad(f"{arg} shape", "at least one head and one element per head", list(shape))
    return shape


def check_capacity(arg: str, need: int, C: int, what: str) -> None:
    if need > C:
        raise bad(arg, f"<= {C} (the planes' capacity)", f"{need} ({what})")


FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def check_float(arg: str, dtype) -> None:
    if dtype not in FLOATS:
        raise bad(f"{arg} dtype", "float16, bfloat16 or float32", dtype)


__all__ = [
    "validate",
    "clear_hidden",
    "fresh_row_ids",
    "distinct_row_ids",
    "MAX_POSITION",
]
