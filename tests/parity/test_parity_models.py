"""Token-exact parity: batched rows through ``kvstate.mlx_lm.forward`` versus
each prompt run alone through mlx-lm with its own caches (same process,
same weights, float32).

Scenario (continuous batching): rows are prefilled alone and merged, decoded
as one batch, filtered out when they finish, and new rows join with
``extend`` while others are mid-generation. Every row's logits at every step
and its greedy tokens must equal its solo run.
"""

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from _quant import needs_stock_quantized_read
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

import kvstate as kv
from kvstate import mlx_lm as br

ATOL = 1e-4

# (prompt length, tokens to generate, step at which the request arrives)
REQUESTS = [(5, 6, 0), (11, 3, 0), (2, 8, 0), (7, 5, 2), (3, 4, 4), (9, 3, 4)]


def solo(model, prompt, n_new, make_cache):
    """Greedy ``n_new`` tokens for ``prompt`` alone in mlx-lm: (logits [n_new, V], tokens)."""
    cache = make_cache()
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out, toks = [], []
    for _ in range(n_new):
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(logits[0])
        toks.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[:, -1]
    return mx.stack(out), toks


def batched(model, prompts, requests, make):
    """Continuous batching through kvstate: returns per request (logits, tokens)."""
    got = {i: ([], []) for i in range(len(requests))}
    active, states, logits, t = [], None, None, 0
    while t <= max(r[2] for r in requests) or active:
        joining = [i for i, r in enumerate(requests) if r[2] == t]
        if joining:
            lg, new = br.prefill(model, [prompts[i] for i in joining], **make)
            if states is None:
                states, logits = new, lg
            else:
                states = br.extend(states, new)
                logits = mx.concatenate([logits, lg], axis=0)
            active += joining
        if active:
            toks = mx.argmax(logits, axis=-1)
            for row, i in enumerate(active):
                got[i][0].append(logits[row])
                got[i][1].append(int(toks[row].item()))
            keep = [row for row, i in enumerate(active) if len(got[i][1]) < requests[i][1]]
            if not keep:
                active, states, logits = [], None, None
            else:
                if len(keep) < len(active):
                    states = br.filter_rows(states, keep)
                    toks = toks[mx.array(keep)]
                    active = [active[row] for row in keep]
                logits, states = br.step(model, toks, states)
        t += 1
    return {i: (mx.stack(g[0]), g[1]) for i, g in got.items()}


def check_parity(model, make_cache, make, requests=REQUESTS, seed=10):
    prompts = [tm.prompt(seed + i, r[0]) for i, r in enumerate(requests)]
    result = batched(model, prompts, requests, make)
    for i, (p, r) in enumerate(zip(prompts, requests)):
        ref_logits, ref_toks = solo(model, p, r[1], make_cache)
        logits, toks = result[i]
        assert toks == ref_toks, f"request {i}: tokens differ"
        np.testing.assert_allclose(
            np.array(logits),
            np.array(ref_logits),
            atol=ATOL,
            rtol=0,
            err_msg=f"request {i}: logits differ",
        )


def full_caches(model):
    return lambda: [KVCache() for _ in model.layers]


@pytest.mark.parametrize("build", [tm.llama_model, tm.qwen3_model], ids=["llama", "qwen3"])
def test_continuous_batching_dense(build):
    model = build()
    check_parity(model, full_caches(model), {})


@needs_stock_quantized_read
def test_continuous_batching_quantized_llama():
    model = tm.llama_model()

    def make_cache():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]

    check_parity(model, make_cache, {"kv_bits": 8, "kv_group_size": 32})


def test_rows_decode_past_a_capacity_step():
    # Rows cross the 256-column capacity boundary at different steps.
    model = tm.llama_model(layers=2)
    requests = [(250, 10, 0), (240, 4, 0), (120, 8, 3)]
    check_parity(model, full_caches(model), {}, requests=requests)


def test_continuous_batching_gemma3_sliding():
    model = tm.gemma3_model(sliding_window=8)  # prompts longer than the window rotate
    check_parity(model, model.make_cache, {})


def test_continuous_batching_llama_sliding_layers():
    model = tm.llama_model(layers=4, sliding_window=6)
    check_parity(model, model.make_cache, {})


def test_continuous_batching_qwen3_max_kv_size():
    model = tm.qwen3_model()  # no make_cache: max_kv_size gives rings with keep=4

    def make_cache():
        return make_prompt_cache(model, max_kv_size=10)

    check_parity(model, make_cache, {"max_kv_size": 10})


def solo_logits(model, make_cache, *blocks):
    """Each block of tokens fed in turn to ``prompt``'s own mlx-lm caches; the last logits."""
    cache = make_cache()
    for block in blocks:
        out = model(mx.array([block]), cache=cache)
    return out[0]


@pytest.mark.parametrize("build", [tm.llama_model, tm.gemma3_model], ids=["llama", "gemma3"])
def test_speculative_block_then_per_row_rollback(build):
    """Ragged rows verify a 3-token draft as one block, keep 3, 1 and 0 of it
    (``kv.rollback`` per row), then decode on: each row equals the prompt run
    alone on only the tokens it kept."""
    model = build()
    make_cache = (
        model.make_cache
        if hasattr(model, "make_cache")
        else lambda: [KVCache() for _ in model.layers]
    )
    prompts = [tm.prompt(70 + i, n) for i, n in enumerate((5, 12, 3))]
    drafts = [tm.prompt(80 + i, 3) for i in range(3)]
    kept = [3, 1, 0]
    _, states = br.prefill(model, prompts)
    cps = [kv.checkpoint(s) for s in states]
    logits, states = br.forward(model, mx.array(drafts), states)
    for i, (p, d) in enumerate(zip(prompts, drafts)):
        np.testing.assert_allclose(
            np.array(logits[i]),
            np.array(solo_logits(model, make_cache, p, d)),
            atol=ATOL,
            rtol=0,
            err_msg=f"row {i} block",
        )
    states = [kv.rollback(s, cp, kept) for s, cp in zip(states, cps)]
    nxt = [7, 8, 9]
    logits, states = br.step(model, mx.array(nxt), states)
    for i, (p, d, k) in enumerate(zip(prompts, drafts, kept)):
        blocks = [p] + ([d[:k]] if k else []) + [[nxt[i]]]
        np.testing.assert_allclose(
            np.array(logits[i]),
            np.array(solo_logits(model, make_cache, *blocks)[-1]),
            atol=ATOL,
            rtol=0,
            err_msg=f"row {i} after rollback",
        )
