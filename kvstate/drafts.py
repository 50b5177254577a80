"""``kvstate.drafts``: the documented path of ``kvstate.speculative.drafts`` (re-exported)."""

from .speculative.drafts import (  # (the public names of ``drafts``)
    DraftModel as DraftModel,
)
from .speculative.drafts import (
    Lookup as Lookup,
)
from .speculative.drafts import (
    lookup as lookup,
)
from .speculative.drafts import (
    truncated as truncated,
)
from .speculative.drafts import (
    validate_drafter as validate_drafter,
)
