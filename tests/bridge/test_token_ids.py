"""Token ids the bridge embeds (``kvstate.mlx_lm.token_ids``; notes/bridge.md, "Token ids").

Host ids outside the vocabulary are refused by name before anything runs;
device ids are not read back, so a row holding one gets NaN logits while
the other rows are exactly what they would be without it, and no id ever
reaches the embedding's gather outside it (an id of 2**30 there crashes the
process: without the guard these tests do not fail, they abort). Against a
plain numpy model of which rows are bad."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from _tol import atol
from hypothesis import given
from hypothesis import strategies as st

import kvstate as kv
from kvstate import mlx_lm as bridge

V = tm.VOCAB
DTYPES = {
    mx.int8: (-(2**7), 2**7 - 1),
    mx.uint8: (0, 2**8 - 1),
    mx.int16: (-(2**15), 2**15 - 1),
    mx.uint16: (0, 2**16 - 1),
    mx.int32: (-(2**31), 2**31 - 1),
    mx.uint32: (0, 2**32 - 1),
    mx.int64: (-(2**63), 2**63 - 1),
    mx.uint64: (0, 2**64 - 1),
}
MODEL = tm.llama_model(seed=4, layers=1)


@st.composite
def id_rows(draw):
    """``(dtype, ids [B, N])``: ids of the dtype's whole range, mostly valid."""
    dtype = draw(st.sampled_from(sorted(DTYPES, key=str)))
    lo, hi = DTYPES[dtype]
    B, N = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    one = st.one_of(
        st.integers(0, V - 1),
        st.integers(0, V - 1),
        st.integers(lo, hi),
        st.sampled_from([x for x in (-1, V, V + 1, 2**30, 2**32 + 3) if lo <= x <= hi]),
    )
    return dtype, [[draw(one) for _ in range(N)] for _ in range(B)]


@given(id_rows())
def test_device_ids_outside_the_vocabulary_poison_only_their_rows(case):
    dtype, ids = case
    bad = [any(not 0 <= x < V for x in row) for row in ids]  # the numpy model
    device = mx.array(np.array(ids, dtype=str(dtype).rsplit(".", 1)[-1]))  # (any uint64 too)
    assert device.dtype == dtype
    got, _ = bridge.forward(MODEL, device, bridge.make_states(MODEL, len(ids)))
    # the same batch with every bad row's ids valid (0), as int32: the other
    # rows' logits must be exactly these
    fixed = [[0] * len(row) if b else row for row, b in zip(ids, bad)]
    want, _ = bridge.forward(MODEL, mx.array(fixed), bridge.make_states(MODEL, len(ids)))
    got, want = np.array(got), np.array(want)
    for b, row in enumerate(ids):
        if bad[b]:
            assert np.isnan(got[b]).all(), f"row {b} {row}"
        else:
            np.testing.assert_allclose(got[b], want[b], atol=atol(), rtol=1e-5)


@pytest.mark.parametrize("ids", [[[3, V]], [[-1, 3]], [[2**31]]])
def test_host_ids_outside_the_vocabulary_are_refused_by_name(ids):
    states = bridge.make_states(MODEL, 1)
    with pytest.raises(kv.KVStateError, match=rf"tokens ids: expected in \[0, {V}\)"):
        bridge.forward(MODEL, ids, states)
    with pytest.raises(kv.KVStateError, match=r"prompts\[0\] ids"):
        bridge.prefill(MODEL, ids)
    assert all(s.lengths == (0,) for s in states)


def test_float_ids_are_refused():
    with pytest.raises(kv.KVStateError, match="tokens dtype: expected an integer dtype"):
        bridge.forward(MODEL, mx.array([[1.0]]), bridge.make_states(MODEL, 1))
