"""Operations, for real: systemd units, socket activation, the notify protocol and watchdog,
inspect and cleanup of live and crashed instances, metrics, JSON logs, reload."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from shmserve import Client

from conftest import new_instance, shm_names
from helpers.server import TESTS_DIR, ServerProcess, scrape_text, wait_for

ROOT = TESTS_DIR.parent
IDENTITY = """
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
"""


def cli(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "shmserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)




# -- systemd units ------------------------------------------------------------------------

def test_units_verify(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed on this machine")
    exe = shutil.which("shmserve") or str(Path(sys.executable).parent / "shmserve")
    for unit in ("shmserve.service", "shmserve.socket"):
        text = (ROOT / "systemd" / unit).read_text().replace("/opt/shmserve/bin/shmserve", exe)
        (tmp_path / unit).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "shmserve.service"),
                        str(tmp_path / "shmserve.socket")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    service = (ROOT / "systemd" / "shmserve.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "LimitMEMLOCK=infinity", "KillMode=mixed", "ExecReload=",
                 "RuntimeDirectory=shmserve", "DevicePolicy=closed", "ProtectSystem=strict", "NoNewPrivileges=yes"):
        assert line in service
    assert "PrivateDevices" not in service.replace("no PrivateDevices=", "")
    # docs/systemd.md installs into the virtual environment ExecStart names, and the runtime
    # directory's group is the clients' group (test_clients_group_reaches_the_socket_others_do_not)
    doc = (ROOT / "docs" / "systemd.md").read_text()
    assert "ExecStart=/opt/shmserve/bin/shmserve serve" in service
    assert "sudo python3 -m venv /opt/shmserve" in doc and "sudo /opt/shmserve/bin/pip install ." in doc
    for line in ("User=shmserve", "Group=shmserve-clients", "RuntimeDirectoryMode=0750"):
        assert line in service.splitlines()
    socket_unit = (ROOT / "systemd" / "shmserve.socket").read_text().splitlines()
    assert "SocketGroup=shmserve-clients" in socket_unit and "SocketMode=0660" in socket_unit
    example = (ROOT / "systemd" / "shmserve.toml").read_text()
    assert 'path = "/var/lib/shmserve/models/demo.onnx"' in example and "/var/lib/shmserve/models/demo.onnx" in doc


@pytest.fixture
def clients_group_and_two_users():
    """A clients' group, a user in it and a user outside it, made with groupadd/useradd (root only)
    and removed again: (group name, member's passwd entry, outsider's passwd entry)."""
    import pwd
    import uuid

    tools = ("groupadd", "groupdel", "useradd", "userdel")
    if os.getuid() != 0 or not all(shutil.which(t) for t in tools):
        pytest.skip("needs root and " + ", ".join(tools))
    tag = uuid.uuid4().hex[:8]
    group, member, outsider = f"ssg{tag}", f"ssm{tag}", f"sso{tag}"
    made: list[list[str]] = []
    try:
        subprocess.run(["groupadd", group], check=True, capture_output=True)
        made.append(["groupdel", group])
        for name, extra in ((member, ["-G", group]), (outsider, [])):
            subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *extra, name], check=True,
                           capture_output=True)
            made.append(["userdel", name])
        yield group, pwd.getpwnam(member), pwd.getpwnam(outsider)
    finally:
        for argv in reversed(made):
            subprocess.run(argv, capture_output=True)


def test_clients_group_reaches_the_socket_others_do_not(tmp_path, clients_group_and_two_users):
    """docs/systemd.md's access, with two real users: the runtime directory as systemd makes it
    (the server's uid, the clients' group, 0750) and the example config systemd/shmserve.toml as
    shipped (its group, instance and model path substituted).  A member of the group infers; a user
    outside it cannot reach the socket.  The server runs as root here, standing for the service user
    (the interpreter under /root is not reachable by other users); the users connect from forked
    children that dropped to them."""
    import grp
    import tempfile

    from helpers.other_user import as_user
    from shmserve.config import demo_config

    group, member, outsider = clients_group_and_two_users
    gid = grp.getgrnam(group).gr_gid
    rundir = Path(tempfile.mkdtemp(prefix="shmserve-run-"))
    os.chown(rundir, os.getuid(), gid)
    os.chmod(rundir, 0o750)
    srv = ServerProcess(tmp_path, "", socket_dir=rundir)
    example = (ROOT / "systemd" / "shmserve.toml").read_text()
    substitutions = (('"shmserve-clients"', f'"{group}"'), ('instance = "shmserve"', f'instance = "{srv.instance}"'),
                     ("/var/lib/shmserve/models/demo.onnx", demo_config().models[0].path))
    for old, new in substitutions:
        assert old in example, old
        example = example.replace(old, new)
    srv.config_path.write_text(example)
    srv.start()
    try:
        st = os.stat(srv.socket)
        assert (st.st_mode & 0o777, st.st_gid) == (0o660, gid)

        def infer() -> str:
            with Client(srv.socket, timeout=30) as c:
                return str(c.infer("demo", {"image": np.zeros((1, 3, 32, 32), np.float32)})["probabilities"].shape)

        def groups(pw) -> tuple[int, ...]:
            return tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))

        assert gid in groups(member) and gid not in groups(outsider)
        assert as_user(member.pw_uid, member.pw_gid, groups(member), infer) == "(1, 10)"
        refused = as_user(outsider.pw_uid, outsider.pw_gid, groups(outsider), infer)
        assert "ermission" in refused, refused
        assert as_user(member.pw_uid, member.pw_gid, groups(member), infer) == "(1, 10)"  # still serving
    finally:
        assert srv.stop() == 0, srv.log()
        os.rmdir(rundir)


def test_socket_activation(tmp_path):
    if not shutil.which("systemd-socket-activate"):
        pytest.skip("systemd-socket-activate is not installed on this machine")
    before = shm_names()
    sock = str(tmp_path / "activated.sock")
    cfg = tmp_path / "act.toml"
    instance = new_instance("act")
    cfg.write_text(f'[server]\ninstance = "{instance}"\n{IDENTITY}')
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    proc = subprocess.Popen(["systemd-socket-activate", "-l", sock, sys.executable, "-m", "shmserve.cli", "serve",
                             "--config", str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: os.path.exists(sock), what="the activation socket")
        with Client(sock, timeout=60) as c:  # connects to systemd's socket; the server starts on demand
            assert c.infer("identity", {"x": np.arange(5, dtype=np.uint8)})["y"].tolist() == [0, 1, 2, 3, 4]
            assert c.info()["socket"] == sock
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode(errors="replace")
    assert b"socket activation: using" in out
    assert shm_names() == before


# -- sd_notify and the watchdog -----------------------------------------------------------

class NotifyListener:
    """Plays systemd: a datagram socket as $NOTIFY_SOCKET, collecting every message."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def lines(self) -> list[str]:
        return [m for _, m in self.messages]

    def close(self):
        self.running = False
        self.thread.join(2)
        self.sock.close()


def test_notify_ready_watchdog_wedged_worker_and_stopping(tmp_path, monkeypatch):
    listener = NotifyListener(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s
    srv = ServerProcess(tmp_path, IDENTITY, server_section="worker_timeout_s = 1.0")
    stopped_pid = None
    try:
        srv.start()
        wait_for(lambda: "READY=1" in listener.lines(), what="READY=1")
        ready_at = listener.lines().index("READY=1")
        assert any(m.startswith("STATUS=loading") for m in listener.lines()[:ready_at])
        wait_for(lambda: listener.lines().count("WATCHDOG=1") >= 3, what="watchdog pings")
        (worker,) = srv.info()["workers"]
        stopped_pid = worker["pid"]
        os.kill(stopped_pid, signal.SIGSTOP)  # wedged: alive, but its heartbeat stops
        # Silent for worker_timeout_s, it is wedged and killed at once (stopped, it cannot act on
        # SIGTERM); the watchdog is not fed while it is wedged (that lasts at most one health check
        # now: its "not responding" status may or may not be seen), and is fed again once the
        # worker is back.
        info = wait_for(lambda: (i := srv.info())["workers"][0]["pid"] not in (stopped_pid, None)
                        and i["workers"][0]["state"] == "ready" and i, what="the restart")
        assert info["workers"][0]["restarts"] == 1 and info["workers"][0]["last_exit"] == "killed by SIGKILL"
        assert "is stopped (SIGSTOP?): killing it" in srv.log()
        mark = len(listener.messages)
        wait_for(lambda: "WATCHDOG=1" in listener.lines()[mark:], timeout=30, what="feeding after the restart")
        with srv.client() as c:
            assert c.infer("identity", {"x": np.ones(3, np.uint8)})["y"].sum() == 3
    finally:
        if stopped_pid is not None:
            try:
                os.kill(stopped_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        code = srv.stop()
        listener.close()
    assert code == 0, srv.log()
    assert "STOPPING=1" in listener.lines()
    assert listener.lines().index("STOPPING=1") > listener.lines().index("READY=1")


# -- inspect and cleanup --------------------------------------------------------------------

def test_inspect_live_then_crashed_then_cleanup(tmp_path):
    before = shm_names()
    srv = ServerProcess(tmp_path, IDENTITY + "instances = 2\n").start()
    try:
        def load():
            with srv.client() as c:
                for _ in range(50):
                    c.infer("identity", {"x": np.ones(100, np.uint8)})

        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        r = cli("inspect", "--instance", srv.instance, "--json")  # while it is under load
        for t in threads:
            t.join(60)
        assert r.returncode == 0, r.stderr
        live = json.loads(r.stdout)
        assert live["owner_alive"] is True and live["state"] == "live" and live["socket"] == srv.socket
        assert [w["model"] for w in live["workers"]] == ["identity", "identity"]
        assert all(w["state"] == "ready" and w["alive"] for w in live["workers"])
        r = cli("inspect", "--instance", srv.instance, "--json")
        after = json.loads(r.stdout)
        assert sum(w["requests"] for w in after["workers"]) == 150
        assert after["latency_us"]["identity"]["total"]["count"] == 150
        assert after["slots"]["by_state"]["FREE"] == after["slots"]["total"]
        assert cli("inspect", "--instance", srv.instance, "--check").returncode == 0
        table = cli("inspect", "--instance", srv.instance)
        assert table.returncode == 0 and "identity" in table.stdout and "latency" in table.stdout
    finally:
        srv.kill()  # SIGKILL the front-end: a crash
    dead = json.loads(cli("inspect", "--instance", srv.instance, "--json").stdout)
    assert dead["owner_alive"] is False and dead["workers"]
    check = cli("inspect", "--instance", srv.instance, "--check")
    assert check.returncode == 1 and "front-end pid" in check.stdout
    assert any(left["instance"] == srv.instance for left in dead["leftovers"])
    r = cli("cleanup", "--instance", srv.instance)
    assert r.returncode == 0 and f"removed /dev/shm/shmserve.{srv.instance}" in r.stdout
    assert not os.path.exists(srv.socket)  # the dead instance's socket went too
    assert shm_names() == before
    r = cli("inspect", "--instance", srv.instance)
    assert r.returncode == 3 and "no arena" in r.stderr


def test_inspect_refuses_corrupt_and_foreign_segments(instance_name):
    name = instance_name()
    shm = posix_ipc.SharedMemory(f"/shmserve.{name}", posix_ipc.O_CREX, size=8192)
    try:
        os.pwrite(shm.fd, b"\x01" * 8192, 0)
        r = cli("inspect", "--instance", name)
        assert r.returncode == 2 and "corrupt or foreign" in r.stderr
        r = cli("inspect", "--instance", name, "--check")
        assert r.returncode != 0 and "corrupt or foreign" in (r.stdout + r.stderr)
    finally:
        shm.close_fd()
        shm.unlink()


def test_cleanup_never_touches_a_live_instance_or_its_regions(tmp_path):
    srv = ServerProcess(tmp_path, IDENTITY).start()
    try:
        with srv.client() as c:
            region = c.open_region(1 << 20)
            r = cli("cleanup")
            assert r.returncode == 0 and srv.instance not in r.stdout
            assert region.id in srv.recorded_regions()
    finally:
        assert srv.stop() == 0


# -- metrics, logs, reload ----------------------------------------------------------------

def scrape(path: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    body = scrape_text(path)
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_json_logs_and_reload(tmp_path):
    metrics = str(tmp_path / "metrics.sock")
    srv = ServerProcess(tmp_path, IDENTITY + "max_output_bytes = 1048576\n",
                        extra_args=["--metrics", metrics, "--log-format", "json"]).start()
    try:
        m0 = scrape(metrics)
        key = ("shmserve_requests_total", (("model", "identity"), ("outcome", "ok"), ("version", "1")))
        with srv.client(lanes=False) as c:  # the socket's requests (lane calls are counted below)
            for _ in range(7):
                c.infer("identity", {"x": np.ones(10, np.uint8)})
            with pytest.raises(Exception):
                c.infer("identity", {"x": np.ones(10, np.float32)})
        # (door processes, docs/doors.md, report what they answered themselves every 0.1 s)
        m1 = wait_for(lambda: (lambda m: m if m.get(key, 0) - m0.get(key, 0) >= 7 else None)(scrape(metrics)),
                      "the socket's answers counted")
        assert m1[key] - m0.get(key, 0) == 7
        # refused in submit: counted without a version
        assert m1[("shmserve_requests_total", (("model", "identity"), ("outcome", "bad_dtype"), ("version", "")))] == 1
        count = ("shmserve_request_stage_seconds_count", (("model", "identity"), ("stage", "total"), ("version", "1")))
        assert m1[count] - m0.get(count, 0) == 7
        assert m1[("shmserve_slots", ())] > 0 and ("shmserve_arena_bytes_in_use", ()) in m1
        def total(m, name, **labels):
            return sum(v for (n, ls), v in m.items() if n == name and labels.items() <= dict(ls).items())

        def lane_calls(m) -> int:
            return total(m, "shmserve_worker_requests_total", outcome="ok") - \
                total(m1, "shmserve_worker_requests_total", outcome="ok")

        with srv.client() as c:  # lane calls skip the front-end: the workers' counters see them
            with c.zero_copy("identity", {"x": ((10,), np.uint8)}) as call:
                for _ in range(5):
                    call.run()
                # (a worker counts a call just after publishing its answer: wait, bounded, for the last)
                m2 = wait_for(lambda: (lambda m: m if lane_calls(m) >= 5 else None)(scrape(metrics)),
                              what="the lane calls in shmserve_worker_requests_total")

        assert lane_calls(m2) == 5
        door_lanes = sum(d["lanes"] for d in srv.info().get("doors") or ())  # the door processes' own (doors.md)
        assert total(m2, "shmserve_lanes", model="identity") == 1 + door_lanes
        # Triton's families count lane calls at once (the workers' counters, read at scrape time; a
        # worker counts a call just after publishing its answer: wait, bounded, for the last one)
        m3 = wait_for(lambda: (lambda m: m if total(m, "nv_inference_request_success_total", model="identity") -
                               total(m1, "nv_inference_request_success_total", model="identity") >= 5 else None)(
            scrape(metrics)), what="the lane calls in nv_inference_request_success")
        for family in ("nv_inference_request_success_total", "nv_inference_count_total"):
            assert total(m3, family, model="identity", version="1") - total(m1, family, model="identity") == 5, family
        runs = total(m3, "nv_inference_exec_count_total", model="identity") - \
            total(m1, "nv_inference_exec_count_total", model="identity")
        assert 1 <= runs <= 5, runs  # calls that met in the worker's queue ran as one batch
        # and the request totals once the front-end has read those counters (its heartbeat)
        wait_for(lambda: scrape(metrics)[key] == m1[key] + 5, what="the lane calls in shmserve_requests_total")
        # reload: a bad config keeps the old one; a good one replaces the changed model's workers
        keeper = srv.client()  # a lane open across the reload moves to the restarted worker
        kept = keeper.zero_copy("identity", {"x": ((3,), np.uint8)})
        kept.inputs["x"][...] = 2
        config = srv.config_path.read_text()
        srv.config_path.write_text(config + "bogus_key = 1\n")
        srv.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "keeping the running configuration" in srv.log(), what="the rejected reload")
        srv.config_path.write_text(config.replace("max_output_bytes = 1048576", "max_output_bytes = 2097152"))
        old_pid = srv.info()["workers"][0]["pid"]
        srv.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload: done (replaced the workers of identity:1 (new settings))" in srv.log(),
                 what="the reload")
        wait_for(lambda: (w := srv.info()["workers"][0])["state"] == "ready" and w["pid"] != old_pid,
                 what="the restarted worker")
        with srv.client() as c:
            assert c.infer("identity", {"x": np.ones(4, np.uint8)})["y"].sum() == 4
        wait_for(lambda: (lambda info: info["workers"][0]["lanes"] == 1 + sum(d["lanes"] for d in info.get("doors")
                                                                           or ()))(srv.info()),
                 what="the lane to be attached again (and the door processes' own)")
        assert kept.run()["y"].tolist() == [2, 2, 2]
        kept.release()
        keeper.close()
    finally:
        assert srv.stop() == 0, srv.log()
    lines = [json.loads(line) for line in srv.log().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    assert any(line["msg"].startswith("ready: listening on") for line in lines)
    assert not os.path.exists(metrics)


def test_metrics_refuses_non_loopback(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(IDENTITY)
    r = cli("serve", "--config", str(cfg), "--metrics", "0.0.0.0:9464", "--socket", str(tmp_path / "s.sock"))
    assert r.returncode == 2 and "loopback" in r.stderr


def test_the_config_directory_is_roots_and_only_the_service_reads_it(clients_group_and_two_users):
    """Issue 28 item 7: docs/systemd.md made /etc/shmserve owned by the service user, so the service
    could rewrite its own configuration.  The doc's install lines for it, run as written (only the
    root directory and the group's name changed), leave it root's: the service (a member of the
    group the unit adds, ``SupplementaryGroups=``) reads the config and can neither change it nor add
    a file beside it; a user outside the group cannot read it."""
    import grp
    import re
    import tempfile

    from helpers.other_user import as_user

    group, service, client = clients_group_and_two_users  # the group stands for 'shmserve'
    unit = (ROOT / "systemd" / "shmserve.service").read_text().splitlines()
    assert "SupplementaryGroups=shmserve" in unit and "User=shmserve" in unit
    block = re.search(r"```sh\n(.*?)```", (ROOT / "docs" / "systemd.md").read_text(), re.S).group(1)
    lines = [line for line in block.splitlines() if line.startswith("sudo install") and "/etc/shmserve" in line]
    assert lines, "docs/systemd.md installs nothing into /etc/shmserve"
    top = Path(tempfile.mkdtemp(prefix="shmserve-etc-"))
    try:
        os.chmod(top, 0o755)
        (top / "etc").mkdir(mode=0o755)
        (top / "var" / "lib" / "shmserve").mkdir(parents=True, mode=0o755)
        for line in lines:
            command = line.split("#")[0].removeprefix("sudo ").replace(" -g shmserve ", f" -g {group} ").replace(
                " -o shmserve ", f" -o {service.pw_name} ")  # the service user, were the doc to make it the owner
            command = command.replace("/etc/shmserve", f"{top}/etc/shmserve").replace(
                "/var/lib/shmserve", f"{top}/var/lib/shmserve")
            r = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (command, r.stderr)
        etc, config = top / "etc" / "shmserve", top / "etc" / "shmserve" / "shmserve.toml"
        gid = grp.getgrnam(group).gr_gid
        for path, mode in ((etc, 0o750), (config, 0o640)):
            st = os.stat(path)
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, gid, mode), path

        def attempts() -> str:
            out = []
            for what, act in (("read", lambda: config.read_text()), ("write", lambda: config.open("a")),
                              ("add", lambda: (etc / "new.toml").write_text(""))):
                try:
                    act()
                    out.append(f"{what}:yes")
                except PermissionError:
                    out.append(f"{what}:no")
            return " ".join(out)

        def groups(pw) -> tuple[int, ...]:
            return tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))

        assert as_user(service.pw_uid, service.pw_gid, groups(service), attempts) == "read:yes write:no add:no"
        assert as_user(client.pw_uid, client.pw_gid, groups(client), attempts) == "read:no write:no add:no"
    finally:
        shutil.rmtree(top)
