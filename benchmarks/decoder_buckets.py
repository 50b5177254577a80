"""The compiled decoder's batch-size buckets: traces and first-run time over a serving
schedule (batch sizes 3, 4, 2, 1), and the steady-state cost of the padded rows.

Part 1 (traces): the schedule of ``examples/compiled_decode.py`` run by a fresh
decoder with the default buckets (powers of two), with ``(8, 16, 32, 64)`` and
without (``batch_buckets=None``); prints the traces, their reasons and the
wall time of the whole first run (``--skip-cost`` stops there).
Part 2 (padding cost): decode steps at batch size ``B`` with buckets (padded to
the bucket) and without, in paired, interleaved rounds (median and spread of
the per-round ratio; a shared machine: see notes/figures.md).

    python benchmarks/decoder_buckets.py [--model PATH] [--rounds 7] [--steps 20] [--B 5]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

import kvstate as kv
from kvstate import mlx_lm as bridge

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from compiled_decode import serve  # noqa: E402


def model_of(path):
    if path:
        from kvstate.models.load import load_model

        return load_model(path, dequantize=True).model
    from kvstate.models.load import tiny_llama

    return tiny_llama()


def steps(model, decoder, B, n):
    prompts = [mx.random.randint(1, 100, (6 + b,), key=mx.random.key(b)).tolist() for b in range(B)]
    batch = bridge.admit(model, prompts)
    batch = bridge.advance(model, batch, step=decoder)  # warm: trace and pad once
    mx.eval(batch.tokens)
    t0 = time.perf_counter()
    for _ in range(n):
        batch = bridge.advance(model, batch, step=decoder)
        batch.tokens.tolist()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--B", type=int, default=5)
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args()
    model = model_of(args.model)
    for buckets in ("pow2", (8, 16, 32, 64), None):
        decoder = kv.compiled_decoder(model, batch_buckets=buckets)
        t0 = time.perf_counter()
        serve(model, step=decoder)
        took = time.perf_counter() - t0
        print(f"buckets {buckets}: {decoder.traces} traces, first run {took:.2f} s")
        for reason in decoder.trace_reasons:
            print("   ", reason)
    if args.skip_cost:
        return
    padded, exact = kv.compiled_decoder(model), kv.compiled_decoder(model, batch_buckets=None)
    ratios = []
    for _ in range(args.rounds):
        a = steps(model, exact, args.B, args.steps)
        b = steps(model, padded, args.B, args.steps)
        ratios.append(b / a)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(
        f"B={args.B} padded to its bucket / unpadded, time per {args.steps} steps: median "
        f"{statistics.median(ratios):.2f} (quartiles {q[0]:.2f}..{q[2]:.2f}, "
        f"{args.rounds} paired rounds)"
    )


if __name__ == "__main__":
    main()
