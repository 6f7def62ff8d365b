"""Who is on the other end of a v2 connection: the peer's uid and groups.

Owns: finding the uid of a loopback TCP peer (the owner of its socket, read
from ``/proc/net/tcp`` and ``/proc/net/tcp6``: the entry whose local address
is the peer's and whose remote address is ours), the credentials of a Unix
socket peer (``SO_PEERCRED``, ``SO_PEERGROUPS``, through the Unix door's
helpers), and a uid's groups from the user database (a TCP peer has no
others to tell).

The kernel's table is the truth: a TCP peer cannot claim a uid, and one
whose socket is not in this network namespace's table (not on this
machine) has none and is refused.

Must not: decide who may do what (``shmserve.v2.service``), or block for
long: the table is read once per connection (a few hundred microseconds
with thousands of sockets open).
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import socket
import struct

from shmserve.frontend.unix import _PEERCRED, peer_groups

TABLES = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}


def _hex_address(host: str, port: int) -> str:
    """``host:port`` as the kernel writes it in /proc/net/tcp[6]: the address's 32-bit words in
    host byte order, then the port, in upper-case hexadecimal."""
    packed = ipaddress.ip_address(host).packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def tcp_peer_uid(family: int, ours: tuple, theirs: tuple) -> int | None:
    """The uid owning the TCP socket at ``theirs`` (host, port, ...) that is connected to
    ``ours``, or None if this machine has no such socket or the table cannot be read.  An IPv4
    pair is looked for in both tables: a dual-stack socket (gRPC's, say) holds it as an
    IPv4-mapped IPv6 address."""
    tables = [(TABLES[family], theirs[0], ours[0])]
    if family == socket.AF_INET:
        tables.append((TABLES[socket.AF_INET6], "::ffff:" + theirs[0], "::ffff:" + ours[0]))
    for table, their_host, our_host in tables:
        want = (_hex_address(their_host, theirs[1]).encode(), _hex_address(our_host, ours[1]).encode())
        try:
            with open(table, "rb") as f:
                f.readline()  # the heading
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and (fields[1], fields[2]) == want:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def user_groups(uid: int) -> frozenset[int]:
    """The gids of ``uid``'s primary and supplementary groups in the user database (empty if it
    has no entry)."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return frozenset()
    try:
        return frozenset(os.getgrouplist(user.pw_name, user.pw_gid))
    except OSError:
        return frozenset({user.pw_gid, *(g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem)})


def credentials(sock: socket.socket) -> tuple[int | None, frozenset[int]]:
    """(uid, groups) of the peer of an accepted stream socket: ``SO_PEERCRED`` for a Unix
    socket, the kernel's TCP table for a loopback TCP one; uid None if it cannot be known."""
    if sock.family == socket.AF_UNIX:
        try:
            _, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            return None, frozenset()
        return uid, frozenset(peer_groups(sock, gid))
    try:
        ours, theirs = sock.getsockname(), sock.getpeername()
    except OSError:
        return None, frozenset()
    if not ipaddress.ip_address(theirs[0]).is_loopback:
        return None, frozenset()
    uid = tcp_peer_uid(sock.family, ours, theirs)
    return uid, (user_groups(uid) if uid is not None else frozenset())
