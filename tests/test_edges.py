"""Edges an adversarial trial found, each refused by name or cleaned up.

A row count past ``MAX_ROWS`` (``kv.empty(10**12)`` ran out of memory,
``kv.fork(s, 0, 10**7)`` never answered), a migration peer whose process died
(MLX's ``RuntimeError`` where ``KVStateError`` is promised), and the partial
files that killed saves leave beside their target.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import pytest
from _launch import run_ranks
from _rows import assert_unchanged, snapshot
from tiny_models import llama_model

import kvstate as kv
from kvstate.core.invariants import MAX_ROWS, fresh_row_ids
from kvstate.errors import LinkError
from kvstate.persist import files as persist

HUGE = 10**12


def one_row(seed=0):
    k = mx.random.normal((1, 2, 3, 4), key=mx.random.key(seed))
    return kv.append(kv.empty(1), k, -k)


def refused(call, *fragments) -> str:
    """``call()`` raises KVStateError naming ``fragments``, and draws no row id."""
    before = fresh_row_ids(1)[0]
    with pytest.raises(kv.KVStateError) as info:
        call()
    assert fresh_row_ids(1)[0] == before + 1  # the failed call made no row
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


# --- 1. a batch size past MAX_ROWS -----------------------------------------------------

CONSTRUCTORS = {
    "empty": lambda b: kv.empty(b),
    "rotating": lambda b: kv.rotating(b, max_size=4),
    "quantized": lambda b: kv.quantized(b),
    "recurrent_state": lambda b: kv.recurrent_state(b, slots=2),
    "chunked_state": lambda b: kv.chunked_state(b, chunk_size=4),
}


@pytest.mark.parametrize("make", CONSTRUCTORS.values(), ids=CONSTRUCTORS.keys())
def test_a_batch_size_past_max_rows_is_refused_by_name(make):
    msg = refused(
        lambda: make(HUGE),
        f"batch_size: expected at most {MAX_ROWS} (MAX_ROWS",
        f"got {HUGE} (",
        f"{52 * HUGE:,} bytes of host memory",
    )
    assert re.fullmatch(r"batch_size: expected .+, got .+ bytes of host memory .+", msg), msg
    refused(lambda: make(MAX_ROWS + 1), f"got {MAX_ROWS + 1}")
    refused(lambda: make(-1), "batch_size: expected >= 0, got -1")
    assert make(MAX_ROWS).batch_size == MAX_ROWS  # the bound itself is allowed


def test_make_states_refuses_a_batch_size_past_max_rows():
    from kvstate.mlx_lm import make_states

    model = llama_model(layers=2)
    refused(lambda: make_states(model, HUGE), "batch_size: expected at most", f"got {HUGE}")
    assert [s.batch_size for s in make_states(model, 2)] == [2, 2]


# --- 2. fork past MAX_ROWS: refused at once -----------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "shared", "layers"])
def test_fork_past_max_rows_is_refused_at_once(kind):
    base = kv.merge_rows([one_row(0), one_row(1)])
    state = {"dense": base, "shared": kv.fork(base, 0, 1), "layers": [base, base]}[kind]
    B = 3 if kind == "shared" else 2
    snaps = [snapshot(s) for s in (state if isinstance(state, list) else [state])]
    t0 = time.perf_counter()
    refused(
        lambda: kv.fork(state, 0, 10**7),
        f"n: expected at most {MAX_ROWS - B} (MAX_ROWS = {MAX_ROWS}",
        f"the record holds {B})",
        f"got {10**7} ({10**7 + B} rows: at least",
    )
    assert time.perf_counter() - t0 < 1.0
    refused(lambda: kv.fork(state, 0, MAX_ROWS - B + 1), f"got {MAX_ROWS - B + 1}")
    for s, snap in zip(state if isinstance(state, list) else [state], snaps):
        assert_unchanged(s, snap)
    got = kv.fork(state, 0, MAX_ROWS - B)  # up to the bound in all
    assert (got[0] if isinstance(got, list) else got).batch_size == MAX_ROWS


# --- 3. a migration peer that died ----------------------------------------------------------


def test_link_error_is_a_kvstate_error():
    assert issubclass(LinkError, kv.KVStateError)


@pytest.mark.skipif(
    not mx.distributed.is_available("ring"), reason="this MLX build has no ring backend"
)
@pytest.mark.parametrize("transport", ["p2p", "collective"])
@pytest.mark.parametrize("role", ["recv", "send"])
def test_a_peer_that_died_raises_kvstate_error_naming_it(role, transport):
    """Rank 0 exits before the migration; rank 1's ``recv_rows`` / ``send_rows``
    raises LinkError (a KVStateError) naming rank 0 and itself, at once."""
    left, survivor = run_ranks("lost", role, transport, timeout=120)
    assert left["left"]
    assert survivor["type"] == "LinkError" and survivor["cause"] == "RuntimeError", survivor
    assert survivor["error"].startswith(
        "rank 0: expected a live link to this process (rank 1), got MLX's RuntimeError: "
    ), survivor
    assert survivor["seconds"] < 10, survivor  # the lost link, not the 20 s timeout


# --- 4. partial files of killed saves -------------------------------------------------------

KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import mlx.core as mx
    import kvstate as kv

    def killed(path, arrays, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\\x00" * 100)  # half a file, then the process is killed
        os.kill(os.getpid(), signal.SIGKILL)

    mx.save_safetensors = killed
    k = mx.ones((1, 2, 3, 4))
    kv.save(sys.argv[1], [kv.append(kv.empty(1), k, k)])
""")


def partials(directory) -> list:
    return sorted(os.path.basename(p) for p in glob.glob(f"{directory}/.*.partial.safetensors"))


def test_save_removes_the_partial_file_a_killed_save_left(tmp_path):
    p = tmp_path / "c.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, str(p)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr
    (left,) = partials(tmp_path)
    assert left.startswith(".c.safetensors.") and not p.exists()
    s = one_row()
    kv.save(p, [s])
    assert partials(tmp_path) == []
    (got,), _ = kv.load(p)
    assert got.lengths == s.lengths
    assert mx.array_equal(got.keys, s.keys).item() and mx.array_equal(got.values, s.values).item()


def test_save_keeps_partial_files_of_live_saves_and_other_targets(tmp_path):
    """Removed: the older form (no process named). Kept: a partial file of a
    live process (a save in progress) and the stale partial file of another target."""
    old = tmp_path / ".c.safetensors.0123456789ab.partial.safetensors"
    live = persist._partial_path(str(tmp_path), "c.safetensors")  # this process's
    other = tmp_path / ".d.safetensors.0123456789ab.partial.safetensors"
    for f in (old, live, other):
        open(f, "wb").write(b"\x00" * 100)
    kv.save(tmp_path / "c.safetensors", [one_row()])
    assert partials(tmp_path) == sorted([os.path.basename(live), other.name])
    assert kv.load(tmp_path / "c.safetensors")[0][0].lengths == (3,)
