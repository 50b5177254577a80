"""A quantized batch through the bridge equals each row run alone through
mlx-lm with its own QuantizedKVCache per layer (same process, same weights,
float32). mlx-lm itself cannot batch these rows (mlx-lm #1583).

The rows have different prompt lengths, decode greedily as one batch, and
go through a speculative round: a 3-token draft appended to every row at its
own end, then a per-row rollback to the accepted tokens (mlx-lm: ``trim`` on
the solo caches). Logits at every position, greedy tokens, and finally every
layer's stored planes (byte-exact) must equal the solo runs.
"""

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from _quant import assert_same_bytes, needs_stock_quantized_read, np_of, row_planes
from mlx_lm.models.cache import QuantizedKVCache

import kvstate as kv
from kvstate import mlx_lm as br

pytestmark = needs_stock_quantized_read  # (mlx-lm's QuantizedKVCache runs the reference)

ATOL = 1e-4
GS = 32  # the tiny models' head dim is 32
PROMPTS = [7, 2, 12]  # prompt lengths of the rows
DRAFT = 3


def close(got, want, what):
    np.testing.assert_allclose(np_of(got), np_of(want), atol=ATOL, rtol=0, err_msg=what)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("build", [tm.llama_model, tm.qwen3_model], ids=["llama", "qwen3"])
def test_quantized_batch_rows_equal_each_row_alone(build, bits):
    model = build()
    prompts = [tm.prompt(40 + i, n) for i, n in enumerate(PROMPTS)]
    B = len(prompts)
    solo = [[QuantizedKVCache(group_size=GS, bits=bits) for _ in model.layers] for _ in prompts]

    logits, states = br.prefill(model, prompts, kv_bits=bits, kv_group_size=GS)
    assert all(isinstance(s, kv.QuantizedState) and s.bits == bits for s in states)
    want = [model(mx.array([p]), cache=c)[:, -1] for p, c in zip(prompts, solo)]
    for b in range(B):
        close(logits[b : b + 1], want[b], f"prefill row {b}")

    def decode(logits, states, steps):
        for t in range(steps):
            toks = mx.argmax(logits, axis=-1)
            logits, states = br.step(model, toks, states)
            for b in range(B):
                want = model(toks[b : b + 1, None], cache=solo[b])[:, -1]
                assert int(mx.argmax(want, axis=-1).item()) == int(
                    mx.argmax(logits[b], axis=-1).item()
                ), f"step {t} row {b}: token"
                close(logits[b : b + 1], want, f"step {t} row {b}")
        return logits, states

    logits, states = decode(logits, states, 3)

    # Speculative round: every row appends the same-length draft at its own
    # end, then keeps a different number of it.
    draft = mx.array([tm.prompt(90 + b, DRAFT) for b in range(B)])
    cps = [kv.checkpoint(s) for s in states]
    dlogits, drafted = br.forward(model, draft, states)
    keep = [0, 2, 3]
    for b in range(B):
        want = model(draft[b : b + 1], cache=solo[b])
        close(dlogits[b : b + 1], want, f"draft row {b}")
        for c in solo[b]:
            assert c.trim(DRAFT - keep[b]) == DRAFT - keep[b]
    states = [kv.rollback(s, cp, keep) for s, cp in zip(drafted, cps)]
    # The next token of each row: greedy after its last accepted position.
    nxt = mx.array(
        [int(mx.argmax(dlogits[b, keep[b] - 1] if keep[b] else logits[b]).item()) for b in range(B)]
    )
    logits, states = br.step(model, nxt, states)
    for b in range(B):
        close(
            logits[b : b + 1],
            model(nxt[b : b + 1, None], cache=solo[b])[:, -1],
            f"after rollback row {b}",
        )

    logits, states = decode(logits, states, 3)

    # What every layer stores for each row: the solo cache's bytes, exactly.
    for layer, s in enumerate(states):
        for b in range(B):
            c = solo[b][layer]
            k, v = c.keys_and_values()
            assert s.lengths[b] == c.offset
            assert_same_bytes(
                row_planes(s, b), [np_of(x[0]) for x in (*k, *v)], f"layer {layer} row {b}"
            )
