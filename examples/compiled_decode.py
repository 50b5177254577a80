"""The compiled decoder in a serving schedule: rows join and leave, the batch size
passes through 3, 4, 2 and 1, and the decoder traces once, not once per batch size.

``kv.compiled_decoder(model)`` pads the rows up to a batch-size bucket (the next
power of two by default; here ``batch_buckets=(8, 16, 32, 64)``, one bucket for
every batch up to 8; ``None`` turns padding off), so every batch size of a
bucket reuses one trace; ``decoder.trace_reasons`` says why each trace
happened. The tokens equal the eager bridge's, row for row.

    python examples/compiled_decode.py [--model PATH]
"""

import sys

import mlx.core as mx
from _model import load

import kvstate as kv
from kvstate import mlx_lm as bridge

SCHEDULE = [  # (step, prompts joining, rows leaving (by id))
    (0, {"a": 5, "b": 7, "c": 4}, []),
    (3, {"d": 6}, []),
    (6, {}, ["a", "c"]),
    (9, {}, ["b"]),
]


def serve(model, step=None, steps=12):
    batch, out = kv.Batch(bridge.make_states(model, 0), []), {}
    for t in range(steps):
        for at, joining, leaving in SCHEDULE:
            if at == t:
                keep = [b for b, i in enumerate(batch.ids) if i not in leaving]
                batch = kv.filter_rows(batch, keep)
                prompts = [
                    mx.random.randint(1, 100, (n,), key=mx.random.key(n)).tolist()
                    for n in joining.values()
                ]
                batch = kv.extend(batch, bridge.admit(model, prompts, ids=list(joining)))
        batch = bridge.advance(model, batch, step=step)
        for i, token in zip(batch.ids, batch.tokens.tolist()):
            out.setdefault(i, []).append(token)
    return out


def main():
    model, _, _ = load(__doc__.splitlines()[0])
    eager = serve(model)
    decoder = kv.compiled_decoder(model, batch_buckets=(8, 16, 32, 64))
    compiled = serve(model, step=decoder)
    print("batch sizes 3, 4, 2, 1 with buckets (8, 16, 32, 64):", decoder.traces, "trace(s)")
    for reason in decoder.trace_reasons:
        print("  traced:", reason)
    pow2 = kv.compiled_decoder(model)
    same_pow2 = serve(model, step=pow2) == eager
    print("with the default buckets (powers of two):", pow2.traces, "traces")
    for reason in pow2.trace_reasons:
        print("  traced:", reason)
    unbucketed = kv.compiled_decoder(model, batch_buckets=None)
    serve(model, step=unbucketed)
    print("without buckets:", unbucketed.traces, "traces")
    for reason in unbucketed.trace_reasons:
        print("  traced:", reason)
    same = compiled == eager and same_pow2
    print("tokens:", "identical to the eager bridge" if same else "DIFFERENT from eager")
    return 0 if same and decoder.traces < unbucketed.traces else 1


if __name__ == "__main__":
    sys.exit(main())
