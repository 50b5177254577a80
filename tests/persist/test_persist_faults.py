"""File faults: ``kv.load`` of corrupted and lying files, and an atomic, durable ``kv.save``.

The fuzz runs ``tests/_fuzz_load.py`` in a subprocess, so a crash (MLX's
loaders do not bounds-check every offset) fails this test instead of
killing the run. Save is checked against a process killed mid-write and a
writer that fails half-way: the previous file always survives whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import pytest

import kvstate as kv
from kvstate.persist import files as persist

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, with _fuzz_load.py


def run(args, timeout=300, **kw):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(TESTS),
        **kw,
    )


def test_load_fuzz_refuses_or_loads_valid_records(tmp_path):
    out = run([os.path.join(TESTS, "_fuzz_load.py"), str(tmp_path)])
    tail = out.stderr[-3000:]
    assert out.returncode == 0, f"fuzz process exited {out.returncode}\n{tail}"
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    print("load fuzz:", counts)
    assert counts["failures"] == 0, tail
    assert counts["files"] >= 1500, counts
    # both answers occur: the fuzz is not all-refused (flipped data bytes load
    # as valid records) nor all-loaded
    assert counts["refused"] > 1000 and counts["loaded"] > 50, counts


def state(seed, B=2, N=16):
    k = mx.random.normal((B, 2, N, 32), key=mx.random.key(seed))
    return kv.append(kv.empty(B, step=16), k, k + 1)


def same(a, b):
    return (
        all(mx.array_equal(x, y).item() for x, y in zip(a.planes, b.planes))
        and a.lengths == b.lengths
        and a.left_pad == b.left_pad
    )


def test_failed_save_leaves_the_previous_file(tmp_path, monkeypatch):
    p = tmp_path / "c.safetensors"
    kv.save(p, [state(0)], {"gen": "0"})
    before = p.read_bytes()

    def torn(path, arrays, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)  # half a file, then the disk fills up
        raise RuntimeError("No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", torn)
    with pytest.raises(kv.KVStateError, match="path: expected a file kvstate can write"):
        kv.save(p, [state(1)], {"gen": "1"})
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors"]  # no temporary left


def test_save_into_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(kv.KVStateError, match="path: expected a file in an existing directory"):
        kv.save(tmp_path / "no" / "c.safetensors", [state(0)])


def test_save_refuses_metadata_load_cannot_read(tmp_path):
    """mlx refuses a header of 100 MB or more: save refuses to write one."""
    p = tmp_path / "c.safetensors"
    kv.save(p, [state(0)])
    before = p.read_bytes()
    with pytest.raises(kv.KVStateError, match="metadata: expected under 100000000 bytes"):
        kv.save(p, [state(1)], {"big": "x" * 200_000_000})
    assert p.read_bytes() == before
    assert persist.HEADER_LIMIT == 100_000_000


@pytest.mark.slow
def test_what_save_writes_load_reads_at_the_header_limit(tmp_path):
    """Just under the limit by the metadata count, the exact header is checked
    after writing: whatever save accepts, load reads."""
    p = tmp_path / "c.safetensors"
    s = state(0)
    for size in (persist.HEADER_LIMIT - 5_000, persist.HEADER_LIMIT - 400):
        meta = {"big": "x" * size}
        try:
            kv.save(p, [s], meta)
        except kv.KVStateError as e:
            assert "header" in str(e) or "metadata" in str(e)
            continue
        (got,), back = kv.load(p)
        assert back == meta and same(got, s)


WRITER = textwrap.dedent("""
    import sys, mlx.core as mx, kvstate as kv
    path = sys.argv[1]
    k = mx.random.normal((4, 8, 4096, 64), key=mx.random.key(0))  # 32 MiB per plane
    states = [kv.append(kv.empty(4), k, k), kv.append(kv.empty(4), -k, -k)]
    mx.eval([s.planes for s in states])
    print("ready", flush=True)
    i = 0
    while True:
        kv.save(path, [states[i % 2]], {"gen": str(i)})
        i += 1
""")


def test_a_save_killed_midway_leaves_a_whole_file(tmp_path):
    """SIGKILL a process that saves 64 MiB files over one path in a loop: the
    path always holds one complete file (in place, 3 kills of 3 tore it)."""
    p = tmp_path / "c.safetensors"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    for kill in range(3):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(p)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            deadline = time.time() + 60
            while not p.exists() and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2 + 0.37 * kill)  # somewhere inside a later save
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        (got,), meta = kv.load(p)
        gen = int(meta["gen"])
        assert got.lengths == (4096,) * 4
        assert mx.array_equal(got.keys[0, 0, 0], got.values[0, 0, 0]).item()
        sign = 1 if gen % 2 == 0 else -1
        k = mx.random.normal((4, 8, 4096, 64), key=mx.random.key(0))
        assert mx.array_equal(got.keys, sign * k).item(), f"kill {kill}: gen {gen} torn"
