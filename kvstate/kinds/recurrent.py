"""Recurrent layers: ``RecurrentState``, mlx-lm's ``ArraysCache``, batched.

A recurrent layer keeps a few fixed-size arrays ("slots") per row; the
model computes the new slots from the old ones and writes them back
(``cache[i] = x``), then counts its tokens (``cache.advance(N)``). Here
those are two pure functions, ``set_slot`` and ``advance``; the mlx-lm
bridge calls them when the model writes. A slot that was never written
(``None``) means zeros, as in mlx-lm (its models start from zeros, its
``merge`` and ``extend`` fill with zeros).

Padding, as mlx-lm's ``ArraysCache`` has it, is of the tokens to come, not
of columns (a recurrent row has none)::

    next append, row b:   p = 0 .. left_padding[b]-1   left_padding[b] .. until[b]-1   until[b] ..
                          padding: state unchanged      real tokens                     padding

``mask(state, n)`` is that picture as the bool ``[B, n]`` the model reads
from ``make_mask``, and ``until`` is what it reads as ``cache.lengths``. A
batch of ragged prompts right-padded to one length (``prepare(state,
until=lengths)``) leaves each row with its solo state.

Recurrent state cannot be un-applied: ``trim`` is refused, a checkpoint
keeps the slots, and ``rollback`` returns each row to the checkpoint or
keeps it as it is. Keeping part of an append replays the accepted tokens
from the checkpoint through the model (``kvstate.mlx_lm.rollback``);
``notes/kinds.md`` says why and what it costs.
"""

from __future__ import annotations

import mlx.core as mx

from ..compiled import boundary as compiled
from ..core import ops
from ..core.args import PerRowInts, as_int, per_row, row_count, row_index, row_list
from ..core.invariants import MAX_POSITION, check_int, validate
from ..core.records import RecurrentCheckpoint, RecurrentState, derived, rows_of
from ..errors import bad, check

__all__ = [
    "advance",
    "finalize",
    "mask",
    "prepare",
    "recurrent_state",
    "set_slot",
    "until_array",
]


def recurrent_state(
    batch_size: int = 1, *, slots: int, left_padding: PerRowInts | None = None
) -> RecurrentState:
    """An empty ``RecurrentState``: ``batch_size`` rows of ``slots`` unwritten slots.

    Args:
        slots: arrays per row (mlx-lm ``ArraysCache(size)``).
        left_padding: optional padding tokens per row at the front of the
            coming appends (mlx-lm ``ArraysCache(size, left_padding)``).
    """
    batch_size = row_count(batch_size, "batch_size")
    slots = as_int(slots, "slots")
    check(slots >= 1, "slots", ">= 1", slots)
    pad = per_row(0 if left_padding is None else left_padding, batch_size, "left_padding")
    return RecurrentState((0,) * batch_size, pad, None, arrays=(None,) * slots)


# --- what the model writes -----------------------------------------------------------


def set_slot(state: RecurrentState, index: int, value: mx.array) -> RecurrentState:
    """``state`` with slot ``index`` replaced by ``value`` ``[B, ...]``.

    A slot that holds an array keeps its shape and dtype.
    """
    index = as_int(index, "index")
    slots = state.arrays
    check(0 <= index < len(slots), "index", f"a slot index in [0, {len(slots)})", index)
    if not isinstance(value, mx.array):
        raise bad("value", "an mx.array [B, ...]", type(value).__name__)
    check(
        value.ndim >= 1 and value.shape[0] == state.batch_size,
        "value batch size (shape[0])",
        state.batch_size,
        list(value.shape),
    )
    old = slots[index]
    if old is not None:
        check(value.shape == old.shape, f"slot {index} shape", list(old.shape), list(value.shape))
        check(value.dtype == old.dtype, f"slot {index} dtype", old.dtype, value.dtype)
    return derived(state, arrays=slots[:index] + (value,) + slots[index + 1 :])


def _real(n: int, pad: int, until: int | None) -> int:
    """Real tokens among the next ``n`` of a row (see the module picture)."""
    end = n if until is None else min(max(until, 0), n)
    return max(0, end - pad)


def advance(state: RecurrentState, n: int) -> RecurrentState:
    """Count ``n`` appended tokens: each row gains its real ones, and the
    padding still to come shrinks by ``n`` (mlx-lm's ``advance``)."""
    n = as_int(n, "n")
    check(n >= 0, "n", ">= 0", n)
    until = state.until or (None,) * state.batch_size
    lengths = tuple(m + _real(n, p, u) for m, p, u in zip(state.lengths, state.left_padding, until))
    pad = tuple(max(0, p - n) for p in state.left_padding)
    new_until = None if state.until is None else tuple(u - n for u in state.until)
    return derived(state, lengths=lengths, left_padding=pad, until=new_until)


def mask(state: RecurrentState, n: int) -> mx.array | None:
    """``None`` when none of the next ``n`` tokens is padding, else the bool
    ``[B, n]`` the model reads from ``make_mask`` (True = a real token)."""
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    pad, until = state.left_padding, state.until
    if not any(pad) and (until is None or min(until) >= n):
        return None
    pos = mx.arange(n)
    out = pos >= mx.array(pad, dtype=mx.int32)[:, None]
    if until is not None:
        out = out & (pos < mx.array(until, dtype=mx.int32)[:, None])
    return out


def until_array(state: RecurrentState) -> mx.array | None:
    """``until`` as the int32 ``[B]`` the model reads as ``cache.lengths``, or ``None``."""
    return None if state.until is None else mx.array(state.until, dtype=mx.int32)


def prepare(
    state: RecurrentState,
    *,
    left_padding: PerRowInts | None = None,
    until: PerRowInts | None = None,
) -> RecurrentState:
    """``state`` with padding for the coming appends (mlx-lm's ``prepare``).

    Args:
        left_padding: per row, padding tokens at the front (added to any pending).
        until: per row, where right padding starts, counted from the next
            append's first token (mlx-lm's ``prepare(lengths=...)``).
    """
    B = state.batch_size
    pad = state.left_padding
    if left_padding is not None:
        pad = tuple(a + b for a, b in zip(pad, per_row(left_padding, B, "left_padding")))
    new_until = state.until if until is None else per_row(until, B, "until")
    return derived(state, left_padding=pad, until=new_until)


def finalize(state: RecurrentState) -> RecurrentState:
    """``state`` with no padding pending (mlx-lm's ``finalize``)."""
    if state.until is None and not any(state.left_padding):
        return state
    return derived(state, left_padding=(0,) * state.batch_size, until=None)


# --- the generic functions -------------------------------------------------------------


ops.refuse(
    RecurrentState,
    (ops.append, ops.attend, ops.next_mask, ops.update_and_read),
    "a record holding keys and values ({op} reads or writes them)",
    "a RecurrentState (the model writes its slots: kvstate.kinds.recurrent.set_slot)",
    "recurrent",
)


@ops.fetch.register(RecurrentState)
def fetch_recurrent(state):
    """The slots (``None`` where the model has not written one)."""
    return state.arrays


@ops.positions.register(RecurrentState)
def positions_recurrent(state):
    return None if len(set(state.lengths)) <= 1 else mx.array(state.lengths, dtype=mx.int32)


@ops.trim.register(RecurrentState)
def trim_recurrent(state, n):
    n = per_row(n, state.batch_size, "n")
    for b, m in enumerate(n):
        check(
            m == 0,
            f"n for row {b}",
            "0 (recurrent state cannot be trimmed: checkpoint, then rollback)",
            m,
        )
    return state


@ops.checkpoint.register(RecurrentState)
def checkpoint_recurrent(state):
    _check_settled(state, "state")
    return RecurrentCheckpoint(state.lengths, state.arrays)


def _check_settled(state, arg):
    check(
        state.until is None and not any(state.left_padding),
        arg,
        "a state with no padding pending (kvstate.kinds.recurrent.finalize)",
        f"left_padding={state.left_padding}, until={state.until}",
    )


def _zeros_like_rows(template, B):
    return mx.zeros((B,) + tuple(template.shape[1:]), template.dtype)


@ops.anchor.register(RecurrentState)
def anchor_recurrent(state):
    """The checkpoint (its slots): what ``commit`` returns rows to."""
    return checkpoint_recurrent(state)


@ops.commit.register(RecurrentState)
def commit_recurrent(state, anchor, keep=0):
    """``rollback``: exact for rows keeping all or none of what they appended."""
    return rollback_recurrent(state, anchor, keep)


@ops.rollback.register(RecurrentState)
def rollback_recurrent(state, checkpoint, keep=0):
    """Each row returns to ``checkpoint`` (``keep`` 0) or stays as it is
    (``keep`` = the tokens appended since); nothing else can be exact without
    the model, so anything else is refused (``kvstate.mlx_lm.rollback`` replays)."""
    if not isinstance(checkpoint, RecurrentCheckpoint):
        raise bad(
            "checkpoint",
            "a RecurrentCheckpoint (kv.checkpoint of a RecurrentState)",
            type(checkpoint).__name__,
        )
    B = state.batch_size
    check(checkpoint.batch_size == B, "checkpoint batch size", B, checkpoint.batch_size)
    check(
        len(checkpoint.arrays) == len(state.arrays),
        "checkpoint slots",
        len(state.arrays),
        len(checkpoint.arrays),
    )
    _check_settled(state, "state")
    keep = per_row(keep, B, "keep")
    back = []
    for b, (c, k, n) in enumerate(zip(checkpoint.lengths, keep, state.lengths)):
        if c + k == n:
            back.append(False)
        elif k == 0 and c <= n:
            back.append(True)
        else:
            raise bad(
                f"keep for row {b}",
                f"0 or {n - c} (a recurrent row returns to its checkpoint or keeps its "
                "append; kvstate.mlx_lm.rollback replays part of one)",
                k,
            )
    if not any(back):
        return state
    if all(back):
        arrays = checkpoint.arrays
    else:
        rows = mx.array(back)
        arrays = []
        for i, (old, new) in enumerate(zip(checkpoint.arrays, state.arrays)):
            if old is None and new is None:
                arrays.append(None)
                continue
            old = _zeros_like_rows(new, B) if old is None else old
            new = _zeros_like_rows(old, B) if new is None else new
            check(
                old.shape == new.shape and old.dtype == new.dtype,
                f"checkpoint slot {i}",
                f"{new.dtype}{list(new.shape)}",
                f"{old.dtype}{list(old.shape)}",
            )
            pick = rows.reshape((B,) + (1,) * (new.ndim - 1))
            arrays.append(mx.where(pick, old, new))
    lengths = tuple(c if r else n for c, r, n in zip(checkpoint.lengths, back, state.lengths))
    return derived(state, lengths=lengths, arrays=tuple(arrays))


@ops.filter_rows.register(RecurrentState)
def filter_rows_recurrent(state, rows):
    rows = row_list(rows, state.batch_size)
    fields = ("lengths", "left_padding", "until")
    return derived(
        state,
        **{f: rows_of(getattr(state, f), rows) for f in fields},
        arrays=tuple(rows_of(a, rows) for a in state.arrays),
    )


@ops.extract_row.register(RecurrentState)
def extract_row_recurrent(state, row):
    """One row owning compact copies of its slots (it does not pin the batch)."""
    row = row_index(row, state.batch_size)
    arrays = tuple(None if a is None else mx.contiguous(a[row : row + 1]) for a in state.arrays)
    until = None if state.until is None else (state.until[row],)
    return derived(
        state,
        lengths=(state.lengths[row],),
        left_padding=(state.left_padding[row],),
        until=until,
        arrays=arrays,
    )


@ops.merge_same_kind.register(RecurrentState)
def merge_recurrent(first, states):
    n = len(first.arrays)
    for i, s in enumerate(states):
        check(len(s.arrays) == n, f"states[{i}] slots", n, len(s.arrays))
        check(
            s.until is None,
            f"states[{i}].until",
            "None (merge rows with no right padding pending: kvstate.kinds.recurrent.finalize)",
            s.until,
        )
    arrays = []
    for j in range(n):
        present = [(i, s.arrays[j]) for i, s in enumerate(states) if s.arrays[j] is not None]
        if not present:
            arrays.append(None)
            continue
        i0, ref = present[0]
        for i, a in present[1:]:
            check(
                a.shape[1:] == ref.shape[1:] and a.dtype == ref.dtype,
                f"states[{i}] slot {j}",
                f"{ref.dtype}{list(ref.shape[1:])} as states[{i0}]",
                f"{a.dtype}{list(a.shape[1:])}",
            )
        arrays.append(
            mx.concatenate(
                [
                    s.arrays[j] if s.arrays[j] is not None else _zeros_like_rows(ref, s.batch_size)
                    for s in states
                ],
                axis=0,
            )
        )
    return derived(
        first,
        lengths=sum((s.lengths for s in states), ()),
        left_padding=sum((s.left_padding for s in states), ()),
        until=None,
        arrays=tuple(arrays),
    )


# --- the compile boundary (kvstate.compiled): slots are the planes, lengths the positions ---


@compiled.host_positions.register(RecurrentState)
def host_positions_recurrent(state):
    return (state.lengths,)


@compiled.prepare.register(RecurrentState)
def prepare_recurrent(state, n: int = 1):
    """As it is (fixed-size slots); refused with padding pending or a slot unwritten."""
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    _check_settled(state, "state")
    check(
        all(a is not None for a in state.arrays),
        "state",
        "a state whose slots the model has written (prefill first)",
        f"slots {[a is not None for a in state.arrays]}",
    )
    return state


@compiled.with_capacity.register(RecurrentState)
def with_capacity_recurrent(state, capacity: int):
    return state  # fixed-size slots: no capacity


@compiled.advanced.register(RecurrentState)
def advanced_recurrent(state, n: int = 1) -> dict:
    return {"lengths": tuple(m + n for m in state.lengths)}


# --- invariants (kvstate.core.invariants) ---------------------------------------------------------


def _check_row_ints(values, arg: str, B: int, low: int = 0) -> None:
    """``values`` is a tuple of ``B`` ints (one per row), each in ``[low, MAX_POSITION]``."""
    if type(values) is not tuple:
        raise bad(arg, "a tuple of ints", type(values).__name__)
    if len(values) != B:
        raise bad(arg, f"{B} values (one per row, as lengths)", len(values))
    for b, v in enumerate(values):
        check_int(v, f"{arg}[{b}]", low)


def _check_slots(arrays, arg: str, B: int) -> None:
    """Each slot ``None`` (unwritten) or an ``mx.array`` ``[B, ...]`` (any dtype: a
    model may keep integer slots)."""
    if type(arrays) is not tuple:
        raise bad(arg, "a tuple of slots", type(arrays).__name__)
    for i, a in enumerate(arrays):
        if a is None:
            continue
        if type(a) is not mx.array:
            raise bad(f"{arg}[{i}]", "an mx.array [B, ...] or None", type(a).__name__)
        if a.ndim < 1 or a.shape[0] != B:
            raise bad(f"{arg}[{i}] batch (shape[0])", f"{B} (one per row)", list(a.shape))


@validate.register
def validate_recurrent(state: RecurrentState):
    """One non-negative ``lengths`` and ``left_padding`` int per row, ``until``
    ``None`` or one int per row (negative once the right padding is passed),
    each slot unwritten or an array of ``B`` rows."""
    B = len(state.lengths)
    _check_row_ints(state.lengths, "state.lengths", B)
    _check_row_ints(state.left_padding, "state.left_padding", B)
    if state.until is not None:
        _check_row_ints(state.until, "state.until", B, -MAX_POSITION)
    _check_slots(state.arrays, "state.arrays", B)
    return state


@validate.register
def validate_recurrent_checkpoint(cp: RecurrentCheckpoint):
    """One non-negative ``lengths`` int per row; the slots as a state's."""
    B = len(cp.lengths)
    _check_row_ints(cp.lengths, "checkpoint.lengths", B)
    _check_slots(cp.arrays, "checkpoint.arrays", B)
    return cp
