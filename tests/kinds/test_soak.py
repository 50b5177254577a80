"""A stateful soak: tens of thousands of random operations over all three record
kinds against plain numpy models of the rows (``@pytest.mark.slow``).

Each kind runs its own seeded stream of appends, trims, speculative rounds
(checkpoint, a draft whose rejected part may hold NaN or inf, rollback
keeping a random count per row), filters, merges, extracts and save/load
round trips. After every operation the record passes ``validate`` and holds
exactly the model's rows (dense and ring: the same float32 values; quantized:
the model holds each appended token quantized alone); every few operations
``kv.attend`` matches numpy attention over the model rows, so a poisoned
stale column would show up as NaN. Refusals must agree with the model (a
ring row trimmed past what it holds).
"""

from __future__ import annotations

import os
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from _ring import RefRing, rows_of
from _rows import ref_attend, visible

import kvstate as kv
from kvstate.core.invariants import validate

H, D = 2, 32
OPS = int(os.environ.get("KVSTATE_SOAK_OPS", "8000"))  # per kind
CHECK_ATTEND = 25
SAVE_EVERY = 500


def quantize_alone(x):
    """What a quantized record holds for tokens ``x`` (numpy ``[..., D]``), dequantized."""
    q = mx.quantize(mx.array(x), group_size=32, bits=4)
    return np.array(mx.dequantize(*q, group_size=32, bits=4))


class Rows:
    """Dense and quantized rows: a list of numpy ``(k [H, L, D], v [H, L, D])``."""

    def __init__(self, quant: bool):
        self.quant = quant
        self.rows = []

    def make(self, B):
        return kv.quantized(B, group_size=32, bits=4, step=8) if self.quant else kv.empty(B, step=8)

    def held(self, x):
        return quantize_alone(x) if self.quant else x

    def append(self, k, v):
        k, v = self.held(k), self.held(v)
        self.rows = [
            (np.concatenate([rk, k[b]], 1), np.concatenate([rv, v[b]], 1))
            for b, (rk, rv) in enumerate(self.rows)
        ]

    def lengths(self):
        return tuple(k.shape[1] for k, _ in self.rows)

    def cut(self, target):
        self.rows = [(k[:, :t], v[:, :t]) for (k, v), t in zip(self.rows, target)]
        return True

    def check(self, s):
        assert s.lengths == self.lengths()
        if self.quant:
            if s.keys is None or s.width == 0:
                assert not any(self.lengths())
                return
            keys, values = kv.fetch(s)
            k = np.array(mx.dequantize(*keys, group_size=32, bits=4))
            v = np.array(mx.dequantize(*values, group_size=32, bits=4))
            got = [(k[b, :, p:e], v[b, :, p:e]) for b, (p, e) in enumerate(zip(s.left_pad, s.ends))]
        else:
            got = visible(s)
        for b, (g, (wk, wv)) in enumerate(zip(got, self.rows)):
            if g is None:
                assert wk.shape[1] == 0
                continue
            np.testing.assert_array_equal(g[0], wk, err_msg=f"row {b} keys")
            np.testing.assert_array_equal(g[1], wv, err_msg=f"row {b} values")

    def attend(self, q):
        return ref_attend(self.rows, q, 0.3)

    def rows_of(self, idx):
        return [self.rows[i] for i in idx]


class Rings:
    """Ring rows: one ``RefRing`` per row."""

    MAX, KEEP = 7, 2

    def __init__(self):
        self.rows = []

    def make(self, B):
        return kv.rotating(B, max_size=self.MAX, keep=self.KEEP, step=4)

    def append(self, k, v):
        for b, r in enumerate(self.rows):
            r.append(k[b], v[b])

    def lengths(self):
        return tuple(r.length for r in self.rows)

    def cut(self, target):
        if not all(r.can_trim_to(t) for r, t in zip(self.rows, target)):
            return False
        for r, t in zip(self.rows, target):
            r.trim_to(t)
        return True

    def check(self, s):
        assert s.lengths == self.lengths()
        if s.keys is None:
            return
        for b, ((k, v), r) in enumerate(zip(rows_of(s), self.rows)):
            if not r.entries:
                assert k.shape[1] == 0
                continue
            wk, wv = r.kv()
            np.testing.assert_array_equal(k, wk, err_msg=f"row {b} keys")
            np.testing.assert_array_equal(v, wv, err_msg=f"row {b} values")

    def attend(self, q):
        return np.stack([r.attend(q[b], 0.3) for b, r in enumerate(self.rows)])

    def rows_of(self, idx):
        import copy

        return [copy.deepcopy(self.rows[i]) for i in idx]


def fresh(model, rng, lengths):
    """A record and its model rows holding random rows of ``lengths`` tokens."""
    singles = []
    model_rows = []
    for n in lengths:
        s = model.make(1)
        sub = type(model)(model.quant) if isinstance(model, Rows) else type(model)()
        sub.rows = (
            [(np.zeros((H, 0, D), np.float32),) * 2]
            if isinstance(model, Rows)
            else [RefRing(Rings.MAX, Rings.KEEP)]
        )
        if n:
            k = rng.standard_normal((1, H, n, D)).astype(np.float32)
            v = rng.standard_normal((1, H, n, D)).astype(np.float32)
            s = kv.append(s, mx.array(k), mx.array(v))
            sub.append(k, v)
        singles.append(s)
        model_rows += sub.rows
    return kv.merge_rows(singles), model_rows


def soak(kind, ops, seed):
    rng = np.random.default_rng(seed)
    model = Rings() if kind == "ring" else Rows(kind == "quant")
    state, model.rows = fresh(model, rng, rng.integers(0, 6, 3).tolist())
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ops):
            B = state.batch_size
            op = str(
                rng.choice(
                    ["append", "speculate", "trim", "filter", "merge", "extract"],
                    p=[0.3, 0.3, 0.12, 0.1, 0.1, 0.08],
                )
            )
            if i % SAVE_EVERY == SAVE_EVERY - 1:
                op = "save"
            if op == "merge" and B >= 6:
                op = "filter"
            counts[op] = counts.get(op, 0) + 1
            if op == "append":
                n = int(rng.integers(1, 4))
                k = rng.standard_normal((B, H, n, D)).astype(np.float32)
                v = rng.standard_normal((B, H, n, D)).astype(np.float32)
                state = kv.append(state, mx.array(k), mx.array(v))
                model.append(k, v)
            elif op == "speculate":
                n = int(rng.integers(1, 5))
                keep = rng.integers(0, n + 1, B)
                k = rng.standard_normal((B, H, n, D)).astype(np.float32)
                v = rng.standard_normal((B, H, n, D)).astype(np.float32)
                for b in range(B):  # the rejected draft of a row may be poison
                    if keep[b] < n and rng.random() < 0.4:
                        k[b, :, keep[b] :] = rng.choice([np.nan, np.inf, -np.inf])
                        v[b, :, keep[b] :] = np.nan
                cp = kv.checkpoint(state)
                before = model.lengths()
                drafted = kv.append(state, mx.array(k), mx.array(v))
                model.append(k, v)
                target = tuple(m + int(c) for m, c in zip(before, keep))
                ok = model.cut(target)
                try:
                    state = kv.rollback(drafted, cp, keep.tolist())
                    assert ok, "rollback accepted what the model cannot do"
                except kv.KVStateError:
                    assert not ok, "rollback refused what the model can do"
                    state = drafted
            elif op == "trim":
                n = [int(rng.integers(0, m + 1)) for m in model.lengths()]
                target = tuple(m - t for m, t in zip(model.lengths(), n))
                ok = (
                    model.cut(target)
                    if isinstance(model, Rows)
                    else all(r.can_trim_to(t) for r, t in zip(model.rows, target))
                )
                try:
                    state = kv.trim(state, n)
                    assert ok
                    if not isinstance(model, Rows):
                        model.cut(target)
                except kv.KVStateError:
                    assert not ok
            elif op == "filter":
                rows = rng.integers(0, B, int(rng.integers(1, B + 1))).tolist()
                state = kv.filter_rows(state, rows)
                model.rows = model.rows_of(rows)
            elif op == "merge":
                other, rows = fresh(model, rng, rng.integers(0, 8, int(rng.integers(1, 3))))
                if rng.random() < 0.5:
                    state, model.rows = kv.merge_rows([other, state]), rows + model.rows
                else:
                    state, model.rows = kv.merge_rows([state, other]), model.rows + rows
            elif op == "extract":
                b = int(rng.integers(0, B))
                state = kv.extract_row(state, b)
                model.rows = model.rows_of([b])
            elif op == "save":
                path = os.path.join(tmp, "s.safetensors")
                kv.save(path, [state])
                (state,), _ = kv.load(path)
            validate(state)
            model.check(state)
            if (
                i % CHECK_ATTEND == 0
                and state.keys is not None
                and min(model.lengths()) > 0
                and (kind != "ring" or min(state.held) > 0)
            ):
                q = rng.standard_normal((state.batch_size, 2 * H, 1, D)).astype(np.float32)
                got = np.array(kv.attend(state, mx.array(q), scale=0.3))
                assert np.isfinite(got).all(), f"op {i}: a stale column leaked"
                np.testing.assert_allclose(
                    got,
                    model.attend(q),
                    atol=2e-4 if kind == "quant" else 1e-5,
                    err_msg=f"op {i} ({op})",
                )
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "quant", "ring"])
def test_soak(kind):
    counts = soak(kind, OPS, seed={"dense": 1, "quant": 2, "ring": 3}[kind])
    print(f"soak {kind}: {OPS} operations {counts}")
    assert sum(counts.values()) == OPS
