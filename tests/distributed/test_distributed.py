"""Tensor parallelism and row migration over ``mx.distributed`` (ring, loopback).

The two-process tests start two real ranks (``tests/_launch.py``) and
compare what they generate with the same scenario run in this process,
unsharded and unmoved.
"""

from __future__ import annotations

import json
from pathlib import Path

import _dist_worker as w
import pytest
from _launch import launch, run_ranks
from tiny_models import llama_model


def test_tensor_parallel_matches_one_process():
    ranks = run_ranks("tp")
    ref = w.tp_scenario(llama_model(**w.CONFIGS["dense+ring"][0]))
    assert ref["heads"] == [2, 2]
    assert ref["kinds"] == ["RotatingState", "CacheState"]
    for r in ranks:
        assert r["tokens"] == ref["tokens"], (r["rank"], r["tokens"], ref["tokens"])
        assert r["heads"] == [1, 1]  # each rank holds its half of the KV heads
        assert r["kinds"] == ref["kinds"]


@pytest.mark.parametrize("transport", ["p2p", "collective"])
def test_prefill_on_rank0_decode_on_rank1(transport):
    ranks = run_ranks("migrate", transport)
    steps = w.BEFORE + w.AFTER
    for config in w.CONFIGS:  # dense + ring, quantized + ring
        r0, r1 = (r[config] for r in ranks)
        for name, got in {**r0["tokens"], **r1["tokens"]}.items():
            assert got == w.generate_alone(config, name, steps), (config, name)
        assert sorted(r0["tokens"]) == ["b"] and sorted(r1["tokens"]) == ["a", "c", "d"]
        # Rows arrive bit for bit (bytes, lengths, padding, ring position), in the order sent.
        assert r1["received"] == r0["sent"]
        assert [len(rows) for rows in r0["rows"]] == [1, 1]
        assert [len(rows) for rows in r1["rows"]] == [3, 3]
    for r in ranks:  # the second migration reuses the first one's waiter thread
        assert r[sorted(w.CONFIGS)[1]]["new_threads"] == 0, r


def test_batch_in_flight_moves_with_its_rows():
    """A kv.Batch's rows keep sampling on the decode rank with their own PRNG
    keys and parameters: each request's sampled tokens equal a one-process run."""
    r0, r1 = run_ranks("batch")
    steps = w.BEFORE + w.AFTER
    got = {**r0["tokens"], **r1["tokens"]}  # b stayed on rank 0, d on rank 1
    for name in "ca":  # prefilled and sampled on rank 0, then on rank 1
        got[name] = r0["sent_tokens"][name] + got[name]
    for name in "abcd":
        assert got[name] == w.sample_alone(name, steps), name
    assert r0["ids"] == ["b"] and r1["ids"] == ["d", "c", "a"]
    assert r1["payload"] == [{"user": n} for n in "dca"]
    for got in r1["sampling"]:
        assert (got["temperature"], got["top_p"], got["top_k"], got["min_p"]) == (0.8, 1.0, 20, 0)


def test_bad_input_raises_on_both_ends():
    r0, r1 = run_ranks("errors")
    # Mismatched geometry (dense rows for a quantized batch): both ends raise.
    assert "layers[0] kind" in r0["geometry"]["error"]
    assert "QuantizedState" in r0["geometry"]["error"]
    assert r1["geometry"]["error"] == r0["geometry"]["error"].replace(
        "rows for rank 1: expected rows that fit its batch",
        "rows from rank 0: expected rows that fit this batch",
    )
    # Rows out of range / a note that is not JSON: the sender raises, the receiver is told.
    for case, arg in (("rows", "rows[0]"), ("note", "note")):
        assert r0[case]["error"].startswith(arg), r0[case]
        assert "an abort: " + r0[case]["error"] in r1[case]["error"]
    # Layer records offered to a receiver holding a kv.Batch: both ends raise.
    assert (
        "rows: expected a kv.Batch's rows (the receiver's), got layer records"
        in (r0["container"]["error"])
    )
    assert r1["container"]["error"].endswith(r0["container"]["error"].split(": ", 2)[-1])
    # The link is still good: the next migration goes through.
    assert r0["good"] == [[5], [5]] and r1["good"] == [[5, 3, 3]] * 2
    # dst names no rank: the sender raises at once; the receiver times out.
    assert r0["dst"]["error"].startswith("dst: expected another rank")
    assert r0["dst"]["seconds"] < 0.5
    assert "an answer within timeout=1.0 s" in r1["dst"]["error"]
    assert 0.9 < r1["dst"]["seconds"] < 10


@pytest.mark.slow
def test_example_prefill_on_one_rank_decode_on_another():
    """``examples/disaggregated.py`` under the real launcher (ring, loopback)."""
    example = Path(__file__).parents[2] / "examples" / "disaggregated.py"
    out = launch(
        str(example), "--check", "--max-tokens", "5", "--every", "2", "--temperature", "0.8"
    )
    done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(d["id"] for d in done) == [0, 1, 2, 3]
    assert all(len(d["tokens"]) == 5 and d["same_as_one_process"] for d in done), done
