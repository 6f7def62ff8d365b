"""`shmserve doctor`: why a service got slow, from the host to the model, and the fix.

Owns: the table of checks (``CHECKS``: id, area, what it looks at, the
function), gathering one run's facts (``gather``: the host under a root
directory, ``nvidia-smi``, the instance's arena and a live server's answers,
the settings) and running every check over them (``run``), each in
isolation: a check that cannot look is skipped with why, one that fails is
reported, and neither stops the others.

Layers: operations, beside ``shmserve.inspection`` (which it reads the arena
through).  Modules: ``host`` (files under the root), ``gpu`` (nvidia-smi and
TensorRT engines), ``context`` (the facts), ``checks_host``,
``checks_placement``, ``checks_gpu``, ``checks_service`` (the judgements),
``findings`` (what a run says, its JSON schema and its table).

Must not: change anything anywhere (it only reads files, runs ``nvidia-smi``
to query, and asks a live server read-only questions), import CUDA or a model
runtime, or raise for what it finds on the machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from shmserve.doctor import checks_gpu, checks_host, checks_placement, checks_service
from shmserve.doctor.context import STATUS_TIMEOUT_S, Context, Service, Settings
from shmserve.doctor.findings import CRITICAL, INFO, SEVERITIES, WARNING, CheckResult, Finding, Report
from shmserve.doctor.gpu import GpuFacts, find_nvidia_smi, query
from shmserve.doctor.host import Host

__all__ = ["CHECKS", "CRITICAL", "INFO", "SEVERITIES", "WARNING", "Check", "Context", "Finding", "Report",
           "gather", "run", "run_checks"]


@dataclass(frozen=True)
class Check:
    id: str
    title: str
    run: Callable[[Context], list[Finding]]


CHECKS = (
    Check("host.cgroup_cpu", "the CPU quota and throttling of the service's cgroup", checks_host.cgroup_cpu),
    Check("host.cpufreq", "the CPU frequency governor", checks_host.cpufreq),
    Check("host.smt", "SMT siblings shared by a worker and a spinning client", checks_host.smt),
    Check("host.thp", "transparent huge pages", checks_host.thp),
    Check("host.memlock", "memlock against the page-locked arena and regions", checks_host.memlock),
    Check("host.shm", "/dev/shm size and free space against the arena", checks_host.shm),
    Check("host.fds", "the descriptor limit against connections and regions", checks_host.fds),
    Check("placement.numa", "each GPU worker's CPUs against its GPU's local CPUs", checks_placement.numa),
    Check("placement.threads", "thread pools against the CPUs each worker owns", checks_placement.threads),
    Check("placement.frontend", "the front-end and door processes beside spinning workers",
          checks_placement.frontend),
    Check("gpu.nvidia_smi", "whether the GPUs answer nvidia-smi", checks_gpu.nvidia_smi),
    Check("gpu.persistence", "persistence mode", checks_gpu.persistence),
    Check("gpu.clocks", "clocks and throttle reasons", checks_gpu.clocks),
    Check("gpu.pcie", "the PCIe link, current against maximum", checks_gpu.pcie),
    Check("gpu.ecc", "ECC errors and row remapping", checks_gpu.ecc),
    Check("gpu.memory", "GPU memory against memory_budget", checks_gpu.memory),
    Check("gpu.engines", "TensorRT engines against the TensorRT, CUDA and GPU here", checks_gpu.engines),
    Check("service.stages", "which stage dominates each model's latency, against the last hour",
          checks_service.stages),
    Check("service.shapes", "models whose inputs arrive in many shapes", checks_service.shapes),
    Check("service.workers", "crash loops, wedged workers, restarts, unavailable models", checks_service.workers),
    Check("service.canaries", "canaries running or rolled back", checks_service.canaries),
    Check("service.evictions", "evictions thrashing", checks_service.evictions),
    Check("service.starved", "clients refused or timed out", checks_service.starved),
)


def run_checks(ctx: Context, checks=CHECKS) -> tuple[list[CheckResult], list[Finding]]:
    """Every check over ``ctx``: (what ran, what it found).  Never raises for a check."""
    results, findings = [], []
    for check in checks:
        try:
            found = check.run(ctx)
        except checks_host.Skip as skip:
            results.append(CheckResult(check.id, check.title, False, skipped=str(skip)))
            continue
        except Exception as exc:  # a bug in a check: said, and the others still run
            results.append(CheckResult(check.id, check.title, False, error=f"{type(exc).__name__}: {exc}"))
            continue
        results.append(CheckResult(check.id, check.title, True))
        findings.extend(found)
    return results, findings


def gather(instance: str, *, root: str = "/", config_path: str | None = None, socket: str | None = None,
           nvidia_smi: str | None = None, path: str | None = None) -> tuple[Service, Settings, GpuFacts, dict]:
    """One run's facts: the instance (its arena; a live one's answers), the settings, the GPUs,
    and what was read from where (``sources``).  ``config_path``: the settings when no server
    answers (else the defaults); ``nvidia_smi``: the program to ask (else the one on ``path``,
    default $PATH).  Raises ConfigError for a config file that does not parse."""
    from shmserve import config as cfg

    fallback = Settings.from_config(cfg.load(config_path, instance=instance), f"the config {config_path}") \
        if config_path else Settings.from_config(cfg.demo_config(instance), "the defaults (no --config, no live server)")
    service = read_service(instance, socket)
    settings = fallback
    if service.live and service.info is not None:
        settings = Settings.from_status(service.info, service.models or [], fallback)
    elif service.snapshot is not None:  # a dead instance: its arena is as large as it is
        settings.arena_bytes = int(service.snapshot["size"])
    gpus = query(nvidia_smi or find_nvidia_smi(path))
    sources = {"arena": service.snapshot.get("arena") if service.snapshot else None,
               "server_why": service.why, "settings": settings.source,
               "nvidia_smi": gpus.command, "nvidia_smi_error": gpus.error, "nvidia_smi_dropped": gpus.dropped,
               "cuda_version": gpus.cuda_version, "tensorrt": list(gpus.tensorrt) if gpus.tensorrt else None}
    return service, settings, gpus, sources


def read_service(instance: str, socket: str | None = None) -> Service:
    """The instance as its arena (``shmserve.inspection``) and, if its front-end lives, its socket
    (``info``, ``models``, ``repository``) show it."""
    from shmserve import inspection
    from shmserve.arena import ArenaError, ArenaNotFound
    from shmserve.client import Client
    from shmserve.config import resolve_socket
    from shmserve.errors import ShmserveError

    service = Service(instance, "none")
    try:
        service.snapshot = inspection.snapshot(instance)
    except ArenaNotFound:
        service.why = f"no arena /dev/shm/shmserve.{instance}"
    except (ArenaError, OSError) as exc:  # another user's arena (0600), or not one of ours
        service.state, service.why = "unreadable", f"the arena cannot be read: {exc}"
    snap = service.snapshot
    if snap is not None:
        service.state = "live" if snap["owner_alive"] else "dead"
        if not snap["owner_alive"]:
            service.why = f"front-end pid {snap['owner_pid']} is gone"
            return service
    if snap is None and service.state == "none":
        return service
    where = socket or (snap or {}).get("socket") or resolve_socket(None, None, instance)
    try:
        with Client(where, timeout=STATUS_TIMEOUT_S, instance=instance) as client:
            service.info, service.models, service.repository = client.info(), client.models(), client.repository()
        service.state = "live"
    except (ShmserveError, OSError, ValueError) as exc:
        if snap is not None:
            service.state, service.why = "dead", f"its front-end lives but does not answer at {where}: {exc}"
    return service


def run(instance: str = "default", *, root: str = "/", config_path: str | None = None, socket: str | None = None,
        nvidia_smi: str | None = None, path: str | None = None, sample_s: float = 0.0,
        checks=CHECKS) -> Report:
    """Gather the facts and run every check: the Report.  Raises ConfigError for a bad ``config_path``."""
    from shmserve import __version__

    service, settings, gpus, sources = gather(instance, root=root, config_path=config_path, socket=socket,
                                              nvidia_smi=nvidia_smi, path=path)
    ctx = Context(Host(root), gpus, service, settings, sample_s, time.sleep if sample_s > 0 else None)
    results, findings = run_checks(ctx, checks)
    return Report(__version__, instance, service.state, time.time(), str(root), sources, results, findings)
