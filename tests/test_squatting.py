"""Squatted /dev/shm names and cleanup's trust rule, through the real CLI and server.

Any local user can put anything at an instance's arena name: another uid's
file, a FIFO (whose blocking open used to hang start-up, inspect and
cleanup), a symlink, a directory, a file with a mode shmserve never makes.
``serve``, ``inspect`` and ``cleanup`` each answer promptly (every command
runs under a bounded timeout) with one line naming the squatter and the
fix, and nothing is ever unlinked but a dead arena of a trusted owner.
``cleanup`` removes a socket named by a dead arena's header only when that
owner is trusted and also owns the socket, which is a real socket (not a
symlink) in a directory of that owner.  Every name here is this session's
(``new_instance``) and is removed by the fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shmserve.arena import Arena, segment_path
from shmserve.layout import arena_name

from conftest import new_instance, shm_names
from helpers.server import TESTS_DIR

NOBODY = 65534  # an unprivileged uid that is neither the caller nor root
CMD_TIMEOUT_S = 60  # a hang fails the test instead of the run; a prompt answer takes a second or two
IDENTITY = '[[models]]\nname = "identity"\nbackend = "python"\npath = "shmserve.models:identity"\n'

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making files of another uid needs root")


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "shmserve.cli", *args], capture_output=True, text=True,
                          timeout=CMD_TIMEOUT_S, env=env)


def remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


@pytest.fixture
def shm_entry():
    """``make(kind) -> instance``: an entry of ``kind`` at a fresh instance's arena name; removed after."""
    made: list[str] = []

    def make(kind: str) -> str:
        instance = new_instance("sq")
        path = segment_path(arena_name(instance))
        made.append(path)
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "symlink":
            os.symlink("/etc/passwd", path)
        elif kind == "directory":
            os.mkdir(path, 0o700)
        elif kind == "socket":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.close()
        elif kind == "wrong mode":
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.ftruncate(fd, 1 << 20)
            os.fchmod(fd, 0o644)
            os.close(fd)
        elif kind == "other uid":
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.ftruncate(fd, 1 << 20)
            os.fchown(fd, NOBODY, -1)
            os.close(fd)
        else:
            raise ValueError(kind)
        return instance

    yield make
    for path in made:
        remove(path)


SQUATTERS = [("fifo", "a fifo owned by uid"), ("symlink", "a symlink owned by uid"),
             ("directory", "a directory owned by uid"), ("socket", "a socket owned by uid"),
             ("wrong mode", "with mode 0644"),
             pytest.param("other uid", f"a regular file owned by uid {NOBODY}", marks=needs_root)]


@pytest.mark.parametrize("kind, words", SQUATTERS)
def test_a_squatted_arena_name_is_refused_promptly_and_left_alone(kind, words, shm_entry, tmp_path):
    instance = shm_entry(kind)
    path = segment_path(arena_name(instance))
    before = os.lstat(path)
    config = tmp_path / "c.toml"
    config.write_text(f'[server]\ninstance = "{instance}"\n{IDENTITY}')
    sock = tmp_path / "run" / "s.sock"

    served = cli("serve", "--config", str(config), "--socket", str(sock))
    assert served.returncode == 1, served.stderr
    (line,) = served.stderr.strip().splitlines()  # one line: who holds the name, and the fix
    assert words in line and path in line and "another --instance" in line and "owner or root" in line
    assert not sock.exists()

    inspected = cli("inspect", "--instance", instance)
    assert inspected.returncode == 2 and f"uid {before.st_uid}" in inspected.stderr
    assert "Traceback" not in inspected.stderr
    everything = cli("inspect", "--all", "--json")  # the squatter is listed, never opened
    lefts = [e for e in json.loads(everything.stdout)["leftovers"] if e["instance"] == instance]
    assert all(words in e["refused"] for e in lefts) and instance not in everything.stderr
    assert lefts or kind == "other uid"  # another user's fresh file may be their server starting: not listed yet

    for args in (("cleanup", "--instance", instance), ("cleanup", "--instance", instance, "--dry-run")):
        cleaned = cli(*args)
        assert cleaned.returncode == 0, cleaned.stderr
        lefts = [line for line in cleaned.stdout.splitlines() if line.startswith(f"left {path}: ")]
        assert "no stale arenas" in cleaned.stdout and all(words in line for line in lefts)
        assert lefts or kind == "other uid"  # as above; a dead one is reported (test_cleanup_as_root_...)
    after = os.lstat(path)  # never unlinked, never replaced
    assert (after.st_ino, after.st_mode, after.st_uid) == (before.st_ino, before.st_mode, before.st_uid)


def test_an_arena_name_freed_by_its_squatter_serves_again(shm_entry, tmp_path):
    instance = shm_entry("fifo")
    os.unlink(segment_path(arena_name(instance)))
    with Arena.create(instance, slot_count=2, max_workers=1, size_classes=[(4096, 1)]) as arena:
        assert stat.S_IMODE(os.lstat(segment_path(arena.name)).st_mode) == 0o600
        r = cli("inspect", "--instance", instance, "--json")
        assert r.returncode == 0 and f'"owner_uid": {os.geteuid()}' in r.stdout


# -- cleanup trusts only what it can prove ------------------------------------------------------

@pytest.fixture
def dead_arena():
    """``make(socket_path, group=None, instance=None) -> instance``: an arena whose owner is gone (its lock was
    dropped without an unlink) and whose header names ``socket_path``; removed after."""
    made: list[str] = []

    def make(socket_path: str, *, group: int | None = None, instance: str | None = None) -> str:
        instance = instance or new_instance("dead")
        arena = Arena.create(instance, slot_count=2, max_workers=1, size_classes=[(4096, 1)],
                             socket_path=socket_path, group=group)
        made.append(segment_path(arena.name))
        arena.close()  # the flock goes with the descriptor: to a sweep, its owner is dead
        return instance

    yield make
    for path in made:
        remove(path)


def dead_socket(path: Path, uid: int | None = None) -> Path:
    """A socket file nobody listens on (its server died), owned by ``uid``."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    if uid is not None:
        os.chown(path, uid, -1)
    return path


def cleanup(instance: str) -> str:
    r = cli("cleanup", "--instance", instance)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_cleanup_removes_a_dead_arena_and_its_own_socket(dead_arena, tmp_path):
    before = shm_names()
    sock = dead_socket(tmp_path / "run" / "s.sock")
    instance = dead_arena(str(sock))
    dry = cli("cleanup", "--instance", instance, "--dry-run").stdout
    assert f"would remove its socket {sock}" in dry and sock.exists()
    out = cleanup(instance)
    assert f"removed /dev/shm/shmserve.{instance}" in out and f"removed its socket {sock}" in out
    assert not sock.exists() and shm_names() == before - {f"shmserve.{instance}"}


@needs_root
def test_cleanup_as_root_leaves_an_arena_of_another_uid_and_the_socket_its_header_names(dead_arena, tmp_path):
    sock = dead_socket(tmp_path / "run" / "s.sock")  # root's, and dead: what a forged header would aim at
    instance = dead_arena(str(sock))
    path = segment_path(arena_name(instance))
    os.chown(path, NOBODY, -1)  # the header is now one another user wrote
    out = cleanup(instance)
    assert "no stale arenas" in out and f"left {path}: a regular file owned by uid {NOBODY}" in out
    assert "does not trust" in out
    assert os.path.exists(path) and sock.exists()


@needs_root
def test_inspect_all_maps_only_its_own_and_roots_arenas(dead_arena, tmp_path):
    """Review L5: another user could shrink its own arena under our read-only mapping (SIGBUS in
    ``inspect``); ``--all`` shows only the caller's and root's instances, and another uid's only
    when it is named with --instance."""
    mine = dead_arena(str(tmp_path / "a.sock"))
    theirs = dead_arena(str(tmp_path / "b.sock"))
    os.chown(segment_path(arena_name(theirs)), NOBODY, -1)
    r = cli("inspect", "--all", "--json")
    listed = {snap["instance"] for snap in json.loads(r.stdout)["instances"]}
    assert mine in listed and theirs not in listed, r.stdout[-2000:]
    named = cli("inspect", "--instance", theirs, "--json")
    assert named.returncode == 0 and json.loads(named.stdout)["instance"] == theirs, named.stderr


@needs_root
@pytest.mark.parametrize("case", ["socket of another uid", "symlink to a socket", "symlinked directory",
                                  "directory of another uid", "regular file", "listening"])
def test_cleanup_leaves_a_socket_it_cannot_prove_is_the_dead_instances(case, dead_arena, tmp_path):
    real = dead_socket(tmp_path / "run" / "s.sock")
    victim, why = real, None
    if case == "socket of another uid":
        os.chown(real, NOBODY, -1)
        named, why = real, f"the socket belongs to uid {NOBODY}"
    elif case == "symlink to a socket":
        named, why = tmp_path / "run" / "link.sock", "a symlink, not a socket"
        os.symlink(real, named)
    elif case == "symlinked directory":
        os.symlink(tmp_path / "run", tmp_path / "linkdir")
        named, why = tmp_path / "linkdir" / "s.sock", "its directory is a symlink"
    elif case == "directory of another uid":
        victim = named = dead_socket(tmp_path / "theirs" / "s.sock")
        os.chown(named.parent, NOBODY, -1)
        why = f"its directory belongs to uid {NOBODY}"
    elif case == "regular file":
        named, why = tmp_path / "run" / "file.sock", "a regular file, not a socket"
        named.write_text("precious")
        victim = named
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        named = victim = tmp_path / "run" / "live.sock"
        listener.bind(str(named))
        listener.listen(1)
        why = "something listens there"
    try:
        instance = dead_arena(str(named))
        out = cleanup(instance)
    finally:
        if case == "listening":
            listener.close()
    assert f"removed /dev/shm/shmserve.{instance}" in out  # the arena is root's and dead: it goes
    assert f"left its socket {named}: {why}" in out
    assert os.path.lexists(named) and os.path.lexists(victim)


def test_a_group_writable_header_is_trusted_only_for_the_default_socket_name(dead_arena, tmp_path):
    gid = os.getgid()
    other = dead_socket(tmp_path / "run" / "s.sock")
    out = cleanup(dead_arena(str(other), group=gid))  # mode 0660: the group could have written the path
    assert f"left its socket {other}: the arena is writable by others" in out and other.exists()
    instance = new_instance("dead")
    default = dead_socket(tmp_path / "run" / f"{instance}.sock")  # the name the instance itself would use
    out = cleanup(dead_arena(str(default), group=gid, instance=instance))
    assert f"removed its socket {default}" in out and not default.exists()
