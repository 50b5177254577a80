"""Continuous batching with per-row sampling, on kvstate and on mlx-lm's BatchGenerator.

Requests arrive at different steps, each with its own temperature, top-p and
seed; rows join with ``kv.extend`` and leave with ``kv.filter_rows``, and their
per-row data (pending token, sampling, key, id) follows them inside ``kv.Batch``.
The same schedule runs through mlx-lm's ``BatchGenerator`` (per-request
samplers, one global random state). Greedy requests must give the same tokens
on both; sampled ones draw from each engine's own random numbers.

    python examples/continuous_batching.py [--model PATH]
"""

import sys
from typing import NamedTuple

import mlx.core as mx
from _model import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

import kvstate as kv
from kvstate import mlx_lm as bridge


class Request(NamedTuple):
    id: int
    arrival: int  # the decode step it arrives at
    prompt: list
    max_tokens: int
    temperature: float
    top_p: float
    seed: int


# --- the two loops (tests/test_examples.py counts their lines) ---------------------------


def kvstate_loop(model, requests):
    batch, out, t = kv.Batch(bridge.make_states(model, 0), []), {}, 0
    while len(out) < len(requests) or batch.batch_size:
        new = [r for r in requests if r.arrival == t]
        sampling = [kv.Sampling(r.temperature, r.top_p, seed=r.seed) for r in new]
        joining = bridge.admit(model, [r.prompt for r in new], sampling=sampling, ids=new)
        batch = kv.extend(bridge.advance(model, batch), joining)
        for r, token in zip(batch.ids, batch.tokens.tolist()):
            out.setdefault(r.id, []).append(token)
        keep = [b for b, r in enumerate(batch.ids) if len(out[r.id]) < r.max_tokens]
        batch = kv.filter_rows(batch, keep)
        t += 1
    return out


def mlx_lm_loop(model, requests):
    gen, out, uid_to_id, done, t = BatchGenerator(model), {}, {}, set(), 0
    while len(done) < len(requests):
        new = [r for r in requests if r.arrival == t]
        samplers = [make_sampler(r.temperature, r.top_p) for r in new]
        uids = gen.insert([r.prompt for r in new], [r.max_tokens for r in new], samplers=samplers)
        uid_to_id.update(zip(uids, [r.id for r in new]))
        for response in gen.next_generated():
            out.setdefault(uid_to_id[response.uid], []).append(response.token)
            if response.finish_reason is not None:
                done.add(uid_to_id[response.uid])
        t += 1
    return out


# --- run both ----------------------------------------------------------------------------


def main():
    model, _ = load(__doc__.splitlines()[0])
    vocab = model.model.embed_tokens.weight.shape[0] if hasattr(model, "model") else 256
    requests = []
    for i, (arrival, n, m, temp, top_p) in enumerate(
        [
            (0, 12, 8, 0.0, 1.0),
            (0, 5, 5, 0.8, 0.9),
            (2, 9, 6, 0.0, 1.0),
            (3, 7, 4, 1.0, 0.95),
            (6, 4, 7, 0.0, 1.0),
            (14, 6, 3, 0.0, 1.0),  # after the batch empties
        ]
    ):
        prompt = mx.random.randint(1, vocab, (n,), key=mx.random.key(i)).tolist()
        requests.append(Request(i, arrival, prompt, m, temp, top_p, seed=100 + i))
    ours, theirs = kvstate_loop(model, requests), mlx_lm_loop(model, requests)
    greedy_ok = True
    for r in requests:
        kind = "greedy " if r.temperature == 0 else f"T={r.temperature}"
        same = ours[r.id] == theirs[r.id]
        greedy_ok &= same or r.temperature > 0
        print(
            f"request {r.id} ({kind}): kvstate {ours[r.id]}  mlx-lm {theirs[r.id]}"
            + ("" if r.temperature else ("  same" if same else "  DIFFERENT"))
        )
        assert len(ours[r.id]) == r.max_tokens
    print("greedy requests:", "identical to mlx-lm" if greedy_ok else "DIFFER from mlx-lm")
    return 0 if greedy_ok else 1


if __name__ == "__main__":
    sys.exit(main())
