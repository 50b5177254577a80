"""Fuzz ``kv.load`` over corrupted and lying files (run as a script, in its own process).

Usage: ``python tests/_fuzz_load.py DIR [--seed S] [--flips N]``

Writes valid files of every kind (kvstate: dense, quantized, ring, empty
records; mlx-lm: KVCache, QuantizedKVCache, RotatingKVCache, BatchKVCache),
then files derived from them by truncation, flipped bytes in the header and
in the data, a lying header length, lying tensor entries (dtype, shape,
offsets), and record tables and mlx-lm state that lie about each field.
Each file is loaded: the load must raise ``KVStateError`` or return records
that pass ``validate`` and take an append, a fetch, an attention read, a
trim and a rollback. Any other exception is a failure (exit 1); a crash
kills this process, which the calling test sees. Each file's name goes to
stderr before it is loaded, so a crash names its file. The last stdout line
is a JSON summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import struct
import sys
import traceback

import mlx.core as mx
from _rows import filled as ragged  # (this script's directory is on sys.path)
from mlx_lm.models import cache as lm_cache

import kvstate as kv
from kvstate.core.invariants import validate
from kvstate.kinds.rows import geometry

H, D = 2, 32


def rand(seed, *shape):
    return mx.random.normal(shape, key=mx.random.key(seed))


# --- valid files ---------------------------------------------------------------


def kvstate_files(out):
    dense = ragged(lambda b: kv.empty(b, step=8), [5, 2, 9])
    dense = kv.trim(dense, [1, 0, 2])
    quant = ragged(lambda b: kv.quantized(b, group_size=32, bits=4, step=8), [3, 6])
    ring = kv.rotating(2, max_size=6, keep=1, step=4)
    for i, n in enumerate([4, 1, 1, 3, 1]):
        ring = kv.append(ring, rand(50 + i, 2, H, n, D), rand(60 + i, 2, H, n, D))
    files = {
        "dense": [dense],
        "quant": [quant],
        "ring": [ring],
        "layers": [dense, kv.empty(3), kv.filter_rows(dense, [2, 0, 1])],
    }
    paths = {}
    for name, states in files.items():
        p = os.path.join(out, f"kv_{name}.safetensors")
        kv.save(p, states, {"note": name})  # compact: one entry per row of a layer
        paths[name] = p
    p = os.path.join(out, "kv_layers_exact.safetensors")
    kv.save(p, files["layers"], {"note": "exact"}, exact=True)  # one entry per layer
    paths["layers_exact"] = p
    return paths


def mlx_lm_caches():
    """name -> a list of mlx-lm cache objects holding a few tokens."""
    k, v = rand(1, 1, H, 7, D), rand(2, 1, H, 7, D)
    dense = lm_cache.KVCache()
    dense.update_and_fetch(k, v)
    quant = lm_cache.QuantizedKVCache(group_size=32, bits=4)
    quant.update_and_fetch(k, v)
    ring = lm_cache.RotatingKVCache(max_size=4, keep=1)
    for i in range(7):
        ring.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    batch = lm_cache.BatchKVCache([2, 0])
    batch.update_and_fetch(rand(3, 2, H, 5, D), rand(4, 2, H, 5, D))
    return {"dense": [dense], "quant": [quant], "ring": [ring], "batch": [batch]}


# Attributes of each mlx-lm cache that its file records, and lies to tell about them.
MLX_LM_LIES = {
    "offset": [-5, -1000, 10**6, 2**40],
    "_idx": [-3, 10**6],
    "keep": [-5, 100],
    "max_size": [0, -1],
    "bits": [1000000, 7, 0],
    "group_size": [0, 48, -64],
    "left_padding": [mx.array([-20, 0]), mx.array([99, 0]), mx.array([1, 2, 3])],
}


def mlx_lm_files(out):
    paths = {}
    for name, caches in mlx_lm_caches().items():
        p = os.path.join(out, f"lm_{name}.safetensors")
        lm_cache.save_prompt_cache(p, caches, {"note": name})
        paths[name] = p
        for attr, lies in MLX_LM_LIES.items():
            if not hasattr(caches[0], attr):
                continue
            for j, lie in enumerate(lies):
                bad = copy.copy(caches[0])
                setattr(bad, attr, lie)
                q = os.path.join(out, f"lm_{name}_{attr}{j}.safetensors")
                try:
                    lm_cache.save_prompt_cache(q, [bad])
                except Exception:  # mlx-lm itself cannot write this lie
                    continue
                paths[f"{name}_{attr}{j}"] = q
    return paths


# --- raw safetensors editing ---------------------------------------------------------


def split(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def records_of(header):
    return json.loads(header["__metadata__"]["kvstate.records"])


def with_records(header, entries):
    h = copy.deepcopy(header)
    h["__metadata__"]["kvstate.records"] = (
        entries if isinstance(entries, str) else json.dumps(entries)
    )
    return h


HOST_LIES = [
    -1,
    -20,
    0,
    1,
    2**31,
    2**70,
    1.5,
    "3",
    None,
    True,
    [],
    [[1]],
    {"a": 1},
    [-1, 0, 0],
    [0] * 7,
    [2**70] * 3,
    [1, 2],
]


def _slots(entries):
    """Every record entry of a table as ``(label, path)``: a layer's entry, or each
    row entry of a compact layer (a list of one-row entries)."""
    out = []
    for i, e in enumerate(entries):
        if isinstance(e, list):
            out += [(f"{i}.{r}", (i, r)) for r in range(len(e))]
        else:
            out.append((str(i), (i,)))
    return out


class _At:
    """``t[i]`` (or ``t[i][r]``) of a copied table, for one mutation."""

    def __init__(self, t, path):
        self.t, self.path = t, path

    def __getitem__(self, key):
        node = self.t
        for p in self.path[:-1]:
            node = node[p]
        return node[self.path[-1]][key]


def _get(t, path):
    for p in path:
        t = t[p]
    return t


def _set(t, path, value):
    node = t
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def lying_tables(header):
    """(label, header) pairs whose record table lies about one thing each."""
    entries = records_of(header)
    out = []
    for i, path in _slots(entries):
        e = _At(entries, path)
        for field, value in e["host"].items():
            lies = list(HOST_LIES)
            if isinstance(value, list):
                lies += [
                    [x + 1 for x in value],
                    [-x - 1 for x in value],
                    value[:-1],
                    value + value[:1],
                    list(reversed(value)),
                    [x * 1000 for x in value],
                ]
            for j, lie in enumerate(lies):
                t = copy.deepcopy(entries)
                _At(t, path)["host"][field] = lie
                out.append((f"r{i}.{field}={j}", t))
            t = copy.deepcopy(entries)
            del _At(t, path)["host"][field]
            out.append((f"r{i}.{field}.missing", t))
        for field, n in e["arrays"].items():
            for j, lie in enumerate([n + 1, max(n - 1, 0), -1, 9, 1.0, "0", None]):
                t = copy.deepcopy(entries)
                _At(t, path)["arrays"][field] = lie
                out.append((f"r{i}.arrays.{field}={j}", t))
            t = copy.deepcopy(entries)
            _At(t, path)["host"][field] = _At(t, path)["arrays"].pop(field) and None
            out.append((f"r{i}.arrays.{field}->host", t))
        for kind in ("CacheState", "QuantizedState", "RotatingState", "Checkpoint", "dict", 5):
            t = copy.deepcopy(entries)
            _set(t, path + ("kind",), kind)
            out.append((f"r{i}.kind={kind}", t))
        for j, extra in enumerate([{"bogus": 1}, {"keys": [1, 2]}]):
            t = copy.deepcopy(entries)
            _At(t, path)["host"].update(extra)
            out.append((f"r{i}.extra{j}", t))
        t = copy.deepcopy(entries)
        _set(t, path, [_get(t, path)])
        out.append((f"r{i}.notdict", t))
    out += [
        ("table.empty", []),
        ("table.dict", {"a": 1}),
        ("table.nested", "[" * 5000 + "]" * 5000),
        ("table.badjson", '[{"kind": '),
        ("table.string", '"x"'),
        ("table.dup", entries + entries[:1]),
    ]
    return [(label, with_records(header, t)) for label, t in out]


def lying_tensors(header):
    out = []
    names = [k for k in header if k != "__metadata__"]
    for name in names:
        t = header[name]
        lies = {
            "dtype": ["F16", "I32", "U8", "F64", "BOGUS", 3, "BF16"],
            "shape": [
                t["shape"][:-1],
                t["shape"] + [1],
                [x * 2 for x in t["shape"]],
                [0] * len(t["shape"]),
                [-1] + t["shape"][1:],
                [2**62] * 2,
                "x",
            ],
            "data_offsets": [
                [0, 0],
                [t["data_offsets"][1], t["data_offsets"][0]],
                [t["data_offsets"][0] + 4, t["data_offsets"][1] + 4],
                [0, 2**62],
                [-8, t["data_offsets"][1]],
                [0],
            ],
        }
        for field, values in lies.items():
            for j, lie in enumerate(values):
                h = copy.deepcopy(header)
                h[name][field] = lie
                out.append((f"{name}.{field}{j}", h))
        h = copy.deepcopy(header)
        h[name + "x"] = h.pop(name)
        out.append((f"{name}.renamed", h))
        h = copy.deepcopy(header)
        h[name] = [1, 2]
        out.append((f"{name}.notdict", h))
    if len(names) >= 2:  # two tensors over one span
        h = copy.deepcopy(header)
        h[names[1]]["data_offsets"] = h[names[0]]["data_offsets"]
        out.append(("overlap", h))
    h = copy.deepcopy(header)
    h["__metadata__"] = {"kvstate.format": "2"}
    out.append(("format2", h))
    h = copy.deepcopy(header)
    h["__metadata__"] = [1]
    out.append(("metadata.list", h))
    return out


def mutations(path, rng, flips):
    """(label, bytes) of files derived from the valid file ``path``."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    end = 8 + n
    cuts = sorted(
        {0, 1, 7, 8, 9, end // 2, end - 1, end, end + 1, (end + len(raw)) // 2, len(raw) - 1}
        | {rng.randrange(len(raw)) for _ in range(4)}
    )
    for c in cuts:
        if c < len(raw):
            yield f"cut{c}", raw[:c]
    for _ in range(flips):  # header bytes
        pos = rng.randrange(8, end)
        b = bytearray(raw)
        b[pos] ^= 1 << rng.randrange(8)
        yield f"hflip{pos}", bytes(b)
    for _ in range(flips // 2):  # data bytes
        if end >= len(raw):
            break
        pos = rng.randrange(end, len(raw))
        b = bytearray(raw)
        b[pos] = rng.randrange(256)
        yield f"dflip{pos}", bytes(b)
    for lie in (0, 1, n - 1, n + 1, len(raw), 2**63, 100_000_000):
        yield f"hlen{lie}", struct.pack("<Q", lie) + raw[8:]
    header, data = split(path)
    for label, h in lying_tensors(header):
        text = json.dumps(h).encode()
        yield label, struct.pack("<Q", len(text)) + text + data
    if "kvstate.records" in header.get("__metadata__", {}):
        for label, h in lying_tables(header):
            text = json.dumps(h).encode()
            yield label, struct.pack("<Q", len(text)) + text + data


# --- loading and using --------------------------------------------------------------------


def exercise(states):
    """Use every loaded record; KVStateError is an allowed answer, nothing else."""
    for s in states:
        validate(s)
        if s.keys is not None:
            use(s)


def use(s):
    """Every operation once on ``s`` (a loaded, valid record holding keys)."""
    Hk, Dk, Dv, dtype = geometry(s)
    B = s.batch_size
    k = mx.zeros((B, Hk, 1, Dk), dtype)
    v = mx.zeros((B, Hk, 1, Dv), dtype)
    for step in (
        lambda: kv.append(s, k, v),
        lambda: kv.fetch(s),
        lambda: kv.attend(kv.append(s, k, v), mx.zeros((B, Hk, 1, Dk), dtype), scale=0.1),
        lambda: kv.trim(s, 1),
        lambda: kv.rollback(kv.append(s, k, v), kv.checkpoint(s), 1),
        lambda: kv.filter_rows(s, list(reversed(range(B)))),
        lambda: kv.extract_row(s, B - 1),
        lambda: kv.merge_rows([s, s]),
    ):
        try:
            out = step()
        except kv.KVStateError:
            continue
        mx.eval(out.planes if hasattr(out, "planes") else out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flips", type=int, default=12)
    args = p.parse_args()
    rng = random.Random(args.seed)
    valid = {**kvstate_files(args.dir), **{f"lm_{k}": v for k, v in mlx_lm_files(args.dir).items()}}
    counts = {"files": 0, "refused": 0, "loaded": 0, "failures": 0}
    target = os.path.join(args.dir, "fuzz.safetensors")

    def attempt(label, raw=None, path=None):
        counts["files"] += 1
        if raw is not None:
            with open(target, "wb") as f:
                f.write(raw)
            path = target
        print(label, file=sys.stderr, flush=True)
        try:
            states, _ = kv.load(path)
        except kv.KVStateError:
            counts["refused"] += 1
            return
        except Exception:
            counts["failures"] += 1
            print(f"FAIL {label}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            return
        try:
            exercise(states)
            counts["loaded"] += 1
        except Exception:
            counts["failures"] += 1
            print(f"FAIL using {label}\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    for name, path in sorted(valid.items()):
        attempt(f"{name} (as written)", path=path)
        if "_" in name.removeprefix("lm_") and name.startswith("lm_"):
            continue  # a lying mlx-lm file: loaded as written only
        for label, raw in mutations(path, rng, args.flips):
            attempt(f"{name} {label}", raw=raw)
    print(json.dumps(counts))
    return 1 if counts["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
