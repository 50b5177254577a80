"""The CUDA decode kernels (routing, sources, launch) and the stock reads and
writes they fall back to elsewhere.

Imports: ``kvstate.core``. Design: ``notes/kernels.md``.
"""

from .cuda import (
    COPY_BYTES as COPY_BYTES,
)
from .cuda import (
    FUSED_BYTES as FUSED_BYTES,
)
from .cuda import (  # (the public names of ``cuda``)
    MAX_QUERIES as MAX_QUERIES,
)
from .cuda import (
    MAX_SPLITS as MAX_SPLITS,
)
from .cuda import (
    MIN_SPLIT as MIN_SPLIT,
)
from .cuda import (
    PREFETCH as PREFETCH,
)
from .cuda import (
    PREFIX_QUERIES as PREFIX_QUERIES,
)
from .cuda import (
    QUANT_BITS as QUANT_BITS,
)
from .cuda import (
    SINGLE_ROWS as SINGLE_ROWS,
)
from .cuda import (
    SINGLE_SPAN as SINGLE_SPAN,
)
from .cuda import (
    TARGET_BLOCKS as TARGET_BLOCKS,
)
from .cuda import (
    THREADS as THREADS,
)
from .cuda import (
    UNROLL as UNROLL,
)
from .cuda import (
    UNROLL_PACKED as UNROLL_PACKED,
)
from .cuda import (
    copies_for as copies_for,
)
from .cuda import (
    decode_read as decode_read,
)
from .cuda import (
    folded_attention as folded_attention,
)
from .cuda import (
    kernel_available as kernel_available,
)
from .cuda import (
    kernel_fits as kernel_fits,
)
from .cuda import (
    quantized_attention as quantized_attention,
)
from .cuda import (
    quantized_fits as quantized_fits,
)
from .cuda import (
    ragged_attention as ragged_attention,
)
from .cuda import (
    splits_for as splits_for,
)
from .cuda import (
    write_and_read as write_and_read,
)
