"""The rows' logits between the model and the sampler: processors, then log-probabilities.

A round's forward is wrapped (``Processed``): each row's logits processors
(``kvstate.sampling.process_logits``: ``logit_bias`` and the penalties, over
the row's context and the round's window, so a drafted position looks back
on the drafts before it) are applied before any row samples or verifies,
and the log-probabilities a request asked for (``logprobs``) are kept for
the tokens the round emits. A batch whose rows ask for neither runs the
plain forward: the wrapper is not made.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import mlx.core as mx

from ..sampling import apply_bitmask, history, process_logits

__all__ = ["FORBIDDEN", "Processed", "needed", "token_logprobs"]

# A masked token's log-probability as reported (JSON has no -inf): vLLM's value.
FORBIDDEN = -9999.0


def needed(sampling: Any, tops: Any) -> bool:
    """Whether some row has processors or asks for log-probabilities."""
    return any(s.processed for s in sampling) or any(t is not None for t in tops)


class Processed:
    """``forward`` with the rows' processors applied; ``logprobs`` ``[B, W, V]`` kept
    (after the call) when a row asks for them.

    Args:
        forward: ``(tokens [B, W], states) -> (logits [B, W, V], states)``.
        sampling: per row, its ``kv.Sampling``.
        contexts: per row, every token so far (its last is the pending token).
        tops: per row, the top log-probabilities it asks for (``None``: none).
        mask: ``mask(logits, window) -> [B, W | 1, ceil(V/32)] int32 bitmask or
            None``: the rows' grammars at each window position
            (``kvstate.speculative.step``'s ``mask``), applied after the processors and
            before the log-probabilities, as vLLM reports them: a token the grammar
            forbids has log-probability ``-inf`` (reported as ``-9999.0``).
    """

    def __init__(
        self,
        forward: Callable,
        sampling: Any,
        contexts: Optional[list],
        tops: list,
        mask: Optional[Callable] = None,
    ) -> None:
        self.forward, self.sampling, self.contexts, self.tops = forward, sampling, contexts, tops
        self.mask = mask
        self.logprobs: Optional[mx.array] = None

    def __call__(self, window: mx.array, states: Any) -> Any:
        logits, states = self.forward(window, states)
        logits = self.apply(logits, window)
        return logits, states

    def apply(self, logits: mx.array, window: Optional[mx.array]) -> mx.array:
        """``logits`` ``[B, W, V]`` processed; keeps their log-probabilities if asked."""
        if any(s.processed for s in self.sampling):
            sizes = [s.context_size for s in self.sampling]
            hist = history(self.contexts or [], sizes, window)
            logits = process_logits(logits, hist, self.sampling)
        bitmask = None if self.mask is None else self.mask(logits, window)
        if bitmask is not None:
            logits = apply_bitmask(logits, bitmask)
        if any(t is not None for t in self.tops):
            lg = logits.astype(mx.float32)
            self.logprobs = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        return logits


def token_logprobs(logprobs: Optional[mx.array], emitted: Any, tops: list) -> list:
    """Per row, per emitted token, ``(logprob, ((id, logprob), ...))`` with the row's
    ``tops[b]`` most likely tokens, best first; ``[]`` for a row that asks for none.

    Args:
        logprobs: ``[B, W, V]``: position ``i`` of row ``b`` is the distribution its
            ``i``-th emitted token was drawn from.
        emitted: per row, the tokens the round emitted.
        tops: per row, ``None`` or how many top tokens (0 to 20).
    """
    out: list = []
    for b, (toks, k) in enumerate(zip(emitted, tops)):
        if k is None or logprobs is None or not toks:
            out.append([])
            continue
        rows = mx.maximum(logprobs[b, : len(toks)], FORBIDDEN)  # [n, V]
        chosen = mx.take_along_axis(rows, mx.array(list(toks))[:, None], axis=-1)[:, 0]
        top = mx.argsort(-rows, axis=-1)[:, :k] if k else mx.zeros((len(toks), 0), mx.int32)
        values = mx.take_along_axis(rows, top, axis=-1)
        chosen_, top_, values_ = (cast(list, a.tolist()) for a in (chosen, top, values))
        out.append([(c, tuple(zip(i, v))) for c, i, v in zip(chosen_, top_, values_)])
    return out
