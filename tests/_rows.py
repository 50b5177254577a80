"""Test support for dense rows: a plain numpy model and reference attention.

A row is what a model sees: its keys ``[H, L, Dk]`` and values ``[H, L, Dv]``
in temporal order. ``visible`` reads those out of a kvstate record through
``kv.fetch`` and the row layout (columns ``[left_pad[b], ends[b])``); the
numpy helpers compute attention over such rows with no MLX at all, so a
disagreement points at kvstate, not at the reference.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np

import kvstate as kv


def rand(rng: np.random.Generator, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def filled(make, lengths, seed=0, H=2, D=32):
    """Rows of ``lengths`` random tokens, each appended alone to ``make(1)``,
    then merged (left-padded); any record kind."""
    rows = []
    for i, n in enumerate(lengths):
        s = make(1)
        if n:
            k1, k2 = mx.random.split(mx.random.key(seed + i))
            s = kv.append(
                s, mx.random.normal((1, H, n, D), key=k1), mx.random.normal((1, H, n, D), key=k2)
            )
        rows.append(s)
    return kv.merge_rows(rows)


def same_buffer(a, b) -> bool:
    """``a`` and ``b`` read one buffer (evaluated): the same array, though each
    handle a record hands out is a new object (``kvstate.core.handles``)."""
    if not (isinstance(a, mx.array) and isinstance(b, mx.array)):
        return a is b
    return buffer_of(a) == buffer_of(b)


def buffer_of(a: mx.array) -> int:
    """The address of ``a``'s data (evaluates ``a``)."""
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def np_of(x) -> np.ndarray:
    return np.array(x, copy=True)


def visible(state) -> list:
    """Per row ``(keys [H, L, Dk], values [H, L, Dv])`` as numpy, from ``fetch``."""
    if state.keys is None:
        assert all(n == 0 for n in state.lengths)
        return [None] * state.batch_size
    k, v = kv.fetch(state)
    assert k.shape[2] == state.width and v.shape[2] == state.width
    k, v = np_of(k), np_of(v)
    return [
        (k[b, :, p:e, :], v[b, :, p:e, :])
        for b, (p, e) in enumerate(zip(state.left_pad, state.ends))
    ]


def assert_rows_equal(got, want, exact=True):
    """``got``/``want``: lists of ``(k, v)`` numpy rows (or ``None`` for no geometry)."""
    assert len(got) == len(want), (len(got), len(want))
    for b, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:
            glen = 0 if g is None else g[0].shape[1]
            wlen = 0 if w is None else w[0].shape[1]
            assert glen == wlen == 0, f"row {b}: {glen} vs {wlen} tokens"
            continue
        for name, a, c in (("keys", g[0], w[0]), ("values", g[1], w[1])):
            assert a.shape == c.shape, f"row {b} {name}: shape {a.shape} vs {c.shape}"
            if exact:
                np.testing.assert_array_equal(a, c, err_msg=f"row {b} {name}")
            else:
                np.testing.assert_allclose(a, c, atol=1e-6, err_msg=f"row {b} {name}")


def ref_attend_row(k, v, q, scale, window=None) -> np.ndarray:
    """Reference attention of one row: ``q`` ``[Hq, N, D]`` are the row's last N positions."""
    H, L, _ = k.shape
    Hq, N, _ = q.shape
    rep = Hq // H
    k64, v64, q64 = (x.astype(np.float64) for x in (k, v, q))
    out = np.zeros((Hq, N, v.shape[2]))
    for h in range(Hq):
        s = q64[h] @ k64[h // rep].T * scale  # [N, L]
        qpos = L - N + np.arange(N)[:, None]
        cols = np.arange(L)[None, :]
        ok = cols <= qpos
        if window is not None:
            ok &= qpos - cols < window
        s = np.where(ok, s, -np.inf)
        s = s - s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[h] = p @ v64[h // rep]
    return out


def ref_attend(rows, q, scale, window=None) -> np.ndarray:
    """Reference attention ``[B, Hq, N, Dv]`` over numpy rows for numpy ``q``."""
    return np.stack([ref_attend_row(k, v, q[b], scale, window) for b, (k, v) in enumerate(rows)])


def snapshot(state):
    """Everything observable about a record, by value (for "unchanged" checks)."""
    planes = tuple(np_of(p) for p in state.planes)
    return (type(state), state.lengths, state.left_pad, state.step, planes)


def assert_unchanged(state, snap):
    now = snapshot(state)
    assert now[:4] == snap[:4], (now[:4], snap[:4])
    assert len(now[4]) == len(snap[4])
    for a, b in zip(now[4], snap[4]):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def state_of_rows(rows, step=256):
    """A batch (``merge_rows`` of one-row states) holding the numpy ``rows``."""
    states = []
    for k, v in rows:
        s = kv.empty(1, step=step)
        if k.shape[1]:
            s = kv.append(s, mx.array(k[None]), mx.array(v[None]))
        else:
            s = kv.from_arrays(mx.array(k[None]), mx.array(v[None]), step=step)
        states.append(s)
    return kv.merge_rows(states)


def append_peak(state, k, steps: int, keep_old: bool):
    """Peak memory growth over ``steps`` appends of ``k`` (as keys and values).

    The caller still holds ``state``, so the first append (untimed) copies;
    from there on only this loop holds the newest record, unless
    ``keep_old`` keeps every old record alive (the control: then each
    append must copy the planes).

    Each append is waited for with ``mx.synchronize`` (a no-op wait on the
    CPU, where ``mx.eval`` has already run it): MLX writes a plane in place
    only when nothing else holds its buffer, and on its CUDA backend a
    finished command's buffers are let go by a worker thread after
    ``mx.eval`` may have returned, so the next append can find the plane
    still held and copy it (``notes/kernels.md``; the H200 measured
    one or two plane copies in 16 appends without the wait). With the wait
    the contract is the same on every backend: a dropped record's planes
    are written in place.
    """
    state = kv.append(state, k, k)
    mx.eval(k, *state.planes)
    mx.synchronize()
    kept = []

    def run():
        nonlocal state
        for _ in range(steps):
            if keep_old:
                kept.append(state)
            state = kv.append(state, k, k)
            mx.eval(*state.planes)
            mx.synchronize()

    return peak_growth(run), state


def peak_growth(run) -> int:
    """How far memory rose above its start while ``run()`` ran."""
    gc.collect()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    run()
    return mx.get_peak_memory() - start


def np_rows_mask(n, left_pad, ends, width, window=None) -> np.ndarray:
    """The contract's per-row mask ``[B, 1, n, width]``, written out in numpy
    (independent of ``kvstate.core.masks``)."""
    B = len(ends)
    out = np.zeros((B, 1, n, width), dtype=bool)
    for b in range(B):
        for i in range(n):
            q = ends[b] - n + i
            for j in range(width):
                ok = left_pad[b] <= j <= q
                if window is not None:
                    ok = ok and q - j < window
                out[b, 0, i, j] = ok
    return out
