"""A real server with both v2 doors for the edge-case tests (HTTP, gRPC, shared memory, fuzz):
its models, short deadlines, and the checks each group of tests ends with: the server is alive,
answers a good request, holds no slot or arena space, and has no more descriptors open than it
had before."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

import numpy as np
import pytest

from helpers import raw_http
from helpers.server import ServerProcess, serving, wait_for

DEADLINE_S = 1  # frame_timeout_s, upload_timeout_s and stall_timeout_s of these servers
MAX_REQUEST_BYTES = 20 << 20  # HTTP bodies and gRPC messages up to 2x this + 1 MiB
BIG_OUT = 4096 * 1000 * 4  # bytes of "big"'s answer to 4096 float32s (serving_models.grow): 16.4 MB

# Datatypes of the two typed_echo models (serving_models.typed_echo; a slot holds 16 tensors).
TYPED = {"typed_a": ["bool", "int8", "int16", "int32", "int64", "uint8"],
         "typed_b": ["uint16", "uint32", "uint64", "float16", "float32", "float64"]}

def python_model(name: str, path: str, **keys) -> str:
    """A [[models]] table of the python backend; ``keys`` are TOML values written by json.dumps
    (options: an inline table of them)."""
    lines = ["[[models]]", f'name = "{name}"', 'backend = "python"', f'path = "{path}"']
    for key, value in keys.items():
        if isinstance(value, dict):
            value = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}"
        else:
            value = json.dumps(value)
        lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n\n"


MODELS = "".join([
    python_model("identity", "shmserve.models:identity", instances=2),
    python_model("f32", "shmserve.models:identity_f32"),
    *(python_model(name, f"serving_models:{name}") for name in ("slow", "two_inputs", "two_outputs")),
    python_model("big", "serving_models:grow", max_output_bytes=BIG_OUT + 4096),
    python_model("reverse", "shmserve.models:bytes_reverse"),
    python_model("bf16", "shmserve.models:typed_identity", options={"factory": True, "dtype": "bfloat16"}),
    *(python_model(name, "serving_models:typed_echo", options={"factory": True, "dtypes": dtypes})
      for name, dtypes in TYPED.items())])


# TCP callers are anonymous unless they present a token (docs/security.md): these servers know three,
# made fresh for each test session.  SHM_UID is the uid whose /dev/shm objects "admin" and "client"
# may register (this suite's own); "other" may register OTHER_UID's (made only by root).
TOKENS = {"admin": secrets.token_urlsafe(24), "client": secrets.token_urlsafe(24), "other": secrets.token_urlsafe(24)}
SHM_UID = os.getuid()
OTHER_UID = SHM_UID + 54321
TOKEN_UIDS = {"admin": SHM_UID, "client": SHM_UID, "other": OTHER_UID}


def auth(role: str = "admin") -> dict[str, str]:
    """The headers (HTTP) or metadata (gRPC, as ``.items()``) that present the ``role`` token."""
    return {"authorization": f"Bearer {TOKENS[role]}"}


class Bearer:
    """A tritonclient plugin (``client.register_plugin``) that presents the ``role`` token on every call."""

    def __init__(self, role: str = "admin"):
        self.value = auth(role)["authorization"]

    def __call__(self, request):
        request.headers["authorization"] = self.value


@contextlib.contextmanager
def triton_client(module, address: str, role: str = "admin"):
    """A ``module`` (tritonclient.http or .grpc) client of ``address`` presenting the ``role``
    token, closed on the way out."""
    client = authed(module.InferenceServerClient(address), role)
    try:
        yield client
    finally:
        client.close()


def authed(client, role: str = "admin"):
    """``client`` (tritonclient.http or .grpc) presenting the ``role`` token from now on."""
    client.register_plugin(Bearer(role))
    return client


def write_tokens(workdir: Path) -> Path:
    from shmserve.v2.auth import token_entry

    path = workdir / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(token_entry(role, token, "admin" if role == "admin" else "client", TOKEN_UIDS[role])
                          for role, token in TOKENS.items()))
    return path


def section(*, shm: bool = True, extra: str = "", http: str | None = None, deadlines: float = DEADLINE_S) -> str:
    """The [server] keys: both doors on loopback port 0 (``http``: the HTTP door's address
    instead), 1 s deadlines (tests of them; a test whose clients must never meet one, on a busy
    machine, gives generous ``deadlines``), 20 MiB requests, the test tokens; a key ``extra`` sets
    replaces its default."""
    lines = [f'http = "{http or "127.0.0.1:0"}"', 'grpc = "127.0.0.1:0"',
             f"v2_system_shared_memory = {str(shm).lower()}", 'v2_tokens = "tokens.toml"',
             f"max_request_bytes = {MAX_REQUEST_BYTES}", f"frame_timeout_s = {deadlines}",
             f"upload_timeout_s = {deadlines}", f"stall_timeout_s = {deadlines}"]
    given = {line.partition("=")[0].strip() for line in extra.splitlines()}
    return "".join(f"{line}\n" for line in lines if line.partition("=")[0].strip() not in given) + extra


@contextlib.contextmanager
def v2_serving(workdir: Path, *, shm: bool = True, extra: str = "", models: str = MODELS, http: str | None = None,
               deadlines: float = DEADLINE_S, **options):
    """``helpers.server.serving`` with both v2 doors; ``srv.http`` and ``srv.grpc`` are their
    addresses (``http``: the HTTP door's, a Unix socket path or loopback; default loopback port 0).
    The native socket answers before the doors are listed, so this waits for them.  ``options``
    go to ``ServerProcess``."""
    write_tokens(workdir)
    with serving(workdir, models, server_section=section(shm=shm, extra=extra, http=http, deadlines=deadlines),
                 **options) as srv:
        v2 = wait_for(lambda: (lambda d: d if {"http", "grpc"} <= set(d) else None)(srv.info()["v2"]),
                      "the v2 doors to listen", timeout=30)
        srv.http, srv.grpc = v2["http"], v2["grpc"]
        yield srv


def server_fixture(tag: str, **options):
    """A module-scoped fixture ``srv``: ``v2_serving`` (with ``options``) in a fresh directory
    named after ``tag``.  A test module assigns it to ``srv``."""
    @pytest.fixture(scope="module")
    def srv(tmp_path_factory):
        with v2_serving(tmp_path_factory.mktemp(tag), **options) as s:
            yield s

    return srv


@pytest.fixture(scope="module")
def stub(srv):
    """Triton's gRPC stub on the module's server, one channel for the whole module, connected
    (gRPC connects on the first call: before it, the server's descriptors do not count it)."""
    from tritonclient.grpc import service_pb2 as pb

    with grpc_stub(srv.grpc) as s:
        assert s.ServerLive(pb.ServerLiveRequest()).live
        yield s


@pytest.fixture(scope="module")
def baseline(srv):
    """The front-end's descriptors once it has served a request (so that nothing it opens on
    first use counts as a leak), with the module's long-lived connections open: a fixture that
    asks for it asks for ``stub`` first."""
    still_serving(srv)
    return open_fds(srv)


def open_fds(srv: ServerProcess, under: str | None = None) -> int:
    """How many descriptors the server's front-end has open now (``under``: only those open on a
    file whose path begins so, say a client's /dev/shm objects)."""
    fds = os.listdir(f"/proc/{srv.proc.pid}/fd")
    if under is None:
        return len(fds)
    count = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{srv.proc.pid}/fd/{fd}").startswith(under)
    return count


def good_request(srv: ServerProcess) -> None:
    """A well-formed binary infer over a fresh HTTP connection is answered right."""
    x = np.arange(37, dtype=np.uint8)
    header = {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [37],
                          "parameters": {"binary_data_size": 37}}], "parameters": {"binary_data_output": True}}
    r = raw_http.one(srv.http, raw_http.binary_infer("identity", header, x.tobytes()))
    assert r.status == 200, r
    assert r.json()["outputs"][0]["shape"] == [37] and r.binary == x.tobytes()


def still_serving(srv: ServerProcess, fds: int | None = None) -> None:
    """The checks after a group: alive, serves, nothing held; with ``fds``, the front-end's
    descriptors are back to at most that many (its side of closed connections closes a moment
    after the client's)."""
    assert srv.proc.poll() is None, f"the server died:\n{srv.log()[-4000:]}"
    good_request(srv)
    srv.wait_idle()
    if fds is not None:
        wait_for(lambda: open_fds(srv) <= fds, f"the server's descriptors back to {fds} (now {open_fds(srv)})",
                 timeout=15)


def json_values(keys, max_leaves: int = 25):
    """A hypothesis strategy of JSON values (what a client's body may hold): scalars past every
    integer type, lists and objects whose keys come from ``keys``."""
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=10)
               | st.floats(allow_nan=False, allow_infinity=False))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
                        max_leaves=max_leaves)


# -- client shared-memory objects --------------------------------------------------------------------

@contextlib.contextmanager
def shm_objects():
    """A factory of /dev/shm objects named for this test session: ``make(size, mode, data, uid)``
    returns its key ("/name"); every one is removed on the way out."""
    from conftest import new_instance

    made = []

    def make(size: int = 4096, mode: int = 0o600, data: bytes = b"", uid: int | None = SHM_UID) -> str:
        name = new_instance("v2shm")
        path = os.path.join("/dev/shm", name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        made.append(path)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, size)
            if data:
                os.pwrite(fd, data, 0)
            if uid is not None and uid != os.getuid():
                os.fchown(fd, uid, -1)
        finally:
            os.close(fd)
        return "/" + name

    try:
        yield make
    finally:
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def shm_path(key: str) -> str:
    return os.path.join("/dev/shm", key.lstrip("/"))


# -- gRPC, message by message ------------------------------------------------------------------------

@contextlib.contextmanager
def grpc_stub(address: str, max_message: int = 256 << 20, role: str | None = "admin"):
    """Triton's GRPCInferenceService stub on a fresh channel (closed on the way out), presenting the
    ``role`` token on every call (None: anonymous)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", max_message),
                                                      ("grpc.max_receive_message_length", max_message)])
    try:
        wrapped = channel if role is None else grpc.intercept_channel(channel, _Presenting(auth(role)))
        yield service_pb2_grpc.GRPCInferenceServiceStub(wrapped)
    finally:
        channel.close()


def _presenting_base():
    import grpc

    class Presenting(grpc.UnaryUnaryClientInterceptor):
        """Adds ``metadata`` to every unary call of a channel."""

        def __init__(self, metadata: dict):
            self.metadata = tuple(metadata.items())

        def intercept_unary_unary(self, continuation, details, request):
            import collections

            fields = collections.namedtuple("Details", ("method", "timeout", "metadata", "credentials",
                                                        "wait_for_ready", "compression"))
            metadata = tuple(details.metadata or ()) + self.metadata
            return continuation(fields(details.method, details.timeout, metadata, details.credentials,
                                       getattr(details, "wait_for_ready", None),
                                       getattr(details, "compression", None)), request)

    return Presenting


def _Presenting(metadata: dict):
    return _presenting_base()(metadata)


def grpc_refused(call, status: str, code: str | None = None) -> str:
    """``call()`` fails with gRPC ``status`` (a StatusCode name) and, given, shmserve's stable
    ``code`` at the start of its details, or beside Triton's words (the trailing metadata
    ``shmserve-code``); returns the details."""
    import grpc

    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() == getattr(grpc.StatusCode, status), (exc.code(), exc.details())
        if code is not None:
            beside = dict(exc.trailing_metadata() or ()).get("shmserve-code")
            assert exc.details().startswith(f"[{code}] ") or beside == code, (exc.details(), beside)
        return exc.details()
    raise AssertionError(f"succeeded; expected {status}")
