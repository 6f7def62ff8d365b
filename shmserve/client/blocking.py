"""The blocking client: ``Client`` (its public face) over ``BlockingPump`` (its I/O).

Owns: the blocking I/O of one connection at a time: connecting (and
checking who serves the socket), sending a request's parts with vectored
``sendmsg``, receiving with ``recvmsg_into`` into the buffer the session
names (a result's payload straight into its new arrays) until the session
yields that request's answer, spinning ``spin_s`` before sleeping in
``recv``, waiting for a lane call on its futex, and a new connection when
one is over.  ``BlockingPump.run`` drives an operation's steps and
``BlockingPump.perform`` an operation's common case; what to send, to wait
for, or to make of an answer is the core's (``shmserve.client.core``,
``infer``, ``zerocopy``).

Must not: decide anything about a request (the steps do), or parse or build
frames (the session does).
"""

from __future__ import annotations

import socket
import time
from types import GeneratorType
from typing import Mapping

import numpy as np

from shmserve.client.core import ClientCore, ClientFace
from shmserve.client.infer import InferOperation
from shmserve.client.memory import Region
from shmserve.client.pump import ANSWER_GRACE_S, FD_SPACE, LOOK_S, MAX_IOV, Pump, check_server_socket, closed_message, \
    no_server, passed_fds, peer_gone, sent, unix_socket
from shmserve.client.steps import Exchange
from shmserve.client.zerocopy import ZeroCopyCall
from shmserve.config import DEFAULT_INSTANCE, spin_default_us
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError
from shmserve.protocol import Kind
from shmserve.session import NEED_DATA, ConnectionFailed, RequestFailed

_monotonic = time.monotonic


class BlockingPump(Pump):
    """The blocking I/O of ``core``'s connection (see the module); connects at once.

    ``spin_us``: poll for an answer this long before sleeping in recv (None: by core count;
    0: never); lane calls follow the server's hint instead unless it is given."""

    def __init__(self, core: ClientCore, spin_us: int | None):
        super().__init__(core)
        self.spin_s = (spin_default_us(client=True) if spin_us is None else spin_us) / 1e6
        self.lane_spin_s = None if spin_us is None else spin_us / 1e6
        self.sock = self.connect()

    # -- carrying out the core's steps -------------------------------------------------------

    def perform(self, op, args: tuple):
        """Carry out the operation ``op`` over ``args`` (``steps.Operation``): its common case —
        ``begin`` submits a lane call, this waits for it, ``answer`` reads it — without a
        generator; else the one request that ends it, or its steps."""
        if _monotonic() - self.seen_at > LOOK_S:  # (look_if_due asks again: this spares a call per call)
            self.look_if_due()
        call = op.begin(args)
        kind = type(call)
        if kind is tuple:
            try:  # (wait_lane, written out: a call fewer on the hot path)
                call[0].lane.wait(call[1], call[2], call[3], self.lane_spin_s, self.check_alive)
            except BaseException as exc:
                call = op.answer(call, exc)
            else:
                call = op.answer(call, None)
            kind = type(call)
            if kind is dict:  # the result
                return call
        if kind is Exchange:  # the one request that ends it
            build, timeout = call
            return op.answered(self.exchange(build, timeout))
        return self.run(call)

    def run(self, steps):
        """Carry out ``steps`` (``shmserve.client.steps``), sending each step's answer in and
        throwing its error in; returns what they return."""
        send, answer = steps.send, None
        while True:
            try:
                step = send(answer)
            except StopIteration as done:
                return done.value
            send = steps.send
            try:
                answer = self.carry_out(step)
            except BaseException as exc:
                answer, send = exc, steps.throw

    def wait_lane(self, call: tuple) -> None:
        """Until the lane call ``call`` has finished (``ClientLane.wait``: TIMEOUT at its deadline)."""
        call[0].lane.wait(call[1], call[2], call[3], self.lane_spin_s, self.check_alive)

    # -- the connection ---------------------------------------------------------------------

    def connect(self) -> socket.socket:
        """A connected socket to a trusted server; ConnectionClosed if none listens,
        PERMISSION_DENIED if another uid serves it."""
        path = self.core.path
        sock = unix_socket()
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise no_server(path, exc) from None
        check_server_socket(sock, path, self.core.trusted)
        self.seen_at = _monotonic()
        return sock

    def ensure_connected(self) -> None:
        """Before a call: if the connection is over (the server closed it, went away — seen now if it
        was not seen open within LOOK_S —, or a call gave up on it), a new one, with a new session;
        ConnectionClosed if no server listens now (the next call tries again), or if this client
        was closed."""
        self.look_if_due()
        core = self.core
        if core.session.failure is None or not core.connection_over():  # (the first: a call fewer per call)
            return
        self.sock.close()
        core.forget_connection()
        try:
            self.sock = self.connect()
        except ShmserveError as exc:
            raise core.reconnect_refused(exc) from None

    def check_alive(self) -> None:
        """ConnectionClosed if the server closed this connection (lane calls wait off the socket)."""
        self.core.session.ensure_open()
        why = peer_gone(self.sock, self.core.path)
        if why is not None:
            raise self.fail(why)
        self.seen_at = _monotonic()

    def close(self) -> None:
        self.core.close()
        self.sock.close()

    # -- one request ------------------------------------------------------------------------

    def exchange(self, build, timeout: float | None = None):
        """Send the request ``build(session)`` makes (its id and parts) and return the event answering
        it; raises the request's error, or the connection's.  On a connection that is over it
        is made on a new one first (``ensure_connected``), and so is one not a byte of which
        could be sent (``ClientCore.retry_unsent``): either way it never reached the server."""
        self.ensure_connected()
        core = self.core
        for attempt in (0, 1):
            rid, parts = build(core.session)
            try:
                self.send(parts)
                break
            except OSError as exc:
                try:  # the server may have said why before it closed (e.g. permission_denied): report that
                    self.receive(rid, _monotonic() + 1.0)
                except ConnectionClosed:
                    if not core.retry_unsent(exc, attempt):
                        raise
                else:
                    raise self.fail(f"connection to {core.path} lost while sending: {exc}") from None
                self.ensure_connected()
        session = core.session
        try:
            return self.receive(rid, _monotonic() + core.timeout_of(timeout) + ANSWER_GRACE_S)
        except BaseException:
            if core.session is session:
                self.give_up(rid)
            raise

    def give_up(self, rid: int) -> None:
        """The caller no longer waits for request ``rid`` (interrupted, or its wait timed out): tell
        the server at once, so that it drops the request (a CANCEL, if the connection goes on),
        or close the socket now if the connection is over (the server drops what it held).  Never
        raises: the caller's own exception is the one that matters."""
        frame = self.core.session.cancel(rid)
        try:
            if frame is None:
                if self.core.session.failure is not None:
                    self.sock.shutdown(socket.SHUT_RDWR)
                return
            self.sock.settimeout(1.0)
            self.sock.sendall(frame)  # (a few dozen bytes: the socket's buffer takes them)
        except OSError:
            pass

    def send(self, parts: list) -> None:
        """Send every part; OSError if the socket refuses, its ``sent`` saying whether any byte went."""
        went = False
        try:
            while parts:
                sent(parts, self.sock.sendmsg(parts[:MAX_IOV]))
                went = True
        except OSError as exc:
            exc.sent = went
            raise

    def receive(self, rid: int, deadline: float):
        session = self.core.session
        while True:
            event = session.next_event()
            if event is NEED_DATA:
                self.read(deadline)
            elif event.request_id != rid:
                if type(event) is ConnectionFailed:
                    raise event.error
                session.discard(event)  # the answer to a call interrupted earlier
            elif type(event) is RequestFailed:
                raise event.error
            else:
                return event

    def read(self, deadline: float) -> None:
        remaining = deadline - _monotonic()
        if remaining <= 0:
            raise self.fail("no answer from the server in time", ErrorCode.TIMEOUT)
        session = self.core.session
        buffers = [session.read_buffer()]
        try:
            got = self.poll_read(buffers) if self.spin_s > 0 else None
            if got is None:
                self.sock.settimeout(remaining)
                got = self.sock.recvmsg_into(buffers, FD_SPACE)
            n, ancdata, _, _ = got
        except socket.timeout:
            raise self.fail("no answer from the server in time", ErrorCode.TIMEOUT) from None
        except OSError as exc:
            raise self.fail(f"connection to {self.core.path} lost: {exc}") from None
        if ancdata:
            session.receive_fds(passed_fds(ancdata))
        if n == 0:
            raise self.fail(closed_message(self.core.path))
        self.seen_at = _monotonic()
        session.read_done(n)

    def poll_read(self, buffers):
        """Non-blocking reads for up to spin_s; None if nothing came (then block)."""
        end = time.perf_counter() + self.spin_s
        while True:
            try:
                return self.sock.recvmsg_into(buffers, FD_SPACE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= end:
                    return None


class Client(ClientFace):
    """A blocking connection to a shmserve server.

    ``socket``: the server's socket path (default: $SHMSERVE_SOCKET, else the
    runtime-directory default for ``instance``).  ``timeout``: default
    seconds per request, enforced by the server (and by this client with a
    grace period should the server not answer at all: the connection is then
    given up).  ``server_uid``: a uid (or user name) trusted to serve, besides
    our own and root (default: $SHMSERVE_SERVER_UID).  ConnectionClosed if no
    server listens there; ShmserveError PERMISSION_DENIED if another uid does
    (nothing is sent to it); ValueError for a ``server_uid`` that is no user.
    Arguments are checked here, before anything is sent: a timeout that is not in
    (0, 86400] s, or a zero-copy input's unsupported dtype or malformed shape, raise
    ``BadArgument`` (a ShmserveError and a ValueError).

    A connection that ended is replaced by a new one on the next call (a server
    restarted on the same socket serves it), and a request not a byte of which
    reached the socket is sent once more on it; one that may have reached the
    server is never sent again (docs/protocol.md, "When the server goes away").
    Not thread-safe; use one per thread (they are cheap).
    """

    def __init__(self, socket_path: str | None = None, *, timeout: float = 60.0, instance: str = DEFAULT_INSTANCE,
                 spin_us: int | None = None, lanes: bool = True, server_uid: int | str | None = None):
        self._core = core = ClientCore(socket_path, timeout, instance, lanes, server_uid)
        self._infer = InferOperation(core)
        # Poll for the answer this long before sleeping in recv (None: by core count; 0: never).
        # Lane calls follow the server's hint instead unless spin_us is given.
        self._pump = BlockingPump(core, spin_us)

    @property
    def spin_s(self) -> float:
        """Seconds to poll for an answer before sleeping in recv."""
        return self._pump.spin_s

    @spin_s.setter
    def spin_s(self, value: float) -> None:
        self._pump.spin_s = value

    # -- public API -----------------------------------------------------------------------

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], *, timeout: float | None = None,
              version: int | None = None, key: str | None = None, priority: int = 0) -> dict[str, np.ndarray]:
        """Run ``model`` on ``inputs`` (name -> array); returns name -> array (new arrays).
        ``version``: that version of the model (default: the model's default version); ``key``: a
        routing key — while a canary runs, requests with the same key reach the same version.
        ``priority``: the request's priority level, Triton's: 1 is served first, then 2, ... up to
        the model's ``priority_levels``; 0 (the default), or one above them, is the model's
        ``default_priority_level`` (docs/config.md, "Priorities and queue policy").  ValueError
        (BadArgument) for a negative or non-int priority, before anything is sent.  A lane call
        carries it in its slot, with its deadline (a worker answers TIMEOUT, unrun, a call whose
        deadline passed before it could start); a socket call in its request.

        With ``lanes`` (the default) the call goes through a lane of the version it goes to (the
        one named, else the one a running split canary picks for ``key`` or for this call, by the
        server's rule, else the default) that the client opens on first use (a region with its
        own queue to a worker: the inputs are copied into it, the outputs copied out, and nothing
        crosses the socket); over the socket instead when the lane cannot take it (a version the
        client has no spec of, a bytes tensor, a request larger than the lane, all its slots
        busy, the lane refused by the server).  Either way the same errors, with the same codes."""
        return self._pump.perform(self._infer, (model, inputs, timeout, version, key, priority))

    def models(self) -> list[dict]:
        """The served models: name, backend, inputs and outputs (name, dtype, shape), and more."""
        return self._pump.run(self._core.models())

    def health(self) -> dict:
        """The server's health: ``status`` (ok, degraded, shutting_down) and each model's workers."""
        return self._pump.run(self._core.health())

    def info(self) -> dict:
        """What the server runs: version, instance, arena, limits, statistics, lanes and workers."""
        return self._pump.run(self._core.info())

    # -- the model lifecycle (docs/models.md); all but ``repository`` need an admin uid --

    def repository(self) -> dict:
        """Every model and version with its state (loading, ready, draining, unavailable, evicted,
        unloaded) and reason, the defaults, canaries and recent lifecycle events."""
        return self._pump.run(self._core.repository())

    def load(self, model: str, *, version: int | None = None, instances: int | None = None, keep: bool = False,
             timeout: float | None = None) -> dict:
        """Load ``version`` of ``model`` (default: the newest its policy selects), warm it and make
        it the default; the one serving before drains and is unloaded unless ``keep``.  Waits
        for all of it (``timeout``: default ``LIFECYCLE_TIMEOUT_S``, 900 s).  ShmserveError: PERMISSION_DENIED,
        UNKNOWN_MODEL, MODEL_UNAVAILABLE (it did not load: why; the old one still serves), ..."""
        return self._pump.run(self._core.control(Kind.LOAD, model, timeout, version=version, instances=instances,
                                                 keep=keep or None))

    def unload(self, model: str, *, version: int | None = None, timeout: float | None = None) -> dict:
        """Drain and unload ``version`` of ``model`` (default: all of them)."""
        return self._pump.run(self._core.control(Kind.UNLOAD, model, timeout, version=version))

    def scale(self, model: str, instances: int, *, version: int | None = None, timeout: float | None = None) -> dict:
        """Run ``instances`` workers for ``model``'s default version (or ``version``)."""
        return self._pump.run(self._core.control(Kind.SCALE, model, timeout, version=version, instances=instances))

    def canary(self, model: str, action: str, *, version: int | None = None, plan: dict | None = None,
               timeout: float | None = None) -> dict:
        """``start`` a canary of ``version`` under ``plan`` (``canary.CanaryPlan`` fields), or
        ``promote``, ``abort`` it, or get its ``status``; the rollout's snapshot."""
        return self._pump.run(self._core.control(Kind.CANARY, model, timeout, action=action, version=version,
                                                 plan=plan))

    def open_region(self, size: int, *, lane: str | None = None) -> Region:
        """Ask the server for ``size`` bytes of shared memory for zero-copy calls on this connection.

        ``lane``: a model name; the region then also carries a queue to one of that model's
        workers, and zero-copy calls placed in it do not touch the socket."""
        return self._pump.run(self._core.open_region(size, lane))

    def zero_copy(self, model: str, inputs: Mapping[str, tuple], *, output_capacity: int | None = None,
                  version: int | None = None, key: str | None = None, priority: int = 0) -> ZeroCopyCall:
        """Reserve region space for one call of ``model``.

        ``inputs`` maps input names to ``(shape, dtype)``; the returned call's
        ``inputs`` are writable numpy views of that space.  Outputs get
        ``output_capacity`` bytes (default: computed from the model's spec
        where its output shapes follow from the inputs, else 16 MiB).  With
        ``lanes`` (the default) the space is in a lane of ``model``: of
        ``version`` if given, else of the version ``key`` (a routing key) is
        routed to now, else of the default.  Each ``run`` goes to ``version``,
        else to the version a running split canary picks for ``key`` (or for
        that run: the server's rule), through that version's lane: its own if
        its lane serves it, else copied through the client's lane to that
        version, as ``infer`` goes (docs/models.md, "Canaries and lanes").  Every run has
        ``priority`` (as ``infer``'s: 0 the model's default level, 1 served first; ValueError for
        a negative or non-int one).
        """
        return ZeroCopyCall(self, self._pump, self._pump.run(self._core.zero_copy(model, inputs, output_capacity,
                                                                                  version, key, priority)))

    def close(self) -> None:
        self._pump.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
