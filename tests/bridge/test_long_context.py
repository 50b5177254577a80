"""The long-context harness (``python -m benchmarks long-context``) on a tiny llama: its
perplexity through chunked caches, the needle prompts and their scoring, the verdict."""

import math

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import long_context as lc
from kvstate.models.load import tiny_llama


class Chars:
    """A character tokenizer (one id per ASCII character, no chat template)."""

    bos_id = None

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128)


def test_an_answer_scores_when_its_first_number_is_the_key():
    assert lc.scored(" 71432.", 71432)
    assert lc.scored("71432 is the key", 71432)
    assert not lc.scored(" 7143", 71432)
    assert not lc.scored("It is 12345, not 71432", 71432)
    assert not lc.scored("no number", 71432)
    assert lc.answer_key("") is None


def test_needle_prompts_hold_the_key_at_its_depth():
    tok = Chars()
    filler = tok.encode("abcdefghij" * 20)
    keys = lc.pass_keys(np.random.default_rng(0), 3)
    assert len(set(keys)) == 3 and all(10000 <= k < 100000 for k in keys)
    prompts = lc.needle_prompts(tok, filler, 100, [0.0, 0.5, 1.0], keys)
    assert len(prompts) == 9 and len({len(p.ids) for p in prompts}) == 1
    head, tail = lc.chat_frame(tok)
    for p in prompts:
        needle = lc.NEEDLE.format(key=p.key)
        assert tok.decode(p.ids[p.at : p.at + len(needle)]) == needle
        assert p.at == len(head) + round(p.depth * 100)
        assert p.ids[: len(head)] == head and p.ids[-len(tail) :] == tail
        assert tok.decode(tail).endswith(lc.ANSWER)


def one_pass_ppl(model, ids):
    logits = model(mx.array([ids[:-1]])).astype(mx.float32)[0]
    lse = mx.logsumexp(logits, axis=-1)
    nll = lse - mx.take_along_axis(logits, mx.array(ids[1:])[:, None], axis=-1)[:, 0]
    return math.exp(nll.mean().item())


def test_chunked_perplexity_through_caches(model):
    """Full KV in chunks equals one pass without a cache; a ring that holds everything
    equals it too; a small ring (it evicts) does not."""
    ids = np.random.default_rng(1).integers(1, 128, 49).tolist()
    want = one_pass_ppl(model, ids)
    full = lc.perplexity(model, lc.Side("full", "records"), ids, 8)
    assert len(full["nll"]) == 48
    assert full["ppl"] == pytest.approx(want, rel=1e-4)
    big = lc.perplexity(model, lc.Side("ring", "ring", 64), ids, 8)
    assert big["ppl"] == pytest.approx(want, rel=1e-4)
    small = lc.perplexity(model, lc.Side("ring", "ring", 8), ids, 8)
    assert abs(small["ppl"] - want) > 1e-3 * want
    assert small["bytes"] < full["bytes"]


def test_sinks_fed_as_decode_is_the_ring_of_one_more(model):
    """At chunk 1 the ``sinks`` policy keeps what mlx-lm's ring keeps (4 sinks, the newest
    rest); a step's query also sees its own column, so budget n is the ring of n + 1."""
    ids = np.random.default_rng(1).integers(1, 128, 41).tolist()
    side = lc.sides_for(12, [1], ["sinks"], extra=dict(kv_window=4), compressed=True)[-1]
    sinks = lc.perplexity(model, side, ids, 1)["ppl"]
    ring = lc.perplexity(model, lc.Side("ring", "ring", 13, chunk=1), ids, 8)["ppl"]
    assert sinks == pytest.approx(ring, rel=1e-5)


@pytest.mark.parametrize("policy", lc.POLICIES)
def test_chunked_perplexity_through_compressed_records(model, policy):
    """A budget that holds everything is full KV; a small one evicts."""
    ids = np.random.default_rng(1).integers(1, 128, 65).tolist()
    want = lc.perplexity(model, lc.Side("full", "records"), ids, 32)["ppl"]
    for budget, same in ((64, True), (24, False)):
        side = lc.sides_for(budget, [1], [policy], compressed=True)[-1]
        assert side.make == dict(kv_budget=budget, policy=policy)
        got = lc.perplexity(model, side, ids, 32)["ppl"]
        assert (got == pytest.approx(want, rel=1e-4)) is same


def test_greedy_answers_of_a_batch_are_each_rows(model):
    prompts = np.random.default_rng(2).integers(1, 128, (2, 40)).tolist()
    for side in (lc.Side("full", "records"), lc.Side("ring", "ring", 16)):
        both, _ = lc.greedy_answers(model, side, prompts, 8, 4)
        alone = [lc.greedy_answers(model, side, [p], 8, 4)[0][0] for p in prompts]
        assert both == alone


def test_sides_name_every_budget():
    sides = lc.sides_for(1024, [2, 4], ["sinks", "h2o"], compressed=True)
    assert [s.name for s in sides] == [
        "full", "ring 1/2", "sinks 1/2", "h2o 1/2", "ring 1/4", "sinks 1/4", "h2o 1/4"
    ]  # fmt: skip
    assert sides[5].make == dict(kv_budget=256, policy="sinks")
    assert [s.name for s in lc.sides_for(64, [4], ["sinks"], compressed=False)] == [
        "full",
        "ring 1/4",
    ]


def test_the_verdict_reads_the_rows():
    def needle(side, hits):
        return [dict(section="needle", side=side, hit=h) for h in hits]

    rows = needle("full", [1, 1, 1, 1]) + needle("ring 1/4", [1, 0, 0, 0])
    rows += needle("snapkv 1/4", [1, 1, 1, 1]) + needle("sinks 1/4", [1, 1, 0, 0])
    rows += [dict(section="decode", side="snapkv 1/4", x_full=dict(median=1.05))]
    lines = lc.verdict(rows, ["snapkv", "sinks", "h2o"])
    assert "retrieval 1.00 (met" in lines[1] and "x1.050" in lines[1]
    assert "(met)" in lines[1]
    assert "retrieval 0.50 (NOT met" in lines[2] and "decode not measured (NOT met)" in lines[2]
    assert lines[3] == "  h2o 1/4: not measured"
