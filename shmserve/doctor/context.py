"""What the checks look at: the host, the GPUs, the instance, and the settings it runs with.

Owns: ``Context`` (one run's facts, handed to every check), ``Settings`` (the
limits and models that the checks measure the host against: from a live
server's ``info`` and ``models`` answers, else a config file, else the
defaults), ``Service`` (an instance: its arena through
``shmserve.inspection``, and a live server's ``info``, ``models`` and
``repository`` answers over its socket) and ``WorkerView`` (one worker, the
arena's record joined with the server's answer).

Must not: judge anything (the checks do), write anything, or import CUDA or a
model runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from shmserve.doctor.gpu import GpuFacts
from shmserve.doctor.host import Host

STATUS_TIMEOUT_S = 5.0  # a live server answers its control questions at once; a wedged one is a finding


@dataclass(frozen=True)
class ModelFacts:
    """One configured model as the checks need it."""

    name: str
    backend: str
    path: str
    devices: tuple[str, ...]
    instances: int
    cpus: str | None = None  # the config's cpus ("auto", "inherit", a cpulist); None: not known here
    intra_op_threads: int | None = None  # onnxruntime's option, when the config is read


@dataclass
class Settings:
    """The instance's limits and models, and where they were read (``source``)."""

    source: str
    arena_bytes: int
    max_connections: int
    max_regions: int
    max_region_bytes_per_connection: int
    max_region_bytes_per_uid: int
    spin_us: int
    memory_budget: dict[str, int]
    models: list[ModelFacts] = field(default_factory=list)
    max_regions_per_uid: int = 256
    v2_system_shared_memory: bool = False  # v2 clients' registrations each hold a descriptor in the front-end
    descriptors: dict[str, int] = field(default_factory=dict)  # ServerConfig.descriptor_budget: what holds them

    @classmethod
    def from_config(cls, config, source: str) -> "Settings":
        """From a ``ServerConfig``: the arena it would create (its size planned as ``serve`` does)."""
        from shmserve import arena, layout

        workers = max(config.max_workers, sum(m.instances for m in config.models))  # as server.Frontend._build
        geometry = layout.plan(slot_count=config.arena_slots, size_classes=config.arena_size_classes(),
                               max_workers=workers, ring_capacity=arena.default_ring_capacity(config.arena_slots),
                               max_regions=config.max_regions)
        models = [ModelFacts(m.name, m.backend, m.path, tuple(m.placement_devices), m.instances, m.cpus,
                             _int(m.options.get("intra_op_threads")) if m.backend == "onnxruntime" else None)
                  for m in config.models]
        return cls(source, geometry.total_size, config.max_connections, config.max_regions,
                   config.max_region_bytes_per_connection, config.max_region_bytes_per_uid,
                   config.effective_spin_us(), dict(config.memory_budget), models, config.max_regions_per_uid,
                   config.v2_system_shared_memory, config.descriptor_budget())

    @classmethod
    def from_status(cls, info: dict, listing: list[dict], fallback: "Settings") -> "Settings":
        """From a live server's ``info`` (its ``limits``; a server older than them: ``fallback``'s)
        and ``models`` answers."""
        limits = info.get("limits") or {}
        models = [ModelFacts(m["name"], m.get("backend", "?"), m.get("path") or "",
                             tuple(m.get("devices") or [m.get("device", "cpu")]), int(m.get("instances") or 1))
                  for m in listing if isinstance(m, dict) and "name" in m]
        return cls("the live server's info and models answers" if limits else
                   f"the live server's models answer; limits from {fallback.source} (the server does not "
                   f"report them)", int((info.get("arena") or {}).get("size") or fallback.arena_bytes),
                   int(limits.get("max_connections", fallback.max_connections)),
                   int(limits.get("max_regions", fallback.max_regions)),
                   int(limits.get("max_region_bytes_per_connection", fallback.max_region_bytes_per_connection)),
                   int(limits.get("max_region_bytes_per_uid", fallback.max_region_bytes_per_uid)),
                   int(limits.get("spin_us", fallback.spin_us)),
                   {str(k): int(v) for k, v in (limits.get("memory_budget") or fallback.memory_budget).items()},
                   models or fallback.models, int(limits.get("max_regions_per_uid", fallback.max_regions_per_uid)),
                   bool(limits.get("v2_system_shared_memory", fallback.v2_system_shared_memory)),
                   {str(k): int(v) for k, v in (limits.get("descriptors") or fallback.descriptors).items()})

    def gpu_models(self) -> list[ModelFacts]:
        return [m for m in self.models if any(d.startswith("cuda") for d in m.devices)]


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class Service:
    """One instance: ``state`` "live" (its front-end answers), "dead" (an arena whose owner is gone,
    or that does not answer: ``why``), "none" (no arena) or "unreadable" (``why``)."""

    instance: str
    state: str
    why: str | None = None
    snapshot: dict | None = None  # shmserve.inspection.snapshot
    info: dict | None = None
    models: list | None = None
    repository: dict | None = None

    @property
    def live(self) -> bool:
        return self.state == "live"

    def workers(self) -> list["WorkerView"]:
        """Every worker in the arena's table, with what the live server says of it."""
        by_index = {w["index"]: w for w in (self.info or {}).get("workers", []) if isinstance(w, dict)}
        out = []
        for w in (self.snapshot or {}).get("workers", []):
            extra = by_index.get(w["index"], {})
            out.append(WorkerView(w["index"], w["model"], w.get("version") or 0, w["device"], w["pid"], w["state"],
                                  bool(w.get("alive")), w.get("cpus"), extra.get("cpus_from"),
                                  extra.get("threads"), extra.get("signatures"), w.get("requests", 0),
                                  w.get("restarts", 0), w.get("crash_streak", 0), w.get("heartbeat_age_s"),
                                  extra.get("last_exit")))
        if not out:  # no arena read (another user's, say): the server's answer alone
            for w in by_index.values():
                out.append(WorkerView(w["index"], w["model"], w.get("version") or 0, w["device"], w.get("pid") or 0,
                                      w["state"], w.get("pid") is not None, None, w.get("cpus_from"),
                                      w.get("threads"), w.get("signatures"), w.get("requests", 0),
                                      w.get("restarts", 0), w.get("crash_streak", 0), None, w.get("last_exit")))
        return out


@dataclass(frozen=True)
class WorkerView:
    index: int
    model: str
    version: int
    device: str
    pid: int
    state: str
    alive: bool
    pinned: str | None  # the cpulist it was pinned to (the arena's worker table; None: not pinned)
    cpus_from: str | None  # why those (the live server's answer)
    threads: dict | None  # its runtime's thread pools, as the worker reported them when ready
    signatures: dict | None  # input signatures it has seen: {"distinct": n, "new": n}
    requests: int
    restarts: int
    crash_streak: int
    heartbeat_age_s: float | None
    last_exit: str | None

    @property
    def who(self) -> str:
        return f"worker {self.index} ({self.model}" + (f" v{self.version}" if self.version else "") + \
               f", {self.device}, pid {self.pid})"


@dataclass
class Context:
    """One run's facts: the host under its root, the GPUs, the instance and its settings, and how
    long to watch counters that grow (``sample_s``; 0: read them once)."""

    host: Host
    gpus: GpuFacts
    service: Service
    settings: Settings
    sample_s: float = 0.0
    sleep: object = None  # time.sleep, or None for no second reading

    def service_pid(self) -> tuple[int | None, str]:
        """The process whose limits and cgroup are the service's: the live front-end, else this
        process (a ``shmserve serve`` started here inherits them), and how it is named."""
        snap = self.service.snapshot or {}
        if self.service.live and snap.get("owner_pid"):
            return snap["owner_pid"], f"the front-end (pid {snap['owner_pid']})"
        own = self.host.own_pid()
        return own, (f"this shell's process (pid {own}): no live server; a 'shmserve serve' started from here "
                     f"gets these")

    def server_environ(self) -> dict[str, str]:
        """The live front-end's environment (its CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER decide
        what cuda:N is), else doctor's own."""
        snap = self.service.snapshot or {}
        proc = self.host.process(snap["owner_pid"]) if self.service.live and snap.get("owner_pid") else None
        env = proc.environ() if proc is not None else None
        return env if env is not None else dict(os.environ)
