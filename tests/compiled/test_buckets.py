"""The compiled decoder's batch-size buckets (``kvstate.compiled.buckets``): padded rows give the
unpadded results, a steady batch is padded once, and ``trace_reasons`` says why."""

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.compiled import buckets as _buckets


def decode(model, decoder, states, toks, n):
    out = []
    for _ in range(n):
        logits, states = decoder(toks, states)
        toks = mx.argmax(logits, axis=-1)
        out.append((np.array(logits), toks.tolist()))
    return out, states


@pytest.mark.parametrize(
    "which, make",
    [
        ("llama", {}),
        ("llama", {"kv_bits": 8, "kv_group_size": 32}),
        ("gemma", {}),
    ],
)
def test_padded_rows_give_the_unpadded_results(which, make):
    model = tm.llama_model() if which == "llama" else tm.gemma3_model()
    prompts = [tm.prompt(50 + i, n) for i, n in enumerate((4, 9, 6))]
    toks = mx.array([1, 2, 3])
    runs = []
    for buckets in (None, "pow2", (8,)):
        _, states = br.prefill(model, prompts, **make)
        decoder = kv.compiled_decoder(model, batch_buckets=buckets)
        out, states = decode(model, decoder, states, toks, 5)
        assert [s.batch_size for s in states] == [3] * len(states)
        runs.append(out)
    for padded in runs[1:]:
        for (a, ta), (b, tb) in zip(runs[0], padded):
            assert ta == tb
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_steady_batch_is_padded_once(llama, monkeypatch):
    made = []
    real = _buckets.blank_rows

    def counted(state, n):
        made.append(n)
        return real(state, n)

    monkeypatch.setattr(_buckets, "blank_rows", counted)
    _, states = br.prefill(llama, [tm.prompt(1, 5), tm.prompt(2, 3), tm.prompt(3, 7)])
    decoder = kv.compiled_decoder(llama)
    _, states = decode(llama, decoder, states, mx.array([1, 2, 3]), 6)
    assert made == [1] * len(states)  # one blank row per layer, once
    states = kv.filter_rows(states, [0, 2, 1])  # new records: padded again
    decode(llama, decoder, states, mx.array([1, 2, 3]), 2)
    assert len(made) == 2 * len(states)


def test_a_schedule_traces_once_per_bucket_and_says_why(llama):
    """Batch sizes 5, 6, 7, 8, 3 with buckets (4, 8): two traces; without: five."""
    prompts = [tm.prompt(10 + i, 4) for i in range(8)]  # one length: rows stay aligned
    _, full = br.prefill(llama, prompts)
    seen = {}
    for buckets in ((4, 8), None):
        decoder = kv.compiled_decoder(llama, batch_buckets=buckets)
        for B in (5, 6, 7, 8, 3):
            states = kv.filter_rows(full, list(range(B)))
            decode(llama, decoder, states, mx.arange(B), 2)
        seen[buckets] = (decoder.traces, decoder.trace_reasons)
    traces, reasons = seen[(4, 8)]
    assert traces == 2 and len(reasons) == 2
    assert reasons[0].startswith("first call: batch size 5 (bucket 8)")
    assert reasons[1] == "new batch size 3 (bucket 4)"
    assert seen[None][0] == 5 and seen[None][1][1] == "new batch size 6"


def test_empty_batches_and_bad_options(llama):
    decoder = kv.compiled_decoder(llama)
    empty = br.make_states(llama, 0)
    logits, states = decoder(mx.zeros((0,), mx.int32), empty)
    assert logits.shape == (0, tm.VOCAB) and [s.batch_size for s in states] == [0] * 3
    assert decoder.traces == 0
    for bad, match in [
        ((4, 2), r"batch_buckets\[1\]: expected > 4"),
        ("all", "batch_buckets"),
        ((0,), r"batch_buckets\[0\]: expected > 0"),
        ([], "batch_buckets"),
    ]:
        with pytest.raises(kv.KVStateError, match=match):
            kv.compiled_decoder(llama, batch_buckets=bad)


def test_bucket_of():
    assert [_buckets.bucket_of(b, "pow2") for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [_buckets.bucket_of(b, (8, 32)) for b in (1, 8, 9, 33)] == [8, 8, 32, 33]
    assert _buckets.bucket_of(5, None) == 5
