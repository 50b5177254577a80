"""A batched speculative round at model level: every row verifies its own draft at once.

Each row drafts ``k`` tokens by prompt lookup (the tokens that followed the
last earlier occurrence of its newest token), the model scores the pending
token and the drafts in one forward, each row keeps the drafts the model
agrees with (greedy), and ``kv.rollback`` gives every row back exactly its own
accepted count, one checkpoint for every layer. The row's history rides in
``kv.Batch.payload``. The tokens equal plain greedy decoding on mlx-lm's own
caches, request by request.

    python examples/speculative.py [--model PATH]
"""

import sys

import attrs
import mlx.core as mx
from _model import load, mlx_lm_greedy

import kvstate as kv
from kvstate import mlx_lm as bridge


def draft(history, k):
    """Prompt lookup: the ``k`` tokens after the last earlier occurrence of the newest one."""
    for j in range(len(history) - 2, -1, -1):
        if history[j] == history[-1]:
            got = list(history[j + 1 : j + 1 + k])
            return got + [history[-1]] * (k - len(got))
    return [history[-1]] * k


def speculative_round(model, batch, k):
    """One round for every row: returns ``(batch, emitted)``, ``emitted[b]`` 1 to k+1 tokens."""
    pending = batch.tokens.tolist()
    drafts = mx.array([draft(h + (t,), k) for h, t in zip(batch.payload, pending)])
    cp = kv.checkpoint(batch)  # one ModelCheckpoint for every layer; holds no arrays
    fed = mx.concatenate([batch.tokens[:, None].astype(drafts.dtype), drafts], axis=1)
    logits, states = bridge.forward(model, fed, batch.states)  # [B, k+1, V]
    target = mx.argmax(logits, axis=-1)  # the model's token after each fed token
    accepted = mx.cumprod(drafts == target[:, :-1], axis=1).sum(axis=1)  # leading agreements
    nxt = mx.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
    # the cache keeps the pending token and the accepted drafts; nxt becomes pending
    batch = kv.rollback(attrs.evolve(batch, states=states), cp, keep=accepted + 1)
    n = accepted.tolist()
    emitted = [d[:a] + [t] for d, a, t in zip(drafts.tolist(), n, nxt.tolist())]
    history = [h + (p,) + tuple(e[:-1]) for h, p, e in zip(batch.payload, pending, emitted)]
    return attrs.evolve(batch, tokens=nxt, payload=history), emitted


def main(k=3, max_tokens=12):
    model, tokenizer, _ = load(__doc__.splitlines()[0])
    texts = ["Once upon a time", "one two three, one two three, one two", "The sea is"]
    prompts = [tokenizer.encode(t) for t in texts]  # the second repeats: lookup drafts hit
    batch = bridge.admit(model, prompts, ids=[0, 1, 2], payload=[tuple(p) for p in prompts])
    out = {i: [t] for i, t in zip(batch.ids, batch.tokens.tolist())}
    rounds = 0
    while batch.batch_size:
        batch, emitted = speculative_round(model, batch, k)
        rounds += 1
        for i, e in zip(batch.ids, emitted):
            out[i] += e
        batch = kv.filter_rows(
            batch, [b for b, i in enumerate(batch.ids) if len(out[i]) < max_tokens]
        )
    ok = True
    for i, p in enumerate(prompts):
        got, ref = out[i][:max_tokens], mlx_lm_greedy(model, p, max_tokens)
        ok &= got == ref
        same = "= mlx-lm greedy" if got == ref else f"!= mlx-lm {tokenizer.decode(ref)!r}"
        print(f"row {i}: {texts[i]!r} -> {tokenizer.decode(got)!r} {same}")
    print(f"{rounds} rounds of k={k} for {max_tokens} tokens per row")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
