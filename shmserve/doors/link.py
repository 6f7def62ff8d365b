"""The link between the main process and one door process: messages over a socketpair, on a loop.

Owns: the message format both ends speak and moving it without blocking
either loop.  A message is a small JSON object (``meta``, with ``"op"``),
optional bytes (``data``: a client's frame, an answer) and optional
descriptors (passed with ``SCM_RIGHTS``)::

    +-----------+-----------+------+---------------+-------------+
    | meta_len  | data_len  | nfds | meta (orjson) | data        |
    | u32       | u64       | u8   | meta_len B    | data_len B  |
    +-----------+-----------+------+---------------+-------------+

The socket is a stream: a message's descriptors travel on its first bytes
(one ``sendmsg``), so they have arrived when its header is read; they are
taken from the queue in order.  A message that names more descriptors than
arrived, or a malformed header, ends the link (both ends are ours: that is a
bug or a dying peer, never a client).

Must not: know what the messages mean (``shmserve.doors.process`` and
``shmserve.frontend.doorhouse`` do), or block: writes the socket cannot take
now wait in order (``pending``) and go when it can.
"""

from __future__ import annotations

import array
import collections
import logging
import os
import socket
import struct
from typing import Callable

import orjson

log = logging.getLogger("shmserve.doors.link")

HEADER = struct.Struct("<IQB")
MAX_META = 1 << 20  # a message's JSON (a models message lists every model's spec)
MAX_DATA = 1 << 40
MAX_FDS = 4  # descriptors one message carries (a lane: its memfd; an answer: a region's)
READ_SIZE = 1 << 20
_FD_SIZE = array.array("i").itemsize


class LinkClosed(Exception):
    """The other end is gone (or sent what no end of ours sends)."""


class Link:
    """One end of a main<->door link over ``sock`` (non-blocking, on ``loop``).

    ``on_message(meta, data, fds)`` is called for each message received (the
    callee owns ``fds``); ``on_closed()`` once, when the other end is gone
    or the link is closed.  ``send`` never blocks: what the socket cannot
    take now waits (``pending`` bytes) and is written when it can.
    """

    def __init__(self, sock: socket.socket, loop, on_message: Callable, on_closed: Callable[[], None]):
        sock.setblocking(False)
        self.sock, self.loop = sock, loop
        self.on_message, self.on_closed = on_message, on_closed
        self.inbox = bytearray()
        self.fds: collections.deque[int] = collections.deque()  # received, not yet taken by a message
        self.outbox: collections.deque[tuple[memoryview, list[int]]] = collections.deque()
        self.pending = 0  # bytes waiting in ``outbox``
        self.closed = False
        self.writing = False
        loop.add_reader(sock.fileno(), self._readable)

    # -- sending ----------------------------------------------------------------------------

    def send(self, meta: dict, data=b"", fds=()) -> None:
        """Queue one message (``fds`` are duplicated by the kernel when it goes: the caller keeps
        its own).  Nothing if the link is closed."""
        if self.closed:
            return
        raw = orjson.dumps(meta)
        head = HEADER.pack(len(raw), len(data), len(fds)) + raw
        if len(data) and len(data) < 65536:
            head, data = head + bytes(data), b""
        self.outbox.append((memoryview(head), list(fds)))
        self.pending += len(head)
        if len(data):
            self.outbox.append((memoryview(data).cast("B"), []))
            self.pending += len(data)
        if not self.writing:
            self._flush()

    def _flush(self) -> None:
        while self.outbox:
            view, fds = self.outbox[0]
            try:
                if fds:
                    sent = self.sock.sendmsg([view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                else:
                    sent = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                return
            self.pending -= sent
            if sent == len(view):
                self.outbox.popleft()
            else:
                self.outbox[0] = (view[sent:], [])  # the descriptors went with the first byte
                break
        want = bool(self.outbox)
        if want != self.writing:
            self.writing = want
            if want:
                self.loop.add_writer(self.sock.fileno(), self._flush)
            else:
                self.loop.remove_writer(self.sock.fileno())

    # -- receiving --------------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(READ_SIZE, socket.CMSG_SPACE(MAX_FDS * 8 * _FD_SIZE))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancillary = b"", []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[:len(payload) - len(payload) % _FD_SIZE])
                self.fds.extend(got)
        if not data:
            self.close()
            return
        self.inbox += data
        try:
            self._messages()
        except LinkClosed as exc:
            log.error("link: %s; closing it", exc)
            self.close()

    def _messages(self) -> None:
        inbox, pos = self.inbox, 0
        while not self.closed and len(inbox) - pos >= HEADER.size:
            meta_len, data_len, nfds = HEADER.unpack_from(inbox, pos)
            if meta_len > MAX_META or data_len > MAX_DATA or nfds > MAX_FDS:
                raise LinkClosed(f"a message header out of bounds ({meta_len}, {data_len}, {nfds})")
            end = pos + HEADER.size + meta_len + data_len
            if len(inbox) < end:
                break
            if len(self.fds) < nfds:
                raise LinkClosed(f"a message names {nfds} descriptors, {len(self.fds)} arrived")
            start = pos + HEADER.size
            meta = orjson.loads(inbox[start:start + meta_len])
            data = bytes(inbox[start + meta_len:end]) if data_len else b""
            fds = [self.fds.popleft() for _ in range(nfds)]
            pos = end
            self.on_message(meta, data, fds)
        if pos:
            del inbox[:pos]

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the link (idempotent): unsent messages are dropped, descriptors received and not
        taken are closed, ``on_closed`` is called once."""
        if self.closed:
            return
        self.closed = True
        fileno = self.sock.fileno()
        if fileno >= 0:
            self.loop.remove_reader(fileno)
            if self.writing:
                self.loop.remove_writer(fileno)
        self.sock.close()
        while self.fds:
            os.close(self.fds.popleft())
        self.outbox.clear()
        self.pending = 0
        self.on_closed()
