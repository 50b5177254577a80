"""A chat session saved mid-conversation and resumed, with no guesswork.

The session is a ``kv.Batch`` of one row: its cache, the pending token (the
last sampled token, not in the cache yet), its sampling parameters and PRNG
key, and a payload. ``kv.save`` writes only the tokens held (compare the file
with mlx-lm's ``save_prompt_cache`` of the same conversation); ``kv.load``
gives back the same batch. The next turn is fed after the pending token
(``kvstate.mlx_lm.feed``). The greedy tokens equal mlx-lm run on the whole
conversation as one prompt; a sampled session continues exactly as if it had
never stopped.

    python examples/session.py [--model PATH]
"""

import os
import sys
import tempfile

import mlx.core as mx
from _model import load, mlx_lm_greedy
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

import kvstate as kv
from kvstate import mlx_lm as bridge


def reply(model, batch, n):
    """``n`` tokens: the pending one, then ``n - 1`` more (each sampled after the last)."""
    out = [batch.tokens.item()]
    for _ in range(n - 1):
        batch = bridge.advance(model, batch)
        out.append(batch.tokens.item())
    return batch, out


def main():
    model, tokenizer, _ = load(__doc__.splitlines()[0])
    turn1 = tokenizer.encode("Tell me about the sea.")
    turn2 = tokenizer.encode(" And the sky?")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chat.safetensors")
        for sampling in (kv.Sampling(), kv.Sampling(temperature=0.8, top_p=0.9, seed=42)):
            session = bridge.admit(model, [turn1], sampling=sampling, payload=[{"user": "ada"}])
            session, said = reply(model, session, 6)
            kv.save(path, session, {"title": "demo"})
            size = os.path.getsize(path)
            resumed, meta = kv.load(path, model=model)
            # the next turn: the pending token (the reply's last) goes in first
            answer = reply(model, bridge.feed(model, resumed, [turn2]), 5)[1]
            straight = reply(model, bridge.feed(model, session, [turn2]), 5)[1]
            ok &= answer == straight  # resuming changed nothing
            if sampling.temperature == 0:
                conversation = turn1 + said + turn2
                want = mlx_lm_greedy(model, conversation, 5)
                ok &= answer == want
                # mlx-lm's file of the same tokens (the cache holds all but the pending one)
                cache = make_prompt_cache(model)
                model(mx.array([turn1 + said[:-1]]), cache=cache)
                save_prompt_cache(path, cache)
                print(
                    f"greedy: {tokenizer.decode(answer)!r} "
                    f"{'= mlx-lm' if answer == want else '!= mlx-lm'}; "
                    f"file {size} bytes, mlx-lm's save_prompt_cache of the same tokens "
                    f"{os.path.getsize(path)} bytes"
                )
            else:
                print(
                    f"T=0.8: {tokenizer.decode(answer)!r} "
                    f"(without the save/load: {tokenizer.decode(straight)!r}); meta {meta}"
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
