"""kv.save / kv.load: byte-exact round trips, mlx-lm prompt-cache files that
continue identically, refusal of files for another model (geometry and
identity), and the memoized model digest. Real safetensors files only."""

import json
import os
import tempfile

import attrs
import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from _quant import needs_stock_quantized_read
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models import cache as lm_cache

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.persist import files as persist

# --- helpers -------------------------------------------------------------------------


def raw(x):
    """Bytes, dtype and shape of an array (byte equality, NaN-safe, any dtype)."""
    return (x.dtype, tuple(x.shape), bytes(memoryview(np.array(x.view(mx.uint8), copy=True))))


def assert_same_record(a, b):
    assert type(a) is type(b)
    for f in attrs.fields(type(a)):
        if not f.eq:  # row_ids: a loaded record's rows get fresh ids
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, mx.array):
            assert raw(x) == raw(y), f.name
        elif isinstance(x, tuple) and x and isinstance(x[0], mx.array):
            assert len(x) == len(y) and all(raw(p) == raw(q) for p, q in zip(x, y)), f.name
        else:
            assert x == y and type(x) is type(y), (f.name, x, y)


def rand_kv(seed, B, N, H=2, D=32, dtype=mx.float32):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return (
        mx.random.normal((B, H, N, D), key=k1).astype(dtype),
        mx.random.normal((B, H, N, D), key=k2).astype(dtype),
    )


def ragged(make, lengths, seed=0, dtype=mx.float32):
    """Rows of the given lengths, each appended alone, then merged (left-padded)."""
    rows = []
    for i, n in enumerate(lengths):
        s = make(1)
        if n:
            s = kv.append(s, *rand_kv(seed + i, 1, n, dtype=dtype))
        rows.append(s)
    return kv.merge_rows(rows)


def dense(B):
    return kv.empty(B, step=16)


def quant(B):
    return kv.quantized(B, group_size=32, bits=4, step=16)


def ring(B):
    return kv.rotating(B, max_size=6, keep=1, step=4)


MAKERS = {"dense": dense, "quant": quant, "ring": ring}


def greedy(model, logits, n, run):
    """``n`` greedy steps: ``run(tokens [B,1]) -> logits [B,1,V]``; returns (logits, tokens)."""
    got_l, got_t = [], []
    for _ in range(n):
        tok = mx.argmax(logits[:, -1], axis=-1)
        got_t.append(tok.tolist())
        logits = run(tok[:, None])
        got_l.append(np.array(logits[:, -1]))
    return np.stack(got_l), got_t


# --- round trips -----------------------------------------------------------------------


def test_round_trip_mixed_records_and_metadata(tmp_path):
    d = ragged(dense, [5, 0, 9, 3], dtype=mx.float16)
    d = kv.trim(d, [1, 0, 2, 0])  # stale columns are kept byte-exact
    q = ragged(quant, [4, 7])
    states = [d, q, kv.empty(3), kv.quantized(2, bits=8), kv.from_arrays(*rand_kv(9, 2, 6))]
    path = tmp_path / "c.safetensors"
    kv.save(path, states, {"prompt": "hello", "n": "3"}, exact=True)
    got, meta = kv.load(path)
    assert meta == {"prompt": "hello", "n": "3"}
    assert len(got) == len(states)
    for a, b in zip(states, got):
        assert_same_record(a, b)
    # The file is a plain safetensors file: arrays readable by anyone.
    arrays = mx.load(str(path))
    assert raw(arrays["0.keys"]) == raw(d.keys)
    assert raw(arrays["1.keys.0"]) == raw(q.keys[0])


OPS = st.lists(
    st.tuples(
        st.sampled_from(["append", "trim", "filter", "extend"]),
        st.integers(0, 6),
        st.integers(0, 2**16),
    ),
    max_size=6,
)


@given(
    kind=st.sampled_from(sorted(MAKERS)),
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    ops=OPS,
)
def test_round_trip_is_exact_after_any_ops(kind, lengths, ops):
    make = MAKERS[kind]
    s = ragged(make, lengths)
    for op, n, seed in ops:
        try:
            if op == "append" and n:
                s = kv.append(s, *rand_kv(seed, s.batch_size, n))
            elif op == "trim":
                s = kv.trim(s, [min(n, m) for m in s.lengths])
            elif op == "filter":
                rows = [b for b in range(s.batch_size) if (seed >> b) & 1] or [0]
                s = kv.filter_rows(s, rows)
            elif op == "extend":
                s = kv.extend(s, ragged(make, [n], seed))
        except kv.KVStateError:
            pass  # an op this record refuses (a ring trimmed past what it holds): s unchanged
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.safetensors")
        kv.save(path, [s], exact=True)
        (got,), meta = kv.load(path)
    assert meta == {}
    assert_same_record(s, got)


def test_round_trip_rotating(tmp_path):
    s = kv.rotating(2, max_size=8, keep=2)
    for i, n in enumerate([5, 1, 1, 4, 1, 1, 1]):
        s = kv.append(s, *rand_kv(i, 2, n))
    kv.save(tmp_path / "r.safetensors", [s, kv.rotating(1, max_size=4)])
    got, _ = kv.load(tmp_path / "r.safetensors")
    assert_same_record(s, got[0])
    assert_same_record(kv.rotating(1, max_size=4), got[1])


def test_loaded_states_continue_like_the_originals(tmp_path):
    model = tm.llama_model(seed=3)
    logits, states = br.prefill(model, [tm.prompt(1, 7), tm.prompt(2, 3)])
    kv.save(tmp_path / "p.safetensors", states)
    loaded, _ = kv.load(tmp_path / "p.safetensors", model=model)
    want = greedy(model, logits[:, None], 5, lambda t, box=[states]: _fw(model, t, box))
    got = greedy(model, logits[:, None], 5, lambda t, box=[loaded]: _fw(model, t, box))
    assert want[1] == got[1]
    np.testing.assert_array_equal(want[0], got[0])


def _fw(model, tokens, box):
    logits, box[0] = br.forward(model, tokens, box[0])
    return logits


# --- files written by mlx-lm ---------------------------------------------------------------


def _continue_both(model, path, logits, n=6, caches=None):
    """Decode on from ``path`` with mlx-lm's loaded caches (or ``caches``, the ones
    that were saved) and with kv.load; compare."""
    caches = lm_cache.load_prompt_cache(str(path)) if caches is None else caches
    want = greedy(model, logits, n, lambda t: model(t, cache=caches))
    states, _ = kv.load(path, model=model)
    box = [states]
    got = greedy(model, logits, n, lambda t: _fw(model, t, box))
    assert got[1] == want[1]
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)
    return states


@pytest.mark.parametrize(
    "quantized",
    [False, pytest.param(True, marks=needs_stock_quantized_read)],
    ids=["KVCache", "QuantizedKVCache"],
)
def test_mlx_lm_file_continues_identically(tmp_path, quantized):
    model = tm.llama_model(seed=4)
    caches = lm_cache.make_prompt_cache(model)
    if quantized:
        caches = [lm_cache.QuantizedKVCache(group_size=32, bits=8) for _ in caches]
    logits = model(mx.array([tm.prompt(5, 13)]), cache=caches)
    path = tmp_path / "lm.safetensors"
    lm_cache.save_prompt_cache(str(path), caches, {"who": "mlx-lm"})
    states = _continue_both(model, path, logits)
    assert type(states[0]) is (kv.QuantizedState if quantized else kv.CacheState)
    assert kv.load(path)[1] == {"who": "mlx-lm"}


def test_mlx_lm_batch_file_continues_identically(tmp_path):
    model = tm.qwen3_model(seed=6)
    rows, last = [], []
    for i, n in enumerate([9, 4, 6]):
        c = lm_cache.make_prompt_cache(model)
        last.append(model(mx.array([tm.prompt(20 + i, n)]), cache=c)[:, -1:])
        rows.append(c)
    batch = [lm_cache.BatchKVCache.merge([r[layer] for r in rows]) for layer in range(len(rows[0]))]
    logits = mx.concatenate(last, axis=0)
    logits = model(mx.argmax(logits[:, -1], axis=-1)[:, None], cache=batch)  # one batched step
    path = tmp_path / "batch.safetensors"
    lm_cache.save_prompt_cache(str(path), batch)
    states = _continue_both(model, path, logits)
    assert states[0].left_pad == (0, 5, 3) and states[0].lengths == (10, 5, 7)


def test_mlx_lm_rotating_file_continues_identically(tmp_path):
    model = tm.gemma3_model(seed=7, sliding_window=8)
    caches = lm_cache.make_prompt_cache(model)
    logits = model(mx.array([tm.prompt(8, 13)]), cache=caches)
    for _ in range(3):  # wrap the ring in place
        logits = model(mx.argmax(logits[:, -1], axis=-1)[:, None], cache=caches)
    path = tmp_path / "ring.safetensors"
    lm_cache.save_prompt_cache(str(path), caches)
    _continue_both(model, path, logits, n=10)


def test_mlx_lm_batch_rotating_file_continues_identically(tmp_path):
    model = tm.gemma3_model(seed=7, sliding_window=8)  # BatchRotatingKVCache + BatchKVCache
    rows, last = [], []
    for i, n in enumerate([11, 4, 6]):
        c = lm_cache.make_prompt_cache(model)
        last.append(model(mx.array([tm.prompt(30 + i, n)]), cache=c)[:, -1:])
        rows.append(c)
    batch = [type(rows[0][layer]).merge([r[layer] for r in rows]) for layer in range(len(rows[0]))]
    logits = mx.concatenate(last, axis=0)
    for _ in range(2):
        logits = model(mx.argmax(logits[:, -1], axis=-1)[:, None], cache=batch)
    path = tmp_path / "batch_ring.safetensors"
    lm_cache.save_prompt_cache(str(path), batch)
    # mlx-lm cannot continue its own loaded BatchRotatingKVCache (from_state leaves
    # _lengths unset: AttributeError), so the reference is the batch that was saved.
    states = _continue_both(model, path, logits, n=8, caches=batch)
    assert isinstance(states[0], kv.RotatingState)


# --- refusing a file made for another model --------------------------------------------------


def test_load_refuses_another_geometry(tmp_path):
    model = tm.llama_model(seed=1)  # 3 layers, 2 KV heads of 32
    _, states = br.prefill(model, [tm.prompt(1, 5)])
    kv.save(tmp_path / "a.safetensors", states)
    kv.load(tmp_path / "a.safetensors", model=tm.llama_model(seed=2))  # same geometry: fine
    with pytest.raises(kv.KVStateError, match=r"states: expected 2 records.*got 3"):
        kv.load(tmp_path / "a.safetensors", model=tm.llama_model(seed=1, layers=2))
    other = tm.gemma3_model(seed=2, layers=3)  # 1 KV head
    with pytest.raises(kv.KVStateError, match=r"states\[0\] geometry .* expected \(1, 32, 32"):
        kv.load(tmp_path / "a.safetensors", model=other)
    # mlx-lm's own files are checked the same way.
    caches = lm_cache.make_prompt_cache(model)
    model(mx.array([tm.prompt(1, 5)]), cache=caches)
    lm_cache.save_prompt_cache(str(tmp_path / "lm.safetensors"), caches)
    with pytest.raises(kv.KVStateError, match="geometry"):
        kv.load(tmp_path / "lm.safetensors", model=other)


def test_load_checks_sliding_layers_hold_rings_of_the_window(tmp_path):
    model = tm.gemma3_model(seed=2, layers=4, sliding_window=8)
    _, states = br.prefill(model, [tm.prompt(3, 11)])
    assert isinstance(states[0], kv.RotatingState) and states[0].max_size == 8
    kv.save(tmp_path / "g.safetensors", states)
    got, _ = kv.load(tmp_path / "g.safetensors", model=model)
    for a, b in zip(states, got):
        assert_same_record(a, b)
    wider = tm.gemma3_model(seed=2, layers=4, sliding_window=16)
    with pytest.raises(kv.KVStateError, match=r"states\[0\]: expected a ring of max_size=16"):
        kv.load(tmp_path / "g.safetensors", model=wider)
    dense_only = [
        kv.from_arrays(*kv.fetch(s)) if isinstance(s, kv.RotatingState) else s for s in states
    ]
    kv.save(tmp_path / "d.safetensors", dense_only)
    with pytest.raises(kv.KVStateError, match="sliding-window layer"):
        kv.load(tmp_path / "d.safetensors", model=model)


def test_load_refuses_wrong_dtype(tmp_path):
    model = tm.llama_model(seed=1)
    s = kv.from_arrays(*rand_kv(0, 1, 4, D=32, dtype=mx.float16))
    kv.save(tmp_path / "h.safetensors", [s] * 3)
    with pytest.raises(kv.KVStateError, match="float16"):
        kv.load(tmp_path / "h.safetensors", model=model)


def _model_dir(path, seed):
    path.mkdir()
    tm.llama_model(seed=seed).save_weights(str(path / "model.safetensors"))
    return path


def test_model_identity_recorded_and_checked(tmp_path):
    a, b = _model_dir(tmp_path / "a", 1), _model_dir(tmp_path / "b", 2)
    states = [ragged(dense, [3, 5])]
    kv.save(tmp_path / "s.safetensors", states, {"x": "y"}, model_path=a)
    got, meta = kv.load(tmp_path / "s.safetensors", model_path=a)
    assert meta == {"x": "y", "kvstate.model.digest": persist.model_digest(a)}
    assert_same_record(states[0], got[0])
    with pytest.raises(kv.KVStateError, match="a cache for another model"):
        kv.load(tmp_path / "s.safetensors", model_path=b)
    kv.save(tmp_path / "anon.safetensors", states)
    with pytest.raises(kv.KVStateError, match="no model identity"):
        kv.load(tmp_path / "anon.safetensors", model_path=a)


def test_loaded_metadata_saves_again_with_its_model_identity(tmp_path):
    # load returns the model digest with the user's pairs; handing that
    # metadata back to save (a resumed chat saved anew) keeps the identity.
    a, b = _model_dir(tmp_path / "a", 1), _model_dir(tmp_path / "b", 2)
    states = [ragged(dense, [3, 5])]
    kv.save(tmp_path / "s.safetensors", states, {"x": "y"}, model_path=a)
    got, meta = kv.load(tmp_path / "s.safetensors", model_path=a)
    kv.save(tmp_path / "again.safetensors", got, meta)
    again, meta2 = kv.load(tmp_path / "again.safetensors", model_path=a)
    assert meta2 == meta
    assert_same_record(states[0], again[0])
    kv.save(tmp_path / "same.safetensors", got, meta, model_path=a)  # agreeing: fine
    assert kv.load(tmp_path / "same.safetensors", model_path=a)[1] == meta
    with pytest.raises(kv.KVStateError, match="metadata.*digest of model_path"):
        kv.save(tmp_path / "other.safetensors", got, meta, model_path=b)  # conflicting
    assert not (tmp_path / "other.safetensors").exists()
    with pytest.raises(kv.KVStateError, match="a cache for another model"):
        kv.load(tmp_path / "again.safetensors", model_path=b)


def test_model_digest_is_memoized_on_file_stats(tmp_path, monkeypatch):
    root = tmp_path / "m"
    root.mkdir()
    for name, n in (
        ("model-00001-of-00002.safetensors", 1000),
        ("model-00002-of-00002.safetensors", 2000),
    ):
        (root / name).write_bytes(bytes(range(256)) * (n // 256) + b"x" * (n % 256))
    (root / "config.json").write_text("{}")  # not a weight file: not hashed
    calls = []
    real_hash = persist.hash_file
    monkeypatch.setattr(persist, "hash_file", lambda p: calls.append(p) or real_hash(p))

    first = persist.model_digest(root)
    assert len(calls) == 2
    assert persist.model_digest(root) == first and len(calls) == 2  # memo: no rehash
    assert persist.model_digest(str(root)) == first and len(calls) == 2

    shard = root / "model-00002-of-00002.safetensors"
    st_ = os.stat(shard)
    os.utime(shard, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # touch: rehash that file
    assert persist.model_digest(root) == first and len(calls) == 3
    assert calls[-1].endswith("00002.safetensors")

    data = bytearray(shard.read_bytes())  # same size, new content
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st_.st_atime_ns, st_.st_mtime_ns + 2 * 10**9))
    changed = persist.model_digest(root)
    assert changed != first and len(calls) == 4
    assert persist.model_digest(root) == changed and len(calls) == 4

    (root / "model-00001-of-00002.safetensors").unlink()  # a file gone: new identity
    assert persist.model_digest(root) != changed


# --- bad input ---------------------------------------------------------------------------


def test_bad_input_names_the_argument_and_writes_nothing(tmp_path):
    good = [kv.empty(1)]
    p = tmp_path / "x.safetensors"
    cases = [
        (lambda: kv.save(p, [good[0], "nope"]), r"states\[1\]: expected a kvstate record"),
        (lambda: kv.save(p, good, {"a": 1}), r"metadata\['a'\]: expected str keys and str values"),
        (lambda: kv.save(p, good, {"kvstate.x": "1"}), "reserved"),
        (lambda: kv.save(p, good, ["a"]), "metadata: expected a dict"),
        (
            lambda: kv.save(tmp_path / "x.npz", good),
            r"path: expected a name ending in \.safetensors",
        ),
        (lambda: kv.save(p, kv.empty(1)), "states: expected a list of records"),
        (
            lambda: kv.save(p, good, model_path=tmp_path / "none"),
            "model_path: expected an existing",
        ),
    ]
    for call, match in cases:
        with pytest.raises(kv.KVStateError, match=match):
            call()
        assert not p.exists()
    with pytest.raises(kv.KVStateError, match="path: expected an existing file"):
        kv.load(p)
    mx.save_safetensors(str(p), {"a": mx.zeros(2)}, {"foo": "bar"})
    with pytest.raises(kv.KVStateError, match="a kvstate or mlx-lm prompt-cache file"):
        kv.load(p)


def test_corrupt_record_table_is_refused(tmp_path):
    p = tmp_path / "c.safetensors"
    kv.save(p, [ragged(dense, [2, 3])], exact=True)
    arrays, meta = mx.load(str(p), return_metadata=True)
    entries = json.loads(meta["kvstate.records"])
    entries[0]["kind"] = "Bogus"
    mx.save_safetensors(str(p), arrays, {**meta, "kvstate.records": json.dumps(entries)})
    with pytest.raises(kv.KVStateError, match="record 0"):
        kv.load(p)
    del arrays["0.values"]
    entries[0]["kind"] = "CacheState"
    mx.save_safetensors(str(p), arrays, {**meta, "kvstate.records": json.dumps(entries)})
    with pytest.raises(kv.KVStateError, match="record 0: expected a tensor named .0.values."):
        kv.load(p)
