"""``python -m benchmarks NAME [args]`` runs benchmark NAME; with no NAME, lists them."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).parent


def names() -> dict:
    """Benchmark name -> the first line of its docstring (read without importing it)."""
    out = {}
    for f in sorted(HERE.glob("[!_]*.py")):
        doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        out[f.stem.replace("_", "-")] = doc.splitlines()[0] if doc else ""
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known = names()
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, known))
        print("python -m benchmarks NAME [args]   (NAME --help: its options)\n")
        for name, line in known.items():
            print(f"  {name:<{width}}  {line}")
        return 0
    name = argv[0].replace("_", "-")
    if name not in known:
        print(f"unknown benchmark {argv[0]!r}; one of: {', '.join(known)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name.replace('-', '_')}")
    sys.argv = [f"python -m benchmarks {name}", *argv[1:]]
    module.main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
