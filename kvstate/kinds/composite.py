"""Layers with several caches: ``CompositeState``, mlx-lm's ``CacheList``.

A composite is a tuple of records holding the same rows; every function
applies to each part and rebuilds the tuple (falcon_h1's layers: a
``RecurrentState`` for the mamba mixer, a ``CacheState`` for attention).
Appends and attention reads go to one part, as the model addresses them
(``cache[0]``, ``cache[1]``), so ``append``, ``attend`` and ``next_mask``
on the composite itself are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ..compiled import boundary as compiled
from ..core import ops
from ..core.invariants import validate
from ..core.records import CompositeCheckpoint, CompositeState, built
from ..errors import bad, check

__all__ = ["composite_state"]


def composite_state(parts: Sequence) -> CompositeState:
    """A ``CompositeState`` of ``parts`` (kvstate records with the same rows)."""
    if isinstance(parts, (str, bytes)) or not hasattr(parts, "__len__"):
        raise bad("parts", "a list of records", type(parts).__name__)
    parts = tuple(parts)
    check(len(parts) >= 1, "parts", "at least one record", "none")
    for i, p in enumerate(parts):
        if not hasattr(p, "batch_size") or not attrs.has(type(p)):
            raise bad(f"parts[{i}]", "a kvstate record", type(p).__name__)
        check(
            p.batch_size == parts[0].batch_size,
            f"parts[{i}] batch size",
            parts[0].batch_size,
            p.batch_size,
        )
    return CompositeState(parts)


ops.refuse(
    CompositeState,
    (ops.append, ops.attend, ops.next_mask, ops.update_and_read),
    "one record ({op} applies to one part: state.parts[i])",
    "a CompositeState",
    "composite",
)


def of_parts(parts) -> CompositeState:
    """A ``CompositeState`` of ``parts`` derived by kvstate's pure functions from
    a valid one's: not validated again (``kvstate.core.invariants``)."""
    return built(CompositeState, {"parts": tuple(parts)})


def _each(state, fn):
    return of_parts(fn(p) for p in state.parts)


def _check_parts(parts, arg: str, part_check) -> int:
    """``parts``: a non-empty tuple, each passing ``part_check`` (its kind's
    ``validate``), all of one batch size. Returns the batch size."""
    if type(parts) is not tuple:
        raise bad(f"{arg}.parts", "a tuple of records", type(parts).__name__)
    if not parts:
        raise bad(f"{arg}.parts", "at least one record", "none")
    for i, p in enumerate(parts):
        part_check(p, f"{arg}.parts[{i}]")
        if p.batch_size != parts[0].batch_size:
            raise bad(
                f"{arg}.parts[{i}] batch size", f"{parts[0].batch_size} (as parts[0])", p.batch_size
            )
    return parts[0].batch_size


def _valid_record(p, arg: str) -> None:
    if validate.dispatch(type(p)) is validate.dispatch(object) or not hasattr(p, "batch_size"):
        raise bad(arg, "a kvstate record", type(p).__name__)
    validate(p)


@validate.register
def validate_composite(state: CompositeState):
    """Each part a valid record, all of one batch size (row ids: each part's
    own; ``notes/core.md``)."""
    _check_parts(state.parts, "state", _valid_record)
    return state


@validate.register
def validate_composite_checkpoint(cp: CompositeCheckpoint):
    """Each part a valid checkpoint, all of one batch size."""
    _check_parts(cp.parts, "checkpoint", _valid_record)
    return cp


@ops.fetch.register(CompositeState)
def fetch_composite(state):
    """Each part's ``fetch``, in order."""
    return tuple(ops.fetch(p) for p in state.parts)


@ops.positions.register(CompositeState)
def positions_composite(state):
    """The first part's positions that are not ``None`` (every part counts the same tokens)."""
    for p in state.parts:
        pos = ops.positions(p)
        if pos is not None:
            return pos
    return None


@ops.trim.register(CompositeState)
def trim_composite(state, n):
    return _each(state, lambda p: ops.trim(p, n))


@ops.checkpoint.register(CompositeState)
def checkpoint_composite(state):
    return built(CompositeCheckpoint, {"parts": tuple(ops.checkpoint(p) for p in state.parts)})


@ops.rollback.register(CompositeState)
def rollback_composite(state, checkpoint, keep=0):
    if not isinstance(checkpoint, CompositeCheckpoint):
        raise bad(
            "checkpoint",
            "a CompositeCheckpoint (kv.checkpoint of a CompositeState)",
            type(checkpoint).__name__,
        )
    check(
        len(checkpoint.parts) == len(state.parts),
        "checkpoint parts",
        len(state.parts),
        len(checkpoint.parts),
    )
    return of_parts(ops.rollback(p, c, keep) for p, c in zip(state.parts, checkpoint.parts))


@ops.anchor.register(CompositeState)
def anchor_composite(state):
    return built(CompositeCheckpoint, {"parts": tuple(ops.anchor(p) for p in state.parts)})


@ops.commit.register(CompositeState)
def commit_composite(state, anchor, keep=0):
    check(
        isinstance(anchor, CompositeCheckpoint) and len(anchor.parts) == len(state.parts),
        "anchor",
        f"kv.anchor of a CompositeState of {len(state.parts)} parts",
        type(anchor).__name__,
    )
    return of_parts(ops.commit(p, a, keep) for p, a in zip(state.parts, anchor.parts))


@ops.filter_rows.register(CompositeState)
def filter_rows_composite(state, rows):
    return _each(state, lambda p: ops.filter_rows(p, rows))


@ops.extract_row.register(CompositeState)
def extract_row_composite(state, row):
    return _each(state, lambda p: ops.extract_row(p, row))


@ops.merge_same_kind.register(CompositeState)
def merge_composite(first, states):
    kinds = tuple(type(p) for p in first.parts)
    for i, s in enumerate(states):
        got = tuple(type(p) for p in s.parts)
        check(
            got == kinds,
            f"states[{i}] parts",
            [k.__name__ for k in kinds],
            [k.__name__ for k in got],
        )
    return of_parts(ops.merge_rows([s.parts[j] for s in states]) for j in range(len(kinds)))


# --- the compile boundary (kvstate.compiled): the parts' planes and positions, in order -----


@attrs.frozen
class CompositeSpec(compiled.Spec):
    """The static half of a ``CompositeState``: one ``Spec`` per part.

    Its ``key`` holds each part's key and its counts of planes and position
    arrays, so a traced step can cut the flat arrays back into part views.
    """

    parts: tuple = ()

    @property
    def static(self) -> tuple:
        return (
            (
                "parts",
                tuple(
                    (p.key, sum(c or 1 for _, c in p.arrays), n)
                    for p, n in zip(self.parts, self.positions)
                ),
            ),
        )

    positions: tuple = ()

    def replace(self, parts=(), **fields) -> "CompositeSpec":
        check(not fields, "fields", "parts (one dict of host fields per part)", sorted(fields))
        return attrs.evolve(self, parts=tuple(p.replace(**f) for p, f in zip(self.parts, parts)))

    def rebuild(self, planes: tuple, *, trusted: bool = False, like=None) -> CompositeState:
        out, i = [], 0
        likes = (None,) * len(self.parts) if like is None else like.parts
        for p, part in zip(self.parts, likes):
            n = sum(c or 1 for _, c in p.arrays)
            out.append(p.rebuild(tuple(planes[i : i + n]), trusted=trusted, like=part))
            i += n
        return of_parts(out) if trusted else CompositeState(tuple(out))


@compiled.spec_of.register(CompositeState)
def spec_of_composite(state):
    parts = tuple(compiled.spec_of(p) for p in state.parts)
    count = sum(sum(c or 1 for _, c in p.arrays) for p in parts)
    return CompositeSpec(
        CompositeState,
        (),
        (("parts", count),),
        parts=parts,
        positions=tuple(len(compiled.host_positions(p)) for p in state.parts),
    )


@compiled.host_positions.register(CompositeState)
def host_positions_composite(state):
    return tuple(x for p in state.parts for x in compiled.host_positions(p))


@compiled.prepare.register(CompositeState)
def prepare_composite(state, n: int = 1):
    return _each(state, lambda p: compiled.prepare(p, n))


@compiled.advanced.register(CompositeState)
def advanced_composite(state, n: int = 1) -> dict:
    return {"parts": tuple(compiled.advanced(p, n) for p in state.parts)}
