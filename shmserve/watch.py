"""What a lifecycle call (load, unload, scale, canary) is doing while it runs, for people.

Owns: a view of one model's versions (``view``: each version's state, its workers ready of
how many, and while it drains the requests its workers still have), read from the server's
``repository`` answer and, only while a version drains, its ``info``; the lines that say what
changed between two views (``changes``: loading and warming up, ready, draining N requests,
unloaded, and why); and ``Watch``, a thread that polls the server on a connection of its own
every ``POLL_S`` while the call waits for its answer and reports each change.

Must not: change anything on the server, decide what the call does, or print (the caller's
``report`` does: ``console.Steps``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from shmserve.inspection import plural

POLL_S = 0.25  # how often the server is asked: a repository answer, and info while a version drains


@dataclass(frozen=True)
class VersionView:
    """One version as a person follows it: its state (the repository's: loading, ready,
    restarting, draining, unavailable, unloaded, evicted), workers, and why."""

    state: str
    workers_ready: int = 0
    workers: int = 0
    in_flight: int | None = None  # while it drains: requests its workers still run (lane calls not counted)
    reason: str = ""


def view(repository: dict, info: dict | None, model: str) -> dict[int, VersionView]:
    """``model``'s versions from a ``repository`` answer (and ``info``, for the requests a draining
    version's workers still have; None: not asked)."""
    in_flight: dict[int, int] = {}
    for w in (info or {}).get("workers", []):
        if w.get("model") == model and w.get("version") is not None:
            in_flight[w["version"]] = in_flight.get(w["version"], 0) + (w.get("inflight") or 0)
    out = {}
    for entry in repository.get("models", []):
        if entry.get("name") != model or entry.get("version") is None:
            continue
        version, state = entry["version"], entry.get("state", "")
        out[version] = VersionView(state, entry.get("workers_ready", 0), entry.get("workers", 0),
                                   in_flight.get(version, 0) if state == "draining" and info is not None else None,
                                   entry.get("reason") or "")
    return out


def describe(version: int, v: VersionView) -> str:
    """One line for a person: what ``version`` is doing now."""
    workers = f"{v.workers_ready} of {plural(v.workers, 'worker')} ready"
    if v.state == "loading":
        return f"version {version}: loading: {workers} (each loads the model and warms it up)"
    if v.state == "draining":
        left = "" if v.in_flight is None else f": {plural(v.in_flight, 'request')} in flight"
        return f"version {version}: draining{left} (its workers finish them, then stop)"
    if v.state in ("ready", "restarting"):
        return f"version {version}: {v.state}, {workers}"
    return f"version {version}: {v.state}" + (f": {v.reason}" if v.reason else "")


def changes(before: dict[int, VersionView], after: dict[int, VersionView]) -> list[str]:
    """The lines that say what changed from ``before`` to ``after`` (both from ``view``), by
    version; a version no longer listed is unloaded."""
    lines = [describe(version, v) for version, v in sorted(after.items()) if before.get(version) != v]
    lines += [f"version {version}: unloaded" for version in sorted(set(before) - set(after))
              if before[version].state not in ("unloaded", "evicted")]
    return lines


class Watch:
    """Report what happens to ``model``'s versions while a call runs: ``with Watch(...):`` around
    the call.  ``connect()`` gives a new client (its own connection: the call's is busy);
    ``report(line)`` is called from the watching thread for each change.  Polls stop when the
    block ends; a poll that fails (the server went away) is tried again at the next one."""

    def __init__(self, connect: Callable, model: str, report: Callable[[str], None], poll_s: float = POLL_S):
        self.connect, self.model, self.report, self.poll_s = connect, model, report, poll_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shmserve-watch", daemon=True)
        self.client = None
        self.last: dict[int, VersionView] = {}

    def __enter__(self) -> "Watch":
        try:  # before the call: only what changes from here is reported
            self.client = self.connect()
            self.last = self._look()
        except Exception:  # noqa: BLE001 - watching is a courtesy: the call says what went wrong
            pass
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30.0)
        if not self.thread.is_alive():
            self._poll()  # what the call's end changed, even if it came between two polls
        if self.client is not None:
            self.client.close()

    def _look(self) -> dict[int, VersionView]:
        repository = self.client.repository()
        draining = any(e.get("name") == self.model and e.get("state") == "draining"
                       for e in repository.get("models", []))
        return view(repository, self.client.info() if draining else None, self.model)

    def _run(self) -> None:
        while not self.stop.wait(self.poll_s):
            self._poll()

    def _poll(self) -> None:
        try:
            if self.client is None:
                self.client = self.connect()
            now = self._look()
        except Exception:  # noqa: BLE001 - as above; the next poll tries again
            return
        for line in changes(self.last, now):
            self.report(line)
        self.last = now
