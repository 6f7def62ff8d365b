#!/usr/bin/env python3
"""Issue 29's cancellation target: of requests cancelled before a worker claimed them, how many a worker ran.

Target: "Cancelled requests that a worker ran: 0 of those cancelled before claim,
over 10,000 cancellations."  This starts a server (``--socket``: use a running one
instead) with one slow model, ``tests/serving_models.py:gated`` (one worker; each
run records its tag in a file, then sleeps ``--sleep-ms``), and sends it ``2 *
--cancels`` requests over one connection, ``--window`` in flight, each tagged.
Every odd one is cancelled (a CANCEL frame) right after it is sent: most are then
still queued behind the slow worker, some are running, a few already answered.

Then it compares three independent records:

* what the worker ran: the model's own file of tags (``ran``);
* where the server says each cancellation happened: ``info``'s ``cancelled``
  (``queued``: taken back before a worker claimed it; ``running``; ``answered``);
* what each cancelled request was answered: CANCELLED, or its result.

"cancelled before claim, and run" = queued - |cancelled tags never run|: the
requests the server says it took back, less those the worker indeed never ran
(0 when the target holds).  Also printed: the worker's own count of requests
run (the arena's worker table), which must equal |ran|.

usage: python tools/bench_cancel.py [--cancels N] [--window W] [--sleep-ms S] [--json]
       (``storm`` is what tests/test_cancellation.py runs, bounded, on its own server)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gated"


def storm(path: str, record: Path, *, cancels: int, first_tag: int = 1, window: int = 32, sleep_s: float = 0.002,
          model: str = MODEL, timeout_s: float = 120.0) -> dict:
    """Send ``2 * cancels`` requests to ``model`` (``serving_models.gated``) on the server at ``path``,
    cancelling every odd one right after it is sent; tags from ``first_tag``.  Returns the counts
    (see the module header); ``record`` is the model's file of tags it ran."""
    from shmserve.client import Client
    from shmserve.session import NEED_DATA, ClientSession, ConnectionFailed, RequestFailed

    def counts() -> tuple[dict, int]:
        with Client(path, timeout=30) as c:
            info = c.info()
        [entry] = [e for e in info["cancelled"] if e["model"] == model]
        return entry, sum(w["requests"] for w in info["workers"] if w["model"] == model)

    before, runs_before = counts()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.settimeout(timeout_s)
    session = ClientSession()
    tag_of, answers, cancelled = {}, {}, set()
    in_flight = 0

    def read_one() -> None:
        nonlocal in_flight
        while (event := session.next_event()) is NEED_DATA:
            buf = session.read_buffer()
            n = sock.recv_into(buf)
            if not n:
                raise ConnectionError("the server closed the connection")
            session.read_done(n)
        if type(event) is ConnectionFailed:
            raise ConnectionError(event.message)
        tag = tag_of.pop(event.request_id)
        answers[tag] = event.error.code.wire if type(event) is RequestFailed else "ok"
        in_flight -= 1

    started = time.monotonic()
    last = first_tag + 2 * cancels
    for tag in range(first_tag, last):
        rid, parts = session.infer(model, {"x": np.array([tag, -sleep_s], np.float32)}, timeout_s)
        sock.sendall(b"".join(bytes(p) for p in parts))
        tag_of[rid] = tag
        in_flight += 1
        if (tag - first_tag) % 2:
            sock.sendall(session.cancel(rid))
            cancelled.add(tag)
        while in_flight >= window:
            read_one()
    while in_flight:
        read_one()
    seconds = time.monotonic() - started
    sock.close()
    after, runs_after = counts()
    ran = {int(line) for line in record.read_text().split()} & set(range(first_tag, last))
    stages = {stage: after[stage] - before[stage] for stage in ("queued", "running", "answered")}
    never_ran = cancelled - ran
    return {
        "requests": 2 * cancels, "cancels_sent": len(cancelled), "seconds": round(seconds, 2),
        "server_counted": stages,
        "answered_cancelled": sum(answers[t] == "cancelled" for t in cancelled),
        "answered_ok_after_cancel": sum(answers[t] == "ok" for t in cancelled),
        "cancelled_never_run": len(never_ran),
        "cancelled_before_claim_and_run": stages["queued"] - len(never_ran),
        "never_run_but_not_answered_cancelled": sum(answers[t] != "cancelled" for t in never_ran),
        "not_cancelled_answered_ok": sum(answers[t] == "ok" for t in range(first_tag, last) if t not in cancelled),
        "ran": len(ran), "worker_runs": runs_after - runs_before,
    }


def start_server(work: Path) -> tuple[subprocess.Popen, str, Path]:
    """A server of ``gated`` (one worker) in ``work``; (process, socket path, the model's record)."""
    from shmserve.client import Client

    record, gates = work / "record", work / "gates"
    gates.mkdir()
    record.touch()
    config = work / "cancel.toml"
    config.write_text(f'[server]\ninstance = "cancelbench{os.getpid()}"\n\n[[models]]\nname = "{MODEL}"\n'
                      f'backend = "python"\npath = "serving_models:gated"\n'
                      f'options = {{factory = true, record = "{record}", gates = "{gates}"}}\n')
    sock = str(work / "s.sock")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    log = open(work / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "serve", "--config", str(config), "--socket",
                               sock], stdout=log, stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        try:
            with Client(sock, timeout=10) as c:
                c.health()
            return server, sock, record
        except Exception:  # noqa: BLE001 - not up yet
            if server.poll() is not None:
                raise SystemExit((work / "server.log").read_text())
            time.sleep(0.1)
    server.kill()
    raise SystemExit("the server did not start in 60 s:\n" + (work / "server.log").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cancels", type=int, default=10_000, help="requests cancelled (as many are not; default 10000)")
    p.add_argument("--window", type=int, default=32, help="requests in flight on the connection (default 32)")
    p.add_argument("--sleep-ms", type=float, default=2.0, help="the model's time per run (default 2 ms)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    if args.cancels < 1 or not 1 <= args.window <= 64 or args.sleep_ms < 0:
        p.error("--cancels must be at least 1, --window in 1..64 (server.max_inflight_per_connection), "
                "--sleep-ms not negative")
    with tempfile.TemporaryDirectory() as tmp:
        server, sock, record = start_server(Path(tmp))
        try:
            result = storm(sock, record, cancels=args.cancels, window=args.window, sleep_s=args.sleep_ms / 1000)
        finally:
            server.terminate()
            server.wait(60)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    s = result["server_counted"]
    print(f"{result['requests']} requests, {result['cancels_sent']} cancelled, in {result['seconds']} s")
    print(f"server: cancelled before claim {s['queued']}, while running {s['running']}, "
          f"after the answer {s['answered']}")
    print(f"answers to the cancelled: {result['answered_cancelled']} cancelled, "
          f"{result['answered_ok_after_cancel']} results")
    print(f"worker ran {result['ran']} (its own count: {result['worker_runs']}); cancelled never run: "
          f"{result['cancelled_never_run']}")
    print(f"Cancelled requests that a worker ran: {result['cancelled_before_claim_and_run']} of the "
          f"{s['queued']} cancelled before claim, over {result['cancels_sent']} cancellations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
