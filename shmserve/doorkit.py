"""The parts every door is built from: the Unix door, the HTTP door, the gRPC door's Unix socket and
the door processes (``shmserve.doors``), as uvicorn's ``flow_control.py`` serves both of its HTTP
protocols.

Owns:

* the listening Unix socket (``Listener``, ``check_socket_path``): its path, mode and group, a dead
  predecessor's socket file, and a directory for it that nobody else controls;
* who the peer is (``peer_of``): only what the kernel vouches for, ``SO_PEERCRED`` and
  ``SO_PEERGROUPS`` of a Unix socket, read once when the connection is accepted (a TCP peer has
  none: nothing the kernel says about a TCP connection names its owner for certain);
* what a door bounds (``DoorLimits``) and how it counts its open connections, in all and per
  owner (``ConnectionCounts``), with the refusal that names the key;
* a connection's flow control (``FlowControl``): reading paused and resumed only when that changes
  something, and writing with the transport's buffer limit 0 (``pause_writing`` means "not all
  sent", ``resume_writing`` "all sent"), with the stall timer that ends a connection whose answers
  go unread for ``stall_timeout_s``;
* the input deadline of what a client is in the middle of sending (``InputDeadline``: one timer,
  keyed by what it times, restarted only when that changes);
* the native protocol's byte pump and its input deadlines (``FramePump``), shared by main's Unix
  door and a door process's connections.

Every timer is made through a ``later(seconds, callback)`` the door passes in (its loop, or a
fake clock in tests), so each part runs without a loop.

The socket's directory: whoever can write it can replace the socket with
their own, and a client's tensors go to them.  So the directory must belong
to the server's uid (or root) and be writable by nobody else (unless sticky,
like /tmp: then nobody else can remove or rename our entries); one that is
missing is created 0700 (0750 with ``socket_group``, which it then gets).
Symbolic links are not followed: not for the directory (opened O_NOFOLLOW,
checked and changed through that descriptor), not for the socket (its mode is
set on the socket before ``bind``, its group with ``lchown``).

Must not: decide anything about a request, know a door's wire format beyond the native protocol's
state (``FramePump``), or trust anything about a peer but what the kernel says.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable

from shmserve import protocol
from shmserve.errors import ErrorCode

log = logging.getLogger("shmserve.doorkit")

SOCKET_BUFFER = 4 * 1024 * 1024  # kernel socket buffers (capped by net.core.wmem_max/rmem_max)
LISTEN_BACKLOG = 512
SUN_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path, without its NUL)
PROBE_TIMEOUT_S = 2.0  # is a socket file at our path a live server?
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

Later = Callable[..., object]  # later(seconds, callback, *args) -> a handle with cancel()


# -- the listening socket -------------------------------------------------------------------

def check_socket_path(path: str) -> None:
    """SystemExit naming the fix if ``path`` cannot be a Unix socket address, if its directory
    exists and is not one the server can trust (see the module header), or if something other
    than a dead server's socket is there (``socket_left_by_the_dead``); checked again at bind.
    Run before start-up spawns anything, so a path already taken costs no model load."""
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise SystemExit(f"shmserve: socket path {path!r} is longer than the {SUN_PATH_MAX} bytes a Unix "
                         f"socket address holds; choose a shorter --socket")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.lstat(directory)
    except OSError:
        return  # missing: made at bind (a path that cannot be made is reported there)
    problem = socket_dir_problem(directory, st)
    if problem:
        raise SystemExit(f"shmserve: cannot listen on {path}: {problem}")
    try:
        socket_left_by_the_dead(path)
    except OSError:
        return  # cannot look (permissions): bind reports it


def socket_left_by_the_dead(path: str) -> bool:
    """Whether a socket file at ``path`` was left by a server that is gone (it refuses
    connections: the caller may remove it); False if nothing is there.

    Raises SystemExit naming the fix if anything else is there: not a socket, or a live server
    (it accepts: its pid, from SO_PEERCRED, is named; or its backlog is full: busy); OSError if
    the path cannot be looked at."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise SystemExit(f"shmserve: {path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)  # a live server with a full backlog would hold a blocking connect
    try:
        probe.connect(path)
        pid = PEERCRED.unpack(probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))[0]
    except (TimeoutError, BlockingIOError):  # EAGAIN: its backlog is full
        raise SystemExit(f"shmserve: another server is listening on {path} (busy: it did not accept within "
                         f"{PROBE_TIMEOUT_S:g} s); stop it or choose another --socket") from None
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    finally:
        probe.close()
    raise SystemExit(f"shmserve: another server (pid {pid}) is listening on {path}; stop it or choose another "
                     f"--socket")


def socket_dir_problem(directory: str, st: os.stat_result) -> str | None:
    """Why ``directory`` (``st``: its lstat) must not hold the server's socket, with the fix; None if
    it may: a real directory of our uid or root that nobody else can write (or a sticky one)."""
    if stat.S_ISLNK(st.st_mode):
        return (f"its directory {directory} is a symbolic link; choose another --socket "
                f"(or give the real directory)")
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory; choose another --socket"
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return (f"its directory {directory} belongs to uid {st.st_uid}, not to this server's uid {me} or root, "
                f"so that user controls the socket; remove the directory or choose another --socket")
    writable = st.st_mode & 0o022
    if writable and not st.st_mode & stat.S_ISVTX:
        who = "others" if writable & 0o002 else "its group"
        return (f"its directory {directory} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}), who could "
                f"replace the socket; run chmod go-w {directory} or choose another --socket")
    return None


class Listener:
    """A bound, listening socket at ``path`` (mode and group applied), or one handed over by
    systemd socket activation (then not ours to unlink)."""

    def __init__(self, path: str, *, mode: int = 0o600, group: str | None = None,
                 sock: socket.socket | None = None):
        """SystemExit naming the fix if the socket cannot be made (a user's mistake, not a bug)."""
        self.path = path
        self.created_dir: Path | None = None  # made by us, removed again at exit if empty
        self._bound: socket.socket | None = None  # bound by us, while the rest of the set-up runs
        self.owned = sock is None
        if sock is None:
            try:
                sock = self._bind(mode, group)
            except (OSError, KeyError) as exc:  # KeyError: no such socket_group
                self._undo()
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"no group {group!r}"
                raise SystemExit(f"shmserve: cannot listen on {path}: {reason}; choose another --socket "
                                 f"(or fix the directory's permissions)") from None
        self.sock = sock

    def _bind(self, mode: int, group: str | None) -> socket.socket:
        path = Path(self.path)
        gid = None
        if group is not None:
            import grp

            gid = grp.getgrnam(group).gr_gid
        self._own_directory(path.parent, gid)
        if socket_left_by_the_dead(str(path)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~mode)
        try:
            os.fchmod(sock.fileno(), mode)  # bind creates the file with the socket's mode (less the umask)
            sock.bind(str(path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        self._bound = sock  # ours to unlink if what follows fails
        if gid is not None:
            os.chown(path, -1, gid, follow_symlinks=False)
        sock.listen(LISTEN_BACKLOG)
        return sock

    def _own_directory(self, directory: Path, gid: int | None) -> None:
        """Make the socket's directory (0700, or 0750 with group ``gid``), or check the one there is;
        SystemExit naming the fix if it is not ours to trust (``socket_dir_problem``)."""
        if not directory.parent.exists():
            directory.parent.mkdir(parents=True)
        try:
            os.mkdir(directory, 0o700)
            self.created_dir = directory
        except FileExistsError:
            pass
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            problem = socket_dir_problem(str(directory), os.lstat(directory))
            raise SystemExit(f"shmserve: cannot listen on {self.path}: {problem}") from None
        try:
            if self.created_dir is not None:  # ours: mode and group through the descriptor, never a path
                if gid is not None:
                    os.fchown(fd, -1, gid)
                os.fchmod(fd, 0o750 if gid is not None else 0o700)
            problem = socket_dir_problem(str(directory), os.fstat(fd))
        finally:
            os.close(fd)
        if problem:
            raise SystemExit(f"shmserve: cannot listen on {self.path}: {problem}")

    def _undo(self) -> None:
        """After a failed bind: remove what this listener made (a bound socket file, its directory)."""
        if self._bound is not None:
            self._bound.close()
            self.remove()
        elif self.created_dir is not None:
            try:
                self.created_dir.rmdir()
            except OSError:
                pass

    def remove(self) -> None:
        """Unlink the socket file (and the directory we made for it, if empty); ours only."""
        if not self.owned:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.created_dir is not None:
            try:
                self.created_dir.rmdir()
            except OSError:
                pass  # not empty: somebody else's files live there too


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+


def peer_groups(sock: socket.socket, gid: int) -> set[int]:
    """The peer's primary gid (SO_PEERCRED) and its supplementary groups as they were when it
    connected (SO_PEERGROUPS, from the socket itself: reading /proc/<pid>/status instead could
    read another process's groups once that pid has exited and been reused).  A peer in more
    groups than one getsockopt can return (256) is judged by its primary gid alone."""
    groups = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError:
        return groups
    groups.update(int(g) for g in array.array("I", raw[:len(raw) - len(raw) % 4]))
    return groups




@dataclass(frozen=True)
class Peer:
    """A Unix-socket peer as the kernel recorded it when it connected: ``pid``, ``uid``, ``gid``
    (``SO_PEERCRED``) and ``groups``, its gid and supplementary groups (``SO_PEERGROUPS``)."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


UNKNOWN_PEER = Peer(-1, -1, -1, frozenset({-1}))  # the kernel could not say (never on a live Unix socket)


def peer_of(sock: socket.socket | None) -> Peer | None:
    """The peer of an accepted Unix stream socket; None for any other socket (TCP: the kernel
    vouches for no one) or if the kernel cannot say."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, gid = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    except OSError:
        return None
    return Peer(pid, uid, gid, frozenset(peer_groups(sock, gid)))


def big_buffers(sock: socket.socket) -> None:
    """Ask for ``SOCKET_BUFFER`` kernel buffers both ways (big inline tensors: fewer, larger
    transfers); the kernel caps them, and a refusal is no harm."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass


# -- what a door bounds ---------------------------------------------------------------------

@dataclass(frozen=True)
class DoorLimits:
    """What the door bounds per connection and per peer uid; the values (and why they are what
    they are) come from ``ServerConfig``'s keys of the same names, and the server replaces them on
    reload.  Each refusal and each deadline names its key."""

    max_connections: int  # open connections in all
    max_connections_per_uid: int  # open connections of one peer uid
    max_inflight_per_uid: int  # requests in flight on all connections of one peer uid
    max_inflight_bytes_per_connection: int  # a connection's requests' arena bytes: no new frame at this
    stall_timeout_s: float  # answers unread this long: the connection is closed
    frame_timeout_s: float  # a begun frame's header and metadata must arrive within this
    upload_timeout_s: float  # an admitted inline request's payload must arrive within this




class ConnectionCounts:
    """A door's open connections: all of them, and those of each owner (a peer uid, or a v2
    identity's key; a TCP connection has none).  ``refusal`` says why one more may not be served."""

    def __init__(self):
        self.open: set = set()
        self.of_owner: dict[Hashable, set] = {}
        self._owner: dict[object, Hashable] = {}

    def __len__(self) -> int:
        return len(self.open)

    def __iter__(self):
        return iter(self.open)

    def __contains__(self, conn) -> bool:
        return conn in self.open

    def count(self, owner: Hashable) -> int:
        """Connections ``owner`` has open."""
        return len(self.of_owner.get(owner, ()))

    def refusal(self, limits: DoorLimits, owner: Hashable | None, who: str, *, door: str = "the server",
                kind: str = "") -> str | None:
        """Why a connection of ``owner`` (``who``, for the message) may not be served now, naming the
        key (``max_connections``: ``door`` has that many open; ``max_connections_per_uid``: ``who``
        has that many ``kind`` connections open); None if it may."""
        if len(self.open) >= limits.max_connections:
            return f"{door} has {len(self.open)} connections open (server.max_connections)"
        if owner is not None and self.count(owner) >= limits.max_connections_per_uid:
            return f"{who} has {self.count(owner)} {kind}connections open (server.max_connections_per_uid)"
        return None

    def enter(self, conn, owner: Hashable | None) -> None:
        self.open.add(conn)
        if owner is not None:
            self._owner[conn] = owner
            self.of_owner.setdefault(owner, set()).add(conn)

    def leave(self, conn) -> bool:
        """``conn`` is gone; whether it was counted (a refused one never was)."""
        if conn not in self.open:
            return False
        self.open.remove(conn)
        owner = self._owner.pop(conn, None)
        if owner is not None:
            mine = self.of_owner[owner]
            mine.discard(conn)
            if not mine:
                del self.of_owner[owner]
        return True


# -- flow control and deadlines ---------------------------------------------------------------

class FlowControl:
    """One connection's flow control, both ways (what uvicorn's ``FlowControl`` is to its HTTP
    protocols).

    Reading: ``read_while(transport, want)`` pauses or resumes the transport's reading only when
    that changes something (``reading`` remembers how it was last set; a transport starts reading).

    Writing: the door sets the transport's write buffer limit to 0 (``zero_write_buffer``), so the
    transport's ``pause_writing`` means "not all sent" and ``resume_writing`` "all sent".  The
    protocol passes both on (``writing_paused``, ``writing_resumed``); while writing is paused
    (``write_blocked``) the stall timer runs, and if the client has not read its answers within
    the given seconds, ``on_stall`` is called (the door closes the connection).  ``stop`` cancels
    the stall timer (the connection is gone).

    Rules
    -----
    =========  ==================  =========  =============================
    from       event               to         and
    =========  ==================  =========  =============================
    flowing    writing_paused      blocked    the stall timer starts
    blocked    writing_paused      blocked    (the timer runs on)
    blocked    writing_resumed     flowing    the stall timer stops
    blocked    the timer fires     blocked    ``on_stall()`` (the door ends it)
    any        stop                (same)     the stall timer stops
    =========  ==================  =========  =============================
    """

    __slots__ = ("later", "reading", "write_blocked", "stall_timer")

    def __init__(self, later: Later):
        self.later = later
        self.reading = True  # the transport's reading, as last set here
        self.write_blocked = False  # from pause_writing to resume_writing: answers wait in the transport
        self.stall_timer = None

    @staticmethod
    def zero_write_buffer(transport) -> None:
        """Set ``transport``'s write buffer limits to 0: ``pause_writing`` then means "not all
        sent" and ``resume_writing`` "all sent"."""
        transport.set_write_buffer_limits(high=0, low=0)

    def read_while(self, transport, want: bool) -> bool:
        """Resume or pause ``transport``'s reading to ``want``; whether that changed anything."""
        if want == self.reading:
            return False
        self.reading = want
        if want:
            transport.resume_reading()
        else:
            transport.pause_reading()
        return True

    def writing_paused(self, stall_s: float, on_stall: Callable[[], None]) -> None:
        """Answers wait in the transport: ``on_stall()`` in ``stall_s`` seconds unless they are all
        sent before (the timer started by the first pause runs on)."""
        self.write_blocked = True
        if self.stall_timer is None:
            self.stall_timer = self.later(stall_s, self._stalled, on_stall)

    def writing_resumed(self) -> None:
        """All written is sent: the stall timer stops."""
        self.write_blocked = False
        self.stop()

    def stop(self) -> None:
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None

    def _stalled(self, on_stall: Callable[[], None]) -> None:
        self.stall_timer = None
        on_stall()


class InputDeadline:
    """The deadline of what a client is in the middle of sending: one timer at a time, keyed by the
    config key that bounds it (``frame_timeout_s``, ``upload_timeout_s``).  ``run`` starts it
    unless it already runs for that key (a piece more of the same frame or body does not restart
    it); ``cancel`` stops it (the input is complete, or this side stopped reading: the client is not
    the one keeping us waiting).  When it fires, ``callback(key, seconds)`` is called."""

    __slots__ = ("later", "key", "seconds", "handle")

    def __init__(self, later: Later):
        self.later = later
        self.key: str | None = None
        self.seconds = 0.0
        self.handle = None

    @property
    def running(self) -> bool:
        return self.handle is not None

    def run(self, key: str, seconds: float, callback: Callable[[str, float], None]) -> None:
        if self.handle is not None and self.key == key:
            return
        self.cancel()
        self.key, self.seconds = key, seconds
        self.handle = self.later(seconds, self._fire, callback)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.key = None

    def _fire(self, callback: Callable[[str, float], None]) -> None:
        key, seconds = self.key, self.seconds
        self.handle, self.key = None, None
        callback(key, seconds)


# -- the native protocol's byte pump ------------------------------------------------------------

FRAME_TIMEOUT, UPLOAD_TIMEOUT = "frame_timeout_s", "upload_timeout_s"  # DoorLimits fields, and config keys
MID_PAYLOAD = (protocol.State.PAYLOAD, protocol.State.DISCARD)


class FramePump(asyncio.BufferedProtocol):
    """What reads a native-protocol connection, for main's door and a door process's alike: a
    payload arrives straight into the sinks the protocol was given (``payload_buffer``), anything
    else into ``read_view`` and the protocol; then ``_update``.  And the deadlines of what the
    client is in the middle of sending (``_await_input``: a frame's header and metadata within
    ``frame_timeout_s``, a payload within ``upload_timeout_s``; ``_input_refusal``: the last
    frame it is sent), the same for both.

    The subclass has ``proto``, ``read_view``, ``into_payload``, ``closed``, ``transport``, ``pid``,
    ``uid`` and ``_update``; ``flow`` (a ``FlowControl``) and ``input_deadline`` (an
    ``InputDeadline``), made with its ``_later(seconds, callback, *args)``; ``_input_limit(key)``
    (seconds) and ``_input_timed_out(key, seconds)``."""

    def get_buffer(self, sizehint: int):
        target = self.proto.payload_buffer()
        self.into_payload = target is not None
        return target if target is not None else self.read_view

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        if self.into_payload:
            self.proto.payload_received(nbytes)
        else:
            self.proto.receive_data(self.read_view[:nbytes])
        self._update()

    @property
    def reading(self) -> bool:
        return self.flow.reading

    @property
    def write_blocked(self) -> bool:
        return self.flow.write_blocked

    def _await_input(self) -> None:
        """The protocol needs more bytes: time what the client is in the middle of sending (a
        frame's header and metadata, or a payload); between frames, an idle client is no harm."""
        if self.proto.state in MID_PAYLOAD:
            key = UPLOAD_TIMEOUT
        elif self.proto.mid_frame:
            key = FRAME_TIMEOUT
        else:
            self.input_deadline.cancel()
            return
        self.input_deadline.run(key, self._input_limit(key), self._input_timed_out)

    def _input_refusal(self, key: str, rid: int | None) -> bytes:
        """The error frame a connection whose ``key`` deadline passed is closed with (logged):
        BAD_FRAME for a frame's header and metadata, TIMEOUT (of request ``rid``) for a payload."""
        if key == FRAME_TIMEOUT:
            rid, code, what = None, ErrorCode.BAD_FRAME, "a frame's header and metadata"
        else:
            code, what = ErrorCode.TIMEOUT, f"the payload of request {rid}" if rid is not None else "a payload"
        message = f"{what} did not all arrive within {self._input_limit(key):g} s (server.{key})"
        log.info("closing a connection from pid %d uid %d: %s", self.pid, self.uid, message)
        return protocol.error_frame(rid, code, message)

    def _read_while(self, want: bool) -> bool:
        """Resume or pause the transport's reading to ``want``; whether that changed anything (and
        when it stopped, the input deadline stops: the client is not the one keeping us waiting)."""
        if self.closed or not self.flow.read_while(self.transport, want):
            return False
        if not want:
            self.input_deadline.cancel()
        return True
