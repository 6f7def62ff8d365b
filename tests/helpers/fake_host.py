"""A machine as files under a directory, for `shmserve doctor`'s checks: the /proc and /sys entries a
test writes, in the kernel's formats, and a fake `nvidia-smi` program that prints what the test
gives it.  Nothing of shmserve's is replaced: the checks read these files through their root."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

LIMITS_HEAD = f"{'Limit':<26}{'Soft Limit':<21}{'Hard Limit':<21}Units     \n"


class FakeHost:
    """Files of a fake machine under ``root`` (every method returns self, to chain)."""

    def __init__(self, root: Path, online: str = "0-7"):
        self.root = Path(root)
        self.write("sys/devices/system/cpu/online", online + "\n")
        (self.root / "dev/shm").mkdir(parents=True, exist_ok=True)

    def write(self, rel: str, text: str) -> "FakeHost":
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return self

    # -- processes ------------------------------------------------------------------------

    def process(self, pid: int, *, name: str = "python3", uid: int = 1000, cpus: str = "0-7", threads: int = 4,
                nofile: tuple = (65536, 65536), memlock: tuple = ("unlimited", "unlimited"), cap_eff: int = 0,
                cgroup: str = "0::/system.slice/shmserve.service\n", environ: dict | None = None,
                last_cpu: int = 0, children: tuple = ()) -> "FakeHost":
        base = f"proc/{pid}"
        self.write(f"{base}/status", textwrap.dedent(f"""\
            Name:\t{name}
            State:\tS (sleeping)
            Pid:\t{pid}
            Uid:\t{uid}\t{uid}\t{uid}\t{uid}
            Threads:\t{threads}
            CapEff:\t{cap_eff:016x}
            Cpus_allowed_list:\t{cpus}
            """))
        self.write(f"{base}/limits", LIMITS_HEAD + "".join(
            f"{what:<26}{str(soft):<21}{str(hard):<21}{unit:<10}\n"
            for what, (soft, hard), unit in (("Max cpu time", ("unlimited", "unlimited"), "seconds"),
                                             ("Max open files", nofile, "files"),
                                             ("Max locked memory", memlock, "bytes"))))
        self.write(f"{base}/cgroup", cgroup)
        fields = [pid, f"({name})", "S"] + [0] * 35 + [last_cpu] + [0] * 12  # field 39: the CPU it last ran on
        self.write(f"{base}/stat", " ".join(map(str, fields)) + "\n")
        self.write(f"{base}/task/{pid}/children", " ".join(map(str, children)) + (" " if children else ""))
        env = environ or {"PATH": "/usr/bin"}
        (self.root / f"{base}/environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
        return self

    def self_is(self, pid: int) -> "FakeHost":
        """``proc/self`` names ``pid`` (the process whose limits the host checks read without a server)."""
        link = self.root / "proc/self"
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        os.symlink(str(pid), link)
        return self

    # -- cgroups --------------------------------------------------------------------------

    def cgroup_v2(self, path: str = "/system.slice/shmserve.service", *, cpu_max: str = "max 100000",
                  periods: int = 0, throttled: int = 0, throttled_usec: int = 0,
                  parent_cpu_max: str | None = None) -> "FakeHost":
        self.write("proc/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
                                  "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n")
        where = "sys/fs/cgroup" + path
        self.write(f"{where}/cpu.max", cpu_max + "\n")
        self.write(f"{where}/cpu.stat", f"usage_usec 123456\nuser_usec 100000\nsystem_usec 23456\n"
                                        f"nr_periods {periods}\nnr_throttled {throttled}\n"
                                        f"throttled_usec {throttled_usec}\n")
        if parent_cpu_max is not None:
            self.write(f"sys/fs/cgroup{path.rsplit('/', 1)[0]}/cpu.max", parent_cpu_max + "\n")
        return self

    def cgroup_v1(self, path: str = "/", *, quota: int = -1, period: int = 100000, periods: int = 0,
                  throttled: int = 0, throttled_ns: int = 0) -> "FakeHost":
        self.write("proc/mounts", "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0\n"
                                  "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n")
        where = "sys/fs/cgroup/cpu,cpuacct" + path.rstrip("/")
        self.write(f"{where}/cpu.cfs_quota_us", f"{quota}\n")
        self.write(f"{where}/cpu.cfs_period_us", f"{period}\n")
        self.write(f"{where}/cpu.stat", f"nr_periods {periods}\nnr_throttled {throttled}\n"
                                        f"throttled_time {throttled_ns}\n")
        return self

    # -- CPUs, memory -----------------------------------------------------------------------

    def governors(self, cpus, governor: str) -> "FakeHost":
        for cpu in cpus:
            self.write(f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor", governor + "\n")
        return self

    def smt(self, *cores: str) -> "FakeHost":
        """Each argument one core's siblings ("0,4"): every CPU of it gets that thread_siblings_list."""
        from shmserve.placement import parse_cpulist

        for core in cores:
            for cpu in parse_cpulist(core):
                self.write(f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", core + "\n")
        return self

    def numa(self, **nodes: str) -> "FakeHost":
        """numa(node0="0-3", node1="4-7")."""
        for name, cpus in nodes.items():
            self.write(f"sys/devices/system/node/{name}/cpulist", cpus + "\n")
        return self

    def thp(self, enabled: str = "madvise", defrag: str = "madvise", shmem: str = "never") -> "FakeHost":
        def line(options, chosen):
            return " ".join(f"[{o}]" if o == chosen else o for o in options) + "\n"

        base = "sys/kernel/mm/transparent_hugepage"
        self.write(f"{base}/enabled", line(("always", "madvise", "never"), enabled))
        self.write(f"{base}/defrag", line(("always", "defer", "defer+madvise", "madvise", "never"), defrag))
        self.write(f"{base}/shmem_enabled", line(("always", "within_size", "advise", "never", "deny", "force"),
                                                 shmem))
        return self

    def gpu(self, bus: str, *, model: str = "NVIDIA H200", uuid: str = "GPU-1111", local: str = "0-7",
            numa_node: int = 0, link: tuple = ("32.0 GT/s PCIe", "32.0 GT/s PCIe", 16, 16)) -> "FakeHost":
        self.write(f"proc/driver/nvidia/gpus/{bus}/information",
                   f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n")
        base = f"sys/bus/pci/devices/{bus}"
        self.write(f"{base}/local_cpulist", local + "\n")
        self.write(f"{base}/numa_node", f"{numa_node}\n")
        for name, value in zip(("current_link_speed", "max_link_speed", "current_link_width", "max_link_width"),
                               link):
            self.write(f"{base}/{name}", f"{value}\n")
        return self


# -- a fake nvidia-smi ----------------------------------------------------------------------

GOOD_ROW = {
    "index": "0", "name": "NVIDIA H200", "pci.bus_id": "00000000:1B:00.0", "driver_version": "580.65.06",
    "compute_cap": "9.0", "persistence_mode": "Enabled", "utilization.gpu": "35", "temperature.gpu": "41",
    "power.draw": "250.12", "power.limit": "700.00", "clocks.sm": "1980", "clocks.max.sm": "1980",
    "clocks.mem": "3201", "clocks.max.mem": "3201", "clocks_event_reasons.active": "0x0000000000000000",
    "pcie.link.gen.current": "5", "pcie.link.gen.max": "5", "pcie.link.width.current": "16",
    "pcie.link.width.max": "16", "ecc.mode.current": "Enabled", "ecc.errors.corrected.volatile.total": "0",
    "ecc.errors.uncorrected.volatile.total": "0", "remapped_rows.pending": "No", "remapped_rows.failure": "No",
    "memory.total": "143771", "memory.used": "2048",
}

BANNER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.65.06              Driver Version: 580.65.06      CUDA Version: 13.0     |
+-----------------------------------------------------------------------------------------+
"""


def fake_nvidia_smi(directory: Path, rows: list[dict], *, refuse: tuple = (), hang: bool = False,
                    banner: str = BANNER) -> Path:
    """An executable ``directory/nvidia-smi`` that answers ``--query-gpu=F1,F2 --format=csv,...``
    with the values of ``rows`` for those fields (like the real one, "[N/A]" for one a row lacks),
    refuses fields in ``refuse`` as the real one refuses a field it does not know, prints
    ``banner`` when run bare, and with ``hang`` never answers.  Each call's argv is appended to
    ``directory/calls.jsonl``."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "nvidia-smi"
    program.write_text(f"""#!{sys.executable}
import json, sys, time
ROWS = {json.dumps(rows)!s}
REFUSE = {json.dumps(list(refuse))!s}
with open({str(directory / 'calls.jsonl')!r}, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if {hang!r}:
    time.sleep(3600)
args = sys.argv[1:]
if not args:
    sys.stdout.write({banner!r})
    sys.exit(0)
query = next(a for a in args if a.startswith("--query-gpu="))
fields = query.split("=", 1)[1].split(",")
for f in fields:
    if f in REFUSE:
        print('Field "%s" is not a valid field to query.' % f)
        print('Run "nvidia-smi --help-query-gpu" for a list of valid fields.')
        sys.exit(2)
for row in ROWS:
    print(", ".join(row.get(f, "[N/A]") for f in fields))
""")
    program.chmod(program.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return program


# -- an instance as the arena and a live server's answers show it ------------------------------

def worker(index: int, model: str, pid: int, *, device: str = "cpu", pinned: str | None = None,
           state: str = "ready", alive: bool = True, threads: dict | None = None, signatures: dict | None = None,
           requests: int = 100, restarts: int = 0, crash_streak: int = 0, heartbeat_age_s: float = 0.2,
           last_exit: str | None = None) -> dict:
    """One worker, as both the arena's snapshot and ``info`` give it (``split`` separates them)."""
    return {"index": index, "model": model, "version": 1, "device": device, "pid": pid, "state": state,
            "alive": alive, "cpus": pinned, "heartbeat_age_s": heartbeat_age_s, "requests": requests,
            "errors": 0, "restarts": restarts, "crash_streak": crash_streak, "restart_in_s": None,
            "threads": threads, "signatures": signatures, "last_exit": last_exit, "cpus_from": "test"}


def stage_means(queue=50.0, copy_in=20.0, compute=500.0, copy_out=20.0, handoff=10.0, count=1000) -> dict:
    """``latency_us`` of one model as the arena's snapshot gives it."""
    total = queue + copy_in + compute + copy_out + handoff
    out = {s: {"count": count, "mean_us": v, "p50_us": None, "p90_us": None, "p99_us": None}
           for s, v in (("queue", queue), ("copy_in", copy_in), ("compute", compute), ("copy_out", copy_out),
                        ("total", total))}
    out["batch_size"] = {"count": count, "mean_us": 1.0}
    return out


def window(seconds: float, count: int, queue=50.0, copy_in=20.0, compute=500.0, copy_out=20.0, handoff=10.0,
           outcomes: dict | None = None, p99=None) -> dict:
    """One of ``info``'s history windows (``shmserve.frontend.history``)."""
    means = {"queue": queue, "copy_in": copy_in, "compute": compute, "copy_out": copy_out}
    stages = {s: [count, int(v * count)] for s, v in means.items()}
    stages["total"] = [count, int((sum(means.values()) + handoff) * count)]
    return {"seconds": seconds, "stages": stages, "p50_us": None, "p99_us": p99, "outcomes": outcomes or {}}


def service(workers: list[dict], *, owner_pid: int = 4000, owner_alive: bool = True, latency: dict | None = None,
            regions: list | None = None, history: dict | None = None, repository: dict | None = None,
            stuck: list | None = None, limits: dict | None = None):
    """A live (or, with ``owner_alive=False``, dead) instance's Service from plain data."""
    from shmserve.doctor.context import Service

    snap = {"instance": "fake", "arena": "/shmserve.fake", "owner_pid": owner_pid, "owner_alive": owner_alive,
            "socket": "/nowhere.sock", "state": "live", "workers": workers, "latency_us": latency or {},
            "regions": regions or [], "stuck": stuck or []}
    if not owner_alive:
        return Service("fake", "dead", "front-end gone", snapshot=snap)
    info = {"workers": workers, "history": history, "limits": limits or {}}
    return Service("fake", "live", snapshot=snap, info=info, models=[],
                   repository=repository or {"models": [], "canaries": {}, "events": []})
