"""No record can be changed through an array it hands out or takes in.

MLX's in-place write (``a[...] = x``) rebinds the array *object*; every
holder of that object sees it. The law: whatever a public function is given
or returns, a caller who writes in place into every array they gave or got
(arrays alone, in tuples, in records' fields, in leases) leaves every record
that was reachable before bit-identical (``notes/core.md``, "Handles").

Hypothesis draws the record kind, its rows and the operation; the model of
"unchanged" is a numpy copy of every array reachable from the records.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
from _rows import filled
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import llama_model, prompt

import kvstate as kv
from kvstate import mlx_lm as bridge
from kvstate.kinds.recurrent import set_slot

H, D = 2, 32


# --- what a caller can reach ----------------------------------------------------------


def reach(value):
    """Every ``mx.array`` a caller reaches from ``value``: the value itself,
    items of tuples, lists and dicts, fields of attrs values (records,
    checkpoints, batches), a lease's mask, an mlx-lm cache's arrays (none of
    these holds itself, so the walk ends)."""
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from reach(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from reach(item)
    elif isinstance(value, kv.MaskLease):
        yield from reach(value.mask)
    elif attrs.has(type(value)):
        for f in attrs.fields(type(value)):
            yield from reach(getattr(value, f.name))
    elif hasattr(value, "update_and_fetch"):  # an mlx-lm cache object
        for name in ("keys", "values", "cache"):
            yield from reach(getattr(value, name, None))


def records(value) -> list:
    """Every kvstate record (attrs value) reachable from ``value``."""
    if isinstance(value, (tuple, list)):
        return [r for item in value for r in records(item)]
    if attrs.has(type(value)) and type(value).__module__.startswith("kvstate"):
        return [value] + [
            r for f in attrs.fields(type(value)) for r in records(getattr(value, f.name))
        ]
    return []


def snapshot(value) -> list:
    """Numpy copies of every array reachable from ``value``, in walk order."""
    mx.eval(list(reach(value)))
    return [np.array(a, copy=True) for a in reach(value)]


def scribble(value) -> None:
    """Write in place into every array reachable from ``value``."""
    for a in list(reach(value)):
        if a.size == 0:
            continue
        if a.dtype == mx.bool_:
            a[...] = mx.logical_not(a)
        else:
            a[...] = a + 1
        mx.eval(a)


def assert_same(before: list, after: list, what: str) -> None:
    assert len(before) == len(after), what
    for i, (b, a) in enumerate(zip(before, after)):
        assert b.dtype == a.dtype and b.shape == a.shape, (what, i)
        assert np.array_equal(b, a, equal_nan=True), f"{what}: array {i} changed"


def check_no_route(run) -> None:
    """``run()`` returns ``(gave, got, inputs)``; after writing into everything
    given and got, the input records and the records got are unchanged."""
    gave, got, inputs = run()
    held = records(inputs) + records(got)
    before = snapshot(held)
    scribble(gave)
    scribble(got)
    assert_same(before, snapshot(held), "a record reachable before the writes")


# --- records of every kind -------------------------------------------------------------


def _normal(seed, *shape):
    return mx.random.normal(shape, key=mx.random.key(seed))


def _recurrent(lengths, seed):
    B = len(lengths)
    s = kv.recurrent_state(B, slots=2)
    s = set_slot(s, 0, _normal(seed, B, 3, 4))
    s = set_slot(s, 1, _normal(seed + 1, B, 2, 4, 4))
    return s


KINDS = {
    "dense": lambda lens, seed: filled(kv.empty, lens, seed, H, D),
    "quantized": lambda lens, seed: filled(
        lambda b: kv.quantized(b, group_size=32, bits=8), lens, seed, H, D
    ),
    "rotating": lambda lens, seed: filled(
        lambda b: kv.rotating(b, max_size=6, keep=1), lens, seed, H, D
    ),
    "chunked": lambda lens, seed: filled(
        lambda b: kv.chunked_state(b, chunk_size=4), lens, seed, H, D
    ),
    "recurrent": _recurrent,
    "composite": lambda lens, seed: kv.composite_state(
        [_recurrent(lens, seed), filled(kv.empty, lens, seed, H, D)]
    ),
    "shared": lambda lens, seed: kv.fork(filled(kv.empty, lens, seed, H, D), 0, 1),
    "compressed": lambda lens, seed: filled(
        lambda b: kv.compressed(b, 4, policy="h2o", sinks=1, window=2, margin=3, step=4),
        lens,
        seed,
        H,
        D,
    ),
}


@st.composite
def a_record(draw):
    kind = draw(st.sampled_from(sorted(KINDS)))
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    if kind in ("composite", "recurrent"):
        lengths = [0] * len(lengths)  # (recurrent rows count tokens the model feeds)
    return kind, KINDS[kind](lengths, draw(st.integers(0, 1000)))


def _kv(B, n, seed):
    return _normal(seed, B, H, n, D), _normal(seed + 7, B, H, n, D)


# --- the operations: each returns (gave, got, inputs) ----------------------------------


def op_fetch(s, data):
    return (), kv.fetch(s), s


def op_append(s, data):
    k, v = _kv(s.batch_size, data.draw(st.integers(1, 3)), 5)
    return (k, v), kv.append(s, k, v), s


def op_attend(s, data):
    q = _normal(9, s.batch_size, 2 * H, 1, D)
    return (q,), kv.attend(s, q, scale=D**-0.5), s


def op_positions(s, data):
    return (), kv.positions(s), s


def op_next_mask(s, data):
    memo = kv.MaskMemo()
    got = kv.next_mask(s, data.draw(st.integers(1, 3)), memo=memo)
    return (), got, s


def op_trim(s, data):
    return (), kv.trim(s, data.draw(st.integers(0, 1))), s


def op_rollback(s, data):
    cp = kv.checkpoint(s)
    k, v = _kv(s.batch_size, 2, 3)
    longer = kv.append(s, k, v)
    keep = data.draw(st.lists(st.integers(0, 2), min_size=s.batch_size, max_size=s.batch_size))
    return (k, v), (cp, kv.rollback(longer, cp, keep)), (s, longer)


def op_filter(s, data):
    rows = data.draw(st.lists(st.integers(0, s.batch_size - 1), max_size=s.batch_size))
    return (), kv.filter_rows(s, rows), s


def op_filter_all(s, data):
    return (), kv.filter_rows(s, list(range(s.batch_size))), s


def op_extract(s, data):
    return (), kv.extract_row(s, data.draw(st.integers(0, s.batch_size - 1))), s


def op_merge_one(s, data):
    return (), kv.merge_rows([s]), s


def op_merge(s, data):
    return (), kv.merge_rows([s, s]), s


def op_extend(s, data):
    return (), kv.extend(s, s), s


def op_fork(s, data):
    return (), kv.fork(s, data.draw(st.integers(0, s.batch_size - 1)), 2), s


def op_flatten(s, data):
    leaves, spec = kv.flatten(s)
    back = kv.unflatten(spec, leaves, like=s)
    return leaves, (leaves, back), s


def op_materialize(s, data):
    return (), kv.materialize(s), s


def op_anchor_commit(s, data):
    a = kv.anchor(s)
    return (), (a, kv.commit(s, a)), s


OPS = [
    op_fetch,
    op_append,
    op_attend,
    op_positions,
    op_next_mask,
    op_trim,
    op_rollback,
    op_filter,
    op_filter_all,
    op_extract,
    op_merge_one,
    op_merge,
    op_extend,
    op_fork,
    op_flatten,
    op_materialize,
    op_anchor_commit,
]


@settings(max_examples=120)
@given(a_record(), st.sampled_from(OPS), st.data())
def test_no_write_reaches_a_record(kind_state, op, data):
    kind, s = kind_state

    def run():
        try:
            return op(s, data)
        except kv.KVStateError:  # an operation this kind refuses: nothing was handed out
            return (), (), s

    check_no_route(run)


@settings(max_examples=60)
@given(a_record(), st.sampled_from(OPS), st.data())
def test_no_write_reaches_a_batch(kind_state, op, data):
    kind, s = kind_state
    B = s.batch_size
    tokens = mx.arange(B, dtype=mx.int32) + 5
    batch = kv.Batch([s, s], tokens)

    def run():
        try:
            got = op(batch, data)
        except (kv.KVStateError, TypeError, AttributeError):  # not a Batch operation
            got = ((), (), batch)
        return (tokens, *got[0]), got[1], (batch, got[2])

    check_no_route(run)


# --- constructors: what the caller passes in stays the caller's -------------------------


CONSTRUCTORS = {
    "from_arrays": lambda k, v, keys: kv.from_arrays(k, v),
    "from_temporal": lambda k, v, keys: kv.from_temporal(k, v, lengths=[4, 4], max_size=8),
    "unflatten": lambda k, v, keys: kv.unflatten(kv.flatten(kv.from_arrays(k, v))[1], (k, v)),
    "Batch": lambda k, v, keys: kv.Batch([kv.from_arrays(k, v)], keys[:, 0], keys=keys),
    "set_slot": lambda k, v, keys: set_slot(kv.recurrent_state(2, slots=1), 0, k),
}


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
def test_constructors_keep_no_caller_array(name):
    k, v = _kv(2, 4, 1)
    keys = kv.row_keys([3, 4])
    made = CONSTRUCTORS[name](k, v, keys)
    before = snapshot(made)
    scribble((k, v, keys))
    assert_same(before, snapshot(made), name)


def test_save_load_hand_out_own_arrays(tmp_path):
    s = filled(kv.empty, [3, 5], 1, H, D)
    kv.save(tmp_path / "c.safetensors", [s])
    states, _ = kv.load(tmp_path / "c.safetensors")
    check_no_route(lambda: ((), states, states))


# --- the bridge: shells and mlx-lm cache objects ---------------------------------------


@pytest.fixture(scope="module")
def llama():
    return llama_model(seed=3, layers=2)


def test_bridge_hands_out_no_record_array(llama):
    logits, states = bridge.prefill(llama, [prompt(1, 5), prompt(2, 3)])
    check_no_route(lambda: ((), bridge.step(llama, logits.argmax(-1), states), states))
    tokens = mx.array([[1, 2], [3, 4]])
    check_no_route(lambda: ((tokens,), bridge.forward(llama, tokens, states), states))
    one = [kv.extract_row(s, 0) for s in states]
    check_no_route(lambda: ((), bridge.to_prompt_cache(one), one))
    caches = bridge.to_prompt_cache(one)
    check_no_route(lambda: (caches, bridge.from_prompt_cache(caches), ()))


# --- the seven routes of the trial, as regression tests ----------------------------------


def _sum(s) -> float:
    return sum(float(p.astype(mx.float32).sum()) for p in s.planes)


def test_fetch_at_full_capacity_hands_out_a_new_handle():
    s = kv.from_arrays(mx.ones((1, 1, 4, 16)), mx.ones((1, 1, 4, 16)), step=4)
    assert s.width == s.capacity
    k, v = kv.fetch(s)
    k[...] = 0
    v[...] = 0
    assert _sum(s) == 128


def test_quantized_fetch_hands_out_new_handles():
    s = filled(lambda b: kv.quantized(b, group_size=32, bits=8, step=4), [4], 1, H, D)
    assert s.width == s.capacity
    before = snapshot(s)
    keys, values = kv.fetch(s)
    for plane in (*keys, *values):
        plane[...] = plane + 1
    assert_same(before, snapshot(s), "quantized record")


def test_from_arrays_does_not_keep_the_callers_array():
    k, v = mx.ones((1, 1, 4, 16)), mx.ones((1, 1, 4, 16))
    s = kv.from_arrays(k, v)
    k[...] = 5
    assert _sum(s) == 128


def test_batch_does_not_keep_the_callers_tokens_or_keys():
    tokens, keys = mx.array([99, 6]), kv.row_keys([1, 2])
    b = kv.Batch([filled(kv.empty, [2, 3])], tokens, keys=keys)
    key_bits = np.array(b.keys)
    tokens[1] = 77
    keys[...] = 0
    assert b.tokens.tolist() == [99, 6]
    assert np.array_equal(np.array(b.keys), key_bits)


def test_filter_of_every_row_shares_no_handle_with_its_parent():
    b = kv.Batch([filled(kv.empty, [2, 3])], mx.array([99, 6]))
    child = kv.filter_rows(b, [0, 1])
    t = child.tokens
    t[1] = 77
    assert b.tokens.tolist() == [99, 6]


def test_filter_of_one_row_shares_no_handle():
    a = kv.from_arrays(mx.ones((1, 1, 4, 16)), mx.ones((1, 1, 4, 16)))
    keys = kv.filter_rows(a, [0]).keys
    keys[...] = 0
    assert _sum(a) == 128


def test_merge_of_one_record_hands_out_no_handle_of_it():
    a = kv.from_arrays(mx.ones((1, 1, 4, 16)), mx.ones((1, 1, 4, 16)))
    merged = kv.merge_rows([a])
    keys = merged.keys
    keys[...] = 0
    assert _sum(a) == 128 and _sum(merged) == 128


def test_a_lease_hands_out_its_own_handle():
    memo = kv.MaskMemo()
    build = lambda: mx.array([[True, False]])  # noqa: E731
    key = kv.MaskKey("test", (1,))
    with memo.mask_for(key, build) as lease:
        m = lease.mask
        m[...] = False
    with memo.mask_for(key, build) as lease:
        assert lease.mask.tolist() == [[True, False]]
    assert memo.builds == 1


def test_a_handle_copies_no_data():
    """The rule costs no copy: a record's read and a fetch at full capacity
    are views of the same buffer (no new memory), until someone writes."""
    k = mx.zeros((1, 1, 4096, 256))
    s = kv.from_arrays(k, k, step=4096)
    mx.eval(s.keys)
    base = mx.get_active_memory()
    got = [kv.fetch(s)[0] for _ in range(8)] + [s.keys for _ in range(8)]
    mx.eval(got)
    assert mx.get_active_memory() - base < k.nbytes // 4
