"""Who is on the other end of a v2 connection, as far as the kernel vouches: a Unix socket's peer.

Owns: the credentials of a Unix-socket peer (``SO_PEERCRED``, and its
supplementary groups from ``SO_PEERGROUPS``, through the Unix door's
helpers), read once when the connection is accepted.

A TCP peer has none: nothing the kernel says about a TCP connection names
its owner for certain (an entry of ``/proc/net/tcp`` may be a closed
socket's, listed with uid 0; a port is anyone's the moment it is free), so a
TCP caller is anonymous unless it proves who it is with a token
(``shmserve.v2.auth``).

Must not: look anything up for a TCP peer, or decide who may do what
(``shmserve.v2.auth``).
"""

from __future__ import annotations

import socket

from shmserve.frontend.unix import _PEERCRED, peer_groups


def credentials(sock: socket.socket) -> tuple[int | None, frozenset[int]]:
    """(uid, groups) of the peer of an accepted Unix stream socket; uid None for any other
    socket (TCP: the kernel vouches for no one) or if the kernel cannot say."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None, frozenset()
    try:
        _, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return None, frozenset()
    return uid, frozenset(peer_groups(sock, gid))
