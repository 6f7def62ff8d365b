"""The machine as ``doctor`` reads it: /proc, /sys and /dev/shm under one root directory.

Owns: every file ``doctor`` reads about the host and its processes, and the
parsing of each (``/proc/<pid>/status``, ``limits``, ``cgroup``, ``environ``,
``stat``; cgroup v1 and v2 CPU controllers; cpufreq governors, SMT siblings,
NUMA nodes, transparent huge pages, PCIe links in sysfs; ``statvfs`` of
``dev/shm``).  ``Host(root)`` reads ``root/proc/...``, ``root/sys/...``: ``/`` on a
real machine, a fake tree in tests, a copy of another machine's files.

Every reader returns None (or an empty value) for what it cannot read: a
missing file is a fact about the machine (no cpufreq in a VM, no cgroup v1),
never an exception.  Values read are untrusted text: a malformed line is
skipped.

Must not: write anything, run a program, or import CUDA or a model runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shmserve import placement

CAP_IPC_LOCK = 14  # capabilities(7): mlock and page-locking without RLIMIT_MEMLOCK
UNLIMITED = None  # a limit of "unlimited" in /proc/<pid>/limits


@dataclass(frozen=True)
class Limit:
    soft: int | None  # None: unlimited
    hard: int | None


@dataclass(frozen=True)
class CpuQuota:
    """One cgroup's CPU bandwidth limit: ``quota_us`` per ``period_us`` (None: no limit)."""

    path: str  # the cgroup, as /proc/<pid>/cgroup names it ("/system.slice/shmserve.service")
    quota_us: int | None
    period_us: int
    source: str  # the file it was read from, relative to the root

    @property
    def cpus(self) -> float | None:
        return None if self.quota_us is None else self.quota_us / self.period_us


@dataclass(frozen=True)
class CpuThrottling:
    """A cgroup's throttling counters (cumulative since the cgroup was made)."""

    path: str
    periods: int
    throttled: int
    throttled_us: int
    source: str


class Host:
    """Files of one machine under ``root``."""

    def __init__(self, root: str | os.PathLike = "/"):
        self.root = Path(root)

    # -- plain reads ----------------------------------------------------------------------

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def text(self, rel: str) -> str | None:
        try:
            with open(self.path(rel), "rb") as f:
                return f.read(1 << 20).decode("utf-8", "replace")
        except OSError:
            return None

    def first_line(self, rel: str) -> str | None:
        text = self.text(rel)
        return None if text is None else (text.splitlines() or [""])[0].strip()

    def integer(self, rel: str) -> int | None:
        line = self.first_line(rel)
        try:
            return int(line) if line is not None else None
        except ValueError:
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError:
            return []

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def shm_space(self) -> tuple[int, int] | None:
        """(size, free bytes) of the file system at ``dev/shm`` (statvfs); None if there is none."""
        try:
            st = os.statvfs(self.path("dev/shm"))
        except OSError:
            return None
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    # -- CPUs -----------------------------------------------------------------------------

    def online_cpus(self) -> frozenset[int]:
        return placement.online_cpus(self.root)

    def cpulist(self, rel: str) -> frozenset[int] | None:
        text = self.first_line(rel)
        if text is None:
            return None
        try:
            return placement.parse_cpulist(text)
        except ValueError:
            return None

    def siblings(self, cpu: int) -> frozenset[int] | None:
        """The SMT siblings of ``cpu`` (itself included); None if sysfs does not say."""
        return self.cpulist(f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")

    def governor(self, cpu: int) -> str | None:
        return self.first_line(f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor")

    def numa_nodes(self) -> dict[int, frozenset[int]]:
        """Each NUMA node's CPUs (``sys/devices/system/node/node<N>/cpulist``); {} when sysfs has none."""
        nodes = {}
        for name in self.listdir("sys/devices/system/node"):
            if name.startswith("node") and name[4:].isdigit():
                cpus = self.cpulist(f"sys/devices/system/node/{name}/cpulist")
                if cpus:
                    nodes[int(name[4:])] = cpus
        return nodes

    def thp(self) -> dict[str, str]:
        """The selected value of each transparent-huge-page setting ("enabled", "defrag",
        "shmem_enabled"): the bracketed word of ``sys/kernel/mm/transparent_hugepage/<name>``."""
        out = {}
        for name in ("enabled", "defrag", "shmem_enabled"):
            text = self.first_line(f"sys/kernel/mm/transparent_hugepage/{name}")
            if text and "[" in text and "]" in text:
                out[name] = text[text.index("[") + 1:text.index("]")]
        return out

    # -- PCI ------------------------------------------------------------------------------

    def pci_link(self, bus_id: str) -> dict[str, str | int | None]:
        """A PCI device's link in sysfs: current and maximum speed (GT/s, as text) and width."""
        base = f"sys/bus/pci/devices/{bus_id}"
        return {"current_speed": self.first_line(f"{base}/current_link_speed"),
                "max_speed": self.first_line(f"{base}/max_link_speed"),
                "current_width": self.integer(f"{base}/current_link_width"),
                "max_width": self.integer(f"{base}/max_link_width")}

    def pci_numa_node(self, bus_id: str) -> int | None:
        node = self.integer(f"sys/bus/pci/devices/{bus_id}/numa_node")
        return None if node is None or node < 0 else node

    # -- processes ------------------------------------------------------------------------

    def process(self, pid: int) -> "Process | None":
        """The process ``pid`` as its /proc shows it; None if there is no such process (or no
        /proc for it under the root)."""
        status = self.text(f"proc/{pid}/status")
        if status is None:
            return None
        fields = {}
        for line in status.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        return Process(self, pid, fields)

    def own_pid(self) -> int | None:
        """The pid whose /proc the host checks read when no server runs: this process on the real
        root; in another tree, the one its ``proc/self`` link names (None without one)."""
        if self.root == Path("/"):
            return os.getpid()
        try:
            return int(os.readlink(self.path("proc/self")))
        except (OSError, ValueError):
            return None

    # -- cgroups --------------------------------------------------------------------------

    def mounts(self) -> list[tuple[str, str, str, str]]:
        """(device, mount point, type, options) of ``proc/mounts``."""
        out = []
        for line in (self.text("proc/mounts") or "").splitlines():
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[0], parts[1].replace("\\040", " "), parts[2], parts[3]))
        return out

    def cgroup_cpu(self, pid: int) -> tuple[list[CpuQuota], CpuThrottling | None]:
        """The CPU quotas on the way from ``pid``'s cgroup up to the root of its hierarchy (the
        tightest one binds) and the throttling counters of its own cgroup.  cgroup v2 (``cpu.max``,
        ``cpu.stat``) where the cpu controller is there, else v1 (``cpu.cfs_quota_us``,
        ``cpu.cfs_period_us``, ``cpu.stat``)."""
        lines = (self.text(f"proc/{pid}/cgroup") or "").splitlines()
        mounts = self.mounts()
        v2_path = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
        v2_mount = next((m[1] for m in mounts if m[2] == "cgroup2"), None)
        if v2_path is not None and v2_mount is not None:
            quotas, stat = self._cgroup_v2(v2_mount, v2_path)
            if quotas or stat is not None:
                return quotas, stat
        for line in lines:
            parts = line.split(":", 2)
            if len(parts) == 3 and "cpu" in parts[1].split(","):
                mount = next((m[1] for m in mounts if m[2] == "cgroup" and "cpu" in m[3].split(",")), None)
                if mount is not None:
                    return self._cgroup_v1(mount, parts[2])
        return [], None

    def _walk(self, mount: str, path: str) -> list[tuple[str, str]]:
        """(cgroup path, its directory relative to the root) from ``path`` up to the hierarchy's root."""
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        out = []
        for n in range(len(parts), -1, -1):
            cg = "/" + "/".join(parts[:n])
            out.append((cg, mount.rstrip("/") + cg.rstrip("/")))
        return out

    def _cgroup_v2(self, mount: str, path: str):
        quotas, stat = [], None
        for i, (cg, where) in enumerate(self._walk(mount, path)):
            words = (self.first_line(f"{where}/cpu.max") or "").split()
            if len(words) == 2 and words[1].isdigit() and int(words[1]) > 0:
                quota = None if words[0] == "max" else int(words[0]) if words[0].isdigit() else None
                if quota is not None:
                    quotas.append(CpuQuota(cg, quota, int(words[1]), f"{where}/cpu.max"))
            if i == 0:
                fields = self._stat(f"{where}/cpu.stat")
                if "nr_periods" in fields:
                    stat = CpuThrottling(cg, fields["nr_periods"], fields.get("nr_throttled", 0),
                                         fields.get("throttled_usec", 0), f"{where}/cpu.stat")
        return quotas, stat

    def _cgroup_v1(self, mount: str, path: str):
        quotas, stat = [], None
        for i, (cg, where) in enumerate(self._walk(mount, path)):
            quota, period = self.integer(f"{where}/cpu.cfs_quota_us"), self.integer(f"{where}/cpu.cfs_period_us")
            if quota is not None and quota > 0 and period:
                quotas.append(CpuQuota(cg, quota, period, f"{where}/cpu.cfs_quota_us"))
            if i == 0:
                fields = self._stat(f"{where}/cpu.stat")
                if "nr_periods" in fields:
                    stat = CpuThrottling(cg, fields["nr_periods"], fields.get("nr_throttled", 0),
                                         fields.get("throttled_time", 0) // 1000, f"{where}/cpu.stat")
        return quotas, stat

    def _stat(self, rel: str) -> dict[str, int]:
        out = {}
        for line in (self.text(rel) or "").splitlines():
            words = line.split()
            if len(words) == 2 and words[1].isdigit():
                out[words[0]] = int(words[1])
        return out


class Process:
    """One process's /proc entries (``Host.process``)."""

    def __init__(self, host: Host, pid: int, status: dict[str, str]):
        self.host, self.pid, self.status = host, pid, status

    @property
    def name(self) -> str:
        return self.status.get("Name", "?")

    @property
    def uid(self) -> int | None:
        words = self.status.get("Uid", "").split()
        return int(words[1]) if len(words) > 1 and words[1].isdigit() else None  # the effective uid

    @property
    def threads(self) -> int | None:
        value = self.status.get("Threads", "")
        return int(value) if value.isdigit() else None

    @property
    def allowed_cpus(self) -> frozenset[int] | None:
        try:
            return placement.parse_cpulist(self.status["Cpus_allowed_list"])
        except (KeyError, ValueError):
            return None

    def has_capability(self, bit: int) -> bool:
        try:
            return bool(int(self.status.get("CapEff", "0"), 16) >> bit & 1)
        except ValueError:
            return False

    def limits(self) -> dict[str, Limit]:
        """``/proc/<pid>/limits`` by name ("Max open files", "Max locked memory")."""
        out = {}
        for line in (self.host.text(f"proc/{self.pid}/limits") or "").splitlines()[1:]:
            name, values = line[:26].strip(), line[26:].split()
            if name and len(values) >= 2:
                out[name] = Limit(_limit(values[0]), _limit(values[1]))
        return out

    def environ(self) -> dict[str, str] | None:
        """Its environment (None if unreadable: another user's process)."""
        try:
            with open(self.host.path(f"proc/{self.pid}/environ"), "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            return None
        out = {}
        for item in data.split(b"\0"):
            key, sep, value = item.decode("utf-8", "replace").partition("=")
            if sep:
                out[key] = value
        return out

    def last_cpu(self) -> int | None:
        """The CPU it last ran on (field 39 of ``/proc/<pid>/stat``)."""
        text = self.host.text(f"proc/{self.pid}/stat")
        if not text or ")" not in text:
            return None
        fields = text.rsplit(")", 1)[1].split()
        try:
            return int(fields[36])  # fields after the name start at field 3
        except (IndexError, ValueError):
            return None

    def children(self) -> list[int]:
        out = []
        for task in self.host.listdir(f"proc/{self.pid}/task"):
            for word in (self.host.text(f"proc/{self.pid}/task/{task}/children") or "").split():
                if word.isdigit():
                    out.append(int(word))
        return out


def _limit(word: str) -> int | None:
    return None if word == "unlimited" else int(word) if word.isdigit() else None
