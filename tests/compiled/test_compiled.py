"""The compile boundary (``kvstate.compiled.boundary``) and the compiled decode step
(``kvstate.mlx_lm.Decoder``).

Compiled loops run under real ``mx.compile`` on real mlx-lm model classes
(tiny, seeded float32 weights) and are compared, step by step, with the
eager bridge loop (``kvstate.mlx_lm.step``) in the same process: logits
within ``_tol.atol`` (float32) and identical greedy tokens. Rings are also compared with each
prompt run alone through mlx-lm's own caches.
"""

import math

import attrs
import mlx.core as mx
import pytest
import tiny_models as tm
from _tol import atol
from mlx_lm.models.cache import make_prompt_cache

import kvstate as kv
import kvstate.compiled.boundary as kc
from kvstate import mlx_lm as br
from kvstate.bridge import decoder as _decoder
from kvstate.bridge import routing
from kvstate.kernels import cuda as kernels
from kvstate.kinds import quantized as _quantized
from kvstate.kinds import rows as _rows

ATOL = atol(mx.float32)


def prefill(model, lens, *, step=256, **make):
    """Ragged rows: each prompt prefilled alone (records with ``step``), then merged."""
    prompts = [tm.prompt(10 + i, n) for i, n in enumerate(lens)]
    last, rows = [], []
    for p in prompts:
        states = br.make_states(model, 1, **make)
        states = [
            s if isinstance(s, kv.RotatingState) else attrs.evolve(s, step=step) for s in states
        ]
        logits, states = br.forward(model, mx.array([p]), states)
        last.append(logits[:, -1])
        rows.append(states)
    return prompts, mx.concatenate(last), br.merge_rows(rows)


def loops(model, logits, states, steps, decode):
    """Greedy eager and compiled loops side by side; returns the worst logit gap."""
    se = sc = states
    te = tc = mx.argmax(logits, axis=-1)
    worst = 0.0
    for t in range(steps):
        le, se = br.step(model, te, se)
        lc, sc = decode(tc, sc)
        worst = max(worst, mx.abs(le - lc).max().item())
        te, tc = mx.argmax(le, axis=-1), mx.argmax(lc, axis=-1)
        assert te.tolist() == tc.tolist(), f"greedy tokens differ at step {t}"
    return worst, se, sc


# --- the boundary -------------------------------------------------------------------


def test_flatten_unflatten_round_trip():
    model = tm.llama_model(layers=1)
    _, _, states = prefill(model, [5, 9, 3], step=16)
    s = states[0]
    flat, spec = kc.flatten(s)
    assert spec.kind is kv.CacheState and spec.same_end  # merged rows are right-aligned
    assert spec.key == (kv.CacheState, (("step", 16),), True)
    assert kc.spec_of(kv.trim(s, (0, 1, 0))).same_end is False
    assert flat.positions[0].tolist() == list(s.ends)
    assert flat.positions[1].tolist() == list(s.left_pad)
    back = kc.unflatten(spec, flat)  # the static half and the leaves alone rebuild it
    assert back.lengths == s.lengths and back.left_pad == s.left_pad
    assert mx.array_equal(kv.fetch(back)[0], kv.fetch(s)[0])
    hash(spec)  # the static half is hashable
    later = kc.spec_of(kv.trim(s, 1))
    assert later != spec and later.key == kc.spec_of(kv.trim(s, (1, 1, 1))).key


@pytest.mark.parametrize(
    "make,rows",
    [
        (lambda: kv.quantized(2, group_size=32, bits=4), "lengths"),
        (lambda: kv.rotating(2, max_size=6, keep=2, step=4), "held"),
    ],
)
def test_unflatten_rebuilds_every_kind_from_spec_and_planes(make, rows):
    mx.random.seed(5)
    s = kv.append(make(), mx.random.normal((2, 2, 9, 32)), mx.random.normal((2, 2, 9, 32)))
    flat, spec = kc.flatten(s)
    back = kc.unflatten(spec, flat.planes)
    assert type(back) is type(s) and kc.spec_of(back) == spec
    assert back.lengths == s.lengths
    for a, b in zip(back.planes, kc.prepare(s).planes):
        assert mx.array_equal(a, b)
    with pytest.raises(kv.KVStateError, match="planes"):
        kc.unflatten(spec, flat.planes[:-1])
    with pytest.raises(kv.KVStateError, match="lengths"):  # rows past the capacity
        kc.unflatten(spec.replace(**{rows: (999, 999)}), flat.planes)


def test_prepare_grows_only_without_room():
    model = tm.llama_model(layers=1)
    _, _, states = prefill(model, [5, 16, 3], step=16)
    s = states[0]  # width 16, capacity 16: no room
    assert s.capacity == 16
    g = kc.prepare(s, 1)
    assert g.capacity == 32 and g.lengths == s.lengths and s.capacity == 16
    assert kc.prepare(g, 1) is g  # room already: no copy
    assert kc.prepare(g, 17).capacity == 48
    assert mx.array_equal(kv.fetch(g)[0], kv.fetch(s)[0])


def test_prepare_refuses_bad_input():
    with pytest.raises(kv.KVStateError, match="state"):
        kc.prepare(kv.empty(2))
    model = tm.llama_model(layers=1)
    _, _, states = prefill(model, [5, 9], step=16)
    with pytest.raises(kv.KVStateError, match="n"):
        kc.prepare(states[0], 0)
    with pytest.raises(kv.KVStateError, match="capacity"):
        kc.with_capacity(states[0], 24)
    with pytest.raises(kv.KVStateError, match="batch size"):
        br.Decoder(model)(mx.array([1, 2, 3]), states)


# --- compiled decode == eager decode ----------------------------------------------


def test_trace_count_600_tokens_ragged():
    step, T = 128, 600
    model = tm.llama_model(layers=1)
    _, logits, states = prefill(model, [5, 19, 2, 11], step=step)
    states = [kv.trim(s, (1, 0, 0, 3)) for s in states]  # every row ends at its own column
    decode = br.Decoder(model, attention="mask")
    tok = mx.argmax(logits, axis=-1)
    caps = set()
    for _ in range(T):
        logits, states = decode(tok, states)
        tok = mx.argmax(logits, axis=-1)
        mx.async_eval(tok)
        caps.add(states[0].capacity)
    assert states[0].lengths == (4 + T, 19 + T, 2 + T, 8 + T)
    assert decode.traces <= math.ceil(T / step) + 1
    assert decode.traces == len(caps)  # exactly one trace per capacity bucket


def test_llama_compiled_equals_eager_across_buckets(monkeypatch):
    monkeypatch.setattr(routing, "routes_reads", lambda: False)  # eager reads as "mask" does
    model = tm.llama_model()
    _, logits, states = prefill(model, [5, 9, 3], step=16)
    states = [kv.trim(s, (0, 2, 1)) for s in states]  # ends differ: per-row scatter writes
    decode = br.Decoder(model, attention="mask")
    worst, se, sc = loops(model, logits, states, 24, decode)
    assert worst <= ATOL
    assert sc[0].lengths == se[0].lengths and sc[0].left_pad == se[0].left_pad
    assert sc[0].capacity == 48 and decode.traces == 3  # buckets 16, 32, 48: one trace each


def test_quantized_batch_compiled_equals_eager():
    model = tm.llama_model()
    _, logits, states = prefill(model, [5, 9, 3], kv_bits=8, kv_group_size=32)
    assert isinstance(states[0], kv.QuantizedState)
    decode = br.Decoder(model, attention="mask")
    worst, _, sc = loops(model, logits, states, 12, decode)
    assert worst <= ATOL
    assert isinstance(sc[0], kv.QuantizedState) and decode.traces == 1


def test_masked_quantized_rows_read_dequantized_where_the_stock_read_cannot_run(monkeypatch):
    """``attention="mask"`` over quantized rows where the stock quantized read
    cannot run (MLX's CUDA backend; forced here, with ``mx.quantized_matmul``
    failing as it does there): each layer reads its columns dequantized under
    the step's mask, and the loop equals the eager stock read's, logits and
    greedy tokens (not the failing stock read)."""
    model = tm.llama_model()
    _, logits, states = prefill(model, [5, 9, 3], kv_bits=8, kv_group_size=32)
    tok, want = mx.argmax(logits, axis=-1), []
    se, te = states, tok
    for _ in range(6):  # the eager stock read, before it is made to fail
        le, se = br.step(model, te, se)
        te = mx.argmax(le, axis=-1)
        want.append(le)
    mx.eval(want)
    monkeypatch.setattr(_quantized, "stock_read_runs", lambda: False)

    def missing(*a, **kw):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape")

    monkeypatch.setattr(mx, "quantized_matmul", missing)
    decode = br.Decoder(model, attention="mask")
    sc, tc = states, tok
    for t, le in enumerate(want):
        lc, sc = decode(tc, sc)
        assert mx.abs(le - lc).max().item() <= ATOL, t
        tc = mx.argmax(lc, axis=-1)
        assert tc.tolist() == mx.argmax(le, axis=-1).tolist(), f"greedy tokens differ at step {t}"
    assert isinstance(sc[0], kv.QuantizedState) and decode.traces == 1


def solo_rows(model, prompts, tokens, steps):
    """Each prompt alone through mlx-lm's own caches, fed the given first token."""
    out = []
    for b, p in enumerate(prompts):
        cache = make_prompt_cache(model)
        model(mx.array([p]), cache=cache)
        t, seq = tokens[b : b + 1], []
        for _ in range(steps):
            lg = model(t[:, None], cache=cache)[:, -1]
            seq.append(lg[0])
            t = mx.argmax(lg, axis=-1)
        out.append(mx.stack(seq))
    return out


def test_gemma3_rings_compiled_equals_mlx_lm_alone_and_eager():
    model = tm.gemma3_model()  # sliding_window=8: rows below, at and past the window
    prompts, logits, states = prefill(model, [3, 8, 12])
    assert isinstance(states[0], kv.RotatingState)
    steps = 14
    tok = mx.argmax(logits, axis=-1)
    ref = solo_rows(model, prompts, tok, steps)
    decode = br.Decoder(model, attention="mask")
    sc, t, worst = states, tok, 0.0
    for i in range(steps):
        lc, sc = decode(t, sc)
        for b in range(len(prompts)):
            worst = max(worst, mx.abs(lc[b] - ref[b][i]).max().item())
        t = mx.argmax(lc, axis=-1)
    assert worst <= ATOL
    assert sc[0].capacity == 8 and sc[0].held == (8, 8, 8)
    worst, _, _ = loops(model, logits, states, steps, br.Decoder(model, attention="mask"))
    assert worst <= ATOL


@pytest.mark.parametrize(
    "kind",
    [
        "dense",
        "rings",
        "quantized",
    ],
)
def test_decoder_reuses_the_specs_of_its_own_records(monkeypatch, kind):
    """A record the decoder returned and gets back unchanged skips ``flatten``
    (its Spec is the advanced one the decoder built; batches that are their own
    bucket, here 4 rows); the remembered Spec is
    the record's own (``spec_of``) at every step, across capacity buckets;
    anything else (a record changed since, a new one) is flattened."""
    model = tm.gemma3_model() if kind == "rings" else tm.llama_model(layers=2)
    make = dict(kv_bits=8, kv_group_size=32) if kind == "quantized" else {}
    _, logits, states = prefill(model, [5, 9, 3, 7], step=16, **make)  # a batch bucket
    flattened = []
    flatten = kc.flatten
    monkeypatch.setattr(kc, "flatten", lambda s, **kw: flattened.append(s) or flatten(s, **kw))
    prepared = []
    prepare = kc.prepare
    monkeypatch.setattr(kc, "prepare", lambda s, n=1: prepared.append(s) or prepare(s, n))
    decode = br.Decoder(model, attention="mask")
    tok = mx.argmax(logits, axis=-1)
    grown = 0
    for t in range(20):
        before, asked = len(flattened), len(prepared)
        layouts = {id(decode._returned[id(r)][1]) for r in states} if t > 0 else ()
        last = decode._last
        steady = last is not None and last.steady is not None and last.steady.room >= 1
        _, new = decode(tok, states)
        moved = sum(a.capacity != b.capacity for a, b in zip(states, new))
        grown += moved
        for r in new:
            assert kc.spec_of(r) == decode._returned[id(r)][1], t
        if t > 0:  # flattened: only the records prepare moved to a new bucket
            assert len(flattened) - before == moved, t
        if t > 0 and not moved:  # prepared: one record per remembered layout (none: steady)
            assert len(prepared) - asked == (0 if steady else len(layouts)), t
        states = new
    assert len(flattened) < 20 * len(states)  # the fast path ran
    specs = {id(decode._returned[id(r)][1]) for r in states}
    assert len(specs) == len({kc.spec_of(r) for r in states})  # one Spec per layout
    if kind == "dense":
        assert grown >= 1  # crossed a bucket
    changed = [kv.trim(s, (1, 0, 0, 0)) for s in states]
    before = len(flattened)
    decode(tok, changed)
    assert len(flattened) - before == len(changed)


def same_record(a, b) -> bool:
    """Bit-equal records: one kind, equal host fields, equal planes (every
    column of the capacity, hidden ones included)."""
    if type(a) is not type(b):
        return False
    for f in attrs.fields(type(a)):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, mx.array) or (isinstance(x, tuple) and x and isinstance(x[0], mx.array)):
            xs, ys = (x,) if isinstance(x, mx.array) else x, (y,) if isinstance(y, mx.array) else y
            if len(xs) != len(ys) or not all(mx.array_equal(p, q).item() for p, q in zip(xs, ys)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("kind", ["dense", "quantized"])
def test_steady_steps_skip_the_per_layer_host_work(monkeypatch, kind):
    """A decode loop's call (``logits, states = dec(tok, states)``) with rows
    that have room in their bucket runs none of the per-layer host work
    (``prepare``, ``flatten``, the trace key, ``Spec.rebuild``): the steady
    path. Over 24 steps its logits and records are bit-equal to the general
    path's (a decoder that never takes the steady path), through a capacity
    bucket crossed (that step falls back) and a step given other records
    (trimmed: falls back too)."""
    model = tm.llama_model(layers=3)
    make = dict(kv_bits=8, kv_group_size=32) if kind == "quantized" else {}
    _, logits, states = prefill(model, [5, 9, 3, 7], step=16, **make)  # a batch bucket
    calls: dict = {}

    def counted(name, fn):
        def call(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)

        return call

    monkeypatch.setattr(kc, "prepare", counted("prepare", kc.prepare))
    monkeypatch.setattr(kc, "flatten", counted("flatten", kc.flatten))
    monkeypatch.setattr(_decoder, "_keys", counted("keys", _decoder._keys))
    monkeypatch.setattr(kc.Spec, "rebuild", counted("rebuild", kc.Spec.rebuild))
    steady, general = br.Decoder(model, attention="mask"), br.Decoder(model, attention="mask")
    general._steady = False
    ss = sg = states
    tok = mx.argmax(logits, axis=-1)
    quiet, crossed = 0, []
    for t in range(24):
        if t == 12:  # other records than the decoder returned
            ss, sg = [kv.trim(s, 1) for s in ss], [kv.trim(s, 1) for s in sg]
        calls.clear()
        ls, new_s = steady(tok, ss)
        work = sum(calls.values())
        lg, new_g = general(tok, sg)
        assert mx.array_equal(ls, lg).item(), t
        assert all(same_record(a, b) for a, b in zip(new_s, new_g)), t
        grew = new_s[0].capacity != ss[0].capacity
        crossed += [t] if grew else []
        if t in (0, 12) or grew:  # the general path
            assert calls.get("prepare", 0) >= 1, t
        else:
            assert work == 0, (t, dict(calls))
            quiet += 1
        ss, sg = new_s, new_g
        tok = mx.argmax(ls, axis=-1)
    assert [t for t in crossed if t not in (0, 12)] and quiet == 24 - len({0, 12, *crossed})
    assert steady.traces == general.traces


def test_layers_of_one_layout_share_their_position_arithmetic(monkeypatch):
    """The position arrays of one layout enter the compiled step once, so the
    offsets, write indices and ends every layer derives from them are traced
    once per step (``TraceContext.shared``), not once per layer."""
    built = []
    shared = kc.TraceContext.shared

    def counting(self, key, arrays, build):
        return shared(self, key, arrays, lambda: built.append(key[0]) or build())

    monkeypatch.setattr(kc.TraceContext, "shared", counting)
    model = tm.llama_model(layers=3)
    _, logits, states = prefill(model, [5, 9, 3, 7], step=16)
    decode = br.Decoder(model, attention="mask")
    decode(mx.argmax(logits, axis=-1), states)
    assert decode.traces == 1
    assert built.count("rows-offset") == 1 and built.count("rows-write") == 1


def test_inputs_unchanged_and_outputs_own_their_rows():
    model = tm.llama_model(layers=2)
    _, logits, states = prefill(model, [4, 7], step=16)
    before = [mx.array(s.keys) for s in states]
    mx.eval(before)
    decode = br.Decoder(model, attention="mask")
    tok = mx.argmax(logits, axis=-1)
    _, new = decode(tok, states)
    _, newer = decode(tok, new)
    mx.eval([s.keys for s in newer])
    for s, b in zip(states, before):
        assert mx.array_equal(s.keys, b)
    assert states[0].lengths == (4, 7) and new[0].lengths == (5, 8)
    assert newer[0].lengths == (6, 9)


def test_kernel_mode_routes_dense_reads_without_a_mask(monkeypatch):
    model = tm.llama_model()
    _, logits, states = prefill(model, [5, 9, 3])
    calls, compiled = [], []
    real = kernels.ragged_attention

    def spy(q, k, v, left_pad, ends, *, scale, **kw):
        if compiled:  # (on CUDA the eager reference's reads are routed here too)
            calls.append(q.shape)
        return real(q, k, v, left_pad, ends, scale=scale)

    real_fused = kernels.write_and_read

    def spy_fused(q, *a, **kw):  # (CUDA, small planes: the write in the read's launch)
        calls.append(q.shape)
        return real_fused(q, *a, **kw)

    monkeypatch.setattr(kernels, "ragged_attention", spy)
    monkeypatch.setattr(kernels, "write_and_read", spy_fused)
    kernel = br.Decoder(model, attention="kernel")

    def decode(tokens, states):
        compiled.append(1)
        try:
            return kernel(tokens, states)
        finally:
            compiled.pop()

    worst, _, _ = loops(model, logits, states, 4, decode)
    assert worst <= ATOL
    assert len(calls) == 3  # one per layer, during the single trace only
    from mlx_lm.models import base, llama

    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_ragged_attention_equals_masked_sdpa():
    mx.random.seed(3)
    B, Hq, H, C, D = 3, 4, 2, 32, 32
    q = mx.random.normal((B, Hq, 1, D))
    k = mx.random.normal((B, H, C, D))
    v = mx.random.normal((B, H, C, D))
    lp, ends = mx.array([0, 5, 9], mx.int32), mx.array([20, 32, 10], mx.int32)
    got = kernels.ragged_attention(q, k, v, lp, ends, scale=0.2)
    for b, (a, e) in enumerate([(0, 20), (5, 32), (9, 10)]):
        want = mx.fast.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e], scale=0.2
        )
        assert mx.allclose(got[b : b + 1], want, atol=ATOL)


def test_make_step_matches_the_bridge_step_signature():
    model = tm.llama_model(layers=1)
    _, logits, states = prefill(model, [3, 6])
    step = br.make_step(model)
    tok = mx.argmax(logits, axis=-1)
    lc, sc = step(model, tok, states)
    le, se = br.step(model, tok, states)
    assert lc.shape == le.shape and mx.abs(lc - le).max().item() <= ATOL
    with pytest.raises(kv.KVStateError, match="model"):
        step(tm.llama_model(layers=1), tok, states)


@pytest.mark.parametrize("write,wait", [("slice", False), ("slice", True), ("scatter", True)])
def test_write_and_wait_options_equal_eager(monkeypatch, write, wait):
    # The eager reference reads as the compiled "mask" mode does: the model's own
    # masked SDPA (on CUDA eager reads are routed to the kernels, notes/kernels.md)
    monkeypatch.setattr(routing, "routes_reads", lambda: False)
    model = tm.llama_model(layers=2)
    _, logits, states = prefill(model, [5, 9, 3], step=16)  # merged: rows share one end
    decode = br.Decoder(model, attention="mask", write=write, wait=wait)
    worst, _, sc = loops(model, logits, states, 10, decode)
    assert worst <= ATOL and decode.traces == 2
    with pytest.raises(kv.KVStateError, match="write"):
        br.Decoder(model, write="poke")


def test_manual_compiled_step_over_flatten_equals_append():
    """The documented boundary without the Decoder: a user's own compiled write."""
    mx.random.seed(4)
    k0, v0 = mx.random.normal((3, 2, 7, 8)), mx.random.normal((3, 2, 7, 8))
    s = kv.from_arrays(k0, v0, lengths=[7, 4, 5], left_pad=[0, 2, 1], step=8)
    traces = []

    @mx.compile
    def step(flat, k, v):
        traces.append(1)
        planes, (ends, _) = flat
        write = _rows.column_writer(ends, 1)
        return [write(p, x) for p, x in zip(planes, (k, v))]

    want = s
    for _ in range(12):
        k, v = mx.random.normal((3, 2, 1, 8)), mx.random.normal((3, 2, 1, 8))
        want = kv.append(want, k, v)
        s = kc.prepare(s)
        flat, spec = kc.flatten(s)
        s = kc.unflatten(spec.replace(**kc.advanced(s)), step(flat, k, v))
        assert s.lengths == want.lengths and s.left_pad == want.left_pad
        for a, b in zip(kv.fetch(s), kv.fetch(want)):
            assert mx.array_equal(a, b)
    assert len(traces) == 3  # buckets 8, 16, 24: widths 7 -> 19
