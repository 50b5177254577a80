"""The compile boundary: records flattened to arrays plus static metadata
(``Spec``), and batch-size buckets, so ``mx.compile`` traces once per bucket.

Imports: ``kvstate.core``. Design: ``notes/compiled.md``.
"""

from .boundary import (
    Flat as Flat,
)
from .boundary import (  # (the public names of ``boundary``)
    Spec as Spec,
)
from .boundary import (
    TraceContext as TraceContext,
)
from .boundary import (
    Traced as Traced,
)
from .boundary import (
    advanced as advanced,
)
from .boundary import (
    flatten as flatten,
)
from .boundary import (
    held_planes as held_planes,
)
from .boundary import (
    host_positions as host_positions,
)
from .boundary import (
    position_arrays as position_arrays,
)
from .boundary import (
    prepare as prepare,
)
from .boundary import (
    proto_of as proto_of,
)
from .boundary import (
    reads_itself as reads_itself,
)
from .boundary import (
    room as room,
)
from .boundary import (
    spec_of as spec_of,
)
from .boundary import (
    traced_mask as traced_mask,
)
from .boundary import (
    traced_offset as traced_offset,
)
from .boundary import (
    traced_read as traced_read,
)
from .boundary import (
    traced_update as traced_update,
)
from .boundary import (
    unflatten as unflatten,
)
from .boundary import (
    validated as validated,
)
from .boundary import (
    with_capacity as with_capacity,
)
