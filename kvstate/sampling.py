"""Samplers: pure functions over per-row arrays.

Every parameter is one value per row (or one value for every row); every row
carries its own PRNG key, so a row's sample depends only on its own logits,
parameters and key, never on which other rows share its batch or where it
sits in it. Nothing here holds state: ``sample`` returns the tokens and the
rows' next keys, JAX-style::

    keys = row_keys([7, 8, 9])                          # [B, 2] uint32, one per row
    tokens, keys = sample(logits, keys, temperature=[0.0, 0.7, 1.0], top_p=0.9)

The filters are mlx-lm's (``mlx_lm.sample_utils``), applied per row to the
log-probabilities before the temperature: ``top_p`` (nucleus; 0 or 1 keeps
every token), ``min_p`` (keep tokens with probability >= ``min_p`` times the
top token's; 0 keeps every token) and ``top_k`` (0 keeps every token). Each
keeps the tokens at or above a threshold, so applying them in sequence (as
mlx-lm does) equals keeping the tokens at or above the largest of the three
thresholds, which is what ``filter_logprobs`` computes. A row whose
temperature is 0 (below ``GREEDY_BELOW``, 1e-5, as vLLM) takes the argmax of its
logits (mlx-lm's greedy sampler). Sampling is Gumbel-max over the filtered
log-probabilities divided by the temperature (``tempered``: shifted so that the
best is 0, so no temperature overflows them), with the noise drawn from the row's
own key; a token with a ``-inf`` logit (a grammar's mask) is never drawn.

Before the filters, ``process_logits`` applies mlx-lm's logits processors
(``mlx_lm.sample_utils.make_logits_processors``), per row and in mlx-lm's
order: ``logit_bias`` (added), ``repetition_penalty`` (a logit of a token
seen in the row's last ``context_size`` tokens, prompt included, is
multiplied by the penalty when negative, else divided), then
``presence_penalty`` (subtracted once from a seen token) and
``frequency_penalty`` (subtracted once per occurrence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import mlx.core as mx

from .core.args import as_int
from .errors import bad

__all__ = [
    "GREEDY_BELOW",
    "Sampling",
    "apply_bitmask",
    "filter_logprobs",
    "history",
    "process_logits",
    "row_keys",
    "sample",
    "sample_arrays",
    "split_keys",
    "tempered",
]

PerRow = float | int | Sequence | mx.array

_NEG_INF = -float("inf")


def row_keys(seeds: Sequence[int]) -> mx.array:
    """One PRNG key per row, ``[B, 2]`` uint32, from one int seed per row."""
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__len__"):
        raise bad("seeds", "a list of int seeds (one per row)", type(seeds).__name__)
    seeds = [_seed(s, f"seeds[{i}]") for i, s in enumerate(seeds)]
    if not seeds:
        return mx.zeros((0, 2), mx.uint32)
    return mx.stack([mx.random.key(s) for s in seeds])


def _split(key):
    return mx.random.split(key, 2)


def split_keys(keys: mx.array) -> tuple:
    """``(use, carry)``: two ``[B, 2]`` keys per row, each split from the row's key alone."""
    check_keys(keys, None)
    if keys.shape[0] == 0:
        return keys, keys
    pairs = mx.vmap(_split)(keys)  # [B, 2, 2]
    return pairs[:, 0], pairs[:, 1]


def check_keys(keys, B) -> None:
    """``keys``: an ``mx.array`` ``[B, 2]`` uint32 (``row_keys`` makes one); any B when None."""
    if not isinstance(keys, mx.array):
        raise bad("keys", "an mx.array [B, 2] uint32 (kv.row_keys(seeds))", type(keys).__name__)
    shape = list(keys.shape)
    if keys.dtype != mx.uint32 or len(shape) != 2 or shape[1] != 2 or B not in (None, shape[0]):
        raise bad(
            "keys",
            f"an mx.array [{'B' if B is None else B}, 2] uint32 (one key per row)",
            f"{keys.dtype} {list(keys.shape)}".replace("mlx.core.", ""),
        )


def _floats(value, B: int, arg: str, low: float, high: float) -> list:
    """One finite float per row in ``[low, high]``: a number, a sequence or a 1-D array."""
    if isinstance(value, mx.array):
        if value.ndim > 1:
            raise bad(arg, "a number or one number per row", f"an array {list(value.shape)}")
        value = value.tolist()
    elif hasattr(value, "tolist") and hasattr(value, "ndim"):  # numpy
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise bad(arg, f"{B} values (one per row)", f"{len(value)} values")
        names = [f"{arg}[{i}]" for i in range(B)]
    else:
        value, names = [value] * B, [arg] * B
    out = []
    for name, v in zip(names, value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad(name, "a number", f"{type(v).__name__} {v!r}")
        v = float(v)
        if not (low <= v <= high and math.isfinite(v)):  # NaN fails too
            raise bad(name, f"a finite number in [{low}, {high}]", v)
        out.append(v)
    return out


def _ints(value, B: int, arg: str) -> list:
    if isinstance(value, mx.array) or (hasattr(value, "tolist") and hasattr(value, "ndim")):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise bad(arg, f"{B} values (one per row)", f"{len(value)} values")
        out = [as_int(v, f"{arg}[{i}]") for i, v in enumerate(value)]
    else:
        out = [as_int(value, arg)] * B
    for i, v in enumerate(out):
        if v < 0:
            raise bad(f"{arg}[{i}]" if isinstance(value, (list, tuple)) else arg, ">= 0", v)
    return out


@attrs.frozen
class Sampling:
    """One row's sampling parameters, checked when made (``KVStateError`` names the field).

    Attributes:
        temperature: >= 0; 0 is greedy (argmax).
        top_p: in [0, 1]; 0 or 1 keeps every token.
        top_k: >= 0; 0 keeps every token.
        min_p: in [0, 1]; 0 keeps every token.
        seed: the seed of the row's PRNG key when it joins a ``kv.Batch``
            (an int in [0, 2**64)); ``None``: the row's index in the batch made.
    """

    temperature: float = attrs.field(
        default=0.0, converter=lambda v: _floats(v, 1, "temperature", 0.0, math.inf)[0]
    )
    top_p: float = attrs.field(default=1.0, converter=lambda v: _floats(v, 1, "top_p", 0.0, 1.0)[0])
    top_k: int = attrs.field(default=0, converter=lambda v: _ints(v, 1, "top_k")[0])
    min_p: float = attrs.field(default=0.0, converter=lambda v: _floats(v, 1, "min_p", 0.0, 1.0)[0])
    seed: int | None = attrs.field(
        default=None, kw_only=True, converter=lambda v: v if v is None else _seed(v, "seed")
    )
    presence_penalty: float = attrs.field(
        default=0.0, kw_only=True, converter=lambda v: _floats(v, 1, "presence_penalty", -2, 2)[0]
    )
    frequency_penalty: float = attrs.field(
        default=0.0, kw_only=True, converter=lambda v: _floats(v, 1, "frequency_penalty", -2, 2)[0]
    )
    repetition_penalty: float = attrs.field(
        default=1.0,
        kw_only=True,
        converter=lambda v: _floats(v, 1, "repetition_penalty", 1e-3, 100.0)[0],
    )
    context_size: int = attrs.field(default=20, kw_only=True, converter=lambda v: _size(v))
    logit_bias: tuple = attrs.field(default=(), kw_only=True, converter=lambda v: _bias(v))

    @property
    def processed(self) -> bool:
        """Whether ``process_logits`` changes this row's logits."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


def _size(value) -> int:
    value = as_int(value, "context_size")
    if not 1 <= value <= 4096:
        raise bad("context_size", "an int in [1, 4096]", value)
    return value


def _bias(value) -> tuple:
    """``logit_bias``: ``{token id: bias in [-100, 100]}`` (or its items), as sorted pairs."""
    items = value.items() if isinstance(value, dict) else value
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise bad("logit_bias", "a dict {token id: bias}", type(value).__name__)
    out = {}
    for pair in items:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise bad("logit_bias", "a dict {token id: bias}", repr(pair))
        token = as_int(pair[0], "logit_bias key")
        if token < 0:
            raise bad("logit_bias key", "a token id >= 0", token)
        out[token] = _floats(pair[1], 1, f"logit_bias[{token}]", -100.0, 100.0)[0]
    return tuple(sorted(out.items()))


def _seed(value, arg: str) -> int:
    value = as_int(value, arg)
    if not 0 <= value < 2**64:
        raise bad(arg, "an int in [0, 2**64)", value)
    return value


def filter_logprobs(
    logprobs: mx.array, top_p: mx.array, top_k: mx.array, min_p: mx.array
) -> mx.array:
    """``logprobs`` ``[B, V]`` with the tokens each row's filters remove set to ``-inf``.

    Args:
        logprobs: log-probabilities (``logits - logsumexp(logits)``), ``[B, V]``.
        top_p: float32 ``[B]``; 0 or 1 keeps every token.
        top_k: int32 ``[B]``; 0 keeps every token.
        min_p: float32 ``[B]``; 0 keeps every token.

    Pure MLX on arrays (compiles with ``mx.compile``); no host checks.
    """
    V = logprobs.shape[-1]
    lp = logprobs.astype(mx.float32)
    ascending = mx.sort(lp, axis=-1)
    # top_p, as mlx_lm.sample_utils.apply_top_p: drop the tokens whose mass
    # above them (exclusive) already reaches top_p of the total.
    probs = mx.exp(ascending)
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = above[:, :1] + probs[:, :1]
    p = top_p[:, None]
    dropped = mx.minimum((above >= p * total).sum(axis=-1, keepdims=True), V - 1)
    p_on = (top_p > 0) & (top_p < 1)
    thr_p = mx.where(p_on[:, None], mx.take_along_axis(ascending, dropped, axis=-1), _NEG_INF)
    # min_p, as apply_min_p (min_tokens_to_keep = 1): top logprob + log(min_p).
    thr_m = mx.where(
        min_p[:, None] > 0, ascending[:, -1:] + mx.log(mx.maximum(min_p[:, None], 1e-38)), _NEG_INF
    )
    # top_k: the k-th largest logprob (ties at the threshold are all kept).
    k = top_k[:, None].astype(mx.int32)
    k_on = (k > 0) & (k < V)
    kth = mx.take_along_axis(ascending, mx.clip(V - k, 0, V - 1), axis=-1)
    thr_k = mx.where(k_on, kth, _NEG_INF)
    threshold = mx.maximum(mx.maximum(thr_p, thr_m), thr_k)
    return mx.where(lp < threshold, _NEG_INF, lp)


def apply_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    """``logits`` ``[..., V]`` with every token whose bit is 0 set to ``-inf``.

    ``bitmask`` ``[..., ceil(V / 32)]`` int32 (broadcast against ``logits``'
    leading axes): bit ``i % 32`` of word ``i // 32`` allows token ``i``, the
    layout xgrammar and llguidance fill. Pure MLX (any backend), compiled: the
    bits unpacked and the select fused (1.5 ms for ``[32, 49152]`` on the CPU,
    against 12.7 ms eager)."""
    return _apply_bitmask(logits, bitmask)


@mx.compile
def _apply_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    V = logits.shape[-1]
    words = bitmask.view(mx.uint32)[..., None]
    bits = (words >> mx.arange(32, dtype=mx.uint32)) & 1  # [..., W, 32]
    allowed = bits.reshape(*bitmask.shape[:-1], -1)[..., :V]
    return mx.where(allowed.astype(mx.bool_), logits, _NEG_INF)


def _gumbel(key, V: int):
    return mx.random.gumbel(shape=(V,), key=key)


def sample_arrays(
    logits: mx.array,
    keys: mx.array,
    temperature: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
) -> tuple:
    """``sample`` on arrays only: no host checks, so it runs inside ``mx.compile``.

    Args:
        logits: ``[B, V]``.
        keys: ``[B, 2]`` uint32, one PRNG key per row.
        temperature, top_p, min_p: float32 ``[B]``; top_k: int32 ``[B]``.

    Returns:
        ``(tokens [B] uint32, keys [B, 2])``: the rows' next keys.
    """
    B, V = logits.shape
    if B == 0:
        return mx.zeros((0,), mx.uint32), keys
    use, carry = (p.squeeze(1) for p in mx.split(mx.vmap(_split)(keys), 2, axis=1))
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kept = filter_logprobs(logprobs, top_p, top_k, min_p)
    greedy, scaled = tempered(kept, temperature)
    noise = mx.maximum(mx.vmap(lambda k: _gumbel(k, V))(use), _FLOOR)  # (finite: see tempered)
    drawn = mx.argmax(scaled + noise, axis=-1)
    tokens = mx.where(greedy, mx.argmax(logits, axis=-1), drawn)
    return tokens, carry


#: Temperatures below this are greedy (the argmax), as in vLLM (``_SAMPLING_EPS``):
#: dividing by a subnormal temperature overflows every finite logit to ``-inf``.
GREEDY_BELOW = 1e-5

_FLOOR = float(mx.finfo(mx.float32).min)


def tempered(kept: mx.array, temperature: mx.array) -> tuple:
    """``(greedy [B], scaled [B, V])``: which rows are greedy (temperature below
    ``GREEDY_BELOW``), and the filtered log-probabilities ``kept`` over each row's
    temperature, shifted so that the row's best token is 0 (its other tokens at most
    0, a removed one ``-inf``): nothing overflows to ``+inf`` or NaN, and the best
    allowed token stays finite whatever the temperature, so a token the filters, a
    grammar or a ``-inf`` bias removed is never drawn (``sample_arrays``, and the
    distribution ``kvstate.speculative.rounds.probabilities`` verifies with)."""
    greedy = temperature < GREEDY_BELOW
    removed = kept == _NEG_INF
    shifted = kept - mx.max(kept, axis=-1, keepdims=True)
    # (a temperature past float32's range is inf: every allowed token then scales to 0)
    scaled = shifted / mx.where(greedy, 1.0, temperature)[:, None]
    return greedy, mx.where(removed, _NEG_INF, scaled)


def next_tokens(logits: mx.array, keys, params: tuple | None) -> tuple:
    """``(tokens [B], keys)``: each row's next token from ``logits`` ``[B, V]``.

    ``params`` ``None`` means every row is greedy: the argmax, and ``keys``
    returned untouched (nothing draws from them, so a greedy loop's keys never
    advance); else ``sample_arrays(logits, keys, *params)``. The one greedy
    rule of the loops that skip sampling when no row samples (speculative
    rounds, the serve engine).
    """
    if params is None:
        return mx.argmax(logits, axis=-1), keys
    return sample_arrays(logits, keys, *params)


def sample(
    logits: mx.array,
    keys: mx.array,
    *,
    temperature: PerRow = 0.0,
    top_p: PerRow = 1.0,
    top_k: PerRow = 0,
    min_p: PerRow = 0.0,
) -> tuple:
    """One token per row, each drawn with the row's own parameters and key.

    Args:
        logits: ``[B, V]`` (a step's last-position logits).
        keys: ``[B, 2]`` uint32 PRNG keys, one per row (``row_keys``).
        temperature: per row (or one for all), >= 0; 0 means greedy (argmax).
        top_p: per row, in [0, 1]; 0 or 1 keeps every token.
        top_k: per row, >= 0; 0 keeps every token.
        min_p: per row, in [0, 1]; 0 keeps every token.

    Returns:
        ``(tokens [B] uint32, keys [B, 2])``: the tokens, and each row's next
        key (split from its own key; pass it to the next call). The inputs
        are left unchanged.
    """
    if not isinstance(logits, mx.array) or logits.ndim != 2:
        raise bad(
            "logits",
            "an mx.array [B, V]",
            f"{type(logits).__name__} {list(getattr(logits, 'shape', []))}",
        )
    B = logits.shape[0]
    check_keys(keys, B)
    return sample_arrays(logits, keys, *parameters(B, temperature, top_p, top_k, min_p))


def parameters(
    B: int,
    temperature: PerRow = 0.0,
    top_p: PerRow = 1.0,
    top_k: PerRow = 0,
    min_p: PerRow = 0.0,
) -> tuple:
    """``sample``'s per-row parameters, checked on the host, as ``sample_arrays``
    takes them: ``(temperature, top_p, top_k, min_p)``, each ``[B]``."""
    return (
        mx.array(_floats(temperature, B, "temperature", 0.0, math.inf), mx.float32),
        mx.array(_floats(top_p, B, "top_p", 0.0, 1.0), mx.float32),
        mx.array(_ints(top_k, B, "top_k"), mx.int32),
        mx.array(_floats(min_p, B, "min_p", 0.0, 1.0), mx.float32),
    )


def history(
    contexts: Sequence[Sequence[int]], sizes: Sequence[int], window: mx.array | None = None
) -> mx.array:
    """The tokens each position's processors look back on, ``[B, W, N]`` int32 (-1: none).

    Args:
        contexts: per row, every token so far (prompt included; the last one is
            the token the first position's logits follow).
        sizes: per row, how many tokens the processors look back on.
        window: ``[B, W]`` (a verify window: the pending token, then drafts) or
            ``None`` (``W = 1``). Position ``w`` looks back on the row's context
            followed by ``window[:, 1 : w + 1]``.
    """
    N = max(sizes, default=1)
    tails = [[-1] * (N - len(c[-n:])) + list(c[-n:]) for c, n in zip(contexts, sizes)]
    tail = mx.array(tails, mx.int32).reshape(len(tails), N)
    W = 1 if window is None else window.shape[1]
    ext = tail if window is None or W == 1 else _extended(tail, window)
    rel = mx.arange(N)[None, :]
    hist = ext[:, mx.arange(W)[:, None] + rel]  # [B, W, N]
    short = rel < (N - mx.array(list(sizes), mx.int32))[:, None]  # [B, N]: past a row's size
    return mx.where(short[:, None, :], -1, hist)


def process_logits(logits: mx.array, hist: mx.array, sampling: Sequence[Sampling]) -> mx.array:
    """``logits`` ``[B, W, V]`` with each row's processors applied (module docstring).

    Args:
        logits: ``[B, W, V]``.
        hist: ``[B, W, N]`` int32, the tokens each position looks back on (``history``).
        sampling: per row, its ``Sampling``.
    """
    B, W, V = logits.shape
    lg = logits.astype(mx.float32).reshape(B * W * V)
    base = (mx.arange(B * W) * V).reshape(B, W, 1)
    pairs = [(b, t, x) for b, s in enumerate(sampling) for t, x in s.logit_bias if t < V]
    if pairs:
        rows, ids, vals = (mx.array(list(c)) for c in zip(*pairs))
        at = (base[rows] + ids[:, None, None]).reshape(-1)  # every position of the row
        lg = lg.at[at].add(mx.repeat(vals.astype(mx.float32), W))
    seen = hist >= 0
    counts = mx.zeros((B * W * V,), mx.float32)
    counts = counts.at[(base + mx.where(seen, hist, 0)).reshape(-1)].add(
        seen.reshape(-1).astype(mx.float32)
    )
    counts, lg = counts.reshape(B, W, V), lg.reshape(B, W, V)
    present = counts > 0
    rep = mx.array([s.repetition_penalty for s in sampling], mx.float32)[:, None, None]
    lg = mx.where(present, mx.where(lg < 0, lg * rep, lg / rep), lg)
    pres = mx.array([s.presence_penalty for s in sampling], mx.float32)[:, None, None]
    freq = mx.array([s.frequency_penalty for s in sampling], mx.float32)[:, None, None]
    return lg - pres * present - freq * counts


def _extended(tail: mx.array, window: mx.array) -> mx.array:
    """``tail`` followed by the window's drafts (its tokens after the pending one)."""
    return mx.concatenate([tail, window[:, 1:].astype(mx.int32)], axis=1)
