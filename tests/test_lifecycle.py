"""Owner death and the stale-arena sweep, with real processes: /dev/shm ends as it began."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import posix_ipc

from shmserve import layout, stale
from shmserve.arena import Arena
from shmserve.cli import main as cli_main

from conftest import shm_names

HOLDER = str(Path(__file__).parent / "helpers" / "arena_holder.py")


def start_holder(instance: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, HOLDER, instance], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"holder did not start: {line!r}"
    return proc


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()


def record(instance: str) -> stale.ArenaRecord:
    (rec,) = stale.list_arenas(instance)
    return rec


def test_sigkilled_owner_is_detected_and_swept(instance_name):
    before = shm_names()
    dead, live = instance_name("dead"), instance_name("live")
    victim, survivor = start_holder(dead), start_holder(live)
    try:
        assert record(dead).owner_alive and record(live).owner_alive
        assert stale.sweep(dead, dry_run=True) == [] and stale.sweep(live, dry_run=True) == []
        kill(victim)
        gone = record(dead)
        assert not gone.owner_alive and not gone.pid_alive and gone.stale
        assert "gone" in gone.reason
        assert [r.instance for r in stale.sweep(dead, dry_run=True)] == [dead]
        assert f"shmserve.{dead}" in shm_names()  # dry run removed nothing
        removed = stale.sweep(dead)
        assert [r.instance for r in removed] == [dead]
        assert stale.sweep(live) == []  # never a live one
        assert record(live).owner_alive
    finally:
        kill(victim)
        kill(survivor)
    assert stale.sweep(live) and shm_names() == before


def test_attached_readers_do_not_keep_a_dead_owner_alive(instance_name):
    name = instance_name()
    holder = start_holder(name)
    reader = Arena.attach(name, read_only=True)
    try:
        kill(holder)
        assert record(name).stale
        assert stale.sweep(name)
        assert reader.info.instance == name  # the mapping stays valid after the unlink
    finally:
        reader.close()
        kill(holder)


def test_a_new_owner_with_the_old_name_is_left_alone(instance_name):
    name = instance_name()
    holder = start_holder(name)
    kill(holder)
    assert stale.sweep(name)
    with Arena.create(name, slot_count=2, max_workers=1, size_classes=[(4096, 1)]):
        assert stale.sweep(name) == []
        assert record(name).owner_alive


def test_earlier_boot_is_stale_even_if_locked(instance_name):
    name = instance_name()
    with Arena.create(name, slot_count=2, max_workers=1, size_classes=[(4096, 1)]) as arena:
        layout.HEADER.write(arena.buf, 0, boot_id=b"\xee" * 16)
        rec = record(name)
        assert not rec.same_boot and not rec.owner_alive and rec.reason == "created during an earlier boot"


def test_unreadable_segments_are_removed_only_after_the_grace_period(instance_name, monkeypatch):
    name = instance_name()
    shm = posix_ipc.SharedMemory(layout.arena_name(name), posix_ipc.O_CREX, size=4096)
    shm.close_fd()
    try:
        assert not record(name).stale and record(name).reason == "being created"
        monkeypatch.setattr(stale, "INIT_GRACE_S", 0.0)
        assert record(name).stale
        assert [r.instance for r in stale.sweep(name)] == [name]
    finally:
        try:
            shm.unlink()
        except posix_ipc.ExistentialError:
            pass


def test_cleanup_command(instance_name, capsys):
    name = instance_name()
    holder = start_holder(name)
    kill(holder)
    assert cli_main(["cleanup", "--instance", name, "--dry-run"]) == 0
    assert f"would remove /dev/shm/shmserve.{name}" in capsys.readouterr().out
    assert cli_main(["cleanup", "--instance", name]) == 0
    assert f"removed /dev/shm/shmserve.{name}" in capsys.readouterr().out
    assert cli_main(["cleanup", "--instance", name]) == 0
    assert "no stale arenas" in capsys.readouterr().out
