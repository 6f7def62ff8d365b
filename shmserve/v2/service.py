"""The KServe v2 operations, shared by the HTTP and gRPC front doors.

Owns: what each v2 operation answers (health, server and model metadata,
model readiness and configuration, inference, the system and CUDA
shared-memory extensions, the repository extension, statistics), who may
call which (the same peer-credential allow-list and admin list as the Unix
socket; a caller whose uid is unknown is refused), and the dispatcher
``Door`` of a v2 connection: it copies a request's input bytes (from the
message, or read from a registered region) into the arena space the
dispatcher gives it, and takes each answer's outputs out before the space is
released.

Every call takes a ``Caller`` (who, and which connection: the per-connection
limits apply to it).  Errors are ``messages.V2Error`` with a shmserve code;
the doors map them to HTTP and gRPC status codes.

Must not: parse HTTP or protobuf, touch a socket, or block the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from shmserve.v2.messages import InferRequest, InferResult


@dataclass(eq=False)
class Caller:
    """A v2 client connection (HTTP) or peer (gRPC).  ``uid``/``groups``: its credentials (from
    ``SO_PEERCRED`` on a Unix socket, or looked up for a loopback TCP peer); ``uid`` None when they
    could not be found (such a caller is refused everything but the health routes)."""

    uid: int | None
    groups: frozenset[int] = frozenset()
    name: Hashable = None  # for logs: the peer address
    door: object = field(default=None, repr=False)  # the dispatcher Door (set by V2Service.connect)


class V2Service:
    """The v2 operations over one running server (see the module header)."""

    # -- connections ---------------------------------------------------------------------

    def connect(self, uid: int | None, groups=frozenset(), name: Hashable = None) -> Caller:
        """A new caller (one per HTTP connection; one per gRPC peer).  V2Error PERMISSION_DENIED if
        it is not on the allow-list (uid None included)."""
        raise NotImplementedError

    def disconnect(self, caller: Caller) -> None:
        """The caller is gone: its requests still in flight are dropped (their space freed once
        workers let go)."""
        raise NotImplementedError

    # -- health and metadata -------------------------------------------------------------

    def live(self) -> bool:
        raise NotImplementedError

    def ready(self) -> bool:
        """Started and not shutting down, and every model's default version serving."""
        raise NotImplementedError

    def server_metadata(self) -> dict:
        """``{"name": "shmserve", "version": ..., "extensions": [...]}``."""
        raise NotImplementedError

    def model_metadata(self, name: str, version: str | None) -> dict:
        """``{"name", "versions": [str], "platform", "inputs": [{"name", "datatype", "shape"}],
        "outputs": [...]}``; variable dimensions are -1.  V2Error UNKNOWN_MODEL."""
        raise NotImplementedError

    def model_ready(self, name: str, version: str | None) -> bool:
        """V2Error UNKNOWN_MODEL for a model (or version) that does not exist."""
        raise NotImplementedError

    def model_config(self, name: str, version: str | None) -> dict:
        """Triton's model configuration as JSON (``name``, ``platform``, ``backend``,
        ``max_batch_size``, ``input``/``output`` with ``data_type`` "TYPE_FP32" and ``dims``,
        ``instance_group``, ``dynamic_batching`` when it batches).  V2Error UNKNOWN_MODEL."""
        raise NotImplementedError

    # -- inference -----------------------------------------------------------------------

    async def infer(self, caller: Caller, request: InferRequest) -> InferResult:
        """Serve one request through the dispatcher.  Inputs with ``shm`` are read from the
        caller's registered region, outputs asked for with ``shm`` are written into one (their
        ``OutputTensor.data`` is then None).  Output data is bytes the result owns.

        V2Error: every code the dispatcher refuses or fails a request with, plus BAD_INPUT (an
        unknown datatype, data of the wrong size, an unknown or duplicate output), BAD_REGION (no
        such region for this caller, offset or size outside it, an output larger than its
        region), TOO_LARGE."""
        raise NotImplementedError

    # -- system shared memory ------------------------------------------------------------

    def shm_register(self, caller: Caller, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the POSIX shared-memory object ``key``
        under ``name`` (names are per caller uid).  V2Error PERMISSION_DENIED (registration is
        off: ``[server] v2_system_shared_memory``), BAD_REGION (no such object, not a regular
        file, owned by another uid, one of the server's own segments, offset + size past its
        end, the name taken).  The message never contains ``key``."""
        raise NotImplementedError

    async def shm_unregister(self, caller: Caller, name: str | None) -> None:
        """Unregister ``name`` (None: all of the caller's), once the requests using it are done.
        Unknown names are not an error (as Triton)."""
        raise NotImplementedError

    def shm_status(self, caller: Caller, name: str | None) -> list[dict]:
        """``[{"name", "key", "offset", "byte_size"}]`` of the caller's regions.  V2Error
        BAD_REGION for an unknown ``name``."""
        raise NotImplementedError

    def cuda_shm_register(self, caller: Caller, name: str, raw_handle: bytes, device_id: int,
                          byte_size: int) -> None:
        """Always V2Error BAD_REGION: CUDA shared memory is not supported."""
        raise NotImplementedError

    def cuda_shm_status(self, caller: Caller, name: str | None) -> list[dict]:
        """Always empty; V2Error BAD_REGION for a ``name``."""
        raise NotImplementedError

    # -- repository and statistics ---------------------------------------------------------

    def repository_index(self, caller: Caller, ready_only: bool = False) -> list[dict]:
        """``[{"name", "version", "state", "reason"}]`` (state READY, UNAVAILABLE, LOADING,
        UNLOADING).  V2Error PERMISSION_DENIED for a caller not on the admin list."""
        raise NotImplementedError

    async def repository_load(self, caller: Caller, name: str, parameters: dict | None = None) -> None:
        """Load ``name`` (its newest version, or ``parameters["version"]``) through the model
        lifecycle.  V2Error PERMISSION_DENIED, UNKNOWN_MODEL, MODEL_UNAVAILABLE (it failed to
        load; the message says why), BAD_INPUT (``parameters`` Triton's ``config`` or ``file:``
        overrides, which are refused)."""
        raise NotImplementedError

    async def repository_unload(self, caller: Caller, name: str, parameters: dict | None = None) -> None:
        """Unload every loaded version of ``name`` (or ``parameters["version"]``).  V2Error
        PERMISSION_DENIED, UNKNOWN_MODEL."""
        raise NotImplementedError

    def statistics(self, caller: Caller, name: str | None, version: str | None) -> dict:
        """Triton's statistics: ``{"model_stats": [{"name", "version", "last_inference",
        "inference_count", "execution_count", "inference_stats": {"success": {"count", "ns"},
        "fail": ..., "queue": ..., "compute_input": ..., "compute_infer": ...,
        "compute_output": ...}, "batch_stats": [...]}]}``.  V2Error UNKNOWN_MODEL."""
        raise NotImplementedError
