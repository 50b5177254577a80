"""kvstate: immutable KV-cache records and pure functions for MLX.

Records (``CacheState``, ``RotatingState``, ``QuantizedState``) are frozen;
every function returns a new record and leaves its input unchanged.
"""

from .errors import KVStateError as KVStateError, LeaseError as LeaseError
from .records import (
    CacheState as CacheState,
    Checkpoint as Checkpoint,
    QuantizedState as QuantizedState,
    RotatingState as RotatingState,
    RecurrentState as RecurrentState,
    ChunkedState as ChunkedState,
    CompositeState as CompositeState,
    RecurrentCheckpoint as RecurrentCheckpoint,
    CompositeCheckpoint as CompositeCheckpoint,
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
    positions as positions,
    rollback as rollback,
    trim as trim,
)
from .layers import ModelCheckpoint as ModelCheckpoint
from .masks import (
    MaskKey as MaskKey,
    MaskLease as MaskLease,
    MaskMemo as MaskMemo,
    encoder_window_mask as encoder_window_mask,
    rotating_block_mask as rotating_block_mask,
)
from .dense import empty as empty, from_arrays as from_arrays
from .quantized import quantized as quantized
from .rotating import rotating as rotating
from .recurrent import recurrent_state as recurrent_state
from .chunked import chunked_state as chunked_state
from .composite import composite_state as composite_state
from .persist import load as load, save as save
from .shared import SharedState as SharedState, fork as fork, materialize as materialize
from .batch import Batch as Batch
from .sampling import (
    Sampling as Sampling,
    row_keys as row_keys,
    sample as sample,
    sample_arrays as sample_arrays,
    split_keys as split_keys,
)
from .compiled import (
    compiled_decoder as compiled_decoder,
    flatten as flatten,
    unflatten as unflatten,
)

__version__ = "0.1.0"
