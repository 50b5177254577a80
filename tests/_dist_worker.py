"""One rank of the two-process tests (``tests/_launch.py`` starts it).

``python _dist_worker.py CASE [ARGS]``: joins the ring group from the
environment, runs CASE, prints one JSON object. The scenarios are functions
the tests also run in a single process, unsharded, as the reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx
import numpy as np
from tiny_models import llama_model, prompt

import kvstate as kv
import kvstate.mlx_lm as kl
from kvstate.distributed.rows import recv_rows, send_rows

WINDOW = 6  # sliding layers wrap within the few tokens the tests generate
CONFIGS = {  # name -> (model kwargs, make_states kwargs): every record kind
    "dense+ring": ({"layers": 2, "sliding_window": WINDOW}, {}),
    "quantized+ring": (
        {"layers": 2, "sliding_window": WINDOW},
        {"kv_bits": 8, "kv_group_size": 32},
    ),
}
PROMPTS = {"a": prompt(11, 5), "b": prompt(12, 3), "c": prompt(13, 7), "d": prompt(14, 4)}


def greedy(logits) -> list:
    return mx.argmax(logits, axis=-1).tolist()


# --- tensor parallelism -------------------------------------------------------------


def tp_scenario(model) -> dict:
    """A ragged batch with rows joining and leaving, eager and compiled steps.

    Returns each request's tokens and the KV heads each layer's record holds.
    """
    decode = kv.compiled_decoder(model, attention="mask")
    names = ["a", "b"]
    logits, states = kl.prefill(model, [PROMPTS[n] for n in names])
    nxt = greedy(logits)
    out = {n: [t] for n, t in zip(names, nxt)}

    def run(steps, compiled):
        nonlocal states, nxt
        for _ in range(steps):
            if compiled:
                logits, states = decode(mx.array(nxt), states)
            else:
                logits, states = kl.step(model, mx.array(nxt), states)
            nxt = greedy(logits)
            for n, t in zip(names, nxt):
                out[n].append(t)

    run(3, compiled=False)
    logits, joined = kl.prefill(model, [PROMPTS["c"]])  # row c joins
    states = kl.extend(states, joined)
    names, nxt = names + ["c"], nxt + greedy(logits)
    out["c"] = [nxt[-1]]
    run(3, compiled=True)
    states = kl.filter_rows(states, [1, 2])  # row a leaves
    names, nxt = names[1:], nxt[1:]
    run(2, compiled=False)
    run(2, compiled=True)
    heads = [
        s.keys.shape[1]
        if s.keys is not None and not isinstance(s.keys, tuple)
        else s.keys[0].shape[1]
        for s in states
    ]
    return {"tokens": out, "heads": heads, "kinds": [type(s).__name__ for s in states]}


def case_tp(group) -> dict:
    model = llama_model(**CONFIGS["dense+ring"][0])
    model.shard(group)
    return tp_scenario(model)


# --- row migration ------------------------------------------------------------------


def digest(states) -> str:
    """SHA-256 of a one-row list of records: host fields and every plane's bytes."""
    h = hashlib.sha256()
    for s in states:
        h.update(repr((type(s).__name__, s.lengths, s.left_pad, getattr(s, "held", None))).encode())
        for p in s.planes:
            h.update(str(p.dtype).encode() + str(p.shape).encode())
            h.update(np.array(p).tobytes())
    return h.hexdigest()


def generate_alone(config: str, name: str, steps: int) -> list:
    """The single-process reference: one request, prefill then ``steps`` decode steps."""
    margs, make = CONFIGS[config]
    model = llama_model(**margs)
    logits, states = kl.prefill(model, [PROMPTS[name]], **make)
    toks = greedy(logits)
    for _ in range(steps):
        logits, states = kl.step(model, mx.array(toks[-1:]), states)
        toks += greedy(logits)
    return toks


BEFORE, AFTER = 2, 3  # decode steps on the prefill rank, then on the decode rank


def case_migrate(group, transport: str) -> dict:
    """``migrate_one`` for every config, on one link."""
    return {config: migrate_one(group, config, transport) for config in CONFIGS}


def migrate_one(group, config: str, transport: str) -> dict:
    """Rank 0 prefills a, b, c and decodes BEFORE steps, then sends rows c and a
    (in that order) to rank 1, which holds d; both decode AFTER more steps."""
    margs, make = CONFIGS[config]
    model = llama_model(**margs)
    rank = group.rank()
    names = ["a", "b", "c"] if rank == 0 else ["d"]
    logits, states = kl.prefill(model, [PROMPTS[n] for n in names], **make)
    toks = {n: [t] for n, t in zip(names, greedy(logits))}
    for _ in range(BEFORE):
        logits, states = kl.step(model, mx.array([toks[n][-1] for n in names]), states)
        for n, t in zip(names, greedy(logits)):
            toks[n].append(t)
    out = {}
    # p2p waits in the caller's thread (timeout=None); the collective on the
    # waiter thread, as transport="auto" runs it by default on a GPU (its
    # streams are the waiter thread's own; the other cases run p2p there on a CPU).
    timeout = None if transport == "p2p" else 60.0
    threads = len(os.listdir("/proc/self/task"))
    t0 = time.perf_counter()
    if rank == 0:
        moved = [2, 0]
        out["sent"] = [digest(kl.extract_row(states, r)) for r in moved]
        note = {n: toks[n] for n in ("c", "a")}
        states = send_rows(
            states, moved, 1, note=note, group=group, transport=transport, timeout=timeout
        )
        names = ["b"]
        out["sent_tokens"] = {n: toks.pop(n) for n in ("c", "a")}
    else:
        states, note = recv_rows(states, 0, group=group, transport=transport, timeout=timeout)
        out["received"] = [digest(kl.extract_row(states, r)) for r in (1, 2)]
        names += list(note)
        toks.update(note)
    out["seconds"] = time.perf_counter() - t0
    out["new_threads"] = len(os.listdir("/proc/self/task")) - threads
    decode = kv.compiled_decoder(model, attention="mask")
    for i in range(AFTER):
        tokens = mx.array([toks[n][-1] for n in names])
        logits, states = decode(tokens, states) if i % 2 else kl.step(model, tokens, states)
        for n, t in zip(names, greedy(logits)):
            toks[n].append(t)
    out["tokens"] = toks
    out["rows"] = [list(s.lengths) for s in states]
    return out


# --- a kv.Batch in flight: pending tokens, keys, sampling, ids, payload move too ---------

SAMPLING = kv.Sampling(temperature=0.8, top_k=20)
SEEDS = {"a": 1, "b": 2, "c": 3, "d": 4}


def sample_alone(name: str, steps: int) -> list:
    """The single-process reference: one request sampled alone with its seed."""
    model = llama_model(layers=2)
    b = kl.admit(model, [PROMPTS[name]], sampling=SAMPLING, seeds=[SEEDS[name]])
    out = b.tokens.tolist()
    for _ in range(steps):
        b = kl.advance(model, b)
        out += b.tokens.tolist()
    return out


def case_batch(group) -> dict:
    """Rank 0 admits a, b, c and samples BEFORE steps, then sends its kv.Batch's
    rows c and a to rank 1 (which holds d); both sample AFTER more steps."""
    model = llama_model(layers=2)
    rank = group.rank()
    names = ["a", "b", "c"] if rank == 0 else ["d"]
    b = kl.admit(
        model,
        [PROMPTS[n] for n in names],
        sampling=SAMPLING,
        seeds=[SEEDS[n] for n in names],
        ids=names,
        payload=[{"user": n} for n in names],
    )
    toks = {n: [t] for n, t in zip(names, b.tokens.tolist())}
    for _ in range(BEFORE):
        b = kl.advance(model, b)
        for n, t in zip(b.ids, b.tokens.tolist()):
            toks[n].append(t)
    out = {}
    if rank == 0:
        b = send_rows(b, [2, 0], 1, group=group)
        out["sent_tokens"] = {n: toks.pop(n) for n in ("c", "a")}
    else:
        b, _ = recv_rows(b, 0, group=group)
        toks.update({n: [] for n in b.ids if n not in toks})
    out["ids"], out["payload"] = list(b.ids), list(b.payload)
    out["sampling"] = [attrs_dict(s) for s in b.sampling]
    decode = kv.compiled_decoder(model, attention="mask")
    for i in range(AFTER):
        b = kl.advance(model, b, step=decode if i % 2 else None)
        for n, t in zip(b.ids, b.tokens.tolist()):
            toks[n].append(t)
    out["tokens"] = toks
    return out


def attrs_dict(x) -> dict:
    import attrs

    return attrs.asdict(x)


# --- bad input ----------------------------------------------------------------------


def _outcome(fn) -> dict:
    t0 = time.perf_counter()
    try:
        fn()
    except kv.KVStateError as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


def case_errors(group) -> dict:
    """Bad sends, each met by a waiting receiver, then a good one on the same link."""
    rank = group.rank()
    model = llama_model(layers=2)
    _, dense = kl.prefill(model, [PROMPTS["a"], PROMPTS["b"]])
    _, quant = kl.prefill(model, [PROMPTS["c"]], kv_bits=8, kv_group_size=32)
    out = {}
    if rank == 0:
        out["geometry"] = _outcome(lambda: send_rows(dense, [0], 1, group=group))
        out["rows"] = _outcome(lambda: send_rows(dense, [5], 1, group=group))
        out["note"] = _outcome(lambda: send_rows(dense, [0], 1, note={1, 2}, group=group))
        out["container"] = _outcome(lambda: send_rows(dense, [0], 1, group=group))
        left = send_rows(dense, [1], 1, group=group)
        out["good"] = [list(s.lengths) for s in left]
        out["dst"] = _outcome(lambda: send_rows(dense, [0], 2, group=group))
        time.sleep(2.5)  # stay on the ring: rank 1 must time out, not see rank 0 leave
    else:
        out["geometry"] = _outcome(lambda: recv_rows(quant, 0, group=group))
        out["rows"] = _outcome(lambda: recv_rows(dense, 0, group=group))
        out["note"] = _outcome(lambda: recv_rows(dense, 0, group=group))
        pending = kv.Batch(dense, [1, 2])  # a kv.Batch expects a kv.Batch's rows
        out["container"] = _outcome(lambda: recv_rows(pending, 0, group=group))
        got, _ = recv_rows(dense, 0, group=group)
        out["good"] = [list(s.lengths) for s in got]
        out["dst"] = _outcome(lambda: recv_rows(dense, 0, group=group, timeout=1.0))
    return out


# --- a peer that died ---------------------------------------------------------------


def case_lost(group, role: str, transport: str) -> dict:
    """Rank 0 leaves at once (``main`` prints its result and exits); rank 1 then
    calls ``recv_rows`` (``role`` "recv") or ``send_rows`` ("send") with it."""
    if group.rank() == 0:
        return {"left": True}
    k = mx.ones((1, 2, 3, 4))
    states = [kv.append(kv.empty(1), k, k)]
    kw = {"group": group, "transport": transport, "timeout": 20.0}
    t0 = time.perf_counter()
    try:
        if role == "recv":
            recv_rows(states, 0, **kw)
        else:
            send_rows(states, [0], 0, **kw)
    except kv.KVStateError as e:
        out = {"error": str(e), "type": type(e).__name__, "cause": type(e.__cause__).__name__}
        return {**out, "seconds": time.perf_counter() - t0}
    return {"error": None, "seconds": time.perf_counter() - t0}


CASES = {
    "tp": case_tp,
    "migrate": case_migrate,
    "batch": case_batch,
    "errors": case_errors,
    "lost": case_lost,
}


def main(argv) -> None:
    group = mx.distributed.init(backend="ring", strict=True)
    result = CASES[argv[0]](group, *argv[1:])
    result["rank"] = group.rank()
    print(json.dumps(result), flush=True)
    # The "dst" case leaves a receive pending on a blocked stream: leave at once.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
