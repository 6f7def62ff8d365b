"""Acting as another user in tests: a child process that drops to nobody (uid and gid 65534), and a
server whose socket nobody's processes can reach.  Only root can do either: ``nobody_group`` skips
the test otherwise."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest

from helpers.server import ServerProcess

NOBODY = 65534
IDENTITY = """
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
"""


def nobody_group() -> str:
    """The name of group 65534; skips the test unless it runs as root on a machine with nobody."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    import grp
    import pwd

    try:
        pwd.getpwuid(NOBODY)
        return grp.getgrgid(NOBODY).gr_name
    except KeyError:
        pytest.skip("no user and group 65534 on this machine")


def as_nobody(fn, groups: tuple[int, ...] = ()) -> str:
    """Run ``fn()`` in a forked child that has dropped to nobody:nogroup with the supplementary
    ``groups`` (the interpreter is loaded already, so nothing under root's home needs to be
    readable by nobody); returns what it returned (a str), or the repr of what it raised."""
    return as_user(NOBODY, NOBODY, groups, fn)


def as_user(uid: int, gid: int, groups: tuple[int, ...], fn) -> str:
    """``as_nobody`` for any uid, primary gid and supplementary groups."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            answer = fn()
        except BaseException as exc:
            answer = repr(exc)
        os.write(write_end, answer.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer


@contextlib.contextmanager
def server_nobody_can_reach(workdir: Path, server_section: str = ""):
    """A started identity server whose socket (mode 0660, group nogroup, in a root-owned 0755
    directory) nobody's processes can open; ``server_section`` adds settings.  Stopped (exit 0)
    and its directory removed on the way out."""
    group = nobody_group()
    sockdir = Path(tempfile.mkdtemp(prefix="shmserve-nobody-"))
    os.chmod(sockdir, 0o755)
    srv = ServerProcess(workdir, IDENTITY, socket_dir=sockdir,
                        server_section=f"socket_mode = 0o660\nsocket_group = \"{group}\"\n{server_section}").start()
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()
        os.rmdir(sockdir)
