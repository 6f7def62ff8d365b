"""What the client's logic asks its pumps to do: the steps, the operations, and the contract between them.

Every client operation is written once, without I/O, for both faces: a
generator of *steps* (``Client`` and ``AsyncClient`` drive it, each with its
own I/O: ``BlockingPump.run``, ``AsyncPump.run``), after h11's sans-I/O
connection and httpcore's pumps over it.  A step is one of:

* ``Exchange((build, timeout))``: send the request ``build(session)`` makes (its
  id and parts) and send back the event answering it; the request's error,
  or the connection's, is thrown in instead;
* a lane call, a plain tuple ``(region, slot, generation, deadline, ...)``:
  wait until slot ``slot`` of ``region``'s lane has finished the call of
  ``generation``, by ``deadline`` (the core's clock); TIMEOUT (the slot is then
  abandoned) or ConnectionClosed thrown in;
* ``CONNECT``: make a new connection if this one is over (``ClientCore.connection_over``).

The two calls every hot loop makes, ``infer`` and ``ZeroCopyCall.run``, are
*operations* as well (``Operation``): their common cases run without a
generator, which costs ~2 us a call on a 2-vCPU VM (generators, their frames
and their StopIteration), a tenth of a lane call.  An operation's ``begin``
does the common case up to the lane call it submitted and returns that; the
pump waits for it and hands it to ``answer``, which returns the result.  Or
``begin`` (or ``answer``) returns the one request that ends the operation (an
``Exchange``: the pump sends it and ``answered`` makes the result of its
event), or, whenever neither applies, the steps of the rest, which the pump
drives (``BlockingPump.perform``, ``AsyncPump.perform``).  So a pump has no
logic of its own: which request to send, when to wait, what an answer or
error means, is decided here and in the core.

Must not: touch a socket, an event loop, or block; read a clock (the core's
is passed in).
"""

from __future__ import annotations

import operator
from typing import Protocol

from shmserve.errors import ErrorCode, ShmserveError


class Exchange(tuple):
    """A step: ``Exchange((build, timeout))``: send ``build(session)``'s request (its id and parts)
    and answer with its event; ``timeout``: the request's, None for the client's default.
    (A tuple's own constructor: one is made on every call over the socket, and a NamedTuple's
    costs ~0.2 us more on a 2-vCPU VM.)"""

    __slots__ = ()

    build = property(operator.itemgetter(0), doc="Callable[[ClientSession], tuple[int, list]]: the request")
    timeout = property(operator.itemgetter(1), doc="float | None: its timeout")


CONNECT = object()  # a step: a new connection if this one is over (ConnectionClosed if the client was closed)

# The lane call ``begin`` submits, and the step that waits for one, is a plain tuple: a NamedTuple
# costs ~0.4 us to make on a 2-vCPU VM, and one is made on every lane call.
LANE_REGION, LANE_SLOT, LANE_GENERATION, LANE_DEADLINE = range(4)


class Operation(Protocol):
    """An operation both faces carry out (``infer``, ``ZeroCopyCall.run``), over ``args``: its
    arguments as one tuple (passed on as it is: ``*args`` costs ~0.1 us more a call).

    ``begin(args)``: its common case without I/O, up to a lane call it submitted (a tuple,
    above, holding whatever else ``answer`` needs); or the one request (``Exchange``) whose
    answer ends the operation; or its steps (a generator).  ``answer(call, failure)``: after
    the pump waited for ``call`` (``failure``: the exception waiting raised, else None), the
    operation's result (a dict), the one request that ends it, or the steps of the rest.
    ``answered(event)``: the result of the operation that request ended, from the event
    answering it.  Any of them may raise the operation's error."""

    def begin(self, args: tuple): ...

    def answer(self, call: tuple, failure: BaseException | None): ...

    def answered(self, event): ...


def left(deadline: float, now: float) -> float:
    """Seconds from ``now`` until ``deadline``; TIMEOUT if none are left."""
    remaining = deadline - now
    if remaining <= 0:
        raise ShmserveError(ErrorCode.TIMEOUT, "no answer in time")
    return remaining
