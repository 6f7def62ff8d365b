"""Where a worker runs: its device (one of its model's devices) and the CPUs it is pinned to.

Owns: the kernel's cpulist form ("0-3,8,10-11": parsing and formatting), the
CPUs of this machine and of this process, finding which PCI device a CUDA
ordinal names and the CPUs local to it (from /proc and /sys, never through
CUDA), the placement decision for a new worker (``place``: pure, given what
its siblings hold and a lookup of a GPU's local CPUs), and pinning the calling
worker (``pin``).

How ``cuda:N`` is found without CUDA (docs/config.md, "CPU placement"):

1. the NVIDIA GPUs of this machine: ``/proc/driver/nvidia/gpus/<bus id>/information``
   (model, UUID, bus location), else the devices bound to the ``nvidia`` driver,
   ``/sys/bus/pci/drivers/nvidia/<bus id>`` (model: their PCI device id); in a
   container the driver's /proc shows only the GPUs given to it;
2. ordered as CUDA orders them: by PCI bus id when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
   or when every GPU is the same model (CUDA's default, ``FASTEST_FIRST``, ranks
   by speed and, among equals, by bus id: observed, not documented by NVIDIA;
   tests/test_gpu_placement.py checks it against CUDA's own bus ids).  GPUs of different models without
   ``PCI_BUS_ID``: unknown (CUDA's speed ranking is not written down);
3. narrowed by ``CUDA_VISIBLE_DEVICES`` (indices into that order, or ``GPU-`` UUIDs
   or unique prefixes; the list ends at the first entry that is neither, as CUDA's
   does; a ``MIG-`` entry or an entry listed twice: unknown);
4. its local CPUs: ``/sys/bus/pci/devices/<bus id>/local_cpulist``.

Anything unknown is no pinning, with the reason logged and shown in ``info``.

Must not: import CUDA, numpy or anything heavy (``workers.main`` imports it
before anything that starts a thread: a thread keeps the affinity it was
created with), or pin any process but the calling worker.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

MAX_CPU = 1 << 16  # a bound for hostile or mistyped lists ("0-4000000000"); Linux's NR_CPUS is at most 8192
AUTO, INHERIT = "auto", "inherit"  # ModelConfig.cpus: the default (a GPU's local CPUs), and "no pinning"
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


# -- the cpulist form -------------------------------------------------------------------------

def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a Linux cpulist ("0-3", "0,2,4-7"; surrounding whitespace, as sysfs files end
    with, is ignored; "" is no CPU).  ValueError saying what is wrong, for anything else: a range
    whose end is below its start, a number of ``MAX_CPU`` or more, the stride form ("0-7:2")."""
    text = text.strip()
    if not text:
        return frozenset()
    cpus: set[int] = set()
    for part in text.split(","):
        match = _RANGE_RE.match(part.strip())
        if match is None:
            raise ValueError(f"{part.strip()!r} is not a CPU number or a range like 0-3")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"range {part.strip()!r} ends before it starts")
        if hi >= MAX_CPU:
            raise ValueError(f"CPU {hi} is out of range (at most {MAX_CPU - 1})")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The shortest cpulist of ``cpus`` ("0-3,8"), ascending; "" for none."""
    out, run = [], None
    for cpu in sorted(set(cpus)):
        if run is not None and cpu == run[1] + 1:
            run[1] = cpu
            continue
        if run is not None:
            out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
        run = [cpu, cpu]
    if run is not None:
        out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(out)


def online_cpus(root: Path = Path("/")) -> frozenset[int]:
    """The CPUs of this machine that are online (/sys/devices/system/cpu/online; without it,
    0 .. os.cpu_count() - 1)."""
    try:
        return parse_cpulist((root / "sys/devices/system/cpu/online").read_text())
    except (OSError, ValueError):
        return frozenset(range(os.cpu_count() or 1))


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (``sched_getaffinity``: narrowed by taskset, a cgroup
    cpuset or systemd's CPUAffinity=); workers may be pinned only within it."""
    return frozenset(os.sched_getaffinity(0))


# -- which PCI device cuda:N is, and its CPUs ---------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    bus_id: str  # "0000:3b:00.0", lower case, as /sys names it
    model: str | None  # the product name, or the PCI device id from sysfs; None: unknown
    uuid: str | None  # "GPU-…" (from the driver's /proc); None: unknown


def normalize_bus_id(text: str) -> str | None:
    """ "00000000:3B:00.0" (nvidia-smi, torch) or "0000:3b:00.0" (sysfs) -> "0000:3b:00.0"; None
    if it is not a PCI address."""
    match = re.match(r"^\s*([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])\s*$", text)
    if match is None:
        return None
    domain, bus, dev, fn = (int(g, 16) for g in match.groups())
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


def _bus_key(bus_id: str) -> tuple[int, ...]:
    return tuple(int(p, 16) for p in re.split(r"[:.]", bus_id))


def _pci_entries(directory: Path) -> list[tuple[str, Path]]:
    """(bus id, entry) for each entry of ``directory`` named by a PCI address; [] if unreadable."""
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    return [(bus_id, e) for e in entries if (bus_id := normalize_bus_id(e.name)) is not None]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def nvidia_gpus(root: Path = Path("/")) -> list[Gpu]:
    """This machine's NVIDIA GPUs in PCI bus order: from the driver's /proc (model, UUID), else
    from the devices bound to the nvidia driver in /sys (model: the PCI device id).  [] when the
    driver shows none."""
    gpus = []
    for bus_id, entry in _pci_entries(root / "proc/driver/nvidia/gpus"):
        fields = {}
        for line in _read(entry / "information").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        bus_id = normalize_bus_id(fields.get("Bus Location", "")) or bus_id
        gpus.append(Gpu(bus_id, fields.get("Model") or None, fields.get("GPU UUID") or None))
    if not gpus:
        for bus_id, _ in _pci_entries(root / "sys/bus/pci/drivers/nvidia"):
            gpus.append(Gpu(bus_id, _read(root / "sys/bus/pci/devices" / bus_id / "device").strip() or None, None))
    return sorted(gpus, key=lambda g: _bus_key(g.bus_id))


def cuda_gpu(ordinal: int, gpus: list[Gpu], env: Mapping[str, str]) -> tuple[Gpu | None, str]:
    """The GPU that ``cuda:<ordinal>`` names in a process with environment ``env``, given the
    machine's GPUs (``nvidia_gpus``); (None, why) when that cannot be known from here."""
    if not gpus:
        return None, "no NVIDIA GPU in /proc/driver/nvidia/gpus or /sys/bus/pci/drivers/nvidia"
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST").strip().upper() or "FASTEST_FIRST"
    if order != "PCI_BUS_ID" and (len({g.model for g in gpus}) > 1 or None in {g.model for g in gpus}) \
            and len(gpus) > 1:
        return None, ("the GPUs are of different models (or of unknown models) and CUDA_DEVICE_ORDER is not "
                      "PCI_BUS_ID, so CUDA numbers them fastest first, which /sys does not say; set "
                      "CUDA_DEVICE_ORDER=PCI_BUS_ID in the server's environment, or cpus")
    visible = list(gpus)
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        visible = []
        for raw in listed.split(","):
            entry = raw.strip()
            if entry.upper().startswith("MIG-"):
                return None, f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry!r}), whose GPU is not looked up"
            if re.fullmatch(r"-?\d+", entry):
                index = int(entry)
                if not 0 <= index < len(gpus):
                    break  # CUDA ignores an invalid entry and every one after it
                gpu = gpus[index]
            elif entry.upper().startswith("GPU-"):
                matches = [g for g in gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
                if not any(g.uuid for g in gpus):
                    return None, "CUDA_VISIBLE_DEVICES names GPUs by UUID, and /proc/driver/nvidia gives no UUIDs"
                if len(matches) != 1:
                    break
                gpu = matches[0]
            else:
                break
            if gpu in visible:
                return None, f"CUDA_VISIBLE_DEVICES lists one GPU twice ({listed!r})"
            visible.append(gpu)
    if not 0 <= ordinal < len(visible):
        return None, f"cuda:{ordinal} is not among the {len(visible)} GPU(s) visible to CUDA here"
    return visible[ordinal], ""


def pci_local_cpus(bus_id: str, root: Path = Path("/")) -> frozenset[int] | None:
    """/sys/bus/pci/devices/<bus_id>/local_cpulist; None if unreadable or malformed."""
    try:
        return parse_cpulist((root / "sys/bus/pci/devices" / bus_id / "local_cpulist").read_text())
    except (OSError, ValueError):
        return None


def gpu_local_cpus(device: str, root: Path = Path("/"),
                   env: Mapping[str, str] | None = None) -> tuple[frozenset[int] | None, str]:
    """The CPUs local to ``device`` ("cuda:N") and where they come from, or (None, why not)."""
    ordinal = int(device.partition(":")[2])
    gpu, why = cuda_gpu(ordinal, nvidia_gpus(root), os.environ if env is None else env)
    if gpu is None:
        return None, why
    cpus = pci_local_cpus(gpu.bus_id, root)
    if not cpus:
        return None, f"no local_cpulist for {device}'s PCI device {gpu.bus_id} in /sys/bus/pci/devices"
    return cpus, f"local to {device} (PCI {gpu.bus_id})"


# -- the decision for a new worker ------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    device: str  # the one device this worker runs its model on
    cpus: frozenset[int] | None  # pinned to these; None: not pinned (the front-end's own affinity)
    source: str  # why: "cpus = 0-3", "local to cuda:0 (PCI …)", "inherited", "inherited: <why not local>"
    chunk: int | None = None  # with cpus_per_worker: which chunk of the pool (siblings take the others first)

    @property
    def cpulist(self) -> str | None:
        return None if self.cpus is None else format_cpulist(self.cpus)


def choose_device(devices: tuple[str, ...], held: Iterable[str]) -> str:
    """The device of ``devices`` that the fewest of ``held`` (the siblings' devices) use; ties go
    to the one listed first.  So workers added one by one go round-robin, and a worker added
    after a scale-down fills the emptiest device."""
    held = list(held)
    return min(devices, key=lambda d: (held.count(d), devices.index(d)))


def choose_chunk(pool: frozenset[int], per_worker: int, held: Iterable[int | None]) -> tuple[frozenset[int], int]:
    """Split ``pool`` (ascending) into consecutive chunks of ``per_worker`` CPUs (a last, shorter
    one joins the one before it) and take the chunk the fewest of ``held`` (siblings' chunks)
    use; ties to the lowest.  More workers than chunks share chunks in turn."""
    cpus = sorted(pool)
    count = max(1, len(cpus) // per_worker)
    chunks = [cpus[i * per_worker:(i + 1) * per_worker] for i in range(count)]
    chunks[-1] = cpus[(count - 1) * per_worker:]
    held = list(held)
    chunk = min(range(count), key=lambda i: (held.count(i), i))
    return frozenset(chunks[chunk]), chunk


def place(devices: tuple[str, ...], cpus: str, cpus_per_worker: int, siblings: Iterable[Placement],
          local: Callable[[str], tuple[frozenset[int] | None, str]], allowed: frozenset[int]) -> Placement:
    """Where a new worker of a model goes.  ``devices``, ``cpus`` (AUTO, INHERIT or a cpulist)
    and ``cpus_per_worker`` are the model's settings; ``siblings`` the placements of its other
    live workers (same settings); ``local(device)`` a GPU's local CPUs (``gpu_local_cpus``);
    ``allowed`` the CPUs the front-end may use, which every pinned set stays within.

    Device: ``choose_device``.  CPUs: ``cpus`` when given; AUTO on a GPU: its local CPUs within
    ``allowed`` (none there, or unknown: not pinned, saying why); AUTO on the CPU: not pinned, or,
    with ``cpus_per_worker``, chunks of ``allowed``.  With ``cpus_per_worker`` the set is split
    (``choose_chunk``) among the workers on the same device."""
    siblings = list(siblings)
    device = choose_device(devices, (s.device for s in siblings))
    if cpus == INHERIT:
        return Placement(device, None, "inherited (cpus = \"inherit\")")
    if cpus != AUTO:
        pool, source = parse_cpulist(cpus), f"cpus = {cpus}"
    elif device == "cpu":
        if not cpus_per_worker:
            return Placement(device, None, "inherited")
        pool, source = allowed, "the server's CPUs"
    else:
        found, why = local(device)
        if found is None:
            return Placement(device, None, f"inherited: {why}")
        pool = found & allowed
        if not pool:
            return Placement(device, None, f"inherited: none of {device}'s local CPUs "
                                           f"({format_cpulist(found)}) is allowed to the server "
                                           f"({format_cpulist(allowed)})")
        source = why
    if not cpus_per_worker or cpus_per_worker >= len(pool):
        return Placement(device, pool, source)
    chunk_cpus, chunk = choose_chunk(pool, cpus_per_worker, (s.chunk for s in siblings if s.device == device))
    return Placement(device, chunk_cpus, f"{source}, chunk {chunk} of {cpus_per_worker}", chunk)


# -- the worker's side ------------------------------------------------------------------------

def pin(cpus: frozenset[int] | None) -> str | None:
    """Pin the calling process (its calling thread: call before any other thread starts) to
    ``cpus``; None when done (or nothing to do), else why not, for the worker's 'failed' message.
    A kernel that narrows the set (a cpuset without some of them) counts as a refusal."""
    if cpus is None:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        return (f"cannot pin to CPUs {format_cpulist(cpus)}: {exc.strerror} (sched_setaffinity); they must be "
                f"online and within the server's allowed CPUs ({format_cpulist(os.sched_getaffinity(0))}): "
                f"change the model's cpus or the server's CPU affinity (taskset, cpuset, CPUAffinity=)")
    got = frozenset(os.sched_getaffinity(0))
    if got != cpus:
        return (f"pinned to CPUs {format_cpulist(got)}, not the {format_cpulist(cpus)} asked for: the kernel "
                f"refused {format_cpulist(cpus - got)} (a cgroup cpuset?): change the model's cpus")
    return None


def cpus_argument(argv: list[str]) -> str | None:
    """The value of ``--cpus`` in a worker's argv (``workerlink.worker_argv``), read before argparse
    so that the worker pins itself before its first heavy import; None if absent."""
    for i, arg in enumerate(argv):
        if arg == "--cpus" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--cpus="):
            return arg.partition("=")[2]
    return None
