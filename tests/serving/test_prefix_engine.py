"""``kvstate generate``'s prefix cache: the engine serves shared prefixes without
prefilling them again, gives the same tokens, and releases every lease."""

from __future__ import annotations

import mlx.core as mx
from tiny_models import VOCAB, llama_model

from kvstate import cli
from kvstate.serving.engine import KVStateEngine, Request, serve
from kvstate.serving.prefix_cache import PrefixCache


def requests(rng_seed=0):
    """A shared 'system prompt', requests after it, repeated prompts (samples), and a
    second turn whose history is an earlier request's prompt."""
    key = mx.random.key(rng_seed)
    system = mx.random.randint(0, VOCAB, (20,), key=key).tolist()
    users = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    prompts = [system + u for u in users]
    prompts += [prompts[0]] * 2  # two more samples of the first prompt
    prompts.append(prompts[1] + [40, 41, 42, 43, 44])  # a second turn of request 1
    return [
        Request(i, tuple(p), 4, temperature=0.8, seed=i, arrival=i // 2)
        for i, p in enumerate(prompts)
    ]


def test_engine_with_a_prefix_cache_gives_the_same_tokens_and_prefills_less():
    model = llama_model()
    reqs = requests()
    plain = KVStateEngine(model)
    shared = KVStateEngine(model, prefix_cache=PrefixCache(1 << 24))
    want, _ = serve(plain, reqs, 3)
    got, _ = serve(shared, reqs, 3)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    total = sum(len(r.prompt) for r in reqs)
    assert plain.prefilled == total
    # 23 for the first, 2 + 4 after the system prompt, 1 per repeat, 5 for the second turn.
    assert shared.prefilled == 23 + 2 + 4 + 1 + 1 + 5
    assert shared.cache.pinned == 0  # every row released its lease as it left
    assert 0 < shared.peak_bytes
    assert shared.peak_bytes < plain.peak_bytes + shared.cache.nbytes


def test_text_requests_samples_and_the_built_in_chats():
    class Tok:
        has_chat_template = True
        eos_ids = (0,)

        def chat(self, messages):
            return [len(m["content"]) for m in messages] + [1]

    args = cli._parser().parse_args(["generate", "--samples", "3"])
    reqs = cli.text_requests(args, Tok())
    n = len(cli.PROMPTS) + len(cli.CHATS)
    assert len(reqs) == 3 * n
    assert [r.prompt for r in reqs[:3]] == [reqs[0].prompt] * 3
    assert len({r.seed for r in reqs}) == len(reqs)
    # The built-in second turn repeats its first turn's messages.
    first, second = cli.CHATS[0], cli.CHATS[-1]
    assert second[: len(first)] == first and second[-1]["role"] == "user"
