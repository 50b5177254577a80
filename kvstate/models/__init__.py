"""Where models come from: GGUF files, the default model's fetch, the tokenizer.

Imports: ``kvstate.persist`` and the floors beneath it. Design: ``notes/models.md``.
"""

from .load import (
    DEFAULT_MEMBER as DEFAULT_MEMBER,
)
from .load import (
    DEFAULT_NAME as DEFAULT_NAME,
)
from .load import (  # (the public names of ``load``)
    DEFAULT_PACKAGE as DEFAULT_PACKAGE,
)
from .load import (
    DEFAULT_SHA256 as DEFAULT_SHA256,
)
from .load import (
    cache_dir as cache_dir,
)
from .load import (
    fetch as fetch,
)
from .load import (
    load_model as load_model,
)
from .load import (
    tiny_llama as tiny_llama,
)
