"""The eager bridge's routed reads on MLX's CUDA backend (issue 15): ragged
dense rows through ``kernels.ragged_attention`` and quantized rows through
the one quantized read (``_quantized.read_route``: the kernel over packed
planes for decode widths, the dequantized columns for prefill), against the
masked stock path in bf16 tolerance (for quantized rows: the masked stock
SDPA over the dequantized planes at every width). Before these routes the eager bridge
could not run quantized rows on CUDA at all (MLX 0.32.4's ``quantized_matmul``
fails for KV shapes). The CPU side of the same wiring (routes forced, the
kernels' stock paths) is ``tests/bridge/test_bridge_routes.py``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _tol import rel_l2
from mlx_lm.models import llama
from test_bridge_routes import record_routes

import kvstate as kv
from kvstate import mlx_lm as bridge
from kvstate.bridge import routing
from kvstate.kernels import cuda as kernels
from kvstate.kinds import quantized as _quantized

pytestmark = pytest.mark.skipif(
    not kernels.kernel_available(), reason="needs MLX's CUDA backend (the routed reads run there)"
)

VOCAB = 256
TOL = rel_l2(mx.bfloat16)  # relative L2 error of bf16 logits


def model_of(heads, kv_heads, head_dim, seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=heads * head_dim,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


GEOMETRIES = [(4, 2, 32), (9, 3, 64)]  # GQA 2/3, head dims 32/64 (SmolLM2: 9/3, 64)


def prompts(lengths):
    rng = np.random.default_rng(sum(lengths))
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


def rel(got, want):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run(model, ps, steps=4, **make):
    """Prefill, then ``steps`` greedy steps: (logits of each, tokens fed)."""
    logits, states = bridge.prefill(model, ps, **make)
    seen, toks = [logits], []
    for _ in range(steps):
        tok = mx.argmax(logits, axis=-1)
        toks.append(tok)
        logits, states = bridge.step(model, tok, states)
        seen.append(logits)
    return seen, toks


def replay(model, ps, toks, **make):
    """The same prefill and the same tokens fed (not re-chosen)."""
    logits, states = bridge.prefill(model, ps, **make)
    seen = [logits]
    for tok in toks:
        logits, states = bridge.step(model, tok, states)
        seen.append(logits)
    return seen


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["gqa2-d32", "gqa3-d64"])
def test_ragged_dense_rows_read_by_the_kernel(monkeypatch, geometry):
    model = model_of(*geometry)
    ps = prompts([40, 200, 7, 129])
    calls = []
    real = kernels.ragged_attention

    def counted(*a, **kw):
        calls.append(a[0].shape[2])
        return real(*a, **kw)

    monkeypatch.setattr(kernels, "ragged_attention", counted)
    got, toks = run(model, ps)
    assert calls and set(calls) == {1}  # every ragged decode read, one query each
    monkeypatch.setattr(routing, "routes_reads", lambda: False)  # the masked stock SDPA
    want = replay(model, ps, toks)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel(g, w) < TOL, f"step {t}: {rel(g, w)}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["gqa2-d32", "gqa3-d64"])
def test_quantized_rows_prefill_and_decode_on_cuda(monkeypatch, geometry, bits):
    """Quantized rows through the eager bridge: prefill chunks read the
    dequantized columns, decode steps the kernel over the packed planes;
    against the same run reading every width by the masked stock SDPA over
    the dequantized planes."""
    model = model_of(*geometry)
    ps = prompts([20, 70, 9])
    make = dict(kv_bits=bits, kv_group_size=32)
    routes = record_routes(monkeypatch)
    got, toks = run(model, ps, **make)
    assert ("dequantized", 69) in routes and ("kernel", 1) in routes
    assert {r for r, _ in routes} == {"dequantized", "kernel"}
    monkeypatch.setattr(_quantized, "read_route", lambda *a: "dequantized")
    want = replay(model, ps, toks, **make)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel(g, w) < TOL, f"step {t}: {rel(g, w)}"


@pytest.mark.parametrize("n", [1, 8, 9, 40])
def test_kv_attend_quantized_at_any_width(n):
    """``kv.attend`` on quantized rows reads at decode and prefill widths on
    CUDA (before: only where the kernel covered the read), against the masked
    float32 SDPA over the dequantized planes."""
    mx.random.seed(n)
    B, H, Hq, D = 3, 2, 8, 64
    rows = []
    for m in (50, 13, 2):
        k, v = (mx.random.normal((1, H, m, D)).astype(mx.bfloat16) for _ in "kv")
        rows.append(kv.append(kv.quantized(1, group_size=32, bits=4), k, v))
    s = kv.merge_rows(rows)
    k, v = (mx.random.normal((B, H, n, D)).astype(mx.bfloat16) for _ in "kv")
    s = kv.append(s, k, v)
    q = mx.random.normal((B, Hq, n, D)).astype(mx.bfloat16)
    got = kv.attend(s, q, scale=D**-0.5)
    dk, dv = (mx.dequantize(*x, group_size=32, bits=4).astype(mx.float32) for x in kv.fetch(s))
    mask = kv.next_mask(kv.trim(s, n), n)[0]
    want = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), dk, dv, scale=D**-0.5, mask=mask
    )
    assert rel(got, want) < TOL
