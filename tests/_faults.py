"""Faults injected into the scheduler for the fault-isolation tests."""

from kvstate.serving import scheduler as sched_mod

MARK = 0.5  # the temperature that marks the job whose sampling fails


def failing_sampler(monkeypatch, message: str) -> None:
    """The scheduler's first-token sampler raises ``message`` for any batch holding a
    row at temperature ``MARK``, and samples as before otherwise."""
    real = sched_mod.sample_batch

    def sample(logits, batch):
        if any(s.temperature == MARK for s in batch.sampling):
            raise RuntimeError(message)
        return real(logits, batch)

    monkeypatch.setattr(sched_mod, "sample_batch", sample)
