"""The bridge for hybrid and recurrent models: shells, model-level rollback, grouping.

mlx-lm models read three more caches, each through its own protocol; a
shell answers it from a record and swaps in the new record as the model
writes (the input records are never changed):

=====================  ==========================================  ===================
mlx-lm cache           what the model does with it                 record
=====================  ==========================================  ===================
``ArraysCache``        ``c[i]``, ``c[i] = x``, ``c.advance(N)``,   ``RecurrentState``
                       ``c.lengths``, ``make_mask(N)``
``ChunkedKVCache``     ``maybe_trim_front()``, ``start_position``, ``ChunkedState``
                       ``offset``, ``update_and_fetch``
``CacheList``          ``c[i]`` (a cache of either kind above)     ``CompositeState``
=====================  ==========================================  ===================

Two things need the model, so they live here rather than beside the records:

* ``rollback``: recurrent rows keep part of an appended block by replaying
  the accepted tokens from the checkpoint (``notes/kinds.md``).
* ``grouped``: llama4 builds its chunk mask from one layer's
  ``start_position`` and ``offset`` as Python ints, so one model call can
  only serve rows at one position. Ragged rows run as one call per position
  (each group laid out aligned), then merge back in order.
"""

from __future__ import annotations

from functools import singledispatch
from typing import Callable, Sequence

import attrs
import mlx.core as mx

from ..compiled import boundary as compiled
from ..compiled import buckets as _buckets
from ..core import ops
from ..core.args import per_row
from ..core.records import CacheState, ChunkedState, CompositeState, RecurrentState
from ..errors import bad, check
from ..kinds import chunked, composite, recurrent
from . import shells as _shells

__all__ = [
    "RecurrentShell",
    "ChunkedShell",
    "CompositeShell",
    "record_for",
    "rollback",
    "needs_groups",
    "grouped",
]


# --- shells ----------------------------------------------------------------------------------
#
# A shell's content is a record (``forward``) or a ``compiled.Traced`` view (the
# compiled decoder); what differs between the two is dispatched on the content.


@singledispatch
def _slots(content) -> tuple:
    """The recurrent slots the content holds."""
    return content.arrays


@singledispatch
def _with_slot(content, index: int, value):
    return recurrent.set_slot(content, index, value)


@singledispatch
def _advanced(content, n: int):
    return recurrent.advance(content, n)


@singledispatch
def _until(content):
    return recurrent.until_array(content)


@singledispatch
def _mask(content, n: int):
    return recurrent.mask(content, n)


@_slots.register(compiled.Traced)
def _slots_traced(view):
    return view.planes


@_with_slot.register(compiled.Traced)
def _with_slot_traced(view, index, value):
    return attrs.evolve(view, planes=view.planes[:index] + (value,) + view.planes[index + 1 :])


@_advanced.register(compiled.Traced)
def _advanced_traced(view, n):
    return view  # the host lengths advance after the step (compiled.advanced)


@_until.register(compiled.Traced)
def _until_traced(view):
    return None  # compiled.prepare refuses rows with padding pending


@_mask.register(compiled.Traced)
def _mask_traced(view, n):
    return None


class RecurrentShell:
    """A ``RecurrentState`` as mlx-lm's ``ArraysCache``: ``c[i]``, ``c[i] = x``,
    ``advance(N)``, ``lengths`` and ``make_mask(N)``."""

    __slots__ = ("content",)

    def __init__(self, content, ctx=None):
        self.content = content

    def __getitem__(self, index: int):
        return _slots(self.content)[index]

    def __setitem__(self, index: int, value) -> None:
        self.content = _with_slot(self.content, index, value)

    def advance(self, n: int) -> None:
        self.content = _advanced(self.content, n)

    @property
    def lengths(self):
        """Where right padding starts in the coming tokens (mlx-lm's ``lengths``), or None."""
        return _until(self.content)

    def make_mask(self, N: int, **kwargs):
        return _mask(self.content, N)

    @property
    def state(self):
        return self.content.planes

    def empty(self) -> bool:
        return _slots(self.content)[0] is None

    def size(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return False


class ChunkedShell(_shells.Shell):
    """A ``ChunkedState`` as mlx-lm's ``ChunkedKVCache``: rows at one position
    (llama4 reads ``start_position`` and ``offset`` as ints; ``grouped`` makes it so)."""

    __slots__ = ()

    @property
    def offset(self):
        pos = ops.positions(self.record)
        return self.record.offsets[0] if pos is None else pos

    @property
    def start_position(self) -> int:
        start = self.record.start
        check(len(set(start)) <= 1, "ChunkedState rows", "rows at one position (grouped)", start)
        return start[0] if start else 0

    def maybe_trim_front(self) -> None:
        self.content, self._offset = chunked.trim_front(self.record), None


@singledispatch
def _parts_of(content) -> tuple:
    """The parts' contents: records, or (compiled) the part views cut from one view."""
    return content.parts


@_parts_of.register(compiled.Traced)
def _parts_of_traced(view):
    parts, i, j = [], 0, 0
    for key, planes, positions in view.proto.parts:  # (CompositeSpec.static)
        flat = (view.planes[i : i + planes], view.positions[j : j + positions])
        parts.append(compiled.Traced.of(flat, key))
        i, j = i + planes, j + positions
    return tuple(parts)


@singledispatch
def _with_parts(content, parts: tuple):
    return composite.of_parts(parts)


@_with_parts.register(compiled.Traced)
def _with_parts_traced(view, parts):
    return attrs.evolve(view, planes=tuple(x for p in parts for x in p.planes))


class CompositeShell:
    """A ``CompositeState`` as mlx-lm's ``CacheList``: ``c[i]`` is part ``i``'s shell."""

    __slots__ = ("parts", "_content")

    def __init__(self, content, ctx):
        self._content = content
        self.parts = tuple(_shells.shell(p, ctx) for p in _parts_of(content))

    def __getitem__(self, index: int):
        return self.parts[index]

    @property
    def content(self):
        return _with_parts(self._content, tuple(p.content for p in self.parts))

    @property
    def state(self):
        return tuple(x for p in self.parts for x in p.state)

    def empty(self) -> bool:
        return self.parts[0].empty()

    def is_trimmable(self) -> bool:
        return all(p.is_trimmable() for p in self.parts)


@_shells.shell_class.register
def shell_class_recurrent(record: RecurrentState) -> type:
    return RecurrentShell


@_shells.shell_class.register
def shell_class_chunked(record: ChunkedState) -> type:
    return ChunkedShell


@_shells.shell_class.register
def shell_class_composite(record: CompositeState) -> type:
    return CompositeShell


# --- records for mlx-lm's caches --------------------------------------------------------------


def record_for(cache, batch_size: int, dense: Callable, arg: str):
    """The empty record for one of ``model.make_cache()``'s hybrid caches
    (``dense()`` makes the record of a ``KVCache``), else ``KVStateError``."""
    from mlx_lm.models import cache as lm_cache

    if isinstance(cache, lm_cache.ArraysCache):
        return recurrent.recurrent_state(batch_size, slots=len(cache.cache))
    if isinstance(cache, lm_cache.ChunkedKVCache):
        return chunked.chunked_state(batch_size, chunk_size=cache.chunk_size)
    if isinstance(cache, lm_cache.CacheList):
        parts = []
        for j, c in enumerate(cache.caches):
            if isinstance(c, lm_cache.KVCache):
                parts.append(dense())
            else:
                parts.append(record_for(c, batch_size, dense, f"{arg}.caches[{j}]"))
        return CompositeState(tuple(parts))
    raise bad(
        arg,
        "KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache, ChunkedKVCache or CacheList",
        type(cache).__name__,
    )


# --- model-level rollback ---------------------------------------------------------------------


@singledispatch
def _partial(state, checkpoint, keep: tuple) -> bool:
    """Whether a row of ``state`` keeps part of what it appended since
    ``checkpoint`` (then only a replay is exact)."""
    return False


@_partial.register(RecurrentState)
def _partial_recurrent(state, checkpoint, keep):
    appended = (n - c for n, c in zip(state.lengths, checkpoint.lengths))
    return any(0 < k < a for k, a in zip(keep, appended))


@_partial.register(CompositeState)
def _partial_composite(state, checkpoint, keep):
    return any(_partial(p, c, keep) for p, c in zip(state.parts, checkpoint.parts))


@singledispatch
def pad_right(state, lengths: tuple):
    """``state`` told that of the next block of tokens, row ``b``'s first
    ``lengths[b]`` are real, then padding (a dense row needs nothing:
    ``unpad`` trims). Given per block, never beyond it: mlx-lm's SSD scan
    (``ssm_attn``) reads a ``lengths`` longer than the block out of range.
    The batched prefill (``kvstate.mlx_lm.pad_right``) and the replay of
    ``rollback`` both pad through it."""
    return state


@pad_right.register(RecurrentState)
def _pad_right_recurrent(state, lengths):
    return recurrent.prepare(state, until=lengths)


@pad_right.register(CompositeState)
def _pad_right_composite(state, lengths):
    return composite.of_parts(pad_right(p, lengths) for p in state.parts)


@singledispatch
def _settle(state, checkpoint, keep):
    """After the replay: padding cleared, every row at ``checkpoint + keep``."""
    return ops.rollback(state, checkpoint, keep)


@_settle.register(RecurrentState)
def _settle_recurrent(state, checkpoint, keep):
    return recurrent.finalize(state)


@_settle.register(CompositeState)
def _settle_composite(state, checkpoint, keep):
    return composite.of_parts(_settle(p, c, keep) for p, c in zip(state.parts, checkpoint.parts))


def rollback(states: Sequence, checkpoint, keep, tokens, forward: Callable) -> list:
    """Every layer back at ``checkpoint`` plus ``keep`` accepted tokens, per row, exactly.

    ``tokens`` ``[B, N]`` are the tokens fed since ``checkpoint``;
    ``forward(tokens, states) -> (logits, states)`` runs the model. Records
    that can roll back alone do (``kv.rollback``). A recurrent row keeping
    part of its block (``0 < keep < N``) cannot: then every layer returns to
    the checkpoint and the accepted tokens are fed again in one forward
    (right-padded to ``max(keep)``; recurrent rows mask the padding as
    mlx-lm's ``ArraysCache.prepare(lengths=...)``, the other layers trim it).
    The result equals never having fed the rejected tokens.
    """
    layers = list(states)
    cps = getattr(checkpoint, "layers", checkpoint)
    if not isinstance(cps, (list, tuple)):
        raise bad(
            "checkpoint",
            "kv.checkpoint(states) of the states then (one per layer)",
            type(checkpoint).__name__,
        )
    check(len(cps) == len(layers), "checkpoint layers", len(layers), len(cps))
    if not isinstance(tokens, mx.array):
        tokens = mx.array(tokens)
    check(
        tokens.ndim == 2 and tokens.shape[0] == layers[0].batch_size,
        "tokens",
        f"[{layers[0].batch_size}, N] (the tokens fed since the checkpoint)",
        list(tokens.shape),
    )
    B = tokens.shape[0]
    keep = per_row(keep, B, "keep")
    seen = ops.checkpoint(layers[0]).lengths  # tokens seen now, per row (any kind)
    for b, (k, now, then) in enumerate(zip(keep, seen, cps[0].lengths)):
        fed = min(now - then, tokens.shape[1])
        check(k <= fed, f"keep[{b}]", f"<= {fed} (tokens fed since the checkpoint)", k)
    if not any(_partial(s, c, keep) for s, c in zip(layers, cps)):
        return [ops.rollback(s, c, keep) for s, c in zip(layers, cps)]
    back = [pad_right(ops.rollback(s, c, 0), keep) for s, c in zip(layers, cps)]
    _, replayed = forward(tokens[:, : max(keep)], back)
    return [_settle(s, c, keep) for s, c in zip(replayed, cps)]


# --- one model call per position, for models that read a layer's position as an int ------------


def _chunked_of(state):
    if isinstance(state, ChunkedState):
        return state
    if isinstance(state, CompositeState):
        return next((p for p in state.parts if isinstance(p, ChunkedState)), None)
    return None


@singledispatch
def _aligned(state) -> bool:
    return state.aligned


@_aligned.register(ChunkedState)
def _aligned_chunked(state):
    return chunked.trim_front(state).aligned


@_aligned.register(CompositeState)
def _aligned_composite(state):
    return all(map(_aligned, state.parts))


def needs_groups(states: Sequence) -> bool:
    """Whether a model with chunked layers gets rows it cannot read in one call:
    llama4 reads positions as ints, so every layer must hold its rows aligned."""
    if not any(_chunked_of(s) is not None for s in states):
        return False
    return not all(map(_aligned, states))


def grouped(forward: Callable, model, tokens, states: Sequence, **kwargs):
    """``forward`` once per group of rows at one position, each group laid out aligned.

    Returns what ``forward`` returns, rows in the input order. The chunked
    layers' ``trim_front`` runs first (the model would run it anyway), so
    rows at one position hold the same columns.
    """
    states = [chunked.trim_front(s) if isinstance(s, ChunkedState) else s for s in states]
    ref = next(c for c in map(_chunked_of, states) if c is not None)
    groups: dict = {}
    for b, key in enumerate(zip(ref.offsets, ref.start)):
        groups.setdefault(key, []).append(b)
    order, logits, parts = [], [], []
    for rows in groups.values():
        sub = [ops.merge_rows([ops.extract_row(s, b) for b in rows]) for s in states]
        out, new = forward(model, tokens[mx.array(rows)], sub, **kwargs)
        order += rows
        logits.append(out)
        parts.append(new)
    inverse = [0] * len(order)
    for i, b in enumerate(order):
        inverse[b] = i
    N = tokens.shape[1]
    merged = [
        _in_place_of(s, ops.filter_rows(ops.merge_rows([p[j] for p in parts]), inverse), N)
        for j, s in enumerate(states)
    ]
    return mx.concatenate(logits, axis=0)[mx.array(inverse)], merged


@singledispatch
def _in_place_of(before, after, n: int):
    """The result of a grouped call in the layout a single call would give.

    Grouping moves the rows of every layer (extracted, merged, put back in
    order), so a dense layer's padding would change under a checkpoint taken
    before the call; its ``n`` new tokens per row are appended to ``before``
    instead (the very keys and values the model computed), which writes them
    at each row's own end, as one call does. Other kinds keep ``after``
    (rings and chunked rows count positions, recurrent rows have no columns).
    """
    return after


@_in_place_of.register(CacheState)
def _in_place_of_dense(before, after, n):
    keys, values = ops.fetch(after)
    cols = mx.array([e - n + i for e in after.ends for i in range(n)], dtype=mx.int32)
    cols = cols.reshape(after.batch_size, 1, n, 1)
    take = [
        mx.take_along_axis(x, mx.broadcast_to(cols, (*x.shape[:2], n, x.shape[3])), axis=2)
        for x in (keys, values)
    ]
    return ops.append(before, *take)


# --- batched prefill: recurrent rows skip their right padding ------------------------------


def register_prefill(paddable, unpad) -> None:
    """Register the recurrent and composite kinds with ``kvstate.mlx_lm``'s
    batched prefill generics (called once by that module, which defines them)."""

    @paddable.register(RecurrentState)
    def _paddable_recurrent(state):
        return True

    @paddable.register(CompositeState)
    def _paddable_composite(state):
        return all(map(paddable, state.parts))

    @unpad.register(RecurrentState)
    def _unpad_recurrent(state, cut):
        return recurrent.finalize(state)  # the padding never reached the slots

    @unpad.register(CompositeState)
    def _unpad_composite(state, cut):
        return composite.of_parts(unpad(p, cut) for p in state.parts)


@_buckets.blank_rows.register(RecurrentState)
def _blank_recurrent(state, n: int):
    """``n`` rows of zero slots (a recurrent row's state before any token), so
    the compiled decoder can pad a batch of recurrent rows to its bucket."""
    return attrs.evolve(
        state,
        lengths=(0,) * n,
        left_padding=(0,) * n,
        until=None,
        arrays=tuple(
            None if a is None else mx.zeros((n, *a.shape[1:]), a.dtype) for a in state.arrays
        ),
    )
