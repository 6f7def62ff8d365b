"""The KServe v2 gRPC door: Triton's ``inference.GRPCInferenceService`` on grpc.aio, on the front-end's loop.

Owns: the gRPC server (a loopback ``host:port`` or a Unix socket path) and
what it may be made to hold, who each RPC's caller is, the servicer (each
RPC turned into a ``V2Service`` call and its answer into the reply message),
and ``ModelInfer``'s tensors (``raw_input_contents`` by input position, the
typed ``contents`` fields, shared-memory parameters; outputs as
``raw_output_contents`` by output position).

The messages are Triton's own, generated from its ``grpc_service.proto``
(a superset of KServe's) and shipped in ``tritonclient[grpc]``
(``service_pb2``); nothing here writes a message by hand.  A request is
checked by the same rules as an HTTP one: it is turned into the v2 JSON
form and read by ``shmserve.v2.rest.parse_infer``.

Nothing is read before its caller is known and within its limits.  Every
method is served by a handler that reads its one request message itself
(``_Rpc``), after:

1. **who**: over TCP, the ``authorization`` metadata's bearer token, or
   anonymous (``shmserve.v2.auth``; nothing is looked up or remembered per
   peer address); over a Unix socket, the server's uid (gRPC tells no peer
   credentials, so the socket is made 0600: only the server's uid and root
   can connect);
2. **may it**: the operation's scope (``Authenticator.check``);
3. **how much**: its RPCs in progress (``max_inflight_per_uid``) and room
   to read a message (``ReadPool``, below).

Until then a stream holds only what HTTP/2 flow control lets its client
send: BDP probing is off, so an unread stream's window stays at 64 KiB.

Reading.  grpc's Python server tells no message size before the read, and a
posted read lets the client send up to the largest message (twice
``max_request_bytes`` plus 1 MiB, 129 MiB at the defaults).  So a read counts
as that much until it ends, against the door's read pool
(``max_grpc_read_bytes``, all callers together), of which one caller's reads
may hold at most half (its first read needs only room in the pool; a read
fits an empty pool whatever its size); a call waits for room, in order,
within ``upload_timeout_s``, and is refused RESOURCE_EXHAUSTED
``[overloaded]`` naming the key if none came.  Once read, the message's own
size moves to the caller's budget (``Ledger.reserve_bytes``,
``max_buffered_bytes_per_uid``: it waits for room, within
``upload_timeout_s``, still holding its read; one message at a time always
fits) and the read is given back.  (Counting each read against the
caller's budget instead, as before, let one caller read one message at a
time at the defaults: two 129 MiB reads pass 256 MiB, so its calls queued
for each other.  No smaller true bound of a message exists while typed
contents are taken: docs/security.md, "what a caller can make the server
hold", weighs the choices.)

The server also caps concurrent streams per connection
(``max_inflight_per_connection``), connections (``max_connections``),
message size, and idles out silent connections (keepalive).  A message must
arrive within ``upload_timeout_s`` of its read.  So one connection holds at
most streams × 64 KiB unread; one caller, its buffered-bytes budget plus
one message, plus half the read pool; all callers together, their budgets
plus the read pool.

Must not: decide anything about a request (``shmserve.v2.service``), trust
anything about a peer but what the kernel or a token says, or block the loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass

import grpc
from tritonclient.grpc import service_pb2 as pb

from shmserve.errors import ErrorCode
from shmserve.doorkit import check_socket_path
from shmserve.v2 import rest
from shmserve.v2.auth import Identity
from shmserve.v2.messages import RateLimited, V2Error
from shmserve.v2.service import Caller, ReadPool, V2Door, V2Service

log = logging.getLogger("shmserve.v2.grpc")

IDLE_PEER_S = 60.0  # a peer's bookkeeping not used this long (and holding nothing) is forgotten
STOP_GRACE_S = 3600.0  # shutdown: RPCs in flight are answered by the dispatcher's drain, not cut by gRPC
CLOSE_WAIT_S = 2.0  # then their answers have this long to leave
# typed InferTensorContents field of each datatype (FP16, BF16 have none: raw contents only)
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}


@dataclass(frozen=True)
class GrpcLimits:
    """What the gRPC server itself is told (at start; a reload does not change them):
    ``max_message_bytes``, the largest message either way (twice ``server.max_request_bytes``
    plus 1 MiB); ``max_read_bytes``, the messages being read at once, all callers together, each
    counted as the largest (``server.max_grpc_read_bytes``); ``max_streams``, concurrent RPCs per
    connection (``server.max_inflight_per_connection``); ``max_connections``
    (``server.max_connections``)."""

    max_message_bytes: int
    max_read_bytes: int = 1 << 30
    max_streams: int = 64
    max_connections: int = 512


def _param(p) -> object:
    """The value of an ``InferParameter`` (whichever of its fields is set)."""
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which is not None else None


def _params(params) -> dict:
    return {k: _param(v) for k, v in params.items()}


def _set_params(target, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int):
            target[key].int64_param = value
        else:
            target[key].string_param = str(value)


class Servicer:
    """Each RPC of Triton's service over one ``V2Service``: ``Method(request, context, caller)``."""

    def __init__(self, door: "GrpcDoor"):
        self.door, self.service = door, door.service

    @staticmethod
    async def _call(context, fn, *args):
        """Run ``fn(*args)`` (a coroutine function or a plain one); a V2Error becomes the RPC's
        status (``abort_with``)."""
        try:
            value = fn(*args)
            if asyncio.iscoroutine(value):
                value = await value
            return value
        except V2Error as exc:
            await abort_with(context, exc)

    async def ServerLive(self, request, context, caller):
        return pb.ServerLiveResponse(live=self.service.live())

    async def ServerReady(self, request, context, caller):
        return pb.ServerReadyResponse(ready=self.service.ready())

    async def ModelReady(self, request, context, caller):
        try:  # a model that does not exist is not ready (the question has an answer)
            ready = self.service.model_ready(request.name, request.version)
        except V2Error:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context, caller):
        meta = self.service.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"], extensions=meta["extensions"])

    async def ModelMetadata(self, request, context, caller):
        meta = await self._call(context, self.service.model_metadata, request.name, request.version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["inputs"]],
            outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["outputs"]])

    async def ModelConfig(self, request, context, caller):
        from google.protobuf import json_format
        from tritonclient.grpc import model_config_pb2

        config = await self._call(context, self.service.model_config, request.name, request.version)
        message = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        return pb.ModelConfigResponse(config=message)

    async def ModelStatistics(self, request, context, caller):
        from google.protobuf import json_format

        stats = await self._call(context, self.service.statistics, caller, request.name,
                                 request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    async def RepositoryIndex(self, request, context, caller):
        entries = await self._call(context, self.service.repository_index, caller, request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries])

    async def RepositoryModelLoad(self, request, context, caller):
        await self._call(context, self.service.repository_load, caller, request.model_name,
                         _params(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context, caller):
        await self._call(context, self.service.repository_unload, caller, request.model_name,
                         _params(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(self, request, context, caller):
        regions = await self._call(context, self.service.shm_status, caller, request.name or None)
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(regions={r["name"]: status(**r) for r in regions})

    async def SystemSharedMemoryRegister(self, request, context, caller):
        await self._call(context, self.service.shm_register, caller, request.name, request.key,
                         request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context, caller):
        await self._call(context, self.service.shm_unregister, caller, request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context, caller):
        await self._call(context, self.service.cuda_shm_status, caller, request.name or None)
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context, caller):
        await self._call(context, self.service.cuda_shm_register, caller, request.name,
                         request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request, context, caller):
        return pb.CudaSharedMemoryUnregisterResponse()

    async def ModelInfer(self, request, context, caller):
        # The model and the size are in the message: checked once it is read, before it is parsed.
        if self.service.rate.limits:
            await self._call(context, self.service.check_rate, caller.identity, request.model_name,
                             request.ByteSize())
        parsed = await self._call(context, self._parse, request)
        result = await self._call(context, self.service.infer, caller, parsed)
        try:
            reply = pb.ModelInferResponse(model_name=result.model_name, model_version=result.model_version,
                                          id=result.id or "")
            for o in result.outputs:
                out = reply.outputs.add(name=o.name, datatype=o.datatype, shape=o.shape)
                if o.shm is not None:
                    _set_params(out.parameters, {"shared_memory_region": o.shm.region,
                                                 "shared_memory_byte_size": o.shm.byte_size})
                reply.raw_output_contents.append(bytes(o.data) if o.data is not None else b"")
        finally:
            result.release()
        return reply

    @staticmethod
    def _parse(request):
        """``request`` as the v2 JSON form, read by ``rest.parse_infer`` (one set of rules)."""
        raw = list(request.raw_input_contents)
        header = {"inputs": [], "parameters": _params(request.parameters)}
        if request.id:
            header["id"] = request.id
        if request.outputs:
            header["outputs"] = [{"name": o.name, "parameters": _params(o.parameters)} for o in request.outputs]
        pieces, next_raw = [], 0
        for t in request.inputs:
            item = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "parameters": _params(t.parameters)}
            field = CONTENTS.get(t.datatype)
            typed = field is not None and t.HasField("contents") and len(getattr(t.contents, field))
            if "shared_memory_region" in item["parameters"]:
                pass
            elif typed and t.datatype == "BYTES":  # elements as they are (JSON data would be UTF-8 text)
                pieces.append(rest.serialize_bytes(t.contents.bytes_contents))
                item["parameters"]["binary_data_size"] = len(pieces[-1])
            elif typed:
                item["data"] = list(getattr(t.contents, field))
            else:
                if next_raw == len(raw):
                    raise V2Error(ErrorCode.BAD_INPUT, f"input {t.name!r} has no data: give raw_input_contents "
                                                       "(one per input without a region) or contents")
                pieces.append(raw[next_raw])
                next_raw += 1
                item["parameters"]["binary_data_size"] = len(pieces[-1])
            header["inputs"].append(item)
        if next_raw != len(raw):
            raise V2Error(ErrorCode.BAD_INPUT, f"{len(raw)} raw_input_contents for {next_raw} inputs without "
                                               "contents or a region")
        return rest.parse_infer(request.model_name, request.model_version or None, header, binary=pieces)

    async def TraceSetting(self, request, context, caller):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "trace settings are not served by shmserve")

    async def LogSettings(self, request, context, caller):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "log settings are not served by shmserve "
                                                           "(serve -v, --log-format)")


# Every method of the service: (operation as shmserve.v2.auth names it, request message class).
SERVICE = "inference.GRPCInferenceService"
METHODS: dict[str, tuple[str, type]] = {
    "ServerLive": ("live", pb.ServerLiveRequest), "ServerReady": ("ready", pb.ServerReadyRequest),
    "ModelReady": ("model_ready", pb.ModelReadyRequest), "ServerMetadata": ("server_metadata", pb.ServerMetadataRequest),
    "ModelMetadata": ("model_metadata", pb.ModelMetadataRequest), "ModelInfer": ("infer", pb.ModelInferRequest),
    "ModelConfig": ("model_config", pb.ModelConfigRequest), "ModelStatistics": ("statistics", pb.ModelStatisticsRequest),
    "RepositoryIndex": ("repository_index", pb.RepositoryIndexRequest),
    "RepositoryModelLoad": ("repository_load", pb.RepositoryModelLoadRequest),
    "RepositoryModelUnload": ("repository_unload", pb.RepositoryModelUnloadRequest),
    "SystemSharedMemoryStatus": ("shm_status", pb.SystemSharedMemoryStatusRequest),
    "SystemSharedMemoryRegister": ("shm_register", pb.SystemSharedMemoryRegisterRequest),
    "SystemSharedMemoryUnregister": ("shm_unregister", pb.SystemSharedMemoryUnregisterRequest),
    "CudaSharedMemoryStatus": ("cuda_shm_status", pb.CudaSharedMemoryStatusRequest),
    "CudaSharedMemoryRegister": ("cuda_shm_register", pb.CudaSharedMemoryRegisterRequest),
    "CudaSharedMemoryUnregister": ("cuda_shm_unregister", pb.CudaSharedMemoryUnregisterRequest),
    "TraceSetting": ("trace_setting", pb.TraceSettingRequest), "LogSettings": ("log_settings", pb.LogSettingsRequest),
}
# Server options beside the limits (the reasons are in the module header).
KEEPALIVE_TIME_MS = 60_000  # ping a connection silent this long...
KEEPALIVE_TIMEOUT_MS = 20_000  # ...and close it if the ping is not answered in this
MAX_CONNECTION_IDLE_MS = 300_000  # a connection with no RPC this long is closed (GOAWAY)
MIN_CLIENT_PING_MS = 10_000  # a client pinging more often than this (3 strikes) is cut off


# The trailing metadata key that carries shmserve's stable code beside a refusal's text.
CODE_KEY = "shmserve-code"
RETRY_AFTER_KEY = "retry-after"  # beside a rate limit's refusal: the seconds until it would be let in


async def abort_with(context, exc: V2Error):
    """End the RPC with ``exc``: its status, its text (Triton's words, or ``[code] message``) as
    the details, and its shmserve code in the trailing metadata (``CODE_KEY``)."""
    trailing = ((CODE_KEY, exc.code.wire),)
    if isinstance(exc, RateLimited):
        trailing += ((RETRY_AFTER_KEY, f"{max(exc.retry_after, 0.001):.3f}"),)
    await context.abort(getattr(grpc.StatusCode, exc.grpc_status), exc.text, trailing_metadata=trailing)


def _abort_now(code: grpc.StatusCode, message: str):
    """A handler that ends its RPC with ``code`` without reading a byte of its message."""
    async def refuse(request_iterator, context):
        await context.abort(code, message)
    return grpc.stream_unary_rpc_method_handler(refuse)


class _Handlers(grpc.GenericRpcHandler):
    """Every method of the service, each read by ``GrpcDoor.serve`` (one message, after the checks)."""

    def __init__(self, door: "GrpcDoor"):
        servicer = Servicer(door)
        self.table = {}
        for name, (op, request_type) in METHODS.items():
            behavior = door.rpc(op, request_type, getattr(servicer, name))
            self.table[f"/{SERVICE}/{name}"] = grpc.stream_unary_rpc_method_handler(
                behavior, response_serializer=lambda m: m.SerializeToString())
        self.table[f"/{SERVICE}/ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self._stream_infer)

    def service(self, handler_call_details):
        return self.table.get(handler_call_details.method)

    @staticmethod
    async def _stream_infer(request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "ModelStreamInfer (decoupled models) is not served "
                                                           "by shmserve: use ModelInfer")


class GrpcDoor:
    """The gRPC door of one server (see the module header).  ``door_limits``: the native door's
    bounds (the server replaces them on reload; the server options take the start's values)."""

    def __init__(self, service: V2Service, limits: GrpcLimits, door_limits):
        self.service, self.limits, self.door_limits = service, limits, door_limits
        self.server: grpc.aio.Server | None = None
        self.address: str | None = None
        self.path: str | None = None  # a Unix socket's path (its callers are the server's uid)
        self.unix_identity = None
        self.doors: dict[str, tuple[V2Door, float]] = {}  # peer -> (its requests' bookkeeping, last use)
        self.rpcs: collections.Counter[str] = collections.Counter()  # identity key -> RPCs in progress
        self.reads = ReadPool(lambda: limits.max_read_bytes, "server.max_grpc_read_bytes")  # messages being read
        self.stopping: asyncio.Task | None = None

    async def start(self, address: str) -> None:
        """Listen on ``address``.  SystemExit naming the flag and why if it cannot."""
        size = self.limits.max_message_bytes
        self.server = grpc.aio.server(options=[
            ("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0),
            ("grpc.max_concurrent_streams", self.limits.max_streams),
            ("grpc.max_allowed_incoming_connections", self.limits.max_connections),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_MS),
            ("grpc.http2.max_ping_strikes", 3)])
        self.server.add_generic_rpc_handlers((_Handlers(self),))
        try:
            if "/" in address:
                check_socket_path(address)
                path = os.path.abspath(address)
                if os.path.lexists(path):
                    os.unlink(path)  # check_socket_path found a dead server's socket (anything else exits)
                old = os.umask(0o177)  # 0600: gRPC tells no peer credentials, so only our uid may connect
                try:
                    port = self.server.add_insecure_port(f"unix:{path}")
                finally:
                    os.umask(old)
                self.path = self.address = path
                self.unix_identity = self.service.auth.peer(os.geteuid(), frozenset({os.getegid()}))
            else:
                host, _, port_text = address.rpartition(":")
                host = host.strip("[]") or "127.0.0.1"
                target = f"[{host}]:{port_text}" if ":" in host else f"{host}:{port_text}"
                port = self.server.add_insecure_port(target)
                resolved = "127.0.0.1" if host == "localhost" else host
                self.address = f"[{resolved}]:{port}" if ":" in resolved else f"{resolved}:{port}"
            if not port:
                raise OSError(f"gRPC could not bind {address}")
            await self.server.start()
        except (OSError, RuntimeError) as exc:
            raise SystemExit(f"shmserve serve: --grpc {address}: cannot listen: {exc}") from None

    def identify(self, context) -> Identity:
        """Who makes this RPC: the server's uid on the Unix socket; on TCP, what its
        ``authorization`` metadata proves (anonymous without one).  V2Error UNAUTHENTICATED."""
        if self.unix_identity is not None:
            return self.unix_identity
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key.lower() == "authorization":
                if authorization is not None:
                    raise V2Error(ErrorCode.UNAUTHENTICATED, "more than one authorization value")
                authorization = value if isinstance(value, str) else value.decode("latin-1")
        return self.service.auth.bearer(authorization)

    def rpc(self, op: str, request_type, method):
        """The behavior of one method: identify, check, count, read its message (see the module
        header), then ``method(request, context, caller)``; whatever happens, what was taken is
        given back."""
        service, ledger = self.service, self.service.ledger

        async def behavior(request_iterator, context):
            try:
                identity = self.identify(context)
                service.auth.check(identity, op)
                key = identity.key
                if self.rpcs[key] >= ledger.max_requests():
                    raise V2Error(ErrorCode.OVERLOADED, f"{identity.who} has {self.rpcs[key]} gRPC calls in "
                                                        "progress (server.max_inflight_per_uid)")
            except V2Error as exc:
                await abort_with(context, exc)
            self.rpcs[key] += 1
            reading = held = 0
            try:
                deadline = self.door_limits.upload_timeout_s
                # While it is read, the message counts as the largest one (grpc tells no size before)
                # against the door's read pool, not the caller's budget (ReadPool: the caller's share
                # is half the pool).  Once read, its own size moves to the caller's budget.  Its
                # parsed form is made on the loop (FromString), so no other call reads or parses
                # meanwhile: at any instant one message at most is held twice, across all callers.
                need = self.limits.max_message_bytes
                try:
                    await self.reads.take(identity, need, deadline)
                except V2Error as exc:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"[{exc.code.wire}] {exc.message}")
                reading = need
                try:
                    raw = await asyncio.wait_for(context.read(), deadline)
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"[timeout] the request message did not all arrive within {deadline:g} s "
                                        "(server.upload_timeout_s)")
                if raw is grpc.aio.EOF:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "[bad_frame] no request message")
                try:  # the message, then its parsed form; its read is held until its bytes are counted
                    await ledger.reserve_bytes(identity, len(raw), deadline)
                except V2Error as exc:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"[{exc.code.wire}] {exc.message}")
                held = len(raw)
                self.reads.give(identity, reading)
                reading = 0
                try:
                    request = request_type.FromString(raw)
                except Exception:  # protobuf's DecodeError
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"[bad_frame] the request is not a {request_type.__name__} message")
                del raw
                return await method(request, context, Caller(identity, self.door_of(context.peer())))
            finally:
                if reading:
                    self.reads.give(identity, reading)
                if held:
                    ledger.give_bytes(identity, held)
                _uncount_key(self.rpcs, key)

        return behavior

    def door_of(self, peer_name: str) -> V2Door:
        """The bookkeeping of ``peer_name``'s requests (one per connection: gRPC has no
        per-connection hook, so a peer address stands for it; it says nothing of who calls)."""
        now = time.monotonic()
        known = self.doors.get(peer_name)
        if known is not None:
            self.doors[peer_name] = (known[0], now)
            return known[0]
        self._forget_idle(now)
        door = self.service.open_door()
        self.doors[peer_name] = (door, now)
        return door

    def _forget_idle(self, now: float) -> None:
        for name, (door, seen) in list(self.doors.items()):
            if now - seen > IDLE_PEER_S and not door.in_flight():
                self.service.close_door(door)
                del self.doors[name]

    async def stop_listening(self) -> None:
        """Take no new RPC; those in flight finish (the server's drain bounds how long)."""
        if self.server is not None and self.stopping is None:
            self.stopping = asyncio.get_running_loop().create_task(self.server.stop(grace=STOP_GRACE_S))

    async def close(self) -> None:
        """Every RPC has been answered (the dispatcher failed what was left): stop for good."""
        if self.server is not None:
            server, self.server = self.server, None
            if self.stopping is None:
                self.stopping = asyncio.get_running_loop().create_task(server.stop(grace=0))
            try:
                await asyncio.wait_for(asyncio.shield(self.stopping), CLOSE_WAIT_S)
            except asyncio.TimeoutError:
                await server.stop(grace=0)
        for door, _ in self.doors.values():
            self.service.close_door(door)
        self.doors.clear()
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)


def _uncount_key(counter: collections.Counter, key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
