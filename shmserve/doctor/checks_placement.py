"""Placement checks: workers' CPUs against their GPU's, thread pools against the CPUs they get, the
front-end beside spinning workers.

Owns: the judgement of each; the CPUs a process may run on are measured
(``Cpus_allowed_list`` of its /proc), the pools as each worker reported them
when ready (its runtime's intra-op and inter-op threads, and the OMP / MKL /
OpenBLAS variables of its environment).

Must not: read a file except through ``ctx.host``, or import CUDA.
"""

from __future__ import annotations

from shmserve import placement, workerlink
from shmserve.doctor.checks_host import Skip
from shmserve.doctor.context import Context
from shmserve.doctor.findings import INFO, WARNING, Finding
from shmserve.inspection import plural
from shmserve.placement import format_cpulist

# -- each GPU worker's CPUs against its GPU's local CPUs ---------------------------------------

def numa(ctx: Context) -> list[Finding]:
    env = ctx.server_environ()
    found = []
    gpu_workers = [w for w in ctx.service.workers() if w.alive and w.device.startswith("cuda")]
    if gpu_workers:
        for w in gpu_workers:
            proc = ctx.host.process(w.pid)
            allowed = proc.allowed_cpus if proc else None
            local, why = placement.gpu_local_cpus(w.device, ctx.host.root, env)
            if allowed is None or local is None:
                continue
            if not allowed <= local:
                found.append(_far(ctx, w.who, w.device, allowed, local, why, f"proc/{w.pid}/status",
                                  w.model, w.cpus_from))
        return found
    configured = [(m, d) for m in ctx.settings.gpu_models() for d in m.devices]
    if not configured:
        raise Skip("no GPU worker running and no GPU model configured")
    for m, device in configured:
        if not m.cpus or m.cpus in (placement.AUTO, placement.INHERIT):
            continue  # auto pins to the local CPUs; inherit is the server's own choice
        try:
            cpus = placement.parse_cpulist(m.cpus)
        except ValueError:
            continue
        local, why = placement.gpu_local_cpus(device, ctx.host.root, env)
        if local is not None and not cpus <= local:
            found.append(_far(ctx, f"model {m.name} on {device}", device, cpus, local, why,
                              f"its cpus = \"{m.cpus}\" ({ctx.settings.source})", m.name, None))
    return found


def _far(ctx: Context, who: str, device: str, cpus, local, why: str, source: str, model: str,
         cpus_from: str | None) -> Finding:
    nodes = ctx.host.numa_nodes()
    spans = sorted(n for n, c in nodes.items() if c & cpus)
    gpu_nodes = sorted(n for n, c in nodes.items() if c & local)
    return Finding(
        "placement.numa", WARNING, "a GPU worker may run on CPUs far from its GPU", who,
        f"CPUs {format_cpulist(cpus)} ({source}" + (f"; NUMA nodes {spans}" if spans else "") + ")"
        + (f"; pinned so because: {cpus_from}" if cpus_from else ""),
        f"within {format_cpulist(local)}, {why}" + (f" (NUMA node {gpu_nodes})" if gpu_nodes else ""),
        "Copies between the arena and the GPU, and the worker's own memory traffic, cross the socket "
        "interconnect from a far CPU: DMA bandwidth drops and every hand-off costs a remote cache miss.",
        f"cpus = \"auto\" for model {model} (the default: its GPU's local CPUs), or cpus = "
        f"\"{format_cpulist(local)}\"; if 'auto' could not tell the GPU's CPUs, set CUDA_DEVICE_ORDER=PCI_BUS_ID "
        f"in the service's environment (docs/config.md, CPU and device placement)",
        {"cpus": format_cpulist(cpus), "local": format_cpulist(local), "device": device})


# -- thread pools against the CPUs each worker owns --------------------------------------------

def pool_of(threads: dict | None) -> tuple[int | None, str]:
    """The compute threads a worker's runtime runs, and what says so: its intra-op pool, else the
    largest of OMP / MKL / OpenBLAS in its environment."""
    if not threads:
        return None, ""
    intra = threads.get("intra_op")
    if isinstance(intra, int) and intra > 0:
        return intra, f"{threads.get('runtime', 'runtime')} intra-op threads {intra}"
    env = threads.get("env") or {}
    best = None
    for name in workerlink.THREAD_VARIABLES:
        try:
            value = int(str(env.get(name, "")).split(",")[0])
        except ValueError:
            continue
        if value > 0 and (best is None or value > best[0]):
            best = (value, f"{name}={env[name]}")
    return best if best else (None, "")


def threads(ctx: Context) -> list[Finding]:
    if not ctx.service.live:
        raise Skip("needs a live instance: each worker's pools and CPUs")
    entries = []
    unreported = []
    for w in ctx.service.workers():
        if not (w.alive and w.state == "ready"):
            continue
        proc = ctx.host.process(w.pid)
        pool, source = pool_of(w.threads)
        if proc is None or not proc.allowed_cpus:
            continue
        if pool is None:
            unreported.append(w.who)
            continue
        entries.append((w, proc, pool, source))
    if not entries:
        raise Skip("no ready worker reported its thread pools" +
                   (f" ({', '.join(unreported)}: a python model sets its own)" if unreported else ""))
    found = []
    for group, cpus in _confined(entries):
        total = sum(pool for _, _, pool, _ in group)
        names = "; ".join(f"{w.who}: {source} on CPUs {format_cpulist(proc.allowed_cpus)} "
                          f"({proc.threads} threads in proc/{w.pid}/status)" for w, proc, _, source in group)
        models = sorted({w.model for w, _, _, _ in group})
        fix_pool = max(1, len(cpus) // len(group))
        found.append(Finding(
            "placement.threads", WARNING, f"{total} compute threads share {plural(len(cpus), 'CPU')}",
            ", ".join(w.who for w, _, _, _ in group), names,
            f"at most {plural(len(cpus), 'thread')} on CPUs {format_cpulist(cpus)} (one per CPU)",
            "An oversubscribed pool's threads take turns on the same CPUs: a parallel operator waits for its "
            "slowest thread, which waits for the scheduler, and spinning pool threads burn the time the others "
            "need. Latency grows with every request running at once.",
            f"give each worker {plural(fix_pool, 'thread')}: [models.options] intra_op_threads = {fix_pool} "
            f"(onnxruntime), OMP_NUM_THREADS={fix_pool} in the service's environment (torch, MKL, OpenBLAS); or "
            f"cpus_per_worker = {fix_pool} so each worker owns its CPUs; or fewer instances of "
            f"{', '.join(models)}",
            {"threads": total, "cpus": format_cpulist(cpus), "workers": [w.index for w, _, _, _ in group]}))
    nodes = ctx.host.numa_nodes()
    if len(nodes) > 1:
        for w, proc, pool, source in entries:
            spans = sorted(n for n, c in nodes.items() if c & proc.allowed_cpus)
            if pool > 1 and len(spans) > 1:
                found.append(Finding(
                    "placement.threads", INFO, "a worker's thread pool spans NUMA nodes", w.who,
                    f"{source} on CPUs {format_cpulist(proc.allowed_cpus)}: NUMA nodes {spans}",
                    "one node's CPUs", "Threads of one operator on two sockets share its tensors across the "
                    "interconnect.", f"pin it to one node: cpus = \"{format_cpulist(nodes[spans[0]])}\" "
                    f"(or cpus_per_worker)", {"nodes": spans}))
    return found


def _confined(entries) -> list[tuple[list, frozenset]]:
    """The oversubscribed groups: for each CPU set a worker is pinned to, smallest first, the workers
    confined to it (their sets inside it) and not in a group already found, against its CPUs less
    those of the groups found (each group's threads are counted where they are confined, once).
    A group whose pools fit its CPUs is no finding.  (Was: overlapping sets merged transitively, so
    two workers of 4 threads on CPUs 0-1 beside two of 16 on 0-15 became '40 threads on 16 CPUs'
    with a fix of 4 threads each, where 0-1 needs 1.)"""
    found, taken, claimed = [], set(), frozenset()
    for cpus in sorted({e[1].allowed_cpus for e in entries}, key=lambda c: (len(c), sorted(c))):
        group = [e for e in entries if e[1].allowed_cpus <= cpus and id(e) not in taken]
        left = (cpus - claimed) or cpus
        if group and sum(e[2] for e in group) > len(left):
            found.append((group, left))
            taken |= {id(e) for e in group}
            claimed |= cpus
    return found


# -- the front-end and door processes beside spinning workers ----------------------------------

def frontend(ctx: Context) -> list[Finding]:
    if not ctx.service.live:
        raise Skip("needs a live instance")
    if ctx.settings.spin_us == 0:
        raise Skip("spin_us = 0: workers do not spin")
    workers = [w for w in ctx.service.workers() if w.alive]
    pinned: set[int] = set()
    for w in workers:
        proc = ctx.host.process(w.pid) if w.pinned else None
        if proc is not None and proc.allowed_cpus:
            pinned |= proc.allowed_cpus
    if not pinned:
        raise Skip("no worker is pinned: the kernel spreads the front-end and workers over every CPU")
    front_pid = (ctx.service.snapshot or {}).get("owner_pid")
    front = ctx.host.process(front_pid) if front_pid else None
    if front is None:
        raise Skip("the front-end's /proc is not readable")
    worker_pids = {w.pid for w in workers}
    processes = [(front, "the front-end")] + [
        (p, f"door process {p.pid}") for pid in front.children() if pid not in worker_pids
        if (p := ctx.host.process(pid)) is not None]
    found = []
    for proc, what in processes:
        allowed = proc.allowed_cpus
        if allowed and allowed <= pinned:
            found.append(Finding(
                "placement.frontend", WARNING, f"{what} has no CPU that a spinning worker is not pinned to",
                f"{what} (pid {proc.pid})",
                f"it may run on CPUs {format_cpulist(allowed)} (proc/{proc.pid}/status); workers are pinned to "
                f"{format_cpulist(pinned)} and spin {ctx.settings.spin_us} us after each request",
                "at least one CPU of its own", "The front-end takes every socket request, completion and "
                "control call; on CPUs where pinned workers spin waiting for work it runs only when the kernel "
                "preempts a spinner, adding a scheduler tick to requests.",
                "leave CPUs to it: give the models' cpus fewer CPUs than the server's affinity (the front-end is "
                "never pinned and goes where they are not), or spin_us = 0 in [server] where cores are scarce",
                {"allowed": format_cpulist(allowed), "pinned": format_cpulist(pinned), "pid": proc.pid}))
    return found
