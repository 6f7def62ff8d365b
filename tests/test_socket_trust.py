"""Who a server and a client trust, through real sockets and processes.

The server's socket directory must be its own (or root's) and writable by nobody else; a missing
one is made 0700 (0750 with socket_group); no symbolic link is followed.  A client checks who
serves the socket (SO_PEERCRED) before it sends anything.  ``info`` shows process ids, paths and
addresses only to the server's own uid.  The tests that need another user act as nobody
(``helpers.other_user``); they skip when not run as root.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from shmserve import AsyncClient, Client, ErrorCode, ShmserveError
from shmserve.config import SERVER_UID_ENV, trusted_server_uids
from shmserve.doorkit import Listener

from conftest import new_instance, shm_names
from helpers.other_user import NOBODY, as_nobody, nobody_group, server_nobody_can_reach

def owner_and_mode(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


# -- the server's socket directory ------------------------------------------------------------

def _other_owner(d: Path) -> None:
    nobody_group()
    os.chown(d, NOBODY, NOBODY)


BAD_DIRECTORIES = {
    # what is wrong: (how to make it so, words of the one-line error)
    "another owner": (_other_owner, "belongs to uid 65534"),
    "writable by others": (lambda d: os.chmod(d, 0o777), "writable by others (mode 0777)"),
    "writable by its group": (lambda d: os.chmod(d, 0o770), "writable by its group (mode 0770)"),
}


@pytest.mark.parametrize("case", list(BAD_DIRECTORIES))
def test_a_socket_directory_someone_else_controls_is_refused(tmp_path, case):
    """Before and at bind: one line naming the directory, what is wrong and the fix; nothing made in
    it, nothing about it changed."""
    make_bad, words = BAD_DIRECTORIES[case]
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    make_bad(d)
    before = owner_and_mode(d)
    with pytest.raises(SystemExit) as info:
        Listener(str(d / "s.sock"))
    message = str(info.value)
    assert words in message and str(d) in message and "choose another --socket" in message, message
    assert "\n" not in message and owner_and_mode(d) == before and os.listdir(d) == []


def test_a_live_but_busy_server_at_the_path_is_left_alone_without_hanging(tmp_path):
    """The liveness probe of a socket file at our path has a timeout: a live server whose backlog
    is full is a live server (not a dead one's file to remove), and start-up says so at once."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    path = str(d / "s.sock")
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(path)
    busy.listen(0)
    queued = []
    try:
        for _ in range(4):  # fill its backlog: nobody accepts
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(path)
            except BlockingIOError:
                break
        with pytest.raises(SystemExit) as info:
            Listener(path)
        assert "another server is listening" in str(info.value) and "busy" in str(info.value)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # not removed
    finally:
        for c in queued:
            c.close()
        busy.close()


def test_a_sticky_directory_like_tmp_is_trusted(tmp_path):
    """Writable by all but sticky (nobody else can remove or rename our entries): accepted."""
    d = tmp_path / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)
    listener = Listener(str(d / "s.sock"))
    try:
        assert stat.S_ISSOCK(os.lstat(d / "s.sock").st_mode)
    finally:
        listener.sock.close()
        listener.remove()
    assert d.exists()  # not ours to remove


def test_a_symlinked_socket_directory_is_refused_and_nothing_is_changed_through_it(tmp_path):
    """The directory is a link (to a directory of ours, or dangling): refused; the target's owner,
    group and mode are as they were, with socket_group too."""
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    target = tmp_path / "target"
    target.mkdir(mode=0o711)
    os.chmod(target, 0o711)
    link = tmp_path / "link"
    link.symlink_to(target)
    before = owner_and_mode(target)
    for path in (link, tmp_path / "dangling"):
        if path.name == "dangling":
            path.symlink_to(tmp_path / "nowhere")
        with pytest.raises(SystemExit) as info:
            Listener(str(path / "s.sock"), mode=0o660, group=group)
        assert "is a symbolic link" in str(info.value) and "choose another --socket" in str(info.value)
    assert owner_and_mode(target) == before and os.listdir(target) == []
    assert not (tmp_path / "nowhere").exists()


def test_a_socket_path_that_is_a_symlink_is_refused(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("")
    (d / "s.sock").symlink_to(victim)
    with pytest.raises(SystemExit, match="exists and is not a socket"):
        Listener(str(d / "s.sock"))
    assert victim.read_text() == "" and (d / "s.sock").is_symlink()


def test_a_missing_directory_is_made_0700_or_0750_with_the_group(tmp_path):
    """Made by the server: 0700, or 0750 and the socket group; the socket gets its mode and group;
    both go again when the listener is removed."""
    import grp

    gid = os.getgid()
    for group, dir_mode, sock_mode in ((None, 0o700, 0o600), (grp.getgrgid(gid).gr_name, 0o750, 0o660)):
        d = tmp_path / "made" / "run"
        listener = Listener(str(d / "s.sock"), mode=sock_mode, group=group)
        try:
            assert owner_and_mode(d) == (os.geteuid(), gid, dir_mode)
            assert owner_and_mode(d / "s.sock") == (os.geteuid(), gid, sock_mode)
        finally:
            listener.sock.close()
            listener.remove()
        assert not d.exists()


def test_serve_refuses_a_squatted_socket_directory_in_one_line(tmp_path):
    """Through the command: the directory of another user is refused before anything starts."""
    nobody_group()
    d = tmp_path / "squatted"
    d.mkdir(mode=0o755)
    os.chown(d, NOBODY, NOBODY)
    before = shm_names()
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--instance", new_instance("sq"),
                        "--socket", str(d / "s.sock")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = [x for x in r.stderr.splitlines() if "cannot listen on" in x]
    assert "belongs to uid 65534" in line and "choose another --socket" in line
    assert owner_and_mode(d) == (NOBODY, NOBODY, 0o755) and os.listdir(d) == [] and shm_names() == before


# -- the client's check of who serves ---------------------------------------------------------

def test_a_client_sends_nothing_to_a_server_of_an_unexpected_uid(tmp_path):
    """A socket served by nobody: Client and AsyncClient refuse it with PERMISSION_DENIED naming
    the uid they found, having sent not one byte; told to trust that uid (argument, or the env
    variable by user name) they do send."""
    nobody_group()
    d = Path(tempfile.mkdtemp(prefix="shmserve-trust-"))
    os.chown(d, NOBODY, NOBODY)
    path = str(d / "s.sock")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the impostor: listens as nobody, reports how many bytes each client sent
        try:
            os.close(ready_r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(path)
            listener.listen()
            os.write(ready_w, b"ready\n")
            listener.settimeout(60)
            for _ in range(4):
                conn, _ = listener.accept()
                conn.settimeout(20)
                got = conn.recv(65536)
                os.write(ready_w, f"{len(got)}\n".encode())
                conn.close()
        finally:
            os._exit(0)
    os.close(ready_w)
    reports = os.fdopen(ready_r, "r")
    try:
        assert reports.readline() == "ready\n"
        with pytest.raises(ShmserveError) as info:
            Client(path)
        assert info.value.code is ErrorCode.PERMISSION_DENIED
        assert "served by uid 65534 (nobody)" in info.value.message and "nothing was sent" in info.value.message
        assert f"{SERVER_UID_ENV}=65534" in info.value.message
        assert reports.readline() == "0\n"

        async def refused():
            with pytest.raises(ShmserveError) as info:
                await AsyncClient(path).connect()
            return info.value.code

        assert asyncio.run(refused()) is ErrorCode.PERMISSION_DENIED
        assert reports.readline() == "0\n"
        with Client(path, server_uid=NOBODY, timeout=5) as c:  # trusted now: it sends, the impostor hangs up
            with pytest.raises(ShmserveError) as info:
                c.health()
            assert info.value.code is ErrorCode.UNAVAILABLE
        assert int(reports.readline()) > 0
        os.environ[SERVER_UID_ENV] = "nobody"
        try:
            assert trusted_server_uids() == {os.geteuid(), 0, NOBODY}
            with Client(path, timeout=5) as c:
                with pytest.raises(ShmserveError):
                    c.health()
        finally:
            del os.environ[SERVER_UID_ENV]
        assert int(reports.readline()) > 0
    finally:
        reports.close()
        os.waitpid(pid, 0)
        os.unlink(path)
        os.rmdir(d)


def test_trusted_server_uids_take_ids_and_names_and_name_a_bad_setting(monkeypatch):
    """A uid or a user name, from the argument or the environment; a bad one is a ValueError (one
    line from the command) naming the setting."""
    monkeypatch.delenv(SERVER_UID_ENV, raising=False)
    me = os.geteuid()
    assert trusted_server_uids() == {me, 0}
    assert trusted_server_uids(4321) == trusted_server_uids("4321") == {me, 0, 4321}
    monkeypatch.setenv(SERVER_UID_ENV, "root")
    assert trusted_server_uids() == {me, 0}
    monkeypatch.setenv(SERVER_UID_ENV, "no-such-user-here")
    with pytest.raises(ValueError, match=f"{SERVER_UID_ENV}: no user 'no-such-user-here'"):
        trusted_server_uids()
    with pytest.raises(ValueError, match="server_uid: -1 is not a uid"):
        trusted_server_uids(-1)
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "health", "--socket", "/nonexistent/s.sock"],
                       capture_output=True, text=True, timeout=60)  # the command says so in one line (a usage error: 2)
    assert r.returncode == 2 and r.stderr.strip() == (f"shmserve health: {SERVER_UID_ENV}: no user "
                                                      f"'no-such-user-here' on this machine"), r.stderr


# -- info for other users -------------------------------------------------------------------

def test_info_shows_pids_and_paths_only_to_the_servers_own_uid(tmp_path):
    """A client of another allowed uid gets info with the server's and workers' pids and the
    socket path as null; the owner sees them."""
    with server_nobody_can_reach(tmp_path, f"allow_uids = [{NOBODY}]") as srv:
        def ask():
            with Client(srv.socket, timeout=20) as c:
                assert c.infer("identity", {"x": np.ones(3, np.uint8)})["y"].sum() == 3  # served
                return json.dumps(c.info())

        theirs = json.loads(as_nobody(ask))
        mine = srv.info()
        assert mine["pid"] == srv.proc.pid and mine["socket"] == srv.socket
        assert all(w["pid"] for w in mine["workers"])
        assert theirs["pid"] is None and theirs["socket"] is None
        assert [w["pid"] for w in theirs["workers"]] == [None] * len(mine["workers"])
        assert theirs["instance"] == mine["instance"] and theirs["workers"][0]["state"] == "ready"
