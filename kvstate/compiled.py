"""The compile boundary: records into and out of an ``mx.compile``'d step.

``mx.compile`` takes trees of arrays, not ``attrs`` records, and anything
that is not an array (a Python int, a tuple of row lengths) is frozen into
the trace. So a record crosses the boundary in two parts::

    record ──flatten──▶ Flat (arrays, traced)  +  Spec (static, hashable)
                              │
                 compiled step: positions are int32 arrays,
                 capacity C is fixed, writes are per-row scatters
                              │
    record ◀─unflatten── Flat' (arrays)  +  Spec  +  host lengths

``Flat`` is a tuple ``(planes, positions)``:

    planes     every stored array, each ``[B, H, C, *]`` (2 dense, 6 quantized)
    positions  int32 ``[B]`` arrays: ``(ends, left_pad)`` for dense and
               quantized rows (``ends``: the column the next token goes to),
               ``(lengths, held)`` for rings

``Spec`` is what changes the traced Python: the record kind, ``step``,
``group_size``/``bits``, ``max_size``/``keep``. The capacity is in the
arrays' shapes, so ``mx.compile`` traces once per capacity *bucket* (a
multiple of ``step``), never once per token. Growth to the next bucket
(``prepare``), and every check that a write stays inside the bucket (MLX's
dynamic scatter does not bounds-check), happen on the host, outside the
compiled function::

    state = prepare(state)                 # host: validate, move to the bucket
    flat, spec = flatten(state)            # arrays + static key
    planes = my_compiled_step(flat)        # traced: arrays only (one per Spec)
    state = unflatten(planes, state, **advanced(state))   # host-side lengths

A decode step for mlx-lm models built on this boundary::

    decode = compiled_decoder(model)
    logits, states = decode(tokens, states)    # tokens [B], logits [B, V]

``decode`` flattens the records, runs the whole model forward and every
state update in one compiled function (one per static key), and unflattens
the results with host-side lengths advanced by one; records in, records out,
the input records unchanged. ``decode.traces`` counts Python executions of
the traced function. Decisions and measurements are in ``notes/compile.md``.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import NamedTuple, Optional

import attrs
import mlx.core as mx

from . import dense
from .errors import as_int, bad, check
from .kernels import kernel_available, ragged_attention, splits_for
from .masks import rows_mask
from .records import CacheState, QuantizedState, RotatingState, _Rows


def _ring():
    """``kvstate.rotating`` (the module; the package's ``rotating`` is the constructor).

    Looked up when a ring is used, so its layout math has one source and a
    change there cannot break importing this module.
    """
    return importlib.import_module(".rotating", __package__)


def ring_plan(state, n):
    return _ring()._plan(state, n)


def ring_relayout(*args):
    return _ring()._relayout(*args)


def column_of(p, keep, capacity):
    return _ring().column_of(p, keep, capacity)


def ring_mask(*args, **kwargs):
    return _ring().ring_mask(*args, **kwargs)


# --- the boundary ---------------------------------------------------------------


@attrs.frozen
class Spec:
    """The static half of a flattened record (hashable; part of the compile key).

    Attributes:
        kind: ``"dense"``, ``"quantized"`` or ``"rotating"``.
        step: capacity buckets are multiples of this.
        group_size: quantization group (0 unless quantized).
        bits: quantization bits (0 unless quantized).
        max_size: ring window (0 unless rotating).
        keep: ring positions never evicted (0 unless rotating).
        same_end: every row ends at one column (aligned rows, or rows
            right-aligned by padding as mlx-lm's ``BatchKVCache`` holds them):
            writes are one dynamic-start ``slice_update`` instead of a scatter.
    """

    kind: str
    step: int
    group_size: int = 0
    bits: int = 0
    max_size: int = 0
    keep: int = 0
    same_end: bool = False


class Flat(NamedTuple):
    """The array half of a flattened record: ``(planes, positions)``.

    ``planes``: every stored array, each ``[B, H, C, *]``. ``positions``:
    int32 ``[B]`` arrays, ``(ends, left_pad)`` for dense and quantized rows,
    ``(lengths, held)`` for rings. A ``NamedTuple`` is a tuple to
    ``mx.compile``.
    """

    planes: tuple
    positions: tuple


def spec_of(state) -> Spec:
    """The static key of ``state``."""
    same = len(set(state.ends)) <= 1 if isinstance(state, _Rows) else False
    if isinstance(state, QuantizedState):
        return Spec("quantized", state.step, state.group_size, state.bits, same_end=same)
    if isinstance(state, CacheState):
        return Spec("dense", state.step, same_end=same)
    if isinstance(state, RotatingState):
        return Spec("rotating", state.step, max_size=state.max_size, keep=state.keep)
    raise bad("state", "a CacheState, QuantizedState or RotatingState", type(state).__name__)


def with_capacity(state, capacity: int):
    """``state`` with planes of exactly ``capacity`` columns (host side, never traced).

    Dense rows grow by appending zero columns (or drop spare columns past
    ``width``); ``capacity`` must be a multiple of ``step`` and hold ``width``.
    Rings are laid out again for the new capacity (``col(p)`` depends on it).
    """
    capacity = as_int(capacity, "capacity")
    check(state.planes != (), "state", "a state holding keys (append first)", "an empty state")
    C = state.capacity
    if C == capacity:
        return state
    if isinstance(state, RotatingState):
        check(capacity >= state.width, "capacity", f">= {state.width} (entries a row holds)",
              capacity)
        planes = ring_relayout(state.planes, state.lengths, state.held, state.keep, C,
                                    capacity)
        return attrs.evolve(state, keys=planes[0], values=planes[1])
    check(capacity % state.step == 0, "capacity", f"a multiple of step={state.step}", capacity)
    check(capacity >= state.width, "capacity", f">= {state.width} (the stored width)", capacity)
    B = state.batch_size
    if C < capacity:
        planes = tuple(
            mx.concatenate([p, mx.zeros((B, p.shape[1], capacity - C, p.shape[3]), p.dtype)],
                           axis=2)
            for p in state.planes)
    else:
        planes = tuple(mx.contiguous(p[:, :, :capacity, :]) for p in state.planes)
    return dense.with_planes(state, planes)


def prepare(state, n: int = 1):
    """``state`` laid out in the bucket a compiled step writing ``n`` tokens uses.

    Dense rows keep their capacity when every row has room for ``n`` more,
    else grow to the next multiple of ``step`` that does: a T-token loop
    visits at most ``ceil(T / step) + 1`` buckets. A ring takes the capacity
    its next append would give it (growing by ``step`` up to ``max_size``)
    and, when that changes, drops the entries that append would evict.
    Host-side only; after this no write of the compiled step is out of range.
    """
    n = as_int(n, "n")
    check(n >= 1, "n", ">= 1", n)
    check(state.planes != (), "state", "a state holding keys (prefill first)", "an empty state")
    if isinstance(state, RotatingState):
        check(n == 1, "tokens per row", "1 for a RotatingState in a compiled step "
              "(prefill blocks with kvstate.mlx_lm.forward)", n)
        _, _, kept, C = ring_plan(state, n)
        if C == state.capacity:
            return state
        planes = ring_relayout(state.planes, state.lengths, kept, state.keep,
                                    state.capacity, C)
        return attrs.evolve(state, held=kept, keys=planes[0], values=planes[1])
    need = state.width + n
    C = state.capacity
    if C >= need and C % state.step == 0:
        return state
    return with_capacity(state, dense.round_up(need, state.step))


def position_arrays(state) -> tuple:
    """The int32 ``[B]`` position arrays of ``state`` (``Flat.positions``)."""
    if isinstance(state, RotatingState):
        return (mx.array(state.lengths, dtype=mx.int32), mx.array(state.held, dtype=mx.int32))
    return (mx.array(state.ends, dtype=mx.int32), mx.array(state.left_pad, dtype=mx.int32))


def layout_key(state) -> tuple:
    """Host values that ``position_arrays`` depends on (records sharing one share arrays)."""
    if isinstance(state, RotatingState):
        return ("ring", state.lengths, state.held)
    return ("rows", state.ends, state.left_pad)


def flatten(state, *, room: int = 1, positions=None) -> tuple:
    """``(Flat, Spec)`` of ``state``, in a bucket with room for ``room`` more tokens per row.

    Host-side: validates the record, moves it to its bucket (``prepare``) and
    builds the position arrays; ``positions`` may pass arrays already built
    for an equal ``layout_key`` (the layers of one model share them).
    """
    spec = spec_of(state)
    state = prepare(state, room)
    if positions is None:
        positions = position_arrays(state)
    return Flat(state.planes, tuple(positions)), spec


def advanced(state, n: int = 1) -> dict:
    """Host fields of ``state`` after a compiled step appended ``n`` tokens per row."""
    if isinstance(state, RotatingState):
        lengths, held, _, _ = ring_plan(state, n)
        return {"lengths": lengths, "held": held}
    return {"lengths": tuple(m + n for m in state.lengths)}


def unflatten(flat, template, **fields):
    """The record ``flat`` holds, shaped like ``template`` (the prepared record
    that was flattened) with host ``fields`` replaced (``advanced`` gives them).

    ``flat`` is a ``Flat`` or just its planes (what a compiled step returns).
    The device position arrays are never read back.
    """
    planes = tuple(flat.planes if isinstance(flat, Flat) else flat)
    check(len(planes) == len(template.planes), "planes", f"{len(template.planes)} arrays",
          len(planes))
    if isinstance(template, RotatingState):
        return attrs.evolve(template, keys=planes[0], values=planes[1], **fields)
    out = dense.with_planes(template, planes, **fields)
    C = planes[0].shape[2]
    check(out.width <= C, "lengths", f"rows ending at most at the capacity {C}", out.ends)
    return out


# --- inside the compiled region: the mlx-lm cache protocol over a Flat -------------


def write_index(cols, N: int):
    """The scatter index ``[B, 1, N, 1]`` of columns ``cols + i`` (``cols``: int32 ``[B]``)."""
    return cols[:, None, None, None] + mx.arange(N, dtype=mx.int32)[None, None, :, None]


def write(plane, new, cols, index=None):
    """Write ``new`` ``[B, H, N, *]`` into ``plane`` at columns ``cols + i`` per row.

    ``cols``: int32 ``[B]``; ``index``: ``write_index(cols, N)`` when already
    built, or ``"same"`` when every row ends at ``cols[0]`` (one dynamic-start
    ``slice_update``). Traceable, and in place when nothing else holds
    ``plane``. MLX does not bounds-check either: the host guarantees
    ``cols + N <= C`` (``prepare``).
    """
    if isinstance(index, str):
        return mx.slice_update(plane, new, cols[:1], (2,))
    if index is None:
        index = write_index(cols, new.shape[2])
    return mx.put_along_axis(plane, mx.broadcast_to(index, new.shape), new, axis=2)


class _Step:
    """What the shells of one traced step share: masks, offsets, write indices.

    Layers of one model hold the same position arrays, so anything derived
    from them is built once per step instead of once per layer (fewer
    kernels in the compiled graph).
    """

    def __init__(self, attention: str, write: str = "scatter"):
        self.attention = attention
        self.write = write
        self.memo = {}

    def shared(self, key, arrays, build):
        key = key + tuple(id(a) for a in arrays)
        if key not in self.memo:
            self.memo[key] = (build(), arrays)  # hold the arrays: their ids stay unique
        return self.memo[key][0]

    mask = shared


class Shell:
    """One layer's dense rows as an mlx-lm model sees them inside a compiled step.

    ``offset`` is the per-row RoPE position (int32 ``[B]``), ``update_and_fetch``
    scatters the new tokens at the rows' ends and returns the whole
    fixed-capacity planes, and ``make_mask`` builds the per-row mask over
    those ``C`` columns from the position arrays. ``flat`` holds the updated
    arrays once the model has run.
    """

    def __init__(self, flat, spec: Spec, ctx: _Step):
        self.flat = Flat(tuple(flat[0]), tuple(flat[1]))
        self.spec = spec
        self._ctx = ctx

    @property
    def capacity(self) -> int:
        return self.flat.planes[0].shape[2]

    @property
    def offset(self):
        ends, lp = self.flat.positions
        return self._ctx.shared(("offset",), (ends, lp), lambda: ends - lp)

    def _new_planes(self, keys, values):
        return (keys, values)

    def update_and_fetch(self, keys, values):
        ends, lp = self.flat.positions
        N = keys.shape[2]
        new = self._new_planes(keys, values)
        if self.spec.same_end and self._ctx.write == "slice":
            index = "same"
        else:
            index = self._ctx.shared(("index", N), (ends,), lambda: write_index(ends, N))
        planes = tuple(write(p, x, ends, index) for p, x in zip(self.flat.planes, new))
        after = self._ctx.shared(("after", N), (ends,), lambda: ends + N)
        self.flat = Flat(planes, (after, lp))
        return self._fetch()

    def _fetch(self):
        return self.flat.planes

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        ends, lp = self.flat.positions
        C = self.capacity
        return self._ctx.mask(("rows", N, window_size, C), (ends, lp),
                              lambda: rows_mask(N, lp, ends + N, C, window_size))

    @property
    def state(self):
        return self.flat.planes

    def is_trimmable(self) -> bool:
        return False


class QuantizedShell(Shell):
    """Quantized rows: ``bits``/``group_size`` send mlx-lm to its quantized SDPA."""

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def group_size(self) -> int:
        return self.spec.group_size

    def _new_planes(self, keys, values):
        qk = mx.quantize(keys, group_size=self.spec.group_size, bits=self.spec.bits)
        qv = mx.quantize(values, group_size=self.spec.group_size, bits=self.spec.bits)
        return (*qk, *qv)

    def _fetch(self):
        p = self.flat.planes
        return tuple(p[:3]), tuple(p[3:])


class RingShell(Shell):
    """A ``RotatingState`` layer: one token per row lands at ``col(lengths)``.

    Eviction and the write column are array arithmetic on ``(lengths,
    held)`` (``kvstate.rotating``'s layout math), and the mask is
    ``rotating.ring_mask`` over all ``C`` ring columns.
    """

    @property
    def offset(self):
        return self.flat.positions[0]

    def _after(self, N):
        lengths, held = self.flat.positions
        keep, ms = self.spec.keep, self.spec.max_size

        def build():
            nk = mx.minimum(lengths, keep)
            kept = nk + mx.minimum(held - nk, mx.maximum(ms - 1 - nk, 0))
            return lengths + N, kept + N

        return self._ctx.shared(("ring-after", N, keep, ms), (lengths, held), build)

    def update_and_fetch(self, keys, values):
        if keys.shape[2] != 1:
            raise bad("tokens per row", "1 for a ring in a compiled step", keys.shape[2])
        lengths, _ = self.flat.positions
        keep, C = self.spec.keep, self.capacity

        def build():
            return write_index(column_of(lengths, keep, C).astype(mx.int32), 1)

        index = self._ctx.shared(("ring-index", keep, C), (lengths,), build)
        planes = tuple(write(p, x, None, index) for p, x in zip(self.flat.planes, (keys, values)))
        self.flat = Flat(planes, self._after(1))
        return planes

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        lengths, held = self.flat.positions
        C, spec = self.capacity, self.spec
        w = window_size or spec.max_size

        def build():
            ln, hd = self._after(N)
            return ring_mask(N, ln, hd, keep=spec.keep, capacity=C, width=C, window=w)

        return self._ctx.mask(("ring", N, w, C, spec.keep), (lengths, held), build)


def _shell(flat, spec, ctx):
    cls = {"dense": Shell, "quantized": QuantizedShell, "rotating": RingShell}[spec.kind]
    return cls(flat, spec, ctx)


# --- attention without a mask array (routing to kvstate.kernels) --------------------------------

_patch_lock = threading.Lock()


def _attention_modules(model):
    """The modules whose ``scaled_dot_product_attention`` global the model calls."""
    from mlx_lm.models import base

    mods = set()
    for _, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and getattr(mod, "scaled_dot_product_attention", None) is \
                base.scaled_dot_product_attention:
            mods.add(mod)
    return mods


class _routed:
    """While tracing, route attention reads of dense shells to ``ragged_attention``.

    mlx-lm's attention calls ``scaled_dot_product_attention(q, k, v, cache=...,
    scale=..., mask=...)``, a global of the model's module. For the duration
    of one trace only (compiled replays run no Python), that global becomes a
    dispatcher that sends a ``Shell`` of dense rows to the mask-free kernel
    and every other call, unchanged, to mlx-lm's function.
    """

    def __init__(self, mods):
        self.mods = mods

    def __enter__(self):
        from mlx_lm.models import base

        original = base.scaled_dot_product_attention

        def dispatch(queries, keys, values, cache, scale, mask, sinks=None):
            if (type(cache) is Shell and sinks is None and queries.shape[2] == 1
                    and cache._ctx.attention == "kernel"):
                ends, left_pad = cache.flat.positions  # after the write
                return ragged_attention(queries, keys, values, left_pad, ends, scale=scale)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                            sinks=sinks)

        _patch_lock.acquire()
        for mod in self.mods:
            mod.scaled_dot_product_attention = dispatch
        self.original = original
        return self

    def __exit__(self, *exc):
        try:
            for mod in self.mods:
                mod.scaled_dot_product_attention = self.original
        finally:
            _patch_lock.release()
        return False


# --- the compiled decode step -----------------------------------------------------------

ATTENTION = ("mask", "kernel", "auto")


class Decoder:
    """A compiled decode step for an mlx-lm model over kvstate records.

    ``decoder(tokens, states) -> (logits, states)``: ``tokens`` ``[B]`` (one
    per row) or ``[B, N]``; ``logits`` ``[B, V]`` for one token per row, else
    ``[B, N, V]``. The whole forward and every state update run in one
    compiled function per static key (the layers' ``Spec``s, ``N`` and the
    attention mode); capacity buckets are shapes, so at most one trace per
    bucket. Input records are unchanged; drop them before evaluating the
    result so the writes happen in place.

    Args:
        model: an mlx-lm model whose layers read their caches through the
            protocol (llama, qwen3, gemma3's full layers, ...).
        attention: ``"mask"``: the model's own SDPA with a per-row bool mask
            over the fixed capacity (any backend, any model). ``"kernel"``:
            dense full-attention decode reads go to ``ragged_attention`` (a
            mask-free split-K CUDA kernel; the masked SDPA elsewhere).
            ``"auto"``: ``"kernel"`` on MLX's CUDA backend, else ``"mask"``.
        write: how dense rows take their new tokens: ``"scatter"`` (one
            ``put_along_axis`` per plane, per-row ends) or ``"slice"`` (a
            dynamic-start ``slice_update`` when every row ends at one column).
            Both write in place when the old buffer is free; which is faster
            depends on the backend (``notes/compile.md``).
        wait: before dispatching a step, wait until the previous step has
            finished. A buffer that an in-flight read still holds cannot be
            written in place, so without the wait a pipelined loop may copy
            every plane each step on a GPU (``notes/compile.md``).
    """

    def __init__(self, model, *, attention: str = "auto", write: str = "scatter",
                 wait: bool = False):
        if attention not in ATTENTION:
            raise bad("attention", f"one of {ATTENTION}", repr(attention))
        if write not in ("scatter", "slice"):
            raise bad("write", "'scatter' or 'slice'", repr(write))
        self.write = write
        if attention == "auto":
            attention = "kernel" if kernel_available() else "mask"
        self.model = model
        self.attention = attention
        self.wait = bool(wait)
        self.traces = 0
        self._fns = {}
        self._mods = None
        self._pending = None
        self._layers = None

    def _compiled(self, key):
        fn = self._fns.get(key)
        if fn is None:
            specs, squeeze, _ = key

            def step(tokens, flats):
                self.traces += 1  # Python runs only while tracing
                ctx = _Step(self.attention, self.write)
                shells = [_shell(f, s, ctx) for f, s in zip(flats, specs)]
                logits = self.model(tokens, cache=shells)
                if squeeze:
                    logits = logits[:, -1, :]
                return logits, [sh.flat.planes for sh in shells]

            fn = self._fns[key] = mx.compile(step)
        return fn

    def __call__(self, tokens, states):
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens)
        squeeze = tokens.ndim == 1
        if squeeze:
            tokens = tokens[:, None]
        check(tokens.ndim == 2, "tokens rank", "1 ([B]) or 2 ([B, N])", tokens.ndim)
        N = tokens.shape[1]
        check(N >= 1, "tokens length", ">= 1", N)
        states = list(states)
        if self._layers is None:
            from .mlx_lm import layer_count  # (kvstate itself does not need mlx-lm)

            self._layers = layer_count(self.model)
        if len(states) != self._layers:
            raise bad("states", f"{self._layers} records (one per layer of the model)",
                      len(states))
        B = tokens.shape[0]
        flats, specs, prepared, layouts = [], [], [], {}
        for i, s in enumerate(states):
            if not isinstance(s, (_Rows, RotatingState)):
                raise bad(f"states[{i}]", "a CacheState, QuantizedState or RotatingState",
                          type(s).__name__)
            check(s.batch_size == B, f"states[{i}] batch size", f"{B} (tokens rows)",
                  s.batch_size)
            s = prepare(s, N)
            lay = layout_key(s)
            if lay not in layouts:
                layouts[lay] = position_arrays(s)
            flat, spec = flatten(s, room=N, positions=layouts[lay])
            flats.append(flat)
            specs.append(spec)
            prepared.append(s)
        fn = self._compiled((tuple(specs), squeeze, self.write))
        if self._pending is not None:
            mx.eval(self._pending)  # the previous step's reads are done: its buffers are free
            self._pending = None
        if self.attention == "kernel":
            if self._mods is None:
                self._mods = _attention_modules(self.model)
            with _routed(self._mods):
                logits, out = fn(tokens, flats)
        else:
            logits, out = fn(tokens, flats)
        del flats, states
        if self.wait:
            self._pending = logits
        new = [unflatten(f, s, **advanced(s, N)) for f, s in zip(out, prepared)]
        return logits, new


def compiled_decoder(model, *, attention: str = "auto") -> Decoder:
    """A ``Decoder`` for ``model``: ``decode(tokens, states) -> (logits, states)``."""
    return Decoder(model, attention=attention)


def make_step(model, *, attention: str = "auto"):
    """``step(model, tokens, states) -> (logits [B, V], states)``, compiled.

    Same signature as ``kvstate.mlx_lm.step`` (what ``kvstate generate
    --compile`` calls); one ``Decoder`` per ``make_step`` call.
    """
    decoder = Decoder(model, attention=attention)

    def step(model_, tokens, states):
        if model_ is not model:
            raise bad("model", "the model this step was compiled for", type(model_).__name__)
        return decoder(tokens, states)

    step.decoder = decoder
    return step


__all__ = [
    "Spec", "Flat", "spec_of", "flatten", "unflatten", "prepare", "advanced", "with_capacity",
    "position_arrays", "layout_key", "write", "write_index", "Shell", "QuantizedShell",
    "RingShell", "ragged_attention", "kernel_available", "splits_for", "Decoder",
    "compiled_decoder", "make_step",
]
