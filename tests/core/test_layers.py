"""Model-level ops (``kvstate.core.layers``): every ``kv`` function over a list or tuple of
layer records, one checkpoint for every layer, and empty (B = 0) batches end to end."""

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

import kvstate as kv
from kvstate import mlx_lm as br

H, D = 2, 32


def planes_np(states):
    return [[np.array(p) for p in s.planes] for s in states]


def assert_same_layers(a, b):
    assert type(a) is type(b) and len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y) and x.lengths == y.lengths and x.left_pad == y.left_pad
        fx, fy = kv.fetch(x), kv.fetch(y)
        for p, q in zip(tree_flatten(fx), tree_flatten(fy)):
            np.testing.assert_array_equal(np.array(p[1]), np.array(q[1]))


def ragged(model, lengths=(3, 7, 5)):
    prompts = [tm.prompt(40 + i, n) for i, n in enumerate(lengths)]
    return br.prefill(model, prompts)


@pytest.mark.parametrize("container", [list, tuple])
def test_each_op_over_layers_equals_each_layer(gemma, container):
    _, states = ragged(gemma)
    states = container(states)
    cases = [
        lambda s: kv.filter_rows(s, [2, 0]),
        lambda s: kv.trim(s, [1, 0, 2]),
        lambda s: kv.extract_row(s, 1),
        lambda s: kv.extend(s, s),
        lambda s: kv.merge_rows([s, s, s]),
    ]
    for op in cases:
        got = op(states)
        assert type(got) is container
        assert_same_layers(got, container(op(s) for s in states))
    fetched = kv.fetch(states)
    assert type(fetched) is container and len(fetched) == len(states)
    assert kv.positions(states)[0].tolist() == kv.positions(states[0]).tolist()
    # per-layer arguments: append's k and v, attend's q, one item per layer
    ks = [
        mx.random.normal((3, kv.fetch(s)[0].shape[1], 2, D), key=mx.random.key(i))
        for i, s in enumerate(states)
    ]
    appended = kv.append(states, ks, ks)
    assert type(appended) is container
    assert_same_layers(appended, container(kv.append(s, k, k) for s, k in zip(states, ks)))
    qs = [mx.random.normal((3, 2 * k.shape[1], 2, D)) for k in ks]
    outs = kv.attend(appended, qs, scale=D**-0.5)
    for o, s, q in zip(outs, appended, qs):
        np.testing.assert_array_equal(np.array(o), np.array(kv.attend(s, q, scale=D**-0.5)))


def test_one_checkpoint_covers_every_layer_of_a_mixed_model(gemma):
    """gemma3 has rings (never padded) and dense layers (left-padded after the merge):
    one layer's checkpoint cannot fit both; the model checkpoint does."""
    _logits, states = ragged(gemma)
    assert {type(s) for s in states} == {kv.CacheState, kv.RotatingState}
    cp = kv.checkpoint(states)
    assert isinstance(cp, kv.ModelCheckpoint) and cp.lengths == (3, 7, 5)
    assert len(cp.layers) == len(states) and cp.batch_size == 3
    draft = mx.array([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    _, drafted = br.forward(gemma, draft, states)
    back = kv.rollback(drafted, cp, keep=[0, 2, 1])
    assert [s.lengths for s in back] == [(3, 9, 6)] * len(states)
    # continuing from the rollback equals having fed only the accepted tokens
    kept = [[], [8, 9], [11]]
    for b, toks in enumerate(kept):
        row = kv.extract_row(back, b)
        ref = kv.extract_row(states, b)
        if toks:
            _, ref = br.forward(gemma, mx.array([toks]), ref)
        a, _ = br.step(gemma, mx.array([1]), row)
        r, _ = br.step(gemma, mx.array([1]), ref)
        np.testing.assert_allclose(np.array(a), np.array(r), atol=1e-5, rtol=0)


def test_wrong_containers_say_what_to_pass(llama):
    _, states = ragged(llama)
    with pytest.raises(kv.KVStateError, match="or a list or tuple of them .one per layer"):
        kv.checkpoint({"layers": states})
    with pytest.raises(
        kv.KVStateError, match=r"^states\[1\]: expected a kvstate record .*one record per layer"
    ):
        kv.filter_rows([states[0], states, states[2]], [0])
    with pytest.raises(kv.KVStateError, match="^states: expected at least one layer record"):
        kv.checkpoint([])
    with pytest.raises(kv.KVStateError, match=r"^k: expected 3 arrays \(one per layer\), got 2"):
        kv.append(states, [mx.zeros((3, H, 1, D))] * 2, [mx.zeros((3, H, 1, D))] * 3)
    with pytest.raises(kv.KVStateError, match="^k: expected a list of 3 arrays"):
        kv.append(states, mx.zeros((3, H, 1, D)), mx.zeros((3, H, 1, D)))
    with pytest.raises(kv.KVStateError, match="^checkpoint: expected the ModelCheckpoint"):
        kv.rollback(states, states[0].lengths)
    with pytest.raises(kv.KVStateError, match="^checkpoint layers: expected 3"):
        kv.rollback(states, kv.checkpoint(states[:2]))
    with pytest.raises(kv.KVStateError, match=r"^states\[1\] layers: expected 3"):
        kv.merge_rows([states, states[:2]])
    with pytest.raises(kv.KVStateError, match=r"^states\[1\]: expected a list like states\[0\]"):
        kv.merge_rows([states, tuple(states)])
    snapshot = planes_np(states)  # nothing above changed the input
    for s, snap in zip(states, snapshot):
        for p, q in zip(s.planes, snap):
            np.testing.assert_array_equal(np.array(p), q)


# --- empty batches ------------------------------------------------------------------


@pytest.mark.parametrize("make", [{}, {"kv_bits": 8, "kv_group_size": 32}, {"max_kv_size": 6}])
def test_empty_batches_from_make_states_and_filter_rows(llama, make):
    empty = br.make_states(llama, 0, **make)
    assert [s.batch_size for s in empty] == [0] * len(llama.layers)
    _logits, states = br.prefill(llama, [tm.prompt(1, 4), tm.prompt(2, 6)], **make)
    gone = kv.filter_rows(states, [])
    assert [s.batch_size for s in gone] == [0] * len(states)
    for zero in (empty, gone):
        lg, same = br.step(llama, mx.zeros((0,), mx.int32), zero)
        assert lg.shape == (0, tm.VOCAB) and all(a is b for a, b in zip(same, zero))
        lg, same = br.forward(llama, mx.zeros((0, 3), mx.int32), zero)
        assert lg.shape == (0, 3, tm.VOCAB)
        for joined in (kv.extend(zero, states), kv.extend(states, zero)):
            assert_same_layers(joined, states)
            a, _ = br.step(llama, mx.array([3, 4]), joined)
            b, _ = br.step(llama, mx.array([3, 4]), states)
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=0)
        cp = kv.checkpoint(zero)
        for back in (kv.rollback(zero, cp, 0), kv.trim(zero, 0)):
            assert [s.batch_size for s in back] == [0] * len(states)
    lg, none = br.prefill(llama, [], **make)
    assert lg.shape == (0, tm.VOCAB) and [s.batch_size for s in none] == [0] * len(states)


def mlx_lm_greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[:, -1]
    return out


def test_a_serving_loop_runs_through_an_empty_batch(llama):
    """Rows leave until none is left, the loop keeps stepping the empty batch, and a
    request joining later gets mlx-lm's greedy tokens."""
    prompts = {0: tm.prompt(5, 4), 1: tm.prompt(6, 7), 2: tm.prompt(7, 3)}
    budget = {0: 2, 1: 3, 2: 4}
    arrive = {0: 0, 1: 0, 2: 5}  # 2 arrives after the batch has emptied (step 3)
    states, logits, rows, got = br.make_states(llama, 0), mx.zeros((0, tm.VOCAB)), [], {}
    empty_steps = 0
    for t in range(12):
        joining = [i for i in prompts if arrive[i] == t]
        if joining:
            lg, new = br.prefill(llama, [prompts[i] for i in joining])
            states, logits = kv.extend(states, new), mx.concatenate([logits, lg])
            rows += joining
        empty_steps += not rows
        toks = mx.argmax(logits, axis=-1) if rows else mx.zeros((0,), mx.uint32)
        for r, i in enumerate(rows):
            got.setdefault(i, []).append(int(toks[r].item()))
        keep = [r for r, i in enumerate(rows) if len(got[i]) < budget[i]]
        states, rows = kv.filter_rows(states, keep), [rows[r] for r in keep]
        logits, states = br.step(llama, toks[mx.array(keep, mx.int32)], states)
    assert empty_steps >= 1
    for i, p in prompts.items():
        assert got[i] == mlx_lm_greedy(llama, p, budget[i]), f"request {i}"
