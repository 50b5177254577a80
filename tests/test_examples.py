"""Every program in ``examples/`` runs (a subprocess each, as a user runs it) and exits 0;
each one checks its own tokens against mlx-lm and exits 1 when they differ."""

import ast
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


@pytest.mark.parametrize("name", PROGRAMS)
def test_example_runs(name):
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        check=False,
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"{name} exited {run.returncode}:\n{run.stdout}\n{run.stderr}"


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


def test_continuous_batching_is_no_longer_than_mlx_lms_batch_generator():
    path = EXAMPLES / "continuous_batching.py"
    ours, theirs = code_lines(path, "kvstate_loop"), code_lines(path, "mlx_lm_loop")
    print(
        f"continuous batching with per-row sampling: kvstate {ours} lines, "
        f"mlx-lm BatchGenerator {theirs} lines"
    )
    assert ours <= theirs
