"""The slot state machine: states, the one transition table, and who may take each edge.

Owns: the meaning of the ``state`` half of a slot's status word.  The arena
module applies transitions with a compare-and-swap on the whole status word
(generation and state); the front-end, workers and lane clients request them,
and the inspection tool names states through this table.

Two kinds of slot table follow it: the arena's (the front-end plays the
``front-end`` part) and each lane's (``shmserve.lanes``: the client plays
the ``client`` part, and the front-end only fails what a dead worker left).

Must not: touch memory.  It is pure data and a check.

Rules
-----
====================  ==========  ==========================================
from -> to            actor       when
====================  ==========  ==========================================
FREE    -> WRITING    front-end   acquire; the generation is incremented
                      client      (a lane slot)
WRITING -> READY      front-end   inputs written, queued on a worker's ring
                      client      (a lane slot)
WRITING -> FREE       front-end   abandoned before submission (bad input,
                                  client gone during upload)
                      client      (a lane slot)
READY   -> RUNNING    worker      claimed from the submission ring
READY   -> ERROR      front-end   failed while queued (worker died, timeout,
                                  shutdown, its caller gone)
                      client      a lane call taken back before a worker
                                  claimed it (its caller gave up; then
                                  ERROR -> FREE): the claim fails, it never runs
RUNNING -> DONE       worker      outputs written (GPU: stream synchronized)
RUNNING -> ERROR      worker      the backend failed on this request
RUNNING -> ERROR      front-end   only once the claiming worker is dead
DONE    -> FREE       front-end   response delivered / client released it
                      client      lane answer read
ERROR   -> FREE       front-end   error delivered / nobody left to tell
                      client      lane error read
====================  ==========  ==========================================

A RUNNING slot is never taken away from a live worker: a request that times
out while RUNNING is answered with a timeout error, and its slot is freed when
the worker publishes DONE or ERROR.
"""

from __future__ import annotations

import enum


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    RUNNING = 3
    DONE = 4
    ERROR = 5


class Actor(enum.Enum):
    FRONTEND = "front-end"
    WORKER = "worker"
    CLIENT = "client"  # a lane's own client, on the lane's slots


class IllegalTransition(RuntimeError):
    """A transition the table does not allow: a bug in the caller, not bad input."""


S, A = SlotState, Actor
TRANSITIONS: dict[tuple[SlotState, SlotState], frozenset[Actor]] = {
    (S.FREE, S.WRITING): frozenset({A.FRONTEND, A.CLIENT}),
    (S.WRITING, S.READY): frozenset({A.FRONTEND, A.CLIENT}),
    (S.WRITING, S.FREE): frozenset({A.FRONTEND, A.CLIENT}),
    (S.READY, S.RUNNING): frozenset({A.WORKER}),
    (S.READY, S.ERROR): frozenset({A.FRONTEND, A.CLIENT}),
    (S.RUNNING, S.DONE): frozenset({A.WORKER}),
    (S.RUNNING, S.ERROR): frozenset({A.WORKER, A.FRONTEND}),
    (S.DONE, S.FREE): frozenset({A.FRONTEND, A.CLIENT}),
    (S.ERROR, S.FREE): frozenset({A.FRONTEND, A.CLIENT}),
}
del S, A

# Terminal states: the worker is done with the slot and its outputs (or error) are readable.
FINISHED = frozenset({SlotState.DONE, SlotState.ERROR})


_ALLOWED = frozenset((int(frm), int(to), actor) for (frm, to), actors in TRANSITIONS.items() for actor in actors)


def check_transition(frm: int, to: int, actor: Actor) -> None:
    """Raise IllegalTransition unless ``actor`` may move a slot from ``frm`` to ``to``."""
    if (frm, to, actor) in _ALLOWED:  # the hot path: no enum construction
        return
    try:
        edge = (SlotState(frm), SlotState(to))
    except ValueError:
        raise IllegalTransition(f"unknown slot state in {frm} -> {to}") from None
    allowed = TRANSITIONS.get(edge)
    if allowed is None:
        raise IllegalTransition(f"slot transition {edge[0].name} -> {edge[1].name} is not allowed")
    if actor not in allowed:
        raise IllegalTransition(
            f"slot transition {edge[0].name} -> {edge[1].name} is not the {actor.value}'s to make")


def state_name(state: int) -> str:
    """Name of a state value, or 'INVALID(n)' for a value outside the table (hostile arenas)."""
    try:
        return SlotState(state).name
    except ValueError:
        return f"INVALID({state})"
