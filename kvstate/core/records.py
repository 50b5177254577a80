"""The records: immutable data, no behaviour beyond derived properties.

Every record is an ``attrs`` frozen class. Functions in ``kvstate.core.ops`` (and
the per-record modules ``dense``, ``quantized``, ``rotating``) take a record
and return a new one; nothing here is ever mutated.

Row layout of a dense record (``CacheState`` and ``QuantizedState``), one
picture for the whole package::

    column:    0        left_pad[b]          ends[b]       width      C
               |            |                   |            |        |
    row 0:     . . . . . .  k k k k k k k k k k  s s           . . . . .
    row 1:     k k k k k k  k k k k k k k k k k  k k k k k k k . . . . .
    row 2:     . . . . . .  . . . . k k k k k k  k k k k  s s  . . . . .
               \\_ padding _/\\______ tokens ______/\\_ stale _/\\ spare __/

    ends[b]  = left_pad[b] + lengths[b]    (the next append writes here)
    width    = max(ends)                   (what ``fetch`` returns)
    C        = capacity, a multiple of ``step`` after any growth

Padding columns come from merging rows of different widths (rows are
left-padded so they end together, as in mlx-lm's ``BatchKVCache``). Stale
columns are tokens a row no longer holds (a rejected draft, a right-padded
prefill): masks never expose them and the next append overwrites them. Rows
advance independently: each append writes row ``b`` at its own ``ends[b]``.

Host bookkeeping (``lengths``, ``left_pad``) is plain tuples of ints, so
validation, mask keys and checkpoints never wait on the device.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import singledispatch
from typing import Any, ClassVar, Optional

import attrs
import mlx.core as mx

from ..errors import bad
from .handles import Owned, owns_arrays
from .invariants import check_int, clear_hidden, fresh_row_ids, validate


def _tuple(value) -> tuple:
    """``tuple(value)``, as a named converter (mypy's attrs plugin types its ``__init__``)."""
    return tuple(value)


def _tuple_of_ints(value) -> tuple:
    """Host bookkeeping as a tuple of ints (numpy ints too); a float or any
    other non-integer is refused rather than truncated.

    A tuple of ints is kept as it is, so records made from one plan share
    one tuple (``_rows.Plans`` and the bridge match layouts by identity)."""
    if type(value) is tuple:
        for x in value:
            if type(x) is not int:
                break
        else:
            return value
    try:
        return tuple(map(operator.index, value))
    except TypeError:
        raise bad(
            "row bookkeeping (lengths, left_pad, held)", "a sequence of ints", repr(value)
        ) from None


def _row_ids(value):
    """``row_ids``: ``None`` (fresh ids are drawn) or a tuple of ints."""
    return None if value is None else _tuple_of_ints(value)


def row_ids_of(state) -> tuple:
    """``state.row_ids``: always a tuple once constructed (``_constructed`` draws fresh
    ids where ``None`` was given), though the field's type admits ``None``."""
    return state.row_ids


def forwarded(path: str, doc: str | None = None) -> Any:
    """A read-only property answering ``self.<path>`` (a dotted path, e.g.
    ``"suffix.step"``): a value that holds a record and answers for it."""
    get = operator.attrgetter(path)
    return property(get, doc=doc or f"``self.{path}``.")


def rows_of(value, rows: Sequence[int]):
    """``value``'s entries for ``rows``, in that order: an ``mx.array`` ``[B, ...]``
    on its first axis (the array itself when ``rows`` is every row in order), a
    tuple (one item per row) item by item, ``None`` stays ``None``. What every
    ``filter_rows`` does to each per-row field."""
    if value is None:
        return None
    if isinstance(value, mx.array):
        if list(rows) == list(range(value.shape[0])):
            return value
        return value[mx.array(list(rows), dtype=mx.int32)]
    return tuple(value[r] for r in rows)


def _constructed(self):
    """After a constructor: fresh row ids where none were given, the kind's
    ``validate``, then zeros in every column no row reads (``clear_hidden``:
    arrays from outside may hold anything there). See ``kvstate.core.invariants``."""
    if self.row_ids is None:
        object.__setattr__(self, "row_ids", fresh_row_ids(len(self.lengths)))
    validate(self)
    clean = clear_hidden(self)
    if clean is not self:
        object.__setattr__(self, "keys", clean.keys)
        object.__setattr__(self, "values", clean.values)


def _validated(self):
    """After the constructor of a record without hidden columns: its kind's ``validate``."""
    validate(self)


_new = object.__new__
_set = object.__setattr__
_FIELDS: dict = {}


def derived(state, **changes):
    """A copy of ``state`` with ``changes``, not validated again.

    For kvstate's pure functions only, which derive valid records from
    valid records (the hot path of every append): the fields are taken as
    given, with no converter and no ``validate``. Anything built from
    outside numbers goes through the record's constructor, which checks.
    A change of the row count without ``row_ids`` makes new rows (fresh ids).
    """
    cls = type(state)
    known = _FIELDS.get(cls)
    if known is None:
        names = frozenset(f.name for f in attrs.fields(cls))
        slots = tuple((f.name, *_slot_access(cls, f.name)) for f in attrs.fields(cls))
        known = _FIELDS[cls] = (names, slots)
    names, slots = known
    lengths = changes.get("lengths")
    if (
        lengths is not None
        and "row_ids" not in changes
        and "row_ids" in names
        and len(lengths) != len(state.row_ids)
    ):
        changes["row_ids"] = fresh_row_ids(len(lengths))
    new, hit = _new(cls), 0
    for name, get, put, take in slots:
        if name in changes:
            hit += 1
            take(new, changes[name])
        else:  # the stored handle itself: no one but records ever holds it
            put(new, get(state))
    if hit != len(changes):
        raise TypeError(f"{cls.__name__} has no field {sorted(changes.keys() - names)}")
    return new


def _slot_access(cls, name: str) -> tuple:
    """``(get, put, take)`` for field ``name`` of ``cls``: the stored value as
    it is (``get``, ``put``: record to record) and the field's own setter
    (``take``: a value from anywhere, given a fresh handle if it is an array)."""
    take = _setter(cls, name)
    owned = cls.__dict__.get(name)
    if isinstance(owned, Owned):
        return owned.get, owned.put, take
    return operator.attrgetter(name), take, take


def built(cls, fields: dict, *, convert: bool = False):
    """A record of ``cls`` holding ``fields`` (a missing field is ``None``), not
    validated: ``derived`` for a record rebuilt from its parts (the compile
    boundary's own step). ``convert``: run the fields' converters."""
    new = _new(cls)
    for f in attrs.fields(cls):
        value = fields.get(f.name)
        if convert and value is not None and f.converter is not None:
            value = f.converter(value)
        _set(new, f.name, value)
    return new


def maker(cls, fields: dict, arrays: tuple):
    """``make(planes)``: ``built(cls, fields | arrays from planes)``, for many
    records of one layout (a compiled step's layers): each field's slot
    setter is found once, here, not once per record. ``arrays``: ``((name,
    count), ...)`` in plane order (``count`` 0: one array, else a tuple of
    that many)."""
    setters = _SETTERS.get(cls)
    if setters is None:
        setters = _SETTERS[cls] = {f.name: _setter(cls, f.name) for f in attrs.fields(cls)}
    taken = {n for n, _ in arrays}
    fixed = tuple((put, fields.get(n)) for n, put in setters.items() if n not in taken)
    if all(c == 0 for _, c in arrays):
        single = tuple(setters[n] for n, _ in arrays)

        def make(planes):
            new = _new(cls)
            for put, v in fixed:
                put(new, v)
            for put, v in zip(single, planes):
                put(new, v)
            return new

        return make
    grouped = tuple((setters[n], c) for n, c in arrays)

    def make_grouped(planes):
        new, i = _new(cls), 0
        for put, v in fixed:
            put(new, v)
        for put, c in grouped:
            put(new, planes[i] if c == 0 else tuple(planes[i : i + c]))
            i += c or 1
        return new

    return make_grouped


_SETTERS: dict = {}


def _setter(cls, name: str):
    """``put(record, value)`` for field ``name`` of ``cls``: its slot's own
    setter (what ``object.__setattr__`` ends in, less the name lookup), or
    ``object.__setattr__`` for a class without slots."""
    for c in cls.__mro__:
        slot = c.__dict__.get(name)
        if slot is not None:
            put = getattr(type(slot), "__set__", None)
            if put is not None:
                return slot.__set__
            break
    return lambda new, value: _set(new, name, value)


def _array_repr(value) -> str:
    """Arrays print as ``dtype[shape]``: a record's repr never dumps its data."""
    if value is None:
        return "None"
    if isinstance(value, mx.array):
        return f"{value.dtype}{list(value.shape)}".replace("mlx.core.", "")
    return "(" + ", ".join(_array_repr(v) for v in value) + ")"


@attrs.frozen
class _Rows:
    """Fields and properties shared by the dense layouts (see module picture)."""

    lengths: tuple = attrs.field(converter=_tuple_of_ints)
    left_pad: tuple = attrs.field(converter=_tuple_of_ints)
    step: int = 256
    row_ids: Optional[tuple] = attrs.field(
        default=None, kw_only=True, eq=False, repr=False, converter=_row_ids
    )

    __attrs_post_init__ = _constructed

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def ends(self) -> tuple:
        return tuple(map(operator.add, self.left_pad, self.lengths))

    @property
    def width(self) -> int:
        return max(self.ends, default=0)

    @property
    def aligned(self) -> bool:
        ends = self.ends  # (C-level tests: these run several times per decode step)
        return not any(self.left_pad) and (not ends or ends.count(ends[0]) == len(ends))

    @property
    def planes(self) -> tuple:
        """Every stored array, each ``[B, H, C, *]``; empty before the first append."""
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        planes = self.planes
        return planes[0].shape[2] if planes else 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)


@owns_arrays("keys", "values")
@attrs.frozen
class CacheState(_Rows):
    """Dense full-attention KV rows.

    Attributes:
        keys: ``[B, H, C, Dk]`` or ``None`` before the first append.
        values: ``[B, H, C, Dv]`` or ``None``.
        lengths: per row, the tokens it holds.
        left_pad: per row, the padding columns before its tokens.
        step: capacity grows in multiples of this.
    """

    keys: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    values: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)

    @property
    def planes(self) -> tuple:
        keys = self.keys  # (one read: each read of a field makes a new handle)
        return () if keys is None else (keys, self.values)


@owns_arrays("keys", "values")
@attrs.frozen
class QuantizedState(_Rows):
    """Affine-quantized KV rows, laid out exactly like ``CacheState``.

    ``keys`` and ``values`` are ``(packed, scales, biases)`` triples as
    ``mx.quantize`` returns them, each plane ``[B, H, C, *]``.

    Attributes:
        keys: ``(packed [B,H,C,Dk*bits/32] uint32, scales [B,H,C,Dk/group_size],
            biases [B,H,C,Dk/group_size])`` or ``None``.
        values: the same for values.
        group_size: elements sharing one scale and bias.
        bits: bits per element.
    """

    keys: Optional[tuple] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    values: Optional[tuple] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    group_size: int = attrs.field(default=64, kw_only=True)
    bits: int = attrs.field(default=8, kw_only=True)

    @property
    def planes(self) -> tuple:
        keys, values = self.keys, self.values
        return () if keys is None or values is None else (*keys, *values)


@attrs.frozen
class Checkpoint:
    """Row lengths at one moment; holds no arrays, so it pins no buffers.

    ``rollback`` accepts it only for a record holding the same rows, in the
    same order (``row_ids``): not after a merge, filter or reorder, and not
    for another record's rows (``kvstate.core.invariants``).

    Attributes:
        lengths: per row, the tokens held when the checkpoint was taken.
        left_pad: per row, the padding then.
        row_ids: the ids of the rows it was taken of (``kv.checkpoint`` fills
            them; a checkpoint made by hand without them is refused by
            ``rollback``).
    """

    lengths: tuple = attrs.field(converter=_tuple_of_ints)
    left_pad: tuple = attrs.field(converter=_tuple_of_ints)
    row_ids: Optional[tuple] = attrs.field(default=None, kw_only=True, converter=_row_ids)

    def __attrs_post_init__(self):
        validate(self)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)


@validate.register
def validate_checkpoint(cp: Checkpoint):
    B = len(cp.lengths)
    for name in ("left_pad", "row_ids"):
        values = getattr(cp, name)
        if values is not None and len(values) != B:
            raise bad(f"checkpoint.{name}", f"{B} values (one per row, as lengths)", len(values))
    for name in ("lengths", "left_pad"):
        for b, v in enumerate(getattr(cp, name)):
            check_int(v, f"checkpoint.{name}[{b}]")
    return cp


# --- sliding-window rings ------------------------------------------------------


class _Unpadded:
    """``batch_size`` and an all-zero ``left_pad`` for records whose rows never
    pad columns (rings, recurrent rows), so code generic over records reads them."""

    lengths: tuple  # declared by each attrs subclass

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def left_pad(self) -> tuple:
        return (0,) * len(self.lengths)


@owns_arrays("keys", "values")
@attrs.frozen
class RotatingState(_Unpadded):
    """Sliding-window KV rows: mlx-lm's ``RotatingKVCache(max_size, keep)``, batched.

    Each row is its own ring inside fixed storage ``[B, H, C, D]``. The first
    ``keep`` positions sit in columns ``[0, keep)`` and are never evicted;
    every later position ``p`` lives at a column fixed by ``p`` alone::

        col(p) = p                           if p < keep
               = keep + (p - keep) % L       otherwise,  L = C - keep

    One row, ``max_size = C = 8``, ``keep = 2``, after 16 tokens (one at a time)::

        column:     0   1 |  2   3   4   5   6   7
        position:   0   1 | 14  15  10  11  12  13        lengths = 16, held = 8
                    kept  |          ^ next write: col(16) = 4, over position 10

    A row holds its kept prefix ``[0, min(keep, lengths))`` and the newest
    positions ``[start, lengths)`` (``start = lengths - (held - min(keep,
    lengths))``); other columns are stale or unused and no mask exposes
    them. Before appending N tokens a row drops its oldest non-kept
    positions until it holds at most ``max_size - 1``, then holds all N (as
    mlx-lm: a multi-token append may hold up to ``max_size + N - 1``, so
    ``C`` may exceed ``max_size`` until the next single-token append shrinks
    it back). Rows never pad: each writes its own columns, so rows of
    different lengths sit side by side and behave exactly as when run alone.

    Attributes:
        lengths: per row, the tokens seen so far (mlx-lm's ``offset``; the
            RoPE position of the row's next token).
        held: per row, the tokens the ring holds now (``<= lengths``).
        max_size: the window the ring keeps (mlx-lm ``max_size``).
        keep: first positions never evicted (mlx-lm ``keep``), ``< max_size``.
        step: capacity grows in multiples of this until it reaches ``max_size``.
        keys: ``[B, H, C, Dk]`` in ring order, or ``None`` before the first append.
        values: ``[B, H, C, Dv]``, or ``None``.
    """

    lengths: tuple = attrs.field(converter=_tuple_of_ints)
    held: tuple = attrs.field(converter=_tuple_of_ints)
    max_size: int = attrs.field(kw_only=True)
    keep: int = attrs.field(default=0, kw_only=True)
    step: int = attrs.field(default=256, kw_only=True)
    keys: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    values: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    row_ids: Optional[tuple] = attrs.field(
        default=None, kw_only=True, eq=False, repr=False, converter=_row_ids
    )

    __attrs_post_init__ = _constructed

    @property
    def starts(self) -> tuple:
        """Per row, the oldest non-kept position held (``lengths`` when none)."""
        return tuple(n - (h - min(self.keep, n)) for n, h in zip(self.lengths, self.held))

    @property
    def width(self) -> int:
        """Columns ``fetch`` returns: the most tokens any row holds."""
        return max(self.held, default=0)

    @property
    def aligned(self) -> bool:
        """Every row has seen and holds the same tokens (one layout for all rows)."""
        return len(set(self.lengths)) <= 1 and len(set(self.held)) <= 1

    @property
    def planes(self) -> tuple:
        keys = self.keys  # (one read: each read of a field makes a new handle)
        return () if keys is None else (keys, self.values)

    @property
    def capacity(self) -> int:
        keys = self.keys
        return 0 if keys is None else keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)


# --- compressed rows (kvstate.kinds.compressed) ---------------------------------


def _marks(value) -> tuple:
    """``CompressedState.evictions``: per row a tuple of ``(length, count)`` int pairs
    (a file gives lists)."""
    try:
        return tuple(tuple((operator.index(t), operator.index(n)) for t, n in row) for row in value)
    except (TypeError, ValueError):
        raise bad(
            "evictions", "per row a sequence of (length, count) int pairs", repr(value)
        ) from None


@owns_arrays("keys", "values", "pos", "dropped", "score", "recent")
@attrs.frozen
class CompressedState(_Unpadded):
    """KV rows at a token budget: which columns stay is decided by a policy.

    Each row holds its columns in append order (positions increasing along
    the columns), each with its position (``pos``) and, once evicted, the
    row length at which it was (``dropped``; ``LIVE`` while kept). Eviction
    is lazy and reversible: before appending, a row marks its excess
    columns dropped (lowest score outside the ``sinks`` first positions
    and the ``window`` newest, oldest first on ties); marked columns stay
    in place for ``margin`` more tokens, so ``rollback`` unmarks them, and
    are compacted away later. A query at position ``p`` sees the columns
    with ``pos <= p < dropped``::

        one row, budget 4, sinks 1, policy "sinks", after 6 tokens then 1 more:
        column:     0   1   2   3   4   5   6
        pos:        0   1   2   3   4   5   6        lengths 7, held 7, kept 5
        dropped:    .   6   6   .   .   .   .        (. = LIVE)
        the query at 6 sees positions 0, 3, 4, 5, 6

    Attributes:
        lengths: per row, the tokens seen (the RoPE offset of the next token).
        held: per row, the columns in use (kept and marked), ``[0, held)``.
        kept: per row, the columns not marked dropped.
        floor: per row, the lowest length ``rollback``/``trim`` can return to.
        budget: per row, the columns kept after each eviction.
        evictions: per row, ``((t, n), ...)``: ``n`` columns marked at length
            ``t``, for the marked columns still held.
        policy: ``"sinks"``, ``"snapkv"`` or ``"h2o"``.
        sinks, window: the first positions and the newest positions never evicted.
        margin: tokens a rollback can give back (and scores kept per query).
        observe: ``snapkv``'s observation window (the last queries of a block scored).
        step: capacity grows in multiples of this.
        keys, values: ``[B, H, C, D]``, or ``None`` before the first append.
        pos, dropped: int32 ``[B, C]``; hidden columns hold ``LIVE`` in both.
        score: float32 ``[B, C]``, attention folded in (``None`` for ``sinks``).
        recent: float32 ``[B, margin, C]``, the last ``margin`` queries'
            attention, slot ``position % margin`` (``None`` for ``sinks``).
    """

    lengths: tuple = attrs.field(converter=_tuple_of_ints)
    held: tuple = attrs.field(converter=_tuple_of_ints)
    kept: tuple = attrs.field(converter=_tuple_of_ints)
    floor: tuple = attrs.field(converter=_tuple_of_ints)
    budget: tuple = attrs.field(converter=_tuple_of_ints)
    evictions: tuple = attrs.field(converter=_marks)
    policy: str = attrs.field(default="sinks", kw_only=True)
    sinks: int = attrs.field(default=4, kw_only=True)
    window: int = attrs.field(default=16, kw_only=True)
    margin: int = attrs.field(default=16, kw_only=True)
    observe: int = attrs.field(default=32, kw_only=True)
    step: int = attrs.field(default=256, kw_only=True)
    keys: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    values: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    pos: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    dropped: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    score: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    recent: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    row_ids: Optional[tuple] = attrs.field(
        default=None, kw_only=True, eq=False, repr=False, converter=_row_ids
    )

    def __attrs_post_init__(self):
        if self.row_ids is None:
            object.__setattr__(self, "row_ids", fresh_row_ids(len(self.lengths)))
        validate(self)

    @property
    def width(self) -> int:
        """Columns a read covers: the most any row holds."""
        return max(self.held, default=0)

    @property
    def aligned(self) -> bool:
        return len(set(self.lengths)) <= 1 and len(set(self.held)) <= 1

    @property
    def scored(self) -> bool:
        """Whether the policy reads attention scores (``snapkv``, ``h2o``)."""
        return self.policy != "sinks"

    @property
    def planes(self) -> tuple:
        keys = self.keys
        return () if keys is None else (keys, self.values)

    @property
    def capacity(self) -> int:
        keys = self.keys
        return 0 if keys is None else keys.shape[2]

    @property
    def nbytes(self) -> int:
        arrays = (self.keys, self.values, self.pos, self.dropped, self.score, self.recent)
        return sum(a.nbytes for a in arrays if a is not None)


# --- recurrent, composite and chunked layers (kvstate.kinds.recurrent, .composite, .chunked) ---


def _optional_ints(value):
    return None if value is None else _tuple_of_ints(value)


@owns_arrays("arrays")
@attrs.frozen
class RecurrentState(_Unpadded):
    """Fixed-size recurrent arrays per row: mlx-lm's ``ArraysCache``, batched.

    A recurrent layer (an SSM, a short convolution, linear attention) keeps a
    few arrays per row whose size does not grow with the tokens seen::

        slot 0 (conv):   [B, K-1, C]     row b: the last K-1 inputs it saw
        slot 1 (ssm):    [B, H, Dh, Ds]  row b: the state after its last token

    The model computes new slots from old ones; kvstate only holds them and
    counts tokens. The state cannot be un-applied, so ``trim`` is refused
    and a ``RecurrentCheckpoint`` holds the arrays (``notes/kinds.md``).

    Padding of the *coming* appends, as mlx-lm's ``ArraysCache`` has it (the
    model reads it through ``make_mask`` and ``lengths``): of the next
    tokens of row ``b``, positions ``p`` with ``left_padding[b] <= p`` (and
    ``p < until[b]`` when ``until`` is set) are real; the others leave the
    state unchanged. Both count down as tokens are appended (mlx-lm's
    ``advance``); ``kvstate.kinds.recurrent.finalize`` clears them.

    Attributes:
        lengths: per row, the real tokens seen so far.
        left_padding: per row, padding tokens still to come before real ones.
        until: per row, the position (from the next append's first token)
            where right padding starts, or ``None`` (no right padding).
        arrays: the slots, each ``[B, ...]`` or ``None`` before the model
            first writes it.
    """

    lengths: tuple = attrs.field(converter=_tuple_of_ints)
    left_padding: tuple = attrs.field(converter=_tuple_of_ints)
    until: Optional[tuple] = attrs.field(default=None, converter=_optional_ints)
    arrays: tuple = attrs.field(default=(), kw_only=True, converter=_tuple, repr=_array_repr)

    __attrs_post_init__ = _validated

    @property
    def aligned(self) -> bool:
        return len(set(self.lengths)) <= 1 and not any(self.left_padding) and self.until is None

    @property
    def capacity(self) -> int:
        """Always 0: recurrent rows have no columns (for code generic over records)."""
        return 0

    @property
    def planes(self) -> tuple:
        return tuple(a for a in self.arrays if a is not None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.planes)


@owns_arrays("keys", "values")
@attrs.frozen
class ChunkedState(_Rows):
    """Chunked local attention rows: mlx-lm's ``ChunkedKVCache(chunk_size)``, batched.

    The dense layout of the module picture, where the oldest tokens of a row
    are dropped from the front: row ``b`` holds positions ``[start[b],
    start[b] + lengths[b])`` at columns ``[left_pad[b], ends[b])``. Before a
    forward, a row holding more than ``chunk_size`` tokens drops the oldest
    (mlx-lm's ``maybe_trim_front``); a query at position ``p`` sees the
    positions ``j <= p`` of its own chunk (``j // chunk_size == p //
    chunk_size``).

    Attributes:
        start: per row, the position of the first held token.
        chunk_size: the attention chunk.
        keys: ``[B, H, C, Dk]`` or ``None`` before the first append.
        values: ``[B, H, C, Dv]`` or ``None``.
    """

    start: tuple = attrs.field(default=(), kw_only=True, converter=_tuple_of_ints)
    chunk_size: int = attrs.field(default=8192, kw_only=True)
    keys: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)
    values: Optional[mx.array] = attrs.field(default=None, kw_only=True, repr=_array_repr)

    @property
    def planes(self) -> tuple:
        keys = self.keys  # (one read: each read of a field makes a new handle)
        return () if keys is None else (keys, self.values)

    @property
    def offsets(self) -> tuple:
        """Per row, the tokens seen (mlx-lm's ``offset``: the next RoPE position)."""
        return tuple(map(operator.add, self.start, self.lengths))

    @property
    def aligned(self) -> bool:
        """Every row holds the same positions at the same columns."""
        return super().aligned and len(set(self.start)) <= 1


class _RowsOfFirst:
    """``batch_size`` and ``lengths`` of a value made of several records that
    share their rows (parts of a layer, layers of a model): the first's.
    ``_first`` names the field holding them."""

    _first: ClassVar[str]

    @property
    def batch_size(self) -> int:
        return getattr(self, self._first)[0].batch_size

    @property
    def lengths(self) -> tuple:
        return getattr(self, self._first)[0].lengths


class _OfParts(_RowsOfFirst):
    """Rows of a record made of parts: those of its first part (all parts share them)."""

    _first = "parts"


@attrs.frozen
class CompositeState(_OfParts):
    """Several records serving one layer: mlx-lm's ``CacheList``.

    ``parts[i]`` is what the model reads as ``cache[i]`` (falcon_h1: a
    ``RecurrentState`` for its mamba mixer and a ``CacheState`` for its
    attention). Every function applies to each part; all parts hold the same rows.

    Attributes:
        parts: the records, in the model's order.
    """

    parts: tuple = attrs.field(converter=_tuple)

    __attrs_post_init__ = _validated

    @property
    def left_pad(self) -> tuple:
        return (0,) * self.batch_size

    @property
    def planes(self) -> tuple:
        return tuple(p for part in self.parts for p in part.planes)

    @property
    def capacity(self) -> int:
        """The most columns a part holds (0 for parts without columns)."""
        return max((p.capacity for p in self.parts), default=0)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


@owns_arrays("arrays")
@attrs.frozen
class RecurrentCheckpoint:
    """A ``RecurrentState``'s rows at one moment, arrays included.

    Recurrent state cannot be un-applied, so this checkpoint keeps the slots
    (a few small arrays per row; no buffer is written in place, so holding
    them copies nothing). ``rollback`` returns a row to it or keeps the row;
    keeping part of an append needs the model (``kvstate.mlx_lm.rollback``).

    Attributes:
        lengths: per row, the tokens seen then.
        arrays: the slots then.
    """

    lengths: tuple = attrs.field(converter=_tuple_of_ints)
    arrays: tuple = attrs.field(default=(), converter=_tuple, repr=_array_repr)

    __attrs_post_init__ = _validated

    @property
    def batch_size(self) -> int:
        return len(self.lengths)


@attrs.frozen
class CompositeCheckpoint(_OfParts):
    """One checkpoint per part of a ``CompositeState``."""

    parts: tuple = attrs.field(converter=_tuple)

    __attrs_post_init__ = _validated


# --- row ids shared by one model's layers ---


def share_row_ids(states: list) -> list:
    """One model's layers hold the same rows: records with row ids of one
    batch size all take the first such record's ids (so one layer's
    ``kv.checkpoint`` fits every layer, and the compiled decoder's layers of
    one layout share one ``Spec``). Records without row ids are left as they
    are."""
    first: dict = {}
    out: list = []
    for s in states:
        ids = getattr(s, "row_ids", None)
        if type(ids) is not tuple:
            out.append(s)
            continue
        want = first.setdefault(len(ids), ids)
        out.append(s if ids is want or ids == want else with_row_ids(s, want))
    return out


@singledispatch
def with_row_ids(state: Any, ids: tuple) -> Any:
    """``state`` whose rows carry ``ids`` (one per row), not validated again:
    a record with a ``row_ids`` field; a kind whose ids are a part's
    registers (a ``SharedState``'s are its suffix's)."""
    return derived(state, row_ids=ids)
