"""Dense rows: ``CacheState`` and the layout it shares with ``QuantizedState``.

The row layout is drawn once, in ``kvstate.records``. Every function here
works plane by plane (a ``CacheState`` has two planes, keys and values; a
``QuantizedState`` six), so moving rows and columns never looks inside a
plane: quantized bytes are moved, never requantized. What differs per record
kind (turning new tokens into planes, the geometry, rebuilding a record) is
a small ``singledispatch`` hook below, overridden in ``kvstate.quantized``.
"""

from __future__ import annotations

import operator
from functools import singledispatch
from typing import Optional

import attrs
import mlx.core as mx

from . import ops
from .errors import as_int, bad, check, check_scale, per_row, row_index, row_list
from .masks import lease, rows_key, rows_mask
from .records import CacheState, Checkpoint, _Rows


def round_up(n: int, step: int) -> int:
    """The smallest multiple of ``step`` that holds ``n``."""
    return -(-n // step) * step


# --- per-kind hooks ---------------------------------------------------------


@singledispatch
def geometry(state):
    """``(H, Dk, Dv, dtype)`` of the stored rows, or ``None`` before the first append."""
    raise NotImplementedError(type(state).__name__)


@geometry.register
def _(state: CacheState):
    if state.keys is None:
        return None
    return (state.keys.shape[1], state.keys.shape[3], state.values.shape[3], state.keys.dtype)


@singledispatch
def to_planes(state, k, v) -> tuple:
    """New tokens ``k``, ``v`` as planes in this record's storage format."""
    raise NotImplementedError(type(state).__name__)


@to_planes.register
def _(state: CacheState, k, v):
    return (k, v)


@singledispatch
def with_planes(state, planes, **changes):
    """A copy of ``state`` holding ``planes`` (and any field ``changes``)."""
    raise NotImplementedError(type(state).__name__)


@with_planes.register
def _(state: CacheState, planes, **changes):
    keys, values = planes if planes else (None, None)
    if not changes.keys() - {"lengths", "left_pad"}:
        # The hot path (every append): the constructor, not attrs.evolve,
        # which re-reads every field through getattr.
        return CacheState(changes.get("lengths", state.lengths),
                          changes.get("left_pad", state.left_pad), state.step,
                          keys=keys, values=values)
    return attrs.evolve(state, keys=keys, values=values, **changes)


# --- construction -----------------------------------------------------------


def empty(batch_size: int = 1, *, step: int = 256) -> CacheState:
    """An empty ``CacheState``: ``batch_size`` rows, no geometry until the first append."""
    batch_size = as_int(batch_size, "batch_size")
    check(batch_size >= 0, "batch_size", ">= 0", batch_size)
    step = as_int(step, "step")
    check(step >= 1, "step", ">= 1", step)
    return CacheState((0,) * batch_size, (0,) * batch_size, step)


def _check_kv(arg_k, k, arg_v, v):
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


def from_arrays(keys, values, *, lengths=None, left_pad=None, step: int = 256) -> CacheState:
    """Wrap existing ``[B, H, S, D]`` arrays; row ``b`` holds
    ``[left_pad[b], left_pad[b] + lengths[b])`` (defaults: no padding, full rows)."""
    _check_kv("keys", keys, "values", values)
    B, _, S, _ = keys.shape
    check(B >= 1, "keys batch size", ">= 1", B)
    step = as_int(step, "step")
    check(step >= 1, "step", ">= 1", step)
    lp = per_row(0 if left_pad is None else left_pad, B, "left_pad")
    n = per_row([S - p for p in lp] if lengths is None else lengths, B, "lengths")
    for b in range(B):
        check(lp[b] + n[b] <= S, f"left_pad[{b}] + lengths[{b}]", f"<= {S} (stored columns)",
              lp[b] + n[b])
    return CacheState(n, lp, step, keys=keys, values=values)


# --- append / fetch ------------------------------------------------------------


def _fits(k, v, B: int, H: int, Dk: int, Dv: int, dtype) -> bool:
    """Whether new tokens ``k``, ``v`` fit rows of this batch and geometry: one
    comparison of shapes and dtypes (it runs on every append, every layer);
    ``validate_tokens`` names what does not fit."""
    if type(k) is not mx.array or type(v) is not mx.array:
        return False
    ks = k.shape
    return (len(ks) == 4 and ks[0] == B and ks[1] == H and ks[3] == Dk and ks[2] >= 1
            and v.shape == (B, H, ks[2], Dv) and k.dtype == dtype and v.dtype == dtype)


def validate_tokens(state, k, v):
    """Host checks of new tokens against the record's batch and geometry."""
    geo = geometry(state)
    if geo is not None and _fits(k, v, state.batch_size, *geo):
        return
    _check_kv("k", k, "v", v)
    (B, Hk, N, dk), dv = k.shape, v.shape[3]
    check(B == state.batch_size, "k batch size", state.batch_size, B)
    check(N >= 1, "k tokens (shape[2])", ">= 1", N)
    if geo is not None:
        H, Dk, Dv, dtype = geo
        check(Hk == H, "k heads (shape[1])", H, Hk)
        check(dk == Dk, "k head dim (shape[3])", Dk, dk)
        check(dv == Dv, "v head dim (shape[3])", Dv, dv)
        check(k.dtype == dtype, "k dtype", dtype, k.dtype)


def _grow(planes, need: int, step: int):
    """Planes with capacity ``round_up(need, step)`` (zero-filled past the old capacity)."""
    C = planes[0].shape[2]
    if need <= C:
        return planes
    return _grow_by(planes, round_up(need, step) - C)


def _grow_by(planes, extra: int):
    """Planes with ``extra`` zero columns after their capacity."""
    return tuple(
        mx.concatenate([p, mx.zeros((p.shape[0], p.shape[1], extra, p.shape[3]), p.dtype)],
                       axis=2)
        for p in planes
    )


def column_writer(ends, N: int):
    """How ``N`` new tokens ``[B, H, N, D]`` are written at the rows' ``ends``:
    a function ``write(plane, new)`` returning the written plane.

    One shared end is a single ``slice_update`` at an int32 start ``[1]``;
    differing ends a per-row scatter at column indices ``[B, 1, N, 1]`` (it
    broadcasts over heads and head dim). The index is built once per append
    on the host from host ints (fewer graph nodes than arange + broadcast)
    and serves every plane. Both write in place when nothing else holds the
    plane.

    On a GPU every write is a scatter: MLX 0.32's CUDA backend copies the
    whole plane for a dynamic-start ``slice_update`` (the step grows with the
    capacity), while its scatter writes in place (``notes/compile.md``).
    """
    if ends and ends.count(ends[0]) == len(ends) and mx.default_device().type != _GPU:
        start = mx.array([ends[0]], dtype=mx.int32)
        return lambda plane, new: mx.slice_update(plane, new, start, (2,))
    flat = [e + i for e in ends for i in range(N)]  # (one list: cheaper than nested)
    index = mx.array(flat, dtype=mx.int32).reshape(len(ends), 1, N, 1)
    return lambda plane, new: mx.put_along_axis(plane, index, new, axis=2)


_GPU = mx.DeviceType.gpu


class AppendPlan:
    """What appending ``n`` tokens does to rows of one layout, from host ints alone.

    The new ``lengths``, the width after the append, the capacity to grow
    by, and the column writer: none of it depends on the planes' heads or
    head dims, so every record with the same rows and capacity (every layer
    of a model, in one forward) shares one plan through ``Plans``.
    """

    __slots__ = ("lengths", "left_pad", "step", "capacity", "n", "width", "grow", "write",
                 "new_lengths")

    def __init__(self, lengths: tuple, left_pad: tuple, step: int, capacity: int, n: int):
        self.lengths, self.left_pad, self.step, self.capacity, self.n = (
            lengths, left_pad, step, capacity, n)
        ends = tuple(map(operator.add, left_pad, lengths))
        self.width = need = max(ends, default=0) + n
        self.new_lengths = tuple([m + n for m in lengths])
        self.grow = round_up(need, step) - capacity if need > capacity else 0
        self.write = column_writer(ends, n)


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
        if (plan is not None and plan.lengths is state.lengths
                and plan.left_pad is state.left_pad and plan.capacity == capacity
                and plan.n == n and plan.step == state.step):
            return plan
        key = (state.lengths, state.left_pad, state.step, capacity, n)
        plan = self._by_key.get(key)
        if plan is None:
            plan = self._by_key[key] = AppendPlan(*key)
        self._last = plan
        return plan


@ops.append.register
def _(state: CacheState, k, v):
    return _append_dense(state, k, v, None)[0]


def update_and_fetch(state: CacheState, k, v, plans: Optional[Plans] = None) -> tuple:
    """``append`` then ``fetch``: ``(new_state, keys, values)``, the new
    state's keys and values over its columns (what mlx-lm's
    ``update_and_fetch`` returns; the bridge's dense layers answer with it).

    ``plans``: shared by the calls of one forward, so the host work of an
    append is done once per layout instead of once per layer.
    """
    state, width = _append_dense(state, k, v, plans)
    keys, values = state.keys, state.values
    if width == keys.shape[2]:
        return state, keys, values
    return state, keys[:, :, :width], values[:, :, :width]


def _append_dense(state: CacheState, k, v, plans):
    """The decode hot path (every layer, every step): ``(new_state, its width)``.

    Anything that is not the hot path (an empty record, tokens that do not
    fit) takes the general path, which names what is wrong.
    """
    keys, values = state.keys, state.values
    if keys is None:
        state = _append_rows(state, k, v)
        return state, state.width
    kshape = keys.shape
    if not _fits(k, v, kshape[0], kshape[1], kshape[3], values.shape[3], keys.dtype):
        state = _append_rows(state, k, v)
        return state, state.width
    if plans is None:
        plan = AppendPlan(state.lengths, state.left_pad, state.step, kshape[2], k.shape[2])
    else:
        plan = plans.get(state, kshape[2], k.shape[2])
    if plan.grow:
        keys, values = _grow_by((keys, values), plan.grow)
    write = plan.write
    return CacheState(plan.new_lengths, plan.left_pad, state.step,
                      keys=write(keys, k), values=write(values, v)), plan.width


@ops.append.register
def _append_rows(state: _Rows, k, v):
    validate_tokens(state, k, v)
    new = to_planes(state, k, v)
    B, N, ends = state.batch_size, k.shape[2], state.ends
    need = max(ends, default=0) + N
    if state.planes:
        planes = _grow(state.planes, need, state.step)
    else:
        C = round_up(need, state.step)
        planes = tuple(mx.zeros((B, x.shape[1], C, x.shape[3]), x.dtype) for x in new)
    write = column_writer(ends, N)
    planes = tuple([write(p, x) for p, x in zip(planes, new)])
    return with_planes(state, planes, lengths=tuple([n + N for n in state.lengths]))


def columns(planes, width: int) -> tuple:
    """Each plane over columns ``[0, width)``."""
    if not planes or planes[0].shape[2] == width:
        return tuple(planes)
    return tuple(p[:, :, :width, :] for p in planes)


@ops.fetch.register
def _(state: CacheState):
    keys = state.keys
    if keys is None:
        raise bad("state", "a state holding keys (append first)", "an empty state")
    width = state.width
    if width == keys.shape[2]:
        return keys, state.values
    return keys[:, :, :width], state.values[:, :, :width]  # (the short index parses faster)


@ops.positions.register
def _(state: _Rows):
    return None if state.aligned else mx.array(state.lengths, dtype=mx.int32)


# --- masks and attention -------------------------------------------------------


def read_mask(state: _Rows, n: int, memo=None, window=None):
    """The mask for ``n`` queries at the rows' ends, leased through ``memo``.

    Aligned rows with no window need no array: ``None`` for one query,
    ``"causal"`` (the fused kernel's bottom-right mode) for several. Returns
    ``(mask, lease_or_None)``; release the lease once the read is built.
    """
    return _rows_read_mask(n, state.left_pad, state.ends, memo, window)


def _rows_read_mask(n: int, left_pad: tuple, ends: tuple, memo, window, array=False):
    if (not array and window is None and (not ends or ends.count(ends[0]) == len(ends))
            and not any(left_pad)):
        return (None if n == 1 else "causal"), None  # aligned
    key = rows_key(n, left_pad, ends, window)
    held = lease(memo, key, lambda: rows_mask(n, left_pad, ends, max(ends, default=0), window))
    return held.mask, held


@ops.next_mask.register
def _(state: _Rows, n, *, memo=None, window=None):
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    # The rows after n more tokens, from host ints alone (no record is built).
    left_pad = state.left_pad
    ends = tuple([p + m + n for p, m in zip(left_pad, state.lengths)])
    return _rows_read_mask(n, left_pad, ends, memo, window)


def next_mask_array(state: _Rows, n: int, *, memo=None, window=None):
    """``next_mask`` as a bool array even where ``None`` or ``"causal"`` would
    do (what an mlx-lm model asking ``make_mask(..., return_array=True)`` needs)."""
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    left_pad = state.left_pad
    ends = tuple([p + m + n for p, m in zip(left_pad, state.lengths)])
    return _rows_read_mask(n, left_pad, ends, memo, window, array=True)


def validate_queries(state, q, *, scale, window, holds=None) -> int:
    """Host checks of ``attend``'s arguments against any record; returns ``N``.

    ``holds``: the tokens each row can be read at (default ``lengths``; a
    ring passes what it still holds).
    """
    geo = geometry(state)
    check(geo is not None, "state", "a state holding keys (append first)", "an empty state")
    H, dk, _, dtype = geo
    check_scale(scale)
    if not isinstance(q, mx.array):
        raise bad("q", "an mx.array [B, Hq, N, D]", type(q).__name__)
    check(q.ndim == 4, "q rank", "4 ([B, Hq, N, D])", f"{q.ndim} {list(q.shape)}")
    check(q.shape[0] == state.batch_size, "q batch size", state.batch_size, q.shape[0])
    check(q.shape[3] == dk, "q head dim (shape[3])", dk, q.shape[3])
    check(q.shape[1] % H == 0, "q heads (shape[1])", f"a multiple of {H} (the KV heads)",
          q.shape[1])
    check(q.dtype == dtype, "q dtype", dtype, q.dtype)
    n = q.shape[2]
    check(n >= 1, "q tokens (shape[2])", ">= 1", n)
    short = min(state.lengths if holds is None else holds, default=n)
    check(n <= short, "q tokens (shape[2])",
          f"<= {short}, the fewest tokens a row holds (queries are each row's last N)", n)
    if window is not None:
        w = as_int(window, "window")
        check(w >= 1, "window", ">= 1", w)
    return n


@ops.attend.register
def _(state: CacheState, q, *, scale: float, memo=None, window=None):
    n = validate_queries(state, q, scale=scale, window=window)
    keys, values = ops.fetch(state)
    mask, held = read_mask(state, n, memo, window)
    try:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    finally:
        if held is not None:
            held.release()


# --- lengths: trim, checkpoint, rollback ------------------------------------------


@ops.trim.register
def _(state: _Rows, n):
    n = per_row(n, state.batch_size, "n")
    for b, (m, have) in enumerate(zip(n, state.lengths)):
        check(m <= have, f"n for row {b}", f"<= {have} (tokens the row holds)", m)
    return attrs.evolve(state, lengths=tuple(h - m for h, m in zip(state.lengths, n)))


@ops.checkpoint.register
def _(state: _Rows):
    return Checkpoint(state.lengths, state.left_pad)


def checkpoint_target(state, cp, keep):
    """The rows' target lengths for ``rollback`` (every record kind checks this way)."""
    if not isinstance(cp, Checkpoint):
        raise bad("checkpoint", "a Checkpoint", type(cp).__name__)
    check(cp.batch_size == state.batch_size, "checkpoint batch size", state.batch_size,
          cp.batch_size)
    check(cp.left_pad == state.left_pad, "checkpoint left_pad",
          f"{state.left_pad} (the state's row layout)", cp.left_pad)
    keep = per_row(keep, state.batch_size, "keep")
    return tuple(c + k for c, k in zip(cp.lengths, keep))


def check_checkpoint(state, cp, keep):
    """Validated target lengths for a dense ``rollback``: within what each row holds."""
    target = checkpoint_target(state, cp, keep)
    for b, (t, have) in enumerate(zip(target, state.lengths)):
        check(t <= have, f"checkpoint + keep for row {b}", f"<= {have} (tokens the row holds)", t)
    return target


@ops.rollback.register
def _(state: _Rows, checkpoint, keep=0):
    return attrs.evolve(state, lengths=check_checkpoint(state, checkpoint, keep))


@ops.anchor.register
def _(state: _Rows):
    return ops.checkpoint(state)


@ops.commit.register
def _(state: _Rows, anchor, keep=0):
    return ops.rollback(state, anchor, keep)


# --- rows: merge, filter, extract ------------------------------------------------


@ops.filter_rows.register
def _(state: _Rows, rows):
    rows = row_list(rows, state.batch_size)
    lp = [state.left_pad[r] for r in rows]
    shared = min(lp, default=0)
    lengths = tuple(state.lengths[r] for r in rows)
    planes = state.planes
    if planes:
        if rows != list(range(state.batch_size)):
            idx = mx.array(rows, dtype=mx.int32)
            planes = tuple(p[idx] for p in planes)
        if shared:
            # Padding that every survivor shares is dead weight: slice it off.
            planes = tuple(p[:, :, shared:, :] for p in planes)
    return with_planes(state, planes, lengths=lengths, left_pad=tuple(p - shared for p in lp))


@ops.extract_row.register
def _(state: _Rows, row):
    row = row_index(row, state.batch_size)
    start, n = state.left_pad[row], state.lengths[row]
    planes = tuple(mx.contiguous(p[row:row + 1, :, start:start + n, :]) for p in state.planes)
    return with_planes(state, planes, lengths=(n,), left_pad=(0,))


def check_same_geometry(states, fields=()):
    """Merging needs one geometry (heads, head dims, dtype, and ``fields``)."""
    ref = None
    for i, s in enumerate(states):
        for f in fields:
            check(getattr(s, f) == getattr(states[0], f), f"states[{i}].{f}",
                  getattr(states[0], f), getattr(s, f))
        geo = geometry(s)
        if geo is None:
            continue
        if ref is None:
            ref = (i, geo)
        elif geo != ref[1]:
            raise bad(f"states[{i}] geometry (H, Dk, Dv, dtype)",
                      f"{ref[1]} as states[{ref[0]}]", geo)
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


@ops._merge.register
def _(first: _Rows, states):
    extra = ("group_size", "bits") if hasattr(first, "bits") else ()
    check_same_geometry(states, extra)
    width = max(s.width for s in states)
    lengths, left_pad = [], []
    for s in states:
        shift = width - s.width
        lengths += s.lengths
        left_pad += [p + shift for p in s.left_pad]
    planes = merge_planes(states, width, first.step)
    return with_planes(first, planes, lengths=tuple(lengths), left_pad=tuple(left_pad))
