"""Persistence: a list of records in one ``.safetensors`` file.

File layout (format 1)::

    tensors                         metadata (str -> str)
    -------                         ---------------------
    "3.keys"      [B, H, C, Dk]     "kvstate.format"   "1"
    "3.values"    [B, H, C, Dv]     "kvstate.records"  JSON: one entry per record,
    "5.keys.0"    packed  (tuple     {"kind": "QuantizedState",
    "5.keys.1"    scales   fields     "host": {"lengths": [..], "bits": 8, ..},
    "5.keys.2"    biases   of arrays) "arrays": {"keys": 3, "values": 3}}
                                    "kvstate.model.digest"  (with model_path)
                                    any user key           (user metadata)

A record is written field by field from its ``attrs`` fields: an array
field becomes one tensor, a tuple of arrays one tensor per item, anything
else (ints, tuples of ints, ``None``) goes to the JSON as host data. So a
new record kind needs one entry in ``RECORDS`` and nothing else. By
default each row of a dense, quantized or ring layer is written compactly
(its columns in use only, ``kvstate.persist.compact``: then ``"kvstate.layout"`` is
``"rows"`` and a layer's entry is a list of one-row entries, tensors
``"{layer}.{row}.{field}"``); ``save(..., exact=True)`` writes every layer
as it is (whole capacity, stale columns included), a byte-exact round trip.
A ``kv.Batch`` adds ``"kvstate.batch"`` (its host per-row fields, JSON) and
tensors ``"batch.tokens"``, ``"batch.keys"``.

Files written by mlx-lm's ``save_prompt_cache`` load too: their cache
objects are rebuilt with mlx-lm's own ``load_prompt_cache`` and converted
with ``kvstate.mlx_lm.from_prompt_cache``.

A model's identity is a digest of its weight files (``*.safetensors``),
memoized per file on ``(size, mtime_ns, ctime_ns, inode, device)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import attrs
import mlx.core as mx

from ..batch import Batch
from ..core import records
from ..core.invariants import fresh_row_ids
from ..errors import KVStateError, bad, check
from ..kinds import rows as _rows
from ..kinds import shared
from . import compact

if TYPE_CHECKING:
    from ..bridge.shells import Model

FORMAT = "1"
PREFIX = "kvstate."
DIGEST_KEY = "kvstate.model.digest"

# Record kinds a file may hold, by name. Adding a kind is one entry here.
RECORDS = {
    cls.__name__: cls
    for cls in (
        records.CacheState,
        records.QuantizedState,
        records.RotatingState,
        records.RecurrentState,
        records.ChunkedState,
        records.CompositeState,
        records.CompressedState,
        shared.SharedState,
    )
}


# --- encoding a record ---------------------------------------------------------


def _is_arrays(value) -> bool:
    """A tuple of arrays (``None`` items allowed: a recurrent slot not yet written)."""
    return (
        isinstance(value, tuple)
        and any(isinstance(x, mx.array) for x in value)
        and all(x is None or isinstance(x, mx.array) for x in value)
    )


def _host(value, arg):
    """A JSON-safe copy of a host field (ints, floats, strings, tuples, None)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return [_host(v, arg) for v in value]
    raise bad(
        arg, "arrays, tuples of arrays, or host values (ints, tuples, None)", type(value).__name__
    )


def _untuple(value):
    """JSON lists back to tuples (records hold tuples, never lists)."""
    return tuple(_untuple(v) for v in value) if isinstance(value, list) else value


def _is_records(value) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(type(x).__name__ in RECORDS for x in value)
    )


def _encode(i, state, tensors: dict) -> dict:
    """``state`` as a JSON entry; its arrays go to ``tensors`` under ``"{i}.{field}"``.

    A field holding records (a ``CompositeState``'s parts) nests: part ``j``
    is encoded under ``i = "{i}.{field}.{j}"``; a field holding one record (a
    ``SharedState``'s suffix) under ``"{i}.{field}"``, as an object instead of
    a list. (A ``SharedState``'s prefixes are written with it: records shared
    by several saved records are written once per record that holds them.)
    """
    name = type(state).__name__
    if RECORDS.get(name) is not type(state):
        raise bad(f"states[{i}]", f"a kvstate record ({', '.join(RECORDS)})", name)
    host: dict = {}
    arrays: dict = {}
    nested: dict[str, Any] = {}  # field -> a list of entries, or one entry
    for field in attrs.fields(type(state)):
        value = getattr(state, field.name)
        if isinstance(value, mx.array):
            tensors[f"{i}.{field.name}"] = value
            arrays[field.name] = 0
        elif _is_arrays(value):
            for j, x in enumerate(value):
                if x is not None:
                    tensors[f"{i}.{field.name}.{j}"] = x
            arrays[field.name] = len(value)
        elif _is_records(value):
            nested[field.name] = [
                _encode(f"{i}.{field.name}.{j}", x, tensors) for j, x in enumerate(value)
            ]
        elif type(value).__name__ in RECORDS:
            nested[field.name] = _encode(f"{i}.{field.name}", value, tensors)
        else:
            host[field.name] = _host(value, f"states[{i}].{field.name}")
    entry = {"kind": name, "host": host, "arrays": arrays}
    if nested:
        entry["records"] = nested
    return entry


# Most arrays one field may hold (a quantized triple holds 3), and how deep
# records may nest (a CompositeState's parts).
MAX_TUPLE = 8
MAX_DEPTH = 4


def _decode(
    i, entry, tensors: dict, used: Optional[set] = None, ids: Optional[dict] = None, depth: int = 0
):
    """Record ``i`` of the table, built through its constructor (so validated).

    ``used`` collects the tensor names it reads; ``ids`` maps the file's row
    ids to fresh ones, one per saved id, so layers that shared rows still do
    and no loaded row shares an id with a row of this process. An item of a
    tuple of arrays that the file does not hold is ``None`` (a recurrent slot
    never written); a single array must be there.
    """
    used = set() if used is None else used
    ids = {} if ids is None else ids
    arg = f"record {i}"
    kind, cls, host, arrays, nested = _entry_parts(arg, entry)
    fields = {k: _untuple(v) for k, v in host.items()}
    _decode_arrays(i, arg, arrays, tensors, used, fields)
    _decode_nested(i, arg, nested, tensors, used, ids, depth, fields)
    if "row_ids" in fields:
        fields["row_ids"] = _fresh_row_ids(arg, fields["row_ids"], ids)
    return _construct(arg, kind, cls, fields)


def _entry_parts(arg: str, entry) -> tuple:
    """Check one table entry's shape and field names.

    Args:
        arg: The entry's name in errors (``"record 0"``).
        entry: The entry as the file's table holds it.

    Returns:
        ``(kind, cls, host, arrays, nested)``: the record's kind, its class and
        the entry's three objects (``nested`` empty where the entry has none).
    """
    if (
        type(entry) is not dict
        or not {"kind", "host", "arrays"} <= set(entry)
        or not set(entry) <= {"kind", "host", "arrays", "records"}
    ):
        raise bad(arg, "an object with kind, host and arrays (and records)", _short(entry))
    kind, host, arrays = entry["kind"], entry["host"], entry["arrays"]
    nested = entry.get("records", {})
    cls = RECORDS.get(kind) if type(kind) is str else None
    if cls is None:
        raise bad(f"{arg} kind", f"one of {sorted(RECORDS)}", _short(kind))
    if type(host) is not dict or type(arrays) is not dict or type(nested) is not dict:
        raise bad(arg, "host, arrays and records objects", _short(entry))
    known = {f.name for f in attrs.fields(cls)}
    names = [*host, *arrays, *nested]
    if not set(names) <= known or len(set(names)) != len(names):
        raise bad(f"{arg} fields", f"each of {sorted(known)} at most once", _short(names))
    return kind, cls, host, arrays, nested


def _decode_arrays(i, arg: str, arrays: dict, tensors: dict, used: set, fields: dict) -> None:
    """Fill ``fields`` with the entry's arrays (one, or a tuple), noting names in ``used``."""
    for name, n in arrays.items():
        if type(n) is not int or not 0 <= n <= MAX_TUPLE:
            raise bad(f"{arg} arrays[{name!r}]", f"an int in [0, {MAX_TUPLE}]", _short(n))
        if n == 0:
            key = f"{i}.{name}"
            if key not in tensors:
                raise bad(arg, f"a tensor named {key!r}", "none in the file")
            used.add(key)
            fields[name] = tensors[key]
        else:
            keys = [f"{i}.{name}.{j}" for j in range(n)]
            used.update(keys)
            fields[name] = tuple(tensors.get(k) for k in keys)
            if all(x is None for x in fields[name]):
                raise bad(arg, f"tensors named {keys[0]!r}...", "none in the file")


def _decode_nested(
    i, arg: str, nested: dict, tensors: dict, used: set, ids: dict, depth: int, fields: dict
) -> None:
    """Fill ``fields`` with the entry's nested records (one, or a tuple), decoded in turn."""
    for name, parts in nested.items():
        if type(parts) is dict and depth < MAX_DEPTH:  # one record
            fields[name] = _decode(f"{i}.{name}", parts, tensors, used, ids, depth + 1)
            continue
        if type(parts) is not list or not parts or depth >= MAX_DEPTH:
            raise bad(
                f"{arg} records[{name!r}]",
                f"a list of records (nested at most {MAX_DEPTH} deep)",
                _short(parts),
            )
        fields[name] = tuple(
            _decode(f"{i}.{name}.{j}", e, tensors, used, ids, depth + 1)
            for j, e in enumerate(parts)
        )


def _fresh_row_ids(arg: str, saved, ids: dict) -> tuple:
    """The saved row ids mapped to fresh ones (one per saved id, shared through ``ids``)."""
    if type(saved) is not tuple or any(type(x) is not int for x in saved):
        raise bad(f"{arg} row_ids", "a list of ints", _short(saved))
    return tuple(ids.setdefault(x, fresh_row_ids(1)[0]) for x in saved)


def _construct(arg: str, kind: str, cls, fields: dict):
    """The record built by ``cls(**fields)``, its errors named for the entry."""
    try:
        return cls(**fields)
    except KVStateError as e:
        raise KVStateError(f"{arg} ({kind}): {e}") from None
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise bad(f"{arg}", f"the fields of a {kind}", f"{type(e).__name__}: {e}") from None


def _short(value, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


# --- save / load -----------------------------------------------------------------


def _check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise bad("metadata", "a dict of str -> str", type(metadata).__name__)
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise bad(
                f"metadata[{k!r}]",
                "str keys and str values",
                f"{type(k).__name__} -> {type(v).__name__}",
            )
        # The model digest ``load`` returns may be handed back, so that
        # ``save(path, *load(other))`` carries the model identity over.
        if k.startswith(PREFIX) and k != DIGEST_KEY:
            raise bad(f"metadata[{k!r}]", f"a key not starting with {PREFIX!r} (reserved)", k)
    return dict(metadata)


def _check_path(path, arg="path") -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise bad(arg, "a file path", type(path).__name__)
    path = os.fspath(path)
    check(path.endswith(".safetensors"), arg, "a name ending in .safetensors", path)
    return path


def save(
    path: str | os.PathLike,
    states: Sequence | Batch,
    metadata: Optional[dict] = None,
    *,
    model_path: str | os.PathLike | None = None,
    exact: bool = False,
) -> None:
    """Write ``states`` (a list of records, one per layer, or a ``kv.Batch``) to a
    ``.safetensors`` file.

    Args:
        path: the file name; must end in ``.safetensors``.
        states: the records, or a ``kv.Batch`` (its per-row data is saved too).
            Each row's columns in use are written, nothing else
            (``kvstate.persist.compact``); ``load`` restores capacity in whole steps.
        metadata: optional ``str -> str`` pairs stored with the file (keys
            starting with ``"kvstate."`` are reserved, except the
            ``"kvstate.model.digest"`` that ``load`` returns: it is stored
            again, so a loaded cache saved anew keeps its model identity).
        model_path: optional model directory; its identity (the digest of
            its ``*.safetensors`` files) is recorded so ``load`` can refuse
            the file for another model.
        exact: write every layer as it is (whole capacity, padding and stale
            columns too): a byte-exact round trip, at the cost of file size.
    """
    path = _check_path(path)
    meta = _check_metadata(metadata)
    tensors: dict = {}
    entries, layout = compact.encode(states, tensors, _encode, exact=exact)
    meta.update(layout)
    if model_path is not None:
        digest = model_digest(model_path)
        given = meta.get(DIGEST_KEY, digest)
        check(
            given == digest,
            f"metadata[{DIGEST_KEY!r}]",
            f"the digest of model_path {model_path} ({digest[:16]}…)",
            f"another model's ({given[:16]}…)",
        )
        meta[DIGEST_KEY] = digest
    meta["kvstate.format"] = FORMAT
    meta["kvstate.records"] = json.dumps(entries, separators=(",", ":"))
    size = sum(len(k) + len(v) for k, v in meta.items())
    check(
        size < HEADER_LIMIT,
        "metadata",
        f"under {HEADER_LIMIT} bytes in all (what load can read back)",
        f"{size} bytes",
    )
    _write_atomic(path, tensors, meta)


# MLX refuses a safetensors header (JSON) of this many bytes or more.
HEADER_LIMIT = 100_000_000


def _write_atomic(path: str, tensors: dict, meta: dict) -> None:
    """Write beside ``path``, flush to disk, then rename over it: a crash or a
    full disk leaves the previous file (or none) and a stray partial file,
    never a torn ``path``; the next save of ``path`` removes that partial file.
    Any failure raises ``KVStateError``."""
    directory = os.path.dirname(os.path.abspath(path))
    check(
        os.path.isdir(directory),
        "path",
        "a file in an existing directory",
        f"{path} (no directory {directory})",
    )
    _remove_stale_partials(directory, os.path.basename(path))
    tmp = _partial_path(directory, os.path.basename(path))
    moved = False  # the partial file became ``path``
    try:
        mx.save_safetensors(tmp, tensors, meta)
        with open(tmp, "rb+") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            check(
                length < HEADER_LIMIT,
                "metadata",
                f"a file header under {HEADER_LIMIT} bytes (what load can read back)",
                f"{length} bytes",
            )
            os.fsync(f.fileno())
        os.replace(tmp, path)
        moved = True
        _fsync_directory(directory)
    except (OSError, RuntimeError, ValueError, struct.error) as e:
        if isinstance(e, KVStateError):
            raise
        raise bad("path", "a file kvstate can write", f"{path}: {e}") from None
    finally:
        if not moved and os.path.exists(tmp):
            os.unlink(tmp)


# A save writes ``.{name}.{host}.{pid}.{random}.partial.safetensors`` beside its target
# and renames it over the target. A save killed midway leaves that file behind; the
# next save of the same target removes it once its process is gone (``_remove_stale_partials``).
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _partial_path(directory: str, name: str) -> str:
    """A new partial file for target ``name``, naming this host and process."""
    tag = f"{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
    return os.path.join(directory, f".{name}.{tag}.partial.safetensors")


def _remove_stale_partials(directory: str, name: str) -> None:
    """Remove the partial files that killed saves of target ``name`` left in ``directory``.

    Stale: a partial file of this host whose process is gone, or one in the
    older form that named no process (kvstate before saves named theirs). A
    live process's partial file is a save in progress (another thread or
    process) and stays, as do other hosts' (a shared directory) and other
    targets'. Best effort: a file that cannot be removed is left.
    """
    stale = re.compile(
        re.escape(f".{name}.") + r"(?:([0-9a-f]{8})\.(\d+)\.)?[0-9a-f]{12}\.partial\.safetensors"
    )
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for found in names:
        m = stale.fullmatch(found)
        if m is None or (m[1] is not None and (m[1] != _HOST or _alive(int(m[2])))):
            continue
        try:
            os.unlink(os.path.join(directory, found))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts; off POSIX, always assumed)."""
    if os.name != "posix":  # (os.kill would terminate it on Windows)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: another user's process
        return True
    return True


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (where the platform lets a directory be synced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that cannot sync a directory
        pass
    finally:
        os.close(fd)


def load(
    path: str | os.PathLike,
    *,
    model: Model | None = None,
    model_path: str | os.PathLike | None = None,
) -> tuple[Any, dict]:
    """Read a file written by ``save`` or by mlx-lm's ``save_prompt_cache``.

    Args:
        path: the ``.safetensors`` file.
        model: optional mlx-lm model; the file is refused (``KVStateError``)
            unless it holds one record per layer with the model's geometry
            (KV heads, head dims, dtype; a sliding layer needs a ring of the
            model's window). See ``check_model``.
        model_path: optional model directory; the file is refused unless it
            recorded the same model identity (``model_digest``).

    Returns:
        ``(states, metadata)``: the records (a ``kv.Batch`` when one was
        saved; capacity in whole steps), and the user metadata (plus
        ``"kvstate.model.digest"`` when one was recorded). For an mlx-lm
        file, the metadata mlx-lm's ``load_prompt_cache`` returns.
    """
    path = _check_path(path)
    check(os.path.isfile(path), "path", "an existing file", path)
    meta = check_file(path)
    if "kvstate.format" in meta:
        check(
            meta["kvstate.format"] == FORMAT, "file format", FORMAT, _short(meta["kvstate.format"])
        )
        states = _load_kvstate(path, meta)
        user = {k: v for k, v in meta.items() if not k.startswith(PREFIX)}
        if DIGEST_KEY in meta:
            user[DIGEST_KEY] = meta[DIGEST_KEY]
    elif "1.0" in meta and "2.0" in meta:
        states, user = _load_mlx_lm(path, meta)
    else:
        raise bad("path", "a kvstate or mlx-lm prompt-cache file", f"{path} (unknown metadata)")
    # mx.load is lazy: read now, so a later change to the file cannot leak in.
    is_batch = type(states) is Batch
    layers = states.states if is_batch else states
    _read(
        path,
        [p for s in layers for p in _arrays(s)]
        + ([states.tokens, states.keys] if is_batch else []),
    )
    if model_path is not None:
        want = model_digest(model_path)
        have = user.get(DIGEST_KEY)
        if have is None:
            raise bad(
                "path",
                f"a cache recording a model identity (for {model_path})",
                "a file with no model identity (saved without model_path)",
            )
        check(
            have == want,
            "path",
            f"a cache for the model at {model_path} (digest {want[:16]}…)",
            f"a cache for another model (digest {have[:16]}…)",
        )
    if model is not None:
        check_model(layers, model)
    return states, user


def _arrays(state) -> tuple:
    """Every array a record holds (its ``attrs`` fields, nested records too), for evaluation."""
    out = []
    for field in attrs.fields(type(state)):
        value = getattr(state, field.name)
        if isinstance(value, mx.array):
            out.append(value)
        elif _is_arrays(value):
            out.extend(x for x in value if x is not None)
        elif _is_records(value):
            for x in value:
                out.extend(_arrays(x))
        elif type(value).__name__ in RECORDS:
            out.extend(_arrays(value))
    return tuple(out)


def _read(path: str, arrays: list) -> None:
    try:
        mx.eval(arrays)
    except (RuntimeError, ValueError) as e:
        raise bad("path", "a readable safetensors file", f"{path}: {e}") from None


def _load_kvstate(path: str, meta: dict):
    table = meta.get("kvstate.records")
    if table is None:
        raise bad("path", "a kvstate.core.records table", "none")
    try:
        entries = json.loads(table)
    except (ValueError, RecursionError) as e:
        raise bad(
            "kvstate.records", "a JSON list of records", f"{type(e).__name__}: {_short(str(e))}"
        ) from None
    if type(entries) is not list:
        raise bad("kvstate.records", "a JSON list of records", type(entries).__name__)
    try:
        tensors = cast(dict, mx.load(path))  # a .safetensors file: a dict of arrays
    except (RuntimeError, ValueError) as e:
        raise bad("path", "a readable safetensors file", f"{path}: {e}") from None
    used: set = set()
    ids: dict = {}
    states = compact.decode(
        entries, meta, tensors, lambda i, e, t: _decode(i, e, t, used, ids), used
    )
    extra = sorted(set(tensors) - used)
    check(not extra, "path", "only the tensors its record table names", _short(extra))
    return states


def _load_mlx_lm(path, meta):
    try:
        from mlx_lm.models.cache import load_prompt_cache
    except ImportError:  # pragma: no cover - mlx-lm is an optional dependency
        raise bad(
            "path", "mlx-lm installed to read an mlx-lm prompt-cache file", "no module mlx_lm"
        ) from None
    from ..bridge.prompt_cache import CACHE_CLASSES, from_prompt_cache

    for k, v in meta.items():
        if k.startswith("1.") and v not in CACHE_CLASSES:
            raise bad(f"mlx-lm cache class {k!r}", f"one of {CACHE_CLASSES}", _short(v))
    try:
        caches, user = load_prompt_cache(path, return_metadata=True)
    except Exception as e:  # mlx-lm's own reader: any failure there is a bad file
        raise bad(
            "path",
            "a readable mlx-lm prompt-cache file",
            f"{path}: {type(e).__name__}: {_short(str(e))}",
        ) from None
    try:
        return list(from_prompt_cache(caches)), user
    except KVStateError as e:
        raise KVStateError(f"{path}: {e}") from None
    except Exception as e:  # an mlx-lm object built from lying numbers
        raise bad(
            "path",
            "an mlx-lm prompt-cache file holding consistent caches",
            f"{path}: {type(e).__name__}: {_short(str(e))}",
        ) from None


# --- the safetensors layout -----------------------------------------------------------

DTYPES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}


def check_file(path: str) -> dict:
    """Check a safetensors file's layout before MLX reads it; return its metadata.

    The header is parsed here: a length that fits the file and MLX's limit,
    a JSON object whose tensors have a known dtype, a shape of non-negative
    ints, and data offsets that lie inside the file and match dtype and
    shape. MLX reads the data through those offsets, so a file that lies
    about them is refused here, as ``KVStateError``, not read.
    """
    size, n, raw = _read_header(path)
    header, meta = _parse_header(raw)
    data = size - 8 - n
    spans = [_tensor_span(name, t, data) for name, t in header.items()]
    spans.sort()
    for (_, e0), (b1, _) in zip(spans, spans[1:]):
        check(b1 >= e0, "path tensors", "data that does not overlap", f"overlap at {b1}")
    return meta


def _read_header(path: str) -> tuple:
    """The file's size, its header's length and raw bytes, the length checked against the size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            check(
                len(head) == 8, "path", "a safetensors file (8-byte header length)", f"{size} bytes"
            )
            n = struct.unpack("<Q", head)[0]
            check(
                2 <= n < min(HEADER_LIMIT, size - 7),
                "path header length",
                f"in [2, {min(HEADER_LIMIT, size - 7)}) (the file holds {size} bytes)",
                n,
            )
            raw = f.read(n)
    except OSError as e:
        raise bad("path", "a readable file", f"{path}: {e}") from None
    return size, n, raw


def _parse_header(raw: bytes) -> tuple:
    """The header's tensor table and its metadata (an object of strings), parsed from JSON."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad("path header", "a JSON object", f"{type(e).__name__}: {_short(str(e))}") from None
    if type(header) is not dict:
        raise bad("path header", "a JSON object", type(header).__name__)
    meta = header.pop("__metadata__", {})
    if type(meta) is not dict or any(
        type(k) is not str or type(v) is not str for k, v in meta.items()
    ):
        raise bad("path metadata", "an object of strings", _short(meta))
    return header, meta


def _tensor_span(name: str, t, data: int) -> tuple:
    """One tensor's ``(begin, end)`` data offsets, checked against its dtype, shape and the data."""
    arg = f"tensor {name!r}"
    if type(t) is not dict or set(t) != {"dtype", "shape", "data_offsets"}:
        raise bad(arg, "dtype, shape and data_offsets", _short(t))
    itemsize = DTYPES.get(t["dtype"]) if type(t["dtype"]) is str else None
    if itemsize is None:
        raise bad(f"{arg} dtype", f"one of {sorted(DTYPES)}", _short(t["dtype"]))
    shape, offsets = t["shape"], t["data_offsets"]
    if (
        type(shape) is not list
        or len(shape) > 8
        or any(type(d) is not int or not 0 <= d < 2**40 for d in shape)
    ):
        raise bad(f"{arg} shape", "at most 8 non-negative ints", _short(shape))
    if type(offsets) is not list or len(offsets) != 2 or any(type(o) is not int for o in offsets):
        raise bad(f"{arg} data_offsets", "[begin, end]", _short(offsets))
    begin, end = offsets
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    if not 0 <= begin <= end <= data or end - begin != nbytes:
        raise bad(f"{arg} data_offsets", f"{nbytes} bytes inside the {data} data bytes", offsets)
    return begin, end


# --- model checks -------------------------------------------------------------------


def _record_geometry(state):
    try:
        return _rows.geometry(state)
    except NotImplementedError:
        return None


def model_geometry(model: Model) -> list:
    """Per layer, what a record must fit to serve an mlx-lm model's cache.

    A KV layer gives ``(H, Dk, Dv, dtype, window)`` (``window``: the ring
    size of a sliding layer, else ``None``); a recurrent layer
    (``ArraysCache``) ``("slots", ((shape[1:], dtype) or None, ...))``; a
    layer of several caches (``CacheList``) ``("parts", (geometry, ...))``.
    Found by building (never evaluating) a one-token forward pass on mlx-lm's
    own caches: MLX knows every shape before it computes anything, so this
    costs a graph build, not a forward pass.
    """
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    return [_cache_geometry(f"model layer {i} cache", c) for i, c in enumerate(caches)]


def _cache_geometry(name, c):
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

    if isinstance(c, CacheList):
        return (
            "parts",
            tuple(_cache_geometry(f"{name}.caches[{j}]", p) for j, p in enumerate(c.caches)),
        )
    if isinstance(c, ArraysCache):
        return (
            "slots",
            tuple(None if a is None else (tuple(a.shape[1:]), a.dtype) for a in c.cache),
        )
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if keys is None or values is None:
        raise bad(name, "a KV, recurrent or composite cache", type(c).__name__)
    if isinstance(keys, (tuple, list)):  # quantized: (packed, scales, biases)
        raise bad("model", "a model whose default caches are not quantized", type(c).__name__)
    window = c.max_size if isinstance(c, RotatingKVCache) else None
    if hasattr(c, "offset") and hasattr(c, "start_position"):  # ChunkedKVCache: no window
        window = None
    return (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype, window)


def check_model(states: Sequence, model: Model) -> None:
    """Refuse (``KVStateError``) ``states`` that do not fit ``model``.

    One record per layer, each with the model's KV heads, head dims and
    dtype; a sliding-window layer needs a ring of the same ``max_size``; a
    recurrent layer a ``RecurrentState`` with its slots' shapes and dtypes;
    a layer of several caches a ``CompositeState`` whose parts fit. Empty
    records (no geometry yet) fit any layer of the right kind.
    """
    want = model_geometry(model)
    check(
        len(states) == len(want),
        "states",
        f"{len(want)} records (one per model layer)",
        len(states),
    )
    for i, (s, geo) in enumerate(zip(states, want)):
        _check_fits(f"states[{i}]", s, geo, i)


def _check_fits(name, s, geo, i):
    kind = geo[0] if isinstance(geo[0], str) else "kv"
    if kind == "parts":
        parts = getattr(s, "parts", None)
        check(
            parts is not None and len(parts) == len(geo[1]),
            name,
            f"a CompositeState of {len(geo[1])} parts (layer {i} is a CacheList)",
            type(s).__name__ if parts is None else f"{len(parts)} parts",
        )
        for j, (p, g) in enumerate(zip(parts, geo[1])):
            _check_fits(f"{name}.parts[{j}]", p, g, i)
        return
    if kind == "slots":
        slots = getattr(s, "arrays", None)
        check(
            isinstance(s, records.RecurrentState) and len(slots) == len(geo[1]),
            name,
            f"a RecurrentState of {len(geo[1])} slots (layer {i} is recurrent)",
            type(s).__name__ if slots is None else f"{len(slots)} slots",
        )
        for j, (a, g) in enumerate(zip(slots, geo[1])):
            if a is not None and g is not None:
                have = (tuple(a.shape[1:]), a.dtype)
                check(
                    have == g,
                    f"{name} slot {j} (shape[1:], dtype)",
                    f"{g} (the model's layer {i})",
                    have,
                )
        return
    H, Dk, Dv, dtype, window = geo
    record_geo = _record_geometry(s)
    if record_geo is None and not hasattr(s, "keys"):
        raise bad(name, f"a KV record (layer {i} is an attention layer)", type(s).__name__)
    if record_geo is not None:
        check(
            tuple(record_geo) == (H, Dk, Dv, dtype),
            f"{name} geometry (H, Dk, Dv, dtype)",
            f"{(H, Dk, Dv, dtype)} (the model's layer {i})",
            tuple(record_geo),
        )
    if window is not None:
        size = getattr(s, "max_size", None)
        check(
            size == window,
            name,
            f"a ring of max_size={window} (layer {i} is a sliding-window layer)",
            type(s).__name__ if size is None else f"max_size={size}",
        )


# --- model identity ---------------------------------------------------------------

_DIGESTS: dict = {}  # realpath -> (stat key, hex digest)


def _stat_key(st) -> tuple:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def hash_file(path: str) -> str:
    """SHA-256 of one file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 23), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str) -> str:
    """``hash_file(path)``, memoized while the file's size, times and inode are unchanged."""
    real = os.path.realpath(path)
    key = _stat_key(os.stat(real))
    hit = _DIGESTS.get(real)
    if hit is not None and hit[0] == key:
        return hit[1]
    digest = hash_file(real)
    # Stat again: a file written while it was read is not memoized as clean.
    if _stat_key(os.stat(real)) == key:
        _DIGESTS[real] = (key, digest)
    return digest


def model_digest(model_path: str | os.PathLike) -> str:
    """The identity of a model directory: one SHA-256 over its ``*.safetensors``
    files (name and content digest of each, sorted by name)."""
    if not isinstance(model_path, (str, os.PathLike)):
        raise bad("model_path", "a model directory", type(model_path).__name__)
    root = Path(model_path).expanduser()
    check(root.is_dir(), "model_path", "an existing directory", os.fspath(model_path))
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    check(
        bool(files),
        "model_path",
        "a directory holding *.safetensors weight files",
        f"none in {os.fspath(model_path)}",
    )
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_digest(os.fspath(p))}\n".encode())
    return h.hexdigest()


__all__ = ["save", "load", "check_model", "model_digest", "model_geometry", "KVStateError"]
