"""The house rules that a reader cannot see in one file: every piece of
process-wide state is the documented one (``notes/core.md``, "Process-wide state")."""

from __future__ import annotations

import functools
import importlib
import itertools
import pkgutil
import re
import threading
import types
from pathlib import Path

import kvstate

# Module-level tables that are never written (lookups), by module.
CONSTANTS = {
    "kvstate.batch": {"ROW"},
    "kvstate.bridge.forward": {"_UNSIGNED"},
    "kvstate.core.layers": {"_MODEL_IMPLS"},
    "kvstate.distributed.links": {"_KINDS"},
    "kvstate.distributed.rows": {"_KINDS"},
    "kvstate.distributed.wire": {"_DTYPES", "_ITEMS"},
    "kvstate.kernels.cuda": {"_QUANT", "_PLAIN"},
    "kvstate.models.gguf": {"_LAYER_NAMES", "_TOP_NAMES"},
    "kvstate.persist.files": {"RECORDS", "DTYPES"},
    "kvstate.serving.grammar": {"JSON_OPTIONS"},
    "kvstate.serving.request": {
        *("SAMPLING", "COMMON", "CHAT_FIELDS", "COMPLETION_FIELDS", "METADATA", "REFUSED"),
        *("STRUCTURED", "_STRUCTURED", "_GUIDED"),
    },
}

_LOCK = type(threading.Lock())


def _stateful(value) -> bool:
    return isinstance(
        value, (dict, list, set, functools._lru_cache_wrapper, itertools.count, _LOCK)
    )


def found_state() -> set:
    """``module.name`` of every module-level mutable object in kvstate/, and of every
    name a ``global`` statement rebinds."""
    out = set()
    for info in pkgutil.walk_packages(kvstate.__path__, "kvstate."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.startswith("__") or isinstance(value, (types.ModuleType, type)):
                continue
            if getattr(value, "__module__", module.__name__) != module.__name__:
                continue  # imported from elsewhere: counted where it lives
            if _stateful(value) and name not in CONSTANTS.get(module.__name__, ()):
                out.add(f"{module.__name__}.{name}")
        source = Path(module.__file__).read_text()
        for names in re.findall(r"^\s+global (\w+(?:, *\w+)*) *(?:#.*)?$", source, flags=re.M):
            out |= {f"{module.__name__}.{n.strip()}" for n in names.split(",")}
    return out


def documented_state() -> set:
    """The names in the first column of notes/core.md's "Process-wide state" table."""
    note = (Path(kvstate.__file__).parent.parent / "notes" / "core.md").read_text()
    table = note.split("## Process-wide state", 1)[1].split("\n## ", 1)[0]
    out = set()
    for row in re.findall(r"^\| `([^|]+)\|", table, flags=re.M):
        first = re.findall(r"`([\w.]+)`", "`" + row)
        if not first:
            continue
        module = first[0].rsplit(".", 1)[0]
        out.add("kvstate." + first[0])
        out |= {f"kvstate.{module}.{n}" for n in first[1:] if "." not in n}
    return out


def test_every_piece_of_process_state_is_documented():
    found, documented = found_state(), documented_state()
    assert found - documented == set(), "state the note does not list"
    assert documented >= found


def test_the_check_finds_state():
    """The walk sees a planted cache (the test can fail)."""
    module = importlib.import_module("kvstate.core.ops")
    module._planted = {}  # type: ignore[attr-defined]
    try:
        assert "kvstate.core.ops._planted" in found_state()
    finally:
        del module._planted  # type: ignore[attr-defined]
