"""Record invariants (``kvstate.core.invariants``): no record that breaks them can exist.

* every lie a constructor, ``attrs.evolve``, ``unflatten`` or
  ``from_prompt_cache`` is told is refused with ``KVStateError``;
* checkpoints know their rows: ``rollback`` refuses one taken before a
  merge, filter or reorder, of another record, or made by hand;
* stale columns cannot leak: a row's attention output equals the row run
  alone whatever its hidden columns held (NaN and inf included);
* a hypothesis state machine drives every public call, hand-made
  checkpoints and lying fields included, over all three record kinds: each
  call returns a valid record with zeros in every hidden column, or raises
  ``KVStateError`` and changes nothing.
"""

from __future__ import annotations

import importlib
import re

import attrs
import mlx.core as mx
import numpy as np
import pytest
from _rows import assert_unchanged, filled, snapshot
from _threads import in_another_thread
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvstate as kv
from kvstate.compiled import boundary as compiled
from kvstate.core import invariants
from kvstate.core.invariants import validate
from kvstate.core.records import derived

H, D = 2, 32


def rand(seed, *shape, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


MAKERS = {
    "dense": lambda B: kv.empty(B, step=8),
    "quant": lambda B: kv.quantized(B, group_size=32, bits=4, step=8),
    "ring": lambda B: kv.rotating(B, max_size=6, keep=1, step=4),
}


def visible(state) -> np.ndarray:
    """Bool ``[B, C]``: the columns each row can read (from the bookkeeping alone)."""
    C = state.capacity
    if isinstance(state, kv.RotatingState):
        holds, _ = importlib.import_module("kvstate.kinds.rotating")._ranks(
            np.array(state.lengths), np.array(state.held), state.keep, C, C
        )
        return holds
    c = np.arange(C)[None, :]
    return (c >= np.array(state.left_pad)[:, None]) & (c < np.array(state.ends)[:, None])


def assert_hidden_zero(state):
    if not state.planes:
        return
    hidden = ~visible(state)
    for p in state.planes:
        a = np.array(p.astype(mx.float32) if p.dtype != mx.uint32 else p)  # [B, H, C, *]
        a = np.moveaxis(a, 2, 1)  # [B, C, H, *]
        assert not a[hidden].any(), "a hidden column holds something other than zeros"


# --- each kind's validation ----------------------------------------------------------


def planes(B=2, C=8, Hh=H, Dd=D, dtype=mx.float32):
    return mx.zeros((B, Hh, C, Dd), dtype)


DENSE_LIES = [
    (dict(left_pad=(-20, 0)), "state.left_pad[0]: expected an int in [0"),
    (dict(lengths=(9, 0)), "state row 0 end (left_pad + lengths): expected <= 8"),
    (dict(lengths=(2**70, 0)), "state.lengths[0]: expected an int in [0, 2147483647]"),
    (
        dict(lengths=(1, 1, 1), left_pad=(0, 0, 0), row_ids=None),
        "state.keys batch (shape[0]): expected 3",
    ),
    (dict(lengths=(1,)), "state.left_pad: expected 1 values"),
    (dict(step=0), "state.step: expected an int in [1"),
    (dict(step=-256), "state.step"),
    (dict(step=2.5), "state.step: expected an int"),
    (dict(keys=planes()[0]), "state.keys rank: expected 4"),
    (dict(values=planes(dtype=mx.float16)), "state.values dtype: expected mlx.core.float32"),
    (dict(values=planes(B=3)), "state.values batch"),
    (dict(values=planes(C=16)), "state.values capacity (shape[2]): expected 8"),
    (dict(values=planes(Hh=4)), "state.values heads (shape[1]): expected 2"),
    (dict(keys=planes(dtype=mx.int32), values=planes(dtype=mx.int32)), "state.keys dtype"),
    (dict(keys=None), "state.keys and state.values: expected both set or both None"),
    (dict(keys=None, values=None), "expected zeros before the first append"),
    (dict(row_ids=(5, 5)), "state.row_ids: expected distinct ids"),
    (dict(row_ids=(5,)), "state.row_ids: expected 2 ints"),
]


@pytest.mark.parametrize("lie,msg", DENSE_LIES, ids=[m.split(":")[0] for _, m in DENSE_LIES])
def test_dense_lies_are_refused(lie, msg):
    base = kv.from_arrays(planes(), planes(), lengths=[3, 1], left_pad=[0, 2])
    with pytest.raises(kv.KVStateError, match=re.escape(msg)):
        attrs.evolve(base, **lie)
    validate(base)


def qplanes(B=2, C=8, Dd=D, bits=4, gs=32, rank=4):
    x = mx.quantize(mx.zeros((B, H, C, Dd)), group_size=gs, bits=bits)
    return tuple(p[0] if rank == 3 else p for p in x)


QUANT_LIES = [
    (dict(bits=7), "state.bits: expected one of"),
    (dict(bits=1000000), "state.bits"),
    (dict(group_size=48), "state.group_size: expected one of"),
    (dict(bits=8), "state.keys[0] (packed) width (shape[3]): expected 8"),
    (dict(group_size=64), "state.keys[0] (packed) width"),
    (dict(keys=qplanes(rank=3)), "state.keys[0] (packed) rank: expected 4"),
    (dict(keys=qplanes()[:2]), "state.keys: expected a (packed, scales, biases) tuple"),
    (dict(values=qplanes(B=3)), "state.values[0] (packed) batch"),
    (dict(values=qplanes(C=16)), "state.values[0] (packed) capacity"),
    (dict(keys=(qplanes()[0].astype(mx.int32), *qplanes()[1:])), "packed) dtype: expected uint32"),
    (
        dict(keys=(qplanes()[0], qplanes()[1].astype(mx.float16), qplanes()[2])),
        "state.keys[2] dtype: expected mlx.core.float16",
    ),
    (dict(lengths=(9, 1)), "state row 0 end"),
]


@pytest.mark.parametrize("lie,msg", QUANT_LIES, ids=[m.split(":")[0] for _, m in QUANT_LIES])
def test_quantized_lies_are_refused(lie, msg):
    base = kv.QuantizedState(
        (3, 1), (0, 2), 8, keys=qplanes(), values=qplanes(), group_size=32, bits=4
    )
    with pytest.raises(kv.KVStateError) as info:
        attrs.evolve(base, **lie)
    assert msg in str(info.value), str(info.value)


RING_LIES = [
    (dict(keep=-5), "state.keep: expected an int in [0, 5]"),
    (dict(keep=6), "state.keep: expected an int in [0, 5]"),
    (dict(max_size=0), "state.max_size: expected an int in [1"),
    (dict(step=0), "state.step"),
    (dict(held=(8, 3)), "state.held[0]: expected <= lengths[0]"),
    (dict(lengths=(40, 3), held=(40, 3)), "state.held[0]: expected <= 8 (the capacity)"),
    (dict(lengths=(-(10**6), 3)), "state.lengths[0]"),
    (dict(held=(0, 3)), "state.held[0]: expected >= keep = 1"),
    (dict(lengths=(1, 3), held=(0, 3)), "state.held[0]: expected 1 (a row inside its kept"),
    (dict(held=(4,)), "state.held: expected 2 values"),
    (dict(values=planes(dtype=mx.float16)), "state.values dtype"),
    (dict(keys=None, values=None), "state.lengths: expected zeros before the first append"),
]


@pytest.mark.parametrize("lie,msg", RING_LIES, ids=[m.split(":")[0] for _, m in RING_LIES])
def test_ring_lies_are_refused(lie, msg):
    base = kv.RotatingState(
        (7, 3), (6, 3), max_size=6, keep=1, step=4, keys=planes(), values=planes()
    )
    with pytest.raises(kv.KVStateError) as info:
        attrs.evolve(base, **lie)
    assert msg in str(info.value), str(info.value)


def test_unflatten_refuses_lying_fields():
    s = filled(MAKERS["dense"], [3, 5])
    flat, spec = compiled.flatten(s)
    for fields, msg in (
        (dict(lengths=(-(10**6), 3)), "state.lengths[0]"),
        (dict(lengths=(3,)), "state.left_pad: expected 1 values"),
        (dict(lengths=[3, 10**4]), "state row 1 end"),
        (dict(step=0), "state.step"),
    ):
        with pytest.raises(kv.KVStateError, match=re.escape(msg)):
            compiled.unflatten(spec.replace(**fields), flat)
    other = filled(MAKERS["dense"], [3, 5, 1])
    with pytest.raises(kv.KVStateError, match="batch"):
        compiled.unflatten(spec, compiled.flatten(other)[0])
    assert compiled.unflatten(spec.replace(lengths=[2, 5]), flat).lengths == (2, 5)
    r = filled(MAKERS["ring"], [4, 9])
    rflat, rspec = compiled.flatten(r)
    for fields in (
        dict(lengths=(-(10**6), 9), held=(4, 5)),
        dict(held=(40, 5)),
        dict(lengths=(4,), held=(4,)),
        dict(keep=9),
    ):
        with pytest.raises(kv.KVStateError):
            compiled.unflatten(rspec.replace(**fields), rflat)


def test_small_items():
    """Point 9 of the issue: each answers ``KVStateError`` now."""
    q = kv.quantized(1, group_size=32)
    with pytest.raises(kv.KVStateError, match="k dtype: expected float16, bfloat16 or float32"):
        kv.append(q, mx.zeros((1, H, 1, D), mx.int32), mx.zeros((1, H, 1, D), mx.int32))
    with pytest.raises(kv.KVStateError, match="k dtype"):
        kv.append(kv.empty(1), mx.zeros((1, H, 1, D), mx.int32), mx.zeros((1, H, 1, D), mx.int32))
    from kvstate.mlx_lm import from_prompt_cache

    with pytest.raises(kv.KVStateError, match="caches: expected a list"):
        from_prompt_cache(None)
    s = filled(MAKERS["dense"], [3, 3])  # aligned: no mask is needed, the memo is still checked
    with pytest.raises(kv.KVStateError, match="memo: expected a MaskMemo, got dict"):
        kv.attend(s, rand(1, 2, H, 1, D), scale=0.1, memo={})
    with pytest.raises(kv.KVStateError, match="memo: expected a MaskMemo, got dict"):
        kv.next_mask(s, 1, memo={})


def test_the_compiled_decoder_refuses_records_of_another_geometry():
    """As eager ``forward`` does (a head dim that the model's keys do not have
    was an MLX broadcast error): checked while tracing, so free per step."""
    import tiny_models as tm

    from kvstate import mlx_lm as br

    model = tm.llama_model(layers=2)  # head_dim 32
    decode = kv.compiled_decoder(model)

    def states(D):
        return [
            kv.append(kv.empty(1), mx.zeros((1, 2, 3, D)), mx.zeros((1, 2, 3, D))) for _ in range(2)
        ]

    msg = re.escape("k head dim (shape[3]): expected 16")
    with pytest.raises(kv.KVStateError, match=msg):
        decode(mx.array([1]), states(16))
    with pytest.raises(kv.KVStateError, match=msg):
        br.forward(model, [[1]], states(16))
    decode(mx.array([1]), states(32))


def test_mlx_lm_caches_that_lie_are_refused():
    from mlx_lm.models import cache as lm_cache

    from kvstate.mlx_lm import from_prompt_cache

    c = lm_cache.QuantizedKVCache(group_size=32, bits=4)
    c.update_and_fetch(rand(0, 1, H, 3, D), rand(1, 1, H, 3, D))
    c.bits = 1000000
    with pytest.raises(kv.KVStateError, match="bits"):
        from_prompt_cache([c])
    d = lm_cache.KVCache()
    d.update_and_fetch(rand(0, 1, H, 5, D), rand(1, 1, H, 5, D))
    d.offset = -4
    with pytest.raises(kv.KVStateError, match=r"caches\[0\].offset: expected in \[0, 256\]"):
        from_prompt_cache([d])


# --- checkpoints know where they came from ----------------------------------------------


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_rollback_refuses_a_checkpoint_of_other_rows(kind):
    make = MAKERS[kind]
    s = filled(make, [4, 2])
    cp = kv.checkpoint(s)
    d = kv.append(s, rand(7, 2, H, 3, D), rand(8, 2, H, 3, D))
    assert kv.rollback(d, cp, [1, 2]).lengths == tuple(n + k for n, k in zip(s.lengths, [1, 2]))
    cases = {
        "reordered": kv.filter_rows(d, [1, 0]),
        "filtered": kv.filter_rows(d, [0]),
        "merged": kv.extend(d, filled(make, [3])),
        "another record": kv.append(
            filled(make, [4, 2], seed=9), rand(7, 2, H, 3, D), rand(8, 2, H, 3, D)
        ),
    }
    for name, other in cases.items():
        snap = snapshot(other)
        with pytest.raises(kv.KVStateError) as info:
            kv.rollback(other, cp, 0)
        assert "row_ids" in str(info.value) or "batch size" in str(info.value), name
        assert_unchanged(other, snap)
    # a row's id survives extract and identity filters, and a copied row is a new row
    assert kv.extract_row(d, 1).row_ids == (d.row_ids[1],)
    assert kv.filter_rows(d, [0, 1]).row_ids == d.row_ids
    twice = kv.filter_rows(d, [0, 0])
    assert twice.row_ids[0] == d.row_ids[0] and twice.row_ids[1] not in d.row_ids
    assert len(set(kv.merge_rows([d, d]).row_ids)) == 4


def test_hand_made_checkpoints():
    s = filled(MAKERS["dense"], [4])
    d = kv.append(s, rand(1, 1, H, 2, D), rand(2, 1, H, 2, D))
    for lengths in ((-100000,), (-10,)):
        with pytest.raises(kv.KVStateError, match=r"checkpoint.lengths\[0\]: expected an int"):
            kv.Checkpoint(lengths, (0,), row_ids=d.row_ids)
    with pytest.raises(kv.KVStateError, match="checkpoint.left_pad: expected 1 values"):
        kv.Checkpoint((3,), (0, 0))
    with pytest.raises(kv.KVStateError, match="checkpoint: expected one kv.checkpoint took"):
        kv.rollback(d, kv.Checkpoint((3,), (0,)), 0)
    # a hand-made checkpoint naming this record's rows is a claim kvstate can check
    assert kv.rollback(d, kv.Checkpoint((3,), (0,), row_ids=d.row_ids), 1).lengths == (4,)
    with pytest.raises(kv.KVStateError, match="checkpoint \\+ keep for row 0"):
        kv.rollback(d, kv.Checkpoint((7,), (0,), row_ids=d.row_ids), 0)


def test_one_checkpoint_fits_every_layer_of_a_model(tmp_path):
    import tiny_models as tm

    from kvstate import mlx_lm as br

    model = tm.llama_model(layers=2)
    _, states = br.prefill(model, [[1, 2, 3], [4, 5]])
    assert len({s.row_ids for s in states}) == 1
    cp = kv.checkpoint(states[0])
    _, d = br.forward(model, [[6, 7], [8, 9]], states)
    back = [kv.rollback(s, cp, [1, 0]) for s in d]
    assert all(s.lengths == (4, 2) for s in back)
    kv.save(tmp_path / "m.safetensors", back)
    loaded, _ = kv.load(tmp_path / "m.safetensors")
    # fresh ids (no loaded row can take a checkpoint of this process's rows),
    # still one set for all layers
    assert len({s.row_ids for s in loaded}) == 1 and loaded[0].row_ids != back[0].row_ids
    with pytest.raises(kv.KVStateError, match="row_ids"):
        kv.rollback(loaded[0], kv.checkpoint(back[0]), 0)


# --- stale columns cannot leak ------------------------------------------------------------


def alone(state, b, q, **kw):
    """Row ``b`` run alone: its own one-row record (no padding, no stale columns)."""
    return kv.attend(kv.extract_row(state, b), q[b : b + 1], scale=0.2, **kw)


# chunked rows too (chunk_size above the rows' lengths: the read is the dense one)
DRAFT_MAKERS = {**MAKERS, "chunked": lambda B: kv.chunked_state(B, chunk_size=64, step=8)}


@pytest.mark.parametrize("kind", sorted(DRAFT_MAKERS))
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_a_rejected_draft_cannot_poison_its_row(kind, poison):
    s = filled(DRAFT_MAKERS[kind], [5, 8, 3], seed=3)
    cp = kv.checkpoint(s)
    # row 0 drafts poison, the others finite tokens they keep: row 0's
    # rejected columns lie inside the read of the longer rows
    draft = mx.concatenate([mx.full((1, H, 4, D), poison), rand(4, 2, H, 4, D)], axis=0)
    d = kv.append(s, draft, draft)
    r = kv.rollback(d, cp, [0, 4, 2])  # every poisoned column rejected
    q = rand(5, 3, 2 * H, 1, D)
    r = kv.append(r, rand(6, 3, H, 1, D), rand(7, 3, H, 1, D))
    out = np.array(kv.attend(r, q, scale=0.2))
    assert np.isfinite(out).all()
    for b in range(3):
        np.testing.assert_allclose(out[b : b + 1], np.array(alone(r, b, q)), atol=1e-5)
    assert_hidden_zero(r)
    t = kv.trim(kv.append(s, draft, draft), [4, 0, 1])  # trim drops them the same way
    assert_hidden_zero(t)


def test_the_control_a_hidden_nan_does_poison_the_read():
    """Without clearing, the masked read is NaN (0 * NaN): the tests above can fail."""
    s = filled(MAKERS["dense"], [5, 8], seed=3)
    cp = kv.checkpoint(s)
    draft = mx.concatenate([mx.full((1, H, 3, D), float("nan")), rand(4, 1, H, 3, D)], axis=0)
    d = kv.append(s, draft, draft)
    unsafe = derived(d, lengths=(cp.lengths[0], cp.lengths[1] + 3))  # lengths only, as before
    q = rand(5, 2, 2 * H, 1, D)
    unsafe = kv.append(unsafe, rand(6, 2, H, 1, D), rand(7, 2, H, 1, D))
    assert np.isnan(np.array(kv.attend(unsafe, q, scale=0.2))[0]).all()


def test_arrays_from_outside_are_cleared(tmp_path):
    k = rand(0, 2, H, 8, D)
    junk = mx.where(mx.arange(8)[None, None, :, None] < 2, float("nan"), k)
    s = kv.from_arrays(junk, junk, lengths=[6, 4], left_pad=[2, 2])  # NaN padding
    assert_hidden_zero(s)
    q = rand(1, 2, H, 1, D)
    out = np.array(kv.attend(s, q, scale=0.2))
    assert np.isfinite(out).all()
    # a file whose stale columns hold NaN (an older save, or another writer)
    p = tmp_path / "c.safetensors"
    kv.save(p, [s], exact=True)  # the layout that holds padding (compact files hold none)
    arrays, meta = mx.load(str(p), return_metadata=True)
    arrays = {
        n: mx.where(mx.arange(8)[None, None, :, None] < 2, float("inf"), a)
        for n, a in arrays.items()
    }
    mx.save_safetensors(str(p), arrays, meta)
    (got,), _ = kv.load(p)
    assert_hidden_zero(got)
    np.testing.assert_allclose(np.array(kv.attend(got, q, scale=0.2)), out, atol=1e-6)


# --- recurrent, composite and shared records --------------------------------------------


def _recurrent(B=2):
    return kv.RecurrentState((3, 1), (0, 2), None, arrays=(rand(0, B, 3, 4), rand(1, B, H, 4, 8)))


RECURRENT_LIES = [
    (dict(lengths=(-1, 1)), "state.lengths[0]: expected an int in [0"),
    (dict(lengths=(2**70, 1)), "state.lengths[0]: expected an int in [0, 2147483647]"),
    (dict(left_padding=(0, -4)), "state.left_padding[1]: expected an int in [0"),
    (dict(left_padding=(0,)), "state.left_padding: expected 2 values"),
    (dict(until=(3,)), "state.until: expected 2 values"),
    (dict(arrays=(rand(0, 3, 3, 4),)), "state.arrays[0] batch (shape[0]): expected 2"),
    (dict(arrays=(rand(0, 2, 3, 4), mx.zeros((4,), mx.int32))), "state.arrays[1] batch"),
    (dict(arrays=(np.zeros((2, 3)),)), "state.arrays[0]: expected an mx.array"),
]


@pytest.mark.parametrize(
    "lie,msg", RECURRENT_LIES, ids=[m.split(":")[0] for _, m in RECURRENT_LIES]
)
def test_recurrent_lies_are_refused(lie, msg):
    base = _recurrent()
    with pytest.raises(kv.KVStateError, match=re.escape(msg)):
        attrs.evolve(base, **lie)
    validate(attrs.evolve(base, until=(-3, 5), arrays=(None, rand(1, 2, 4))))  # honest ones pass
    cp = kv.RecurrentCheckpoint((3, 1), base.arrays)
    validate(cp)
    with pytest.raises(kv.KVStateError, match=re.escape("checkpoint.lengths[1]")):
        kv.RecurrentCheckpoint((3, -1), base.arrays)
    with pytest.raises(kv.KVStateError, match=re.escape("checkpoint.arrays[0] batch")):
        kv.RecurrentCheckpoint((3,), base.arrays)


def test_composite_lies_are_refused():
    rec = kv.RecurrentState((3, 1), (0, 0), None, arrays=_recurrent().arrays)  # settled
    dense = kv.from_arrays(planes(), planes(), lengths=[3, 1], left_pad=[0, 2])
    good = kv.CompositeState((rec, dense))
    assert validate(good) is good
    one = kv.extract_row(dense, 0)
    for parts, msg in [
        ((rec, one), "state.parts[1] batch size: expected 2 (as parts[0])"),
        ((), "state.parts: expected at least one record"),
        ((rec, "cache"), "state.parts[1]: expected a kvstate record"),
        ((rec, derived(dense, lengths=(9, 1))), "state row 0 end"),  # a part that lies
    ]:
        with pytest.raises(kv.KVStateError, match=re.escape(msg)):
            kv.CompositeState(parts)
    cp = kv.checkpoint(good)
    assert validate(cp) is cp
    with pytest.raises(kv.KVStateError, match=re.escape("checkpoint.parts[1] batch size")):
        kv.CompositeCheckpoint((cp.parts[0], kv.checkpoint(one)))
    # the compile boundary: a slot of another batch is refused, the honest planes pass
    flat, spec = compiled.flatten(good, room=1)
    assert validate(compiled.unflatten(spec, flat)).batch_size == 2
    with pytest.raises(kv.KVStateError, match=re.escape("state.arrays[0] batch")):
        compiled.unflatten(spec, (rand(0, 3, 3, 4), *flat.planes[1:]))


def test_shared_state_is_validated_by_the_generic():
    s = filled(MAKERS["dense"], [5, 3])
    forked = kv.fork([s], 0, 2)[0]
    assert isinstance(forked, kv.SharedState) and validate(forked) is forked
    with pytest.raises(kv.KVStateError, match=re.escape("shared[0]: expected in [0,")):
        attrs.evolve(forked, shared=(99,) + forked.shared[1:])
    with pytest.raises(kv.KVStateError, match=re.escape("prefix_row[1]: expected a row of")):
        attrs.evolve(forked, prefix_row=forked.prefix_row[:1] + (7,) + forked.prefix_row[2:])
    with pytest.raises(kv.KVStateError, match=re.escape("source: expected")):
        attrs.evolve(forked, source=forked.source[1:])


# --- every public call, lying fields included ------------------------------------------------


class Adversary(RuleBasedStateMachine):
    """One record of each kind, driven by every public call with honest and
    lying arguments. After each call the record is valid and its hidden
    columns are zeros; a refused call changed nothing."""

    def __init__(self):
        super().__init__()
        self.states, self.cps = {}, []

    @initialize(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=3))
    def start(self, lengths):
        self.states = {k: filled(make, lengths) for k, make in MAKERS.items()}
        Adversary.sequences += 1

    def apply(self, name, call, planes_trusted=False):
        """``call(state)`` on every kind: a valid record or KVStateError, input unchanged.

        ``planes_trusted``: ``unflatten`` takes the planes a compiled step
        returned as they are (hidden columns included; notes/core.md)."""
        for kind, s in list(self.states.items()):
            snap = snapshot(s)
            try:
                out = call(s)
            except kv.KVStateError:
                assert_unchanged(s, snap)
                Adversary.refused += 1
                continue
            Adversary.operations += 1
            if isinstance(out, (kv.CacheState, kv.QuantizedState, kv.RotatingState)):
                validate(out)
                if not planes_trusted:
                    assert_hidden_zero(out)
                if out.batch_size and not planes_trusted:
                    self.states[kind] = out
            assert_unchanged(s, snap)
        note(f"{name}: {[(k, s.lengths) for k, s in self.states.items()]}")

    @rule(
        n=st.integers(-1, 4),
        seed=st.integers(0, 99),
        bad=st.sampled_from([None, "heads", "dim", "dtype", "batch"]),
    )
    def append(self, n, seed, bad):
        def call(s):
            B, Hh, Dd, dtype = s.batch_size, H, D, mx.float32
            if bad == "heads":
                Hh = 3
            elif bad == "dim":
                Dd = 16
            elif bad == "dtype":
                dtype = mx.int32
            elif bad == "batch":
                B += 1
            k = rand(seed, B, Hh, max(n, 0), Dd, dtype=dtype)
            return kv.append(s, k, k)

        self.apply(f"append {n} {bad}", call)

    @rule(n=st.one_of(st.integers(-3, 12), st.lists(st.integers(-3, 12), max_size=4)))
    def trim(self, n):
        self.apply(f"trim {n}", lambda s: kv.trim(s, n))

    @rule()
    def checkpoint(self):
        self.cps = [(k, kv.checkpoint(s)) for k, s in self.states.items()]

    @rule(
        keep=st.integers(-1, 5),
        by_hand=st.none()
        | st.tuples(
            st.lists(st.integers(-20, 20), min_size=1, max_size=3),
            st.lists(st.integers(-2, 4), min_size=1, max_size=3),
            st.booleans(),
        ),
    )
    def rollback(self, keep, by_hand):
        def call(s):
            if by_hand is not None:
                lengths, pads, own = by_hand
                cp = kv.Checkpoint(lengths, pads, row_ids=s.row_ids if own else None)
            else:
                cp = dict(self.cps).get(kind_of(s)) or kv.checkpoint(s)
            return kv.rollback(s, cp, keep)

        self.apply(f"rollback {keep} {by_hand}", call)

    @rule(rows=st.lists(st.integers(-1, 4), min_size=0, max_size=4))
    def filter(self, rows):
        self.apply(f"filter {rows}", lambda s: kv.filter_rows(s, rows))

    @rule(row=st.integers(-1, 3))
    def extract(self, row):
        self.apply(f"extract {row}", lambda s: kv.extract_row(s, row))

    @rule(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=2), self_too=st.booleans())
    def merge(self, lengths, self_too):
        def call(s):
            if s.batch_size > 5:
                return s
            other = filled(MAKERS[kind_of(s)], lengths, seed=11)
            return kv.merge_rows([s, other] + ([s] if self_too else []))

        self.apply(f"merge {lengths}", call)

    @rule(
        field=st.sampled_from(
            [
                "lengths",
                "left_pad",
                "held",
                "step",
                "keep",
                "max_size",
                "bits",
                "group_size",
                "row_ids",
            ]
        ),
        value=st.one_of(st.integers(-5, 40), st.lists(st.integers(-5, 40), max_size=4)),
    )
    def lie(self, field, value):
        def call(s):
            if field not in attrs.fields_dict(type(s)):
                raise kv.KVStateError("field: expected one of this kind, got none")
            return attrs.evolve(s, **{field: value})

        self.apply(f"evolve {field}={value}", call)

    @rule(
        fields=st.fixed_dictionaries(
            {},
            optional={
                "lengths": st.lists(st.integers(-3, 30), max_size=4),
                "held": st.lists(st.integers(-3, 30), max_size=4),
            },
        )
    )
    def unflatten(self, fields):
        def call(s):
            if s.keys is None:
                return s
            if not isinstance(s, kv.RotatingState):
                fields.pop("held", None)
            flat, spec = compiled.flatten(s)
            return compiled.unflatten(spec.replace(**fields), flat)

        self.apply(f"unflatten {fields}", call, planes_trusted=True)

    @invariant()
    def valid(self):
        for s in self.states.values():
            validate(s)


def kind_of(s):
    return {kv.CacheState: "dense", kv.QuantizedState: "quant", kv.RotatingState: "ring"}[type(s)]


Adversary.sequences = Adversary.operations = Adversary.refused = 0
Adversary.TestCase.settings = settings(max_examples=200, stateful_step_count=20)
TestAdversary = Adversary.TestCase


@pytest.mark.parametrize("cols", [(range(5, 7), range(6, 8)), (range(5, 7), ())])
def test_a_clear_layout_cached_by_one_thread_serves_another(cols):
    # clear_columns remembers its last layout's index arrays across calls; made lazily
    # they were bound to the stream of the thread that built them, and another thread
    # clearing the same layout failed ("There is no Stream(cpu, 0) in current thread")
    p = mx.arange(2 * 8 * 4, dtype=mx.float32).reshape(2, 1, 8, 4)
    mx.eval(p)
    invariants.clear_columns((p,), cols)  # built here, never evaluated here
    plane = in_another_thread(lambda: np.array(invariants.clear_columns((p,), cols)[0]))
    want = np.array(p)
    for b, c in enumerate(cols):
        want[b, :, list(c)] = 0
    np.testing.assert_array_equal(plane, want)
