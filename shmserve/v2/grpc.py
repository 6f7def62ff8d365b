"""The KServe v2 gRPC door: Triton's ``inference.GRPCInferenceService`` on grpc.aio, on the front-end's loop.

Owns: the gRPC server (a loopback ``host:port`` or a Unix socket path), the
servicer: each RPC turned into a ``V2Service`` call and its answer into the
reply message, ``ModelInfer``'s tensors (``raw_input_contents`` by input
position, the typed ``contents`` fields, shared-memory parameters; outputs
as ``raw_output_contents`` by output position), and who the caller is.

The messages are Triton's own, generated from its ``grpc_service.proto``
(a superset of KServe's) and shipped in ``tritonclient[grpc]``
(``service_pb2``, ``service_pb2_grpc``); nothing here writes a message by
hand.  A request is checked by the same rules as an HTTP one: it is turned
into the v2 JSON form and read by ``shmserve.v2.rest.parse_infer``.

Callers: gRPC has no per-connection hook, so a caller is one peer address.
A loopback TCP peer's uid is read from the kernel's TCP table
(``shmserve.v2.peer``) when it is first seen and again when its answer is
older than ``PEER_TTL_S``; a Unix-socket peer has no credentials in gRPC, so
the socket is made 0600 and only the server's uid (and root) can connect:
they are served as the server's uid.

Must not: decide anything about a request (``shmserve.v2.service``), or
block the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from shmserve.errors import ErrorCode
from shmserve.frontend.unix import check_socket_path
from shmserve.v2 import peer, rest
from shmserve.v2.messages import V2Error
from shmserve.v2.service import Caller, V2Service

log = logging.getLogger("shmserve.v2.grpc")

PEER_TTL_S = 1.0  # how long a TCP peer's uid is trusted before the kernel's table is read again
IDLE_CALLER_S = 60.0  # a peer not seen this long (and holding nothing) is forgotten
STOP_GRACE_S = 3600.0  # shutdown: RPCs in flight are answered by the dispatcher's drain, not cut by gRPC
CLOSE_WAIT_S = 2.0  # then their answers have this long to leave
# typed InferTensorContents field of each datatype (FP16, BF16 have none: raw contents only)
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}


@dataclass(frozen=True)
class GrpcLimits:
    """``max_message_bytes``: the largest message either way (the server sets twice
    ``server.max_request_bytes`` plus 1 MiB)."""

    max_message_bytes: int


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


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Each RPC of Triton's service over one ``V2Service`` (``door``: the caller lookup)."""

    def __init__(self, door: "GrpcDoor"):
        self.door, self.service = door, door.service

    async def _call(self, context, fn, *args):
        """Run ``fn(*args)`` (a coroutine function or a plain one); a V2Error becomes the RPC's
        status, with shmserve's stable code in its message."""
        try:
            value = fn(*args)
            if asyncio.iscoroutine(value):
                value = await value
            return value
        except V2Error as exc:
            await context.abort(getattr(grpc.StatusCode, exc.grpc_status), f"[{exc.code.wire}] {exc.message}")

    async def _caller(self, context) -> Caller:
        """The caller of this RPC; a refused one (not on the allow-list, no known uid) ends it."""
        return await self._call(context, self.door.caller, context.peer())

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.service.live())

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.service.ready())

    async def ModelReady(self, request, context):
        try:  # a model that does not exist is not ready (the question has an answer)
            ready = self.service.model_ready(request.name, request.version)
        except V2Error:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        meta = self.service.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"], extensions=meta["extensions"])

    async def ModelMetadata(self, request, context):
        meta = await self._call(context, self.service.model_metadata, request.name, request.version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["inputs"]],
            outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["outputs"]])

    async def ModelConfig(self, request, context):
        from google.protobuf import json_format
        from tritonclient.grpc import model_config_pb2

        config = await self._call(context, self.service.model_config, request.name, request.version)
        message = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        return pb.ModelConfigResponse(config=message)

    async def ModelStatistics(self, request, context):
        from google.protobuf import json_format

        stats = await self._call(context, self.service.statistics, await self._caller(context), request.name,
                                 request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    async def RepositoryIndex(self, request, context):
        entries = await self._call(context, self.service.repository_index, await self._caller(context), request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries])

    async def RepositoryModelLoad(self, request, context):
        await self._call(context, self.service.repository_load, await self._caller(context), request.model_name,
                         _params(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._call(context, self.service.repository_unload, await self._caller(context), request.model_name,
                         _params(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(self, request, context):
        regions = await self._call(context, self.service.shm_status, await self._caller(context), request.name or None)
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(regions={r["name"]: status(**r) for r in regions})

    async def SystemSharedMemoryRegister(self, request, context):
        await self._call(context, self.service.shm_register, await self._caller(context), request.name, request.key,
                         request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._call(context, self.service.shm_unregister, await self._caller(context), request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        await self._call(context, self.service.cuda_shm_status, await self._caller(context), request.name or None)
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        await self._call(context, self.service.cuda_shm_register, await self._caller(context), request.name,
                         request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request, context):
        return pb.CudaSharedMemoryUnregisterResponse()

    async def ModelInfer(self, request, context):
        caller = await self._caller(context)
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

    async def ModelStreamInfer(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "ModelStreamInfer (decoupled models) is not served "
                                                           "by shmserve: use ModelInfer")

    async def TraceSetting(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "trace settings are not served by shmserve")

    async def LogSettings(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "log settings are not served by shmserve "
                                                           "(serve -v, --log-format)")


class GrpcDoor:
    """The gRPC door of one server (see the module header)."""

    def __init__(self, service: V2Service, limits: GrpcLimits, door_limits=None):
        self.service, self.limits, self.door_limits = service, limits, door_limits
        self.server: grpc.aio.Server | None = None
        self.address: str | None = None
        self.path: str | None = None
        self.ours: tuple | None = None  # (family, host, port) bound, for the TCP table
        self.callers: dict[str, tuple[Caller, float]] = {}  # peer -> (caller, when its uid was read)
        self.stopping: asyncio.Task | None = None

    async def start(self, address: str) -> None:
        """Listen on ``address``.  SystemExit naming the flag and why if it cannot."""
        size = self.limits.max_message_bytes
        self.server = grpc.aio.server(options=[("grpc.max_send_message_length", size),
                                               ("grpc.max_receive_message_length", size),
                                               ("grpc.so_reuseport", 0)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(self), self.server)
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
            else:
                host, _, port_text = address.rpartition(":")
                host = host.strip("[]") or "127.0.0.1"
                target = f"[{host}]:{port_text}" if ":" in host else f"{host}:{port_text}"
                port = self.server.add_insecure_port(target)
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                resolved = "127.0.0.1" if host == "localhost" else host
                self.ours = (family, resolved, port)
                self.address = f"[{resolved}]:{port}" if ":" in resolved else f"{resolved}:{port}"
            if not port:
                raise OSError(f"gRPC could not bind {address}")
            await self.server.start()
        except (OSError, RuntimeError) as exc:
            raise SystemExit(f"shmserve serve: --grpc {address}: cannot listen: {exc}") from None

    def caller(self, peer_name: str) -> Caller:
        """The caller of ``peer_name`` (``context.peer()``).  V2Error PERMISSION_DENIED if its
        uid cannot be known or it is not on the allow-list."""
        now = time.monotonic()
        known = self.callers.get(peer_name)
        if known is not None and now - known[1] < PEER_TTL_S:
            return known[0]
        if peer_name.startswith("unix:"):
            uid = os.getuid()
        elif self.ours is not None and (peer_name.startswith("ipv4:") or peer_name.startswith("ipv6:")):
            host, _, port = peer_name[5:].rpartition(":")
            family, ours_host, ours_port = self.ours
            uid = peer.tcp_peer_uid(family, (ours_host, ours_port), (host.strip("[]"), int(port)))
        else:
            uid = None
        if known is not None and known[0].uid == uid:
            self.callers[peer_name] = (known[0], now)
            return known[0]
        if known is not None:
            self.service.disconnect(known[0])
            del self.callers[peer_name]
        self._forget_idle(now)
        caller = self.service.connect(uid, peer.user_groups(uid) if uid is not None else frozenset(), name=peer_name)
        self.callers[peer_name] = (caller, now)
        return caller

    def _forget_idle(self, now: float) -> None:
        for name, (caller, seen) in list(self.callers.items()):
            if now - seen > IDLE_CALLER_S and not caller.door.in_flight():
                self.service.disconnect(caller)
                del self.callers[name]

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
        for caller, _ in self.callers.values():
            self.service.disconnect(caller)
        self.callers.clear()
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
