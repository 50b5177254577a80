"""Hybrid and recurrent model families through ``kvstate.mlx_lm``, against mlx-lm.

Five tiny seeded float32 models (``tiny_hybrid.py``): lfm2 (short conv +
attention: ``RecurrentState`` + ``CacheState``), qwen3_next (gated delta
net + attention), mamba2 (SSM only), falcon_h1 (``CompositeState`` of a
recurrent and a dense record per layer) and llama4 (``ChunkedState`` +
``CacheState``). Every comparison runs mlx-lm in the same process on the
same inputs, each row alone with its own mlx-lm caches: logits within
float32 tolerance, greedy tokens equal.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny_hybrid as th
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import kvstate as kv
from kvstate import mlx_lm as br

FAMILIES = sorted(th.MODELS)
KINDS = {
    "lfm2": {kv.RecurrentState, kv.CacheState},
    "qwen3_next": {kv.RecurrentState, kv.CacheState},
    "mamba2": {kv.RecurrentState},
    "falcon_h1": {kv.CompositeState},
    "llama4": {kv.ChunkedState, kv.CacheState},
}
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, th.MODELS[request.param]()


class Solo:
    """One row run alone on mlx-lm: its caches, its last logits."""

    def __init__(self, model, tokens):
        self.model, self.cache = model, make_prompt_cache(model)
        self.logits = None
        self.feed(tokens)

    def feed(self, tokens):
        self.logits = self.model(mx.array([list(tokens)]), cache=self.cache)[0, -1]
        return self.logits


def close(got, want, what):
    np.testing.assert_allclose(np.array(got), np.array(want), atol=ATOL, rtol=1e-4, err_msg=what)


def decode(model, logits, states, refs, steps, what):
    """Greedy steps of a kvstate batch and of each row alone; equal at every step."""
    for i in range(steps):
        for b, ref in enumerate(refs):
            close(logits[b], ref.logits, f"{what}: row {b}, step {i}")
        tok = mx.argmax(logits, axis=-1)
        for b, ref in enumerate(refs):
            assert tok[b].item() == mx.argmax(ref.logits).item(), f"{what}: row {b}, step {i}"
            ref.feed([tok[b].item()])
        logits, states = br.step(model, tok, states)
    return logits, states


def test_make_states_mirror_make_cache(family):
    name, model = family
    states = br.make_states(model, 2)
    assert len(states) == len(make_prompt_cache(model))
    assert {type(s) for s in states} == KINDS[name]
    assert all(s.batch_size == 2 for s in states)


def test_ragged_batch_equals_each_row_alone(family):
    name, model = family
    prompts = [th.prompt(1, 5), th.prompt(2, 11), th.prompt(3, 8)]
    logits, states = br.prefill(model, prompts)
    refs = [Solo(model, p) for p in prompts]
    decode(model, logits, states, refs, 5, name)


def test_batched_chunked_prefill_equals_each_row_alone(family):
    """``prefill`` right-pads the rows and runs them in chunks of 3 tokens:
    recurrent rows skip their padding (mlx-lm's ``lengths`` mask, counting down
    across chunks), attention rows trim it; llama4 prefills rows alone."""
    name, model = family
    prompts = [th.prompt(21, 9), th.prompt(22, 2), th.prompt(23, 6)]
    logits, states = br.prefill(model, prompts, prefill_step_size=3)
    assert all(br.paddable(s) for s in states) == (name != "llama4")
    refs = [Solo(model, p) for p in prompts]
    decode(model, logits, states, refs, 3, f"{name} (batched prefill)")


def test_continuous_batching_rows_join_and_leave(family):
    name, model = family
    prompts = [th.prompt(4, 6), th.prompt(5, 9)]
    logits, states = br.prefill(model, prompts)
    refs = [Solo(model, p) for p in prompts]
    logits, states = decode(model, logits, states, refs, 3, f"{name} (2 rows)")
    # A newcomer prefilled alone joins the running batch.
    new_logits, new_states = br.prefill(model, [th.prompt(6, 4)])
    refs.append(Solo(model, th.prompt(6, 4)))
    states = br.extend(states, new_states)
    logits = mx.concatenate([logits, new_logits], axis=0)
    logits, states = decode(model, logits, states, refs, 3, f"{name} (joined)")
    # The first row finishes and leaves.
    states = br.filter_rows(states, [1, 2])
    logits, refs = logits[mx.array([1, 2])], refs[1:]
    decode(model, logits, states, refs, 3, f"{name} (left)")


def test_rollback_after_rejected_draft_equals_never_drafting(family):
    name, model = family
    prompts = [th.prompt(7, 7), th.prompt(8, 4), th.prompt(9, 10)]
    logits, states = br.prefill(model, prompts)
    cp = kv.checkpoint(states)
    draft = mx.array([th.prompt(20 + b, 4) for b in range(3)])  # 4 draft tokens per row
    _, drafted = br.forward(model, draft, states)
    keep = [0, 2, 4]  # row 0 rejects all, row 1 keeps half, row 2 keeps all
    states = br.rollback(model, drafted, cp, keep, draft)
    want = tuple(len(p) + k for p, k in zip(prompts, keep))
    assert all(kv.checkpoint(s).lengths == want for s in states)  # tokens seen, every layer
    refs = []
    for b, (p, k) in enumerate(zip(prompts, keep)):
        ref = Solo(model, p)
        if k:
            ref.feed(draft[b, :k].tolist())  # never drafted: the accepted tokens, fed once
        refs.append(ref)
    nxt = mx.array([mx.argmax(r.logits).item() for r in refs])
    logits, states = br.step(model, nxt, states)
    for b, r in enumerate(refs):
        r.feed([nxt[b].item()])
    decode(model, logits, states, refs, 3, f"{name} (after rollback)")


def test_model_rollback_refuses_bad_input_and_changes_nothing(family):
    name, model = family
    _, states = br.prefill(model, [th.prompt(18, 5), th.prompt(19, 3)])
    cp = kv.checkpoint(states)
    draft = mx.array([th.prompt(32, 3), th.prompt(33, 3)])
    _, drafted = br.forward(model, draft, states)
    before = [kv.checkpoint(s).lengths for s in drafted]
    for args, arg in (
        ((cp, [1, 4], draft), "keep\\[1\\]"),
        ((cp, [1, 1], draft[:1]), "tokens"),
        ((cp.layers[0], 1, draft), "checkpoint"),
        ((kv.checkpoint(drafted[:1]), 1, draft), "checkpoint layers"),
    ):
        with pytest.raises(kv.KVStateError, match=arg):
            br.rollback(model, drafted, *args)
    assert [kv.checkpoint(s).lengths for s in drafted] == before


def test_rollback_without_replay_keeps_or_restores_rows(family):
    """keep 0 or all: every record rolls back alone (no model call), exactly."""
    name, model = family
    prompts = [th.prompt(10, 6), th.prompt(11, 3)]
    _, states = br.prefill(model, prompts)
    cp = kv.checkpoint(states)
    draft = mx.array([th.prompt(30, 3), th.prompt(31, 3)])
    _, drafted = br.forward(model, draft, states)
    back = kv.rollback(drafted, cp, [0, 3])
    _, want = br.forward(model, draft[1:], br.filter_rows(states, [1]))
    got_logits, _ = br.step(model, mx.array([5, 5]), back)
    ref0, ref1 = Solo(model, prompts[0] + [5]), Solo(model, prompts[1] + draft[1].tolist() + [5])
    close(got_logits[0], ref0.logits, f"{name}: restored row")
    close(got_logits[1], ref1.logits, f"{name}: kept row")
    if name in ("lfm2", "qwen3_next", "mamba2", "falcon_h1"):
        with pytest.raises(kv.KVStateError, match="keep for row 0"):
            kv.rollback(drafted, cp, [1, 3])  # part of a block: only a replay is exact


def test_save_load_and_mlx_lm_files(family, tmp_path):
    name, model = family
    prompts = [th.prompt(12, 6), th.prompt(13, 9)]
    logits, states = br.prefill(model, prompts)
    path = str(tmp_path / "kv.safetensors")
    kv.save(path, states, {"family": name})
    loaded, meta = kv.load(path)
    assert meta == {"family": name}
    refs = [Solo(model, p) for p in prompts]
    decode(model, logits, loaded, refs, 3, f"{name} (kv.load)")
    # A file mlx-lm's save_prompt_cache wrote (one row alone on mlx-lm), and back.
    solo = Solo(model, prompts[1])
    mpath = str(tmp_path / "mlx.safetensors")
    save_prompt_cache(mpath, solo.cache, {"m": "1"})
    from_file, meta = kv.load(mpath)
    assert meta == {"m": "1"}
    ref = Solo(model, prompts[1])
    decode(model, solo.logits[None], from_file, [ref], 3, f"{name} (mlx-lm file)")
    # to_prompt_cache: mlx-lm continues from kvstate's records.
    _, one = br.prefill(model, [prompts[0]])
    caches = br.to_prompt_cache(one)
    back = model(mx.array([[7]]), cache=caches)[0, -1]
    close(back, Solo(model, prompts[0] + [7]).logits, f"{name} (to_prompt_cache)")
    lm = load_prompt_cache(mpath)
    assert len(lm) == len(from_file)


def test_load_checks_the_model_of_every_family(tmp_path):
    """``kv.load(path, model=...)`` takes a file of the model's own layout and
    refuses another family's (recurrent slots, composite parts, chunked layers)."""
    models = {name: th.MODELS[name]() for name in FAMILIES}
    paths = {}
    for name, model in models.items():
        _, states = br.prefill(model, [th.prompt(14, 5)])
        paths[name] = str(tmp_path / f"{name}.safetensors")
        kv.save(paths[name], states)
        loaded, _ = kv.load(paths[name], model=model)
        assert [type(s) for s in loaded] == [type(s) for s in states]
    for name, other in (
        ("mamba2", "lfm2"),
        ("falcon_h1", "qwen3_next"),
        ("llama4", "lfm2"),
        ("lfm2", "qwen3_next"),
    ):
        with pytest.raises(kv.KVStateError, match="states"):
            kv.load(paths[other], model=models[name])


@pytest.mark.parametrize("name", ["lfm2", "qwen3_next", "mamba2", "falcon_h1"])
def test_compiled_decoder_equals_eager_with_one_trace(name):
    """Recurrent slots cross the compile boundary as planes (composites as their
    parts'); the compiled loop's logits equal the eager loop's, one trace."""
    model = th.MODELS[name]()
    # Three rows: the decoder pads them to its batch bucket of 4 (recurrent rows
    # with zero slots; a composite layer is not padded and runs at 3).
    logits, eager = br.prefill(model, [th.prompt(15, 5), th.prompt(16, 9), th.prompt(17, 2)])
    decode, compiled = kv.compiled_decoder(model), eager
    for i in range(6):
        tok = mx.argmax(logits, axis=-1)
        logits, eager = br.step(model, tok, eager)
        got, compiled = decode(tok, compiled)
        close(got, logits, f"{name}: compiled step {i}")
    assert decode.traces == 1
    assert [type(s) for s in compiled] == [type(s) for s in eager]
    assert all(
        kv.checkpoint(a).lengths == kv.checkpoint(b).lengths for a, b in zip(compiled, eager)
    )


def test_compiled_decoder_refuses_chunked_layers_by_name():
    model = th.MODELS["llama4"]()
    _, states = br.prefill(model, [th.prompt(17, 5)])
    with pytest.raises(kv.KVStateError, match="Python int"):
        kv.compiled_decoder(model)(mx.array([1]), states)


def test_speculative_decoding_on_hybrid_targets_equals_plain_greedy(family):
    """kvstate.speculative on a hybrid target (prompt-lookup drafts) emits the
    tokens of plain greedy decoding; its rollback is ``kvstate.mlx_lm.rollback``
    (rows keeping part of a window replay it; the replay's own exactness is
    ``test_rollback_after_rejected_draft_equals_never_drafting``)."""
    from kvstate.speculative import rounds as sp
    from kvstate.speculative.drafts import Lookup

    name, model = family
    prompts = [(th.prompt(40, 4) * 6)[:22], (th.prompt(41, 3) * 8)[:19]]
    logits, states = br.prefill(model, prompts)
    want = [[t] for t in mx.argmax(logits, axis=-1).tolist()]
    for _ in range(10):
        logits, states = br.step(model, mx.argmax(logits, axis=-1), states)
        for w, t in zip(want, mx.argmax(logits, axis=-1).tolist()):
            w.append(t)
    spec, rounds = sp.start(model, prompts, drafter=Lookup(min_ngram=1), num_draft=4), []
    while min(len(c) - len(p) for c, p in zip(spec.context, prompts)) < 11:
        spec, r = sp.step(model, spec, drafter=Lookup(min_ngram=1))
        rounds.append(r)
    got = [list(c[len(p) : len(p) + 11]) for c, p in zip(spec.context, prompts)]
    assert got == want, name
    partial = sum(0 < a < d for r in rounds for d, a in zip(r.drafted, r.accepted))
    if name == "mamba2":  # (these seeded rows keep part of a window once: the replay runs)
        assert partial > 0, f"{name}: no round kept part of its drafts (the replay never ran)"


def test_kvstate_generate_runs_a_local_hybrid_model_directory(family, tmp_path, capsys):
    """``kvstate generate --model DIR`` on an mlx-lm directory of each family
    (random token workload: the tiny models have no tokenizer)."""
    from kvstate import cli

    name, _ = family
    path = th.model_dir(name, tmp_path / name)
    argv = [
        "generate",
        "--model",
        str(path),
        "--quiet",
        "--requests",
        "4",
        "--prompt-len",
        "3:9",
        "--gen-len",
        "2:6",
        "--batch-size",
        "3",
        "--arrival-gap",
        "1",
    ]
    assert cli.main(argv) == 0
    assert f"model: {path}" in capsys.readouterr().out
