"""kvstate: immutable KV-cache records and pure functions for MLX.

Records (``CacheState``, ``RotatingState``, ``QuantizedState``) are frozen;
every function returns a new record and leaves its input unchanged. This
file is the public surface: everything a user needs is re-exported here and
listed in ``__all__``. Implementation modules are private (``_rows``,
``_dense``, ``_quantized``, ``_ring``, ...), so that no exported name (the
constructors ``kv.rotating``, ``kv.quantized``) shadows a module
(``notes/design.md``). Public modules: ``kvstate.mlx_lm`` (the mlx-lm
bridge), ``kvstate.compiled`` (the compile boundary), ``kvstate.masks``,
``kvstate.ops``, ``kvstate.records``, ``kvstate.errors``, ``kvstate.persist``,
``kvstate.kernels``, ``kvstate.cli``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version
from typing import TYPE_CHECKING, Any

from . import ops as _ops
from ._dense import empty as empty, from_arrays as from_arrays
from ._quantized import quantized as quantized, to_quantized as to_quantized
from ._ring import from_temporal as from_temporal, rotating as rotating
from .batch import Batch as Batch
from .chunked import chunked_state as chunked_state
from .compiled import Flat as Flat, Spec as Spec, flatten as flatten, unflatten as unflatten
from .composite import composite_state as composite_state
from .errors import KVStateError as KVStateError, LeaseError as LeaseError
from .layers import ModelCheckpoint as ModelCheckpoint
from .masks import (
    MaskKey as MaskKey,
    MaskLease as MaskLease,
    MaskMemo as MaskMemo,
    encoder_window_mask as encoder_window_mask,
    rotating_block_mask as rotating_block_mask,
)
from .ops import (
    anchor as anchor,
    append as append,
    attend as attend,
    checkpoint as checkpoint,
    commit as commit,
    extend as extend,
    extract_row as extract_row,
    fetch as fetch,
    filter_rows as filter_rows,
    merge_rows as merge_rows,
    next_mask as next_mask,
    positions as positions,
    rollback as rollback,
    trim as trim,
)
from .persist import load as load, save as save
from .records import (
    CacheState as CacheState,
    Checkpoint as Checkpoint,
    ChunkedState as ChunkedState,
    CompositeCheckpoint as CompositeCheckpoint,
    CompositeState as CompositeState,
    QuantizedState as QuantizedState,
    RecurrentCheckpoint as RecurrentCheckpoint,
    RecurrentState as RecurrentState,
    RotatingState as RotatingState,
)
from .recurrent import recurrent_state as recurrent_state
from .sampling import (
    Sampling as Sampling,
    row_keys as row_keys,
    sample as sample,
    sample_arrays as sample_arrays,
    split_keys as split_keys,
)
from .shared import SharedState as SharedState, fork as fork, materialize as materialize

if TYPE_CHECKING:
    from ._decoder import Decoder
    from ._shells import Model

try:
    __version__ = _version("kvstate")
except PackageNotFoundError:  # pragma: no cover (running from a source tree)
    __version__ = "0+unknown"


def compiled_decoder(model: Model, **options: Any) -> Decoder:
    """``kvstate.mlx_lm.Decoder(model, **options)``: a compiled decode step for an
    mlx-lm model.

    ``decode(tokens, states) -> (logits, states)``; ``options`` are the
    ``Decoder``'s (``attention``, ``write``, ``wait``, ``batch_buckets``).
    Imported on call: the decoder is part of the mlx-lm bridge, which needs
    ``mlx-lm``.
    """
    from .mlx_lm import compiled_decoder as make

    return make(model, **options)


__all__ = [
    # records
    "CacheState",
    "QuantizedState",
    "RotatingState",
    "RecurrentState",
    "ChunkedState",
    "CompositeState",
    "SharedState",
    "Batch",
    "Checkpoint",
    "RecurrentCheckpoint",
    "CompositeCheckpoint",
    "ModelCheckpoint",
    # constructors
    "empty",
    "rotating",
    "quantized",
    "from_arrays",
    "from_temporal",
    "to_quantized",
    "recurrent_state",
    "chunked_state",
    "composite_state",
]
# the pure functions: kvstate.ops's operations (re-exported above), then the shared-prefix ones
__all__ += _ops.__all__
__all__ += [
    "fork",
    "materialize",
    # sampling
    "Sampling",
    "sample",
    "sample_arrays",
    "row_keys",
    "split_keys",
    # masks
    "MaskKey",
    "MaskMemo",
    "MaskLease",
    "encoder_window_mask",
    "rotating_block_mask",
    # errors
    "KVStateError",
    "LeaseError",
    # compile boundary and decoding
    "flatten",
    "unflatten",
    "Flat",
    "Spec",
    "compiled_decoder",
    # persistence
    "save",
    "load",
]
