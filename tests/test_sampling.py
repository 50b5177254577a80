"""``kvstate.sampling``: mlx-lm's filters per row, greedy rows, per-row keys, and a row's
sample independent of the rows beside it."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

import kvstate as kv
from kvstate.sampling import filter_logprobs, history, next_tokens, parameters, process_logits

V = 40


def logits_of(seed, B=1, spread=3.0):
    return mx.random.normal((B, V), key=mx.random.key(seed)) * spread


def logprobs_of(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


params = st.fixed_dictionaries(
    {
        "top_p": st.sampled_from([0.0, 1.0]) | st.floats(0.05, 0.99),
        "min_p": st.sampled_from([0.0]) | st.floats(0.01, 0.5),
        "top_k": st.sampled_from([0, 1, 2, 5, V - 1, V, V + 3]),
    }
)


def mlx_lm_kept(lp, top_p, min_p, top_k):
    """The tokens mlx-lm's make_sampler chain keeps (same order, same process).

    mlx-lm's filters are ``mx.compile``d with the float parameter as a constant
    (one trace per value); run eagerly, the same code costs no traces."""
    mx.disable_compile()
    try:
        if 0 < top_p < 1:
            lp = apply_top_p(lp, top_p)
        if min_p != 0:
            lp = apply_min_p(lp, min_p)
        if 0 < top_k < V:
            lp = apply_top_k(lp, top_k)
        return np.isfinite(np.array(lp))
    finally:
        mx.enable_compile()


@given(seed=st.integers(0, 10_000), p=params)
def test_filters_keep_what_mlx_lm_keeps(seed, p):
    lp = logprobs_of(logits_of(seed))
    ours = filter_logprobs(
        lp, mx.array([p["top_p"]]), mx.array([p["top_k"]]), mx.array([p["min_p"]])
    )
    np.testing.assert_array_equal(np.isfinite(np.array(ours)), mlx_lm_kept(lp, **p))
    kept = np.isfinite(np.array(ours))
    np.testing.assert_array_equal(np.array(ours)[kept], np.array(lp)[kept])


@given(seed=st.integers(0, 10_000), rows=st.lists(params, min_size=1, max_size=5))
def test_filters_per_row_equal_filters_alone(seed, rows):
    lp = logprobs_of(logits_of(seed, len(rows)))
    cols = {k: mx.array([r[k] for r in rows]) for k in ("top_p", "top_k", "min_p")}
    batch = np.array(filter_logprobs(lp, **cols))
    for b, r in enumerate(rows):
        alone = filter_logprobs(
            lp[b : b + 1], mx.array([r["top_p"]]), mx.array([r["top_k"]]), mx.array([r["min_p"]])
        )
        np.testing.assert_array_equal(batch[b], np.array(alone)[0])


row = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.3, 1.0, 2.5]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5]),
        "top_k": st.sampled_from([0, 1, 4]),
        "min_p": st.sampled_from([0.0, 0.05]),
        "seed": st.integers(0, 2**32 - 1),
    }
)


@given(seed=st.integers(0, 10_000), rows=st.lists(row, min_size=1, max_size=6), data=st.data())
def test_a_rows_sample_does_not_depend_on_its_neighbours(seed, rows, data):
    """Row b sampled in a batch equals row b sampled alone and in a shuffled batch."""
    logits = logits_of(seed, len(rows))

    def run(order):
        cols = {k: [rows[i][k] for i in order] for k in ("temperature", "top_p", "top_k", "min_p")}
        keys = kv.row_keys([rows[i]["seed"] for i in order])
        return kv.sample(logits[mx.array(order)], keys, **cols)

    tokens, keys = run(list(range(len(rows))))
    order = data.draw(st.permutations(range(len(rows))))
    shuffled, skeys = run(order)
    for pos, b in enumerate(order):
        assert shuffled[pos].item() == tokens[b].item()
        assert skeys[pos].tolist() == keys[b].tolist()
    for b in range(len(rows)):
        alone, akey = run([b])
        assert alone.item() == tokens[b].item()
        assert akey[0].tolist() == keys[b].tolist()


def test_temperature_zero_is_argmax_and_ignores_the_key():
    logits = logits_of(1, 5)
    for seeds in ([1, 2, 3, 4, 5], [9, 9, 9, 9, 9]):
        tokens, _ = kv.sample(logits, kv.row_keys(seeds), temperature=0, top_k=3, top_p=0.5)
        assert tokens.tolist() == mx.argmax(logits, axis=-1).tolist()


def test_the_greedy_rule_is_sampling_at_temperature_zero_without_keys():
    """``next_tokens`` (the loops that skip sampling when no row samples): with no
    parameters, the tokens ``sample`` gives every row at temperature 0, and the
    keys back untouched; with parameters, exactly ``sample_arrays``."""
    logits, keys = logits_of(2, 6), kv.row_keys([3, 4, 5, 6, 7, 8])
    tokens, same = next_tokens(logits, keys, None)
    assert same is keys
    want, advanced = kv.sample(logits, keys, temperature=0)
    assert tokens.tolist() == want.tolist()
    params = parameters(6, temperature=[0, 0.7, 1.0, 0, 2.0, 0.5], top_p=0.9)
    got, got_keys = next_tokens(logits, keys, params)
    ref, ref_keys = kv.sample_arrays(logits, keys, *params)
    assert got.tolist() == ref.tolist() and got_keys.tolist() == ref_keys.tolist()
    assert got_keys.tolist() == advanced.tolist()  # (sampling splits every row's key)


def test_samples_follow_the_filtered_distribution():
    """Many rows with one logits vector and distinct keys: frequencies match the
    filtered softmax at temperature T, and no removed token is ever drawn."""
    n, T = 4000, 0.8
    base = logits_of(3, 1, spread=1.0)
    lp = logprobs_of(base)
    kept = filter_logprobs(lp, mx.array([0.9]), mx.array([6]), mx.array([0.0]))
    expect = np.array(mx.softmax(kept / T, axis=-1))[0]
    tokens, _ = kv.sample(
        mx.repeat(base, n, axis=0), kv.row_keys(range(n)), temperature=T, top_p=0.9, top_k=6
    )
    freq = np.bincount(np.array(tokens), minlength=V) / n
    assert set(np.nonzero(freq)[0]) <= set(np.nonzero(expect)[0])
    # 4000 draws: the standard error of a frequency is at most 0.008.
    np.testing.assert_allclose(freq, expect, atol=0.035)
    assert (freq > 0).sum() >= 3  # not greedy: the bound above could not tell


def test_keys_carry_and_calls_are_pure():
    logits = mx.repeat(logits_of(4, 1, spread=0.5), 3, axis=0)
    keys = kv.row_keys([5, 6, 7])
    snapshot = keys.tolist()
    a, next_a = kv.sample(logits, keys, temperature=1.0)
    b, next_b = kv.sample(logits, keys, temperature=1.0)
    assert keys.tolist() == snapshot
    assert a.tolist() == b.tolist() and next_a.tolist() == next_b.tolist()
    draws = [a.tolist()]
    k = next_a
    for _ in range(8):
        t, k = kv.sample(logits, k, temperature=1.0)
        draws.append(t.tolist())
    assert len({tuple(d) for d in draws}) > 1  # the carried keys move on
    use, carry = kv.split_keys(keys)
    assert carry.tolist() == next_a.tolist() and use.tolist() != carry.tolist()


def test_empty_batch():
    tokens, keys = kv.sample(mx.zeros((0, V)), kv.row_keys([]), temperature=0.5)
    assert tokens.shape == (0,) and keys.shape == (0, 2)


def test_sample_arrays_compiles():
    logits = logits_of(6, 3)
    keys = kv.row_keys([1, 2, 3])
    args = (
        mx.array([0.0, 1.0, 0.7]),
        mx.array([1.0, 0.9, 0.5]),
        mx.array([0, 5, 2]),
        mx.array([0.0, 0.0, 0.1]),
    )
    eager = kv.sample_arrays(logits, keys, *args)
    compiled = mx.compile(kv.sample_arrays)(logits, keys, *args)
    assert eager[0].tolist() == compiled[0].tolist()
    assert eager[1].tolist() == compiled[1].tolist()


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": [0.5, 0.5]}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": [0.5, 0.5, -1.0]}, "top_p[2]"),
        ({"min_p": 2}, "min_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": [1, 2, True]}, "top_k[2]"),
    ],
)
def test_bad_parameters_are_refused_by_name(kwargs, arg):
    with pytest.raises(kv.KVStateError, match=rf"^{arg.replace('[', '.').replace(']', '.')}: "):
        kv.sample(logits_of(0, 3), kv.row_keys([1, 2, 3]), **kwargs)


def test_bad_keys_and_logits_are_refused():
    logits = logits_of(0, 3)
    with pytest.raises(kv.KVStateError, match="^keys: expected an mx.array .3, 2. uint32"):
        kv.sample(logits, kv.row_keys([1, 2]))
    with pytest.raises(kv.KVStateError, match="^keys: "):
        kv.sample(logits, [1, 2, 3])
    with pytest.raises(kv.KVStateError, match="^keys: "):
        kv.sample(logits, mx.zeros((3, 2), mx.int32))
    with pytest.raises(kv.KVStateError, match="^logits: "):
        kv.sample(logits[0], kv.row_keys([1]))
    with pytest.raises(kv.KVStateError, match=r"^seeds\[1\]: "):
        kv.row_keys([1, -2])


# --- logits processors: mlx-lm's make_logits_processors, per row --------------------------

processors = st.fixed_dictionaries(
    {
        "repetition_penalty": st.sampled_from([1.0]) | st.floats(0.5, 2.0),
        "presence_penalty": st.sampled_from([0.0]) | st.floats(-2.0, 2.0),
        "frequency_penalty": st.sampled_from([0.0]) | st.floats(-2.0, 2.0),
        "context_size": st.integers(1, 30),
        "logit_bias": st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=4),
    }
)
contexts = st.lists(st.integers(0, V - 1), min_size=1, max_size=40)


def mlx_lm_processed(logits, tokens, p):
    """``logits`` [1, V] through mlx-lm's own processors (its order, its context sizes)."""
    size = p["context_size"]
    for proc in make_logits_processors(
        p["logit_bias"] or None,
        p["repetition_penalty"],
        size,
        p["presence_penalty"],
        size,
        p["frequency_penalty"],
        size,
    ):
        logits = proc(mx.array(tokens), logits)
    return logits


@given(seed=st.integers(0, 10_000), rows=st.lists(st.tuples(processors, contexts), max_size=5))
def test_processors_per_row_equal_mlx_lms(seed, rows):
    """Each row of one batch, with its own penalties, bias and context, gets exactly what
    mlx-lm's processors give that row alone."""
    if not rows:
        return
    logits = logits_of(seed, len(rows))
    sampling = [kv.Sampling(**p) for p, _ in rows]
    hist = history([c for _, c in rows], [s.context_size for s in sampling])
    got = process_logits(logits[:, None, :], hist, sampling)[:, 0]
    for b, (p, c) in enumerate(rows):
        want = mlx_lm_processed(logits[b : b + 1], c, p)
        np.testing.assert_allclose(np.array(got[b]), np.array(want[0]), rtol=1e-6, atol=1e-4)


@given(
    seed=st.integers(0, 10_000),
    p=processors,
    ctx=contexts,
    drafts=st.lists(st.integers(0, V - 1), max_size=4),
)
def test_a_window_position_looks_back_on_the_drafts_before_it(seed, p, ctx, drafts):
    """Position ``w`` of a verify window is processed as mlx-lm processes the context
    followed by the window's first ``w`` drafts."""
    W = 1 + len(drafts)
    logits = mx.random.normal((1, W, V), key=mx.random.key(seed)) * 3
    window = mx.array([[ctx[-1], *drafts]])
    s = kv.Sampling(**p)
    got = process_logits(logits, history([ctx], [s.context_size], window), [s])
    for w in range(W):
        want = mlx_lm_processed(logits[:, w], ctx + drafts[:w], p)
        np.testing.assert_allclose(np.array(got[0, w]), np.array(want[0]), rtol=1e-6, atol=1e-4)


def test_processors_change_the_logits_and_a_plain_row_is_untouched():
    """The control: a penalty changes the seen tokens' logits; a row with none is unchanged."""
    logits = logits_of(3, 2)
    rows = [kv.Sampling(presence_penalty=1.0), kv.Sampling()]
    got = process_logits(logits[:, None, :], history([[1, 2], [1, 2]], [20, 20]), rows)[:, 0]
    assert np.array_equal(np.array(got[1]), np.array(logits[1]))
    assert np.allclose(np.array(got[0, 1:3]), np.array(logits[0, 1:3]) - 1.0)
    assert np.array_equal(np.array(got[0, 3:]), np.array(logits[0, 3:]))


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"context_size": 0}, "context_size"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias key"),
        ({"logit_bias": {3: 101}}, "logit_bias.3."),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ],
)
def test_bad_processor_settings_are_refused_by_name(kwargs, arg):
    with pytest.raises(kv.KVStateError, match=rf"^{arg}: "):
        kv.Sampling(**kwargs)
