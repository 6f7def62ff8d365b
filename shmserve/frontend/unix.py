"""The Unix-socket front door: the native protocol over a local stream socket.

Owns: the listening socket (its path, mode, group, a dead predecessor's
socket file, and a directory for it that nobody else controls), who may connect (``SO_PEERCRED`` against the allow-lists), and
each connection: it pumps bytes between the socket and the sans-I/O protocol
(``shmserve.protocol``), hands inference requests to the dispatcher, answers
control messages (models, health, info, regions), keeps answers in the order
the requests came, passes region descriptors (``SCM_RIGHTS``), and frees
what a connection held when it goes.

Data path: a connection is an ``asyncio.BufferedProtocol``; while an inline
request's payload arrives, ``get_buffer`` returns the views of arena space
the dispatcher gave it (``Door.admitted``), so the kernel copies the bytes
straight into shared memory.  Results are written with ``writelines`` from
views of the arena, which are released only once the transport has flushed
them (the write buffer limit is 0, so ``resume_writing`` means "all sent").

The socket's directory: whoever can write it can replace the socket with
their own, and a client's tensors go to them.  So the directory must belong
to the server's uid (or root) and be writable by nobody else (unless sticky,
like /tmp: then nobody else can remove or rename our entries); one that is
missing is created 0700 (0750 with ``socket_group``, which it then gets).
Symbolic links are not followed: not for the directory (opened O_NOFOLLOW,
checked and changed through that descriptor), not for the socket (its mode is
set on the socket before ``bind``, its group with ``lchown``).

Must not: decide anything about a request (the dispatcher does), parse bytes
itself (the protocol module does), or block the loop.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import socket
import stat
import struct
from pathlib import Path

from shmserve import lanes, layout, protocol
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.dispatcher import Answer, Dispatcher, Failure, Outputs
from shmserve.frontend.regions import RegionTable
from shmserve.frontend.requests import Request
from shmserve.frontend.status import Status
from shmserve.protocol import Frame, Kind, PayloadDone, ProtocolError, ProtocolViolation

log = logging.getLogger("shmserve.unix")

READ_BUFFER = 256 * 1024  # protocol bytes between payloads; payloads bypass it
SOCKET_BUFFER = 4 * 1024 * 1024  # kernel socket buffers (capped by net.core.wmem_max/rmem_max)
LISTEN_BACKLOG = 512
SUN_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path, without its NUL)
_PEERCRED = struct.Struct("3i")


# -- the listening socket -------------------------------------------------------------------

def check_socket_path(path: str) -> None:
    """SystemExit naming the fix if ``path`` cannot be a Unix socket address, or if its directory
    exists and is not one the server can trust (see the module header); checked again at bind."""
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
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise SystemExit(f"shmserve: {path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                raise SystemExit(f"shmserve: another server is listening on {path}")
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink()  # left behind by a server that died
            finally:
                probe.close()
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


def _peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's primary gid (SO_PEERCRED) and its supplementary groups (from /proc)."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass
    return groups


class UnixDoor:
    """The door itself: what every connection shares, and the set of open connections."""

    def __init__(self, dispatcher: Dispatcher, regions: RegionTable, status: Status, *,
                 allow_uids=(), allow_gids=()):
        self.dispatcher, self.regions, self.status = dispatcher, regions, status
        self.connections: set[ClientConnection] = set()
        self.set_access(allow_uids, allow_gids)

    def set_access(self, allow_uids, allow_gids) -> None:
        """Who may connect: these uids and gids (primary or supplementary), our own uid and root."""
        self.allowed_uids = {os.getuid(), 0, *allow_uids}
        self.allowed_gids = set(allow_gids)

    def allowed(self, pid: int, uid: int, gid: int) -> bool:
        return uid in self.allowed_uids or bool(_peer_groups(pid, gid) & self.allowed_gids)

    def protocol(self) -> "ClientConnection":
        return ClientConnection(self)

    def unflushed(self) -> bool:
        """Whether any open connection still has answers in its transport's buffer."""
        return any(c.transport.get_write_buffer_size() for c in self.connections if not c.transport.is_closing())

    def close_all(self) -> None:
        for conn in list(self.connections):
            conn.transport.close()


class _Entry:
    """A request's place in its connection's answer order: the frame parts of its answer once
    there is one; ``req`` is None for a request refused before the dispatcher took it."""

    __slots__ = ("req", "parts", "held", "payload_pending")

    def __init__(self, req: Request | None, parts: list | None = None, payload_pending: bool = False):
        self.req, self.parts, self.held, self.payload_pending = req, parts, False, payload_pending


class ClientConnection(asyncio.BufferedProtocol):
    """One client: pumps bytes between the socket and the sans-I/O protocol, keeps answers in
    order.  It is the dispatcher's ``Door`` for the requests it submits."""

    def __init__(self, door: UnixDoor):
        self.door, self.dispatcher = door, door.dispatcher
        self.proto = protocol.Connection(protocol.Role.SERVER)
        self.read_buffer = bytearray(READ_BUFFER)
        self.read_view = memoryview(self.read_buffer)
        self.into_payload = False
        self.order: collections.deque[_Entry] = collections.deque()
        self.entries: dict[Request, _Entry] = {}
        self.unflushed: list[Request] = []
        self.receiving: Request | None = None
        self.waiting_for_space: Request | None = None  # the request this connection stopped reading for
        self.paused = False
        self.processing = False
        self.closed = False
        self.deferred_fd_frames: list[tuple[bytes, int]] = []
        self.peer = (-1, -1, -1)  # pid, uid, gid (SO_PEERCRED)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.door.connections.add(self)
        transport.set_write_buffer_limits(high=0, low=0)  # resume_writing == "all flushed"
        sock = transport.get_extra_info("socket")
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # big inline tensors: fewer, larger transfers
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            except OSError:
                pass
        try:
            pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            pid = uid = gid = -1
        self.peer = (pid, uid, gid)
        if not self.door.allowed(pid, uid, gid):
            log.warning("refused connection from pid %d uid %d gid %d (not on the allow-list)", pid, uid, gid)
            transport.write(protocol.error_frame(None, ErrorCode.PERMISSION_DENIED,
                                                 f"uid {uid} is not allowed to use this server"))
            self.closed = True
            transport.close()

    # -- reading --------------------------------------------------------------------------

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
        self.process()

    def process(self) -> None:
        if self.processing:
            return  # re-entered (e.g. resume() from inside a frame handler): the outer loop continues
        self.processing = True
        try:
            self._process()
        finally:
            self.processing = False

    def _process(self) -> None:
        while not self.closed and not self.paused:
            if self.proto.state is protocol.State.AWAIT:
                return  # waiting for arena space
            event = self.proto.next_event()
            if event is protocol.NEED_DATA:
                return
            try:
                if isinstance(event, Frame):
                    self.on_frame(event)
                elif isinstance(event, PayloadDone):
                    req, self.receiving = self.receiving, None
                    if req is not None:  # None: a discarded payload
                        self.dispatcher.received(req)
            except Exception:  # our bug: this connection ends, the server goes on
                log.exception("internal error handling a %s; closing that connection", type(event).__name__)
                self.send_now(protocol.error_frame(None, ErrorCode.INTERNAL, "internal server error"))
                self.closed = True
                self.transport.close()
                return
            if isinstance(event, ProtocolError):
                log.info("closing a connection: %s: %s", event.code.wire, event.message)
                self.send_now(protocol.error_frame(None, event.code, event.message))
                self.closed = True
                self.transport.close()
                return

    def on_frame(self, frame: Frame) -> None:
        kind, meta = frame.kind, frame.meta
        rid = protocol.request_id(meta)
        infer = kind in (Kind.INFER, Kind.INFER_REGION)
        try:
            if infer:
                self._on_infer(frame)
            elif rid is None:
                raise ShmserveError(ErrorCode.BAD_FRAME, "'id' must be an integer in [0, 2**63)")
            elif kind == Kind.MODELS:
                self.reply(rid, {"models": self.door.status.model_listing()})
            elif kind == Kind.HEALTH:
                self.reply(rid, self.door.status.health())
            elif kind == Kind.INFO:
                self.reply(rid, self.door.status.info(self.peer[1]))
            elif kind == Kind.OPEN_REGION:
                self._open_region(rid, meta)
            elif kind == Kind.CLOSE_REGION:
                region = self.door.regions.close(self, meta.get("region"))
                self.reply(rid, {"closed": region.id})
        except (ProtocolViolation, ShmserveError) as exc:
            answer = protocol.error_frame(rid, exc.code, exc.message)
            if frame.data_len and self.proto.state is protocol.State.AWAIT:
                self.proto.discard_payload()
            if infer:
                if isinstance(exc, ProtocolViolation):  # submit counts its own refusals
                    self.dispatcher.refused(meta.get("model"), exc.code)
                self.answer_in_order(answer)  # after the results of earlier requests on this connection
            else:
                self.send_now(answer)

    def _on_infer(self, frame: Frame) -> None:
        parsed = protocol.parse_infer(frame.meta, zero_copy=frame.kind == Kind.INFER_REGION)
        region = self.door.regions.get(self, parsed.region) if parsed.region is not None else None
        req = self.dispatcher.submit(self, parsed, payload_bytes=frame.data_len, region=region)
        entry = _Entry(req, payload_pending=frame.data_len > 0)
        self.order.append(entry)
        self.entries[req] = entry
        self.dispatcher.admit(req)

    def _open_region(self, rid: int, meta: dict) -> None:
        lane = meta.get("lane")
        if "lane" in meta and not isinstance(lane, str):
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"'lane' must name a model: {lane!r} is none")
        pid, uid, _ = self.peer
        region = self.door.regions.open(self, meta.get("size"), lane, uid=uid, pid=pid)
        answer = {"id": rid, "region": region.id, "size": region.size}
        if region.is_lane:
            answer["lane"] = {"model": region.lane_model.name, "data_offset": lanes.DATA_FLOOR,
                              "slots": layout.LANE_SLOTS}
        self.send_with_fd(protocol.encode_frame(Kind.REGION, answer), region.fd)

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        self.process()

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.door.connections.discard(self)
        for req in self.unflushed:
            self.dispatcher.release(req)
        self.unflushed.clear()
        for _, fd in self.deferred_fd_frames:
            os.close(fd)
        self.deferred_fd_frames.clear()
        self.receiving = None
        for entry in self.order:
            if entry.req is not None:
                self.dispatcher.drop(entry.req)
        self.order.clear()
        self.entries.clear()
        self.door.regions.drop_owner(self)

    # -- the dispatcher's Door ------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self.order)

    def waiting(self, req: Request) -> None:
        self.waiting_for_space = req
        self.pause()  # its payload (and every later request) stays in the socket until there is space

    def admitted(self, req: Request, sinks: list | None) -> None:
        if req is self.waiting_for_space:
            self.waiting_for_space = None
        if sinks is not None:
            self.entries[req].payload_pending = False
            self.receiving = req
            self.proto.accept_payload(sinks)
        self.resume()

    def answer(self, req: Request, answer: Answer) -> None:
        entry = self.entries.get(req)
        if entry is None:
            if isinstance(answer, Outputs) and answer.in_arena:
                self.dispatcher.release(req)  # its connection is gone
            return
        paused_for_it = req is self.waiting_for_space
        if paused_for_it:
            self.waiting_for_space = None
        if isinstance(answer, Failure):
            entry.parts = [protocol.error_frame(req.id, answer.code, answer.message)]
            if entry.payload_pending:  # answered before its payload was read: skip the payload
                entry.payload_pending = False
                if self.proto.state is protocol.State.AWAIT:
                    self.proto.discard_payload()
        elif answer.in_arena:
            metas = [{"name": o.name, "dtype": o.dtype, "shape": list(o.shape)} for o in answer.outputs]
            header = protocol.encode_frame(Kind.RESULT, {"id": req.id, "outputs": metas},
                                           sum(o.nbytes for o in answer.outputs))
            entry.parts = [header] + [o.view for o in answer.outputs if o.nbytes]
            entry.held = True
        else:
            metas = [{"name": o.name, "dtype": o.dtype, "shape": list(o.shape), "offset": o.offset}
                     for o in answer.outputs]
            entry.parts = [protocol.encode_frame(Kind.RESULT_REGION, {"id": req.id, "outputs": metas})]
        self.flush()
        if paused_for_it:
            self.resume()  # it stopped reading while this request waited for space

    # -- writing --------------------------------------------------------------------------

    def reply(self, rid: int, body: dict) -> None:
        self.send_now(protocol.encode_frame(Kind.REPLY, {"id": rid, **body}))

    def send_now(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def answer_in_order(self, data: bytes) -> None:
        """Send an answer that holds nothing, but only after every earlier request's answer."""
        if not self.order:
            self.send_now(data)
            return
        self.order.append(_Entry(None, [data]))
        self.flush()

    def flush(self) -> None:
        """Write answered requests from the head of this connection's order."""
        while self.order and self.order[0].parts is not None:
            entry = self.order.popleft()
            parts, entry.parts = entry.parts, None
            if entry.req is not None:
                del self.entries[entry.req]
            if self.transport.is_closing():
                if entry.held:
                    self.dispatcher.release(entry.req)
                continue
            self.transport.writelines(parts)
            if entry.held:
                if self.transport.get_write_buffer_size() == 0:
                    self.dispatcher.release(entry.req)
                else:
                    self.unflushed.append(entry.req)

    def send_with_fd(self, frame: bytes, fd: int) -> None:
        """Send a frame with a descriptor attached (SCM_RIGHTS), after anything already queued."""
        if self.transport.get_write_buffer_size():
            self.deferred_fd_frames.append((frame, os.dup(fd)))
            return
        self._sendmsg_fd(frame, fd)

    def _sendmsg_fd(self, frame: bytes, fd: int) -> None:
        sock = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
        try:
            sent = socket.send_fds(sock, [frame], [fd])
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
            sent = len(frame)
        finally:
            sock.close()
        if sent == 0:
            log.warning("socket full while passing a region descriptor; closing the connection")
            self.transport.close()
        elif sent < len(frame):
            self.transport.write(frame[sent:])

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        for req in self.unflushed:
            self.dispatcher.release(req)
        self.unflushed.clear()
        while self.deferred_fd_frames and not self.transport.get_write_buffer_size():
            frame, fd = self.deferred_fd_frames.pop(0)
            try:
                self._sendmsg_fd(frame, fd)
            finally:
                os.close(fd)
