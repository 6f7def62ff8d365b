"""The models a front-end serves, and which of their workers can take work.

Owns: ``ModelState`` — a model's configuration, its workers, its spec (as
its workers reported it), the choice of worker for a request, and the
model's availability derived from its workers' states.

Must not: start or stop workers (``shmserve.supervisor``) or hold requests
(``shmserve.frontend.dispatcher``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shmserve.config import ModelConfig
from shmserve.spec import ModelSpec
from shmserve.supervisor import FAILED, READY, WorkerHandle

# A model's availability, derived from its workers (``ModelState.state``).
MODEL_READY, MODEL_RESTARTING, MODEL_UNAVAILABLE = "ready", "restarting", "unavailable"


@dataclass(eq=False)
class ModelState:
    index: int  # the model id written into slots and lane headers
    name: str
    config: ModelConfig
    workers: list[WorkerHandle] = field(default_factory=list)

    @property
    def spec(self) -> ModelSpec | None:
        """What the model takes and returns, as its workers reported it (None before any was ready)."""
        for w in self.workers:
            if w.spec is not None:
                return w.spec
        return None

    def pick_worker(self) -> WorkerHandle | None:
        """The ready worker with the fewest requests in flight, or None if none is ready."""
        best = None
        for w in self.workers:
            if w.state == READY and (best is None or len(w.inflight) < len(best.inflight)):
                best = w
        return best

    @property
    def state(self) -> str:
        """MODEL_READY while any worker is ready, MODEL_UNAVAILABLE once all failed for good,
        MODEL_RESTARTING otherwise."""
        if any(w.state == READY for w in self.workers):
            return MODEL_READY
        if all(w.state == FAILED for w in self.workers):
            return MODEL_UNAVAILABLE
        return MODEL_RESTARTING

    @property
    def crash_looping(self) -> bool:
        """Whether a worker of the model is in a crash loop (``WorkerHandle.crash_looping``)."""
        return any(w.crash_looping for w in self.workers)

    def unavailable_reason(self) -> str:
        """Why the model has no ready worker: what its workers said when they failed for good, or
        what each one not ready is doing (how it last died, whether it crash-loops, when it starts
        again)."""
        if self.state == MODEL_UNAVAILABLE:
            errors = sorted({w.error for w in self.workers if w.error})
            return f"model {self.name!r} is unavailable: {'; '.join(errors) or 'its workers failed'}"
        now = time.monotonic()
        parts = []
        for w in self.workers:
            if w.state == READY:
                continue
            part = f"worker {w.index} {w.state}"
            if w.last_exit:
                part += f" after it was {w.last_exit}" if w.last_exit.startswith("killed") else f" after {w.last_exit}"
            if w.crash_looping:
                part += f", crash-looping ({w.crash_streak} deaths in a row)"
            wait = w.restart_in(now)
            if wait is not None:
                part += f", next start in {wait:.1f} s"
            parts.append(part)
        what = "has not loaded yet" if self.spec is None else "has no ready worker"
        return f"model {self.name!r} {what} ({'; '.join(parts)})"
