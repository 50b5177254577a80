"""kvstate: immutable KV-cache records and pure functions for MLX.

Records (``CacheState``, ``RotatingState``, ``QuantizedState``) are frozen;
every function returns a new record and leaves its input unchanged. This
file is the public surface: everything a user needs is re-exported here and
listed in ``__all__``. Implementation modules are private (``_rows``,
``_dense``, ``_quantized``, ``_ring``, ...), so that no exported name (the
constructors ``kv.rotating``, ``kv.quantized``) shadows a module
(``notes/core.md``). Public modules: ``kvstate.mlx_lm`` (the mlx-lm
bridge), ``kvstate.compiled`` (the compile boundary), ``kvstate.core.masks``,
``kvstate.core.ops``, ``kvstate.core.records``, ``kvstate.errors``, ``kvstate.persist``,
``kvstate.kernels``, ``kvstate.cli``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

from .batch import Batch as Batch
from .compiled.boundary import (
    Flat as Flat,
)
from .compiled.boundary import (
    Spec as Spec,
)
from .compiled.boundary import (
    flatten as flatten,
)
from .compiled.boundary import (
    unflatten as unflatten,
)
from .core import ops as _ops
from .core.layers import ModelCheckpoint as ModelCheckpoint
from .core.masks import (
    MaskKey as MaskKey,
)
from .core.masks import (
    MaskLease as MaskLease,
)
from .core.masks import (
    MaskMemo as MaskMemo,
)
from .core.masks import (
    encoder_window_mask as encoder_window_mask,
)
from .core.masks import (
    rotating_block_mask as rotating_block_mask,
)
from .core.ops import (
    anchor as anchor,
)
from .core.ops import (
    append as append,
)
from .core.ops import (
    attend as attend,
)
from .core.ops import (
    checkpoint as checkpoint,
)
from .core.ops import (
    commit as commit,
)
from .core.ops import (
    extend as extend,
)
from .core.ops import (
    extract_row as extract_row,
)
from .core.ops import (
    fetch as fetch,
)
from .core.ops import (
    filter_rows as filter_rows,
)
from .core.ops import (
    merge_rows as merge_rows,
)
from .core.ops import (
    next_mask as next_mask,
)
from .core.ops import (
    positions as positions,
)
from .core.ops import (
    rollback as rollback,
)
from .core.ops import (
    trim as trim,
)
from .core.records import (
    CacheState as CacheState,
)
from .core.records import (
    Checkpoint as Checkpoint,
)
from .core.records import (
    ChunkedState as ChunkedState,
)
from .core.records import (
    CompositeCheckpoint as CompositeCheckpoint,
)
from .core.records import (
    CompositeState as CompositeState,
)
from .core.records import (
    CompressedState as CompressedState,
)
from .core.records import (
    QuantizedState as QuantizedState,
)
from .core.records import (
    RecurrentCheckpoint as RecurrentCheckpoint,
)
from .core.records import (
    RecurrentState as RecurrentState,
)
from .core.records import (
    RotatingState as RotatingState,
)
from .errors import KVStateError as KVStateError
from .errors import LeaseError as LeaseError
from .kinds.chunked import chunked_state as chunked_state
from .kinds.composite import composite_state as composite_state
from .kinds.compressed import compressed as compressed
from .kinds.dense import empty as empty
from .kinds.dense import from_arrays as from_arrays
from .kinds.quantized import quantized as quantized
from .kinds.quantized import to_quantized as to_quantized
from .kinds.recurrent import recurrent_state as recurrent_state
from .kinds.rotating import from_temporal as from_temporal
from .kinds.rotating import rotating as rotating
from .kinds.shared import SharedState as SharedState
from .kinds.shared import fork as fork
from .kinds.shared import materialize as materialize
from .persist.files import load as load
from .persist.files import save as save
from .sampling import (
    Sampling as Sampling,
)
from .sampling import (
    row_keys as row_keys,
)
from .sampling import (
    sample as sample,
)
from .sampling import (
    sample_arrays as sample_arrays,
)
from .sampling import (
    split_keys as split_keys,
)

if TYPE_CHECKING:
    from .bridge.decoder import Decoder
    from .bridge.shells import Model

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
    "CompressedState",
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
    "compressed",
]
# the pure functions: kvstate.core.ops's operations (re-exported above), then the shared-prefix ones
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
