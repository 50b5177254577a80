"""``kvstate.engine``: the documented path of ``kvstate.serving.engine`` (re-exported)."""

from .serving.engine import (
    Completion as Completion,
)
from .serving.engine import (
    KVStateEngine as KVStateEngine,
)
from .serving.engine import (
    MlxLmEngine as MlxLmEngine,
)
from .serving.engine import (  # (the public names of ``engine``)
    Request as Request,
)
from .serving.engine import (
    SpeculativeEngine as SpeculativeEngine,
)
from .serving.engine import (
    serve as serve,
)
