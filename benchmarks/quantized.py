"""Quantized rows: cache bytes per token, and decode-step time against dense rows.

(a) Bytes per token for one model geometry (Llama-3.2-1B's ``ModelArgs``:
    16 layers, 8 KV heads, head dim 64), measured from records built by
    appending bfloat16 tokens to every layer's record: ``CacheState`` in
    bfloat16, and ``QuantizedState`` at 8 and 4 bits (group 64, as mlx-lm's
    ``kv_group_size`` default). Beside each: mlx-lm's ``nbytes`` for the same
    tokens in ``KVCache`` / ``QuantizedKVCache``. The model's weights are
    never evaluated (MLX is lazy), only its layer list and config are used.

(b) Decode-step time through ``kvstate.mlx_lm.step`` (a smaller llama,
    float32, CPU): a ragged batch (B rows of different lengths around
    ``--length``, prefilled alone and merged) with dense rows, 8-bit and
    4-bit rows; and an aligned batch where mlx-lm's own ``KVCache`` /
    ``QuantizedKVCache`` can batch too, side by side (same cached K/V, same
    tokens, so their greedy tokens must agree). The cached K/V are random
    (a step's cost does not depend on their values; a real 512-token prefill
    of 8 rows takes minutes on this CPU); the decode steps run the real
    model. Variants alternate step by step in one process (the order
    rotates), each step timed to its evaluated tokens; medians are reported.

    (c) The same step at the attention level for the 1B geometry (append one
    token + attend, per layer, 16 layers, B rows, 32 query heads), dense
    versus quantized, so the cache's share is visible without the MLPs; and
    the quantized rows read by mlx-lm's ``quantized_scaled_dot_product_attention``
    instead of ``kv.attend`` (same planes, same mask), side by side.

    python -m benchmarks quantized [--only a|b|c]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention as lm_qsdpa
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import kvstate as kv
from benchmarks import _common as c
from kvstate import mlx_lm as br
from kvstate.kinds.rows import read_mask

GROUP = 64


# --- (a) bytes per token --------------------------------------------------------------


def bytes_per_token(tokens: int, chunk: int = 64):
    model = c.llama("llama-3.2-1b", "bfloat16", evaluate=False)  # weights never evaluated
    args = model.args
    H, D = args.num_key_value_heads, args.head_dim
    rows = []
    for name, bits in (("bfloat16", None), ("8-bit", 8), ("4-bit", 4)):
        states = br.make_states(model, 1, kv_bits=bits, kv_group_size=GROUP)
        caches = [
            KVCache() if bits is None else QuantizedKVCache(GROUP, bits) for _ in model.layers
        ]
        key = mx.random.key(0)
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            new = []
            for layer in range(len(states)):
                key, k1, k2 = mx.random.split(key, 3)
                k = mx.random.normal((1, H, n, D), key=k1).astype(mx.bfloat16)
                v = mx.random.normal((1, H, n, D), key=k2).astype(mx.bfloat16)
                new.append(kv.append(states[layer], k, v))
                caches[layer].update_and_fetch(k, v)
            states = new
            mx.eval([s.planes for s in states], [c.state for c in caches])
        assert all(s.lengths == (tokens,) for s in states)
        kv_bytes = sum(s.nbytes for s in states)
        lm_bytes = sum(c.nbytes for c in caches)
        cap = states[0].capacity
        rows.append(
            (
                name,
                kv_bytes / tokens,
                lm_bytes / tokens,
                cap,
                states[0].planes[0].dtype if bits else states[0].keys.dtype,
            )
        )
    print(
        f"(a) cache bytes per token, Llama-3.2-1B geometry ({args.num_hidden_layers} layers, "
        f"{H} KV heads, head dim {D}), {tokens} tokens appended in chunks of {chunk}, "
        f"bfloat16 inputs, group {GROUP}"
    )
    print(
        f"    {'rows':<9} {'kvstate B/token':>16} {'mlx-lm B/token':>15} {'vs bf16':>8}"
        f"  (capacity {rows[0][3]} columns per record)"
    )
    for name, kb, lb, _, _ in rows:
        print(f"    {name:<9} {kb:16.1f} {lb:15.1f} {kb / rows[0][1]:8.3f}")
    return rows


# --- (b) decode step through the bridge -------------------------------------------------


def random_rows(model, lengths, seed=0):
    """Per layer, per row: random ``(k, v)`` in the model's dtype, ``[1, H, n, D]`` standing for a
    prefilled prompt (a step's cost does not depend on the cached values, and a
    real 512-token prefill of 8 rows takes minutes on this CPU)."""
    a = model.args
    H, D = a.num_key_value_heads, a.head_dim
    dtype = model.layers[0].self_attn.q_proj.weight.dtype
    key = mx.random.key(seed)
    out = []
    for _ in model.layers:
        layer = []
        for n in lengths:
            key, k1, k2 = mx.random.split(key, 3)
            layer.append(
                (
                    mx.random.normal((1, H, n, D), key=k1).astype(dtype),
                    mx.random.normal((1, H, n, D), key=k2).astype(dtype),
                )
            )
        out.append(layer)
    mx.eval(out)
    return out


class KvSide:
    """kvstate records through ``kvstate.mlx_lm.step``; rows prefilled alone, merged."""

    def __init__(self, model, rows, bits, first):
        self.model, self.tok = model, first
        states = []
        for layer in rows:
            solo = []
            for k, v in layer:
                s = kv.empty(1) if bits is None else kv.quantized(1, group_size=GROUP, bits=bits)
                solo.append(kv.append(s, k, v))
            states.append(kv.merge_rows(solo))
        self.states = states
        mx.eval([s.planes for s in self.states])

    def step(self):
        logits, self.states = br.step(self.model, self.tok, self.states)
        self.tok = mx.argmax(logits, axis=-1)
        mx.eval(self.tok)


class LmSide:
    """mlx-lm's own caches over an aligned batch (it cannot batch ragged quantized rows)."""

    def __init__(self, model, rows, bits, first):
        self.model, self.tok = model, first
        self.cache = []
        for layer in rows:
            c = KVCache() if bits is None else QuantizedKVCache(GROUP, bits)
            c.update_and_fetch(
                mx.concatenate([k for k, _ in layer]), mx.concatenate([v for _, v in layer])
            )
            self.cache.append(c)
        mx.eval([c.state for c in self.cache])

    def step(self):
        self.tok = mx.argmax(self.model(self.tok[:, None], cache=self.cache)[:, -1], axis=-1)
        mx.eval(self.tok)


class FloorSide:
    """The model forward for one token per row with no cache: the floor under a step."""

    def __init__(self, model, first):
        self.model, self.tok = model, first

    def step(self):
        self.tok = mx.argmax(self.model(self.tok[:, None])[:, -1], axis=-1)
        mx.eval(self.tok)


def race(sides: dict, steps: int, warmup: int = 2):
    """Median seconds of each side's ``step`` (variants interleaved, the order turning)."""
    t = c.rounds({n: side.step for n, side in sides.items()}, steps, warmup=warmup)
    return {n: c.median(v) for n, v in t.items()}


def decode_step(args):
    shape = c.shaped(args.hidden, args.layers, args.kv_heads, args.vocab)
    model = c.llama("llama-3.2-1b" if args.model == "1b" else shape, args.dtype)
    B = args.batch
    lengths = c.ragged(B, args.length, args.spread)
    a = model.args
    geo = (
        f"llama {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
        f"{a.num_attention_heads} q heads, {a.num_key_value_heads} KV heads, head dim "
        f"{a.head_dim}, vocab {a.vocab_size}, {args.dtype}, {mx.default_device()}"
    )

    first = mx.random.randint(1, args.vocab, (B,), key=mx.random.key(99))
    rows = random_rows(model, lengths)
    ragged = {
        "kvstate dense": KvSide(model, rows, None, first),
        "kvstate 8-bit": KvSide(model, rows, 8, first),
        "kvstate 4-bit": KvSide(model, rows, 4, first),
        "model, no cache": FloorSide(model, first),
    }
    t = race(ragged, args.steps)
    print(f"(b) decode step through kvstate.mlx_lm.step, {geo}")
    print(
        f"    ragged B={B}, cached lengths {lengths[0]}..{lengths[-1]} (random K/V), "
        f"median of {args.steps} steps (variants interleaved)"
    )
    base = t["kvstate dense"]
    for n, v in t.items():
        print(f"    {n:<22} {v * 1e3:8.3f} ms/step   {v / base:6.3f}x dense")
    del ragged, rows

    rows = random_rows(model, [args.length] * B, seed=1)
    aligned = {
        "kvstate dense": KvSide(model, rows, None, first),
        "mlx-lm KVCache": LmSide(model, rows, None, first),
        "kvstate 8-bit": KvSide(model, rows, 8, first),
        "mlx-lm Quantized 8": LmSide(model, rows, 8, first),
        "kvstate 4-bit": KvSide(model, rows, 4, first),
        "mlx-lm Quantized 4": LmSide(model, rows, 4, first),
    }
    del rows
    toks = {n: [] for n in aligned}

    class Rec:
        def __init__(self, name, side):
            self.name, self.side = name, side

        def step(self):
            self.side.step()
            toks[self.name].append(self.side.tok.tolist())

    t = race({n: Rec(n, s) for n, s in aligned.items()}, args.steps)
    print(
        f"    aligned B={B}, {args.length} cached tokens per row (random K/V; mlx-lm's "
        f"caches hold the same), median of {args.steps} steps (variants interleaved)"
    )
    for kvn, lmn in (
        ("kvstate dense", "mlx-lm KVCache"),
        ("kvstate 8-bit", "mlx-lm Quantized 8"),
        ("kvstate 4-bit", "mlx-lm Quantized 4"),
    ):
        same = toks[kvn] == toks[lmn]
        print(
            f"    {kvn:<14} {t[kvn] * 1e3:8.3f} ms/step   {lmn:<19} {t[lmn] * 1e3:8.3f} ms/step"
            f"   mlx-lm/kvstate {t[lmn] / t[kvn]:6.3f}   tokens equal: {same}"
        )
    base = t["kvstate dense"]
    print(
        f"    quantized vs dense (kvstate): 8-bit {t['kvstate 8-bit'] / base:.3f}x, "
        f"4-bit {t['kvstate 4-bit'] / base:.3f}x"
    )


# --- (c) attention level, 1B geometry ------------------------------------------------


def attention_step(args):
    a = c.LLAMA_1B
    L, H = a["num_hidden_layers"], a["num_key_value_heads"]
    Hq, D = a["num_attention_heads"], a["head_dim"]
    B = args.batch
    lengths = c.ragged(B, args.length, args.spread)
    key = mx.random.key(1)
    dt = getattr(mx, args.dtype)

    def rows(bits):
        out = []
        for layer in range(L):
            per_row = []
            for n in lengths:
                s = kv.empty(1) if bits is None else kv.quantized(1, group_size=GROUP, bits=bits)
                k1, k2 = mx.random.split(mx.random.key(layer * 1000 + n))
                per_row.append(
                    kv.append(
                        s,
                        mx.random.normal((1, H, n, D), key=k1).astype(dt),
                        mx.random.normal((1, H, n, D), key=k2).astype(dt),
                    )
                )
            out.append(kv.merge_rows(per_row))
        mx.eval([s.planes for s in out])
        return out

    class Side:
        def __init__(self, bits, lm_sdpa=False):
            self.bits, self.lm_sdpa = bits, lm_sdpa
            self.states = rows(bits)
            k1, k2, k3 = mx.random.split(key, 3)
            self.k = mx.random.normal((B, H, 1, D), key=k1).astype(dt)
            self.v = mx.random.normal((B, H, 1, D), key=k2).astype(dt)
            self.q = mx.random.normal((B, Hq, 1, D), key=k3).astype(dt)

        def step(self):
            memo, outs, new = kv.MaskMemo(), [], []
            for s in self.states:
                s = kv.append(s, self.k, self.v)
                if self.lm_sdpa:  # mlx-lm's function on the same planes and mask
                    keys, values = kv.fetch(s)
                    mask, held = read_mask(s, 1, memo)
                    outs.append(
                        lm_qsdpa(
                            self.q * 1,
                            keys,
                            values,
                            scale=D**-0.5,
                            mask=mask,
                            group_size=GROUP,
                            bits=self.bits,
                        )
                    )
                    if held is not None:
                        held.release()
                else:
                    outs.append(kv.attend(s, self.q, scale=D**-0.5, memo=memo))
                new.append(s)
            self.states = new
            mx.eval(outs, [s.planes for s in new])

    sides = {
        "dense": Side(None),
        "8-bit": Side(8),
        "4-bit": Side(4),
        "8-bit, mlx-lm SDPA": Side(8, True),
        "4-bit, mlx-lm SDPA": Side(4, True),
    }
    t = race(sides, args.steps)
    print(
        f"(c) attention only, Llama-3.2-1B geometry: {L} layers x (append 1 token + attend), "
        f"B={B} ragged rows {lengths[0]}..{lengths[-1]}, {Hq} q / {H} KV heads, head dim {D}, "
        f"{args.dtype}, {mx.default_device()}, median of {args.steps}"
    )
    for n, v in t.items():
        print(f"    {n:<19} {v * 1e3:8.3f} ms/step   {v / t['dense']:6.3f}x dense")
    for b in ("8-bit", "4-bit"):
        print(
            f"    {b} kv.attend vs mlx-lm's quantized SDPA on the same planes: "
            f"mlx-lm / kvstate {t[b + ', mlx-lm SDPA'] / t[b]:.3f}"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024, help="(a) tokens appended per record")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512, help="(b, c) mean prompt length")
    p.add_argument("--spread", type=int, default=96, help="(b, c) lengths length +- spread")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--only", choices=["a", "b", "c"], default=None)
    p.add_argument(
        "--model",
        choices=["small", "1b"],
        default="small",
        help="(b) the small llama (--layers/--hidden/...) or the Llama-3.2-1B shape",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="(b, c)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = p.parse_args(argv)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    print(c.machine())
    if args.only in (None, "a"):
        bytes_per_token(args.tokens)
    if args.only in (None, "b"):
        decode_step(args)
    if args.only in (None, "c"):
        attention_step(args)


if __name__ == "__main__":
    main()
