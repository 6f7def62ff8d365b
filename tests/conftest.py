"""Shared fixtures: unique arena names, guaranteed cleanup, and a /dev/shm leak check.

Every test that creates arenas takes its instance names from ``instance_name``
so that a crashed run never collides with a later one, and whatever a test
leaves behind under those names is removed after it, pass or fail.  The
session-wide ``shm_leak_check`` fails the run if /dev/shm does not end as it
began.
"""

from __future__ import annotations

import os
import uuid

import posix_ipc
import pytest

from shmserve.arena import SHM_DIR
from shmserve.layout import arena_name


def shm_names() -> set[str]:
    return set(os.listdir(SHM_DIR))


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
        name = f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        made.append(name)
        return name

    yield make
    for name in made:
        try:
            posix_ipc.unlink_shared_memory(arena_name(name))
        except posix_ipc.ExistentialError:
            pass
