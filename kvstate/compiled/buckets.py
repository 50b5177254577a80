"""Batch-size buckets for the compiled decoder: rows padded up to a bucket, and why it traced.

``mx.compile`` traces again for every new input shape, and the batch size is
one of them: a serving schedule passing through batch sizes 3, 4, 2 and 1
would trace four times. The decoder pads the rows up to a bucket instead (by
default the next power of two, ``BUCKETS``; a server that wants one trace for
every batch up to 8 passes ``batch_buckets=(8, 16, 32, 64)``), so every batch
size of a bucket shares one trace::

    rows in:     r0 r1 r2                       (B = 3)
    compiled:    r0 r1 r2 __                    (Bb = 4: one blank row, token 0)
    rows out:    r0 r1 r2                       (views of the first B rows)

The price is the blank rows' share of the step (at most half of it with powers
of two); ``batch_buckets=None`` turns padding off (one trace per batch size).

Blank rows are empty rows of the layer's kind (``blank_rows``): each holds only
the tokens the padded steps write into it, and no real row reads them. The
padded records are kept between calls: when the next call gets the very
records the last one returned (a decode loop), it reuses them, so a steady
batch is padded once, not every step (the old buffers are dropped before the
step is evaluated, so its writes stay in place). Kinds with no ``blank_rows``
(hybrid records) run unpadded.
"""

from __future__ import annotations

from functools import singledispatch

import attrs
import mlx.core as mx

from ..core import ops
from ..core.args import as_int
from ..core.records import CacheState, QuantizedState, RotatingState, derived
from ..errors import bad, check

__all__ = ["BUCKETS", "Padding", "blank_rows", "bucket_of", "check_buckets", "head_rows"]

BUCKETS = "pow2"
"""The default: the smallest power of two >= B."""


def check_buckets(buckets):
    """``None`` (no padding), ``"pow2"``, or increasing positive ints (a batch beyond
    the largest runs unpadded)."""
    if buckets is None or buckets == BUCKETS:
        return buckets
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (list, tuple)) or not buckets:
        raise bad(
            "batch_buckets",
            f"None, {BUCKETS!r} or a non-empty list of increasing ints",
            repr(buckets),
        )
    out = tuple(as_int(b, f"batch_buckets[{i}]") for i, b in enumerate(buckets))
    for i, (a, b) in enumerate(zip((0, *out), out)):
        check(b > a, f"batch_buckets[{i}]", f"> {a} (increasing, positive)", b)
    return out


def bucket_of(B: int, buckets) -> int:
    """The batch size ``B`` rows are padded to."""
    if buckets is None or B == 0:
        return B
    if buckets == BUCKETS:
        return 1 << (B - 1).bit_length()
    return next((b for b in buckets if b >= B), B)


@singledispatch
def blank_rows(state, n: int):
    """``n`` empty rows of ``state``'s kind and static fields, or ``None``: not paddable."""
    return None


@blank_rows.register
def _blank_dense(state: CacheState, n: int):
    return CacheState((0,) * n, (0,) * n, state.step)


@blank_rows.register
def _blank_quantized(state: QuantizedState, n: int):
    return QuantizedState(
        (0,) * n, (0,) * n, state.step, group_size=state.group_size, bits=state.bits
    )


@blank_rows.register
def _blank_ring(state: RotatingState, n: int):
    return attrs.evolve(
        state, lengths=(0,) * n, held=(0,) * n, keys=None, values=None, row_ids=None
    )  # (new rows: fresh ids)


def head_rows(state, B: int):
    """The first ``B`` rows of ``state``: its per-row tuples and arrays sliced (views,
    no copy), every column kept (capacity and layout unchanged)."""
    n = state.batch_size
    changes: dict = {}
    for f in attrs.fields(type(state)):
        v = getattr(state, f.name)
        if isinstance(v, mx.array):
            changes[f.name] = v[:B]
        elif isinstance(v, tuple) and v and all(isinstance(x, mx.array) for x in v):
            changes[f.name] = tuple(x[:B] for x in v)
        elif isinstance(v, tuple) and len(v) == n and all(type(x) is int for x in v):
            changes[f.name] = v[:B]
        elif attrs.has(type(v)) and getattr(v, "batch_size", None) == n:
            changes[f.name] = head_rows(v, B)  # (a record's rows: a SharedState's suffix)
    return derived(state, **changes)  # (rows of a valid record: not validated again)


class Padding:
    """The padded records of the last call, kept for the next one (see the module)."""

    def __init__(self):
        self._returned = None
        self._padded = None

    def pad(self, tokens: mx.array, states: list, Bb: int):
        """``(tokens, states)`` with ``Bb`` rows, or ``None`` when a layer cannot pad."""
        B = tokens.shape[0]
        returned, padded = self._returned, self._padded
        self._returned = self._padded = None  # the decoder holds no buffer past this call
        if (
            returned is not None
            and len(returned) == len(states)
            and all(a is b for a, b in zip(returned, states))
        ):
            out = padded
        else:
            blanks = [blank_rows(s, Bb - B) for s in states]
            if any(b is None for b in blanks):
                return None
            out = [ops.merge_rows([s, b]) for s, b in zip(states, blanks)]
        blank = mx.zeros((Bb - B, *tokens.shape[1:]), tokens.dtype)
        return mx.concatenate([tokens, blank], axis=0), out

    def unpad(self, logits: mx.array, states: list, B: int):
        """The first ``B`` rows of the results; the padded records are kept for the next call."""
        out = [head_rows(s, B) for s in states]
        self._returned, self._padded = out, states
        return logits[:B], out


def explain(sig: tuple, seen: list) -> str:
    """Why a call with signature ``sig`` traced, against the signatures traced before.

    ``sig``: ``(Bb, B, N, squeeze, layer keys, capacities)``.
    """
    Bb, B, N, squeeze, keys, caps = sig
    size = f"batch size {B}" + (f" (bucket {Bb})" if Bb != B else "")
    if not seen:
        return f"first call: {size}, {N} token(s) per row, capacity {max(caps, default=0)}"
    ref = min(seen, key=lambda s: sum(a != b for a, b in zip(s, sig)))
    why = []
    if ref[0] != Bb:
        why.append(f"new {size}")
    if (ref[2], ref[3]) != (N, squeeze):
        why.append(f"new tokens per row: {N}")
    if ref[4] != keys:
        changed = [i for i, (a, b) in enumerate(zip(ref[4], keys)) if a != b]
        layers = f"layers {changed[:4]}" + ("..." if len(changed) > 4 else "")
        if all(ref[4][i][:2] == keys[i][:2] for i in changed):  # only same_end moved
            why.append(
                f"{layers}: rows now "
                + (
                    "all end at one column (one-slice writes)"
                    if keys[changed[0]][2]
                    else "end at different columns"
                )
            )
        else:
            why.append(f"{layers}: new kind or static fields (step, bits, window)")
    if ref[5] != caps:
        why.append(f"new capacity bucket {max(caps, default=0)}")
    return "; ".join(why) or "same signature (MLX retraced)"
