"""``kvstate.sampling.apply_bitmask`` against a numpy model: what it lets through, and
that a sampler fed its output only ever draws allowed tokens."""

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstate.sampling import GREEDY_BELOW, apply_bitmask, parameters, row_keys, sample
from kvstate.speculative.rounds import probabilities


def _allowed(bitmask: np.ndarray, V: int) -> np.ndarray:
    """The numpy model: bit ``i % 32`` of word ``i // 32`` allows token ``i``."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :V].astype(bool)


@st.composite
def masks(draw, min_allowed=0):
    B = draw(st.integers(1, 4))
    V = draw(st.integers(1, 100))
    W = (V + 31) // 32
    words = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=B * W, max_size=B * W))
    bitmask = np.array(words, np.int64).astype(np.int32).reshape(B, W)
    if min_allowed:  # every row allows at least one token: set one bit per row
        for b in range(B):
            t = draw(st.integers(0, V - 1))
            bitmask[b, t // 32] = np.int32(np.uint32(bitmask[b, t // 32]) | np.uint32(1 << t % 32))
    return bitmask, V


@given(masks(), st.integers(0, 2**31 - 1))
def test_apply_bitmask_is_the_numpy_model(mv, seed):
    bitmask, V = mv
    logits = np.random.default_rng(seed).normal(size=(bitmask.shape[0], V)).astype(np.float32)
    out = np.array(apply_bitmask(mx.array(logits), mx.array(bitmask)))
    allowed = _allowed(bitmask, V)
    np.testing.assert_array_equal(out[allowed], logits[allowed])
    assert np.all(out[~allowed] == -np.inf)


# every finite temperature >= 0: subnormal ones (1/t overflows float32), tiny, huge (past
# float32's range: inf once on the device)
temperatures = st.one_of(
    st.just(0.0),
    st.floats(0.01, 2.0),
    st.floats(0.0, 1e-3, allow_subnormal=True),
    st.sampled_from([5e-324, 1e-45, 1e-38, 1e-30, 9.9e-6, 1e-5, 1e30, 3.4028235677973366e38]),
    st.floats(0.0, allow_nan=False, allow_infinity=False),
)


@given(
    masks(min_allowed=1),
    st.integers(0, 2**31 - 1),
    temperatures,
    st.floats(0.0, 1.0),
    st.sampled_from([1.0, 5.0, 1e4]),
)
def test_only_allowed_tokens_are_sampled(mv, seed, temperature, top_p, scale):
    """Whatever the temperature, a masked token is never drawn, and the distribution
    speculative verification draws from gives it probability 0 (and is one: no NaN)."""
    bitmask, V = mv
    B = bitmask.shape[0]
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.normal(scale=scale, size=(B, V)).astype(np.float32))
    masked = apply_bitmask(logits, mx.array(bitmask))
    allowed = _allowed(bitmask, V)
    keys = row_keys([seed + b for b in range(B)])
    for _ in range(8):
        tokens, keys = sample(masked, keys, temperature=temperature, top_p=top_p)
        assert all(allowed[b, t] for b, t in enumerate(tokens.tolist()))
    params = parameters(B, temperature, top_p)
    p = np.array(probabilities(masked, *params))
    assert np.all(p[~allowed] == 0)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-5)


def test_a_temperature_below_greedy_below_is_the_argmax():
    """A subnormal temperature (1/t overflows) is greedy: the argmax after a -100 bias,
    never a token the bias pushed down, whatever the key."""
    logits = mx.array([[9.0, 1.0, 5.0, -2.0]])
    biased = logits + mx.array([[-100.0, 0.0, 0.0, 0.0]])  # (logit_bias {0: -100})
    keys = row_keys([3])
    for t in (1e-45, 1e-30, GREEDY_BELOW / 2):
        for _ in range(4):
            tokens, keys = sample(biased, keys, temperature=t)
            assert tokens.tolist() == [2]
    drawn, _ = sample(biased, row_keys([3]), temperature=GREEDY_BELOW * 10)
    assert drawn.tolist() == [2]  # (the spread at 1e-4 is still far below the gap of 4)


def test_a_bitmask_broadcasts_over_window_positions():
    """One word row per row covers every position of a ``[B, N, V]`` window."""
    bitmask = np.array([[0b101], [0b010]], np.int32)  # row 0: tokens 0, 2; row 1: token 1
    logits = mx.zeros((2, 3, 3))
    out = np.array(apply_bitmask(logits, mx.array(bitmask)[:, None, :]))
    assert np.all(np.isfinite(out[0, :, [0, 2]])) and np.all(out[0, :, 1] == -np.inf)
    assert np.all(np.isfinite(out[1, :, 1])) and np.all(out[1, :, [0, 2]] == -np.inf)
