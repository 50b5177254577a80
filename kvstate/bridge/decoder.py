"""The compiled decode step for mlx-lm models (the bridge side of ``kvstate.compiled``).

``Decoder(model)(tokens, states) -> (logits, states)``: the records cross
the boundary (``compiled.flatten``), the whole model forward runs on
``compiled.Traced`` views through the same shells ``kvstate.mlx_lm.forward``
uses (``kvstate.bridge.shells``), and the results come back as records
(``compiled.unflatten`` with the host lengths advanced). Decisions and
measurements: ``notes/compiled.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import mlx.core as mx

from ..compiled import boundary as compiled
from ..compiled import buckets as _buckets
from ..core.records import QuantizedState
from ..errors import bad, check
from ..kernels import cuda as kernels
from ..kinds import quantized as _quantized
from . import routing
from . import shells as _shells
from .forward import forward, layer_count
from .shells import Model


class _TracedReads:
    """A traced step's attention router: a layer whose kind reads itself
    (``compiled.traced_read``: shared-prefix rows) goes there; with
    ``kernel``, the others go to ``routed_read``; without, quantized rows
    where the stock quantized read cannot run (MLX's CUDA backend) are read
    dequantized under the model's mask (``_masked_quantized``: still a masked
    read, as ``attention="mask"`` says); anything else to the model's own
    SDPA. ``check`` raises when a self-reading layer was not read through the
    router (a model bypassing mlx-lm's global would otherwise attend over the
    suffix columns alone)."""

    def __init__(self, ctx, kernel: bool):
        self.ctx, self.kernel, self.read = ctx, kernel, 0

    def __call__(self, queries, keys, values, cache, scale, sinks, mask):
        content = getattr(cache, "content", None)
        if sinks is None and isinstance(content, compiled.Traced):
            read = compiled.traced_read(content.proto, content, queries, scale, self.ctx)
            if read is not None:
                self.read += 1
                out, cache.content = read
                return out
        if self.kernel:
            return routing.routed_read(queries, keys, values, cache, scale, sinks, mask)
        if sinks is None and isinstance(cache, _shells.Shell):
            return routing._masked_quantized(cache, queries, keys, values, scale, mask)
        return None

    def check(self, own: int) -> None:
        if self.read != own:
            raise bad(
                "model",
                "attention that reads shared rows through mlx-lm's "
                "scaled_dot_product_attention (the cascade read)",
                f"{own - self.read} layer reads that bypassed it",
            )


ATTENTION = ("mask", "kernel", "auto")


class Decoder:
    """A compiled decode step for an mlx-lm model over kvstate records.

    ``decoder(tokens, states) -> (logits, states)``: ``tokens`` ``[B]`` (one
    per row) or ``[B, N]``; ``logits`` ``[B, V]`` for one token per row, else
    ``[B, N, V]``. The whole forward and every state update run in one
    compiled function per static key (the layers' ``Spec.key``s, ``N`` and
    the attention mode); capacity buckets are shapes, so at most one trace
    per bucket. Input records are unchanged; drop them before evaluating the
    result so the writes happen in place. The decode loop's call, given back
    the records the last call returned (with room in their bucket, unpadded),
    runs no per-layer host work beyond building the new records (the steady
    path; ``notes/compiled.md``).

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
            depends on the backend (``notes/compiled.md``). With
            ``attention="kernel"`` on CUDA, planes under
            ``kernels.FUSED_BYTES`` are written by the read's own launch
            instead (``kernels.write_and_read``; ``notes/kernels.md``).
        wait: before returning a step (so before the caller dispatches
            it), wait until the previous step has finished. A buffer that an
            in-flight read still holds cannot be written in place, so without
            the wait a pipelined loop copies every plane it writes each step
            on a GPU (``notes/compiled.md``, ``notes/kernels.md``).
        batch_buckets: rows are padded up to a batch-size bucket so that a
            schedule whose batch size changes does not trace once per size
            (``kvstate.compiled.buckets``): ``"pow2"`` (the default: the next power
            of two), increasing ints (e.g. ``(8, 16, 32, 64)``: one trace for
            every batch up to 8; a batch beyond the largest runs unpadded),
            or ``None`` (no padding: one trace per batch size).

    ``traces`` counts the traces; ``trace_reasons`` says why each happened
    (first call, a new batch-size bucket, a new capacity bucket, new tokens
    per row, a new static layout).
    """

    def __init__(
        self,
        model: Model,
        *,
        attention: str = "auto",
        write: str = "scatter",
        wait: bool = False,
        batch_buckets: str | Sequence[int] | None = _buckets.BUCKETS,
    ) -> None:
        if attention not in ATTENTION:
            raise bad("attention", f"one of {ATTENTION}", repr(attention))
        if write not in ("scatter", "slice"):
            raise bad("write", "'scatter' or 'slice'", repr(write))
        self.write = write
        if attention == "auto":
            attention = "kernel" if kernels.kernel_available() else "mask"
        self.model = model
        self.attention = attention
        self.wait = bool(wait)
        self.batch_buckets = _buckets.check_buckets(batch_buckets)
        self.traces = 0
        self.trace_reasons: list = []
        self._seen: list = []
        self._padding = _buckets.Padding()
        self._fns: dict = {}
        self._mods = None
        self._pending: mx.array | None = None
        self._layers: int | None = None
        self._last: _Last | None = None  # what the last call returned (unpadded)
        self._steady = True  # (False: every call takes the general path; benchmarks)

    def _compiled(self, key):
        fn = self._fns.get(key)
        if fn is None:
            keys, squeeze, where = key
            kernel = self.attention == "kernel"
            own = sum(compiled.reads_itself(k[0]) for k in keys)
            # quantized rows under "mask" where the stock quantized read cannot run
            unread = not _quantized.stock_read_runs() and any(k[0] is QuantizedState for k in keys)
            routed = kernel or own or unread
            if routed and self._mods is None:
                self._mods = routing._attention_modules(self.model)

            def step(tokens, flats, positions):
                self.traces += 1  # Python runs only while tracing
                if squeeze:  # ([B] tokens: one per row; traced, not a host op per call)
                    tokens = tokens[:, None]
                ctx = _shells.Tracing(self.attention, self.write == "slice")
                shells = [
                    _shells.shell(compiled.Traced.of((f[0], positions[w], *f[1:]), k), ctx)
                    for f, k, w in zip(flats, keys, where)
                ]
                if not routed:
                    logits = self.model(tokens, cache=shells)
                else:
                    reader = _TracedReads(ctx, kernel)
                    with routing.routed_attention(self._mods, reader):
                        logits = self.model(tokens, cache=shells)
                    reader.check(own)
                if squeeze:
                    logits = logits[:, -1, :]
                return logits, [sh.content.planes for sh in shells]

            fn = self._fns[key] = mx.compile(step)
        return fn

    def __call__(self, tokens: mx.array | list | tuple, states: Sequence) -> tuple[mx.array, list]:
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens)
        if tokens.dtype != mx.int32 and mx.issubdtype(tokens.dtype, mx.integer):
            # argmax and the samplers give uint32, a list int32: one dtype, one trace
            tokens = tokens.astype(mx.int32)
        states = list(states)
        last = self._last
        if last is not None and last.steady is not None and self._steady:
            got = self._steady_call(last, last.steady, tokens, states)
            if got is not None:
                return got
        return self._general(tokens, states)

    def _steady_call(self, last: "_Last", st: "_Steady", tokens: mx.array, states: list):
        """The decode loop's common call, ``logits, states = dec(tokens, states)``:
        ``states`` are the records the last call returned (each layer's by
        identity), unpadded, and every row still has room in its bucket
        (``compiled.room``, taken when they were built), so ``prepare`` would
        return each as it is and ``_flatten`` would give what it gave last time:
        the same specs, keys, ``where`` and compiled function. So none of that
        runs: the planes and one position set per layout go straight in, and
        each layout advances its ``Spec`` once and builds its layers' records
        with ``Spec.maker``. ``None``: anything differs (the general path)."""
        N = st.N
        if tokens.shape != st.shape or tokens.dtype != st.dtype or st.room < N:
            return None
        refs = last.refs
        if len(states) != len(refs):
            return None
        for r, s in zip(refs, states):
            if r() is not s:
                return None
        layouts = [compiled.position_arrays(states[i]) for i in st.reps]
        traced = self.traces
        logits, out = st.fn(tokens, [(s.planes,) for s in states], layouts)
        if self.traces != traced:  # (MLX retraced: same shapes, so not expected)
            B = tokens.shape[0]
            caps = tuple(s.capacity for s in states)
            self._note_trace((B, B, N, tokens.ndim == 1, st.keys, caps))
        specs, makes = [], []
        for i, sp in last.groups:
            sp = sp.replace(**compiled.advanced(states[i], N))
            specs.append((i, sp))
            makes.append(sp.maker())
        del layouts, states
        new = [makes[g](f) for g, f in zip(last.group_of, out)]
        room = min(compiled.room(new[i]) for i, _ in specs)
        self._last = _Last([weakref.ref(x) for x in new], last.group_of, specs)
        self._last.steady = st._replace(room=room)
        self._settle(logits)
        return logits, new

    def _note_trace(self, sig: tuple) -> None:
        self.trace_reasons.append(_buckets.explain(sig, self._seen))
        self._seen.append(sig)

    def _general(self, tokens: mx.array, states: list) -> tuple[mx.array, list]:
        """Any call: the arguments checked, rows padded to their bucket, each
        record prepared and flattened (``_flatten``), the step, the records
        rebuilt (``_rebuild``)."""
        squeeze, N, B = self._check_call(tokens, states)
        if B == 0:  # nothing to run (mlx-lm models cannot run an empty batch)
            self._last = None
            logits, states = forward(self.model, tokens[:, None] if squeeze else tokens, states)
            return (logits[:, -1, :] if squeeze else logits), states
        Bb = _buckets.bucket_of(B, self.batch_buckets)
        padded = self._padding.pad(tokens, states, Bb) if Bb != B else None
        if padded is None:
            Bb = B
        else:
            tokens, states = padded
        flats, specs, prepared, layouts, where, groups = self._flatten(states, N)
        alone = all(len(f) == 1 for f in flats)  # (no read-only planes: a steady step may follow)
        keys = _keys(specs)
        fn = self._compiled((keys, squeeze, tuple(where)))
        traced = self.traces
        logits, out = fn(tokens, flats, layouts)
        if self.traces != traced:
            self._note_trace((Bb, B, N, squeeze, keys, tuple(s.capacity for s in prepared)))
        del flats, states, padded
        new, group_of, firsts = self._rebuild(out, specs, prepared, groups, N)
        last = self._last = _Last([weakref.ref(x) for x in new], group_of, firsts)
        self._settle(logits)
        if Bb != B:
            self._last = None
            return self._padding.unpad(logits, new, B)
        if alone and all(type(sp) is compiled.Spec for _, sp in firsts):
            last.steady = _steady_of(tokens, N, fn, keys, where, new, firsts)
        return logits, new

    def _check_call(self, tokens: mx.array, states: list) -> tuple[bool, int, int]:
        """Check a call's tokens and records (one per layer, each ``B`` rows).

        Returns:
            ``(squeeze, N, B)``: whether ``tokens`` is ``[B]``, the tokens per
            row, and the rows.
        """
        check(tokens.ndim in (1, 2), "tokens rank", "1 ([B]) or 2 ([B, N])", tokens.ndim)
        squeeze = tokens.ndim == 1
        N = 1 if squeeze else tokens.shape[1]
        check(N >= 1, "tokens length", ">= 1", N)
        if self._layers is None:
            self._layers = layer_count(self.model)
        if len(states) != self._layers:
            raise bad("states", f"{self._layers} records (one per layer of the model)", len(states))
        B = tokens.shape[0]
        kinds: set = set()  # (each kind checked once: this loop runs every step)
        for i, s in enumerate(states):
            if type(s) not in kinds:
                if not _shells.is_record(s):
                    raise bad(f"states[{i}]", "a kvstate record", type(s).__name__)
                kinds.add(type(s))
            if s.batch_size != B:
                raise bad(f"states[{i}] batch size", f"{B} (tokens rows)", s.batch_size)
        return squeeze, N, B

    @property
    def _returned(self) -> dict:
        """The records the last call returned (unpadded), by id: ``(weak
        reference, their Spec)``."""
        last, got = self._last, {}
        if last is not None:
            for r, g in zip(last.refs, last.group_of):
                x = r()
                if x is not None:
                    got[id(x)] = (r, last.groups[g][1])
        return got

    def _settle(self, logits: mx.array) -> None:
        """With ``wait``: block until the previous step has finished, after
        this step's graph is built (so its Python and compiled replay overlap
        the previous step's device time; only the caller's dispatch waits).

        MLX keeps every buffer a launched kernel reads alive until a worker
        thread sees that kernel finish, and a buffer with another holder is
        copied, not written in place. ``mx.eval`` returns when the step's
        event fires, which can be before that worker has let go of its
        buffers; ``mx.synchronize`` returns after it has (``notes/kernels.md``)."""
        if self._pending is not None:
            mx.eval(self._pending)
            mx.synchronize()
            self._pending = None
        if self.wait:
            self._pending = logits

    def _flatten(self, states: Sequence, N: int) -> tuple:
        """Each layer's record prepared for ``N`` new tokens and flattened for
        the compiled step: ``(flats, specs, prepared, layouts, where, groups)``.

        A record this decoder returned last step, unchanged since, is not
        flattened again (its advanced ``Spec`` is remembered); layers of one
        layout share one ``Spec`` object (a ``Spec`` holds no record: a shared
        layer's prefix records stay in the record, ``compiled.rebuild``'s
        ``like``); each layout's position arrays enter the step once
        (``layouts``; ``where[i]`` is layer ``i``'s index into them), so what
        the layers derive from them is traced once per step
        (``TraceContext.shared``). The records this decoder returned with one
        ``Spec`` object have one layout and one set of plane shapes (``_rebuild``
        gave them that object), so once one of them is prepared as it is, the
        others are taken with no per-layer work. ``groups[i]``: layer ``i``'s
        layout for ``_rebuild`` (its ``Spec`` and plane shapes)."""
        flats: list = []
        specs, prepared, positions = [], [], compiled.Positions()
        returned, self._last = self._returned, None
        canon: dict = {}
        layouts: list = []
        slot: dict = {}
        where: list = []
        groups: list = []
        fits: dict = {}  # id(remembered Spec) -> its layout's slot, once one fits as it is

        def add(planes, read_only, spec, p, at, group) -> None:
            # one layer's entries; ``read_only``: planes read, never written (a shared
            # layer's own prefix planes), entered beside its planes
            flats.append((planes, read_only) if read_only else (planes,))
            specs.append(spec)
            prepared.append(p)
            where.append(at)
            groups.append(group)

        for s in states:
            mine = returned.get(id(s))
            known = mine[1] if mine is not None and mine[0]() is s else None  # (its Spec)
            if known is not None and id(known) in fits:
                add(s.planes, compiled.held_planes(s), known, s, fits[id(known)], id(known))
                continue
            p = compiled.prepare(s, N)
            as_is = p is s and known is not None
            if as_is:
                flat, spec = compiled.Flat(s.planes, tuple(positions(s))), known
            else:
                flat, spec = compiled.flatten(p, room=N, positions=positions(p), prepared=True)
                spec = canon.setdefault(spec, spec)  # equal layouts: one Spec object
            ids = tuple(id(a) for a in flat.positions)
            if ids not in slot:
                slot[ids] = len(layouts)
                layouts.append(flat.positions)
            at = slot[ids]
            if as_is:
                fits[id(spec)] = at
            group = id(spec) if as_is else (id(spec), tuple(x.shape for x in p.planes))
            add(flat.planes, compiled.held_planes(p), spec, p, at, group)
        return flats, specs, prepared, layouts, where, groups

    def _rebuild(self, out: list, specs: list, prepared: list, groups: list, N: int) -> tuple:
        """The step's new records from its output arrays; the layers of one
        layout (``groups``: one ``Spec`` object, one set of plane shapes)
        advance their ``Spec`` once. Returns ``(new, group_of, firsts)``:
        ``firsts[group_of[i]]`` is ``(first layer, advanced Spec)`` of layer
        ``i``'s layout (remembered for the next call, ``_Last``)."""
        new: list = []
        group_of: list = []
        firsts: list = []
        index: dict = {}
        for i, (f, sp, s, g) in enumerate(zip(out, specs, prepared, groups)):
            j = index.get(g)
            if j is None:
                j = index[g] = len(firsts)
                firsts.append((i, sp.replace(**compiled.advanced(s, N))))
            new.append(firsts[j][1].rebuild(f, trusted=True, like=s))  # (compiled.rebuild,
            # less its checks: ``f`` is what the step returned for this Spec)
            group_of.append(j)
        return new, group_of, firsts


class _Steady(NamedTuple):
    """What a steady call reuses from the call before (``Decoder._steady_call``):
    the tokens' ``shape`` and ``dtype``, ``N`` per row, the compiled ``fn``,
    its layers' ``keys`` and position slots (``where``: not stored, it is in
    ``fn``'s key; ``reps[k]``: a layer whose record gives slot ``k``'s
    position arrays), and ``room``: the fewest columns any returned record
    has left in its bucket (``compiled.room``)."""

    shape: tuple
    dtype: Any
    N: int
    fn: Any
    keys: tuple
    reps: tuple
    room: int


class _Last:
    """The records a call returned (unpadded), for the next call: a weak
    reference to each (the decoder pins no buffer), ``group_of[i]`` (layer
    ``i``'s layout) and ``groups[j]`` = ``(first layer, Spec)`` of layout
    ``j``; ``steady``: what a steady call reuses, or ``None`` (padded rows,
    a kind without ``compiled.room``, read-only planes (``held_planes``), a
    ``Spec`` subclass)."""

    __slots__ = ("refs", "group_of", "groups", "steady")

    def __init__(self, refs: list, group_of: list, groups: list) -> None:
        self.refs, self.group_of, self.groups = refs, group_of, groups
        self.steady: _Steady | None = None


def _steady_of(
    tokens: mx.array, N: int, fn, keys: tuple, where: list, new: list, firsts: list
) -> "_Steady":
    """What a steady call may reuse from this general call: its compiled step,
    keys, one representative flat per group (``reps``) and the room left."""
    reps: dict = {}
    for i, w in enumerate(where):
        reps.setdefault(w, i)
    return _Steady(
        shape=tokens.shape,
        dtype=tokens.dtype,
        N=N,
        fn=fn,
        keys=keys,
        reps=tuple(reps[w] for w in range(len(reps))),
        room=min(compiled.room(new[i]) for i, _ in firsts),
    )


def _keys(specs: list) -> tuple:
    """The compiled step's cache key of each layer's ``Spec`` (computed once per
    ``Spec`` object: the layers of one layout share one)."""
    key_of: dict = {}
    for sp in specs:
        if id(sp) not in key_of:
            key_of[id(sp)] = sp.key
    return tuple(key_of[id(sp)] for sp in specs)


def compiled_decoder(model: Model, **options: Any) -> Decoder:
    """A ``Decoder`` for ``model``: ``decode(tokens, states) -> (logits, states)``.

    ``options``: ``Decoder``'s (``attention``, ``write``, ``wait``, ``batch_buckets``).
    """
    return Decoder(model, **options)


class CompiledStep:
    """``step(model, tokens, states) -> (logits [B, V], states)``, compiled: what
    ``make_step`` returns. ``decoder`` is the ``Decoder`` it runs (its
    ``traces`` count what was compiled)."""

    def __init__(self, model: Model, decoder: Decoder) -> None:
        self.model, self.decoder = model, decoder

    def __call__(self, model: Model, tokens: mx.array | list | tuple, states: Sequence) -> tuple:
        if model is not self.model:
            raise bad("model", "the model this step was compiled for", type(model).__name__)
        return self.decoder(tokens, states)


def make_step(model: Model, **options: Any) -> CompiledStep:
    """``step(model, tokens, states) -> (logits [B, V], states)``, compiled.

    Same signature as ``kvstate.mlx_lm.step`` (what ``kvstate generate
    --compile`` calls); one ``Decoder(model, **options)`` per ``make_step`` call.
    """
    return CompiledStep(model, Decoder(model, **options))


__all__ = ["Decoder", "compiled_decoder", "make_step", "ATTENTION"]
