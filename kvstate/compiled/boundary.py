"""The compile boundary: records into and out of an ``mx.compile``'d step.

``mx.compile`` takes trees of arrays, not ``attrs`` records, and anything
that is not an array (a Python int, a tuple of row lengths) is frozen into
the trace. So a record crosses the boundary in two parts, as a pytree does::

    record ──flatten──▶ Flat (arrays, traced)  +  Spec (everything else, hashable)
                              │
                 compiled step: positions are int32 arrays,
                 capacity C is fixed, writes are per-row scatters
                              │
    record ◀─unflatten── Spec (host fields advanced) + the step's planes

``Flat`` is ``(planes, positions)``: every stored array, each ``[B, H, C, *]``
(2 dense, 6 quantized, 2 ring), and int32 ``[B]`` arrays of the rows'
positions (``host_positions``: ``(ends, left_pad)`` for padded rows,
``(lengths, held)`` for rings). ``Spec`` is the record's kind and every
non-array field, derived from its ``attrs`` fields as ``kvstate.persist``
does; ``unflatten(spec, planes)`` rebuilds the record from those two alone.
``spec.key`` is the part a trace depends on (the kind and its scalar fields:
``step``, ``group_size``/``bits``, ``max_size``/``keep``), never the row
lengths: the capacity is in the arrays' shapes, so ``mx.compile`` traces once
per capacity *bucket* (a multiple of ``step``), never once per token. Growth
to the next bucket (``prepare``), and every check that a write stays inside
the bucket (MLX's dynamic scatter does not bounds-check), happen on the
host, outside the compiled function::

    state = prepare(state)                 # host: validate, move to the bucket
    flat, spec = flatten(state)            # arrays + static part
    planes = my_compiled_step(flat)        # traced: arrays only (one trace per spec.key)
    state = unflatten(spec.replace(**advanced(state)), planes)   # host-side lengths

Inside a compiled step a record is a ``Traced`` view (a row-less record of
its kind, ``proto``, plus the arrays), and mlx-lm's cache protocol over it is
four generics registered per kind beside the kind's layout rules:
``traced_offset``, ``traced_update``, ``traced_mask`` (and ``host_positions``,
``prepare``, ``with_capacity``, ``advanced`` on the host). The mlx-lm decoder
built on them is ``kvstate.mlx_lm.Decoder`` (the bridge). Decisions and
measurements: ``notes/compiled.md``.
"""

from __future__ import annotations

import functools
from functools import singledispatch
from typing import Any, NamedTuple

import attrs
import mlx.core as mx

from ..core.args import as_int
from ..core.invariants import validate
from ..core.records import built, maker
from ..errors import bad, check

# --- the boundary ---------------------------------------------------------------


def _is_arrays(value) -> bool:
    return (
        isinstance(value, tuple) and len(value) > 0 and all(isinstance(x, mx.array) for x in value)
    )


@attrs.frozen
class Spec:
    """The static half of a flattened record: its kind and every non-array field.

    Attributes:
        kind: the record class.
        host: ``((name, value), ...)``, every field that is not an array, in
            field order (per-row tuples and scalars).
        arrays: ``((name, count), ...)``, the array fields in plane order;
            ``count`` is ``0`` for one array, else the length of a tuple of
            arrays (a quantized triple).
        same_end: every row ends at one column (``host_positions[0]`` all
            equal): a compiled step may write with one ``slice_update``.
    """

    kind: type
    host: tuple
    arrays: tuple
    same_end: bool = False

    @property
    def static(self) -> tuple:
        """The scalar host fields (``step``, ``group_size``, ``max_size``, ...)."""
        return tuple((n, v) for n, v in self.host if not isinstance(v, tuple))

    @property
    def key(self) -> tuple:
        """What a trace depends on: the kind, its scalar fields, ``same_end``."""
        return (self.kind, self.static, self.same_end)

    def replace(self, **fields) -> "Spec":
        """This spec with host ``fields`` replaced (``advanced`` gives them)."""
        host = tuple((n, fields.pop(n, v)) for n, v in self.host)
        check(not fields, "fields", f"host fields of {self.kind.__name__}", sorted(fields))
        return attrs.evolve(self, host=host)

    def rebuild(self, planes: tuple, *, trusted: bool = False, like: Any = None):
        """The record this spec stands for, holding ``planes`` (``unflatten``
        has checked their count); checked by ``validated``, with the fields'
        converters run (per-row lists to tuples). ``trusted``: the decoder's
        own step (a spec taken from a valid record, host fields ``advanced``
        derived), built as it is (``kvstate.core.invariants``). ``like``: the
        record the spec was taken of, for kinds whose records hold host
        objects a spec leaves out (a ``SharedState``'s prefix records);
        unused here."""
        fields, i = dict(self.host), 0
        for name, count in self.arrays:
            fields[name] = planes[i] if count == 0 else tuple(planes[i : i + count])
            i += count or 1
        if trusted:
            return built(self.kind, fields)
        return validated(built(self.kind, fields, convert=True))

    def maker(self):
        """``make(planes)``: ``rebuild(planes, trusted=True)`` for the many
        layers of one layout (the field names looked up once, not per
        record; ``records.maker``). Only for kinds rebuilt from the spec
        alone (a ``Spec`` of its own class, not a subclass's ``rebuild``)."""
        check(type(self) is Spec, "spec", "a plain Spec", type(self).__name__)
        return maker(self.kind, dict(self.host), self.arrays)


class Flat(NamedTuple):
    """The array half of a flattened record: ``(planes, positions)``.

    ``planes``: every stored array, each ``[B, H, C, *]``. ``positions``:
    int32 ``[B]`` arrays (``host_positions``). A ``NamedTuple`` is a tuple to
    ``mx.compile``. (Arrays a step reads but never writes, ``held_planes``,
    travel beside it: ``Traced.of`` takes ``(planes, positions, read_only)``.)
    """

    planes: tuple
    positions: tuple


@singledispatch
def spec_of(state: Any) -> Spec:
    """The static half of ``state`` (derived from its ``attrs`` fields)."""
    if not attrs.has(type(state)):
        raise bad("state", "a kvstate record", type(state).__name__)
    host, arrays = [], []
    for f in attrs.fields(type(state)):
        v = getattr(state, f.name)
        if isinstance(v, mx.array):
            arrays.append((f.name, 0))
        elif _is_arrays(v):
            arrays.append((f.name, len(v)))
        elif v is not None or f.default is not None:
            host.append((f.name, v))
    check(arrays != [], "state", "a state holding keys (append first)", "an empty state")
    first = host_positions(state)[0]
    return Spec(
        type(state), tuple(host), tuple(arrays), same_end=first.count(first[0]) == len(first)
    )


def unflatten(spec: Spec, leaves: Flat | tuple, like: Any = None) -> Any:
    """The record ``spec`` and ``leaves`` stand for (``leaves``: a ``Flat``, or
    the planes alone, what a compiled step returns).

    The device position arrays are never read back: the host fields come
    from ``spec``. The rebuilt record is checked here, in one place
    (``validated``). A ``Spec`` holds no record: a kind whose records hold
    others (a ``SharedState``'s prefix records, read, never written) takes
    them from ``like``, the record the spec was taken of; every other kind
    is rebuilt from ``spec`` and ``leaves`` alone.
    """
    return _planes_of(spec, leaves, lambda planes: spec.rebuild(planes, like=like))


def rebuild(spec: Spec, leaves, like: Any = None):
    """``unflatten`` without the check, for a compiled step's own outputs: a
    spec taken from a valid record with host fields ``advanced`` derived
    (the decoder's every step; ``kvstate.core.invariants``); ``like``: the
    record the step read."""
    return _planes_of(spec, leaves, lambda planes: spec.rebuild(planes, trusted=True, like=like))


def _planes_of(spec, leaves, rebuild_):
    if not isinstance(spec, Spec):
        raise bad("spec", "a Spec (from flatten)", type(spec).__name__)
    planes = tuple(leaves.planes if isinstance(leaves, Flat) else leaves)
    want = sum(c or 1 for _, c in spec.arrays)
    check(len(planes) == want, "planes", f"{want} arrays", len(planes))
    return rebuild_(planes)


@singledispatch
def validated(state: Any) -> Any:
    """``state`` if it satisfies its kind's invariants (``invariants.validate``:
    numbers and planes agree), else ``KVStateError`` (every record
    ``unflatten`` rebuilds passes here). The planes are taken as they are,
    hidden columns included: a compiled step writes only at the rows' ends
    (``notes/core.md``)."""
    if validate.dispatch(type(state)) is validate.dispatch(object):  # a kind with no check
        C = state.capacity
        check(state.width <= C, "lengths", f"rows within the capacity {C}", state.width)
        return state
    return validate(state)


def flatten(
    state: Any, *, room: int = 1, positions: tuple | None = None, prepared: bool = False
) -> tuple[Flat, Spec]:
    """``(Flat, Spec)`` of ``state``, in a bucket with room for ``room`` more tokens per row.

    Host-side: validates the record, moves it to its bucket (``prepare``) and
    builds the position arrays; ``positions`` may pass arrays already built
    for an equal ``host_positions`` (the layers of one model share them);
    ``prepared``: ``state`` is what ``prepare(state, room)`` returned already.
    """
    if not prepared:
        state = prepare(state, room)
    if positions is None:
        positions = position_arrays(state)
    return Flat(state.planes, tuple(positions)), spec_of(state)


@singledispatch
def position_arrays(state: Any, host: tuple | None = None) -> tuple:
    """The int32 ``[B]`` arrays of ``host_positions(state)`` (``Flat.positions``;
    ``host``: those tuples, when the caller has them): new arrays, unless the
    kind registers arrays it keeps (a ``SharedState``'s row map, which decoding
    never changes, is built once per map)."""
    return _int32(host_positions(state) if host is None else host)


def _int32(host: tuple) -> tuple:
    return tuple(mx.array(p, dtype=mx.int32) for p in host)


class Positions:
    """``position_arrays`` once per layout: called with a record, the arrays of
    an earlier record of the same kind and ``host_positions``, else new ones.
    The layers of one forward or step share their rows' layout, so one of
    these per forward (``_shells.Eager``, ``shared.Layouts``) or per step
    (the compiled decoder) builds each layout's arrays once."""

    __slots__ = ("_got",)

    def __init__(self) -> None:
        self._got: dict = {}

    def __call__(self, state: Any) -> tuple:
        host = host_positions(state)
        key = (type(state), *host)
        got = self._got.get(key)
        if got is None:
            got = self._got[key] = position_arrays(state, host)
        return got


# --- host-side, per kind ------------------------------------------------------------


@singledispatch
def held_planes(state: Any) -> tuple:
    """The read-only planes: arrays a compiled step reads from ``state`` but
    never writes nor returns (the third item ``Traced.of`` takes): none, unless the kind registers
    them (a ``SharedState``'s prefix planes)."""
    return ()


@singledispatch
def host_positions(state: Any) -> tuple:
    """The per-row host tuples a compiled step gets as int32 arrays."""
    raise bad("state", "a kvstate record", type(state).__name__)


@singledispatch
def with_capacity(state: Any, capacity: int) -> Any:
    """``state`` with planes of exactly ``capacity`` columns (host side, never traced).

    Padded rows grow by zero columns (or drop spare columns past ``width``);
    ``capacity`` must be a multiple of ``step`` and hold ``width``. Rings are
    laid out again for the new capacity (``col(p)`` depends on it).
    """
    raise bad("state", "a kvstate record", type(state).__name__)


def check_capacity(state, capacity):
    capacity = as_int(capacity, "capacity")
    check(state.planes != (), "state", "a state holding keys (append first)", "an empty state")
    return capacity


@singledispatch
def prepare(state: Any, n: int = 1) -> Any:
    """``state`` laid out in the bucket a compiled step writing ``n`` tokens uses.

    Padded rows keep their capacity when every row has room for ``n`` more,
    else grow to the next multiple of ``step`` that does: a T-token loop
    visits at most ``ceil(T / step) + 1`` buckets. A ring takes the capacity
    its next append would give it (growing by ``step`` up to ``max_size``)
    and, when that changes, drops the entries that append would evict.
    Host-side only; after this no write of the compiled step is out of range.
    """
    raise bad("state", "a kvstate record", type(state).__name__)


def check_room(state, n):
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    check(state.planes != (), "state", "a state holding keys (prefill first)", "an empty state")
    return n


@singledispatch
def room(state: Any) -> int:
    """Columns every row of ``state`` can still take in its bucket: ``prepare(state,
    n)`` is ``state`` itself for every ``1 <= n <= room(state)``, and a step
    appending ``n`` leaves ``room(state) - n``. ``0`` (the default) where a
    kind does not say, or holds arrays beside its planes (``held_planes``):
    the decoder then prepares it every step (``kvstate.bridge.decoder``'s steady
    path is for kinds that register this)."""
    return 0


@singledispatch
def advanced(state: Any, n: int = 1) -> dict:
    """Host fields of ``state`` after a compiled step appended ``n`` tokens per row."""
    raise bad("state", "a kvstate record", type(state).__name__)


# --- inside the compiled region: a record as a traced view --------------------------


@functools.lru_cache(maxsize=256)
def proto_of(kind: type, static: tuple) -> Any:
    """A row-less record of ``kind`` with the scalar fields ``static``: what the
    kind's traced functions dispatch on and read static fields from (its row
    tuples are empty, so nothing per row can be frozen into a trace)."""
    fields = dict(static)
    for f in attrs.fields(kind):
        if f.name not in fields:
            fields[f.name] = () if f.default is attrs.NOTHING or f.name == "row_ids" else f.default
    # not validated: a proto holds no rows, and a composite's parts are the parts' keys
    return built(kind, fields, convert=True)


@attrs.frozen
class Traced:
    """One record inside a compiled step: ``proto`` (its kind and static
    fields), ``planes`` (``[B, H, C, *]``, traced) and ``positions`` (int32
    ``[B]`` arrays, traced, as ``host_positions`` orders them); ``same_end``
    from the spec; ``held``: the read-only planes (``held_planes``: read,
    never written). ``written``: after a dense write of the last ``N`` columns,
    ``(planes before the write, the written tokens)``, so that a read may do
    the write itself (``kernels.write_and_read``); ``()`` otherwise."""

    proto: object
    planes: tuple
    positions: tuple
    same_end: bool = False
    held: tuple = ()
    written: tuple = ()

    @classmethod
    def of(cls, flat, key: tuple) -> "Traced":
        """The view of ``flat`` (``(planes, positions)``, or ``(planes, positions,
        read_only)``) for a record whose ``Spec.key`` is ``key``."""
        kind, static, same_end = key
        read_only = tuple(flat[2]) if len(flat) > 2 else ()
        return cls(proto_of(kind, static), tuple(flat[0]), tuple(flat[1]), same_end, read_only)

    @property
    def capacity(self) -> int:
        return self.planes[0].shape[2]


class TraceContext:
    """What the records of one traced step share: anything derived from the
    same position arrays (offsets, write indices, masks) is built once per
    step, not once per layer (fewer kernels in the compiled graph).

    Attributes:
        same_end_slice: write rows that share one end with a dynamic-start
            ``slice_update`` instead of a scatter.
    """

    def __init__(self, same_end_slice: bool = False) -> None:
        self.same_end_slice = same_end_slice
        self._memo: dict = {}

    def shared(self, key, arrays, build):
        """``build()``, once per ``key`` and identity of ``arrays``."""
        key = key + tuple(id(a) for a in arrays)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = (build(), arrays)  # hold the arrays: their ids stay unique
        return hit[0]


@singledispatch
def traced_offset(proto: Any, view: Traced, ctx: TraceContext) -> mx.array:
    """Per-row RoPE offsets of the next token, int32 ``[B]`` (mlx-lm's ``offset``)."""
    raise bad("state", "a kvstate record kind", type(proto).__name__)


@singledispatch
def traced_update(
    proto: Any, view: Traced, k: mx.array, v: mx.array, ctx: TraceContext
) -> tuple[Traced, mx.array, mx.array]:
    """Write ``k``, ``v`` ``[B, H, N, D]``: ``(new_view, keys, values)``, where
    ``keys, values`` is what mlx-lm's ``update_and_fetch`` returns (every
    column of the fixed capacity; ``traced_mask`` hides the rest)."""
    raise bad("state", "a kvstate record kind", type(proto).__name__)


@singledispatch
def traced_mask(
    proto: Any, view: Traced, n: int, window: int | None, ctx: TraceContext
) -> mx.array:
    """The bool mask ``[B, 1, n, C]`` for ``n`` tokens about to be written."""
    raise bad("state", "a kvstate record kind", type(proto).__name__)


@singledispatch
def traced_read(
    proto: Any, view: Traced, q: mx.array, scale: float, ctx: TraceContext
) -> tuple[mx.array, Traced] | None:
    """The attention read of ``q`` ``[B, Hq, N, D]`` over ``view`` after its
    write, for kinds that read themselves (a ``SharedState``'s cascade):
    the compiled decoder routes the model's attention call here. Returns
    ``(out, view)``: the layer's view after the read (a read that did the
    write itself, ``kernels.write_and_read``, hands back its planes). ``None``
    (the default): the model's own read of the columns ``traced_update``
    returned."""
    return None


def reads_itself(kind: type) -> bool:
    """Whether ``kind`` registers ``traced_read`` (its layers must be routed)."""
    return traced_read.dispatch(kind) is not traced_read.dispatch(object)


__all__ = [
    "Spec",
    "Flat",
    "Traced",
    "TraceContext",
    "spec_of",
    "flatten",
    "unflatten",
    "validated",
    "prepare",
    "advanced",
    "room",
    "with_capacity",
    "host_positions",
    "position_arrays",
    "proto_of",
    "traced_offset",
    "traced_update",
    "traced_mask",
    "traced_read",
    "reads_itself",
    "held_planes",
]
