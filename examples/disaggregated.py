"""Disaggregated serving: rank 0 prefills each request, rank 1 decodes them all.

Rank 0 prefills one request at a time and hands its row to rank 1 with
``kvstate.distributed.send_rows`` (the row's KV records for every layer,
plus a note with the request id and its first token). Rank 1 decodes one
batch: a new request joins every ``--every`` steps (``recv_rows`` merges it
into the batch), and a request leaves when it has ``--max-tokens`` tokens.
With ``--check``, rank 1 also generates every request alone in one process
and says whether the tokens are the same::

    mlx.launch -n 2 --backend ring examples/disaggregated.py --check
    mlx.launch -n 2 --backend ring examples/disaggregated.py \\
        --model mlx-community/SmolLM2-135M-Instruct --prompt "Hello" --prompt "Why?"

Without ``--model`` the model is a small llama with seeded random weights
(no download) and prompts are token ids. Across machines, give
``mlx.launch`` a hostfile (the README shows one).
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

import kvstate as kv
from kvstate import mlx_lm as kl
from kvstate.distributed import recv_rows, send_rows


def load(args):
    """``(model, tokenizer or None, prompts as token ids)``."""
    if args.model:
        from mlx_lm import load as lm_load

        model, tokenizer = lm_load(args.model)
        prompts = args.prompt or ["Tell me about the sea.", "What is 2 + 2?", "Name a color."]
        return model, tokenizer, [tokenizer.encode(p) for p in prompts]
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=128,
            num_hidden_layers=4,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-5,
            vocab_size=512,
            tie_word_embeddings=False,
        )
    )
    mx.eval(model.parameters())
    lengths = [7, 3, 12, 5]
    prompts = [
        mx.random.randint(1, 512, (n,), key=mx.random.key(i)).tolist()
        for i, n in enumerate(lengths)
    ]
    return model, None, prompts


def greedy(logits) -> list:
    return mx.argmax(logits, axis=-1).tolist()


def alone(model, prompt, n) -> list:
    """The single-process reference: one request, ``n`` tokens."""
    logits, states = kl.prefill(model, [prompt])
    out = greedy(logits)
    while len(out) < n:
        logits, states = kl.step(model, mx.array(out[-1:]), states)
        out += greedy(logits)
    return out


def prefill_rank(model, prompts, group):
    for i, prompt in enumerate(prompts):
        logits, states = kl.prefill(model, [prompt])
        left = send_rows(states, [0], 1, note={"id": i, "tokens": greedy(logits)}, group=group)
        assert left[0].batch_size == 0  # the row went: nothing stays on the prefill rank


def decode_rank(model, tokenizer, prompts, args, group):
    states = kl.make_states(model, 0)  # an empty batch (B = 0)
    ids, tokens = [], []  # per row: request id, tokens so far
    step, waiting = 0, len(prompts)
    while waiting or ids:
        if waiting and step % args.every == 0:
            states, note = recv_rows(states, 0, group=group)
            ids.append(note["id"])
            tokens.append(note["tokens"])
            waiting -= 1
        if ids:
            logits, states = kl.step(model, mx.array([t[-1] for t in tokens]), states)
            for t, nxt in zip(tokens, greedy(logits)):
                t.append(nxt)
            done = [b for b, t in enumerate(tokens) if len(t) >= args.max_tokens]
            if done:
                stay = [b for b in range(len(ids)) if b not in done]
                for b in done:
                    report(model, tokenizer, prompts, ids[b], tokens[b], args)
                states = kv.filter_rows(states, stay)
                ids, tokens = [ids[b] for b in stay], [tokens[b] for b in stay]
        step += 1


def report(model, tokenizer, prompts, i, tokens, args):
    out = {"id": i, "prompt_tokens": len(prompts[i]), "tokens": tokens}
    if tokenizer is not None:
        out["text"] = tokenizer.decode(tokens)
    if args.check:
        out["same_as_one_process"] = tokens == alone(model, prompts[i], len(tokens))
    print(json.dumps(out), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="an mlx-lm model (local folder or Hugging Face id)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--every", type=int, default=3, help="decode steps between new requests")
    p.add_argument("--check", action="store_true", help="compare with one-process runs")
    args = p.parse_args(argv)
    if args.prompt and not args.model:
        p.error("--prompt needs --model (the random model takes no text)")
    group = mx.distributed.init()
    if group.size() != 2:
        p.error(f"run under mlx.launch -n 2 (this group has {group.size()} rank)")
    model, tokenizer, prompts = load(args)
    if group.rank() == 0:
        prefill_rank(model, prompts, group)
    else:
        decode_rank(model, tokenizer, prompts, args, group)


if __name__ == "__main__":
    main()
