#!/usr/bin/env python3
"""Server shapes for the KServe v2 gRPC door, measured side by side (issue 25).

Self-contained: it starts its own tiny echo servers (no shmserve server) that
answer Triton's ``ModelInferRequest`` with a ``ModelInferResponse`` carrying
``raw_input_contents`` back as ``raw_output_contents``, one server per
(shape, handler), and drives them from client processes it keeps for the
whole run.

Shapes (a name is ``kind[-token...]``; ``--list`` prints the defaults):

  aio-asyncio          grpc.aio on asyncio's own loop
  aio-uvloop           grpc.aio on uvloop (today's door)
  sync-tN              grpc.server with a ThreadPoolExecutor of N threads
  grpclib-uvloop       grpclib (pure-Python HTTP/2 on h2) on uvloop: no core threads at all
  h2lean-uvloop        a PROTOTYPE of the door's own gRPC-over-HTTP/2 on its loop (an asyncio Protocol,
                       hpack for the request headers, constant answer headers, HTTP/2 flow control
                       both ways; one task per RPC): what one loop costs with no core threads and no
                       general-purpose HTTP/2 library.  Not hardened: a measurement, not a door
  h2-uvloop            the same on the ``h2`` library's state machine (python-hyper's, which checks
                       every frame): the door's own gRPC on its loop without writing HTTP/2 by hand
  ...-pN               N processes of that shape sharing the port (SO_REUSEPORT, grpc.so_reuseport=1)
  ...-latency          grpc.optimization_target=latency
  ...-iomgr            GRPC_EXPERIMENTS off for the EventEngine client/listener/endpoints (legacy iomgr I/O)
  ...-poll             GRPC_POLL_STRATEGY=poll
  ...-bdp              grpc.http2.bdp_probe=1 (the door has it off: an unread stream's window stays 64 KiB)
  ...-lookNk           grpc.http2.lookahead_bytes=N KiB (a larger stream window with BDP probing still off)

Every server uses the door's options that matter here (bdp_probe=0, no message
size limit; compression is off by default in grpcio, as in the door).

Handlers (``--handlers``):

  unary    unary_unary, grpcio deserialises the request
  stream   stream_unary reading its one message itself (aio ``await context.read()``,
           sync ``next(request_iterator)``), as the door does: nothing is read before the
           caller is checked
  hop      sync only: ``stream`` plus a round trip through an asyncio loop (uvloop) on another
           thread of the server (``run_coroutine_threadsafe``), which the door needs to reach
           shared-memory completions driven by its loop

Each handler reads the ``authorization`` metadata (the door's identity) before it reads.
grpclib, h2 and h2lean have ``stream`` only: their handlers always read the message themselves.

Clients (``--clients``): ``stub``, grpcio's generated stub with a prebuilt request;
``triton``, ``tritonclient.grpc.InferenceServerClient.infer`` with ``as_numpy`` on
the answer.  ``--concurrency 1,C``: 1 is a latency run (one client process, K
requests back to back); C > 1 is a load run (C client processes, each with its
own connection, back to back for ``--duration`` seconds from a common start).

Cases are interleaved: every round runs every case once, in a fresh seeded
shuffle, so the machine's noise falls on all alike.  Reported per case: p50/p90/p99
(all rounds pooled), the spread of the per-round p50s, requests/s (load: median
of the rounds, min-max), and the server's CPU per request (every thread of all
its processes, from ``/proc/.../schedstat``: less noisy than latency on a shared
machine, and what bounds throughput on a larger one), the time its threads were
runnable but waited for a CPU (the machine's contention, per request), its
voluntary context switches per request (each one a thread going to sleep and
being woken: the hops), the client's CPU per request and, for -pN shapes, the
busiest process's share of the server's CPU (SO_REUSEPORT spreads connections,
not requests).

``--breakdown`` instead measures, per shape (1 client, stub, 4 KiB, ``stream``
handler), where the time goes: first the floor under any RPC stack (the same
bytes echoed over loopback TCP by a uvloop Protocol), then per shape the
server's CPU and wakeups per thread (the loop or handler threads, grpc's poller
thread, grpc core's EventEngine threads) and the client's, the syscalls of
each side (``strace -f -c``, if present) and, with ``--perf``, the split of the
server's CPU between Python, grpc's Cython/C-core, the kernel and libc
(``perf record``).

usage:
  python tools/grpc_shapes.py --quick
  python tools/grpc_shapes.py [--shapes A,B] [--handlers stream] [--sizes 4KiB,1MiB]
      [--clients stub,triton] [--concurrency 1,4] [--rounds 5] [--requests 300]
      [--duration 1.0] [--procs N] [--seed S] [--time-limit S] [--json-out FILE]
  python tools/grpc_shapes.py --breakdown [--shapes ...] [--perf] [--json-out FILE]
  python tools/grpc_shapes.py --serve SHAPE --handler H [--port P]   (one server; prints its port)
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

METHOD = "/inference.GRPCInferenceService/ModelInfer"
TOKEN = "grpc-shapes-token"
SEED = 20261202
# the EventEngine experiments that can be turned off in grpcio 1.85: legacy iomgr TCP client, listener, endpoints
IOMGR_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
HANDLERS = ("unary", "stream", "hop")
CLIENTS = ("stub", "triton")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_shapes(procs: int) -> list[str]:
    """Every shape worth comparing (grpclib's, h2's and h2lean's only where grpclib, h2 or hpack is
    installed: none is a dependency of shmserve)."""
    import importlib.util

    shapes = ["aio-asyncio", "aio-uvloop", "aio-uvloop-latency", "aio-uvloop-iomgr", "aio-uvloop-poll",
              "sync-t1", "sync-t2", "sync-t4", "sync-t8", "sync-t4-iomgr"]
    for module, shape in (("grpclib", "grpclib-uvloop"), ("h2", "h2-uvloop"), ("hpack", "h2lean-uvloop")):
        if importlib.util.find_spec(module) is not None:
            shapes.append(shape)
    if procs > 1:
        shapes += [f"aio-uvloop-p{procs}", f"sync-t4-p{procs}"]
        if importlib.util.find_spec("hpack") is not None:
            shapes.append(f"h2lean-uvloop-p{procs}")
    return shapes


def quick_shapes(procs: int) -> list[str]:
    """The door's shape, the sync server and the h2lean prototype (where hpack is installed), and their -pN."""
    import importlib.util

    bases = ["aio-uvloop", "sync-t4"] + (["h2lean-uvloop"] if importlib.util.find_spec("hpack") else [])
    return bases + ([f"{b}-p{procs}" for b in bases] if procs > 1 else [])


# -- shapes --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One server shape, parsed from its name (see the module header)."""

    name: str
    kind: str  # aio | sync | grpclib | h2 | h2lean
    loop: str = "uvloop"  # aio, grpclib: asyncio | uvloop (sync: the loop of the ``hop`` handler)
    threads: int = 0  # sync: the handler pool
    procs: int = 1  # processes sharing the port
    options: tuple = ()
    env: tuple = ()

    @property
    def handlers(self) -> tuple[str, ...]:
        return {"aio": ("unary", "stream"), "sync": HANDLERS, "grpclib": ("stream",), "h2lean": ("stream",),
                "h2": ("stream",)}[self.kind]


def parse_shape(name: str) -> Shape:
    """``name`` as a Shape; ValueError naming what is wrong."""
    parts = name.split("-")
    kind = parts[0]
    if kind not in ("aio", "sync", "grpclib", "h2lean", "h2"):
        raise ValueError(f"shape {name!r}: the kind is aio, sync, grpclib, h2 or h2lean")
    loop, threads, procs, options, env = "uvloop", 4 if kind == "sync" else 0, 1, [], []
    for token in parts[1:]:
        if token in ("asyncio", "uvloop") and kind != "sync":
            loop = token
        elif re.fullmatch(r"t\d+", token) and kind == "sync":
            threads = int(token[1:])
        elif re.fullmatch(r"p\d+", token):
            procs = int(token[1:])
        elif token == "latency" and kind in ("aio", "sync"):
            options.append(("grpc.optimization_target", "latency"))
        elif token == "iomgr" and kind in ("aio", "sync"):
            env.append(("GRPC_EXPERIMENTS", IOMGR_EXPERIMENTS))
        elif token == "poll" and kind in ("aio", "sync"):
            env.append(("GRPC_POLL_STRATEGY", "poll"))
        elif token == "bdp" and kind in ("aio", "sync"):
            options.append(("grpc.http2.bdp_probe", 1))
        elif re.fullmatch(r"look\d+k", token) and kind in ("aio", "sync"):
            options.append(("grpc.http2.lookahead_bytes", int(token[4:-1]) * 1024))
        else:
            raise ValueError(f"shape {name!r}: unknown token {token!r}")
    if threads < 1 and kind == "sync" or procs < 1:
        raise ValueError(f"shape {name!r}: threads and processes are at least 1")
    return Shape(name, kind, loop, threads, procs, tuple(options), tuple(env))


# -- the echo servers ------------------------------------------------------------------------------

def _identity(metadata) -> str | None:
    """What the door does before it reads: the one ``authorization`` value, if any."""
    found = None
    for key, value in metadata or ():
        if key == "authorization":
            found = value
    return found


def _echo(pb, request):
    reply = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
    for i, t in enumerate(request.inputs):
        name = request.outputs[i].name if i < len(request.outputs) else t.name
        reply.outputs.add(name=name, datatype=t.datatype, shape=t.shape)
    reply.raw_output_contents.extend(request.raw_input_contents)
    return reply


def _server_options(shape: Shape) -> list:
    options = dict([("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                    ("grpc.http2.bdp_probe", 0), ("grpc.so_reuseport", 1 if shape.procs > 1 else 0)])
    options.update(shape.options)
    return list(options.items())


def _announce(port: int) -> None:
    """Tell the driver the port; then answer ``threads`` on stdin with this process's Python threads."""
    print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)

    def answer():
        for line in sys.stdin:
            if line.strip() == "threads":
                print(json.dumps({str(t.native_id): t.name for t in threading.enumerate()}), flush=True)
    threading.Thread(target=answer, daemon=True, name="shapes-control").start()


def serve(shape: Shape, handler: str, port: int) -> None:
    """Run one server process of ``shape`` with ``handler`` on 127.0.0.1:``port`` until killed."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if handler not in shape.handlers:
        raise SystemExit(f"shape {shape.name} has no {handler!r} handler (it has {', '.join(shape.handlers)})")
    if shape.kind == "grpclib":
        _serve_grpclib(shape, port)
    elif shape.kind == "h2lean":
        _run_loop(shape.loop, _serve_h2lean(shape, port))
    elif shape.kind == "h2":
        _run_loop(shape.loop, _serve_h2(shape, port))
    elif shape.kind == "aio":
        _run_loop(shape.loop, _serve_aio(shape, handler, port))
    else:
        _serve_sync(shape, handler, port)


def _run_loop(loop: str, coro) -> None:
    if loop == "uvloop":
        import uvloop
        uvloop.run(coro)
    else:
        import asyncio
        asyncio.run(coro)


async def _serve_aio(shape: Shape, handler: str, port: int) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    async def unary(request, context):
        _identity(context.invocation_metadata())
        return _echo(pb, request)

    async def stream(request_iterator, context):
        _identity(context.invocation_metadata())
        raw = await context.read()
        return _echo(pb, pb.ModelInferRequest.FromString(raw))

    serializer = pb.ModelInferResponse.SerializeToString
    if handler == "unary":
        method = grpc.unary_unary_rpc_method_handler(unary, pb.ModelInferRequest.FromString, serializer)
    else:
        method = grpc.stream_unary_rpc_method_handler(stream, response_serializer=serializer)
    server = grpc.aio.server(options=_server_options(shape))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": method}),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    _announce(bound)
    await server.wait_for_termination()


def _serve_sync(shape: Shape, handler: str, port: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from tritonclient.grpc import service_pb2 as pb

    def unary(request, context):
        _identity(context.invocation_metadata())
        return _echo(pb, request)

    def stream(request_iterator, context):
        _identity(context.invocation_metadata())
        raw = next(request_iterator)
        return _echo(pb, pb.ModelInferRequest.FromString(raw))

    loop = None
    if handler == "hop":
        import asyncio
        ready = threading.Event()

        def run_loop():
            nonlocal loop
            if shape.loop == "uvloop":
                import uvloop
                loop = uvloop.new_event_loop()
            else:
                loop = asyncio.new_event_loop()
            loop.call_soon(ready.set)
            loop.run_forever()
        threading.Thread(target=run_loop, daemon=True, name="shapes-loop").start()
        ready.wait()

        async def on_loop(raw):
            return _echo(pb, pb.ModelInferRequest.FromString(raw))

    def hop(request_iterator, context):
        _identity(context.invocation_metadata())
        raw = next(request_iterator)
        return asyncio.run_coroutine_threadsafe(on_loop(raw), loop).result()

    serializer = pb.ModelInferResponse.SerializeToString
    if handler == "unary":
        method = grpc.unary_unary_rpc_method_handler(unary, pb.ModelInferRequest.FromString, serializer)
    else:
        method = grpc.stream_unary_rpc_method_handler(stream if handler == "stream" else hop,
                                                      response_serializer=serializer)
    server = grpc.server(ThreadPoolExecutor(shape.threads), options=_server_options(shape),
                         maximum_concurrent_rpcs=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": method}),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    _announce(bound)
    server.wait_for_termination()


def _serve_grpclib(shape: Shape, port: int) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server
    from tritonclient.grpc import service_pb2 as pb

    class Echo:
        async def infer(self, stream):
            _identity(stream.metadata.items())
            request = await stream.recv_message()  # nothing is read before this line
            await stream.send_message(_echo(pb, request))

        def __mapping__(self):
            return {METHOD: Handler(self.infer, Cardinality.UNARY_UNARY, pb.ModelInferRequest,
                                    pb.ModelInferResponse)}

    async def main():
        server = Server([Echo()])
        await server.start("127.0.0.1", port, reuse_port=shape.procs > 1)
        _announce(server._server.sockets[0].getsockname()[1])
        await server.wait_closed()

    _run_loop(shape.loop, main())


# HTTP/2 (RFC 9113) frame types and flags the prototype uses
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# the answer's header blocks never change: literal fields without indexing (the decoder's table untouched)
H2_RESPONSE_HEADERS = b"\x88" + b"\x0f\x10\x10application/grpc"  # :status 200 (static 8); content-type (static 31)
H2_TRAILERS = b"\x00\x0bgrpc-status\x010"


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


async def _serve_h2lean(shape: Shape, port: int) -> None:
    """The h2lean prototype (see the module header): one asyncio Protocol per connection."""
    import asyncio

    import hpack
    from tritonclient.grpc import service_pb2 as pb

    loop = asyncio.get_running_loop()

    async def handle(conn, sid, headers, body):
        _identity(headers)  # the door would check the caller here, before granting the stream any window
        if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            conn.reset(sid)
            return
        reply = _echo(pb, pb.ModelInferRequest.FromString(bytes(body[5:]))).SerializeToString()
        conn.respond(sid, b"\x00" + len(reply).to_bytes(4, "big") + reply)

    class Conn(asyncio.Protocol):
        def connection_made(self, transport):
            self.t, self.buf, self.preface = transport, bytearray(), False
            self.decoder = hpack.Decoder()
            self.streams: dict[int, list] = {}  # sid -> [headers, body, header fragments]
            self.unacked = 0  # bytes read on the connection and not yet granted back
            self.initial_recv = 65535  # every stream's receive window (HTTP/2's default: no SETTINGS for it)
            self.window, self.initial_window, self.max_frame = 65535, 65535, 16384
            self.windows: dict[int, int] = {}  # open answers' send windows
            self.pending: dict[int, list] = {}  # sid -> [data still to send, trailers due]
            transport.write(_frame(SETTINGS, 0, 0))

        def data_received(self, data):
            buf = self.buf
            buf += data
            if not self.preface:
                if len(buf) < len(PREFACE):
                    return
                if buf[:len(PREFACE)] != PREFACE:
                    self.t.close()
                    return
                del buf[:len(PREFACE)]
                self.preface = True
            out, at, end = [], 0, len(buf)
            view = memoryview(buf)
            while end - at >= 9:
                length = int.from_bytes(view[at:at + 3], "big")
                if end - at < 9 + length:
                    break
                kind, flags, sid = buf[at + 3], buf[at + 4], int.from_bytes(view[at + 5:at + 9], "big") & 0x7FFFFFFF
                payload = view[at + 9:at + 9 + length]
                at += 9 + length
                self.frame(kind, flags, sid, payload, out)
            payload = None  # every view of buf goes before buf changes size
            view.release()
            del buf[:at]  # once per read, not per frame
            if out:
                self.t.write(b"".join(out))

        def frame(self, kind, flags, sid, payload, out):
            if kind == DATA:
                stream = self.streams.get(sid)
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                if stream is not None:
                    first = not stream[1]
                    stream[1] += payload
                    if first and len(stream[1]) >= 5 and not flags & END_STREAM:
                        # the message's length is in its 5-byte prefix: grant the stream all of it at once
                        # (the door: after the caller is admitted and the bytes reserved)
                        extra = 5 + int.from_bytes(stream[1][1:5], "big") - self.initial_recv
                        if extra > 0:
                            out.append(_frame(WINDOW_UPDATE, 0, sid, extra.to_bytes(4, "big")))
                            out.append(_frame(WINDOW_UPDATE, 0, 0, extra.to_bytes(4, "big")))
                    self.unacked += len(payload)  # the connection's window: given back as messages are read
                    if self.unacked >= 32768:
                        out.append(_frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big")))
                        self.unacked = 0
                if flags & END_STREAM and stream is not None:
                    del self.streams[sid]
                    loop.create_task(handle(self, sid, stream[0], stream[1]))
            elif kind in (HEADERS, CONTINUATION):
                if kind == HEADERS:
                    if flags & PADDED:
                        payload = payload[1:len(payload) - payload[0]]
                    if flags & PRIORITY:
                        payload = payload[5:]
                    stream = self.streams.setdefault(sid, [None, bytearray(), bytearray()])
                else:
                    stream = self.streams[sid]
                stream[2] += payload
                if flags & END_HEADERS:
                    stream[0] = self.decoder.decode(bytes(stream[2]))
                    stream[2] = None
                if kind == HEADERS and flags & END_STREAM:  # no message at all
                    del self.streams[sid]
                    self.reset(sid)
            elif kind == SETTINGS:
                if not flags & ACK:
                    payload = bytes(payload)
                    for i in range(0, len(payload) - 5, 6):
                        key = int.from_bytes(payload[i:i + 2], "big")
                        value = int.from_bytes(payload[i + 2:i + 6], "big")
                        if key == 4:
                            for open_sid in self.windows:
                                self.windows[open_sid] += value - self.initial_window
                            self.initial_window = value
                        elif key == 5:
                            self.max_frame = value
                    out.append(_frame(SETTINGS, ACK, 0))
            elif kind == WINDOW_UPDATE:
                step = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                if sid == 0:
                    self.window += step
                elif sid in self.windows:
                    self.windows[sid] += step
                if self.pending:
                    self.flush(out)
            elif kind == PING:
                if not flags & ACK:
                    out.append(_frame(PING, ACK, 0, bytes(payload)))
            elif kind == RST_STREAM:
                self.streams.pop(sid, None)
                self.windows.pop(sid, None)
                self.pending.pop(sid, None)
            elif kind == GOAWAY:
                self.t.close()

        def reset(self, sid):
            self.t.write(_frame(RST_STREAM, 0, sid, (2).to_bytes(4, "big")))

        def respond(self, sid, message):
            self.windows[sid] = self.initial_window
            self.pending[sid] = [memoryview(message), True]
            out = [_frame(HEADERS, END_HEADERS, sid, H2_RESPONSE_HEADERS)]
            self.flush(out)
            self.t.write(b"".join(out))

        def flush(self, out):
            for sid in list(self.pending):
                data, _ = self.pending[sid]
                while data and self.window > 0 and self.windows[sid] > 0:
                    n = min(len(data), self.window, self.windows[sid], self.max_frame)
                    out.append(_frame(DATA, 0, sid, bytes(data[:n])))
                    data = data[n:]
                    self.window -= n
                    self.windows[sid] -= n
                if data:
                    self.pending[sid][0] = data
                else:
                    out.append(_frame(HEADERS, END_HEADERS | END_STREAM, sid, H2_TRAILERS))
                    del self.pending[sid]
                    del self.windows[sid]

    server = await loop.create_server(Conn, "127.0.0.1", port, reuse_port=shape.procs > 1)
    _announce(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


async def _serve_h2(shape: Shape, port: int) -> None:
    """The h2 shape (see the module header): one asyncio Protocol per connection over h2's H2Connection."""
    import asyncio

    import h2.config
    import h2.connection
    import h2.events
    from tritonclient.grpc import service_pb2 as pb

    loop = asyncio.get_running_loop()
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    response_headers = ((b":status", b"200"), (b"content-type", b"application/grpc"))
    trailers = ((b"grpc-status", b"0"),)

    async def handle(conn, sid, headers, body):
        _identity(headers)  # the door would check the caller here, before acknowledging any data
        if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            conn.h2.reset_stream(sid)
            conn.t.write(conn.h2.data_to_send())
            return
        reply = _echo(pb, pb.ModelInferRequest.FromString(bytes(body[5:]))).SerializeToString()
        conn.respond(sid, b"\x00" + len(reply).to_bytes(4, "big") + reply)

    class Conn(asyncio.Protocol):
        def connection_made(self, transport):
            self.t, self.h2 = transport, h2.connection.H2Connection(config=config)
            self.h2.initiate_connection()
            self.streams: dict[int, list] = {}  # sid -> [headers, body]
            self.pending: dict[int, memoryview] = {}  # answers waiting for window
            transport.write(self.h2.data_to_send())

        def data_received(self, data):
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                self.t.write(self.h2.data_to_send())
                self.t.close()
                return
            for event in events:
                if isinstance(event, h2.events.RequestReceived):
                    self.streams[event.stream_id] = [event.headers, bytearray()]
                elif isinstance(event, h2.events.DataReceived):
                    stream = self.streams.get(event.stream_id)
                    if stream is not None:
                        stream[1] += event.data
                    # given back at once (the door: after admission)
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    stream = self.streams.pop(event.stream_id, None)
                    if stream is not None:
                        loop.create_task(handle(self, event.stream_id, stream[0], stream[1]))
                elif isinstance(event, h2.events.WindowUpdated):
                    for sid in list(self.pending):
                        self.flush(sid)
                elif isinstance(event, h2.events.StreamReset):
                    self.streams.pop(event.stream_id, None)
                    self.pending.pop(event.stream_id, None)
            self.t.write(self.h2.data_to_send())

        def respond(self, sid, message):
            self.h2.send_headers(sid, response_headers)
            self.pending[sid] = memoryview(message)
            self.flush(sid)
            self.t.write(self.h2.data_to_send())

        def flush(self, sid):
            data = self.pending[sid]
            while data:
                n = min(len(data), self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
                if n <= 0:
                    self.pending[sid] = data
                    return
                self.h2.send_data(sid, data[:n].tobytes())
                data = data[n:]
            self.h2.send_headers(sid, trailers, end_stream=True)
            del self.pending[sid]

    server = await loop.create_server(Conn, "127.0.0.1", port, reuse_port=shape.procs > 1)
    _announce(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


class Server:
    """The processes of one (shape, handler), started by the driver."""

    def __init__(self, shape: Shape, handler: str):
        self.shape, self.handler = shape, handler
        self.procs: list[subprocess.Popen] = []
        placeholder = None
        port = 0
        if shape.procs > 1:  # hold a port with SO_REUSEPORT while every process binds it too
            placeholder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            placeholder.bind(("127.0.0.1", 0))
            port = placeholder.getsockname()[1]
        env = dict(os.environ, **dict(shape.env))
        try:
            for _ in range(shape.procs):
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--serve", shape.name, "--handler", handler,
                     "--port", str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True))
            for p in self.procs:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"server {shape.name}/{handler} did not start (exit {p.wait(10)})")
                port = json.loads(line)["port"]
        except BaseException:
            self.stop()
            raise
        finally:
            if placeholder is not None:
                placeholder.close()
        self.address = f"127.0.0.1:{port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def threads(self) -> dict[int, str]:
        """native thread id -> Python thread name, over every process."""
        names = {}
        for p in self.procs:
            p.stdin.write("threads\n")
            p.stdin.flush()
            names.update({int(k): v for k, v in json.loads(p.stdout.readline()).items()})
        return names

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)


# -- /proc accounting ------------------------------------------------------------------------------

def _schedstat(task: str) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of one thread (``/proc/.../schedstat``)."""
    with open(f"{task}/schedstat") as f:
        run_ns, wait_ns, _ = f.read().split()
    return int(run_ns), int(wait_ns)


def _switches(path: str) -> tuple[int, int]:
    vol = invol = 0
    with open(path) as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                invol = int(line.split()[1])
    return vol, invol


def thread_usage(pids: list[int]) -> dict[int, tuple[str, int, int, int, int]]:
    """tid -> (comm, ns on a CPU, ns waiting for a CPU, voluntary, involuntary switches) for every
    thread of ``pids`` (a thread that ended between two readings is not counted: grpc's are long-lived)."""
    out = {}
    for pid in pids:
        for task in glob.glob(f"/proc/{pid}/task/*"):
            try:
                tid = int(task.rsplit("/", 1)[1])
                with open(f"{task}/comm") as f:
                    comm = f.read().strip()
                run_ns, wait_ns = _schedstat(task)
                v, i = _switches(f"{task}/status")
                out[tid] = (comm, run_ns, wait_ns, v, i)
            except (OSError, ValueError):
                continue
    return out


def proc_usage(pids: list[int]) -> dict[int, tuple[int, int, int, int]]:
    """pid -> (ns on a CPU, ns waiting for one, voluntary, involuntary switches), summed over its threads."""
    out = {pid: [0, 0, 0, 0] for pid in pids}
    for pid in pids:
        for _, run_ns, wait_ns, v, i in thread_usage([pid]).values():
            acc = out[pid]
            acc[0] += run_ns
            acc[1] += wait_ns
            acc[2] += v
            acc[3] += i
    return {pid: tuple(v) for pid, v in out.items()}


def _delta(before: dict, after: dict) -> tuple[tuple[float, ...], list[float]]:
    """Summed (CPU s, CPU-wait s, voluntary, involuntary) between two ``proc_usage`` and each process's CPU s."""
    pids = [p for p in after if p in before]
    per = [(after[p][0] - before[p][0]) / 1e9 for p in pids]
    total = tuple(sum(after[p][k] - before[p][k] for p in pids) for k in range(4))
    return (total[0] / 1e9, total[1] / 1e9, total[2], total[3]), per


# -- clients ---------------------------------------------------------------------------------------

def _payload(size: int) -> bytes:
    return random.Random(size).randbytes(size)


class StubCaller:
    """grpcio's generated stub, with a request built once."""

    def __init__(self, address: str, size: int, timeout: float | None = None):
        import grpc
        from tritonclient.grpc import service_pb2 as pb
        from tritonclient.grpc import service_pb2_grpc

        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
            ("grpc.use_local_subchannel_pool", 1)])
        self.call = service_pb2_grpc.GRPCInferenceServiceStub(self.channel).ModelInfer
        self.request = pb.ModelInferRequest(model_name="echo")
        self.request.inputs.add(name="x", datatype="UINT8", shape=[size])
        self.request.outputs.add(name="y")
        self.request.raw_input_contents.append(_payload(size))
        self.metadata = (("authorization", f"Bearer {TOKEN}"),)
        self.size, self.timeout = size, timeout  # a deadline only where asked (the tests): none in a benchmark

    def __call__(self):
        reply = self.call(self.request, metadata=self.metadata, timeout=self.timeout)
        if len(reply.raw_output_contents[0]) != self.size:
            raise RuntimeError("short answer")
        return reply.raw_output_contents[0]

    def close(self):
        self.channel.close()


class TritonCaller:
    """``tritonclient.grpc``: what Triton's users write (inputs set once, ``as_numpy`` on every answer)."""

    def __init__(self, address: str, size: int, timeout: float | None = None):
        import numpy as np
        import tritonclient.grpc as tc

        self.client = tc.InferenceServerClient(address)
        x = np.frombuffer(_payload(size), np.uint8)
        self.inputs = [tc.InferInput("x", [size], "UINT8")]
        self.inputs[0].set_data_from_numpy(x)
        self.outputs = [tc.InferRequestedOutput("y")]
        self.headers = {"authorization": f"Bearer {TOKEN}"}
        self.size, self.timeout = size, timeout

    def __call__(self):
        y = self.client.infer("echo", self.inputs, outputs=self.outputs, headers=self.headers,
                              client_timeout=self.timeout).as_numpy("y")
        if y.nbytes != self.size:
            raise RuntimeError("short answer")
        return y.tobytes()

    def close(self):
        self.client.close()


CALLERS = {"stub": StubCaller, "triton": TritonCaller}


def worker_main(conn) -> None:
    """A client process: runs the driver's blocks on callers it keeps (one connection per server)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    callers = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        op, address, client, size = msg[:4]
        try:
            key = (address, client, size)
            if key not in callers:
                callers[key] = CALLERS[client](address, size)
            call = callers[key]
            cpu0 = time.process_time()
            if op == "warm":
                for _ in range(msg[4]):
                    if call() != _payload(size):
                        raise RuntimeError("the echo is not the request's bytes")
                conn.send(("ok", None))
                continue
            samples = []
            clock = time.perf_counter_ns
            if op == "lat":
                n, budget = msg[4], msg[5]
                threads0 = thread_usage([os.getpid()]) if len(msg) > 6 and msg[6] else None
                end = clock() + int(budget * 1e9)
                for _ in range(n):
                    t0 = clock()
                    call()
                    t1 = clock()
                    samples.append(t1 - t0)
                    if t1 > end:
                        break
                if threads0 is not None:  # --breakdown: this client's own threads, as the server's
                    threads1 = thread_usage([os.getpid()])
                    conn.send(("ok", (samples, time.process_time() - cpu0, {
                        tid: (t[0], t[1] - threads0.get(tid, t)[1], t[2] - threads0.get(tid, t)[2],
                              t[3] - threads0.get(tid, t)[3], t[4] - threads0.get(tid, t)[4])
                        for tid, t in threads1.items()})))
                    continue
            else:  # load: from a common monotonic start, for a duration
                start_at, duration = msg[4], msg[5]
                while time.monotonic() < start_at:
                    time.sleep(min(0.002, max(0.0, start_at - time.monotonic())))
                end = time.monotonic() + duration
                while time.monotonic() < end:
                    t0 = clock()
                    call()
                    samples.append(clock() - t0)
            conn.send(("ok", (samples, time.process_time() - cpu0)))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops the run
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    for call in callers.values():
        call.close()


class Workers:
    def __init__(self, n: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child,), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def ask(self, indices, msg) -> list:
        for i in indices:
            self.conns[i].send(msg)
        answers = []
        for i in indices:
            status, value = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"client {i}: {value} ({msg[:4]})")
            answers.append(value)
        return answers

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# -- the run ---------------------------------------------------------------------------------------

@dataclass
class Case:
    shape: str
    handler: str
    size: int
    client: str
    concurrency: int
    samples_ns: list = field(default_factory=list)
    round_p50_us: list = field(default_factory=list)
    round_rps: list = field(default_factory=list)
    server_cpu_us: list = field(default_factory=list)  # per request, each round
    server_wait_us: list = field(default_factory=list)  # per request: its threads runnable, waiting for a CPU
    server_vcs: list = field(default_factory=list)
    server_ivcs: list = field(default_factory=list)
    client_cpu_us: list = field(default_factory=list)
    busiest_share: list = field(default_factory=list)  # multi-process: the busiest process's share of CPU

    @property
    def key(self) -> tuple:
        return (self.shape, self.handler, self.size, self.client, self.concurrency)

    def summary(self) -> dict:
        s = sorted(self.samples_ns)

        def pct(q):
            return s[min(len(s) - 1, int(q * len(s)))] / 1e3 if s else float("nan")

        def med(values):
            return round(statistics.median(values), 1) if values else None
        return {"shape": self.shape, "handler": self.handler, "size": self.size, "client": self.client,
                "concurrency": self.concurrency, "requests": len(s),
                "p50_us": round(pct(0.5), 1), "p90_us": round(pct(0.9), 1), "p99_us": round(pct(0.99), 1),
                "round_p50_us": [round(v, 1) for v in self.round_p50_us],
                "rps": med(self.round_rps), "round_rps": [round(v, 1) for v in self.round_rps],
                "server_cpu_us_per_req": med(self.server_cpu_us),
                "server_cpu_wait_us_per_req": med(self.server_wait_us), "server_vcs_per_req": med(self.server_vcs),
                "server_ivcs_per_req": med(self.server_ivcs), "client_cpu_us_per_req": med(self.client_cpu_us),
                "busiest_process_share": med(self.busiest_share)}


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(B|KiB|MiB)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4KiB, 1MiB, 512)")
    return int(m.group(1)) * {None: 1, "B": 1, "KiB": 1024, "MiB": 1 << 20}[m.group(2)]


def _size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else (
        f"{n >> 10} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} B")


def _run_block(case: Case, server: Server, workers: Workers, args) -> None:
    """One round of one case: samples, CPU and switches."""
    before = proc_usage(server.pids)
    if case.concurrency == 1:
        n = args.requests if case.size < (1 << 20) else max(20, args.requests // 10)
        t0 = time.perf_counter()
        ((samples, client_cpu),) = workers.ask([0], ("lat", server.address, case.client, case.size, n,
                                                     args.block_budget))
        wall = time.perf_counter() - t0
        client_cpus = [client_cpu]
    else:
        start_at = time.monotonic() + 0.05
        answers = workers.ask(range(case.concurrency), ("load", server.address, case.client, case.size,
                                                        start_at, args.duration))
        wall = args.duration
        samples = [v for a in answers for v in a[0]]
        client_cpus = [a[1] for a in answers]
    after = proc_usage(server.pids)
    (cpu, wait, vol, invol), per = _delta(before, after)
    n = max(1, len(samples))
    case.samples_ns.extend(samples)
    case.round_p50_us.append(statistics.median(samples) / 1e3)
    case.round_rps.append(len(samples) / wall)
    case.server_cpu_us.append(cpu / n * 1e6)
    case.server_wait_us.append(wait / n * 1e6)
    case.server_vcs.append(vol / n)
    case.server_ivcs.append(invol / n)
    case.client_cpu_us.append(sum(client_cpus) / n * 1e6)
    if len(per) > 1 and cpu > 0:
        case.busiest_share.append(max(per) / cpu)


def _print_table(rows: list[dict]) -> None:
    print("| shape | handler | size | client | clients | p50 µs | p90 µs | p99 µs | round p50s µs | req/s "
          "| server CPU µs/req | server CPU-wait µs/req | server wakeups/req | client CPU µs/req | busiest proc |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        spread = f"{min(r['round_p50_us']):.0f}–{max(r['round_p50_us']):.0f}" if r["round_p50_us"] else ""
        busiest = f"{r['busiest_process_share']:.2f}" if r["busiest_process_share"] is not None else ""
        print(f"| {r['shape']} | {r['handler']} | {_size_name(r['size'])} | {r['client']} | {r['concurrency']} "
              f"| {r['p50_us']:.0f} | {r['p90_us']:.0f} | {r['p99_us']:.0f} | {spread} | {r['rps']:.0f} "
              f"| {r['server_cpu_us_per_req']:.0f} | {r['server_cpu_wait_us_per_req']:.0f} "
              f"| {r['server_vcs_per_req']:.1f} "
              f"| {r['client_cpu_us_per_req']:.0f} | {busiest} |")


def _environment() -> dict:
    import grpc

    from importlib import metadata

    versions = {}
    for dist in ("tritonclient", "protobuf", "uvloop", "grpclib", "h2"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    env = {"python": platform.python_version(), "grpcio": grpc.__version__, **versions,
           "cpus": _cpus(), "machine": platform.machine(), "kernel": platform.release(),
           "loadavg_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                    None)
    except OSError:
        pass
    return env


def run(args) -> int:
    shapes = [parse_shape(s) for s in args.shapes]
    cases = []
    for shape in shapes:
        for handler in args.handlers:
            if handler not in shape.handlers:
                continue
            for size in args.sizes:
                for client in args.clients:
                    for c in args.concurrency:
                        cases.append(Case(shape.name, handler, size, client, c))
    if not cases:
        raise SystemExit("no case to run: the shapes have none of the handlers asked for (see --list)")
    params = {"seed": args.seed, "rounds": args.rounds, "requests": args.requests, "duration_s": args.duration,
              "block_budget_s": args.block_budget, "shapes": args.shapes, "handlers": args.handlers,
              "sizes": args.sizes, "clients": args.clients, "concurrency": args.concurrency,
              "procs": args.procs, "cases": len(cases)}
    env = _environment()
    print(f"# grpc_shapes {json.dumps(params)}")
    print(f"# environment {json.dumps(env)}", flush=True)
    servers: dict[tuple, Server] = {}
    workers = Workers(max(args.concurrency))
    t_start = time.monotonic()
    rounds_done = 0
    try:
        for case in cases:
            if (case.shape, case.handler) not in servers:
                servers[case.shape, case.handler] = Server(parse_shape(case.shape), case.handler)
        # every client process opens its connections now (and checks the echo) so no round pays for that
        for case in cases:
            server = servers[case.shape, case.handler]
            workers.ask(range(case.concurrency), ("warm", server.address, case.client, case.size, 20))
        rng = random.Random(args.seed)
        for rnd in range(args.rounds):
            t_round = time.monotonic()
            order = cases[:]
            rng.shuffle(order)
            for case in order:
                _run_block(case, servers[case.shape, case.handler], workers, args)
            rounds_done = rnd + 1
            now = time.monotonic()
            print(f"# round {rounds_done}/{args.rounds} done at {now - t_start:.0f} s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            if args.time_limit and now - t_start + (now - t_round) > args.time_limit:
                print(f"# stopping after {rounds_done} rounds: another would pass --time-limit {args.time_limit:g} s",
                      flush=True)
                break
    finally:
        workers.close()
        for server in servers.values():
            server.stop()
    env["loadavg_end"] = os.getloadavg()
    params["rounds_done"] = rounds_done
    rows = [c.summary() for c in cases]
    _print_table(rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"tool": "grpc_shapes", "params": params, "environment": env, "cases": rows,
                       "elapsed_s": round(time.monotonic() - t_start, 1)}, f, indent=1)
    return 0


# -- where the time goes ---------------------------------------------------------------------------

def _thread_role(tid: int, pid: int, comm: str, names: dict[int, str]) -> str:
    if tid == pid:
        return "main (the loop / sync: idle)"
    name = names.get(tid, "")
    if "_poll_wrapper" in name:
        return "grpc.aio poller thread"
    if "(_serve)" in name:
        return "sync server's polling thread"
    if name.startswith("ThreadPoolExecutor"):
        return "handler pool threads"
    if name == "shapes-loop":
        return "hop: asyncio loop thread"
    if name:
        return f"python: {re.sub(r'[-_]?[0-9]+', '', name)}"
    return f"core: {comm}"


def _strace_counts(pids: list[int], during) -> dict[str, int] | None:
    """Syscall counts of every thread of ``pids`` while ``during()`` runs (``strace -f -c``)."""
    if not shutil.which("strace"):
        return None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        cmd = ["strace", "-f", "-c", "-o", out.name]
        for pid in pids:
            cmd += ["-p", str(pid)]
        tracer = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # attached
        during()
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        counts = {}
        for line in out.read().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and not line.startswith("100.00"):
                counts[parts[-1]] = int(parts[3])
        return counts


def _perf_split(pids: list[int], during) -> dict | None:
    """Share of the server's CPU samples per (thread name, shared object) while ``during()`` runs."""
    if not shutil.which("perf"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        rec = subprocess.Popen(["perf", "record", "-q", "-F", "2999", "-o", data, "-p", ",".join(map(str, pids))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        during()
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
        rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "--sort", "comm,dso",
                              "-g", "none"], capture_output=True, text=True)
        split = {}
        for line in rep.stdout.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+(.+?)\s*$", line)
            if m:
                split[f"{m.group(2)} / {m.group(3)}"] = float(m.group(1))
        return split or None


RAW_ECHO = """
import asyncio, json, os, signal, struct, sys, uvloop
signal.signal(signal.SIGTERM, signal.SIG_DFL)
class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.buf = transport, bytearray()
    def data_received(self, data):
        self.buf += data
        while len(self.buf) >= 4:
            n = struct.unpack_from("<I", self.buf)[0]
            if len(self.buf) < 4 + n:
                break
            self.t.write(bytes(self.buf[:4 + n]))
            del self.buf[:4 + n]
async def main():
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(json.dumps({"port": server.sockets[0].getsockname()[1], "pid": os.getpid()}), flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


def raw_floor(size: int, n: int, repeats: int) -> dict:
    """The machine's floor under any RPC stack: the same bytes echoed over loopback TCP by a uvloop
    Protocol (length-prefixed), from a blocking socket in this process.  p50 and CPU per request."""
    import struct

    server = subprocess.Popen([sys.executable, "-c", RAW_ECHO], stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(server.stdout.readline())["port"]
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = struct.pack("<I", size) + _payload(size)
        answer = bytearray(len(message))

        def once():
            sock.sendall(message)
            view, got = memoryview(answer), 0
            while got < len(answer):
                k = sock.recv_into(view[got:])
                if not k:
                    raise RuntimeError("the raw echo closed")
                got += k
        for _ in range(200):
            once()
        out = []
        for _ in range(repeats):
            before, cpu0, samples = proc_usage([server.pid]), time.process_time(), []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                once()
                samples.append(time.perf_counter_ns() - t0)
            (cpu, wait, vol, _), _ = _delta(before, proc_usage([server.pid]))
            out.append({"p50_us": statistics.median(samples) / 1e3, "server_cpu_us_per_req": cpu / n * 1e6,
                        "server_wakeups_per_req": vol / n,
                        "client_cpu_us_per_req": (time.process_time() - cpu0) / n * 1e6})
        if bytes(answer) != message:
            raise RuntimeError("the raw echo is not the request's bytes")
        sock.close()
        return {"repeats": out}
    finally:
        server.kill()
        server.wait(10)


def breakdown(args) -> int:
    size = args.sizes[0]
    handler = args.handlers[0]
    env = _environment()
    params = {"shapes": args.shapes, "handler": handler, "size": size, "requests": args.requests,
              "repeats": args.rounds, "perf": args.perf}
    print(f"# grpc_shapes --breakdown {json.dumps(params)}")
    print(f"# environment {json.dumps(env)}", flush=True)
    workers = Workers(1)
    results = []
    floor = raw_floor(size, args.requests, args.rounds)
    reps = floor["repeats"]
    print(f"\n## floor: a raw loopback TCP echo on uvloop (no HTTP/2, no gRPC), {_size_name(size)}: p50 "
          f"{statistics.median(r['p50_us'] for r in reps):.0f} µs (repeats "
          f"{', '.join(str(round(r['p50_us'])) for r in reps)}), server CPU "
          f"{statistics.median(r['server_cpu_us_per_req'] for r in reps):.0f} µs/req, "
          f"{statistics.median(r['server_wakeups_per_req'] for r in reps):.2f} wakeups/req, client CPU "
          f"{statistics.median(r['client_cpu_us_per_req'] for r in reps):.0f} µs/req", flush=True)
    try:
        for name in args.shapes:
            shape = parse_shape(name)
            h = handler if handler in shape.handlers else shape.handlers[-1]
            server = Server(shape, h)
            try:
                workers.ask([0], ("warm", server.address, "stub", size, 200))
                names = server.threads()
                n = args.requests

                def block(client_threads=False):
                    return workers.ask([0], ("lat", server.address, "stub", size, n, 600.0, client_threads))[0]

                repeats = []
                for _ in range(args.rounds):
                    t_before = thread_usage(server.pids)
                    samples, client_cpu, client_threads = block(client_threads=True)
                    t_after = thread_usage(server.pids)
                    client_roles: dict[str, list[float]] = {}
                    worker_pid = workers.procs[0].pid
                    for tid, (comm, run_ns, wait_ns, vol, invol) in client_threads.items():
                        role = "client main (the calling thread)" if tid == worker_pid else f"client core: {comm}"
                        acc = client_roles.setdefault(role, [0.0, 0.0, 0])
                        acc[0] += run_ns / len(samples) / 1e3
                        acc[1] += vol / len(samples)
                        acc[2] += 1
                    roles: dict[str, list[float]] = {}
                    per_req = 1e3 * len(samples)  # ns in all -> µs per request
                    for tid, (comm, run_ns, wait_ns, vol, invol) in t_after.items():
                        r0, w0, v0, i0 = t_before.get(tid, (comm, 0, 0, 0, 0))[1:]
                        pid = next((p for p in server.pids if os.path.exists(f"/proc/{p}/task/{tid}")), None)
                        role = _thread_role(tid, pid, comm, names)
                        acc = roles.setdefault(role, [0.0, 0.0, 0.0, 0.0, 0])
                        acc[0] += (run_ns - r0) / per_req
                        acc[1] += (wait_ns - w0) / per_req
                        acc[2] += (vol - v0) / len(samples)
                        acc[3] += (invol - i0) / len(samples)
                        acc[4] += 1
                    repeats.append({"p50_us": statistics.median(samples) / 1e3,
                                    "wall_us_per_req": sum(samples) / len(samples) / 1e3,
                                    "client_cpu_us_per_req": client_cpu / len(samples) * 1e6,
                                    "threads": {r: {"cpu_us_per_req": round(v[0], 1),
                                                    "cpu_wait_us_per_req": round(v[1], 1),
                                                    "wakeups_per_req": round(v[2], 2),
                                                    "preempted_per_req": round(v[3], 2), "count": v[4]}
                                                for r, v in sorted(roles.items())},
                                    "client_threads": {r: {"cpu_us_per_req": round(v[0], 1),
                                                           "wakeups_per_req": round(v[1], 2), "count": v[2]}
                                                       for r, v in sorted(client_roles.items())}})
                syscalls = _strace_counts(server.pids, block)
                client_syscalls = _strace_counts([workers.procs[0].pid], block)
                if client_syscalls:
                    client_syscalls = {k: round(v / n, 2)
                                       for k, v in sorted(client_syscalls.items(), key=lambda kv: -kv[1])}
                if syscalls:
                    syscalls = {k: round(v / n, 2) for k, v in sorted(syscalls.items(), key=lambda kv: -kv[1])}
                perf = _perf_split(server.pids, block) if args.perf else None
            finally:
                server.stop()
            result = {"shape": name, "handler": h, "repeats": repeats, "syscalls_per_req": syscalls,
                      "client_syscalls_per_req": client_syscalls, "perf": perf}
            results.append(result)
            _print_breakdown(result)
            env["loadavg_end"] = os.getloadavg()
            if args.json_out:  # after every shape: a run cut short keeps what it measured
                with open(args.json_out, "w") as f:
                    json.dump({"tool": "grpc_shapes --breakdown", "params": params, "environment": env,
                               "raw_tcp_floor": floor, "results": results}, f, indent=1)
    finally:
        workers.close()
    return 0


def _print_breakdown(r: dict) -> None:
    reps = r["repeats"]
    med = statistics.median
    p50s = ", ".join(f"{x['p50_us']:.0f}" for x in reps)
    print(f"\n## {r['shape']} ({r['handler']} handler): p50 {med(x['p50_us'] for x in reps):.0f} µs "
          f"(repeats {p50s}), "
          f"client CPU {med(x['client_cpu_us_per_req'] for x in reps):.0f} µs/req")
    print("| thread(s) | count | CPU µs/req (median; repeats) | waiting for a CPU µs/req | wakeups/req "
          "| preempted/req |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    roles = sorted({k for x in reps for k in x["threads"]})
    total = [sum(t["cpu_us_per_req"] for t in x["threads"].values()) for x in reps]
    for role in roles:
        vals = [x["threads"].get(role, {"cpu_us_per_req": 0, "cpu_wait_us_per_req": 0, "wakeups_per_req": 0,
                                        "preempted_per_req": 0, "count": 0}) for x in reps]
        cpu = [v["cpu_us_per_req"] for v in vals]
        if max(cpu) < 0.5 and max(v["wakeups_per_req"] for v in vals) < 0.01:
            continue
        print(f"| {role} | {vals[-1]['count']} | {med(cpu):.0f} ({', '.join(f'{c:.0f}' for c in cpu)}) "
              f"| {med(v['cpu_wait_us_per_req'] for v in vals):.0f} "
              f"| {med(v['wakeups_per_req'] for v in vals):.2f} | {med(v['preempted_per_req'] for v in vals):.2f} |")
    wakeups = [sum(t["wakeups_per_req"] for t in x["threads"].values()) for x in reps]
    print(f"| **all** | | {med(total):.0f} ({', '.join(f'{c:.0f}' for c in total)}) | "
          f"| {med(wakeups):.2f} | |")
    client = sorted({k for x in reps for k in x["client_threads"]})
    parts = []
    for role in client:
        cpu = [x["client_threads"].get(role, {"cpu_us_per_req": 0})["cpu_us_per_req"] for x in reps]
        wake = [x["client_threads"].get(role, {"wakeups_per_req": 0})["wakeups_per_req"] for x in reps]
        if max(cpu) >= 0.5:
            parts.append(f"{role} {med(cpu):.0f} µs ({med(wake):.2f} wakeups)")
    print("client, per request: " + "; ".join(parts))
    if r["syscalls_per_req"]:
        top = list(r["syscalls_per_req"].items())[:10]
        print("syscalls/req (strace -f): " + ", ".join(f"{k} {v:g}" for k, v in top)
              + f"; all {sum(r['syscalls_per_req'].values()):.1f}")
    if r.get("client_syscalls_per_req"):
        top = list(r["client_syscalls_per_req"].items())[:8]
        print("client syscalls/req: " + ", ".join(f"{k} {v:g}" for k, v in top)
              + f"; all {sum(r['client_syscalls_per_req'].values()):.1f}")
    if r["perf"]:
        top = sorted(r["perf"].items(), key=lambda kv: -kv[1])[:10]
        print("perf, % of server CPU samples by thread / object: " + "; ".join(f"{k} {v:.1f}" for k, v in top))


# -- command line ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    cpus = _cpus()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a bounded run (under a minute on 2 vCPUs): the door's shape, sync-t4, h2lean and "
                         "their -pN forms, stream handler, 4 KiB, stub, 1 and N clients, 3 rounds")
    ap.add_argument("--shapes", type=lambda s: s.split(","), help="comma-separated shapes (default: --list)")
    ap.add_argument("--handlers", type=lambda s: s.split(","), default=["unary", "stream"])
    ap.add_argument("--sizes", type=lambda s: [_size(x) for x in s.split(",")], default=[4096, 1 << 20],
                    help="payload sizes, e.g. 4KiB,1MiB")
    ap.add_argument("--clients", type=lambda s: s.split(","), default=["stub"], help="stub, triton")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="client processes per case (1 = latency run); default 1 and max(4, CPUs)")
    ap.add_argument("--procs", type=int, default=cpus, help="N of the default -pN shapes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=300, help="requests per latency block (1 MiB: a tenth)")
    ap.add_argument("--block-budget", type=float, default=2.0, help="a latency block stops after this many s")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per load block")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="start no round that would end past this many seconds (a bounded run on a slow machine)")
    ap.add_argument("--breakdown", action="store_true", help="where the server's time goes (see the header)")
    ap.add_argument("--perf", action="store_true", help="--breakdown: also a perf record of the server")
    ap.add_argument("--list", action="store_true", help="print the default shapes and exit")
    ap.add_argument("--json-out", help="write the results here as JSON")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--handler", default="stream", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(parse_shape(args.serve), args.handler, args.port)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers (finally)
    if args.list:
        print("\n".join(default_shapes(args.procs)))
        return 0
    if args.quick:
        args.shapes = args.shapes or quick_shapes(args.procs)
        args.handlers, args.sizes = ["stream"], [4096]
        args.concurrency = args.concurrency or [1, max(4, cpus)]
        args.rounds, args.requests, args.duration = 3, 200, 0.7
    if args.breakdown:
        args.shapes = args.shapes or ["aio-uvloop", "aio-asyncio", "sync-t1", "sync-t4", "aio-uvloop-iomgr",
                                      "sync-t4-iomgr", "grpclib-uvloop"]
        args.handlers = args.handlers if args.handlers != ["unary", "stream"] else ["stream"]
        args.sizes = args.sizes if args.sizes != [4096, 1 << 20] else [4096]
        args.requests = args.requests if args.requests != 300 else 2000
        args.rounds = min(args.rounds, 3)
    args.shapes = args.shapes or default_shapes(args.procs)
    args.concurrency = args.concurrency or [1, max(4, cpus)]
    for name in ("shapes", "handlers", "sizes", "clients", "concurrency"):  # each once, in the order given
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    try:
        for s in args.shapes:
            parse_shape(s)
    except ValueError as exc:
        raise SystemExit(f"grpc_shapes: {exc}") from None
    for name, allowed in (("handlers", HANDLERS), ("clients", CLIENTS)):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad:
            raise SystemExit(f"grpc_shapes: --{name} {','.join(bad)}: choose from {', '.join(allowed)}")
    return breakdown(args) if args.breakdown else run(args)


if __name__ == "__main__":
    sys.exit(main())
