"""What both pumps share: the Unix socket's set-up and checks, and looking whether the server is still there.

A pump carries out the I/O of the steps the client's logic yields
(``shmserve.client.steps``) on one connection: ``BlockingPump`` (``Client``)
blocks in the kernel, ``AsyncPump`` (``AsyncClient``) waits in an asyncio
loop.  Everything they both do outside their waits is here: making the
socket (``unix_socket``), checking who serves it before anything is sent
(``check_server_socket``: ``SO_PEERCRED``), the descriptors a read brought
(``passed_fds``), what a send took (``sent``), and ``Pump.look_if_due``: a
call through a lane touches no socket, so a server that went away while the
client was idle is noticed by a peek at the socket, at most every LOOK_S,
before the call is placed in a dead lane.

Must not: decide anything about a request (the steps do); build or parse
frames (the session does).
"""

from __future__ import annotations

import array
import select
import socket
import struct
import time

from shmserve.client.core import ClientCore
from shmserve.client.steps import CONNECT, Exchange
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError
from shmserve.lanes import WAIT_SLICE_S
from shmserve.session import check_server

ANSWER_GRACE_S = 5.0  # wait this much longer than the request's timeout for the server's own answer
SOCKET_BUFFER = 4 * 1024 * 1024  # fewer, larger transfers for big inline tensors (capped by net.core.*mem_max)
MAX_IOV = 512  # buffers per sendmsg (the kernel takes up to IOV_MAX, 1024)
LOOK_S = WAIT_SLICE_S  # a call through a lane first looks whether the server is still there, if not seen since
FD_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def unix_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass
    return sock


def no_server(path: str, exc: OSError) -> ConnectionClosed:
    return ConnectionClosed(f"no shmserve server at {path} ({exc.strerror})")


def check_server_socket(sock: socket.socket, path: str, trusted: frozenset[int]) -> None:
    """Close ``sock`` and raise PERMISSION_DENIED unless a trusted uid serves it (nothing sent yet)."""
    try:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        check_server(path, pid, uid, trusted)
    except BaseException:
        sock.close()
        raise


def passed_fds(ancdata) -> list[int]:
    """The descriptors a recvmsg received (SCM_RIGHTS)."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def closed_message(path: str) -> str:
    """Why calls in flight fail when the server closes the connection: it went away (or stopped
    serving this client) with them unanswered.  They may have run: they are not sent again."""
    return (f"the server at {path} closed the connection (a call in flight may have run: it is not sent "
            f"again; the next call connects again)")


def sent(parts: list, n: int) -> None:
    """Drop from ``parts`` the ``n`` bytes one sendmsg took (and empty parts at the front)."""
    while parts and n >= len(parts[0]):
        n -= len(parts[0])
        del parts[0]
    if n:
        parts[0] = memoryview(parts[0])[n:]


def peer_gone(sock: socket.socket, path: str) -> str | None:
    """Why the connection is over if the server closed it, else None.  Never blocks: a peek on a
    socket with a timeout would wait (CPython polls first), so it looks with select first."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable and sock.recv(1, socket.MSG_PEEK) == b"":
            return closed_message(path)
    except OSError as exc:
        return f"connection to {path} lost: {exc}"
    return None


class Pump:
    """The part of a pump that does not wait: its core, its socket (None while it has none), when
    the connection was last seen open (monotonic), and ending the connection (``fail``)."""

    def __init__(self, core: ClientCore):
        self.core = core
        self.sock: socket.socket | None = None
        self.seen_at = 0.0

    def look_if_due(self) -> None:
        """If the connection was not seen open within LOOK_S, look, and end it if the server closed
        it (the next call connects again)."""
        if self.core.session.failure is None and self.sock is not None and \
                time.monotonic() - self.seen_at > LOOK_S:
            why = peer_gone(self.sock, self.core.path)
            if why is None:
                self.seen_at = time.monotonic()
            else:
                self.fail(why)

    def fail(self, message: str, code: ErrorCode | None = None) -> ShmserveError:
        """The connection is over (the first reason stands): the error to raise."""
        return self.core.session.fail(message, code).error

    def carry_out(self, step):
        """The I/O of one step (``shmserve.client.steps``): its answer from ``BlockingPump``, an
        awaitable of it from ``AsyncPump`` (each pump's ``exchange``, ``ensure_connected`` and
        ``wait_lane`` are its own)."""
        if type(step) is Exchange:
            build, timeout = step
            return self.exchange(build, timeout)
        if step is CONNECT:
            return self.ensure_connected()
        return self.wait_lane(step)
