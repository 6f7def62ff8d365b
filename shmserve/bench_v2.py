"""`shmserve bench --protocol http|grpc`: the KServe v2 clients and floors of the benchmark.

Owns: one request of a one-input model over the v2 HTTP door (binary tensor
data, ``Inference-Header-Content-Length``) or gRPC door (``raw_input_contents``),
inline or through system shared memory (the input written once into a
region the client registered; the output read back from another), and the
floors for them: an echo of the same payload over the same stacks — an HTTP
server on the same parser (httptools on uvloop) answering the body back to the
same client, and a gRPC server (grpc.aio) whose ``ModelInfer`` answers
``raw_input_contents`` as ``raw_output_contents`` to the same stub.

The clients are deliberately lean (a raw kept-alive HTTP/1.1 connection,
grpcio's generated stub): a benchmark of the server, not of a client library.

Must not: leave a /dev/shm object behind (a region's name is unlinked once the server has
registered it), or listen anywhere but loopback.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

from shmserve.v2.messages import V2_NAMES

PROTOCOLS = ("unix", "http", "grpc")
# The bearer token the v2 clients present (a TCP caller without one is anonymous, and may not register
# shared memory): bench --token, or the token of the server --spawn-server makes.
TOKEN_ENV = "SHMSERVE_V2_TOKEN"


def _authorization() -> dict[str, str]:
    token = os.environ.get(TOKEN_ENV)
    return {"authorization": f"Bearer {token}"} if token else {}
# unix: inline is Client.infer (through a lane by default), socket the same with lanes=False (tensor
# bytes through the socket and the front-end), zero-copy Client.zero_copy (a lane, no copies).
MODES = {"unix": ("inline", "socket", "zero-copy"), "http": ("inline", "shm"), "grpc": ("inline", "shm")}


class _Region:
    """A /dev/shm object of this process (posix_ipc), mapped.  Its name is unlinked as soon as the
    server has registered it (the server holds its own descriptor), so not even a killed client
    leaves it behind; ``close`` unmaps it (and unlinks it if that has not happened)."""

    def __init__(self, size: int):
        import posix_ipc

        self.key = f"/shmserve-bench-v2-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shm = posix_ipc.SharedMemory(self.key, posix_ipc.O_CREX, mode=0o600, size=max(size, 1))
        try:
            self.buf = mmap.mmap(shm.fd, max(size, 1))
        finally:
            shm.close_fd()
        self.size = size
        self.linked = True

    def unlink(self) -> None:
        import posix_ipc

        if self.linked:
            self.linked = False
            posix_ipc.unlink_shared_memory(self.key)

    def close(self) -> None:
        self.buf.close()
        self.unlink()


def _registered(regions: list, register) -> None:
    """``register(tag, region)`` for the input ("in") and output ("out") region, then unlink their
    names; on any failure the regions are closed."""
    try:
        for tag, r in zip(("in", "out"), regions):
            register(tag, r)
    finally:
        for r in regions:
            r.unlink()


class HttpConnection:
    """A lean HTTP/1.1 client on one kept-alive connection: a request is its prebuilt bytes (one
    ``sendall``), an answer is read with ``recv_into`` into a buffer that is reused (the status
    line and ``content-length`` are all it reads of the head).  Python's ``http.client`` parses
    every head with the ``email`` package, which would cost more CPU than the server per request."""

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 16)

    @staticmethod
    def request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
        head = [f"{method} {path} HTTP/1.1", "host: localhost", f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    def __call__(self, request: bytes) -> tuple[int, memoryview]:
        """Send ``request``; (status, body: a view of the reused buffer, valid until the next call)."""
        self.sock.sendall(request)
        have, end = 0, -1
        while end < 0:
            have += self._recv(have)
            end = self.buf.find(b"\r\n\r\n", 0, have)
        head = bytes(self.buf[:end]).lower()
        status = int(head[9:12])
        at = head.find(b"content-length:")
        length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None]) if at >= 0 else 0
        total = end + 4 + length
        if len(self.buf) < total:
            self.buf.extend(bytes(total - len(self.buf)))
        while have < total:
            have += self._recv(have)
        return status, memoryview(self.buf)[end + 4:total]

    def _recv(self, at: int) -> int:
        n = self.sock.recv_into(memoryview(self.buf)[at:])
        if not n:
            raise ConnectionError("the server closed the connection")
        return n

    def close(self) -> None:
        self.sock.close()


class HttpCall:
    """One model's binary infer request over a kept-alive HTTP connection; ``shm``: its input and
    output in two registered regions."""

    def __init__(self, address: str, model: str, name: str, x: np.ndarray, output: str, shm: bool):
        self.conn = HttpConnection(address)
        self.auth = _authorization()
        self.regions: list[_Region] = []
        datatype = V2_NAMES[x.dtype.name]
        tensor = {"name": name, "shape": list(x.shape), "datatype": datatype}
        path = f"/v2/models/{model}/infer"
        if shm:
            src, dst = _Region(x.nbytes), _Region(x.nbytes)
            self.regions = [src, dst]
            np.frombuffer(src.buf, np.uint8, x.nbytes)[:] = x.reshape(-1).view(np.uint8)
            _registered(self.regions, lambda tag, r: self._post(
                f"/v2/systemsharedmemory/region/{tag}{os.getpid()}/register",
                json.dumps({"key": r.key, "offset": 0, "byte_size": r.size}).encode()))
            tensor["parameters"] = {"shared_memory_region": f"in{os.getpid()}", "shared_memory_byte_size": x.nbytes}
            out = {"name": output, "parameters": {"shared_memory_region": f"out{os.getpid()}",
                                                  "shared_memory_byte_size": x.nbytes}}
            self.request = HttpConnection.request("POST", path, json.dumps({"inputs": [tensor], "outputs": [out]})
                                                  .encode(), {"content-type": "application/json", **self.auth})
        else:
            tensor["parameters"] = {"binary_data_size": x.nbytes}
            header = json.dumps({"inputs": [tensor], "outputs": [{"name": output,
                                                                  "parameters": {"binary_data": True}}]}).encode()
            self.request = HttpConnection.request("POST", path, header + x.tobytes(), {
                "inference-header-content-length": len(header), "content-type": "application/octet-stream",
                **self.auth})

    def _post(self, path: str, body: bytes) -> memoryview:
        status, data = self.conn(HttpConnection.request("POST", path, body, {"content-type": "application/json",
                                                                             **self.auth}))
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {bytes(data[:200])!r}")
        return data

    def __call__(self) -> memoryview:
        status, data = self.conn(self.request)
        if status != 200:
            raise RuntimeError(f"infer: HTTP {status}: {bytes(data[:200])!r}")
        return data

    def close(self) -> None:
        try:
            for tag in ("in", "out") if self.regions else ():  # by name: the other clients' stay
                self._post(f"/v2/systemsharedmemory/region/{tag}{os.getpid()}/unregister", b"")
        finally:
            self.conn.close()
            for r in self.regions:
                r.close()


class GrpcCall:
    """The same over gRPC (``raw_input_contents``); ``shm`` as ``HttpCall``."""

    def __init__(self, address: str, model: str, name: str, x: np.ndarray, output: str, shm: bool):
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.pb = service_pb2
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1),
                                                               ("grpc.max_receive_message_length", -1)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = tuple(_authorization().items())
        self.regions: list[_Region] = []
        req = service_pb2.ModelInferRequest(model_name=model)
        tensor = req.inputs.add(name=name, datatype=V2_NAMES[x.dtype.name], shape=list(x.shape))
        out = req.outputs.add(name=output)
        if shm:
            src, dst = _Region(x.nbytes), _Region(x.nbytes)
            self.regions = [src, dst]
            np.frombuffer(src.buf, np.uint8, x.nbytes)[:] = x.reshape(-1).view(np.uint8)
            _registered(self.regions, lambda tag, r: self.stub.SystemSharedMemoryRegister(
                service_pb2.SystemSharedMemoryRegisterRequest(name=f"{tag}{os.getpid()}", key=r.key, offset=0,
                                                              byte_size=r.size), metadata=self.metadata))
            for t, tag in ((tensor, "in"), (out, "out")):
                t.parameters["shared_memory_region"].string_param = f"{tag}{os.getpid()}"
                t.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        else:
            req.raw_input_contents.append(x.tobytes())
        self.request = req

    def __call__(self):
        return self.stub.ModelInfer(self.request, metadata=self.metadata)

    def close(self) -> None:
        try:
            for tag in ("in", "out") if self.regions else ():  # by name: the other clients' stay
                self.stub.SystemSharedMemoryUnregister(self.pb.SystemSharedMemoryUnregisterRequest(
                    name=f"{tag}{os.getpid()}"), metadata=self.metadata)
        finally:
            self.channel.close()
            for r in self.regions:
                r.close()


def v2_call(protocol: str, address: str, model: str, spec: dict, name: str, x: np.ndarray, mode: str):
    """A callable making one request (and ``close()``), for ``shmserve.bench``'s clients."""
    output = spec["outputs"][0]["name"]
    cls = HttpCall if protocol == "http" else GrpcCall
    return cls(address, model, name, x, output, shm=(mode == "shm"))


# -- floors ------------------------------------------------------------------------------------

HTTP_ECHO = """
import asyncio, signal, sys, httptools, uvloop
signal.signal(signal.SIGINT, signal.SIG_DFL)
class Echo(asyncio.Protocol):
    def connection_made(self, t):
        self.t, self.p, self.body = t, httptools.HttpRequestParser(self), []
    def data_received(self, d): self.p.feed_data(d)
    def on_message_begin(self): self.body = []
    def on_body(self, b): self.body.append(b)
    def on_message_complete(self):
        body = b"".join(self.body)
        self.t.writelines([b"HTTP/1.1 200 OK\\r\\ncontent-type: application/octet-stream\\r\\n"
                           b"content-length: %d\\r\\n\\r\\n" % len(body), body])
async def main():
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""

GRPC_ECHO = """
import asyncio, signal, grpc, uvloop
from tritonclient.grpc import service_pb2, service_pb2_grpc
signal.signal(signal.SIGINT, signal.SIG_DFL)
class Echo(service_pb2_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request, context):
        reply = service_pb2.ModelInferResponse(model_name=request.model_name)
        reply.raw_output_contents.extend(request.raw_input_contents)
        return reply
async def main():
    server = grpc.aio.server(options=[("grpc.max_send_message_length", -1),
                                      ("grpc.max_receive_message_length", -1)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
uvloop.run(main())
"""


def echo_floor(protocol: str, size: int, reps: int) -> float:
    """p50 microseconds of an echo of ``size`` bytes over the same HTTP or gRPC stack (server in
    another process, the same client code as the benchmark's)."""
    server = subprocess.Popen([sys.executable, "-c", HTTP_ECHO if protocol == "http" else GRPC_ECHO],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(server.stdout.readline())
        x = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        spec = {"outputs": [{"name": "y"}]}
        call = v2_call(protocol, f"127.0.0.1:{port}", "echo", spec, "x", x, "inline")
        samples = []
        try:
            for i in range(reps + 10):
                t0 = time.perf_counter_ns()
                call()
                if i >= 10:
                    samples.append((time.perf_counter_ns() - t0) / 1e3)
        finally:
            call.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(10)
    return float(statistics.median(samples))
