"""The generic functions: one per operation, dispatching on the record type.

Each function here is pure: the new record is returned and the input record
(and every array it holds) is left unchanged. Implementations are registered beside
their record kind: ``kvstate.kinds.rows`` (every kind with the padded row layout),
``kvstate.kinds.dense`` (``CacheState``), ``kinds.quantized`` and ``kinds.rotating``.
A new record kind registers its implementations of these generics (and those listed
in ``notes/core.md``, "Adding a record kind") in its own module.
"""

from __future__ import annotations

from functools import singledispatch
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import bad
from .args import PerRowInts

if TYPE_CHECKING:
    import mlx.core as mx

# Any kvstate record kind, or a list/tuple of a model's layer records (kvstate.core.layers):
# the generics dispatch on it, so no narrower static type fits every registration.
Record = Any


def _refusal(name: str, expected: str, actual: str | None = None):
    """An implementation named ``name`` that refuses any call (``actual``: the
    state's type name when ``None``)."""

    def impl(state, *args, **kwargs):
        raise bad("state", expected, type(state).__name__ if actual is None else actual)

    impl.__name__ = name
    return impl


def _unsupported(name):
    return _refusal(
        name,
        "a kvstate record (CacheState, RotatingState, QuantizedState), "
        "or a list or tuple of them (one per layer of a model)",
    )


def refuse(kind: type, generics: Sequence[Any], expected: str, actual: str, tag: str) -> None:
    """Register, for each of ``generics``, an implementation for ``kind`` that
    refuses any call: what a record kind does for an operation that does not
    apply to it.

    Args:
        kind: the record class the implementations are registered for.
        generics: the operations, e.g. ``(ops.append, ops.attend)``.
        expected: what the call needed, as ``KVStateError`` says it; ``{op}``
            stands for the operation's name.
        actual: what it got.
        tag: the implementations are named ``{op}_{tag}`` (for tracebacks).
    """
    for generic in generics:
        op = generic.__name__
        generic.register(kind)(_refusal(f"{op}_{tag}", expected.format(op=op), actual))


@singledispatch
def append(state: Record, k: mx.array, v: mx.array) -> Record:
    """Write ``k`` ``[B, H, N, Dk]`` and ``v`` ``[B, H, N, Dv]`` at each row's end.

    Returns the new state; capacity grows to a multiple of ``step``. Drop the
    old record so the write can happen in place (O(N), not O(capacity)).
    """
    return _unsupported("append")(state)


@singledispatch
def fetch(state: Record) -> tuple:
    """``(keys, values)`` over columns ``[0, width)``, as mlx-lm's ``update_and_fetch``."""
    return _unsupported("fetch")(state)


@singledispatch
def attend(
    state: Record, q: mx.array, *, scale: float, memo: Any = None, window: int | None = None
) -> mx.array:
    """Attention output ``[B, Hq, N, Dv]`` of ``q`` ``[B, Hq, N, Dk]`` over the rows.

    The ``N`` queries of row ``b`` are its last ``N`` positions (append them
    first). ``Hq`` may be a multiple of ``H`` (grouped-query attention). When
    ``memo`` is given the mask is leased from it, so layers share one build.
    """
    return _unsupported("attend")(state)


@singledispatch
def next_mask(
    state: Record,
    n: int,
    *,
    memo: Any = None,
    window: int | None = None,
    array: bool = False,
) -> tuple:
    """The mask ``attend`` will use after ``n`` more tokens are appended.

    Returns ``(mask, lease)``: ``mask`` is ``None``, ``"causal"`` or a bool
    array laid out over the columns ``update_and_read`` will return (for a
    ``RotatingState``: the ring-order read, not ``fetch``'s temporal order);
    ``lease`` is the ``MaskLease`` it came from (``None`` when no array was
    needed). With ``array=True`` the mask is always a bool array (what an
    mlx-lm model asking ``make_mask(..., return_array=True)`` needs), from the
    same builder and key family. This is what an mlx-lm cache's
    ``make_mask`` answers before ``update_and_fetch``.
    """
    return _unsupported("next_mask")(state)


@singledispatch
def update_and_read(state, k, v, plans=None):
    """``append``, then the new state's read: ``(new_state, keys, values)``.

    What an mlx-lm cache's ``update_and_fetch`` returns: ``fetch``'s columns
    for the padded row layout, the ring-order read for a ``RotatingState``
    (``next_mask`` is laid out over exactly these columns). ``plans`` (a
    ``kvstate.kinds.rows.Plans``) lets the layers of one forward share their host
    work; kinds that do not plan ignore it.
    """
    return _unsupported("update_and_read")(state)


@singledispatch
def positions(state: Record) -> Any:
    """``None`` when aligned, else ``mx.array`` int32 ``[B]``: each row's next RoPE offset."""
    return _unsupported("positions")(state)


@singledispatch
def trim(state: Record, n: PerRowInts) -> Record:
    """Drop the last ``n`` tokens of every row (``n``: int or one per row)."""
    return _unsupported("trim")(state)


@singledispatch
def checkpoint(state: Record) -> Any:
    """A ``Checkpoint`` of the row lengths; it holds no arrays."""
    return _unsupported("checkpoint")(state)


@singledispatch
def rollback(state: Record, checkpoint: Any, keep: PerRowInts = 0) -> Record:
    """Rows return to ``checkpoint`` plus ``keep`` accepted tokens (int or per row)."""
    return _unsupported("rollback")(state)


@singledispatch
def anchor(state: Record) -> Any:
    """What ``commit`` needs to bring ``state`` back after later appends.

    A ``Checkpoint`` (no arrays) for dense and quantized rows, whose rollback
    is free; the record itself for a ring, whose single-token appends
    overwrite entries a rollback of more than one token needs.
    """
    return _unsupported("anchor")(state)


@singledispatch
def commit(state: Record, anchor: Any, keep: PerRowInts = 0) -> Record:
    """Rows return to ``anchor`` plus the first ``keep`` tokens appended since
    (int or per row), as appending those tokens one position at a time would
    have left them.

    ``anchor`` is ``anchor(earlier)`` of an earlier record of this one's
    history (same rows). With a ``Checkpoint`` this is ``rollback``; with a
    ring record it takes the kept tokens' entries from ``state`` and writes
    them, position by position, into the earlier ring, so any accepted count
    comes back however the draft was appended (one token at a time or as
    one block).
    """
    return _unsupported("commit")(state)


@singledispatch
def filter_rows(state: Record, rows: Sequence[int]) -> Record:
    """Keep ``rows`` in that order, then drop the padding columns every survivor shares."""
    return _unsupported("filter_rows")(state)


@singledispatch
def extract_row(state: Record, row: int) -> Record:
    """A one-row state with no padding owning a compact copy (it does not pin the batch)."""
    return _unsupported("extract_row")(state)


@singledispatch
def merge_same_kind(first, states):
    """``merge_rows`` for ``states`` (two or more, all of ``first``'s kind; checked)."""
    return _unsupported("merge_rows")(first)


def merge_rows(states: Sequence[Record]) -> Record:
    """One state whose rows are the inputs' rows, in order.

    Narrower inputs are left-padded so that every row ends at the common width.
    All inputs must be records of one kind and one geometry.
    """
    if isinstance(states, (str, bytes)) or not isinstance(states, (list, tuple)):
        raise bad("states", "a list of records (or of models' layer lists)", type(states).__name__)
    states = list(states)
    if not states:
        raise bad("states", "at least one record", "an empty list")
    kind = type(states[0])
    for i, s in enumerate(states):
        if type(s) is not kind:
            raise bad(f"states[{i}]", f"a {kind.__name__} like states[0]", type(s).__name__)
    if len(states) == 1:
        return states[0]
    return merge_same_kind(states[0], states)


def extend(state: Record, other: Record) -> Record:
    """``merge_rows([state, other])``."""
    return merge_rows([state, other])


# The operations every record kind answers, re-exported by ``kvstate`` (whose
# ``__all__`` takes this list). ``update_and_read``, ``merge_same_kind`` and
# ``refuse`` are what a record kind registers or calls, not user operations.
__all__ = [
    "append",
    "fetch",
    "attend",
    "next_mask",
    "positions",
    "trim",
    "checkpoint",
    "rollback",
    "anchor",
    "commit",
    "filter_rows",
    "extract_row",
    "merge_rows",
    "extend",
]
