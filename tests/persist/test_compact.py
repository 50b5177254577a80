"""Compact files (``kvstate.persist.compact``): ``kv.save`` writes the tokens held and nothing
else, ``kv.load`` restores capacity in whole steps, and a saved ``kv.Batch`` resumes."""

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from mlx_lm.models import cache as lm_cache

import kvstate as kv
from kvstate import mlx_lm as br


def data_and_header(path):
    """``(data bytes, header bytes)`` of a safetensors file (8-byte length, JSON, data)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(path) - 8 - n, 8 + n


def held_bytes(states) -> int:
    """Bytes of the tokens the rows hold, from lengths (held for rings) and plane shapes."""
    total = 0
    for s in states:
        per_token = sum(p.shape[1] * p.shape[3] * p.itemsize for p in s.planes)
        total += per_token * sum(getattr(s, "held", s.lengths))
    return total


def ragged_states(model, make=None, lengths=(3, 11, 6), trim=(1, 0, 2)):
    prompts = [tm.prompt(70 + i, n) for i, n in enumerate(lengths)]
    _, states = br.prefill(model, prompts, **(make or {}))
    _, states = br.forward(model, mx.array([[1, 2, 3]] * len(lengths)), states)
    return kv.trim(states, list(trim)), prompts  # stale columns, left padding, spare capacity


@pytest.mark.parametrize(
    "name, make",
    [
        ("dense", {}),
        ("quantized", {"kv_bits": 8, "kv_group_size": 32}),
        ("rings", "gemma"),
    ],
)
def test_the_file_holds_the_tokens_held_plus_its_header(tmp_path, llama, gemma, name, make):
    model = gemma if make == "gemma" else llama
    states, _ = ragged_states(model, None if make == "gemma" else make)
    path = str(tmp_path / "c.safetensors")
    kv.save(path, states)
    data, header = data_and_header(path)
    assert data == held_bytes(states)  # not one byte of padding, stale or spare columns
    kv.save(str(tmp_path / "x.safetensors"), states, exact=True)
    exact, _ = data_and_header(str(tmp_path / "x.safetensors"))
    assert exact > 10 * data  # the control: the whole capacity is far larger
    print(f"{name}: {data} data bytes + {header} header bytes (exact: {exact})")


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_loaded_rows_continue_like_the_originals(tmp_path, llama, gemma, which):
    model = llama if which == "llama" else gemma
    states, _ = ragged_states(model)
    kv.save(tmp_path / "s.safetensors", states)
    loaded, _ = kv.load(tmp_path / "s.safetensors", model=model)
    for a, b in zip(states, loaded):
        assert type(a) is type(b) and a.lengths == b.lengths
        if type(b) is kv.CacheState:
            assert b.capacity % b.step == 0 and b.capacity >= b.width
    toks = mx.array([5, 6, 7])
    for _ in range(4):
        la, states = br.step(model, toks, states)
        lb, loaded = br.step(model, toks, loaded)
        np.testing.assert_allclose(np.array(la), np.array(lb), atol=1e-5, rtol=0)
        toks = mx.argmax(la, axis=-1)
        assert toks.tolist() == mx.argmax(lb, axis=-1).tolist()


def test_one_row_loads_with_capacity_in_whole_steps(tmp_path, llama):
    _, states = br.prefill(llama, [tm.prompt(3, 7)])
    kv.save(tmp_path / "one.safetensors", states)
    loaded, _ = kv.load(tmp_path / "one.safetensors")
    assert [s.capacity for s in loaded] == [256] * len(states)
    assert data_and_header(str(tmp_path / "one.safetensors"))[0] == held_bytes(states)


def run(model, batch, n):
    out = []
    for _ in range(n):
        batch = br.advance(model, batch)
        out.append(batch.tokens.tolist())
    return batch, out


def test_a_saved_batch_resumes_without_guesswork(tmp_path, llama):
    """Save mid-generation, load, continue: the same tokens as never stopping (sampled rows
    included: the keys travel), and the data of every row comes back."""
    sampling = [kv.Sampling(seed=1), kv.Sampling(0.9, top_p=0.9, seed=2), kv.Sampling(1.2, top_k=5)]
    batch = br.admit(
        llama,
        [tm.prompt(80, 4), tm.prompt(81, 9), tm.prompt(82, 6)],
        sampling=sampling,
        ids=["a", "b", 7],
        payload=[{"user": "ada"}, None, [1, 2]],
    )
    batch, _ = run(llama, batch, 3)
    kv.save(tmp_path / "session.safetensors", batch, {"turn": "1"})
    loaded, meta = kv.load(tmp_path / "session.safetensors", model=llama)
    assert meta == {"turn": "1"} and type(loaded) is kv.Batch
    assert loaded.ids == ("a", "b", 7) and loaded.payload == ({"user": "ada"}, None, [1, 2])
    assert loaded.sampling == tuple(sampling) and loaded.lengths == batch.lengths
    assert loaded.tokens.tolist() == batch.tokens.tolist()
    assert loaded.keys.tolist() == batch.keys.tolist()
    _, want = run(llama, batch, 5)
    _, got = run(llama, loaded, 5)
    assert got == want


def test_a_resumed_chat_takes_a_new_turn_like_one_long_prompt(tmp_path, llama):
    """Resume and feed the next turn: the pending token goes in first, then the turn;
    greedy tokens equal mlx-lm run on the whole conversation as one prompt."""
    prompt, turn = tm.prompt(90, 6), tm.prompt(91, 4)
    batch, said = run(llama, br.admit(llama, [prompt]), 3)
    first = br.admit(llama, [prompt]).tokens.tolist()
    kv.save(tmp_path / "chat.safetensors", batch)
    batch, _ = kv.load(tmp_path / "chat.safetensors")
    history = prompt + first + [t[0] for t in said]  # every token emitted so far
    batch = br.feed(llama, batch, [turn])
    _, more = run(llama, batch, 3)
    got = [batch.tokens.item()] + [t[0] for t in more]
    cache = lm_cache.make_prompt_cache(llama)
    logits = llama(mx.array([history + turn]), cache=cache)[:, -1]
    want = []
    for _ in range(4):
        want.append(int(mx.argmax(logits, axis=-1).item()))
        logits = llama(mx.array([[want[-1]]]), cache=cache)[:, -1]
    assert got == want


def test_empty_batches_save_and_load(tmp_path, llama):
    empty = br.admit(llama, [])
    kv.save(tmp_path / "e.safetensors", empty)
    loaded, _ = kv.load(tmp_path / "e.safetensors")
    assert loaded.batch_size == 0 and len(loaded.states) == len(empty.states)
    joined = kv.extend(loaded, br.admit(llama, [tm.prompt(1, 3)], ids=["x"]))
    assert joined.ids == ("x",)


def test_what_cannot_be_saved_is_refused_by_name_and_nothing_is_written(tmp_path, llama):
    batch = br.admit(llama, [tm.prompt(1, 3), tm.prompt(2, 3)], payload=[1, object()])
    path = tmp_path / "p.safetensors"
    with pytest.raises(kv.KVStateError, match=r"^payload\[1\]: expected a JSON value"):
        kv.save(path, batch)
    assert not path.exists()


def test_a_malformed_compact_table_is_refused(tmp_path, llama):
    batch = br.admit(
        llama, [tm.prompt(1, 3), tm.prompt(2, 5)], sampling=[kv.Sampling(), kv.Sampling(0.5)]
    )
    p = str(tmp_path / "m.safetensors")
    kv.save(p, batch)
    arrays, meta = mx.load(p, return_metadata=True)
    entries, host = json.loads(meta["kvstate.records"]), json.loads(meta["kvstate.batch"])
    cases = [
        ({"kvstate.records": json.dumps([[]] + entries[1:])}, "record 0: expected at least one"),
        ({"kvstate.layout": "columns"}, "kvstate.layout: expected 'rows' or absent"),
        ({"kvstate.batch": "[1]"}, "kvstate.batch: expected a JSON object"),
        ({"kvstate.batch": json.dumps({**host, "ids": [None]})}, "ids: expected 2 values"),
        (
            {"kvstate.batch": json.dumps({**host, "sampling": [{"kv.Sampling": 3}, None]})},
            "kvstate.records: expected a table that save wrote",
        ),
        (
            {"kvstate.batch": json.dumps({**host, "sampling": [None, None]})},
            r"sampling\[0\]: expected a kv.Sampling",
        ),
    ]
    for change, match in cases:
        mx.save_safetensors(p, arrays, {**meta, **change})
        with pytest.raises(kv.KVStateError, match=match):
            kv.load(p)
