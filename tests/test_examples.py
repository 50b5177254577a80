"""Every program in ``examples/`` runs (a subprocess each, as a user runs it, on this
checkout's kvstate) and exits 0; each one checks its own tokens against mlx-lm and exits
1 when they differ. The programs print text, not token ids."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The programs a user runs as ``python examples/NAME``; examples that need a launcher
# (``disaggregated.py``: ``mlx.launch``) have their own tests.
PROGRAMS = [
    "compiled_decode.py",
    "continuous_batching.py",
    "session.py",
    "speculative.py",
    "tour.py",
]
TEXT = ["continuous_batching.py", "session.py", "speculative.py"]  # the ones that generate


@pytest.mark.parametrize("name", PROGRAMS)
def test_example_runs(name):
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}  # this checkout's kvstate
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        check=False,
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, f"{name} exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
    if name in TEXT:  # what the model wrote, quoted, and no list of token ids
        assert re.search(r"'[^']+'", run.stdout), f"{name} prints no text:\n{run.stdout}"
        assert not re.search(r"\[\d+, \d+", run.stdout), f"{name} prints ids:\n{run.stdout}"


def code_lines(path: Path, function: str) -> int:
    """Lines of ``function``'s source that hold code (no blank, comment or docstring line)."""
    source = path.read_text()
    node = next(
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == function
    )
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    doc = ast.get_docstring(node)
    skip = set()
    if doc is not None:
        first = node.body[0]
        skip = set(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for i, line in enumerate(lines, start=node.lineno)
        if line.strip() and not line.strip().startswith("#") and i not in skip
    )


@pytest.mark.parametrize(
    "ours, theirs, what",
    [
        ("kvstate_text", "mlx_lm_text", "text in, text out, stop tokens, a batch limit"),
        ("kvstate_loop", "mlx_lm_loop", "arrivals and per-row sampling"),
    ],
)
def test_continuous_batching_is_no_longer_than_mlx_lms_batch_generator(ours, theirs, what):
    path = EXAMPLES / "continuous_batching.py"
    n, m = code_lines(path, ours), code_lines(path, theirs)
    print(f"continuous batching, {what}: kvstate {n} lines, mlx-lm BatchGenerator {m} lines")
    assert n <= m
