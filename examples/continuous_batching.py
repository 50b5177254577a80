"""Continuous batching, text in and text out, on kvstate and on mlx-lm's BatchGenerator.

First the loop of mlx-lm's ``batch_generate``: prompts wait for a free row (at
most ``max_batch`` decode at once), every row stops at an end-of-sequence token
or ``max_tokens``, and the completions come back as text. kvstate's loop is
``admit`` (prefill, first tokens), ``advance`` (one decode step of every row),
``kv.extend`` (rows join) and ``collect`` (tokens added to the completions,
finished rows leave). Greedy, so both must give the same text.

Then requests that arrive at different steps, each with its own temperature,
top-p and seed: their per-row data (pending token, sampling, key, id) follows
them inside ``kv.Batch``. mlx-lm's ``BatchGenerator`` has per-request samplers
and one global random state, so only the greedy requests must agree.

    python examples/continuous_batching.py [--model PATH | --model default]
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


# --- the loops (tests/test_examples.py counts their lines) ---------------------------------


def kvstate_text(model, tokenizer, prompts, max_tokens, max_batch):
    waiting, batch, out = list(enumerate(prompts)), kv.Batch(bridge.make_states(model, 0), []), {}
    while waiting or batch.batch_size:
        free = max_batch - batch.batch_size
        new, waiting = waiting[:free], waiting[free:]
        joining = bridge.admit(model, [p for _, p in new], ids=[i for i, _ in new])
        batch = kv.extend(bridge.advance(model, batch), joining)
        batch, out = bridge.collect(batch, out, stop=tokenizer.eos_ids, max_tokens=max_tokens)
    return [tokenizer.decode(out[i]) for i in range(len(prompts))]


def mlx_lm_text(model, tokenizer, prompts, max_tokens, max_batch):
    stop = [[t] for t in tokenizer.eos_ids]
    gen = BatchGenerator(
        model, max_tokens=max_tokens, stop_tokens=stop, completion_batch_size=max_batch
    )
    uids = gen.insert(prompts)
    out = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                out[r.uid].append(r.token)
    gen.close()
    return [tokenizer.decode(out[uid]) for uid in uids]


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

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What is the largest planet?",
    "Name a famous painting in the Louvre.",
]


def encode(tokenizer, question):
    """The prompt's ids: the chat template's user turn where the tokenizer has one."""
    if tokenizer.has_chat_template:
        return tokenizer.chat([{"role": "user", "content": question}])
    return tokenizer.encode(question)


def main():
    model, tokenizer, _ = load(__doc__.splitlines()[0])
    prompts = [encode(tokenizer, q) for q in QUESTIONS]
    ours = kvstate_text(model, tokenizer, prompts, max_tokens=24, max_batch=4)
    theirs = mlx_lm_text(model, tokenizer, prompts, max_tokens=24, max_batch=4)
    texts_ok = ours == theirs
    for q, a, b in zip(QUESTIONS, ours, theirs):
        print(f"{q}\n  kvstate: {a!r}" + ("" if a == b else f"\n  mlx-lm:  {b!r}  DIFFERENT"))
    print("text:", "identical to mlx-lm's" if texts_ok else "DIFFERS from mlx-lm's", "\n")

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
        text, ref = tokenizer.decode(ours[r.id]), tokenizer.decode(theirs[r.id])
        print(
            f"request {r.id} ({kind}): kvstate {text!r}  mlx-lm {ref!r}"
            + ("" if r.temperature else ("  same" if same else "  DIFFERENT"))
        )
        assert len(ours[r.id]) == r.max_tokens
    print("greedy requests:", "identical to mlx-lm" if greedy_ok else "DIFFER from mlx-lm")
    return 0 if greedy_ok and texts_ok else 1


if __name__ == "__main__":
    sys.exit(main())
