"""Client library: ``Client`` (blocking) and ``AsyncClient`` (asyncio), two faces over one implementation.

Every operation is written once, without I/O, and each face only pumps it
(after h11 and the clients over it): the *core* decides, a *pump* does the
I/O its steps ask for (``shmserve.client.steps`` states the contract).

==================  ===========================================================
module              owns
==================  ===========================================================
``steps``           the vocabulary between logic and pumps: the steps
                    (``Exchange``, a lane call, ``CONNECT``) and ``Operation``
                    (a common case without a generator, then steps)
``core``            ``ClientCore``: the state both faces keep (session,
                    regions, specs, limits, infer's lanes), when a connection
                    is over and what a new one forgets, whether a request is
                    sent again, and the operations of a request or a few
``infer``           ``InferOperation``: ``infer`` through a lane or the socket
``zerocopy``        ``ZeroCopyOperation`` (one zero-copy call's run, swaps
                    included) and its faces ``ZeroCopyCall``,
                    ``AsyncZeroCopyCall``
``planning``        where a call's tensors go, from the model's spec (pure)
``memory``          ``Region``, ``RegionAllocator``, infer's seats in a lane
``pump``            what both pumps share: the socket's set-up and checks,
                    looking whether the server is still there
``blocking``        ``Client`` and ``BlockingPump``
``aio``             ``AsyncClient``, ``AsyncPump`` and ``LaneWatcher``
==================  ===========================================================

Everything about frames — building requests, request ids, checking and
decoding answers, the descriptors the server passes — is
``shmserve.session.ClientSession``'s.  Zero-copy calls and ``infer`` go
through lanes by default (``shmserve.lanes.ClientLane``: a region with its own
queue to a worker, no socket round trip).

Before either client sends anything it checks who serves the socket
(``SO_PEERCRED``): its own uid, root, or the ``server_uid`` it was given
(else $SHMSERVE_SERVER_UID); anyone else is refused with PERMISSION_DENIED
(``session.check_server``).

Errors raise ``ShmserveError`` (``.code`` is the server's stable code);
``ConnectionClosed`` when no server answers or the connection ended.  A
connection that ended is replaced by a new one on the next call (a server
restarted on the same socket serves it), and a request not a byte of which
reached the socket is sent once more on it; one that may have reached the
server is never sent again (docs/protocol.md, "When the server goes away").
Neither client is thread-safe; use one per thread (they are cheap).

Must not: parse or build frames (the session does), or trust what the server
sends (the session checks frames; ``Region`` checks the memory it is given).
"""

from __future__ import annotations

from shmserve.client.aio import AsyncClient, LaneWatcher
from shmserve.client.blocking import Client
from shmserve.client.core import LIFECYCLE_TIMEOUT_S
from shmserve.client.infer import LANE_RETRY_S
from shmserve.client.memory import SEATS_MAX, Region, RegionAllocator
from shmserve.client.planning import DEFAULT_OUTPUT_CAPACITY, DEFAULT_REGION_BYTES, LANE_FORMS_MAX, SPEC_RETRIES, \
    region_limit
from shmserve.client.pump import ANSWER_GRACE_S, LOOK_S, MAX_IOV, SOCKET_BUFFER
from shmserve.client.zerocopy import AsyncZeroCopyCall, ZeroCopyCall

__all__ = ["ANSWER_GRACE_S", "DEFAULT_OUTPUT_CAPACITY", "DEFAULT_REGION_BYTES", "LANE_FORMS_MAX", "LANE_RETRY_S",
           "LIFECYCLE_TIMEOUT_S", "LOOK_S", "MAX_IOV", "SEATS_MAX", "SOCKET_BUFFER", "SPEC_RETRIES", "AsyncClient",
           "AsyncZeroCopyCall", "Client", "LaneWatcher", "Region", "RegionAllocator", "ZeroCopyCall", "region_limit"]

# Their public home, as numpy's and pandas' public classes say theirs: reprs and help() name
# shmserve.client, not the module of the package that defines them.
for _public in (AsyncClient, AsyncZeroCopyCall, Client, LaneWatcher, Region, RegionAllocator, ZeroCopyCall):
    _public.__module__ = __name__
del _public
