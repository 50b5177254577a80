"""The public namespace: ``kvstate.__all__``, module names, registration names, version."""

import importlib
import importlib.metadata
import importlib.util
import inspect
import pkgutil
import re
import types
from pathlib import Path

import attrs
import pytest

import kvstate as kv


def test_all_lists_the_public_api_and_nothing_missing():
    assert len(kv.__all__) == len(set(kv.__all__))
    for name in kv.__all__:
        assert hasattr(kv, name), name
    for name in (
        "next_mask",
        "append",
        "fetch",
        "attend",
        "rotating",
        "quantized",
        "empty",
        "flatten",
        "unflatten",
        "compiled_decoder",
        "MaskMemo",
        "KVStateError",
    ):
        assert name in kv.__all__
    star = {}
    exec("from kvstate import *", star)
    assert {n for n in star if not n.startswith("__")} == set(kv.__all__)


def test_no_exported_name_shadows_a_module():
    """An exported name is never also a submodule (``kv.rotating`` is the
    constructor and there is no ``kvstate.rotating`` module it hides)."""
    for name in kv.__all__:
        assert importlib.util.find_spec(f"kvstate.{name}") is None, name
        assert not isinstance(getattr(kv, name), types.ModuleType), name
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvstate.rotating")
    assert callable(kv.rotating) and callable(kv.quantized)


def _modules():
    """Every module of the package, sub-packages' included (``__main__`` aside)."""
    for info in pkgutil.walk_packages(kv.__path__, "kvstate."):
        if info.name.endswith("__main__"):
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError as e:  # an optional dependency (mlx-lm is in the test extra)
            pytest.fail(f"{info.name} does not import: {e}")


def test_every_registration_has_a_name():
    """Tracebacks through a generic function never say ``in _``."""
    seen = 0
    for mod in _modules():
        for obj in vars(mod).values():
            registry = getattr(obj, "registry", None)
            if not callable(obj) or not isinstance(registry, types.MappingProxyType):
                continue
            for cls, impl in registry.items():
                seen += 1
                assert getattr(impl, "__name__", "") not in ("_", "<lambda>"), (
                    f"{mod.__name__}.{obj.__name__} for {cls.__name__}"
                )
    assert seen > 50


def test_one_version_string():
    """The installed distribution's version (pyproject's one string), or
    "0+unknown" where the tree is imported without being installed (the H200
    runs it from a path entry)."""
    try:
        installed = importlib.metadata.version("kvstate")
    except importlib.metadata.PackageNotFoundError:
        installed = "0+unknown"
    assert kv.__version__ == installed


def _unannotated(module):
    """``module.__all__``'s functions (and a class's own ``__init__``/``__call__``;
    an attrs class's ``__init__`` is generated from its annotated fields) with a
    parameter or the return left unannotated."""
    out = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            fns = [
                (f"{name}.{m}", vars(obj)[m])
                for m in ("__init__", "__call__")
                if m in vars(obj) and not (m == "__init__" and attrs.has(obj))
            ]
        elif callable(obj):
            fns = [(name, obj)]
        else:
            continue
        for label, fn in fns:
            sig = inspect.signature(fn)
            params = [p for p in sig.parameters.values() if p.name != "self"]
            missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
            if sig.return_annotation is inspect.Signature.empty:
                missing.append("return")
            if missing:
                out.append(f"{module.__name__}.{label}: {missing}")
    return out


# Implementation modules: what users reach of them is re-exported by a checked module
# (kvstate, kvstate.mlx_lm, ...), where it is checked.
IMPLEMENTATION = {
    "kvstate.bridge.decoder",
    "kvstate.bridge.hybrid",
    "kvstate.bridge.shells",
    "kvstate.compiled.buckets",
    "kvstate.core.args",
    "kvstate.core.handles",
    "kvstate.distributed.links",
    "kvstate.distributed.wire",
    "kvstate.kinds.dense",
    "kvstate.kinds.quantized",
    "kvstate.kinds.rotating",
    "kvstate.kinds.rows",
    "kvstate.speculative.window",
}

# Public modules whose __all__ still has unannotated functions.
NOT_YET_TYPED: dict = {}


def test_public_functions_are_annotated():
    """Every parameter and return of the public API has a type (what mypy checks):
    ``kvstate``'s ``__all__`` and that of every public module defining one."""
    public = [kv] + [m for m in _modules() if m.__name__ not in IMPLEMENTATION]
    checked = [m for m in public if hasattr(m, "__all__")]
    assert {"kvstate", "kvstate.mlx_lm", "kvstate.core.ops", "kvstate.compiled.boundary"} <= {
        m.__name__ for m in checked
    }
    for module in checked:
        missing = _unannotated(module)
        assert len(missing) <= NOT_YET_TYPED.get(module.__name__, 0), missing


def test_readme_module_table_lists_every_file():
    """README's "Where things live" table names each file and sub-package of the
    package (``kvstate/core/``), and only those."""
    root = Path(kv.__file__).parent
    readme = (root.parent / "README.md").read_text()
    table = readme.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `kvstate/([^`]+)` \|", table, flags=re.M)
    assert len(listed) == len(set(listed))
    files = {p.name for p in root.iterdir() if p.is_file() and not p.name.endswith(".pyc")}
    files |= {p.name + "/" for p in root.iterdir() if (p / "__init__.py").is_file()}
    assert set(listed) == files
