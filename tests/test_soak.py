"""Soak: eight well-behaved clients for a minute while hostile clients rotate through the attacks
of issue 11 against the same server.  Not one good answer may fail or be wrong; every attacker
gets the answer the server owes it; and the server ends as it began.

The good clients (``helpers/soak.py``, one process each) are three inline, three zero-copy through
lanes (one lane per model) and two zero-copy through plain regions over the socket; each checks
every answer against its reference (``identity``: its input; ``double``, a batching model: twice
its input).  The attackers (one function each in ``helpers/soak.py``): truncating, growing and
hole-punching their own sealed regions and lanes; scribbling over their own lane's ring indices
and slots; never reading their socket; a stalled upload; a half-sent frame; regions up to and
past every region limit; a connection flood up to ``max_connections_per_uid``; a lane client
killed in the middle of batched calls.

Connection and region limits count per uid, and attackers and good clients are one uid here (one
test user).  So the good clients connect, and make every region and lane they use, before the
first attack and keep them to the end; LIMITS leaves room for them, and the flood and the region
attack stop at their first refusal and then drop everything.  While one of them holds the uid's
last connection or region bytes, a *new* connection or region of a good client of that uid would
be refused: that is what a per-uid limit is for, so no good client asks for one (each ends with
the regions it began with).  The server-wide ``max_connections`` is not attacked: with one uid
it cannot be reached before ``max_connections_per_uid`` (test_hostile_connections reaches it).

The attacks run one at a time, each in a fresh process, in a seeded random order (every attack
once per round, rounds until the time is up; SHMSERVE_SOAK_SEED replays an order,
SHMSERVE_SOAK_SECONDS sets the time).  After each, the server must hold again exactly the good
clients' regions and the front-end exactly its descriptors of before the first (that attack's
connections and regions freed) before the next one starts.

Afterwards: the server is up, no worker restarted, no slot or extent is in use, no region is
recorded or mapped by any server process, /dev/shm holds what it did, and every server process
has the descriptors it had before the soak.  Nothing here asserts how fast anything is.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from shmserve import Client, ShmserveError, protocol
from shmserve.protocol import Kind

from conftest import shm_names
from helpers import soak
from helpers.raw_frames import connect
from helpers.server import TESTS_DIR, serving

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("SHMSERVE_SOAK_SECONDS", "60"))
GOOD_CLIENTS = ("inline",) * 3 + ("lane",) * 3 + ("region",) * 2
SETTLE_S = 30.0  # how long the server may take to let go of what an attacker held
GOOD_TIMEOUT_S = soak.GOOD_TIMEOUT_S + 30  # a good client finishes its last call after the stop
LIMITS = {
    "max_connections_per_uid": 32,  # the good clients hold 8: the flood opens the other 24
    "max_regions": 48,  # the good clients hold 8
    "max_regions_per_connection": 16,
    "max_region_bytes_per_connection": 32 << 20,
    "max_region_bytes_per_uid": 128 << 20,  # the good clients hold about 32 MiB
}
SERVER_SECTION = "\n".join([
    "request_timeout_s = 120",
    "max_request_bytes = 8388608",
    "stall_timeout_s = 2",
    "frame_timeout_s = 2",
    "upload_timeout_s = 2",
    "max_inflight_per_connection = 8",
    "max_inflight_bytes_per_connection = 8388608",
    *(f"{key} = {value}" for key, value in LIMITS.items()),
])
MODELS = """
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
instances = 2

[[models]]
name = "double"
backend = "python"
path = "serving_models:double_rows"
max_batch_size = 8
max_queue_delay_us = 20000
"""
SOAK = [sys.executable, "-m", "helpers.soak"]  # the client processes (tests/ on their path)
SOAK_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))


# -- what each attacker must have seen -----------------------------------------------------------

def _refused(entry, key: str) -> bool:
    """Whether ``entry`` (what the attacker recorded of a refusal) is 'overloaded' naming ``key``."""
    return isinstance(entry, dict) and entry.get("code") == "overloaded" and entry.get("key") == key


EXPECTED = {
    # Sealed memfds: neither shrunk nor grown; a punched hole only zeroes the attacker's own pages.
    "truncate_own_regions": lambda got: got == {
        f"{kind}: {key}": want for kind in ("region", "lane") for step, refusal in (
            ("truncate to 0", "EPERM"), ("truncate to 1 TiB", "EPERM"), ("punch a hole", "ok"))
        for key, want in ((step, refusal), (f"calls after {step}", ["ok"]), ("size", "unchanged"))},
    # Its own calls may fail or time out while its lane is corrupt; nothing else.
    "scribble_lane": lambda got: got["before"] == "ok" and set(got.values()) <= {"ok", "timeout", "internal"},
    "never_read": lambda got: got["send"] in ("EPIPE", "ECONNRESET"),
    "stalled_upload": lambda got: got["frames"] == [{"kind": "ERROR", "code": "timeout", "key": "upload_timeout_s"}],
    "half_sent_header": lambda got: got["frames"] == [{"kind": "ERROR", "code": "bad_frame",
                                                       "key": "frame_timeout_s"}],
    "region_limits": lambda got: all(_refused(got[key], key) for key in got) and set(got) == {
        "max_regions_per_connection", "max_region_bytes_per_connection", "max_region_bytes_per_uid", "max_regions"}
        and got["max_regions_per_connection"]["opened"] == LIMITS["max_regions_per_connection"]
        and got["max_region_bytes_per_connection"]["opened"] == LIMITS["max_region_bytes_per_connection"] // (8 << 20),
    "connection_flood": lambda got: _refused(got["refused"], "max_connections_per_uid")
        and got["served"] == LIMITS["max_connections_per_uid"] - len(GOOD_CLIENTS),
    "kill_lane_client": lambda got: got["victim"] == "killed",
}
assert set(EXPECTED) == set(soak.ATTACKS)


# -- the processes ---------------------------------------------------------------------------------

def good_client(kind: str, args: dict) -> soak.ClientProcess:
    """One well-behaved client process (``helpers.soak``)."""
    return soak.ClientProcess(kind, [*SOAK, "good", kind, json.dumps(args)], SOAK_ENV)


def run_attack(srv, name: str, seed: int, regions_before: int) -> dict:
    """Run attack ``name`` in a process of its own; what it recorded.  ``regions_before``: how many
    regions the server holds for others (the attack waits for its own to go)."""
    args = {"socket": srv.socket, "instance": srv.instance, "seed": seed, "limits": LIMITS,
            "regions_before": regions_before}
    done = subprocess.run([*SOAK, "attack", name, json.dumps(args)], capture_output=True, text=True, timeout=120,
                          env=SOAK_ENV)
    assert done.returncode == 0 and done.stdout.strip(), \
        f"attack {name} (seed {seed}) ended with exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def steady_fd_count(pid: int) -> int:
    """The descriptor count of ``pid`` once two looks 0.3 s apart agree (connections just closed
    are still being let go)."""
    last = fd_count(pid)
    for _ in range(100):
        time.sleep(0.3)
        now = fd_count(pid)
        if now == last:
            return now
        last = now
    raise AssertionError(f"pid {pid}'s descriptors never settled")


def wait_settled(what, timeout: float = SETTLE_S) -> str | None:
    """Poll ``what()`` (a description of what is still wrong, or None) until it says nothing;
    returns what was still wrong after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (problem := what()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return problem


def workers(srv) -> dict:
    return {(w["model"], w["index"]): (w["pid"], w["restarts"], w["state"]) for w in srv.info()["workers"]}


def warm_up(srv) -> None:
    """Everything the soak does once, so that descriptors the server opens lazily exist before
    they are counted: inline and zero-copy calls, lanes of both models, an error, a dropped
    connection with a region open."""
    rng = np.random.default_rng(0)
    for lanes in (True, False):
        with Client(srv.socket, timeout=60, lanes=lanes) as c:
            for model in soak.MODELS:
                c.open_region(soak.REGION_BYTES, lane=model if lanes else None)
                for kind in ("inline", "zero-copy"):
                    assert soak.call(c, kind, model, *soak.random_input(rng, model, 1 << 16)) is None
            with pytest.raises(ShmserveError):
                c.infer("no-such-model", {"x": np.ones(1, np.uint8)})
    s = connect(srv.socket)
    s.sendall(protocol.encode_frame(Kind.OPEN_REGION, {"id": 1, "size": 4096}))
    s.recv(4096)
    s.close()


# -- the soak --------------------------------------------------------------------------------------

def rotate_attacks(srv, rng: random.Random) -> tuple[list[dict], list[str]]:
    """Attacks one after another, every one once per round in a random order, for SOAK_S seconds
    (and until each has run once); returns what each attacker got, and what went wrong: an
    attacker answered otherwise than it should be, or the server not back to holding only the
    good clients' connections and regions after an attack."""
    good_regions = set(srv.recorded_regions())
    frontend_fds = steady_fd_count(srv.proc.pid)

    def settled() -> str | None:
        if set(srv.recorded_regions()) != good_regions:
            return f"regions {sorted(set(srv.recorded_regions()) - good_regions)} still recorded"
        if fd_count(srv.proc.pid) != frontend_fds:
            return f"the front-end holds {fd_count(srv.proc.pid)} descriptors, not {frontend_fds}"
        return None

    records: list[dict] = []
    problems: list[str] = []
    started = time.monotonic()
    rounds: list[str] = []
    while time.monotonic() - started < SOAK_S or set(soak.ATTACKS) - {r["attack"] for r in records}:
        if not rounds:
            rounds = rng.sample(sorted(soak.ATTACKS), len(soak.ATTACKS))
        name = rounds.pop()
        record = run_attack(srv, name, rng.randrange(2**32), len(good_regions))
        records.append(record)
        print(f"  {time.monotonic() - started:5.1f} s  {name}: {record['got']}")
        if not EXPECTED[name](record["got"]):
            problems.append(f"{name} got {record['got']}")
        leftover = wait_settled(settled)
        if leftover:
            problems.append(f"after {name}: {leftover}")
        assert srv.proc.poll() is None, f"the server died during {name}:\n{srv.log()[-3000:]}"
    print(f"soak: {len(records)} attacks in {time.monotonic() - started:.1f} s")
    return records, problems


def test_soak_good_clients_unharmed_while_attackers_rotate(tmp_path):
    seed = int(os.environ.get("SHMSERVE_SOAK_SEED", random.SystemRandom().randrange(2**32)))
    print(f"soak: seed={seed} seconds={SOAK_S} (replay with SHMSERVE_SOAK_SEED={seed})")
    with serving(tmp_path, MODELS, server_section=SERVER_SECTION) as srv:
        shm_before = shm_names()  # the arena: client regions and lanes have no name in /dev/shm
        warm_up(srv)
        assert not wait_settled(lambda: srv.recorded_regions() and "regions")
        srv.wait_idle()
        workers_before = workers(srv)
        pids = [srv.proc.pid] + [pid for pid, _, _ in workers_before.values()]
        fds_before = {pid: steady_fd_count(pid) for pid in pids}

        stop = tmp_path / "stop"
        good = [good_client(kind, {"socket": srv.socket, "seed": seed + i, "stop": str(stop)})
                for i, kind in enumerate(GOOD_CLIENTS)]
        try:
            for client in good:
                line = client.next_line(120)
                assert line == "ready", f"a good {client.kind} client did not start: {line!r}"
            records, problems = rotate_attacks(srv, random.Random(seed))
            stop.touch()
            results = [client.result(GOOD_TIMEOUT_S) for client in good]
        finally:
            for client in good:
                client.kill()

        for r in results:
            print(f"  {r}")
        assert all(r.get("failed") == 0 and r.get("wrong") == 0 for r in results), results
        assert all(r["ok"] > 0 for r in results), results
        assert [r["regions"] for r in results] == [{"inline": 0, "lane": 2, "region": 1}[k] for k in GOOD_CLIENTS]
        assert not problems, "\n".join(problems)
        ran = {name: sum(r["attack"] == name for r in records) for name in soak.ATTACKS}
        print(f"  attacks run: {ran}")
        assert min(ran.values()) >= 1, ran

        # The server ends as it began.
        assert srv.proc.poll() is None
        assert workers(srv) == workers_before, "a worker restarted"
        srv.wait_idle()
        leftover = wait_settled(lambda: (srv.recorded_regions() and f"regions {sorted(srv.recorded_regions())}")
                                or (any(srv.mapped_regions().values()) and f"mapped {srv.mapped_regions()}")
                                or (srv.info()["lanes"] and "lanes left"))
        assert not leftover, leftover
        leftover = wait_settled(lambda: {pid: fd_count(pid) for pid in pids} != fds_before
                                and f"descriptors {({pid: fd_count(pid) for pid in pids})}, before {fds_before}")
        assert not leftover, leftover
        assert shm_names() == shm_before
        assert "Traceback" not in srv.log(), srv.log()[-5000:]
