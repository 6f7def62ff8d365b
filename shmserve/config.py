"""Server configuration: the TOML file, its defaults, and the embedded demo.

Owns: every configurable knob with its default and the reason for it, and
validation that names the key that is wrong (``models[1].device: …``).

Must not: import backends or start anything (backend names are checked
against ``workerlink.backend_names``, which imports no backend).

File format::

    [server]
    instance = "default"            # arena /dev/shm/shmserve.<instance>
    socket = "/run/shmserve/x.sock" # else $SHMSERVE_SOCKET, else the runtime-dir default
    request_timeout_s = 30
    max_request_bytes = 67108864    # arena space per request: inputs plus outputs
    allow_uids = [1000]             # SO_PEERCRED allow-list; the server's uid and root always
    allow_gids = []
    allow_groups = ["shmserve-clients"]   # by name; members (primary or supplementary) may connect
    socket_mode = 0o600             # 0o660 with socket_group to let a group's members connect
    socket_group = "shmserve-clients"
    max_regions = 1024              # client regions and lanes held at once, all connections together
    max_regions_per_connection = 16
    max_regions_per_uid = 256
    max_region_bytes_per_connection = 1073741824
    max_region_bytes_per_uid = 4294967296
    restart_healthy_s = 10          # a worker that served this long is healthy: its restart back-off starts over
    # What one client can make the server hold (a refusal names the key it hit):
    max_connections = 512           # open connections in all; more are refused 'overloaded'
    max_connections_per_uid = 256   # open connections of one peer uid; more are refused 'overloaded'
    max_inflight_per_connection = 64          # requests not yet written back, unread results included
    max_inflight_per_uid = 512      # the same, all connections of one peer uid together
    max_inflight_bytes_per_connection = 67108864  # their arena bytes; at this, stop reading the socket
    stall_timeout_s = 10            # answers unread this long: the connection is closed, all it held freed
    frame_timeout_s = 10            # a frame's header and metadata must arrive within this, once begun
    upload_timeout_s = 10           # an inline request's payload must arrive within this, once it has space
    strict = false                  # true: a model that cannot load stops the start (exit 1); also serve --strict
    # Model lifecycle (docs/models.md):
    model_repository = "models"     # DIR/<model>/config.toml, DIR/<model>/<version>/<file>; also serve --model-repository
    admin_uids = [1000]             # may load/unload/scale/canary; the server's uid and root always
    admin_gids = []
    admin_groups = ["shmserve-admins"]
    max_workers = 64                # workers at once, all models and versions (a swap runs both versions)
    version_drain_timeout_s = 30    # a replaced version's requests may finish this long, then fail
    memory_budget = {cpu = "8GiB", "cuda:0" = "60GiB"}   # measured use of loaded versions per device
    # The KServe v2 front door (docs/v2.md); each off unless given; also serve --http / --grpc:
    http = "127.0.0.1:8000"         # loopback host:port, or a Unix socket path
    grpc = "127.0.0.1:8001"
    v2_system_shared_memory = false # true: clients may register their own /dev/shm objects
    v2_tokens = "/etc/shmserve/v2-tokens.toml"   # bearer tokens of TCP callers (0600; shmserve token new)
    v2_anonymous = ["metadata", "infer"]         # what a TCP caller without a token may do
    max_buffered_bytes_per_uid = 268435456       # v2 request bodies (and door processes' relayed payloads) per caller
    max_grpc_read_bytes = 1073741824             # gRPC messages being read, all callers (each as the largest)

    [arena]
    slots = 256
    size_classes = [[4096, 256], [65536, 64]]   # [extent bytes, count]; default derived from limits

    [[models]]
    name = "demo"
    backend = "onnxruntime"         # or "python", or any registered backend (checked here: the error lists them)
    path = "demo.onnx"              # relative to this file; python: "module:callable", the module looked up
                                    # in this file's directory, then the current one, then the Python path
    device = "cpu"                  # or "cuda:0", or ["cuda:0", "cuda:1"]: instances spread round-robin
    cpus = "0-3"                    # pin its workers (a cpulist; "inherit": never); default: a GPU model's
                                    # local CPUs (sysfs), a CPU model unpinned; docs/config.md "CPU placement"
    cpus_per_worker = 0             # N: each worker its own N CPUs of that set (0: every worker the whole set)
    io_mode = "copy"                # GPU only: "copy" (DMA) or "mapped" (zero-copy reads); docs/gpu.md
    instances = 1
    max_batch_size = 0              # 0: no batching
    max_queue_delay_us = 0
    max_output_bytes = 0            # the most one output may take (0: no limit but what the server delivers)
    inputs = [{name = "x", dtype = "float32", shape = ["batch", 3, 32, 32]}]   # optional overrides
    check_dims = ["batch"]          # named dimensions that must agree across a request's inputs;
                                    # default []: only rank and fixed sizes are checked (as runtimes do)
    version_policy = {latest = 1}   # repository versions served: {latest = N}, "all", {versions = [1, 3]}
    load = "startup"                # or "on_demand": loaded by its first request, evicted under memory_budget
    pinned = false                  # true: never evicted
    warmup = {requests = 1, inputs = {x = "x.npy"}, batch_sizes = [1, 8]}   # before a version takes traffic

    [rate_limits.batch]             # a named limit (the name is what refusals and metrics say)
    users = ["batch"]               # who: uids, users, groups, tokens, roles, anonymous = true, or each_caller = true
    model = "resnet"                # default: every model
    requests_per_s = 20             # and/or bytes_per_s = "64MiB"; each caller matched has its own bucket
    burst = 40                      # requests at once (default: one second's); burst_bytes likewise
"""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from shmserve import layout, placement
from shmserve.layout import validate_instance
from shmserve.spec import PLACEHOLDER_DIMS, TensorSpec
from shmserve.workerlink import backend_names

MiB = 1024 * 1024
DEFAULT_INSTANCE = "default"
DEMO_MODEL_RESOURCE = "demo.onnx"  # in shmserve/models/, rebuilt by tools/make_demo_model.py
_DEVICE_RE = re.compile(r"^(cpu|cuda:\d{1,2})$")


class ConfigError(ValueError):
    """A configuration problem; the message starts with the offending key."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    backend: str
    path: str
    device: str = "cpu"
    instances: int = 1
    max_batch_size: int = 0
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()  # run at once when a batch reaches one of these
    max_output_bytes: int = 0  # the most one output may take; 0: no limit of its own (shmserve.reservations)
    io_mode: str = "copy"  # GPU: "copy" (DMA to device buffers) or "mapped" (kernels read shared memory); docs/gpu.md
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    options: dict = field(default_factory=dict)  # backend-specific, passed through
    # -- where a python model is imported from, and which named dimensions must agree (issue 15) --
    base_dir: str = ""  # the config file's directory: searched first for a python model's module
    check_dims: tuple[str, ...] = ()  # named input dimensions held equal across a request's inputs
    # -- lifecycle (issue 12): which version this is, when it is loaded, how it is warmed --
    version: int = 1  # a single-file config's model is version 1; a repository's, its directory's number
    version_policy: tuple[str, tuple[int, ...]] = ("latest", (1,))  # ("latest", (n,)), ("all", ()), ("specific", vs)
    load: str = "startup"  # or "on_demand": loaded by its first request, evictable under the memory budget
    pinned: bool = False  # never evicted
    warmup_requests: int = 1  # warm-up runs per batch size before a version takes traffic
    warmup_inputs: tuple[tuple[str, str], ...] = ()  # (input name, .npy file) samples; else generated from the spec
    warmup_batch_sizes: tuple[int, ...] = ()  # () : 1, the preferred sizes and max_batch_size
    # -- placement (issue 14, part 4; docs/config.md "CPU placement") --
    devices: tuple[str, ...] = ()  # device = [...]: its workers spread over these (device is the first); ()
    cpus: str = placement.AUTO  # a cpulist (canonical), placement.INHERIT, or AUTO: a GPU's local CPUs
    cpus_per_worker: int = 0  # split the CPU set: each worker its own N CPUs; 0: every worker the whole set
    # -- scheduling (issue 29; shmserve.scheduling): Triton's priority_levels / default_queue_policy --
    priority_levels: int = 0  # 0: one level (arrival order within fairness); else 1 (first) .. N
    default_priority_level: int = 0  # a request's level when it names none (0: the lowest, N)
    priority_starvation_limit: int = 32  # the most times a waiting request is passed over by higher levels
    fairness: str = "callers"  # within a level: "callers" (round-robin across callers) or "arrival"
    max_queue_size: int = 0  # the most requests waiting for this model's workers; 0: no limit of its own
    default_timeout_us: int = 0  # a request's queue timeout when it sets none; 0: none
    timeout_action: str = "reject"  # a request whose queue timeout passed: "reject" (TIMEOUT) or "delay" (last)
    allow_timeout_override: bool = True  # a request's own timeout replaces default_timeout_us

    def to_dict(self) -> dict:
        return {"name": self.name, "backend": self.backend, "path": self.path, "device": self.device,
                "base_dir": self.base_dir, "check_dims": list(self.check_dims),
                "version": self.version, "version_policy": [self.version_policy[0], list(self.version_policy[1])],
                "load": self.load, "pinned": self.pinned, "warmup_requests": self.warmup_requests,
                "warmup_inputs": [list(p) for p in self.warmup_inputs],
                "warmup_batch_sizes": list(self.warmup_batch_sizes),
                "instances": self.instances, "max_batch_size": self.max_batch_size,
                "max_queue_delay_us": self.max_queue_delay_us, "max_output_bytes": self.max_output_bytes,
                "preferred_batch_sizes": list(self.preferred_batch_sizes),
                "io_mode": self.io_mode, "devices": list(self.devices), "cpus": self.cpus,
                "cpus_per_worker": self.cpus_per_worker,
                "priority_levels": self.priority_levels, "default_priority_level": self.default_priority_level,
                "priority_starvation_limit": self.priority_starvation_limit, "fairness": self.fairness,
                "max_queue_size": self.max_queue_size, "default_timeout_us": self.default_timeout_us,
                "timeout_action": self.timeout_action, "allow_timeout_override": self.allow_timeout_override,
                "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs],
                "options": self.options}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["inputs"] = tuple(TensorSpec.from_dict(t) for t in d.get("inputs", ()))
        d["outputs"] = tuple(TensorSpec.from_dict(t) for t in d.get("outputs", ()))
        d["preferred_batch_sizes"] = tuple(d.get("preferred_batch_sizes", ()))
        d["check_dims"] = tuple(d.get("check_dims", ()))
        if "version_policy" in d:
            d["version_policy"] = (d["version_policy"][0], tuple(d["version_policy"][1]))
        d["warmup_inputs"] = tuple(tuple(p) for p in d.get("warmup_inputs", ()))
        d["warmup_batch_sizes"] = tuple(d.get("warmup_batch_sizes", ()))
        d["devices"] = tuple(d.get("devices", ()))
        return cls(**d)

    @property
    def placement_devices(self) -> tuple[str, ...]:
        """The devices its workers are spread over (round-robin): ``devices``, else ``device``."""
        return self.devices or (self.device,)

    @property
    def key(self) -> str:
        """``name:version``, the version's name in logs, metrics and the worker table."""
        return f"{self.name}:{self.version}"

    def batch_sizes_to_warm(self) -> tuple[int, ...]:
        """The batch sizes a warm-up runs: the configured ones, else 1, the preferred sizes and
        max_batch_size (each a size the batcher will run)."""
        if self.warmup_batch_sizes:
            return self.warmup_batch_sizes
        return tuple(sorted({1, *self.preferred_batch_sizes, *((self.max_batch_size,) if self.max_batch_size else ())}))


DESCRIPTORS_RESERVED = 64  # the arena, eventfds, signals, logs, metrics, listeners, libraries' own
DESCRIPTORS_PER_WORKER = 4  # its control socket, pidfd, and the descriptors passed while spawning it


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelConfig, ...]
    instance: str = DEFAULT_INSTANCE
    socket: str | None = None
    request_timeout_s: float = 30.0
    max_request_bytes: int = 64 * MiB  # arena space one request may use: its inputs plus its outputs
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    arena_slots: int = 256
    size_classes: tuple[tuple[int, int], ...] | None = None
    drain_timeout_s: float = 10.0  # SIGTERM: how long in-flight requests may finish
    spin_us: int | None = None  # bounded spin before sleeping; None: auto (spin_default_us); 0: never
    max_waiting: int = 1024  # requests queued for arena space before 'overloaded'
    restart_backoff_s: tuple[float, float] = (0.5, 30.0)  # first and longest delay between restarts
    socket_mode: int = 0o600
    socket_group: str | None = None
    worker_timeout_s: float = 10.0  # a ready worker silent this long is wedged (watchdog) and killed
    # Client regions (sealed memfds, charged to the server's memory): what clients may make it hold.
    max_regions: int = 1024  # all connections together (the arena's region table)
    # Door processes serving the Unix socket beside the main one (docs/doors.md); None: auto
    # (``doors_default``); 0: the main process serves it alone.
    doors: int | None = 0
    door_lane_bytes: int = 64 * MiB  # each door lane's region (its data space is cut in one part per lane slot)
    max_regions_per_connection: int = 16
    max_regions_per_uid: int = 256  # a quarter of max_regions: one uid cannot take every record
    max_region_bytes_per_connection: int = 1 << 30
    max_region_bytes_per_uid: int = 4 << 30
    # Recovery.  10 s: a crash loop (a worker dying at load or right after it) dies well within it,
    # while a worker killed from outside after serving 10 s comes back after the first delay.
    restart_healthy_s: float = 10.0  # a worker ready this long is healthy: its restart back-off starts over
    # -- what one client can make the server hold (the Unix door and the dispatcher enforce these) --
    # Every open connection costs a descriptor and a 256 KiB read buffer: 512 stay well inside the
    # usual 1024-descriptor limit and 128 MiB.  One uid may take half, so it cannot lock others out.
    max_connections: int = 512
    max_connections_per_uid: int = 256
    # Requests submitted on one connection and not yet written back (results it has not read
    # included): each holds a slot, so a quarter of the default arena's 256 slots, leaving the rest
    # to others.  More are refused 'overloaded'.
    max_inflight_per_connection: int = 64
    # The same, all connections of one peer uid together: several processes of one uid cannot hold
    # more.  512 is twice the default slots (requests waiting for space count too); where several
    # uids share a server, set it to a fair share of arena.slots + max_waiting.
    max_inflight_per_uid: int = 512
    # The arena bytes (inputs and outputs) of those requests: at this much the server reads no new
    # frame from the connection until some are written back (backpressure, not an error).  It may
    # be passed by the one request that reaches it.  Default: the default max_request_bytes.
    max_inflight_bytes_per_connection: int = 64 * MiB
    # A connection whose answers wait unread (its socket is full) this long is closed, and every
    # slot, extent and region it held is freed.  Meanwhile it takes no new frame.
    stall_timeout_s: float = 10.0
    # Once a frame's first byte has come, its header and metadata must follow within this; else
    # 'bad_frame' and the connection is closed (a half-sent header holds a connection forever).
    frame_timeout_s: float = 10.0
    # Once an inline request has arena space, its payload must arrive within this; else it is
    # answered 'timeout', its space is freed and the connection is closed.
    upload_timeout_s: float = 10.0
    # -- start-up --
    # Strict (like Triton's --exit-on-error): a model none of whose workers is ready once start-up
    # has waited for them stops the start, with exit 1 and one line naming it and why, instead of
    # serving the others (``health`` would say degraded).  Off: the others are served.
    strict: bool = False
    # -- model lifecycle (issue 12; docs/models.md) --
    model_repository: str | None = None  # DIR/<model>/config.toml and DIR/<model>/<version>/<file>
    admin_uids: tuple[int, ...] = ()  # may load, unload, scale and run canaries; the server's uid and root always
    admin_gids: tuple[int, ...] = ()
    # The arena's worker table: every worker running at once, across all models and versions.  A
    # swap runs the old and new versions' workers side by side, so leave room for twice the largest.
    max_workers: int = 64
    # A version being replaced or unloaded: how long its queued and running requests may take to
    # finish before they fail 'model_unavailable' and its workers are stopped.
    version_drain_timeout_s: float = 30.0
    # Per device ("cpu", "cuda:0", ...), the memory its loaded versions may use (bytes, measured after
    # load); on_demand versions are evicted to stay within it.  No entry: no budget for that device.
    memory_budget: tuple[tuple[str, int], ...] = ()
    # -- the KServe v2 front door (issue 13; docs/v2.md): each off unless given --
    http: str | None = None  # "127.0.0.1:8000" (loopback only) or a Unix socket path
    grpc: str | None = None  # the same, for gRPC
    # Clients may register /dev/shm objects of their own uid (Triton's system shared-memory
    # extension).  Off: registering is refused PERMISSION_DENIED.
    v2_system_shared_memory: bool = False
    # Bearer tokens of the v2 doors' TCP callers (docs/security.md, "The v2 doors"): a TOML file of
    # [[token]] entries (name, sha256, role, uid), mode 0600, of the server's uid or root.  None: no
    # TCP caller can prove who it is, so every one is anonymous.
    v2_tokens: str | None = None
    # What a TCP caller without a token may do, besides health: any of V2_ANONYMOUS_SCOPES.  Never
    # shared memory (the server would open objects with its own rights for someone it cannot name)
    # nor the repository.  [] : only health.
    v2_anonymous: tuple[str, ...] = ("metadata", "infer")
    # The request bytes one v2 caller (a uid, a token, or all anonymous callers together) may make
    # the doors hold in memory outside the arena: HTTP bodies being parsed, gRPC messages being
    # read; and, counted apart, the payloads one uid's frames hold in the door processes while
    # they arrive to be relayed (docs/doors.md).  Four default-sized requests; a body or message
    # that would pass it is refused 'overloaded' before it is read (one at a time is always let
    # through, whatever its size).
    max_buffered_bytes_per_uid: int = 256 * MiB
    # The gRPC messages being read at once, all callers together: grpc tells no size before a
    # read, so each read counts as the largest message (twice max_request_bytes plus 1 MiB) until
    # it is read, then its own size moves to its caller's max_buffered_bytes_per_uid.  One caller's
    # reads at most half of it; one read always fits.  At the defaults: 7 reads, 3 per caller.
    max_grpc_read_bytes: int = 1024 * MiB
    # Per-caller rate limits ([rate_limits.NAME] tables; docs/config.md "Rate limits"): token buckets
    # kept by shmserve.frontend.ratelimit, checked where each request enters.
    rate_limits: tuple["RateLimit", ...] = ()

    def effective_doors(self) -> int:
        """How many door processes to start: ``doors``, or ``doors_default()`` when it is None (auto)."""
        return doors_default() if self.doors is None else self.doors

    def effective_spin_us(self) -> int:
        return spin_default_us() if self.spin_us is None else self.spin_us

    def descriptor_budget(self) -> dict[str, int]:
        """How many descriptors the front-end may hold at once when every limit is reached, by what
        holds them: each door's connections, client regions and lanes (two each: the memfd and the
        mapping's copy), registered v2 shared memory, workers, and its own.  ``serve`` refuses to
        start when it does not fit under RLIMIT_NOFILE; ``shmserve doctor`` measures a host by it."""
        budget = {"server.max_connections (Unix socket)": self.max_connections}
        if self.http:
            budget["server.max_connections (HTTP)"] = self.max_connections
        if self.grpc:
            budget["server.max_connections (gRPC)"] = self.max_connections
        budget["server.max_regions (client regions and lanes, two each)"] = 2 * self.max_regions
        if self.v2_system_shared_memory and (self.http or self.grpc):
            budget["server.max_regions (registered shared memory)"] = self.max_regions
        workers = max(self.max_workers, sum(m.instances for m in self.models))
        budget["server.max_workers (4 each)"] = DESCRIPTORS_PER_WORKER * workers
        budget["the front-end's own"] = DESCRIPTORS_RESERVED
        return budget

    def arena_size_classes(self) -> tuple[tuple[int, int], ...]:
        """Explicit classes, or a default whose largest class holds a max_request_bytes request twice."""
        if self.size_classes:
            return self.size_classes
        big = self.max_request_bytes + 64 * 1024  # + alignment padding between tensors
        classes = [(4096, 256), (64 * 1024, 128), (MiB, 16), (16 * MiB, 2)]
        classes = [c for c in classes if c[0] < big]
        return tuple(classes + [(big, 2)])


MAX_DOORS = 64  # door processes (each holds a lane per worker of each version it serves)
DOOR_LANE_MIN = 128 * 1024  # the least door_lane_bytes: a lane's 64 KiB queue and 4 KiB per lane slot


def doors_default(cpus: int | None = None) -> int:
    """Door processes by default: none below 4 CPUs (a door process there only takes CPU from the
    workers and the main process: docs/performance.md), else a quarter of the CPUs, at most 8.
    ``cpus``: the CPUs this process may run on (its affinity: a server pinned to 2 CPUs of a big
    host gets none)."""
    cpus = cpus or len(os.sched_getaffinity(0)) or 1
    return 0 if cpus < 4 else min(8, cpus // 4)


def spin_default_us(client: bool = False) -> int:
    """How long a waiter spins before it sleeps, by default.  A cross-core wake-up costs
    20-100 us on the machines measured, so spinning pays when a core is free to spin on.
    Measured on 2 vCPUs (docs/performance.md): a 300 us spin in the front-end and workers
    took a lone client's 4 KiB round trip from ~400 to ~240 us and left 8-client throughput
    unchanged, while clients, of which there may be many, spin only 50 us there.
    8+ CPUs: 500 us everywhere."""
    if (os.cpu_count() or 1) >= 8:
        return 500
    return 50 if client else 300


def resolve_socket(cli_value: str | None, config_value: str | None, instance: str) -> str:
    """--socket, else the config, else $SHMSERVE_SOCKET, else $XDG_RUNTIME_DIR/shmserve/<instance>.sock,
    else /tmp/shmserve-<uid>/<instance>.sock."""
    for value in (cli_value, config_value, os.environ.get("SHMSERVE_SOCKET")):
        if value:
            return value
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "shmserve" if runtime else Path(f"/tmp/shmserve-{os.getuid()}")
    return str(base / f"{instance}.sock")


SERVER_UID_ENV = "SHMSERVE_SERVER_UID"  # a client's trust in a server of another user (uid or user name)


def trusted_server_uids(server_uid: int | str | None = None) -> frozenset[int]:
    """The uids a client lets serve it: its own, root's, and ``server_uid`` (a uid or a user name),
    else $SHMSERVE_SERVER_UID.  ValueError naming the setting for a uid out of range or no such user."""
    where = "server_uid"
    if server_uid is None:
        server_uid, where = os.environ.get(SERVER_UID_ENV) or None, SERVER_UID_ENV
    trusted = {os.geteuid(), 0}
    if server_uid is None:
        return frozenset(trusted)
    if isinstance(server_uid, str) and not server_uid.isdigit():
        import pwd

        try:
            server_uid = pwd.getpwnam(server_uid).pw_uid
        except KeyError:
            raise ValueError(f"{where}: no user {server_uid!r} on this machine") from None
    uid = int(server_uid)
    if not 0 <= uid < 2**32 - 1:
        raise ValueError(f"{where}: {server_uid!r} is not a uid")
    return frozenset(trusted | {uid})


def demo_config(instance: str = DEFAULT_INSTANCE) -> ServerConfig:
    """The embedded default: the demo model on CPU through ONNX Runtime.  ConfigError for a bad
    instance name."""
    try:
        validate_instance(instance)
    except ValueError as exc:
        raise ConfigError(f"instance: {exc}") from None
    path = str(resources.files("shmserve.models") / DEMO_MODEL_RESOURCE)
    return ServerConfig(models=(ModelConfig(name="demo", backend="onnxruntime", path=path),), instance=instance)


def load(path: str | os.PathLike, *, instance: str | None = None, repository_given: bool = False) -> ServerConfig:
    """Parse and validate a TOML config file.  Raises ConfigError naming the bad key.
    ``repository_given``: a model repository comes from elsewhere (``serve --model-repository``), so
    a file with no ``[[models]]`` and no ``model_repository`` (server settings only) is valid."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse(raw, base_dir=path.parent, instance=instance, repository_given=repository_given)


REGION_KEYS = {"max_regions", "max_regions_per_connection", "max_regions_per_uid", "max_region_bytes_per_connection",
               "max_region_bytes_per_uid"}


def parse(raw: dict, *, base_dir: Path = Path("."), instance: str | None = None,
          repository_given: bool = False) -> ServerConfig:
    _keys(raw, "", {"server", "arena", "models", "rate_limits"})
    server = _table(raw, "server")
    arena = _table(raw, "arena")
    _keys(server, "server.", {"instance", "socket", "request_timeout_s", "max_request_bytes", "allow_uids",
                              "allow_gids", "drain_timeout_s", "spin_us", "max_waiting",
                              "max_inflight_per_connection", "socket_mode", "socket_group", "worker_timeout_s",
                              "allow_groups", "restart_healthy_s", "strict", "doors", "door_lane_bytes",
                              *CLIENT_LIMIT_KEYS} | REGION_KEYS
          | LIFECYCLE_KEYS | V2_KEYS)
    _keys(arena, "arena.", {"slots", "size_classes"})
    kw: dict = {}
    inst = instance or server.get("instance", DEFAULT_INSTANCE)
    try:
        kw["instance"] = validate_instance(inst)
    except ValueError as exc:
        raise ConfigError(f"server.instance: {exc}") from None
    if "socket" in server:
        kw["socket"] = _str(server["socket"], "server.socket")
    if "socket_mode" in server:
        kw["socket_mode"] = _int(server["socket_mode"], "server.socket_mode", 0, 0o777)
        if kw["socket_mode"] & 0o007:
            raise ConfigError("server.socket_mode: must not grant access to other users (use socket_group)")
    if "socket_group" in server:
        kw["socket_group"] = _str(server["socket_group"], "server.socket_group")
    kw.update(_bounded(server, "server.", lambda v, w, lo, hi: float(_num(v, w, lo, hi)), (
        ("request_timeout_s", 0.001, 86400), ("drain_timeout_s", 0, 3600), ("worker_timeout_s", 0.5, 3600))))
    kw.update(_bounded(server, "server.", lambda v, w, lo, hi: float(_num(v, w, lo, hi)), (
        ("restart_healthy_s", 0.01, 86400),)))
    kw.update(_bounded(server, "server.", _int, (
        ("max_request_bytes", 1, 1 << 36), ("spin_us", 0, 10_000_000), ("max_waiting", 0, 1 << 20))))
    kw.update(_client_limits(server))
    if "doors" in server:
        kw["doors"] = None if server["doors"] == "auto" else _int(server["doors"], "server.doors (or 'auto')", 0,
                                                                   MAX_DOORS)
    kw.update(_bounded(server, "server.", _int, (("door_lane_bytes", DOOR_LANE_MIN, 1 << 34),)))
    kw.update(_bounded(server, "server.", _int, (
        ("max_regions", 1, 1 << 16), ("max_regions_per_connection", 0, 1 << 16), ("max_regions_per_uid", 0, 1 << 16),
        ("max_region_bytes_per_connection", 0, 1 << 40), ("max_region_bytes_per_uid", 0, 1 << 44))))
    for key in ("allow_uids", "allow_gids", "admin_uids", "admin_gids"):
        if key in server:
            values = server[key]
            if not isinstance(values, list):
                raise ConfigError(f"server.{key}: expected a list of ids")
            kw[key] = tuple(_int(v, f"server.{key}[{i}]", 0, 2**32 - 1) for i, v in enumerate(values))
    if "allow_groups" in server:
        kw["allow_gids"] = tuple(kw.get("allow_gids", ())) + _group_ids(server["allow_groups"], "server.allow_groups")
    if "strict" in server:
        if type(server["strict"]) is not bool:
            raise ConfigError(f"server.strict: expected true or false, got {server['strict']!r}")
        kw["strict"] = server["strict"]
    kw.update(_lifecycle(server, base_dir))
    kw.update(_v2(server, base_dir))
    kw["admin_gids"] = kw.get("admin_gids", ()) + kw.pop("admin_group_gids", ())
    if "slots" in arena:
        kw["arena_slots"] = _int(arena["slots"], "arena.slots", 1, 1 << 20)
    if "size_classes" in arena:
        classes = arena["size_classes"]
        if not isinstance(classes, list) or not classes or len(classes) > 8:
            raise ConfigError("arena.size_classes: expected 1-8 [extent_bytes, count] pairs")
        kw["size_classes"] = tuple(
            (_int(c[0], f"arena.size_classes[{i}][0]", 1, 1 << 36), _int(c[1], f"arena.size_classes[{i}][1]", 1, 1 << 20))
            if isinstance(c, list) and len(c) == 2 else _bad(f"arena.size_classes[{i}]: expected [extent_bytes, count]")
            for i, c in enumerate(classes))
    models = raw.get("models", [])
    if not isinstance(models, list) or (not models and "model_repository" not in kw and not repository_given):
        raise ConfigError("models: at least one [[models]] table is required (or server.model_repository)")
    parsed, names = [], set()
    for i, m in enumerate(models):
        mc = _model(m, f"models[{i}]", base_dir)
        if mc.name in names:
            raise ConfigError(f"models[{i}].name: {mc.name!r} is used twice")
        names.add(mc.name)
        parsed.append(mc)
    kw["rate_limits"] = rate_limits(_table(raw, "rate_limits"))
    return ServerConfig(models=tuple(parsed), **kw)


# -- per-caller rate limits (issue 29, part 2; docs/config.md "Rate limits") -------------------

RATE_LIMIT_KEYS = {"uids", "users", "groups", "tokens", "roles", "anonymous", "each_caller", "model",
                   "requests_per_s", "burst", "bytes_per_s", "burst_bytes"}
_LIMIT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_RATE_WHO = ("uids = [1001], users = [\"batch\"], groups = [\"ml\"], tokens = [\"ingest\"], "
             "roles = [\"client\"], anonymous = true or each_caller = true")


@dataclass(frozen=True)
class RateLimit:
    """One ``[rate_limits.NAME]`` table: who it holds (each caller matched has its own buckets:
    a uid, a v2 token, or the anonymous TCP caller, one caller for all), which model (None:
    every model), requests and/or bytes per second and their bursts (a full bucket's size)."""

    key: str  # NAME: what refusals, metrics and info call it
    uids: tuple[int, ...] = ()  # uids = [...] and users = [...] (resolved when the file is read)
    gids: tuple[int, ...] = ()  # groups = [...]: a Unix-socket caller in one (primary or supplementary)
    tokens: tuple[str, ...] = ()  # v2 token names (server.v2_tokens)
    roles: tuple[str, ...] = ()  # v2 token roles: "client", "admin"
    anonymous: bool = False  # the v2 doors' anonymous TCP caller (all of them: one caller)
    each_caller: bool = False  # every caller
    model: str | None = None
    requests_per_s: float | None = None
    burst: float = 0.0  # requests a full bucket holds (requests_per_s set: at least 1)
    bytes_per_s: float | None = None
    burst_bytes: float = 0.0  # bytes a full bucket holds


def rate_limits(table: dict) -> tuple[RateLimit, ...]:
    """The ``[rate_limits]`` tables, each checked; ConfigError naming the key and the fix."""
    limits = []
    for name, t in table.items():
        where = f"rate_limits.{name}"
        if not _LIMIT_NAME_RE.match(name):
            raise ConfigError(f"{where}: a limit's name is 1-64 of A-Z a-z 0-9 _ . - (it becomes a metrics label)")
        if not isinstance(t, dict):
            raise ConfigError(f"{where}: expected a table like {{users = [\"batch\"], requests_per_s = 20}}")
        _keys(t, f"{where}.", RATE_LIMIT_KEYS)
        kw: dict = {"key": name}
        if "uids" in t:
            if not isinstance(t["uids"], list):
                raise ConfigError(f"{where}.uids: expected a list of uids")
            kw["uids"] = tuple(_int(v, f"{where}.uids[{i}]", 0, 2**32 - 2) for i, v in enumerate(t["uids"]))
        if "users" in t:
            kw["uids"] = kw.get("uids", ()) + _user_ids(t["users"], f"{where}.users")
        if "groups" in t:
            kw["gids"] = _group_ids(t["groups"], f"{where}.groups")
        for key in ("tokens", "roles"):
            if key in t:
                if not isinstance(t[key], list):
                    raise ConfigError(f"{where}.{key}: expected a list of names")
                kw[key] = tuple(_str(v, f"{where}.{key}[{i}]") for i, v in enumerate(t[key]))
        for i, role in enumerate(kw.get("roles", ())):
            if role not in ("client", "admin"):
                raise ConfigError(f"{where}.roles[{i}]: a v2 token's role is 'client' or 'admin', got {role[:20]!r}")
        for key in ("anonymous", "each_caller"):
            if key in t:
                if type(t[key]) is not bool:
                    raise ConfigError(f"{where}.{key}: expected true or false, got {t[key]!r}")
                kw[key] = t[key]
        if not (kw.get("uids") or kw.get("gids") or kw.get("tokens") or kw.get("roles") or kw.get("anonymous")
                or kw.get("each_caller")):
            raise ConfigError(f"{where}: names no caller; add {_RATE_WHO}")
        if "model" in t:
            kw["model"] = _str(t["model"], f"{where}.model")
        if "requests_per_s" in t:
            kw["requests_per_s"] = float(_num(t["requests_per_s"], f"{where}.requests_per_s", 0.001, 1e9))
        if "bytes_per_s" in t:
            kw["bytes_per_s"] = float(parse_size(t["bytes_per_s"], f"{where}.bytes_per_s"))
            if not kw["bytes_per_s"]:
                raise ConfigError(f"{where}.bytes_per_s: must be more than 0 (leave it out for no byte limit)")
        if "requests_per_s" not in kw and "bytes_per_s" not in kw:
            raise ConfigError(f"{where}: limits nothing; add requests_per_s = N and/or bytes_per_s = \"64MiB\"")
        if "burst" in t:
            if "requests_per_s" not in kw:
                raise ConfigError(f"{where}.burst: a burst of requests needs requests_per_s")
            kw["burst"] = float(_num(t["burst"], f"{where}.burst", 1, 1e9))
        elif "requests_per_s" in kw:
            kw["burst"] = max(1.0, kw["requests_per_s"])  # one second's requests
        if "burst_bytes" in t:
            if "bytes_per_s" not in kw:
                raise ConfigError(f"{where}.burst_bytes: a burst of bytes needs bytes_per_s")
            kw["burst_bytes"] = float(parse_size(t["burst_bytes"], f"{where}.burst_bytes"))
            if not kw["burst_bytes"]:
                raise ConfigError(f"{where}.burst_bytes: must be more than 0")
        elif "bytes_per_s" in kw:
            kw["burst_bytes"] = kw["bytes_per_s"]  # one second's bytes
        limits.append(RateLimit(**kw))
    return tuple(limits)


def _user_ids(names, where: str) -> tuple[int, ...]:
    """The uids of a list of user names; ConfigError naming ``where`` and a name no user has."""
    return _named_ids(names, where, "user")


# -- the KServe v2 front door (issue 13) --------------------------------------------------------

V2_KEYS = {"http", "grpc", "v2_system_shared_memory", "v2_tokens", "v2_anonymous", "max_buffered_bytes_per_uid",
           "max_grpc_read_bytes"}
# What server.v2_anonymous may grant (shmserve.v2.auth.ANONYMOUS_GRANTABLE: a test holds them equal).
V2_ANONYMOUS_SCOPES = ("metadata", "infer", "statistics")


def _v2(server: dict, base_dir: Path) -> dict:
    """The [server] keys of the v2 front door (ServerConfig says what each does)."""
    kw: dict = {}
    for key in ("http", "grpc"):
        if key in server:
            kw[key] = _str(server[key], f"server.{key}") or None
    if "v2_system_shared_memory" in server:
        if type(server["v2_system_shared_memory"]) is not bool:
            raise ConfigError("server.v2_system_shared_memory: expected true or false")
        kw["v2_system_shared_memory"] = server["v2_system_shared_memory"]
    if "v2_tokens" in server:
        path = _str(server["v2_tokens"], "server.v2_tokens")
        kw["v2_tokens"] = str(base_dir / path) if path else None
    if "v2_anonymous" in server:
        scopes = server["v2_anonymous"]
        if not isinstance(scopes, list):
            raise ConfigError(f"server.v2_anonymous: expected a list of {', '.join(V2_ANONYMOUS_SCOPES)}")
        for i, scope in enumerate(scopes):
            if scope in ("shared_memory", "repository"):
                raise ConfigError(f"server.v2_anonymous[{i}]: {scope!r} is never granted to anonymous callers (the "
                                  "server cannot tell who they are); give those callers a token (server.v2_tokens)")
            if scope not in V2_ANONYMOUS_SCOPES:
                raise ConfigError(f"server.v2_anonymous[{i}]: expected one of {', '.join(V2_ANONYMOUS_SCOPES)}, "
                                  f"got {str(scope)[:40]!r}")
        kw["v2_anonymous"] = tuple(dict.fromkeys(scopes))
    kw.update(_bounded(server, "server.", _int, (("max_buffered_bytes_per_uid", 1, 1 << 40),
                                                 ("max_grpc_read_bytes", 1, 1 << 40))))
    return kw


# -- model lifecycle (issue 12) ----------------------------------------------------------------

LIFECYCLE_KEYS = {"model_repository", "admin_uids", "admin_gids", "admin_groups", "max_workers",
                  "version_drain_timeout_s", "memory_budget"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(|B|KiB|MiB|GiB|TiB)\s*$")
_SIZE_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_size(value, where: str) -> int:
    """Bytes from an integer or a string like "512MiB" / "8 GiB"; ConfigError naming ``where``."""
    if type(value) is int and value >= 0:
        return value
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{where}: expected bytes (an integer, or a string like \"8GiB\"), got {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def _lifecycle(server: dict, base_dir: Path) -> dict:
    """The [server] keys of the model lifecycle (ServerConfig says what each does)."""
    kw: dict = {}
    if "model_repository" in server:
        root = (base_dir / _str(server["model_repository"], "server.model_repository")).resolve()
        if not root.is_dir():
            raise ConfigError(f"server.model_repository: no such directory {str(root)!r}")
        kw["model_repository"] = str(root)
    kw.update(_bounded(server, "server.", _int, (("max_workers", 1, 4096),)))
    kw.update(_bounded(server, "server.", lambda v, w, lo, hi: float(_num(v, w, lo, hi)), (
        ("version_drain_timeout_s", 0, 86400),)))
    if "admin_groups" in server:
        kw["admin_group_gids"] = _group_ids(server["admin_groups"], "server.admin_groups")
    if "memory_budget" in server:
        budget = server["memory_budget"]
        if not isinstance(budget, dict):
            raise ConfigError('server.memory_budget: expected a table like {cpu = "8GiB", "cuda:0" = "60GiB"}')
        for device in budget:
            if not _DEVICE_RE.match(device):
                raise ConfigError(f"server.memory_budget.{device}: expected 'cpu' or 'cuda:N' as the key")
        kw["memory_budget"] = tuple(sorted((d, parse_size(v, f"server.memory_budget.{d}")) for d, v in budget.items()))
    return kw


def _group_ids(names, where: str) -> tuple[int, ...]:
    """The gids of a list of group names (``allow_groups``, ``admin_groups``); ConfigError naming
    ``where`` and the index of a name no group on this machine has."""
    return _named_ids(names, where, "group")


def _named_ids(names, where: str, kind: str) -> tuple[int, ...]:
    """The ids of a list of ``kind`` ("user" or "group") names on this machine."""
    import grp
    import pwd

    if not isinstance(names, list):
        raise ConfigError(f"{where}: expected a list of {kind} names")
    look_up = (lambda n: pwd.getpwnam(n).pw_uid) if kind == "user" else (lambda n: grp.getgrnam(n).gr_gid)
    ids = []
    for i, name in enumerate(names):
        try:
            ids.append(look_up(_str(name, f"{where}[{i}]")))
        except KeyError:
            raise ConfigError(f"{where}[{i}]: no {kind} {name!r} on this machine") from None
    return tuple(ids)


_POLICY_HELP = 'expected {latest = N}, "all", or {versions = [1, 3]}'


def _version_policy(value, where: str) -> tuple[str, tuple[int, ...]]:
    if value == "all":
        return ("all", ())
    if isinstance(value, dict) and set(value) == {"latest"}:
        return ("latest", (_int(value["latest"], f"{where}.latest", 1, 1 << 20),))
    if isinstance(value, dict) and set(value) == {"versions"} and isinstance(value["versions"], list) \
            and value["versions"]:
        versions = tuple(_int(v, f"{where}.versions[{i}]", 1, 2**31 - 1) for i, v in enumerate(value["versions"]))
        if len(set(versions)) != len(versions):
            raise ConfigError(f"{where}.versions: a version is listed twice")
        return ("specific", tuple(sorted(versions)))
    raise ConfigError(f"{where}: {_POLICY_HELP}, got {value!r}")


def _lifecycle_model(m: dict, where: str, base_dir: Path | None) -> dict:
    """A model's lifecycle keys: version_policy, load, pinned, warmup (``base_dir`` None: warm-up
    files are kept as written, not looked for)."""
    kw: dict = {}
    if "version_policy" in m:
        kw["version_policy"] = _version_policy(m["version_policy"], f"{where}.version_policy")
    if "load" in m:
        if m["load"] not in ("startup", "on_demand"):
            raise ConfigError(f"{where}.load: expected 'startup' or 'on_demand', got {m['load']!r}")
        kw["load"] = m["load"]
    if "pinned" in m:
        if type(m["pinned"]) is not bool:
            raise ConfigError(f"{where}.pinned: expected true or false, got {m['pinned']!r}")
        kw["pinned"] = m["pinned"]
    if "warmup" in m:
        warm = m["warmup"]
        if not isinstance(warm, dict):
            raise ConfigError(f"{where}.warmup: expected a table like {{requests = 2, inputs = {{x = \"x.npy\"}}}}")
        _keys(warm, f"{where}.warmup.", {"requests", "inputs", "batch_sizes"})
        if "requests" in warm:
            kw["warmup_requests"] = _int(warm["requests"], f"{where}.warmup.requests", 0, 1000)
        if "inputs" in warm:
            if not isinstance(warm["inputs"], dict):
                raise ConfigError(f"{where}.warmup.inputs: expected a table of input name = .npy file")
            files = []
            for name, file in warm["inputs"].items():
                if base_dir is None:
                    files.append((name, _str(file, f"{where}.warmup.inputs.{name}")))
                    continue
                resolved = (base_dir / _str(file, f"{where}.warmup.inputs.{name}")).resolve()
                if not resolved.is_file():
                    raise ConfigError(f"{where}.warmup.inputs.{name}: no such file {str(resolved)!r}")
                files.append((name, str(resolved)))
            kw["warmup_inputs"] = tuple(files)
        if "batch_sizes" in warm:
            sizes = warm["batch_sizes"]
            if not isinstance(sizes, list) or not sizes:
                raise ConfigError(f"{where}.warmup.batch_sizes: expected a list of batch sizes")
            kw["warmup_batch_sizes"] = tuple(sorted({_int(v, f"{where}.warmup.batch_sizes[{j}]", 1, 1 << 16)
                                                    for j, v in enumerate(sizes)}))
    return kw


# -- what one client can make the server hold -----------------------------------------------

CLIENT_LIMIT_KEYS = ("max_connections", "max_connections_per_uid", "max_inflight_per_connection", "max_inflight_per_uid",
                     "max_inflight_bytes_per_connection", "stall_timeout_s", "frame_timeout_s", "upload_timeout_s")


def _client_limits(server: dict) -> dict:
    """The [server] keys that bound what one client can make the server hold (ServerConfig says why)."""
    kw = _bounded(server, "server.", _int, (
        ("max_connections", 1, 1 << 20), ("max_connections_per_uid", 1, 1 << 20),
        ("max_inflight_per_connection", 1, 1 << 16), ("max_inflight_per_uid", 1, 1 << 20),
        ("max_inflight_bytes_per_connection", 1, 1 << 40)))
    kw.update(_bounded(server, "server.", lambda v, w, lo, hi: float(_num(v, w, lo, hi)), (
        ("stall_timeout_s", 0.01, 3600), ("frame_timeout_s", 0.01, 3600), ("upload_timeout_s", 0.01, 3600))))
    return kw


MODEL_LIFECYCLE_KEYS = ("version_policy", "load", "pinned", "warmup")


def _model(m, where: str, base_dir: Path | None) -> ModelConfig:
    """One [[models]] table.  ``base_dir`` None (a repository's config.toml, whose files lie in each
    version's directory): ``path`` and warm-up files are checked for form only, not looked for."""
    if not isinstance(m, dict):
        raise ConfigError(f"{where}: expected a table")
    _keys(m, f"{where}.", {"name", "backend", "path", "device", "instances", "max_batch_size",
                           "max_queue_delay_us", "max_output_bytes", "io_mode", "inputs", "outputs", "options",
                           "preferred_batch_sizes", "check_dims", "cpus", "cpus_per_worker",
                           *MODEL_LIFECYCLE_KEYS, *SCHEDULING_KEYS})
    for key in ("name", "backend", "path"):
        if key not in m:
            raise ConfigError(f"{where}.{key}: required")
    name = _str(m["name"], f"{where}.name")
    if not re.match(r"^[A-Za-z0-9_.:-]{1,128}$", name):
        raise ConfigError(f"{where}.name: {name!r} must be 1-128 of A-Z a-z 0-9 _ . : -")
    backend = _str(m["backend"], f"{where}.backend")
    path = _str(m["path"], f"{where}.path")
    _check_backend(backend, path, where, base_dir)
    if base_dir is not None and backend != "python" and ":" not in path.split("/")[0]:
        resolved = (base_dir / path).resolve()
        if not resolved.is_file():
            raise ConfigError(f"{where}.path: no such file {str(resolved)!r}")
        path = str(resolved)
    devices = _devices(m.get("device", "cpu"), f"{where}.device")
    kw = dict(name=name, backend=backend, path=path, device=devices[0],
              base_dir=str(base_dir.resolve()) if base_dir is not None else "")
    if len(devices) > 1:
        kw["devices"] = devices
    kw.update(_cpus(m, where))
    if "io_mode" in m:
        kw["io_mode"] = _str(m["io_mode"], f"{where}.io_mode")
        if kw["io_mode"] not in ("copy", "mapped"):
            raise ConfigError(f"{where}.io_mode: expected 'copy' or 'mapped', got {kw['io_mode']!r}")
    kw.update(_bounded(m, f"{where}.", _int, (
        ("instances", 1, 64), ("max_batch_size", 0, 1 << 16), ("max_queue_delay_us", 0, 10_000_000),
        ("max_output_bytes", 0, 1 << 36))))
    for key in ("inputs", "outputs"):
        if key in m:
            tensors = m[key]
            if not isinstance(tensors, list):
                raise ConfigError(f"{where}.{key}: expected a list of {{name, dtype, shape}} tables")
            specs = []
            for j, t in enumerate(tensors):
                if not isinstance(t, dict) or set(t) != {"name", "dtype", "shape"} or not isinstance(t["shape"], list):
                    raise ConfigError(f"{where}.{key}[{j}]: expected {{name, dtype, shape}}")
                try:
                    specs.append(TensorSpec.from_dict(t))
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"{where}.{key}[{j}]: {exc}") from None
            kw[key] = tuple(specs)
    if "preferred_batch_sizes" in m:
        sizes = m["preferred_batch_sizes"]
        if not isinstance(sizes, list):
            raise ConfigError(f"{where}.preferred_batch_sizes: expected a list of batch sizes")
        kw["preferred_batch_sizes"] = tuple(_int(v, f"{where}.preferred_batch_sizes[{j}]", 1, 1 << 16)
                                            for j, v in enumerate(sizes))
    if "check_dims" in m:
        kw["check_dims"] = _check_dims(m["check_dims"], f"{where}.check_dims")
    if "options" in m:
        if not isinstance(m["options"], dict):
            raise ConfigError(f"{where}.options: expected a table")
        kw["options"] = dict(m["options"])
    kw.update(_lifecycle_model(m, where, base_dir))
    kw.update(_scheduling(m, where))
    return ModelConfig(**kw)


# -- scheduling (issue 29): priorities, fairness and the queue policy ---------------------------

SCHEDULING_KEYS = ("priority_levels", "default_priority_level", "priority_starvation_limit", "fairness",
                   "default_queue_policy")
QUEUE_POLICY_KEYS = {"max_queue_size", "default_timeout_microseconds", "timeout_action", "allow_timeout_override"}
FAIRNESS = ("callers", "arrival")
TIMEOUT_ACTIONS = ("reject", "delay")


def _scheduling(m: dict, where: str) -> dict:
    """``priority_levels``, ``default_priority_level``, ``priority_starvation_limit``, ``fairness``
    and the ``[models.default_queue_policy]`` table (Triton's names; docs/config.md)."""
    kw = _bounded(m, f"{where}.", _int, (
        ("priority_levels", 0, layout.SCHED_LEVELS), ("priority_starvation_limit", 1, 1 << 20)))
    levels = kw.get("priority_levels", 0)
    if "default_priority_level" in m:
        kw["default_priority_level"] = _int(m["default_priority_level"], f"{where}.default_priority_level",
                                            0, max(levels, 0))
        if kw["default_priority_level"] and not levels:
            raise ConfigError(f"{where}.default_priority_level: set priority_levels first (1-{layout.SCHED_LEVELS})")
    if "fairness" in m:
        kw["fairness"] = _str(m["fairness"], f"{where}.fairness")
        if kw["fairness"] not in FAIRNESS:
            raise ConfigError(f"{where}.fairness: expected one of {', '.join(map(repr, FAIRNESS))}, "
                              f"got {kw['fairness']!r}")
    if "default_queue_policy" in m:
        q, qw = m["default_queue_policy"], f"{where}.default_queue_policy"
        if not isinstance(q, dict):
            raise ConfigError(f"{qw}: expected a table with {', '.join(sorted(QUEUE_POLICY_KEYS))}")
        _keys(q, f"{qw}.", QUEUE_POLICY_KEYS)
        if "max_queue_size" in q:
            kw["max_queue_size"] = _int(q["max_queue_size"], f"{qw}.max_queue_size", 0, 1 << 24)
        if "default_timeout_microseconds" in q:
            kw["default_timeout_us"] = _int(q["default_timeout_microseconds"], f"{qw}.default_timeout_microseconds",
                                            0, 86_400_000_000)
        if "timeout_action" in q:
            action = _str(q["timeout_action"], f"{qw}.timeout_action").lower()
            if action not in TIMEOUT_ACTIONS:
                raise ConfigError(f"{qw}.timeout_action: expected 'reject' or 'delay', got {q['timeout_action']!r}")
            kw["timeout_action"] = action
        if "allow_timeout_override" in q:
            if not isinstance(q["allow_timeout_override"], bool):
                raise ConfigError(f"{qw}.allow_timeout_override: expected true or false")
            kw["allow_timeout_override"] = q["allow_timeout_override"]
    return kw


# -- placement: devices and CPUs (issue 14, part 4) ------------------------------------------

_DEVICE_HELP = "expected 'cpu' or 'cuda:N', or a list of distinct 'cuda:N' like [\"cuda:0\", \"cuda:1\"]"
_CPUS_HELP = 'a Linux cpulist like "0-3" or "0,2,4-7", "auto" (the default) or "inherit" (never pinned)'


def _devices(value, where: str) -> tuple[str, ...]:
    """``device``: one device, or a list of distinct GPUs the model's workers are spread over."""
    values = value if isinstance(value, list) else [value]
    if not values or len(values) > 64:
        raise ConfigError(f"{where}: {_DEVICE_HELP}, got {value!r}")
    for i, d in enumerate(values):
        if not isinstance(d, str) or not _DEVICE_RE.match(d):
            raise ConfigError(f"{where}{f'[{i}]' if isinstance(value, list) else ''}: {_DEVICE_HELP}, got {d!r}")
    if isinstance(value, list) and len(values) > 1:
        if "cpu" in values:
            raise ConfigError(f"{where}: a list names GPUs only ('cpu' is one device already), got {value!r}")
        if len(set(values)) != len(values):
            raise ConfigError(f"{where}: a device is listed twice in {value!r}")
    return tuple(values)


def _cpus(m: dict, where: str) -> dict:
    """``cpus`` and ``cpus_per_worker``: the cpulist checked against this machine's online CPUs and
    the CPUs this process may use (the workers inherit that limit), stored canonical."""
    kw: dict = {}
    if "cpus" in m:
        value = m["cpus"]
        if not isinstance(value, str):
            raise ConfigError(f"{where}.cpus: expected {_CPUS_HELP}, got {value!r}")
        if value.strip() == "auto":
            pass
        elif value.strip() == "inherit":
            kw["cpus"] = placement.INHERIT
        else:
            try:
                cpus = placement.parse_cpulist(value)
            except ValueError as exc:
                raise ConfigError(f"{where}.cpus: {exc}; expected {_CPUS_HELP}") from None
            if not cpus:
                raise ConfigError(f"{where}.cpus: names no CPU; expected {_CPUS_HELP}")
            online = placement.online_cpus()
            if cpus - online:
                raise ConfigError(f"{where}.cpus: CPU {placement.format_cpulist(cpus - online)} not on this machine "
                                  f"(online: {placement.format_cpulist(online)}, /sys/devices/system/cpu/online); "
                                  f"name CPUs it has")
            allowed = placement.allowed_cpus()
            if cpus - allowed:
                raise ConfigError(f"{where}.cpus: CPU {placement.format_cpulist(cpus - allowed)} not among the CPUs "
                                  f"this server may use ({placement.format_cpulist(allowed)}: its affinity, narrowed "
                                  f"by taskset, a cgroup cpuset or systemd's CPUAffinity=); name CPUs within it, "
                                  f"or widen the server's")
            kw["cpus"] = placement.format_cpulist(cpus)
    if "cpus_per_worker" in m:
        kw["cpus_per_worker"] = _int(m["cpus_per_worker"], f"{where}.cpus_per_worker", 0, placement.MAX_CPU)
        if kw["cpus_per_worker"] and kw.get("cpus") == placement.INHERIT:
            raise ConfigError(f"{where}.cpus_per_worker: needs a CPU set to split, and cpus = \"inherit\" pins "
                              f"nothing; drop one of them")
        if kw.get("cpus", placement.AUTO) not in (placement.AUTO, placement.INHERIT) \
                and kw["cpus_per_worker"] > len(placement.parse_cpulist(kw["cpus"])):
            raise ConfigError(f"{where}.cpus_per_worker: {kw['cpus_per_worker']} is more than the "
                              f"{len(placement.parse_cpulist(kw['cpus']))} CPU(s) of cpus = \"{kw['cpus']}\"")
    return kw


# -- backends and python models, checked when the file is read (issue 15) ------------------

_PYTHON_PATH_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def _check_backend(backend: str, path: str, where: str, base_dir: Path | None) -> None:
    """ConfigError for a backend name no loader answers to (listing those that exist), and for a
    python model's ``path`` that is not ``module:callable`` or whose top-level module is in none
    of the config file's directory (``base_dir``; None: not looked for), the current one and the
    Python path.  Imports nothing (a top-level module is found, not run)."""
    available = backend_names()
    if backend not in available:
        raise ConfigError(f"{where}.backend: no backend {backend!r} (available: {', '.join(available)})")
    if backend != "python":
        return
    if not _PYTHON_PATH_RE.match(path):
        raise ConfigError(f"{where}.path: a python model is 'module:callable' (e.g. 'mymodels:make'), "
                          f"got {path!r}")
    if base_dir is None:
        return
    top = path.partition(":")[0].split(".")[0]
    here = base_dir.resolve()
    # The order a worker searches (workers.backends.python): this directory, its current one, the Python path.
    if not (any((d / f"{top}.py").is_file() or (d / top).is_dir() for d in (here, Path.cwd()))
            or importlib.util.find_spec(top)):
        raise ConfigError(f"{where}.path: no module {top!r} in {str(here)!r} (the config file's directory), "
                          f"the current directory or the Python path")


def _check_dims(value, where: str) -> tuple[str, ...]:
    """The ``check_dims`` list: distinct dimension names, none a placeholder (``?``, ``None``)."""
    if not isinstance(value, list) or len(value) > 64:
        raise ConfigError(f"{where}: expected a list of up to 64 dimension names, e.g. [\"batch\"]")
    names = tuple(_str(v, f"{where}[{i}]") for i, v in enumerate(value))
    for i, name in enumerate(names):
        if name in PLACEHOLDER_DIMS:
            raise ConfigError(f"{where}[{i}]: {name!r} is a placeholder for an unknown size, never checked")
        if name in names[:i]:
            raise ConfigError(f"{where}[{i}]: {name!r} is listed twice")
    return names


def _bounded(table: dict, prefix: str, convert, bounds) -> dict:
    """The keys of ``bounds`` (key, lo, hi) present in ``table``, each checked by ``convert``."""
    return {key: convert(table[key], f"{prefix}{key}", lo, hi) for key, lo, hi in bounds if key in table}


def _keys(table: dict, prefix: str, allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}: unknown key (allowed: {', '.join(sorted(allowed))})")


def _table(raw: dict, key: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table")
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _int(value, where: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ConfigError(f"{where}: expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _num(value, where: str, lo: float, hi: float) -> float:
    if type(value) not in (int, float) or not lo <= value <= hi:
        raise ConfigError(f"{where}: expected a number in [{lo}, {hi}], got {value!r}")
    return value


def _bad(message: str):
    raise ConfigError(message)
