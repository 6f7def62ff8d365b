"""Fault injection into a real server, done from the test side: ``python -m helpers.faults serve ...``
is ``shmserve serve`` with some of its doors' callbacks wrapped so that each raises once.

Why here and not in shmserve: a switch that makes the server raise on purpose is code every
production start would carry and every reader would have to rule out; wrapping the callbacks in
the server's own process, before it starts, costs the product nothing and reaches exactly the
callbacks a door gives the dispatcher.  The server is otherwise the real one (its doors, its
dispatcher, its workers, its shared memory); only the named callbacks are wrapped.

``SHMSERVE_TEST_FAULTS`` names the points, each ``point:n`` (raise on the n-th call of that point,
counted over every connection; n defaults to 1), comma-separated.  A wrapped callback raises
*before* it does anything, so its door never learns what it was told.  Each raise is logged as a
line ``INJECTED FAULT <point>`` on stderr (the server's log).  Points (``POINTS``):

=================  ==================================================  =========================
point              callback                                            raises
=================  ==================================================  =========================
unix.waiting       ``ClientConnection.waiting`` (``Door``)             InjectedFault
unix.admitted      ``ClientConnection.admitted``                       InjectedFault
unix.answer        ``ClientConnection.answer``                         InjectedFault
http.waiting       ``V2Door.waiting`` of an HTTP caller                InjectedFault
http.admitted      ``V2Door.admitted`` of an HTTP caller               InjectedFault
http.answer        ``V2Door.answer`` of an HTTP caller                 InjectedFault
http.fill          ``BodyStream.fill`` (``BodyReceiver``)              InjectedFault
http.done          ``HttpConnection._infer_done`` (its answer)         InjectedFault
grpc.waiting       ``V2Door.waiting`` of a gRPC caller                 InjectedFault
grpc.admitted      ``V2Door.admitted`` of a gRPC caller                InjectedFault
grpc.answer        ``V2Door.answer`` of a gRPC caller                  InjectedFault
sysshm.read        ``SystemShm.read_into`` (an input from a region)    OSError(EIO)
sysshm.write       ``SystemShm.write_from`` (an output into a region)  OSError(ENOSPC)
=================  ==================================================  =========================

An HTTP caller's ``V2Door`` is told apart from a gRPC caller's by its ``on_abort`` (the HTTP
connection sets it).
"""

from __future__ import annotations

import errno
import functools
import os
import sys
import threading

ENV = "SHMSERVE_TEST_FAULTS"


class InjectedFault(Exception):
    """What a wrapped door callback raises."""


def _target(point: str):
    """(class, method name, predicate on the instance or None, exception factory) of ``point``."""
    from shmserve.frontend.unix import ClientConnection
    from shmserve.v2.http import BodyStream, HttpConnection
    from shmserve.v2.service import V2Door
    from shmserve.v2.sysshm import SystemShm

    door, _, method = point.partition(".")
    fault = lambda: InjectedFault(f"injected fault {point}")  # noqa: E731
    if door == "unix":
        return ClientConnection, method, None, fault
    if door in ("http", "grpc") and method in ("waiting", "admitted", "answer"):
        http = door == "http"
        return V2Door, method, (lambda d: (d.on_abort is not None) == http), fault
    if point == "http.fill":
        return BodyStream, "fill", None, fault
    if point == "http.done":
        return HttpConnection, "_infer_done", None, fault
    if point == "sysshm.read":
        return SystemShm, "read_into", None, lambda: OSError(errno.EIO, "injected fault sysshm.read")
    if point == "sysshm.write":
        return SystemShm, "write_from", None, lambda: OSError(errno.ENOSPC, "injected fault sysshm.write")
    raise SystemExit(f"{ENV}: unknown point {point!r}")


POINTS = ("unix.waiting", "unix.admitted", "unix.answer", "http.waiting", "http.admitted", "http.answer",
          "http.fill", "http.done", "grpc.waiting", "grpc.admitted", "grpc.answer", "sysshm.read", "sysshm.write")


def install(spec: str) -> None:
    """Wrap the callbacks ``spec`` names (the format of ``SHMSERVE_TEST_FAULTS``)."""
    wanted: dict[tuple, list] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, nth = item.partition(":")
        cls, name, applies, fault = _target(point)
        wanted.setdefault((cls, name), []).append([point, applies, fault, int(nth or 1)])
    lock = threading.Lock()  # region copies of 1 MiB or more run on threads
    for (cls, name), faults in wanted.items():
        original = cls.__dict__[name]
        static = isinstance(original, staticmethod)
        func = original.__func__ if static else original

        def wrapper(*args, _func=func, _faults=faults, _static=static):
            for entry in _faults:
                point, applies, fault, _ = entry
                if applies is not None and not applies(args[0]):
                    continue
                with lock:
                    entry[3] -= 1
                    fire = entry[3] == 0
                if fire:
                    print(f"INJECTED FAULT {point}", file=sys.stderr, flush=True)
                    raise fault()
            return _func(*args)

        functools.update_wrapper(wrapper, func)
        setattr(cls, name, staticmethod(wrapper) if static else wrapper)


def main() -> int:
    install(os.environ.get(ENV, ""))
    from shmserve.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
