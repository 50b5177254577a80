"""Cache files: the exact ``.safetensors`` format (``kv.save``/``kv.load``) and
the compact one.

Imports: ``kvstate.mlx_lm`` and the floors beneath it. Design: ``notes/persist.md``.
"""

from .files import (
    KVStateError as KVStateError,
)
from .files import (
    check_model as check_model,
)
from .files import (
    load as load,
)
from .files import (
    model_digest as model_digest,
)
from .files import (
    model_geometry as model_geometry,
)
from .files import (  # (the public names of ``files``)
    save as save,
)
