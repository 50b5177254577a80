"""Batched speculative decoding with per-row acceptance: rounds (``start``,
``step``, ``join``, ``leave``), the cost-aware verify window and the draft
sources (prompt lookup, a draft model).

Imports: ``kvstate.mlx_lm`` and the floors beneath it. Design: ``notes/speculative.md``.
"""

from .rounds import (  # (the public names of ``rounds``)
    DraftModel as DraftModel,
)
from .rounds import (
    Lookup as Lookup,
)
from .rounds import (
    Round as Round,
)
from .rounds import (
    Speculation as Speculation,
)
from .rounds import (
    Window as Window,
)
from .rounds import (
    accept_greedy as accept_greedy,
)
from .rounds import (
    accept_sampled as accept_sampled,
)
from .rounds import (
    compiled as compiled,
)
from .rounds import (
    eager as eager,
)
from .rounds import (
    expected_accepted as expected_accepted,
)
from .rounds import (
    join as join,
)
from .rounds import (
    leave as leave,
)
from .rounds import (
    next_num_draft as next_num_draft,
)
from .rounds import (
    probabilities as probabilities,
)
from .rounds import (
    recorded as recorded,
)
from .rounds import (
    start as start,
)
from .rounds import (
    step as step,
)
