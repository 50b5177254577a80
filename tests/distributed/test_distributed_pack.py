"""The pure halves of row migration, in one process: ``pack`` / ``unpack``
over a JSON round trip, ``mismatch``, and the refusals that need no peer.

What goes over the wire is the offer ``pack`` builds (JSON) and its arrays;
these laws check that the receiver rebuilds exactly ``kv.extract_row`` of
every moved row, for every record kind, and merges it as ``kv.merge_rows``.
"""

from __future__ import annotations

import json

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import kvstate as kv
from kvstate.distributed import rows as dist
from kvstate.distributed import wire as _wire
from kvstate.kinds import recurrent as rec


def kv_row(make):
    """One row of a KV kind: ``make()`` then a few appends of random tokens."""

    def build(draw, rng):
        s = make()
        for n in draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)):
            k, v = (
                mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32)) for _ in range(2)
            )
            s = kv.append(s, k, v)
        if hasattr(s, "left_pad") and not hasattr(s, "max_size") and draw(st.booleans()):
            s = kv.trim(s, 1)
        return s

    return build


def recurrent_row(draw, rng):
    s = rec.recurrent_state(1, slots=3)
    s = rec.set_slot(s, 0, mx.array(rng.standard_normal((1, 3, 8)).astype(np.float32)))
    if draw(st.booleans()):  # slot 2 may stay unwritten
        s = rec.set_slot(s, 2, mx.array(rng.integers(0, 9, (1, 2, 4)).astype(np.int32)))
    return rec.advance(s, draw(st.integers(1, 5)))


def composite_row(draw, rng):
    return kv.composite_state([KINDS["ring"](draw, rng), recurrent_row(draw, rng)])


KINDS = {  # every record kind a migration carries
    "dense": kv_row(lambda: kv.empty(1, step=4)),
    "quantized": kv_row(lambda: kv.quantized(1, group_size=32, bits=4)),
    "ring": kv_row(lambda: kv.rotating(1, max_size=5, keep=1, step=2)),
    "chunked": kv_row(lambda: kv.chunked_state(1, chunk_size=4, step=4)),
    "recurrent": recurrent_row,
    "composite": composite_row,
}


@st.composite
def batches(draw, kind):
    """A ragged batch of ``kind`` (padding, stale tails, wrapped rings, unwritten slots)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    return kv.merge_rows([KINDS[kind](draw, rng) for _ in range(draw(st.integers(1, 4)))])


def same(a, b):
    """Two records hold the same fields: host values equal, arrays bit for bit."""
    assert type(a) is type(b)
    for f in attrs.fields(type(a)):
        if not f.eq:  # row_ids: rows received are new rows here (fresh ids)
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=f.name)
        elif isinstance(x, tuple) and any(isinstance(e, mx.array) or attrs.has(type(e)) for e in x):
            assert len(x) == len(y), f.name
            for e, g in zip(x, y):
                if attrs.has(type(e)):
                    same(e, g)
                else:
                    assert (e is None) == (g is None), f.name
                    if e is not None:
                        np.testing.assert_array_equal(np.array(e), np.array(g), err_msg=f.name)
        else:
            assert x == y, (f.name, x, y)


def wire(desc):
    """The offer as the receiver parses it."""
    return json.loads(json.dumps(desc, separators=(",", ":")))


@given(
    st.sampled_from(sorted(KINDS)).flatmap(lambda k: st.tuples(batches(k), batches(k), st.data()))
)
def test_unpack_of_pack_is_extract_row_and_merges(args):
    sender, receiver, data = args
    rows = data.draw(st.lists(st.integers(0, sender.batch_size - 1), min_size=1, unique=True))
    note(f"rows {rows} of lengths {sender.lengths}")
    states = [sender, sender]  # two layers
    desc, arrays = dist.pack(states, rows)
    got = dist.unpack(wire(desc), arrays)
    assert len(got) == len(rows)
    for row, r in zip(got, rows):
        for record, s in zip(row, states):
            same(record, kv.extract_row(s, r))
    assert dist.mismatch(desc["layers"], [dist.signature(receiver)] * 2) is None
    merged = kv.merge_rows([receiver, *(row[0] for row in got)])
    want = kv.merge_rows([receiver, *(kv.extract_row(sender, r) for r in rows)])
    same(merged, want)
    # Bytes on the wire are what the moved rows own, never the batch's capacity.
    assert sum(a.nbytes for a in arrays) == 2 * sum(kv.extract_row(sender, r).nbytes for r in rows)


def test_signatures_and_mismatch():
    dense = kv.append(kv.empty(1), mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    ring = kv.rotating(1, max_size=4, keep=1)
    quant = kv.quantized(1, group_size=32, bits=8)
    assert dist.signature(dense) == {
        "kind": "CacheState",
        "geometry": [2, 8, 8, "float32"],
        "params": {},
    }
    assert dist.signature(ring)["params"] == {"max_size": 4, "keep": 1}
    assert dist.signature(quant)["params"] == {"group_size": 32, "bits": 8}
    sig = dist.signature
    assert dist.mismatch([sig(dense)], None) is None
    assert dist.mismatch([sig(dense)], [sig(kv.empty(1))]) is None  # no geometry yet: fits
    assert "layers: expected 2" in dist.mismatch([sig(dense)], [sig(dense)] * 2)
    assert "layers[0] kind" in dist.mismatch([sig(dense)], [sig(quant)])
    assert "layers[0] params" in dist.mismatch(
        [sig(ring)], [sig(kv.rotating(1, max_size=8, keep=1))]
    )
    r1 = rec.set_slot(rec.recurrent_state(1, slots=2), 0, mx.zeros((1, 3, 8)))
    r2 = rec.set_slot(rec.recurrent_state(1, slots=2), 0, mx.zeros((1, 3, 4)))
    assert sig(r1)["geometry"] == [["float32", 3, 8], None]
    assert "layers[0] geometry" in dist.mismatch([sig(r1)], [sig(r2)])
    assert dist.mismatch([sig(r1)], [sig(rec.recurrent_state(1, slots=2))]) is None
    c1 = kv.composite_state([kv.rotating(1, max_size=4), r1])
    c2 = kv.composite_state([kv.rotating(1, max_size=8), r1])
    assert "layers[0] parts[0] params" in dist.mismatch([sig(c1)], [sig(c2)])
    other = kv.append(kv.empty(1), mx.zeros((1, 1, 3, 8)), mx.zeros((1, 1, 3, 8)))
    assert "layers[0] geometry" in dist.mismatch([sig(dense)], [sig(other)])


def refused_all(desc, spoilers):
    """Each spoiled copy of the offer ``desc`` is refused with KVStateError."""
    for name, spoil in spoilers.items():
        bad = wire(desc)
        spoil(bad)
        with pytest.raises(kv.KVStateError):
            # arrays as a receiver makes them: of the (spoiled) offered shapes
            got = [mx.zeros(shape, dtype) for _, dtype, shape in _wire._specs(bad)]
            dist.unpack(bad, got)
            pytest.fail(f"the spoiled {name} was taken")


def test_unpack_refuses_bad_offers():
    s = kv.append(kv.empty(2), mx.ones((2, 1, 2, 4)), mx.ones((2, 1, 2, 4)))
    desc, arrays = dist.pack([s], [1])
    cases = {
        "dtype": lambda d: d["arrays"][0].__setitem__(1, "complex64"),
        "shape": lambda d: d["arrays"][0].__setitem__(2, [-1, 2]),
        "kind": lambda d: d["rows"][0][0].__setitem__("kind", "os.system"),
        "layers": lambda d: d["rows"].__setitem__(0, []),
        "signature": lambda d: d["layers"][0].__setitem__("kind", "QuantizedState"),
        "lengths": lambda d: d["rows"][0][0]["host"].__setitem__("lengths", [2, 2]),
        "past the columns": lambda d: d["rows"][0][0]["host"].__setitem__("lengths", [3]),
        "negative": lambda d: d["rows"][0][0]["host"].__setitem__("left_pad", [-1]),
        "array rows": lambda d: d["arrays"][0][2].__setitem__(0, 2),
    }
    refused_all(desc, cases)
    with pytest.raises(kv.KVStateError, match="offer"):
        dist.unpack({"rows": []}, arrays)


def test_refused_before_any_communication():
    # A process started without a launcher is a group of one: no rank to talk to.
    s = [kv.append(kv.empty(1), mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))]
    with pytest.raises(kv.KVStateError, match=r"dst: expected another rank .* got 1"):
        dist.send_rows(s, [0], 1)
    with pytest.raises(kv.KVStateError, match=r"dst: expected another rank .* got 0"):
        dist.send_rows(s, [0], 0)
    with pytest.raises(kv.KVStateError, match="src: expected another rank"):
        dist.recv_rows(s, -1)
    with pytest.raises(kv.KVStateError, match="dst: expected an int"):
        dist.send_rows(s, [0], "1")


def test_batch_rows_travel_with_their_records():
    k = mx.array(np.arange(3 * 2 * 4 * 8, dtype=np.float32).reshape(3, 2, 4, 8))
    layers = [kv.from_arrays(k, k + 1, lengths=[4, 2, 3], left_pad=[0, 2, 1])] * 2
    b = kv.Batch(
        layers,
        [5, 6, 7],
        sampling=[kv.Sampling(), kv.Sampling(temperature=0.5), kv.Sampling(top_k=3)],
        ids=["x", 2, None],
        payload=[{"a": [1]}, None, "p"],
    )
    desc, arrays = dist.pack(list(b.states), [2, 0])
    desc["batch"] = dist.batch_rows(b, [2, 0])
    got = dist.unpack(wire(desc), arrays)
    for row, r in zip(got, [2, 0]):
        same(row, kv.extract_row(b, r))  # records, pending token, key, sampling, id, payload
    spoiled = {
        "sampling": lambda d: d["batch"][0]["sampling"]["fields"].__setitem__("temperature", -1),
        "record": lambda d: d["batch"][0]["sampling"].__setitem__("record", "os.system"),
        "tokens": lambda d: d["batch"][1]["tokens"].__setitem__("dtype", "float32"),
        "fields": lambda d: d["batch"][1].pop("keys"),
        "rows": lambda d: d["batch"].pop(),
    }
    refused_all(desc, spoiled)
