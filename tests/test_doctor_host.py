"""`shmserve doctor`'s host and placement checks on fake machines: each check over a fake /proc and
/sys tree that triggers it and one that does not, read through the checks' one root directory
(`shmserve.doctor.host.Host`); and a healthy machine that reports nothing above "info"."""

from __future__ import annotations

import pytest

from shmserve.doctor import CHECKS, checks_host, run_checks
from shmserve.doctor.context import Context, ModelFacts, Service, Settings
from shmserve.doctor.findings import CRITICAL, INFO, WARNING
from shmserve.doctor.gpu import GpuFacts, query
from shmserve.doctor.host import Host

from helpers.fake_host import GOOD_ROW, FakeHost, fake_nvidia_smi, service, stage_means, worker

MiB = 1 << 20
FRONT = 4000  # the fake front-end's pid
ORT4 = {"runtime": "onnxruntime", "intra_op": 4, "inter_op": 1, "env": {}}
ORT1 = {"runtime": "onnxruntime", "intra_op": 1, "inter_op": 1, "env": {}}


def settings(**over) -> Settings:
    values = dict(source="test", arena_bytes=192 * MiB, max_connections=512, max_regions=1024,
                  max_region_bytes_per_connection=1 << 30, max_region_bytes_per_uid=4 << 30, spin_us=300,
                  memory_budget={}, models=[])
    values.update(over)
    return Settings(**values)


def context(root, svc: Service | None = None, *, gpus: GpuFacts | None = None, sample_s: float = 0.0, sleep=None,
            **over) -> Context:
    return Context(Host(root), gpus or GpuFacts(None, error="nvidia-smi is not on the PATH"),
                   svc or Service("fake", "none"), settings(**over), sample_s, sleep)


def check(check_id: str, ctx: Context):
    """(findings, why skipped) of one check."""
    (entry,) = [c for c in CHECKS if c.id == check_id]
    results, findings = run_checks(ctx, [entry])
    assert results[0].error is None, results[0].error
    return findings, results[0].skipped


def machine(tmp_path, **proc) -> FakeHost:
    host = FakeHost(tmp_path / "root")
    host.process(FRONT, **proc).self_is(FRONT)
    return host


def live_front(tmp_path, workers, **proc):
    """A fake machine whose front-end (FRONT) is live, and its Service."""
    return machine(tmp_path, **proc), service(workers, owner_pid=FRONT)


# -- host.cgroup_cpu ------------------------------------------------------------------------

def test_a_cgroup_v2_quota_below_the_cpus_the_service_may_use_is_a_warning(tmp_path):
    host = machine(tmp_path).cgroup_v2(cpu_max="200000 100000", periods=1000)
    found, _ = check("host.cgroup_cpu", context(host.root))
    (f,) = found
    assert f.severity == WARNING and "2 CPUs" in f.title and "8 CPUs" in f.title
    assert "sys/fs/cgroup/system.slice/shmserve.service/cpu.max" in f.measured and "CPUQuota=" in f.fix
    host.cgroup_v2(cpu_max="max 100000", periods=1000)
    assert check("host.cgroup_cpu", context(host.root))[0] == []


def test_a_parents_quota_binds_too(tmp_path):
    host = machine(tmp_path).cgroup_v2(cpu_max="max 100000", parent_cpu_max="100000 100000", periods=10)
    (f,) = check("host.cgroup_cpu", context(host.root))[0]
    assert f.data["cgroup"] == "/system.slice" and f.data["quota_cpus"] == 1.0


def test_throttled_periods_are_a_warning_with_the_counters(tmp_path):
    host = machine(tmp_path).cgroup_v2(periods=1000, throttled=300, throttled_usec=4_500_000)
    (f,) = check("host.cgroup_cpu", context(host.root))[0]
    assert f.title == "the service's cgroup is being throttled"
    assert "300 of 1000 periods throttled (30.0%)" in f.measured and "4.5 s" in f.measured
    host.cgroup_v2(periods=1000, throttled=5, throttled_usec=1000)  # 0.5 %: noise
    assert check("host.cgroup_cpu", context(host.root))[0] == []


def test_throttling_that_grows_while_doctor_watches_is_caught(tmp_path):
    host = machine(tmp_path).cgroup_v2(periods=100000, throttled=10)  # 0.01 % so far: nothing by itself

    def sleep(seconds):  # the time doctor waits: the cgroup is throttled meanwhile
        host.cgroup_v2(periods=100010, throttled=17, throttled_usec=80_000)

    (f,) = check("host.cgroup_cpu", context(host.root, sample_s=1.0, sleep=sleep))[0]
    assert "in the last 1 s: 7 of 10 periods" in f.measured and "(growing)" in f.measured
    assert f.data["sample"] == {"seconds": 1.0, "periods": 10, "throttled": 7, "throttled_usec": 80_000} or \
        f.data["sample"]["throttled"] == 7

    def quiet(seconds):
        host.cgroup_v2(periods=100020, throttled=17, throttled_usec=80_000)

    assert check("host.cgroup_cpu", context(host.root, sample_s=1.0, sleep=quiet))[0] == []


def test_cgroup_v1_quota_and_throttling(tmp_path):
    host = machine(tmp_path, cgroup="4:memory:/x\n2:cpu,cpuacct:/\n0::/\n")
    host.cgroup_v1(quota=50000, periods=400, throttled=100, throttled_ns=2_000_000_000)
    found = check("host.cgroup_cpu", context(host.root))[0]
    assert [f.title for f in found] == ["a CPU quota of 0.5 CPUs, below the 8 CPUs the service may run on",
                                        "the service's cgroup is being throttled"]
    assert "cpu.cfs_quota_us" in found[0].measured and "2.0 s in all" in found[1].measured
    host.cgroup_v1(quota=-1, periods=400)
    assert check("host.cgroup_cpu", context(host.root))[0] == []


def test_no_cpu_controller_is_a_skip_saying_where_it_looked(tmp_path):
    host = machine(tmp_path, cgroup="")
    found, skipped = check("host.cgroup_cpu", context(host.root))
    assert found == [] and "no CPU controller" in skipped


# -- host.cpufreq -------------------------------------------------------------------------

def test_a_power_saving_governor_is_a_warning(tmp_path):
    host = machine(tmp_path).governors(range(8), "powersave")
    (f,) = check("host.cpufreq", context(host.root))[0]
    assert f.severity == WARNING and "powersave on CPUs 0-7" in f.measured and "cpupower frequency-set" in f.fix
    host.governors(range(8), "performance")
    assert check("host.cpufreq", context(host.root))[0] == []
    assert "no sys/devices/system/cpu" in check("host.cpufreq", context(machine(tmp_path / "vm").root))[1]


def test_the_governor_is_judged_on_the_workers_cpus(tmp_path):
    host = machine(tmp_path).governors(range(4), "performance").governors(range(4, 8), "powersave")
    host.process(4100, cpus="0-3")
    svc = service([worker(0, "m", 4100, pinned="0-3")], owner_pid=FRONT)
    assert check("host.cpufreq", context(host.root, svc))[0] == []  # its CPUs run at full speed
    host.process(4100, cpus="2-5")
    (f,) = check("host.cpufreq", context(host.root, svc))[0]
    assert "powersave on CPUs 4-5" in f.measured


# -- host.smt -----------------------------------------------------------------------------

def test_a_lane_client_spinning_on_a_pinned_workers_sibling_is_a_warning(tmp_path):
    host = machine(tmp_path).smt("0,4", "1,5", "2,6", "3,7")
    host.process(4100, cpus="0").process(5000, name="client", last_cpu=4)
    lane = [{"kind": "lane", "owner_pid": 5000, "id": 1}]
    svc = service([worker(0, "m", 4100, pinned="0")], owner_pid=FRONT, regions=lane)
    (f,) = check("host.smt", context(host.root, svc))[0]
    assert "client pid 5000" in f.subject and "last ran on CPU 4" in f.measured and "taskset" in f.fix
    host.process(5000, name="client", last_cpu=2)  # on a core of its own
    assert check("host.smt", context(host.root, svc))[0] == []
    host.process(5000, name="client", last_cpu=4)
    assert "spin_us = 0" in check("host.smt", context(host.root, svc, spin_us=0))[1]


# -- host.thp -----------------------------------------------------------------------------

def test_synchronous_huge_page_compaction_is_a_warning(tmp_path):
    host = machine(tmp_path).thp(defrag="always")
    (f,) = check("host.thp", context(host.root))[0]
    assert f.severity == WARNING and f.measured == "defrag = always" and "defer+madvise" in f.fix
    host.thp(defrag="madvise")
    assert check("host.thp", context(host.root))[0] == []
    host.thp(enabled="always", defrag="defer+madvise")
    assert [f.severity for f in check("host.thp", context(host.root))[0]] == [INFO]


# -- host.memlock -------------------------------------------------------------------------

GPU_MODEL = ModelFacts("det", "tensorrt", "/models/det.plan", ("cuda:0",), 1)


def test_memlock_below_the_arena_stops_gpu_workers_critical(tmp_path):
    host = machine(tmp_path, memlock=(8 * MiB, 8 * MiB))
    (f,) = check("host.memlock", context(host.root, models=[GPU_MODEL]))[0]
    assert f.severity == CRITICAL and "8 MiB" in f.measured and "192 MiB" in f.expected
    assert "LimitMEMLOCK=infinity" in f.fix and "det" in f.why
    host.process(FRONT, memlock=(256 * MiB, 256 * MiB))  # the arena fits, one uid's regions do not
    (f,) = check("host.memlock", context(host.root, models=[GPU_MODEL]))[0]
    assert f.severity == WARNING
    host.process(FRONT, memlock=("unlimited", "unlimited"))
    assert check("host.memlock", context(host.root, models=[GPU_MODEL]))[0] == []
    host.process(FRONT, memlock=(8 * MiB, 8 * MiB), uid=0)  # root is not limited
    assert check("host.memlock", context(host.root, models=[GPU_MODEL]))[0] == []
    host.process(FRONT, memlock=(8 * MiB, 8 * MiB), cap_eff=1 << 14)  # nor is CAP_IPC_LOCK
    assert check("host.memlock", context(host.root, models=[GPU_MODEL]))[0] == []


def test_memlock_does_not_matter_without_a_gpu_model(tmp_path):
    host = machine(tmp_path, memlock=(8 * MiB, 8 * MiB))
    found, skipped = check("host.memlock", context(host.root))
    assert found == [] and "no GPU model" in skipped


def test_memlock_of_a_live_gpu_worker_is_its_own(tmp_path):
    host = machine(tmp_path).process(4100, memlock=(64 * 1024, 64 * 1024))
    svc = service([worker(0, "det", 4100, device="cuda:0")], owner_pid=FRONT)
    (f,) = check("host.memlock", context(host.root, svc))[0]
    assert f.severity == CRITICAL and "worker 0 (det" in f.subject


# -- host.shm -----------------------------------------------------------------------------

def test_a_dev_shm_too_small_for_the_arena_is_critical_before_the_start(tmp_path):
    host = machine(tmp_path)
    space = Host(host.root).shm_space()
    assert space is not None
    (f,) = check("host.shm", context(host.root, arena_bytes=space[0] + (1 << 40)))[0]
    assert f.severity == CRITICAL and "--shm-size" in f.fix and "statvfs" in f.measured
    assert check("host.shm", context(host.root, arena_bytes=MiB))[0] == []


def test_a_live_dev_shm_nearly_full_is_a_warning():
    judge = checks_host.judge_shm
    (f,) = judge(total=64 * MiB, free=2 * MiB, arena=32 * MiB, live=True, source="test")
    assert f.severity == WARNING and "2 MiB free of 64 MiB" in f.measured
    assert judge(total=64 * MiB, free=30 * MiB, arena=32 * MiB, live=True, source="test") == []
    assert judge(total=64 * GiB, free=2 * GiB, arena=32 * MiB, live=True, source="test") == []  # 1 GiB+ left


GiB = 1 << 30


# -- host.fds -----------------------------------------------------------------------------

def test_a_descriptor_limit_below_what_the_limits_can_use_is_a_warning(tmp_path):
    """The budget is the server's own (ServerConfig.descriptor_budget, which serve refuses to start
    without): each door's connections, regions and lanes, registrations, workers."""
    import dataclasses

    from shmserve.config import demo_config

    plain = demo_config().descriptor_budget()
    need = sum(plain.values())
    host = machine(tmp_path, nofile=(1024, 1024))
    (f,) = check("host.fds", context(host.root, descriptors=plain))[0]
    assert "hard limit 1024" in f.measured and f"= {need}" in f.expected
    assert "2048 server.max_regions" in f.expected and "512 server.max_connections (Unix socket)" in f.expected
    assert "LimitNOFILE=65536" in f.fix
    host.process(FRONT, nofile=(1024, 65536))  # the server lifts its soft limit to the hard one
    assert check("host.fds", context(host.root, descriptors=plain))[0] == []
    host.process(FRONT, nofile=(need, need))  # enough, until the v2 doors and their registrations are on
    assert check("host.fds", context(host.root, descriptors=plain))[0] == []
    doors = dataclasses.replace(demo_config(), http="127.0.0.1:0", grpc="127.0.0.1:0",
                                v2_system_shared_memory=True).descriptor_budget()
    (f,) = check("host.fds", context(host.root, descriptors=doors))[0]
    assert "server.max_connections (gRPC)" in f.expected and "registered shared memory" in f.expected


# -- placement.numa -------------------------------------------------------------------------

def two_sockets(tmp_path) -> FakeHost:
    host = machine(tmp_path, cpus="0-15")
    host.write("sys/devices/system/cpu/online", "0-15\n").numa(node0="0-7", node1="8-15")
    return host.gpu("0000:1b:00.0", local="0-7", numa_node=0)


def test_a_gpu_worker_on_cpus_far_from_its_gpu_is_a_warning(tmp_path):
    host = two_sockets(tmp_path).process(4100, cpus="0-15")
    svc = service([worker(0, "det", 4100, device="cuda:0")], owner_pid=FRONT)
    (f,) = check("placement.numa", context(host.root, svc))[0]
    assert f.severity == WARNING and "CPUs 0-15" in f.measured and "NUMA nodes [0, 1]" in f.measured
    assert "within 0-7, local to cuda:0 (PCI 0000:1b:00.0)" in f.expected and 'cpus = "auto"' in f.fix
    host.process(4100, cpus="0-7")
    assert check("placement.numa", context(host.root, svc))[0] == []


def test_a_configured_cpulist_far_from_its_gpu_is_caught_before_the_start(tmp_path):
    host = two_sockets(tmp_path)
    far = ModelFacts("det", "tensorrt", "/x.plan", ("cuda:0",), 1, cpus="8-15")
    (f,) = check("placement.numa", context(host.root, models=[far]))[0]
    assert "model det on cuda:0" in f.subject and 'cpus = "8-15"' in f.measured
    near = ModelFacts("det", "tensorrt", "/x.plan", ("cuda:0",), 1, cpus="auto")
    assert check("placement.numa", context(host.root, models=[near]))[0] == []


# -- placement.threads ----------------------------------------------------------------------

def test_thread_pools_larger_than_the_cpus_they_share_are_a_warning(tmp_path):
    host = machine(tmp_path).process(4100, cpus="0-1", threads=7).process(4101, cpus="0-1", threads=7)
    svc = service([worker(0, "m", 4100, pinned="0-1", threads=ORT4), worker(1, "m", 4101, pinned="0-1", threads=ORT4)],
                  owner_pid=FRONT)
    (f,) = check("placement.threads", context(host.root, svc))[0]
    assert f.title == "8 compute threads share 2 CPUs" and "onnxruntime intra-op threads 4" in f.measured
    assert "7 threads in proc/4100/status" in f.measured and "intra_op_threads = 1" in f.fix
    svc = service([worker(0, "m", 4100, pinned="0-1", threads=ORT1), worker(1, "m", 4101, pinned="0-1", threads=ORT1)],
                  owner_pid=FRONT)
    assert check("placement.threads", context(host.root, svc))[0] == []


def test_workers_on_cpus_of_their_own_do_not_add_up(tmp_path):
    host = machine(tmp_path).process(4100, cpus="0-3").process(4101, cpus="4-7")
    svc = service([worker(0, "m", 4100, pinned="0-3", threads=ORT4), worker(1, "m", 4101, pinned="4-7", threads=ORT4)],
                  owner_pid=FRONT)
    assert check("placement.threads", context(host.root, svc))[0] == []


def test_omp_num_threads_counts_where_the_runtime_does_not_say(tmp_path):
    host = machine(tmp_path).process(4100, cpus="0-1")
    omp = {"env": {"OMP_NUM_THREADS": "16"}}
    (f,) = check("placement.threads", context(host.root, service([worker(0, "m", 4100, threads=omp)],
                                                                   owner_pid=FRONT)))[0]
    assert "OMP_NUM_THREADS=16" in f.measured
    found, skipped = check("placement.threads", context(host.root, service([worker(0, "m", 4100, threads={})],
                                                                            owner_pid=FRONT)))
    assert found == [] and "no ready worker reported" in skipped


def test_a_pool_across_numa_nodes_is_said(tmp_path):
    host = two_sockets(tmp_path).process(4100, cpus="0-15")
    torch16 = {"runtime": "torch", "intra_op": 16, "inter_op": 1}
    (f,) = check("placement.threads", context(host.root, service([worker(0, "m", 4100, threads=torch16)],
                                                                   owner_pid=FRONT)))[0]
    assert f.severity == INFO and "NUMA nodes [0, 1]" in f.measured


# -- placement.frontend ---------------------------------------------------------------------

def test_a_front_end_with_no_cpu_but_spinning_workers_is_a_warning(tmp_path):
    host = machine(tmp_path, cpus="0-3").process(4100, cpus="0-1").process(4101, cpus="2-3")
    svc = service([worker(0, "m", 4100, pinned="0-1"), worker(1, "m", 4101, pinned="2-3")], owner_pid=FRONT)
    (f,) = check("placement.frontend", context(host.root, svc))[0]
    assert f.subject == f"the front-end (pid {FRONT})" and "spin 300 us" in f.measured
    assert "spin_us = 0" in f.fix
    host.process(FRONT, cpus="0-7")  # CPUs 4-7 are its own
    assert check("placement.frontend", context(host.root, svc))[0] == []
    host.process(FRONT, cpus="0-3")
    assert "spin_us = 0" in check("placement.frontend", context(host.root, svc, spin_us=0))[1]


def test_a_door_process_is_judged_like_the_front_end(tmp_path):
    host = machine(tmp_path, cpus="0-7", children=(4100, 4200)).process(4100, cpus="0-3")
    host.process(4200, name="door", cpus="0-3")
    svc = service([worker(0, "m", 4100, pinned="0-3")], owner_pid=FRONT)
    (f,) = check("placement.frontend", context(host.root, svc))[0]
    assert f.subject == "door process 4200 (pid 4200)"


# -- the Host reader --------------------------------------------------------------------------

def test_limits_status_and_stat_are_parsed_as_the_kernel_writes_them(tmp_path):
    host = machine(tmp_path, nofile=(1024, 4096), memlock=("unlimited", "unlimited"), last_cpu=5, threads=9,
                   environ={"OMP_NUM_THREADS": "3"})
    proc = Host(host.root).process(FRONT)
    limits = proc.limits()
    assert (limits["Max open files"].soft, limits["Max open files"].hard) == (1024, 4096)
    assert limits["Max locked memory"].soft is None
    assert (proc.last_cpu(), proc.threads, proc.uid, proc.allowed_cpus) == (5, 9, 1000, frozenset(range(8)))
    assert proc.environ()["OMP_NUM_THREADS"] == "3"
    assert Host(host.root).process(99999) is None
    assert Host(host.root).own_pid() == FRONT


def test_the_real_machine_reads_without_error():
    """On this machine (whatever it is): every reader returns a value or None, never raises."""
    host = Host("/")
    proc = host.process(host.own_pid())
    assert proc is not None and proc.allowed_cpus and proc.limits()["Max open files"].hard
    host.cgroup_cpu(host.own_pid())
    host.thp(), host.numa_nodes(), host.shm_space(), host.siblings(0), host.governor(0)


# -- a healthy machine --------------------------------------------------------------------------

def test_a_healthy_machine_reports_nothing_above_info(tmp_path):
    host = machine(tmp_path, cpus="0-15", memlock=("unlimited", "unlimited"))
    host.write("sys/devices/system/cpu/online", "0-15\n").numa(node0="0-3,8-11", node1="4-7,12-15")
    host.smt("0,8", "1,9", "2,10", "3,11", "4,12", "5,13", "6,14", "7,15").governors(range(16), "performance")
    host.cgroup_v2(periods=5000, throttled=0).thp().gpu("0000:1b:00.0", local="0-3,8-11", numa_node=0)
    # two GPU workers on whole cores of the GPU's node, a lane client on a core of its own
    host.process(4100, cpus="0-1,8-9", threads=6).process(4101, cpus="2-3,10-11", threads=6)
    host.process(5000, name="client", last_cpu=12, cpus="4-7,12-15")
    torch4 = {"runtime": "torch", "intra_op": 4, "inter_op": 1, "env": {}}
    svc = service([worker(0, "det", 4100, device="cuda:0", pinned="0-1,8-9", threads=torch4,
                          signatures={"new": 3, "distinct": 3}),
                   worker(1, "det", 4101, device="cuda:0", pinned="2-3,10-11", threads=torch4,
                          signatures={"new": 3, "distinct": 3})],
                  owner_pid=FRONT, latency={"det": stage_means()}, regions=[{"kind": "lane", "owner_pid": 5000}])
    gpus = query(str(fake_nvidia_smi(tmp_path / "bin", [GOOD_ROW])))
    ctx = context(host.root, svc, gpus=gpus, arena_bytes=MiB,
                  models=[ModelFacts("det", "torch", "/m.pt", ("cuda:0",), 2, cpus="auto")],
                  memory_budget={"cuda:0": 100 << 30})
    results, findings = run_checks(ctx)
    assert [f"{f.check}: {f.title}" for f in findings if f.severity != INFO] == []
    assert not [r for r in results if r.error]
    ran = {r.check for r in results if r.ran}
    assert {"host.cgroup_cpu", "host.cpufreq", "host.smt", "host.thp", "host.memlock", "host.shm", "host.fds",
            "placement.numa", "placement.threads", "placement.frontend", "gpu.persistence", "gpu.clocks",
            "gpu.pcie", "gpu.ecc", "gpu.memory", "service.stages", "service.shapes", "service.workers"} <= ran


@pytest.mark.parametrize("check_id", [c.id for c in CHECKS])
def test_every_check_on_an_empty_tree_skips_or_finds_without_failing(tmp_path, check_id):
    found, _ = check(check_id, context(tmp_path))
    assert all(f.check == check_id for f in found)


def test_a_small_crowded_cpu_set_inside_a_larger_one_is_its_own_finding(tmp_path):
    """As on the H200 (2026-12-02): two ONNX Runtime workers of 4 threads pinned to CPUs 0-1, two torch
    workers of 16 on 0-15.  Each set is judged with the workers confined to it: 8 threads on 2 CPUs
    (1 each), then 32 on the 14 CPUs left (7 each); was one '40 compute threads share 16 CPUs' with 4 each."""
    host = machine(tmp_path)
    for pid, cpus in ((4100, "0-1"), (4101, "0-1"), (4102, "0-15"), (4103, "0-15")):
        host = host.process(pid, cpus=cpus, threads=20)
    torch16 = {"runtime": "torch", "intra_op": 16, "inter_op": 1}
    svc = service([worker(0, "crowded", 4100, pinned="0-1", threads=ORT4),
                   worker(1, "crowded", 4101, pinned="0-1", threads=ORT4),
                   worker(2, "convnet", 4102, pinned="0-15", threads=torch16),
                   worker(3, "convnet", 4103, pinned="0-15", threads=torch16)], owner_pid=FRONT)
    small, large = check("placement.threads", context(host.root, svc))[0]
    assert small.title == "8 compute threads share 2 CPUs" and "intra_op_threads = 1" in small.fix
    assert "crowded" in small.fix and "convnet" not in small.fix
    assert large.title == "32 compute threads share 14 CPUs" and "intra_op_threads = 7" in large.fix
    assert large.data["cpus"] == "2-15" and "CPUs 2-15" in large.expected
