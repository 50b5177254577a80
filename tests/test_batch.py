"""``kv.Batch``: per-row data follows its row through every row operation; ``admit`` and
``advance`` decode a continuous batch with per-row sampling that equals each request run
alone on mlx-lm's own caches."""

import attrs
import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.models.cache import make_prompt_cache

import kvstate as kv
from kvstate import mlx_lm as br

H, D = 1, 4


# --- a continuous batch with per-row sampling equals each request alone ---------------


REQUESTS = [  # (prompt length, tokens to generate, arrival step, sampling)
    (5, 6, 0, kv.Sampling(seed=100)),
    (3, 4, 0, kv.Sampling(0.9, top_p=0.9, seed=101)),
    (7, 5, 2, kv.Sampling(1.3, top_k=8, seed=102)),
    (4, 3, 3, kv.Sampling(0.7, min_p=0.05, seed=103)),
    (6, 4, 9, kv.Sampling(seed=104)),  # arrives after every other row has left
]


def alone(model, prompt, n, sampling, seed):
    """The request alone on mlx-lm's caches, sampled with kv.sample on its own key."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    keys, out = kv.row_keys([seed]), []
    for _ in range(n):
        params = {k: getattr(sampling, k) for k in ("temperature", "top_p", "top_k", "min_p")}
        tok, keys = kv.sample(logits, keys, **params)
        out.append(tok.item())
        logits = model(tok[:, None], cache=cache)[:, -1]
    return out


def continuous(model, prompts, step=None):
    batch, out = kv.Batch(br.make_states(model, 0), []), {}
    for t in range(16):
        batch = br.advance(model, batch, step=step)  # B may be 0
        new = [i for i, r in enumerate(REQUESTS) if r[2] == t]
        if new:
            batch = kv.extend(
                batch,
                br.admit(
                    model,
                    [prompts[i] for i in new],
                    ids=new,
                    sampling=[REQUESTS[i][3] for i in new],
                ),
            )
        for i, tok in zip(batch.ids, batch.tokens.tolist()):
            out.setdefault(i, []).append(tok)
        batch = kv.filter_rows(
            batch, [b for b, i in enumerate(batch.ids) if len(out[i]) < REQUESTS[i][1]]
        )
    return out, batch


def test_continuous_batching_with_per_row_sampling_equals_each_request_alone(llama):
    prompts = [tm.prompt(60 + i, r[0]) for i, r in enumerate(REQUESTS)]
    got, batch = continuous(llama, prompts)
    assert batch.batch_size == 0
    for i, r in enumerate(REQUESTS):
        assert got[i] == alone(llama, prompts[i], r[1], r[3], 100 + i), f"request {i}"


def test_advance_takes_the_compiled_decoder(llama):
    prompts = [tm.prompt(60 + i, r[0]) for i, r in enumerate(REQUESTS)]
    eager, _ = continuous(llama, prompts)
    compiled, _ = continuous(llama, prompts, step=kv.compiled_decoder(llama))
    assert compiled == eager


# --- per-row data follows its row (a model of the rows: a dict by id) -------------------


def row_data(ids):
    """Per-row data derived from each row's id, so that any misalignment shows."""
    return {
        "tokens": mx.array([i % 1000 for i in ids], mx.uint32),
        "keys": kv.row_keys(ids),
        "sampling": [kv.Sampling(temperature=(i % 7) / 10, top_k=i % 5) for i in ids],
        "ids": list(ids),
        "payload": [{"id": i} for i in ids],
    }


def rows_of(ids, lengths):
    """A dense record whose row for id ``i`` holds ``lengths[i]`` tokens, each equal to i."""
    s = kv.empty(0)
    for i in ids:
        n = lengths[i]
        one = kv.empty(1)
        if n:
            k = mx.full((1, H, n, D), float(i))
            one = kv.append(one, k, k)
        s = kv.extend(s, one)
    return s


class BatchRows(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.next_id, self.lengths, self.order = 0, {}, []
        self.batch = kv.Batch([kv.empty(0), kv.empty(0)], **row_data([]))

    @rule(n=st.integers(1, 3), length=st.integers(0, 4))
    def join(self, n, length):
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        for i in ids:
            self.lengths[i] = length + i % 3
        s = rows_of(ids, self.lengths)
        self.batch = kv.extend(self.batch, kv.Batch([s, s], **row_data(ids)))
        self.order += ids

    @rule(data=st.data())
    def leave(self, data):
        rows = data.draw(
            st.lists(st.sampled_from(range(len(self.order))), unique=True)
            if self.order
            else st.just([])
        )
        note(f"filter_rows {rows}")
        self.batch = kv.filter_rows(self.batch, rows)
        self.order = [self.order[r] for r in rows]

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def extract(self, data):
        r = data.draw(st.integers(0, len(self.order) - 1))
        one = kv.extract_row(self.batch, r)
        self.check(one, [self.order[r]])

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def speculate(self, data):
        """Append a draft to every row, then keep a per-row count: data stays put."""
        B = len(self.order)
        cp = kv.checkpoint(self.batch)
        draft = mx.broadcast_to(mx.array(self.order, mx.float32)[:, None, None, None], (B, H, 3, D))
        appended = attrs.evolve(
            self.batch, states=kv.append(self.batch.states, [draft] * 2, [draft] * 2)
        )
        keep = data.draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
        self.batch = kv.rollback(appended, cp, keep)
        for i, k in zip(self.order, keep):
            self.lengths[i] += k

    @invariant()
    def rows_follow(self):
        self.check(self.batch, self.order)

    def check(self, batch, order):
        assert batch.batch_size == len(order)
        want = row_data(order)
        assert batch.tokens.tolist() == want["tokens"].tolist()
        assert batch.keys.tolist() == want["keys"].tolist()
        assert list(batch.sampling) == want["sampling"]
        assert list(batch.ids) == order and list(batch.payload) == want["payload"]
        for s in batch.states:
            assert s.lengths == tuple(self.lengths[i] for i in order)
            if not s.planes:  # no row has held a token yet
                assert not any(s.lengths)
                continue
            keys, _ = kv.fetch(s)
            for b, i in enumerate(order):
                held = np.array(keys[b, 0, s.left_pad[b] : s.ends[b], 0])
                assert (held == i).all()


TestBatchRows = BatchRows.TestCase
TestBatchRows.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


def test_fork_copies_per_row_data_and_gives_the_copies_their_own_keys(llama):
    batch = br.admit(
        llama,
        [tm.prompt(1, 4), tm.prompt(2, 6)],
        ids=["a", "b"],
        sampling=[kv.Sampling(seed=7), kv.Sampling(1.0, seed=8)],
        payload=[1, 2],
    )
    forked = kv.fork(batch, 1, 3)
    assert forked.ids == ("a", "b", "b", "b", "b") and forked.payload == (1, 2, 2, 2, 2)
    assert forked.sampling == batch.sampling + (batch.sampling[1],) * 3
    assert forked.tokens.tolist() == batch.tokens.tolist() + [batch.tokens[1].item()] * 3
    keys = [tuple(k) for k in forked.keys.tolist()]
    assert keys[:2] == [tuple(k) for k in batch.keys.tolist()]  # the source keeps its key
    assert len(set(keys)) == 5
    step = br.advance(llama, forked)
    # every copy is the same row with its own key: the greedy row repeats its token, the
    # sampled copies compute the same logits but draw differently
    assert next(s.lengths for s in step.states) == (5, 7, 7, 7, 7)
    a = br.advance(llama, kv.fork(batch, 0, 2))
    assert len(set(a.tokens.tolist()[2:] + [a.tokens[0].item()])) == 1
    assert len(set(br.advance(llama, kv.fork(batch, 1, 15)).tokens.tolist()[1:])) > 1


def test_empty_batches_admit_advance_and_extend(llama):
    empty = br.admit(llama, [])
    assert empty.batch_size == 0 and empty.tokens.shape == (0,)
    assert br.advance(llama, empty).batch_size == 0
    one = br.admit(llama, [tm.prompt(3, 5)], ids=["x"])
    assert kv.extend(empty, one).ids == ("x",) and kv.extend(one, empty).ids == ("x",)
    assert kv.filter_rows(one, []).ids == ()


def test_bad_batches_are_refused_by_name(llama):
    s = br.make_states(llama, 2)
    with pytest.raises(kv.KVStateError, match=r"^tokens: expected an integer mx.array \[2\]"):
        kv.Batch(s, [1, 2, 3])
    with pytest.raises(kv.KVStateError, match=r"^tokens: "):
        kv.Batch(s, mx.array([0.5, 1.0]))
    with pytest.raises(kv.KVStateError, match=r"^keys: expected an mx.array \[2, 2\] uint32"):
        kv.Batch(s, [1, 2], keys=kv.row_keys([1]))
    with pytest.raises(kv.KVStateError, match=r"^sampling: expected 2 values"):
        kv.Batch(s, [1, 2], sampling=[kv.Sampling()])
    with pytest.raises(kv.KVStateError, match=r"^sampling\[1\]: expected a kv.Sampling"):
        kv.Batch(s, [1, 2], sampling=[kv.Sampling(), 0.7])
    with pytest.raises(kv.KVStateError, match=r"^ids: expected 2 values"):
        kv.Batch(s, [1, 2], ids=["a"])
    with pytest.raises(kv.KVStateError, match=r"^states\[1\] batch size: expected 2"):
        kv.Batch([s[0], kv.empty(3)], [1, 2])
    with pytest.raises(kv.KVStateError, match=r"^states\[0\]: expected a kvstate record"):
        kv.Batch([s], [1, 2])
    with pytest.raises(kv.KVStateError, match="^batch: expected a kv.Batch"):
        br.advance(llama, s)
    with pytest.raises(kv.KVStateError, match="^temperature: "):
        kv.Sampling(temperature=-1)


@pytest.mark.parametrize("turns", [[[9, 4], [3, 8]], [[9, 4, 2], []]])
def test_feed_appends_the_pending_token_then_the_turn(llama, turns):
    """``feed`` equals prefilling prompt + pending + turn from scratch (greedy)."""
    prompts = [tm.prompt(30, 5), tm.prompt(31, 8)]
    batch = br.admit(llama, prompts)
    fed = br.feed(llama, batch, turns)
    whole = [p + [t] + turn for p, t, turn in zip(prompts, batch.tokens.tolist(), turns)]
    logits, _ = br.prefill(llama, whole)
    assert fed.tokens.tolist() == mx.argmax(logits, axis=-1).tolist()
    assert fed.lengths == tuple(len(w) for w in whole)
    with pytest.raises(kv.KVStateError, match="^tokens: expected 2 lists of token ids"):
        br.feed(llama, batch, [[1]])


# --- collect: tokens into completions, finished rows out --------------------------------


def test_collect_adds_tokens_drops_finished_rows_and_leaves_its_inputs(llama):
    batch = kv.Batch(br.make_states(llama, 3), [7, 2, 5], ids=["a", "b", "c"])
    out = {"a": (1,), "c": (4, 4)}
    rows, new = br.collect(batch, out, stop=[2], max_tokens=3)
    assert new == {"a": (1, 7), "b": (), "c": (4, 4, 5)}  # a stop token is not added
    assert rows.ids == ("a",)  # b stopped, c reached max_tokens
    assert out == {"a": (1,), "c": (4, 4)} and batch.ids == ("a", "b", "c")  # unchanged
    same, _ = br.collect(batch, {}, stop=())  # no row finished: the batch itself
    assert same is batch


def test_collect_runs_a_text_loop_to_mlx_lms_greedy_tokens(llama):
    prompts, n = [tm.prompt(1, 5), tm.prompt(2, 3), tm.prompt(3, 7)], 4
    batch, out = br.admit(llama, prompts, ids=[0, 1, 2]), {}
    while True:
        batch, out = br.collect(batch, out, max_tokens=n)
        if not batch.batch_size:
            break
        batch = br.advance(llama, batch)
    for i, p in enumerate(prompts):
        cache, want = make_prompt_cache(llama), []
        logits = llama(mx.array([p]), cache=cache)[:, -1]
        for _ in range(n):
            want.append(int(mx.argmax(logits, axis=-1).item()))
            logits = llama(mx.array([[want[-1]]]), cache=cache)[:, -1]
        assert list(out[i]) == want


def test_collect_refuses_bad_input_by_name(llama):
    batch = kv.Batch(br.make_states(llama, 2), [1, 2], ids=["x", "x"])
    with pytest.raises(kv.KVStateError, match="^batch.ids: expected one distinct id per row"):
        br.collect(batch, {})
    with pytest.raises(kv.KVStateError, match="^max_tokens: expected at least 1"):
        br.collect(kv.Batch(br.make_states(llama, 1), [1]), {}, max_tokens=0)
    with pytest.raises(kv.KVStateError, match="^batch: expected a kv.Batch"):
        br.collect(br.make_states(llama, 1), {})
