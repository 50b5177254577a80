"""The cache shells an mlx-lm model reads: one family for eager and compiled runs.

An mlx-lm model reads its cache through a small protocol: ``offset`` (the
RoPE position of the next token), ``update_and_fetch(k, v)``, ``make_mask``
and, for quantized caches, ``bits``/``group_size``. A ``Shell`` answers it
for one layer from its *content*, through a *context* shared by every layer
of one model call:

    ==========================  =====================  ===========================
    context                     content                the kind's functions called
    ==========================  =====================  ===========================
    ``Eager`` (``forward``)     a record               ``ops.positions``,
                                                       ``ops.update_and_read``,
                                                       ``ops.next_mask``
    ``Tracing`` (compiled       ``compiled.Traced``    ``compiled.traced_offset``,
    decoder)                                           ``traced_update``, ``traced_mask``
    ==========================  =====================  ===========================

Both columns are generics registered beside each record kind, over the same
layout rules (column writes, eviction, quantizing new tokens, masks). The
shell swaps in the new content as the model writes and never mutates it.
This module and ``kvstate.mlx_lm`` are the bridge: core modules never
import them.
"""

from __future__ import annotations

from functools import singledispatch
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..compiled import boundary as compiled
from ..core import ops
from ..core.args import as_int
from ..core.masks import MaskMemo
from ..core.records import QuantizedState, RotatingState
from ..errors import bad
from ..kinds import rotating as _ring
from ..kinds.rows import Plans

# An mlx-lm model: an ``nn.Module`` called as ``model(tokens, cache=...)`` with
# ``layers`` (and optionally ``make_cache``), what ``mlx_lm.load`` returns.
Model = nn.Module


class Eager:
    """The context of one eager ``forward``: the memo and its leases, the
    offsets and the append plans (host work done once per layout)."""

    __slots__ = (
        "memo",
        "leases",
        "plans",
        "started",
        "route",
        "windowed",
        "positions",
        "_positions",
        "_last",
    )

    def __init__(self, memo: MaskMemo, start_early: bool = False):
        self.memo = memo
        self.route = None  # an attention router for this forward (kvstate.kinds.shared's cascade)
        self.leases: list = []
        self.plans = Plans()
        self.started = not start_early
        self.windowed = False  # a mask with a window was asked for (no routed dense read)
        self._positions: dict = {}
        # ``positions(record)``: its per-row positions as int32 ``[B]`` arrays,
        # once per layout per forward (every layer shares them)
        self.positions = compiled.Positions()
        self._last = None

    def start(self, keys, values):
        """Start computing the first layer's new keys and values on the device.

        They are the first thing a forward hands its caches, so they depend
        on the tokens and weights alone, never on a cache write: computing
        them now lets the device work while the host builds the rest of the
        graph (``notes/bridge.md``). Nothing later is started early: every
        later layer reads updated planes, and evaluating a write while the
        caller still holds the old record would copy the whole plane.
        """
        self.started = True
        if type(keys) is mx.array and type(values) is mx.array:
            try:
                mx.async_eval(keys, values)
            except ValueError:  # traced (mx.compile, vmap, grad): nothing to start
                pass

    def static(self, record):
        return record

    def offset(self, state):
        """An int when the rows are aligned, else the per-row int32 ``[B]`` array.

        Layers with one layout share one array (one per forward, not per
        layer); records holding the very same bookkeeping tuples (every
        layer after a shared append) are matched without hashing.
        """
        lengths, left_pad, kind = state.lengths, state.left_pad, type(state)
        last = self._last
        if last is not None and last[0] is lengths and last[1] is left_pad and last[2] is kind:
            return last[3]
        key = (kind, lengths, left_pad)
        off = self._positions.get(key)
        if off is None:
            pos = ops.positions(state)
            off = self._positions[key] = int(lengths[0]) if pos is None else pos
        self._last = (lengths, left_pad, kind, off)
        return off

    def update(self, record, keys, values):
        if not self.started:
            self.start(keys, values)
        return ops.update_and_read(record, keys, values, self.plans)

    def mask(self, record, N: int, window, return_array: bool):
        self.windowed |= window is not None
        # Models that ask return_array=True (gemma2, phi3small, ...) read the
        # mask's dtype: the same mask as an array, same builder and memo.
        mask, lease = ops.next_mask(record, N, memo=self.memo, window=window, array=return_array)
        if lease is not None:
            self.leases.append(lease)
        return mask

    def release(self):
        for lease in self.leases:
            if not lease.released:
                lease.release()
        self.leases.clear()


class Tracing(compiled.TraceContext):
    """The context of one traced compiled step (``kvstate.mlx_lm.Decoder``).

    Attributes:
        attention: ``"mask"`` or ``"kernel"`` (dense decode reads routed to
            ``kvstate.kernels.ragged_attention`` while tracing).
    """

    route = None  # (eager forwards route shared rows; a traced step routes in the decoder)

    def __init__(self, attention: str, same_end_slice: bool = False):
        super().__init__(same_end_slice)
        self.attention = attention
        self.windowed = False

    def static(self, view):
        return view.proto

    def positions(self, view) -> tuple:
        return view.positions

    def offset(self, view):
        return compiled.traced_offset(view.proto, view, self)

    def update(self, view, keys, values):
        return compiled.traced_update(view.proto, view, keys, values, self)

    def mask(self, view, N: int, window, return_array: bool):
        self.windowed |= window is not None
        return compiled.traced_mask(view.proto, view, N, window, self)


class Shell:
    """One layer's cache as an mlx-lm model sees it.

    ``content`` (a record, or a ``compiled.Traced`` view inside a compiled
    step) is replaced, never mutated, by each ``update_and_fetch`` and
    ``trim``; the offset of the current content is looked up once (the
    model reads it twice per layer) and forgotten when it is replaced.
    """

    __slots__ = ("content", "_ctx", "_offset")

    def __init__(self, content, ctx):
        self.content = content
        self._ctx = ctx
        self._offset = None

    @property
    def offset(self):
        off = self._offset
        if off is None:
            off = self._offset = self._ctx.offset(self.content)
        return off

    def update_and_fetch(self, keys, values):
        self.content, keys, values = self._ctx.update(self.content, keys, values)
        self._offset = None
        return keys, values

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        return self._ctx.mask(self.content, N, window_size, return_array)

    # --- for a routed attention read (kvstate.bridge.routing.routed_read) ---

    @property
    def proto(self):
        """The content's kind and static fields (eager: the record itself)."""
        return self._ctx.static(self.content)

    def positions(self) -> tuple:
        """The content's per-row positions after the last write, int32 ``[B]``
        arrays in ``compiled.host_positions``'s order."""
        return self._ctx.positions(self.content)

    @property
    def windowed(self) -> bool:
        """Whether this model call asked any layer for a windowed mask."""
        return self._ctx.windowed

    def keys_and_values(self):
        """The read the model attends over, without an update (eager runs only;
        shared-KV layers such as afm7's call it)."""
        return shell_read(self.record)

    @property
    def record(self):
        """The record this shell holds now (eager runs only)."""
        if isinstance(self.content, compiled.Traced):
            raise bad(
                "shell", "an eager shell (kvstate.mlx_lm.forward)", "a shell inside a compiled step"
            )
        return self.content

    @property
    def state(self):
        """The arrays the content holds (for ``mx.eval(c.state)``)."""
        return self.content.planes

    @property
    def keys(self):
        return self.record.keys

    @property
    def values(self):
        return self.record.values

    @property
    def nbytes(self) -> int:
        return self.record.nbytes

    def empty(self) -> bool:
        return self.record.keys is None

    def size(self) -> int:
        return shell_size(self.record)

    def is_trimmable(self) -> bool:
        return not isinstance(self.content, compiled.Traced) and shell_trimmable(self.record)

    def trim(self, n: int) -> int:
        """Drop up to ``n`` tokens from every row (as mlx-lm, clipped at what a row holds)."""
        n = as_int(n, "n")
        cut = tuple(min(n, m) for m in self.record.lengths)
        self.content, self._offset = ops.trim(self.record, cut), None
        return max(cut, default=0)


class QuantizedShell(Shell):
    """Has ``bits``/``group_size``: mlx-lm's attention then takes its quantized path."""

    __slots__ = ()

    @property
    def bits(self) -> int:
        return self._ctx.static(self.content).bits

    @property
    def group_size(self) -> int:
        return self._ctx.static(self.content).group_size


# --- per-kind shell behaviour (mlx-lm semantics; registered here, on the bridge side) ----


@singledispatch
def shell_class(record) -> type:
    """The shell class a record kind is read through (``Shell`` unless registered)."""
    return Shell


@shell_class.register
def shell_class_quantized(record: QuantizedState) -> type:
    return QuantizedShell


@singledispatch
def shell_read(record):
    """What ``update_and_read`` returns, without an update (default ``kv.fetch``)."""
    return ops.fetch(record)


@shell_read.register
def shell_read_ring(record: RotatingState):
    return _ring.read(record)  # ring order, the columns next_mask is laid out over


@singledispatch
def shell_size(record) -> int:
    """mlx-lm's ``size()``: the columns the cache returns."""
    return record.width


@singledispatch
def shell_trimmable(record) -> bool:
    """mlx-lm's ``is_trimmable()``."""
    return True


# size and is_trimmable answer as mlx-lm's RotatingKVCache does (per row, then
# over rows); kv.trim can give back more than mlx-lm allows.
@shell_size.register
def shell_size_ring(record: RotatingState) -> int:
    return max(min(n, record.max_size) for n in record.lengths)


@shell_trimmable.register
def shell_trimmable_ring(record: RotatingState) -> bool:
    return all(n < record.max_size for n in record.lengths)


def shell(content, ctx) -> Shell:
    """A shell over ``content`` (a record, or a ``compiled.Traced`` view)."""
    return shell_class(ctx.static(content))(content, ctx)


_UNREGISTERED = ops.update_and_read.dispatch(object)


def is_record(value) -> bool:
    """Whether ``value`` is a record of a kind the shells can read (one that
    registered ``ops.update_and_read``)."""
    return ops.update_and_read.dispatch(type(value)) is not _UNREGISTERED
