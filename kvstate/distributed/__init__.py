"""Row migration between processes: the wire format and the links.

Imports: ``kvstate.persist`` and the floors beneath it. Design: ``notes/distributed.md``.
"""

from .rows import (  # (the public names of ``rows``)
    batch_rows as batch_rows,
)
from .rows import (
    mismatch as mismatch,
)
from .rows import (
    pack as pack,
)
from .rows import (
    recv_rows as recv_rows,
)
from .rows import (
    send_rows as send_rows,
)
from .rows import (
    signature as signature,
)
from .rows import (
    unpack as unpack,
)
