"""Run a worker as ``n`` processes of one ``mx.distributed`` ring on localhost.

The ranks are plain subprocesses with the environment ``mlx.launch --backend
ring`` gives them (``MLX_RANK``, ``MLX_HOSTFILE`` naming one loopback port
per rank). Every rank has a deadline: a hang kills them all and fails the
test instead of hanging CI. Each rank prints one JSON object as its last
stdout line; ``run_ranks`` returns them by rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstate.kernels import cuda as kernels

WORKER = Path(__file__).with_name("_dist_worker.py")

# A rank's deadline: past it the test fails as a hang. On MLX's CUDA backend a
# rank compiles its kernels at first use (NVRTC, cached on disk per machine):
# on the H200 a migration pair ran 38.7 s with kernels already
# cached by earlier tests and was cut at 60 s as the run's first test.
DEADLINE = 240.0 if kernels.kernel_available() else 60.0


def free_ports(n: int) -> list:
    """``n`` loopback ports the OS had free a moment ago."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_ranks(*args: str, n: int = 2, timeout: float = DEADLINE) -> list:
    """Run ``_dist_worker.py *args`` on ``n`` ranks; their JSON results by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "PYTHONUNBUFFERED": "1"}
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env={**env, "MLX_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(n)
        ]
        deadline = time.monotonic() + timeout
        outs = []
        try:
            for r, p in enumerate(procs):
                try:
                    out, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"rank {r} of {args} still running after {timeout} s (a hang)"
                    ) from None
                assert p.returncode == 0, f"rank {r} of {args} exited {p.returncode}:\n{err}"
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    return outs


def launch(*args: str, n: int = 2, timeout: float = DEADLINE + 30) -> str:
    """``mlx.launch -n n --backend ring args...`` on loopback; its stdout.

    The launcher and its ranks run in their own session, killed whole on
    timeout (a hang fails the test).
    """
    cmd = [
        sys.executable,
        "-c",
        "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
        "-n",
        str(n),
        "--backend",
        "ring",
        "--starting-port",
        str(free_ports(1)[0]),
        "--python",
        sys.executable,
        *args,
    ]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        raise AssertionError(f"mlx.launch {args} still running after {timeout} s") from None
    assert p.returncode == 0, f"mlx.launch {args} exited {p.returncode}:\n{err}"
    return out
