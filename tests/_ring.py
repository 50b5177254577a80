"""Test support for rings: a plain numpy model of one ``RotatingKVCache`` row.

``RefRing`` holds a row's entries as a temporal list of ``(position, k, v)``
and applies mlx-lm's rule directly (before appending N tokens, drop the
oldest non-kept entries until at most ``max_size - 1`` remain). Attention is
computed in float64 numpy under the rank window (a query sees itself and
the ``w - 1`` entries before it in temporal order). No MLX is involved, so a
disagreement points at kvstate or mlx-lm, never at the reference.
"""

from __future__ import annotations

import numpy as np

import kvstate as kv


def rand(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


class RefRing:
    def __init__(self, max_size: int, keep: int = 0):
        self.max_size, self.keep = max_size, keep
        self.length = 0
        self.entries = []  # (position, k [H, Dk], v [H, Dv]) in temporal order

    def append(self, k, v):
        """``k`` ``[H, N, Dk]``, ``v`` ``[H, N, Dv]``."""
        while len(self.entries) > self.max_size - 1:
            i = next(i for i, e in enumerate(self.entries) if e[0] >= self.keep)
            del self.entries[i]
        for j in range(k.shape[1]):
            self.entries.append((self.length, k[:, j], v[:, j]))
            self.length += 1

    def can_trim_to(self, t: int) -> bool:
        if t > self.length:
            return False
        if t <= self.keep or len(self.entries) == self.length:
            return True
        start = (
            self.entries[min(self.keep, len(self.entries) - 1)][0]
            if len(self.entries) > self.keep
            else self.length
        )
        return t - start >= self.max_size - 1 - self.keep

    def trim_to(self, t: int):
        self.entries = [e for e in self.entries if e[0] < t]
        self.length = t

    @property
    def positions(self):
        return [e[0] for e in self.entries]

    def kv(self):
        """``(k [H, L, Dk], v [H, L, Dv])`` in temporal order."""
        return (
            np.stack([e[1] for e in self.entries], axis=1),
            np.stack([e[2] for e in self.entries], axis=1),
        )

    def attend(self, q, scale, window=None) -> np.ndarray:
        """``q`` ``[Hq, N, D]``: the last N entries' queries -> ``[Hq, N, Dv]``."""
        w = self.max_size if window is None else window
        k, v = self.kv()
        H, L, _ = k.shape
        Hq, N, _ = q.shape
        k = np.repeat(k.astype(np.float64), Hq // H, axis=0)
        v = np.repeat(v.astype(np.float64), Hq // H, axis=0)
        s = np.einsum("hnd,hld->hnl", q.astype(np.float64), k) * scale
        qr = (L - N + np.arange(N))[:, None]
        r = np.arange(L)[None, :]
        s = np.where((r <= qr) & (qr - r < w), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("hnl,hld->hnd", s / s.sum(-1, keepdims=True), v)


def rows_of(state):
    """Per row ``(k [H, held, Dk], v [H, held, Dv])`` as numpy, from ``kv.fetch``."""
    k, v = kv.fetch(state)
    k, v = np.array(k), np.array(v)
    W = state.width
    assert k.shape[2] == W
    return [(k[b, :, W - h :], v[b, :, W - h :]) for b, h in enumerate(state.held)]


def positions_of(state):
    """Per row, the positions it holds in temporal order (from the bookkeeping)."""
    out = []
    for n, h, s in zip(state.lengths, state.held, state.starts):
        nk = min(state.keep, n)
        out.append(list(range(nk)) + list(range(s, n)))
        assert len(out[-1]) == h
    return out
