"""Running a call in another thread (MLX arrays a cache keeps must serve every thread)."""

from __future__ import annotations

import threading
from typing import Any, Callable


def in_another_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a new thread, its result returned here; a ``RuntimeError``
    there (e.g. "There is no Stream(cpu, 0) in current thread": a kept lazy
    array bound to the stream of the thread that made it) fails the test."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except RuntimeError as e:
            out["error"] = str(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    return out["value"]
