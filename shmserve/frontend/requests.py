"""A request's life in the front-end: its states, the one transition table, and the request itself.

Owns: what a request holds at each moment (nothing, a slot and extent, a
place on a worker's ring, an answer that still points into the arena) and
which events may move it on.  The dispatcher applies the events; front doors
only read ``state``.

Must not: touch the arena, a socket or the clock.  It is data and a check,
in the style of ``shmserve.slotstate``.

Rules
-----
=========  ========  =========  ===============================================
from       event     to         when
=========  ========  =========  ===============================================
NEW        WAIT      WAITING    no arena space yet, or no ready worker of its
                                model: it waits (its front door stops reading
                                until it is admitted)
NEW        ADMIT     ADMITTED   slot (and, inline, an extent) taken; its inputs
                                are being written or received
WAITING    ADMIT     ADMITTED   space freed up (and a worker of its model is
                                ready)
ADMITTED   PUBLISH   QUEUED     READY on a worker's submission ring (an
                                ADMITTED or QUEUED request with no ready
                                worker waits, holding its slot: parked)
QUEUED     RERUN     ADMITTED   its worker answered short: its outputs took more
                                than the guess reserved (``shmserve.
                                reservations``); given an output area of what
                                they took, it is published again, once
QUEUED     HOLD      FLUSHING   answered with outputs that are views of the
                                arena: slot and extent stay held until the
                                front door has written them
FLUSHING   RELEASE   DONE       written, or its front door is gone: freed
QUEUED     ABANDON   ABANDONED  answered (timeout, shutdown) or its front door
                                is gone while a worker may still touch the
                                slot: freed when the worker finishes
ABANDONED  RELEASE   DONE       the worker finished (or died): freed
NEW        END       DONE       answered (refused: nothing was held)
WAITING    END       DONE       timed out, shutting down, or its door is gone
ADMITTED   END       DONE       timed out waiting for a worker, its model
                                cannot be loaded, or its door is gone
                                mid-upload: freed now
QUEUED     END       DONE       answered with a result that holds nothing
                                (zero-copy), with the worker's error, or taken
                                back before a worker claimed it: freed now
=========  ========  =========  ===============================================

Every request gets exactly one answer: the answer is given on the edge that
leaves NEW, WAITING, ADMITTED or QUEUED (HOLD, ABANDON, END), and those are
the only states that can take one, so a second answer is an illegal
transition.  A request whose door is gone takes the same edges, answered to
nobody.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmserve.allocator import Extent
    from shmserve.frontend.models import ModelState
    from shmserve.frontend.regions import Region
    from shmserve.protocol import TensorMeta
    from shmserve.supervisor import WorkerHandle


class RequestState(enum.StrEnum):  # a str subclass: hashed in C on the hot path
    NEW = "new"
    WAITING = "waiting"
    ADMITTED = "admitted"
    QUEUED = "queued"
    FLUSHING = "flushing"
    ABANDONED = "abandoned"
    DONE = "done"


class Event(enum.StrEnum):
    WAIT = "wait"
    ADMIT = "admit"
    PUBLISH = "publish"
    RERUN = "rerun"
    HOLD = "hold"
    RELEASE = "release"
    ABANDON = "abandon"
    END = "end"


class IllegalTransition(RuntimeError):
    """An event the table does not allow in the request's state: a bug in the caller."""


S, E = RequestState, Event
TRANSITIONS: dict[tuple[RequestState, Event], RequestState] = {
    (S.NEW, E.WAIT): S.WAITING,
    (S.NEW, E.ADMIT): S.ADMITTED,
    (S.WAITING, E.ADMIT): S.ADMITTED,
    (S.ADMITTED, E.PUBLISH): S.QUEUED,
    (S.QUEUED, E.RERUN): S.ADMITTED,
    (S.QUEUED, E.HOLD): S.FLUSHING,
    (S.FLUSHING, E.RELEASE): S.DONE,
    (S.QUEUED, E.ABANDON): S.ABANDONED,
    (S.ABANDONED, E.RELEASE): S.DONE,
    (S.NEW, E.END): S.DONE,
    (S.WAITING, E.END): S.DONE,
    (S.ADMITTED, E.END): S.DONE,
    (S.QUEUED, E.END): S.DONE,
}
del S, E

# States in which the request has not been answered yet (and its door may still get an answer).
UNANSWERED = frozenset({RequestState.NEW, RequestState.WAITING, RequestState.ADMITTED, RequestState.QUEUED})
# States in which the request holds a slot of the arena.
HOLDING = frozenset({RequestState.ADMITTED, RequestState.QUEUED, RequestState.FLUSHING, RequestState.ABANDONED})


def next_state(state: RequestState, event: Event) -> RequestState:
    """The state ``event`` leads to from ``state``; IllegalTransition if the table has no such edge."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"request event {event.name} is not allowed in state {state.name}") from None


@dataclass(eq=False)
class Request:
    """One inference request from admission to release.

    ``door`` is the front door's handle for answering it (see ``dispatcher.Door``);
    ``inputs`` the checked input descriptors; ``region`` the client region of a
    zero-copy request (None: inline, its tensors go through arena space).
    What it holds (``slot``, ``generation``, ``extent``, ``out_extent``, ``worker``) is set and
    cleared by the dispatcher; ``state`` only moves through ``advance``.
    """

    door: Any
    id: int
    model: "ModelState"
    inputs: tuple["TensorMeta", ...]
    timeout_s: float
    region: "Region | None" = None
    out_offset: int = 0
    out_capacity: int = 0
    in_bytes: int = 0  # the input tensors' bytes
    total_bytes: int = 0  # inline: arena bytes for inputs and outputs
    slot: int | None = None
    generation: int = 0
    extent: "Extent | None" = None
    out_extent: "Extent | None" = None  # run again (RERUN): its output area, beside the inputs' extent
    signature: "tuple | None" = None  # its inputs' (name, dtype, shape) where its output space was a guess
    reran: bool = False  # it was run again once: a second short answer is its answer
    worker: "WorkerHandle | None" = None
    deadline: float = 0.0  # the clock's time at which it times out, whatever state it is in
    timer: Any = None  # the clock's handle of its deadline
    state: RequestState = RequestState.NEW
    named_version: bool = False  # the client named the version: it is never moved to another one
    started: float = 0.0  # the clock's time at submission (latency for canary analysis)
    unchecked: "Any" = None  # (parsed, payload_bytes, region): inputs to check once its version has loaded (on demand)
    shadow: "Any" = None  # a shadow copy's comparison (canary shadow mode), set on the copy only
    priority: int = 0  # the level its client asked for (0: the model's default; written to its slot)
    caller: int = 0  # its door's caller key (fairness between callers; 0: unknown)
    own_timeout: bool = False  # its client set its own timeout (SLOT_FLAG_OWN_TIMEOUT)

    @property
    def zero_copy(self) -> bool:
        return self.region is not None

    @property
    def answered(self) -> bool:
        return self.state not in UNANSWERED

    def advance(self, event: Event) -> RequestState:
        """Take ``event``; returns the new state.  IllegalTransition if the table forbids it."""
        try:
            self.state = state = TRANSITIONS[(self.state, event)]
        except KeyError:
            next_state(self.state, event)  # raises, naming the edge
            raise
        return state
