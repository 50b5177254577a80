"""Disaggregated serving: rank 0 prefills each request, rank 1 decodes them all.

Rank 0 prefills one request at a time (``kvstate.mlx_lm.admit``: a
``kv.Batch`` holding the row's records for every layer, its first sampled
token, PRNG key and id) and hands the row to rank 1 with
``kvstate.distributed.send_rows``. Rank 1 decodes one batch in flight: a new
request joins every ``--every`` steps (``recv_rows`` merges it into the
batch), each step feeds the pending tokens and samples the next
(``kvstate.mlx_lm.advance``), and a request leaves when it has
``--max-tokens`` tokens. With ``--check``, rank 1 also generates every
request alone in one process and says whether the tokens are the same::

    mlx.launch -n 2 --backend ring --python python3 examples/disaggregated.py --check
    mlx.launch -n 2 --backend ring --python python3 examples/disaggregated.py --check \\
        --temperature 0.8
    mlx.launch -n 2 --backend ring --python python3 examples/disaggregated.py --check \\
        --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt "Hello" --prompt "Why?"

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
        from kvstate.models import load_model

        # a llama-family .gguf or an mlx-lm model directory; float32 layers
        # (quantized matmuls are slow on a CPU)
        loaded = load_model(args.model, dequantize=True)
        model, tokenizer = loaded.model, loaded.tokenizer
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


def alone(model, prompt, n, sampling, seed) -> list:
    """The single-process reference: one request, ``n`` tokens."""
    batch = kl.admit(model, [prompt], sampling=sampling, seeds=[seed])
    out = batch.tokens.tolist()
    while len(out) < n:
        batch = kl.advance(model, batch)
        out += batch.tokens.tolist()
    return out


def prefill_rank(model, prompts, sampling, group):
    for i, prompt in enumerate(prompts):
        # prefill and the first sampled token; the row's PRNG key is seeded by its id
        batch = kl.admit(model, [prompt], sampling=sampling, seeds=[i], ids=[i])
        left = send_rows(batch, [0], 1, group=group)  # the row, its pending token, key, id
        assert left.batch_size == 0  # nothing stays on the prefill rank


def decode_rank(model, tokenizer, prompts, sampling, args, group):
    batch = kv.Batch(kl.make_states(model, 0), [])  # an empty batch in flight (B = 0)
    emitted = {}  # request id -> tokens so far
    step, waiting = 0, len(prompts)
    while waiting or batch.batch_size:
        if waiting and step % args.every == 0:
            batch, _ = recv_rows(batch, 0, group=group)  # joins at the end of the batch
            emitted[batch.ids[-1]] = [batch.tokens[-1].item()]  # sampled on rank 0
            waiting -= 1
        if batch.batch_size:
            batch = kl.advance(model, batch)  # feed the pending tokens, sample the next
            for i, t in zip(batch.ids, batch.tokens.tolist()):
                emitted[i].append(t)
            stay = [b for b, i in enumerate(batch.ids) if len(emitted[i]) < args.max_tokens]
            for i in batch.ids:
                if len(emitted[i]) >= args.max_tokens:
                    report(model, tokenizer, prompts, sampling, i, emitted[i], args)
            if len(stay) < batch.batch_size:
                batch = kv.filter_rows(batch, stay)
        step += 1


def report(model, tokenizer, prompts, sampling, i, tokens, args):
    out = {"id": i, "prompt_tokens": len(prompts[i]), "tokens": tokens}
    if tokenizer is not None:
        out["text"] = tokenizer.decode(tokens)
    if args.check:
        out["same_as_one_process"] = tokens == alone(model, prompts[i], len(tokens), sampling, i)
    print(json.dumps(out), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a llama-family .gguf file or an mlx-lm model directory")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--every", type=int, default=3, help="decode steps between new requests")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--check", action="store_true", help="compare with one-process runs")
    args = p.parse_args(argv)
    if args.prompt and not args.model:
        p.error("--prompt needs --model (the random model takes no text)")
    group = mx.distributed.init()
    if group.size() != 2:
        p.error(f"run under mlx.launch -n 2 (this group has {group.size()} rank)")
    model, tokenizer, prompts = load(args)
    sampling = kv.Sampling(temperature=args.temperature)
    if group.rank() == 0:
        prefill_rank(model, prompts, sampling, group)
    else:
        decode_rank(model, tokenizer, prompts, sampling, args, group)


if __name__ == "__main__":
    main()
