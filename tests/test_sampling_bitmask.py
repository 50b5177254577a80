"""``kvstate.sampling.apply_bitmask`` against a numpy model: what it lets through, and
that a sampler fed its output only ever draws allowed tokens."""

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstate.sampling import apply_bitmask, row_keys, sample


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


# temperatures the sampler handles: 0 (greedy) or one whose 1/t keeps float32 logits finite
@given(
    masks(min_allowed=1),
    st.integers(0, 2**31 - 1),
    st.one_of(st.just(0.0), st.floats(0.01, 2.0)),
    st.floats(0.0, 1.0),
)
def test_only_allowed_tokens_are_sampled(mv, seed, temperature, top_p):
    bitmask, V = mv
    B = bitmask.shape[0]
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.normal(scale=5.0, size=(B, V)).astype(np.float32))
    masked = apply_bitmask(logits, mx.array(bitmask))
    allowed = _allowed(bitmask, V)
    keys = row_keys([seed + b for b in range(B)])
    for _ in range(8):
        tokens, keys = sample(masked, keys, temperature=temperature, top_p=top_p)
        assert all(allowed[b, t] for b, t in enumerate(tokens.tolist()))


def test_a_bitmask_broadcasts_over_window_positions():
    """One word row per row covers every position of a ``[B, N, V]`` window."""
    bitmask = np.array([[0b101], [0b010]], np.int32)  # row 0: tokens 0, 2; row 1: token 1
    logits = mx.zeros((2, 3, 3))
    out = np.array(apply_bitmask(logits, mx.array(bitmask)[:, None, :]))
    assert np.all(np.isfinite(out[0, :, [0, 2]])) and np.all(out[0, :, 1] == -np.inf)
    assert np.all(np.isfinite(out[1, :, 1])) and np.all(out[1, :, [0, 2]] == -np.inf)
