"""Host checks: CPU quota and throttling, frequency governor, SMT siblings, huge pages, memlock,
/dev/shm, descriptors.

Owns: the judgement of each (``Check`` in ``shmserve.doctor.checks``): what is
measured, against what, how severe, and the fix.  Each function takes the
run's ``Context`` and returns ``Finding``s, or raises ``Skip`` saying why it
cannot look.

Must not: read a file except through ``ctx.host`` (one root directory), or
run a program.
"""

from __future__ import annotations

from shmserve.doctor.context import Context
from shmserve.doctor.findings import CRITICAL, INFO, WARNING, Finding
from shmserve.doctor.host import CAP_IPC_LOCK
from shmserve.placement import format_cpulist

THROTTLED_SHARE = 0.01  # throttled in more than 1 % of the periods measured: latency is being added
MIN_PERIODS = 20  # fewer periods than this say nothing about a share
SHM_HEADROOM = 0.10  # a live /dev/shm with less than this share free (and under 1 GiB) is near full
FD_SPARE = 64  # descriptors a front-end holds besides connections and regions (listeners, eventfds, logs)
SPINNING_GOVERNORS_OK = ("performance",)


class Skip(Exception):
    """The check cannot look (no such facility here, no live server): why."""


def size(n: float | int | None) -> str:
    """Bytes for people: "192 MiB", "1.5 GiB"; "unlimited" for None."""
    if n is None:
        return "unlimited"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) or value >= 100 else f"{value:.1f} {unit}"
    return f"{int(n)} B"


# -- the CPU quota of the service's cgroup ------------------------------------------------------

def cgroup_cpu(ctx: Context) -> list[Finding]:
    pid, whose = ctx.service_pid()
    if pid is None:
        raise Skip("no process to read a cgroup of (no live server, and no proc/self under the root)")
    quotas, stat = ctx.host.cgroup_cpu(pid)
    if stat is None and not quotas:
        raise Skip(f"no CPU controller for {whose} in proc/{pid}/cgroup and proc/mounts")
    found = []
    proc = ctx.host.process(pid)
    allowed = (proc.allowed_cpus if proc else None) or ctx.host.online_cpus()
    tightest = min(quotas, key=lambda q: q.cpus) if quotas else None
    subject = f"cgroup {stat.path if stat else tightest.path} of {whose}"
    if tightest is not None and tightest.cpus < len(allowed):
        found.append(Finding(
            "host.cgroup_cpu", WARNING, f"a CPU quota of {tightest.cpus:g} CPUs, below the {len(allowed)} CPUs the "
            f"service may run on", subject,
            f"{tightest.quota_us} us per {tightest.period_us} us = {tightest.cpus:g} CPUs ({tightest.source}, cgroup "
            f"{tightest.path})", f"no quota, or at least the {len(allowed)} CPUs of its affinity "
            f"({format_cpulist(allowed)})",
            "Thread pools size themselves from the CPUs a process may run on, not from its quota: once their "
            "threads have used the quota the kernel stops the whole cgroup until the next period (throttling), "
            "which adds up to a period (100 ms by default) to whatever request is running.",
            f"raise or remove the quota (systemd: 'CPUQuota=' in the [Service] section, or 'systemctl set-property "
            f"shmserve.service CPUQuota={len(allowed) * 100}%'; Docker: --cpus; Kubernetes: resources.limits.cpu), "
            f"or pin the service to as many CPUs as its quota ('CPUAffinity=' / the models' cpus) so the pools "
            f"fit it", {"quota_cpus": tightest.cpus, "allowed_cpus": len(allowed), "cgroup": tightest.path}))
    if stat is not None:
        first = stat
        grown = None
        if ctx.sample_s > 0 and ctx.sleep is not None:
            ctx.sleep(ctx.sample_s)
            _, second = ctx.host.cgroup_cpu(pid)
            if second is not None and second.periods >= first.periods:
                grown = (second.periods - first.periods, second.throttled - first.throttled,
                         second.throttled_us - first.throttled_us)
        share = first.throttled / first.periods if first.periods >= MIN_PERIODS else 0.0
        recent = grown[1] / grown[0] if grown and grown[0] >= 1 else None
        if share > THROTTLED_SHARE or (recent is not None and grown[1] > 0):
            measured = (f"{first.throttled} of {first.periods} periods throttled ({share:.1%}), "
                        f"{first.throttled_us / 1e6:.1f} s in all ({first.source})")
            if grown is not None:
                measured += (f"; in the last {ctx.sample_s:g} s: {grown[1]} of {grown[0]} periods, "
                             f"{grown[2] / 1e3:.0f} ms" + (" (growing)" if grown[1] else " (not now)"))
            found.append(Finding(
                "host.cgroup_cpu", WARNING, "the service's cgroup is being throttled", subject, measured,
                f"at most {THROTTLED_SHARE:.0%} of periods throttled, and none while it serves",
                "Each throttled period stops every thread of the cgroup until the period ends: a request that "
                "was running waits up to a whole period, so p95 and p99 jump while the mean hardly moves.",
                "raise the quota (CPUQuota= / --cpus / limits.cpu) to what the workers use, or make the thread "
                "pools fit it: [models.options] intra_op_threads (onnxruntime), OMP_NUM_THREADS, or the models' "
                "cpus / cpus_per_worker",
                {"periods": first.periods, "throttled": first.throttled, "throttled_us": first.throttled_us,
                 "sample": None if grown is None else {"seconds": ctx.sample_s, "periods": grown[0],
                                                       "throttled": grown[1], "throttled_us": grown[2]}}))
    return found


# -- the CPU frequency governor ----------------------------------------------------------------

def cpufreq(ctx: Context) -> list[Finding]:
    cpus = _worker_cpus(ctx) or ctx.host.online_cpus()
    governors: dict[str, set[int]] = {}
    for cpu in sorted(cpus):
        g = ctx.host.governor(cpu)
        if g is not None:
            governors.setdefault(g, set()).add(cpu)
    if not governors:
        raise Skip("no sys/devices/system/cpu/cpu*/cpufreq/scaling_governor (a VM, or a frequency driver "
                   "without governors): the hypervisor or firmware sets the clocks")
    slow = {g: c for g, c in governors.items() if g not in SPINNING_GOVERNORS_OK}
    if not slow:
        return []
    where = "; ".join(f"{g} on CPUs {format_cpulist(c)}" for g, c in sorted(slow.items()))
    return [Finding(
        "host.cpufreq", WARNING, "CPUs that serve requests run a power-saving frequency governor",
        "CPUs " + format_cpulist(cpus) + (" (the workers')" if _worker_cpus(ctx) else ""),
        f"{where} (sys/devices/system/cpu/cpu*/cpufreq/scaling_governor)", "performance",
        "A governor other than performance lowers the clock when a CPU looks idle and raises it only after it "
        "has been busy for a while: a request arriving after a pause runs its first milliseconds slow, and "
        "short requests never see the full clock.",
        "sudo cpupower frequency-set -g performance (kept across reboots by 'tuned-adm profile "
        "latency-performance', or a udev rule / kernel parameter cpufreq.default_governor=performance)",
        {"governors": {g: format_cpulist(c) for g, c in governors.items()}})]


def _worker_cpus(ctx: Context) -> frozenset[int]:
    """The CPUs the live workers may run on (from their /proc), or empty."""
    cpus: set[int] = set()
    for w in ctx.service.workers():
        proc = ctx.host.process(w.pid) if w.alive else None
        if proc is not None and proc.allowed_cpus:
            cpus |= proc.allowed_cpus
    return frozenset(cpus)


# -- SMT siblings shared by a worker and a spinning client -----------------------------------

def smt(ctx: Context) -> list[Finding]:
    if not ctx.service.live:
        raise Skip("needs a live instance: its pinned workers and the clients of its lanes")
    pinned = [(w, ctx.host.process(w.pid)) for w in ctx.service.workers() if w.alive and w.pinned]
    pinned = [(w, p) for w, p in pinned if p is not None and p.allowed_cpus]
    if not pinned:
        raise Skip("no worker is pinned (the kernel moves unpinned workers away from busy siblings)")
    if ctx.settings.spin_us == 0:
        raise Skip("spin_us = 0: nobody spins")
    clients = {r["owner_pid"] for r in (ctx.service.snapshot or {}).get("regions", []) if r.get("kind") == "lane"}
    found = []
    for pid in sorted(clients):
        client = ctx.host.process(pid)
        if client is None:
            continue
        cpu = client.last_cpu()
        if cpu is None:
            continue
        siblings = ctx.host.siblings(cpu) or frozenset({cpu})
        for w, proc in pinned:
            shared = (siblings - {cpu}) & proc.allowed_cpus
            if shared and cpu not in proc.allowed_cpus:
                found.append(Finding(
                    "host.smt", WARNING, "a lane client spins on the SMT sibling of a pinned worker's CPU",
                    f"client pid {pid} ({client.name}) and {w.who}",
                    f"client last ran on CPU {cpu}, whose sibling(s) {format_cpulist(shared)} the worker is pinned "
                    f"to (sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list = "
                    f"{format_cpulist(siblings)}); spin_us = {ctx.settings.spin_us}",
                    "a spinning client on a core of its own, not on a sibling of a worker's CPU",
                    "Two hardware threads of one core share its execution units: while the client spins waiting "
                    "for its answer, the worker computing that answer runs at a fraction of the core's speed.",
                    f"run the client on other cores (taskset -c <CPUs outside {format_cpulist(siblings)}> ...), "
                    f"or give the model whole cores (cpus = \"{format_cpulist(siblings | proc.allowed_cpus)}\"), or "
                    f"spin_us = 0 in [server]",
                    {"client_pid": pid, "client_cpu": cpu, "worker": w.index, "siblings": format_cpulist(siblings)}))
    return found


# -- transparent huge pages --------------------------------------------------------------------

def thp(ctx: Context) -> list[Finding]:
    thp = ctx.host.thp()
    if not thp:
        raise Skip("no sys/kernel/mm/transparent_hugepage (a kernel without THP)")
    found = []
    if thp.get("defrag") == "always":
        found.append(Finding(
            "host.thp", WARNING, "transparent huge pages compact memory synchronously on page faults",
            "sys/kernel/mm/transparent_hugepage/defrag", "defrag = always",
            "madvise, defer or defer+madvise",
            "With defrag = always a page fault that wants a huge page compacts memory first, in the faulting "
            "thread: a worker or client touching new memory stalls for milliseconds, at random.",
            "echo defer+madvise | sudo tee /sys/kernel/mm/transparent_hugepage/defrag (at boot: "
            "transparent_hugepage=madvise on the kernel command line, or a tuned profile)", dict(thp)))
    if thp.get("enabled") == "always":
        found.append(Finding(
            "host.thp", INFO, "transparent huge pages are on for every process",
            "sys/kernel/mm/transparent_hugepage/enabled", "enabled = always", "madvise (or always)",
            "Huge pages help large tensors' TLB misses; khugepaged collapsing pages in the background can add "
            "jitter to a busy worker.", "", dict(thp)))
    return found


# -- page-locked memory -------------------------------------------------------------------------

def memlock(ctx: Context) -> list[Finding]:
    names = ", ".join(sorted({m.name for m in ctx.settings.gpu_models()} |
                             {w.model for w in ctx.service.workers() if w.device.startswith("cuda")}))
    if not names:
        raise Skip("no GPU model: only GPU workers page-lock the arena and regions")
    pid, whose = ctx.service_pid()
    worker = next((w for w in ctx.service.workers() if w.device.startswith("cuda") and w.alive), None)
    if worker is not None:
        pid, whose = worker.pid, worker.who
    proc = ctx.host.process(pid) if pid is not None else None
    if proc is None:
        raise Skip(f"no proc/{pid}/status to read the limit of")
    if proc.uid == 0 or proc.has_capability(CAP_IPC_LOCK):
        return []  # root and CAP_IPC_LOCK page-lock without a limit
    limit = proc.limits().get("Max locked memory")
    if limit is None:
        raise Skip(f"no 'Max locked memory' in proc/{pid}/limits")
    arena = ctx.settings.arena_bytes
    wanted = arena + ctx.settings.max_region_bytes_per_uid
    subject = f"{whose}: RLIMIT_MEMLOCK"
    if limit.soft is not None and limit.soft < arena:
        return [Finding(
            "host.memlock", CRITICAL, "GPU workers cannot page-lock the arena", subject,
            f"soft limit {size(limit.soft)} (proc/{pid}/limits 'Max locked memory')",
            f"at least the arena, {size(arena)}; unlimited to also lock client regions",
            f"Every GPU worker page-locks the whole arena (cudaHostRegister) before it loads its model; under this "
            f"limit it fails to start, and models {names} stay unavailable.",
            "systemd: LimitMEMLOCK=infinity in the [Service] section (the shipped unit has it); a shell: ulimit -l "
            "unlimited before 'shmserve serve'; Docker: --ulimit memlock=-1",
            {"soft": limit.soft, "hard": limit.hard, "arena_bytes": arena})]
    if limit.soft is not None and limit.soft < wanted:
        return [Finding(
            "host.memlock", WARNING, "GPU workers can page-lock the arena but few client regions",
            subject, f"soft limit {size(limit.soft)} (proc/{pid}/limits)",
            f"the arena ({size(arena)}) + one uid's regions (max_region_bytes_per_uid, "
            f"{size(ctx.settings.max_region_bytes_per_uid)}) = {size(wanted)}; unlimited is simplest",
            "A GPU worker page-locks each client region and lane it is passed; past the limit the registration "
            "fails and that client's lane or zero-copy calls are refused.",
            "LimitMEMLOCK=infinity (systemd) / ulimit -l unlimited / --ulimit memlock=-1",
            {"soft": limit.soft, "wanted": wanted})]
    return []


# -- /dev/shm --------------------------------------------------------------------------------

def shm(ctx: Context) -> list[Finding]:
    space = ctx.host.shm_space()
    if space is None:
        raise Skip("no dev/shm under the root")
    live = ctx.service.snapshot is not None and ctx.service.state in ("live", "dead")
    return judge_shm(space[0], space[1], ctx.settings.arena_bytes, live, ctx.settings.source)


def judge_shm(total: int, free: int, arena: int, live: bool, source: str) -> list[Finding]:
    """/dev/shm of ``total`` bytes with ``free`` left, for an arena of ``arena`` bytes that exists
    already (``live``: it is in ``total - free``) or is still to be made."""
    data = {"size": total, "free": free, "arena_bytes": arena}
    if not live and free < arena:
        return [Finding(
            "host.shm", CRITICAL, "/dev/shm cannot hold the arena", "dev/shm",
            f"{size(free)} free of {size(total)} (statvfs)", f"at least the arena: {size(arena)} ({source})",
            "'shmserve serve' creates and pre-faults the whole arena in /dev/shm at start; without the room it "
            "refuses to start (and a container's default 64 MiB /dev/shm is far too small).",
            "sudo mount -o remount,size=<N>G /dev/shm (or in /etc/fstab); Docker: --shm-size=<N>g; Kubernetes: an "
            "emptyDir with medium: Memory mounted at /dev/shm; or a smaller arena ([arena] size_classes, "
            "max_request_bytes)", data)]
    if live and free < SHM_HEADROOM * total and free < (1 << 30):
        return [Finding(
            "host.shm", WARNING, "/dev/shm is nearly full", "dev/shm",
            f"{size(free)} free of {size(total)} (statvfs); the arena takes {size(arena)}",
            f"at least {SHM_HEADROOM:.0%} free", "Whatever else writes /dev/shm (v2 clients' system shared "
            "memory, other instances, other programs) fails with ENOSPC or dies of SIGBUS when it touches a page "
            "it could not get; a restart of this instance needs the arena's size again once the old one is gone.",
            "find what fills it (ls -lS /dev/shm; 'shmserve cleanup' removes dead instances' arenas), or enlarge "
            "it (mount -o remount,size=<N>G /dev/shm / --shm-size)", data)]
    return []


# -- descriptors ------------------------------------------------------------------------------

def fds(ctx: Context) -> list[Finding]:
    pid, whose = ctx.service_pid()
    proc = ctx.host.process(pid) if pid is not None else None
    if proc is None:
        raise Skip(f"no proc/{pid}/status to read the limit of")
    limit = proc.limits().get("Max open files")
    if limit is None:
        raise Skip(f"no 'Max open files' in proc/{pid}/limits")
    s = ctx.settings
    budget = s.descriptors or {"server.max_connections": s.max_connections,
                               "server.max_regions (two each)": 2 * s.max_regions, "the front-end's own": FD_SPARE}
    needed = sum(budget.values())
    usable = limit.hard  # the server lifts its soft limit to the hard one at start
    if usable is None or usable >= needed:
        return []
    return [Finding(
        "host.fds", WARNING, "the descriptor limit is below what the configured limits can use",
        f"{whose}: RLIMIT_NOFILE", f"hard limit {usable} (proc/{pid}/limits 'Max open files'; soft {limit.soft})",
        "at least " + " + ".join(f"{n} {what}" for what, n in budget.items()) + f" = {needed} "
        "(ServerConfig.descriptor_budget: serve refuses to start below it)",
        "The front-end holds a descriptor per connection, two per lane or region (workers one per region) and "
        "one per v2 system shared-memory registration; past the limit accept(), region creation and "
        "registration fail with 'too many open files' while the configured limits still say yes.",
        "systemd: LimitNOFILE=65536 (the shipped unit); a shell: ulimit -n 65536; or lower [server] "
        "max_connections / max_regions", {"hard": usable, "soft": limit.soft, "needed": needed})]
