"""The soak's client processes: well-behaved clients that check every answer, and attackers.

As a script (``python -m helpers.soak``, tests/ on the path): ``good KIND ARGS`` runs one
well-behaved client (KIND: ``inline``, ``lane`` or ``region``), ``attack NAME ARGS`` one
attack, ``victim ARGS`` the lane client attack ``kill_lane_client`` kills; ARGS is a JSON object (``socket``,
``instance``, ``seed``, ``stop`` for a good client, ``limits`` for the attacks).

A good client prints ``ready`` once it is connected, holds the regions or lanes it will use
and has had one correct answer from each model; then calls until the file ``stop`` exists and
prints one JSON line: how many answers were right, failed or wrong (with the first few
failures).  Every answer is checked against its reference: ``identity`` returns its input,
``double`` twice its input.

An attack does what an attacker would, through the real socket and its own regions, and
prints one JSON line: ``{"attack": NAME, "got": {...}}``, what it saw at each step (error
codes, the config key a refusal named, errno names), for the test to compare with what the
server should have answered.  Then it leaves abruptly (``os._exit``: no region closed, no
socket shut down), as a crashed or hostile client does.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from shmserve import AsyncClient, Client, ConnectionClosed, ShmserveError, inspection, layout, protocol
from shmserve import _atomics as atomics
from shmserve.protocol import Kind

from helpers.raw_frames import connect, infer_frame, read_to_end

GOOD_TIMEOUT_S = 120.0  # per request: the machine is small and shared, the answer must still come right
ATTACK_TIMEOUT_S = 30.0  # how long an attacker waits for the server to answer or close it
REGION_BYTES = 4 << 20  # a good client's region (or each lane): room for its largest call
MAX_INLINE_BYTES = 256 << 10  # an inline answer fits the socket buffers: a good client never stalls
MAX_ZERO_COPY_BYTES = 1 << 20
DOUBLE_COLUMNS = (3, 64, 1000)
MODELS = ("identity", "double")
_KEY = re.compile(r"\((?:server\.)?([a-z_]+)\)")  # the config key a refusal names, "(server.key)"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent goes (a test that is itself killed leaves none running)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ClientProcess:
    """A client process of a soak (``argv``, with ``env``; ``stdin``: a line written to it, then
    closed): its output lines arrive on a queue a thread fills, ``kind`` names it in reports."""

    def __init__(self, kind: str, argv: list[str], env: dict, stdin: str | None = None):
        import queue

        self.kind = kind
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env,
                                     stdin=subprocess.PIPE if stdin is not None else None)
        if stdin is not None:
            self.proc.stdin.write(stdin + "\n")
            self.proc.stdin.close()
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, timeout: float) -> str | None:
        """Its next output line; None once it ended, or after ``timeout`` seconds without one."""
        import queue

        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def result(self, timeout: float) -> dict:
        """Its counts (a JSON line), once it has seen the stop file (or how it ended instead)."""
        line = self.next_line(timeout)
        return json.loads(line) if line and line.startswith("{") else {"kind": self.kind, "ended": line}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# -- well-behaved clients ---------------------------------------------------------------------

def random_input(rng: np.random.Generator, model: str, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """An input for ``model`` and the answer it must give."""
    if model == "identity":
        x = rng.integers(0, 256, int(2 ** rng.uniform(0, np.log2(max_bytes))), dtype=np.uint8)
        return x, x
    rows, cols = int(rng.integers(1, 5)), int(rng.choice(DOUBLE_COLUMNS))
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    return x, x * 2


def check(y: np.ndarray, expected: np.ndarray) -> str | None:
    """What is wrong with answer ``y`` (None: nothing)."""
    if y.dtype != expected.dtype or y.shape != expected.shape:
        return f"got {y.dtype}{y.shape}, expected {expected.dtype}{expected.shape}"
    if not np.array_equal(y, expected):
        return f"{int(np.count_nonzero(y != expected))} of {y.size} values differ"
    return None


def call(client: Client, kind: str, model: str, x: np.ndarray, expected: np.ndarray) -> str | None:
    """One request of ``kind``: inline, or zero-copy in the client's lane or plain region."""
    if kind == "inline":
        return check(client.infer(model, {"x": x})["y"], expected)
    with client.zero_copy(model, {"x": (x.shape, x.dtype)}, output_capacity=expected.nbytes) as zc:
        zc.inputs["x"][...] = x
        return check(zc.run()["y"], expected)


def good_client(kind: str, args: dict) -> dict:
    die_with_parent()
    rng = np.random.default_rng(args["seed"])
    client = Client(args["socket"], timeout=GOOD_TIMEOUT_S, lanes=kind == "lane")
    if kind == "lane":
        for model in MODELS:  # its own lanes, made before the attacks begin: zero_copy uses them
            client.open_region(REGION_BYTES, lane=model)
    elif kind == "region":
        client.open_region(REGION_BYTES)
    max_bytes = MAX_INLINE_BYTES if kind == "inline" else MAX_ZERO_COPY_BYTES
    for model in MODELS:
        wrong = call(client, kind, model, *random_input(rng, model, max_bytes))
        assert wrong is None, f"{kind} client, {model}: {wrong}"
    print("ready", flush=True)
    counts = {"kind": kind, "ok": 0, "failed": 0, "wrong": 0, "problems": [], "slowest_s": 0.0}
    while not os.path.exists(args["stop"]):
        model = MODELS[int(rng.integers(len(MODELS)))]
        x, expected = random_input(rng, model, max_bytes)
        start = time.monotonic()
        try:
            wrong = call(client, kind, model, x, expected)
        except ConnectionClosed as exc:  # nothing more to ask on this connection
            counts["failed"] += 1
            counts["problems"].append(f"{model} {x.dtype}{x.shape}: {exc}")
            break
        except ShmserveError as exc:
            outcome, problem = "failed", f"{model} {x.dtype}{x.shape}: {exc}"
        else:
            outcome, problem = ("ok", None) if wrong is None else ("wrong", f"{model} {x.dtype}{x.shape}: {wrong}")
        counts[outcome] += 1
        counts["slowest_s"] = max(counts["slowest_s"], round(time.monotonic() - start, 3))
        if problem and len(counts["problems"]) < 5:
            counts["problems"].append(problem)
    counts["regions"] = len(client._core.regions)  # all made before the attacks: none opened since
    client.close()
    return counts


# -- what an attacker saw -----------------------------------------------------------------------

def frames_until_closed(s: socket.socket) -> list[dict]:
    """What the server sent until it closed ``s`` (within ATTACK_TIMEOUT_S), each described."""
    return [describe(frame) for frame in read_to_end(s)]


def describe(frame: protocol.Frame) -> dict:
    if frame.kind is not Kind.ERROR:
        return {"kind": frame.kind.name}
    return {"kind": "ERROR", "code": frame.meta.get("code"), "key": named_key(frame.meta.get("message", ""))}


def named_key(message: str) -> str | None:
    found = _KEY.search(message)
    return found.group(1) if found else None


def refusal(exc: ShmserveError) -> dict:
    return {"code": exc.code.wire, "key": named_key(exc.message)}


def outcome(fn) -> str:
    """``fn()``'s outcome: "ok", "wrong", an error code, or an exception's name."""
    try:
        return "ok" if fn() is None else "wrong"
    except ShmserveError as exc:
        return exc.code.wire
    except OSError as exc:
        return type(exc).__name__ if not exc.errno else errno.errorcode[exc.errno]


# -- the attacks, one function each -----------------------------------------------------------

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE): give the pages back (reads then see zeros); OSError if refused."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def open_region_keeping_fd(client: Client, size: int, lane: str | None) -> int:
    """Open a region the client's calls will use, keeping a descriptor of it (the client closes
    the one it is passed once mapped); returns that descriptor."""
    grant = client._pump.exchange(lambda session: session.open_region(size, lane))
    fd = os.dup(grant.fd)
    client._core.add_region(grant)
    return fd


def truncate_own_regions(args: dict, rng: np.random.Generator) -> dict:
    """A plain region and a lane: shrink each to nothing, grow it huge (both sealed: refused), punch
    a hole through the whole of it (allowed: that only zeroes the attacker's own pages), and make
    zero-copy calls in it after each."""
    got = {}
    for kind, lane in (("region", None), ("lane", "identity")):
        client = Client(args["socket"], timeout=ATTACK_TIMEOUT_S, lanes=lane is not None)
        fd = open_region_keeping_fd(client, REGION_BYTES, lane)
        size = os.fstat(fd).st_size
        for step, action in (("truncate to 0", lambda: os.ftruncate(fd, 0)),
                             ("truncate to 1 TiB", lambda: os.ftruncate(fd, 1 << 40)),
                             ("punch a hole", lambda: punch_hole(fd, 0, size))):
            got[f"{kind}: {step}"] = outcome(action)
            got[f"{kind}: calls after {step}"] = sorted({
                outcome(lambda: call(client, kind, "identity", *random_input(rng, "identity", 1 << 20)))
                for _ in range(2)})
        got[f"{kind}: size"] = "unchanged" if os.fstat(fd).st_size == size else os.fstat(fd).st_size
    return got


def scribble_lane(args: dict, rng: np.random.Generator) -> dict:
    """Its own lane: both rings' head and tail set to 2**64-1, then to random values, then random
    bytes over its slots and junk entries on its submission ring, a call after each."""
    lane_layout = layout.LANE
    client = Client(args["socket"], timeout=ATTACK_TIMEOUT_S)
    client.open_region(1 << 20, lane="identity")
    zc = client.zero_copy("identity", {"x": ((256,), np.uint8)})
    buf, lane = zc.region.buf, zc.region.lane
    rings = (lane_layout.submission_off, lane_layout.completion_off)

    def run() -> str | None:
        x = rng.integers(0, 256, 256, dtype=np.uint8)
        zc.inputs["x"][...] = x
        return check(zc.run(timeout=2.0)["y"], x)

    got = {"before": outcome(run)}
    for ring in rings:
        for word in (layout.RING_HEAD, layout.RING_TAIL):
            atomics.store64(buf, ring + word, 2**64 - 1)
    got["indices 2**64-1"] = outcome(run)
    for ring in rings:
        for word in (layout.RING_HEAD, layout.RING_TAIL):
            atomics.store64(buf, ring + word, int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2)))
    lane.bell.notify()
    got["indices random"] = outcome(run)
    slots = lane_layout.slot_table_off
    for _ in range(int(rng.integers(10, 100))):
        offset = int(rng.integers(slots // 8, layout.LANE_BYTES // 8)) * 8
        buf[offset:offset + 8] = rng.bytes(8)
    for _ in range(int(rng.integers(1, 8))):
        lane.submissions.push(int(rng.integers(0, 2**64, dtype=np.uint64)))
    lane.bell.notify()
    got["slots scribbled"] = outcome(run)
    return got


def never_read(args: dict, rng: np.random.Generator) -> dict:
    """Many inline requests on a socket it never reads: the server stops reading it and closes it
    at the stall deadline; the send fails then."""
    s = connect(args["socket"], rcvbuf=4096, timeout=ATTACK_TIMEOUT_S)
    burst = b"".join(infer_frame(rid, 256 * 1024) for rid in range(1, 129))
    start = time.monotonic()
    result = {}

    def send():
        try:
            s.sendall(burst)
            result["send"] = "all sent"
        except OSError as exc:
            result["send"] = errno.errorcode.get(exc.errno, type(exc).__name__)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(ATTACK_TIMEOUT_S)
    return {"send": result.get("send", "still sending"), "after_s": round(time.monotonic() - start, 1)}


def stalled_upload(args: dict, rng: np.random.Generator) -> dict:
    """An inline request whose header and first 1000 payload bytes come, and the rest never."""
    n = 1 << 20
    s = connect(args["socket"], timeout=ATTACK_TIMEOUT_S)
    s.sendall(infer_frame(1, n)[:-(n - 1000)])
    return {"frames": frames_until_closed(s)}


def half_sent_header(args: dict, rng: np.random.Generator) -> dict:
    """A frame cut in its header or in its metadata, never finished."""
    cut = int(rng.choice([5, protocol.HEADER_SIZE + 10]))
    s = connect(args["socket"], timeout=ATTACK_TIMEOUT_S)
    s.sendall(protocol.encode_frame(Kind.HEALTH, {"id": 1, "padding": "x" * 100})[:cut])
    return {"frames": frames_until_closed(s)}


def region_limits(args: dict, rng: np.random.Generator) -> dict:
    """Regions up to and past each limit: count and bytes per connection, bytes per uid, count in
    all; the connections of each step are dropped without closing their regions."""
    limits, path = args["limits"], args["socket"]
    page_regions, big = 4096, 8 << 20

    def open_until_refused(size: int, per_connection: int, most: int) -> dict:
        """Open ``size``-byte regions, ``per_connection`` on each new connection, until one is refused
        (at most ``most`` tries); then drop those connections abruptly."""
        clients, opened = [], 0
        try:
            while opened < most:
                if opened % per_connection == 0:
                    clients.append(Client(path, timeout=ATTACK_TIMEOUT_S))
                try:
                    clients[-1].open_region(size)
                except ShmserveError as exc:
                    return {"opened": opened, **refusal(exc)}
                opened += 1
            return {"opened": opened, "code": None, "key": None}
        finally:
            for c in clients:
                c._pump.sock.close()  # no CLOSE_REGION: the server must free them when it sees the socket go
            wait_regions_below(args["instance"], args["regions_before"] + 1)

    return {
        "max_regions_per_connection": open_until_refused(page_regions, limits["max_regions_per_connection"] + 1,
                                                         limits["max_regions_per_connection"] + 1),
        "max_region_bytes_per_connection": open_until_refused(big, 1 << 20, 16),
        "max_region_bytes_per_uid": open_until_refused(big, limits["max_region_bytes_per_connection"] // big - 1,
                                                       limits["max_region_bytes_per_uid"] // big + 1),
        "max_regions": open_until_refused(page_regions, limits["max_regions_per_connection"],
                                          limits["max_regions"] + 1),
    }


def wait_regions_below(instance: str, count: int) -> None:
    """Until the server records fewer than ``count`` regions (it frees a dropped connection's as
    soon as it sees the socket go)."""
    deadline = time.monotonic() + ATTACK_TIMEOUT_S
    while len(inspection.snapshot(instance)["regions"]) >= count:
        assert time.monotonic() < deadline, "the server kept a dropped connection's regions"
        time.sleep(0.05)


def connection_flood(args: dict, rng: np.random.Generator) -> dict:
    """Connections, each served once (so that it counts), until one is refused; then all dropped."""
    opened = []
    for rid in range(args["limits"]["max_connections_per_uid"] + 1):
        s = connect(args["socket"], timeout=ATTACK_TIMEOUT_S)
        opened.append(s)
        s.sendall(protocol.encode_frame(Kind.HEALTH, {"id": rid}))
        conn = protocol.Connection(protocol.Role.CLIENT)
        while (event := conn.next_event()) is protocol.NEED_DATA:
            data = s.recv(65536)
            if not data:
                return {"served": rid, "refused": "closed without an answer"}
            conn.receive_data(data)
        if event.kind is Kind.ERROR:
            return {"served": rid, "refused": describe(event)}
    return {"served": len(opened), "refused": None}


def kill_lane_client(args: dict, rng: np.random.Generator) -> dict:
    """A client with calls in its lane of the batching model, killed (SIGKILL) in the middle of
    them: three at a time, fewer than a batch, so that its worker is usually gathering a batch
    with them claimed when the client's region is dropped."""
    victim = subprocess.Popen([sys.executable, "-m", "helpers.soak", "victim", json.dumps(args)],
                              stdout=subprocess.PIPE, text=True)
    try:
        rounds = 0
        while rounds < 2:
            line = victim.stdout.readline()
            if not line:
                return {"victim": f"ended before it was killed: exit {victim.wait()}"}
            rounds = int(line.split()[1])
        time.sleep(float(rng.uniform(0, 0.2)))
        os.kill(victim.pid, signal.SIGKILL)
        return {"victim": "killed" if victim.wait(ATTACK_TIMEOUT_S) == -signal.SIGKILL else "not killed",
                "rounds_done": rounds}
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def lane_victim(args: dict) -> None:
    """Three calls at a time in one lane of ``double``, round after round, until killed."""
    die_with_parent()

    async def main():
        async with AsyncClient(args["socket"], timeout=GOOD_TIMEOUT_S) as c:
            await c.open_region(1 << 20, lane="double")
            calls = [await c.zero_copy("double", {"x": ((2, 64), np.float32)}, output_capacity=2 * 64 * 4)
                     for _ in range(3)]
            for i, zc in enumerate(calls):
                zc.inputs["x"][...] = i
            for rounds in range(1, 1_000_000):
                await asyncio.gather(*(zc.run() for zc in calls))
                print(f"round {rounds}", flush=True)

    asyncio.run(main())


ATTACKS = {f.__name__: f for f in (truncate_own_regions, scribble_lane, never_read, stalled_upload,
                                    half_sent_header, region_limits, connection_flood, kill_lane_client)}


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    if role == "good":
        print(json.dumps(good_client(rest[0], json.loads(rest[1]))), flush=True)
    elif role == "attack":
        args = json.loads(rest[1])
        print(json.dumps({"attack": rest[0], "got": ATTACKS[rest[0]](args, np.random.default_rng(args["seed"]))}),
              flush=True)
        os._exit(0)  # abruptly: regions, lanes and sockets as they are
    elif role == "victim":
        lane_victim(json.loads(rest[0]))
    else:
        sys.exit(f"unknown role {role!r}")
