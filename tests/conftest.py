"""Shared fixtures: unique arena names, guaranteed cleanup, and a /dev/shm leak check.

Every instance a test creates is named by ``new_instance`` (the fixture
``instance_name`` for arenas made in-process, ``helpers.server`` for server
processes): the name carries this test session's tag, so that a crashed run
never collides with a later one, and the leak checks watch only this
session's names.  A suite passes next to a production instance, or another
test run, starting and stopping on the same host.  Whatever a test leaves
behind under its names is removed after it, pass or fail.  The session-wide
``shm_leak_check`` fails the run if this session's names do not end as they
began (none).
"""

from __future__ import annotations

import os
import uuid

import posix_ipc
import pytest

from shmserve.arena import SHM_DIR
from shmserve.layout import arena_name


SESSION_TAG = f"t{os.getpid()}x{uuid.uuid4().hex[:4]}"  # in the name of everything this session creates


def new_instance(tag: str = "t") -> str:
    """A fresh instance name of this test session."""
    return f"{SESSION_TAG}-{tag}-{uuid.uuid4().hex[:8]}"


def shm_names() -> set[str]:
    """The /dev/shm entries of this test session (arenas, regions, test segments)."""
    return {name for name in os.listdir(SHM_DIR) if SESSION_TAG in name}


@pytest.fixture(scope="session", autouse=True)
def shm_leak_check():
    before = shm_names()
    yield
    leaked = sorted(shm_names() - before)
    assert not leaked, f"/dev/shm gained {leaked} during the test session"


@pytest.fixture
def instance_name(request):
    """A factory of unique instance names; their segments are unlinked after the test."""
    made: list[str] = []

    def make(tag: str = "t") -> str:
        name = new_instance(tag)
        made.append(name)
        return name

    yield make
    for name in made:
        try:
            posix_ipc.unlink_shared_memory(arena_name(name))
        except posix_ipc.ExistentialError:
            pass
