"""`shmserve bench`: request latency and throughput next to floors measured in the same run.

Owns: the benchmark.  For each payload size, mode and client count (a sweep:
``--clients 1,2,4,8``) it runs that many client processes against a server
(its own with ``--spawn-server``, else the one at ``--socket``, measuring a
model it lists) and reports p50/p90/p99/max latency, requests/s and GB/s,
with the ratio to the floor measured in the same run on the same machine.
Clients send back to back (closed loop), or at a fixed total rate
(``--rate N``, open loop, like perf_analyzer's request-rate mode: each
request is due at its time whether or not the last one is back, and its
latency counts from when it was due, so a server that falls behind shows it).
``--plot`` draws the latency percentiles of every case (matplotlib, the
``plot`` extra).  The floors:

* the floor for a round trip: a uvloop Unix-socket echo of the same payload
  (a server process echoing, a client sending and reading it back);
* for payloads of 1 MiB and more, also one memcpy of the payload into POSIX
  shared memory (the unavoidable copy of the inline path), added to the echo.

GB/s counts request payload bytes (the same amount comes back).  Machines here
are shared and noisy: compare ratios within one run, not numbers across runs.

Must not: start anything it does not own (``--spawn-server`` starts and stops
its own server on a temporary socket), or leave segments in /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

MODEL = "identity"  # uint8 vector in, the same vector out (shmserve.models:identity)
# For a model whose rows are larger than the payload asked for (the demo's image is 12 KiB a row)
# one row is sent: the table's "tensor" column says what really went, and GB/s counts that.
UNITS = {"": 1, "B": 1, "KIB": 1024, "KB": 1000, "MIB": 1 << 20, "MB": 1000 ** 2, "GIB": 1 << 30}

RUN_ID = uuid.uuid4().hex[:8]  # names this run's server instance and segments (its JSON says it)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    num = text.rstrip("KMGIB")
    unit = text[len(num):]
    try:
        size = int(float(num) * UNITS[unit])
    except (KeyError, ValueError, OverflowError):
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 64, 4KiB, 16MiB)")
    return size


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# -- client processes -------------------------------------------------------------------------

def make_input(spec: dict, size: int, rng) -> tuple[str, np.ndarray]:
    """An input for a model with one input: its dynamic leading dimension sized so the tensor is
    about ``size`` bytes (at least one row); other dynamic dimensions are 1."""
    (tensor,) = spec["inputs"]
    dtype = np.dtype(tensor["dtype"])
    rest = [d if isinstance(d, int) and d >= 0 else 1 for d in tensor["shape"][1:]]
    row = dtype.itemsize * int(np.prod(rest, dtype=np.int64))
    first = tensor["shape"][0] if tensor["shape"] else None
    rows = first if isinstance(first, int) and first >= 0 else max(1, size // max(row, 1))
    shape = ([rows] if tensor["shape"] else []) + rest
    if dtype.kind == "f":
        x = rng.standard_normal(shape).astype(dtype)
    else:
        x = rng.integers(0, 100, shape).astype(dtype)
    return tensor["name"], x


WARMUP = 20  # requests per client before it reports ready


def client_main(path: str, mode: str, size: int, requests: int, duration: float, model: str,
                rate: float = 0.0) -> None:
    """One benchmark client (a child process): connects and warms up, says "ready", waits for
    "go" on stdin (so that every client measures the same window, not its neighbours' start-up),
    then prints its latencies in microseconds and its measuring window as JSON.  With ``rate``
    (requests/s of this client) request i is due at start + i / rate, and its latency counts
    from then."""
    from shmserve import Client

    samples = []
    with Client(path, timeout=120) as c:
        spec = next(m for m in c.models() if m["name"] == model)
        name, x = make_input(spec, size, np.random.default_rng(os.getpid()))
        if mode == "inline":
            run = lambda: c.infer(model, {name: x})  # noqa: E731
            call = None
        else:
            call = c.zero_copy(model, {name: (x.shape, x.dtype)})
            call.inputs[name][...] = x
            run = call.run
        for _ in range(WARMUP):
            run()
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.monotonic()
        deadline = start + duration if duration else None
        t_start = time.perf_counter_ns()
        interval_ns = int(1e9 / rate) if rate else 0
        for i in range(requests):
            t0 = time.perf_counter_ns()
            if interval_ns:
                due = t_start + i * interval_ns
                if due > t0:
                    time.sleep((due - t0) / 1e9)
                t0 = due
            run()
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if deadline and time.monotonic() > deadline and i >= 10:
                break
        end = time.monotonic()
        if call is not None:
            call.release()
    print(json.dumps({"samples": samples, "nbytes": int(x.nbytes), "start": start, "end": end}), flush=True)


def run_case(path: str, mode: str, size: int, clients: int, requests: int, duration: float,
             model: str, rate: float = 0.0) -> dict:
    """Run ``clients`` client processes over one common window; requests/s counts that window only.
    ``rate``: requests/s of all of them together (0: each sends back to back)."""
    procs = [subprocess.Popen([sys.executable, "-m", "shmserve.bench", "--client", path, mode, str(size),
                               str(requests if not duration else 1 << 62), str(duration), model,
                               str(rate / clients if rate else 0.0)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(clients)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a benchmark client failed to start (exit {p.wait()})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"a benchmark client failed (exit {p.returncode})")
            reports.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    samples = [s for r in reports for s in r["samples"]]
    wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    result = summarize(samples, wall, reports[0]["nbytes"])
    result["tensor_bytes"] = reports[0]["nbytes"]
    return result


def summarize(samples: list[float], wall: float, size: int) -> dict:
    arr = np.asarray(samples)
    rps = len(samples) / wall if wall else 0.0
    return {"n": len(samples), "p50_us": round(float(np.percentile(arr, 50)), 1),
            "p90_us": round(float(np.percentile(arr, 90)), 1), "p99_us": round(float(np.percentile(arr, 99)), 1),
            "max_us": round(float(arr.max()), 1), "rps": round(rps, 1), "GBps": round(rps * size / 1e9, 3)}


# -- floors -----------------------------------------------------------------------------------

ECHO_SERVER = """
import asyncio, signal, sys, uvloop
signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it quietly
class Echo(asyncio.Protocol):
    def connection_made(self, t): self.t = t
    def data_received(self, d): self.t.write(d)
async def main():
    server = await asyncio.get_running_loop().create_unix_server(Echo, sys.argv[1])
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


def echo_floor(size: int, reps: int) -> float:
    """p50 microseconds of a uvloop Unix-socket echo of ``size`` bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "echo.sock")
        server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, path], stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
            data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
            back = bytearray(size)
            view = memoryview(back)
            samples = []
            for i in range(reps + 10):
                t0 = time.perf_counter_ns()
                sock.sendall(data)
                got = 0
                while got < size:
                    got += sock.recv_into(view[got:])
                if i >= 10:
                    samples.append((time.perf_counter_ns() - t0) / 1e3)
            sock.close()
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(10)
    return float(statistics.median(samples))


def memcpy_floor(size: int, reps: int) -> float:
    """p50 microseconds of one copy of ``size`` bytes into POSIX shared memory (already touched)."""
    import posix_ipc

    name = f"/shmserve-bench-{RUN_ID}-{uuid.uuid4().hex[:8]}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    try:
        buf = mmap.mmap(shm.fd, size)
        shm.close_fd()
        dst = np.frombuffer(buf, np.uint8)
        src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        dst[:] = 0
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            np.copyto(dst, src)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
        del dst
        buf.close()
    finally:
        posix_ipc.unlink_shared_memory(name)
    return float(statistics.median(samples))


# -- the server it may own ---------------------------------------------------------------------

def spawn_server(workdir: Path) -> tuple[subprocess.Popen, str]:
    from shmserve import Client
    from shmserve.errors import ConnectionClosed

    instance = f"bench-{RUN_ID}"
    sock = str(workdir / "bench.sock")
    cfg = workdir / "bench.toml"
    cfg.write_text(f"""[server]
instance = "{instance}"
max_request_bytes = {200 << 20}
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
instances = 2
[[models]]
name = "identity_batched"
backend = "python"
path = "shmserve.models:identity"
instances = 1
max_batch_size = 64
max_queue_delay_us = 50
[[models]]
name = "demo"
backend = "onnxruntime"
path = "{_demo_path()}"
""")
    log = open(workdir / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "serve", "--config", str(cfg), "--socket", sock],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"shmserve bench: the server exited ({proc.returncode}); log: {workdir / 'server.log'}")
        try:
            with Client(sock) as c:
                c.health()
            return proc, sock
        except ConnectionClosed:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("shmserve bench: the server did not start in 120 s")


def _demo_path() -> str:
    from shmserve.config import demo_config

    return demo_config().models[0].path


class Progress:
    """Where a run is: a progress bar with the case in hand on a terminal (rich, on stderr), else
    one ``[step/total] case`` line per case (logs and pipes stay readable)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.bar = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           console=Console(file=self.stream), transient=True)
            self.task = self.bar.add_task("starting", total=total)
            self.bar.start()

    def step(self, what: str) -> None:
        """The next case begins (the one before is done)."""
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, description=what)
        else:
            print(f"[{self.done + 1}/{self.total}] {what}", file=self.stream, flush=True)
        self.done += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
            self.bar.stop()
            self.bar = None


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"bad client counts {text!r} (use e.g. 1 or 1,2,4,8)")
    return counts


def pick_model(path: str, wanted: str | None) -> tuple[str | None, tuple[int, str] | None]:
    """(model, None): ``wanted``, or a model the server at ``path`` lists that bench can drive
    (``identity`` if it has one, else its first one-input model); or (None, (exit code, why))."""
    from shmserve.cli import EXIT_FAILURE, EXIT_NO_SERVER
    from shmserve.client import Client
    from shmserve.errors import ConnectionClosed, ShmserveError

    try:
        with Client(path, timeout=30) as client:
            listing = client.models()
    except ConnectionClosed as exc:
        return None, (EXIT_NO_SERVER, f"{exc.message} (start one, or give --spawn-server)")
    except ShmserveError as exc:
        return None, (EXIT_FAILURE, str(exc))
    names = [m["name"] for m in listing if len(m.get("inputs") or ()) == 1]
    if wanted is not None and wanted not in names:
        return None, (EXIT_FAILURE, f"the server has no one-input model {wanted!r} "
                                    f"(it has: {', '.join(names) or 'none'}); give --model")
    if wanted is None and not names:
        return None, (EXIT_FAILURE, "the server lists no model with a single input; give --spawn-server")
    return wanted or (MODEL if MODEL in names else names[0]), None


def plot(results: list[dict], path: str, title: str) -> None:
    """Latency percentiles (p50, p90, p99) of every case, one group of bars per case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("shmserve bench: --plot needs matplotlib: pip install 'shmserve[plot]'") from None
    labels = [f"{human(r['payload'])}\n{r['mode']}\n{r['clients']} cl." for r in results]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(results)), 4.5))
    for i, (key, name) in enumerate((("p50_us", "p50"), ("p90_us", "p90"), ("p99_us", "p99"))):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in results], 0.27, label=name)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("latency, µs (log)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from shmserve.cli import EXIT_CODES, HelpFormatter, instance_name
    from shmserve.inspection import plural

    p = argparse.ArgumentParser(prog="shmserve bench", description="Latency and throughput against floors "
                                                                   "measured in the same run.",
                                formatter_class=HelpFormatter,
                                epilog="examples:\n  shmserve bench --spawn-server\n"
                                       "  shmserve bench --payload 4KiB,1MiB --json-out results.json\n"
                                       "  shmserve bench --payload 4KiB --clients 1,2,4,8 --plot latency.png\n"
                                       "  shmserve bench --payload 4KiB --clients 4 --rate 2000\n\n" + EXIT_CODES)
    p.add_argument("--socket", help="server to measure (default: $SHMSERVE_SOCKET, else the --instance's socket "
                                    "in $XDG_RUNTIME_DIR/shmserve/ or /tmp/shmserve-<uid>/)")
    p.add_argument("--instance", type=instance_name, default="default", help="instance whose default socket to measure")
    p.add_argument("--spawn-server", action="store_true", help="start and stop a server of its own")
    p.add_argument("--model", help="a model with one input; its leading dimension is sized to the payload "
                                   "(default: identity, or the running server's first one-input model; "
                                   "--spawn-server has identity, identity_batched, demo)")
    p.add_argument("--payload", default="64,4KiB,1MiB,16MiB", help="comma-separated sizes")
    p.add_argument("--mode", choices=("inline", "zero-copy", "both"), default="both", help="how requests travel")
    p.add_argument("--clients", type=parse_counts, default=[1], metavar="N[,N...]",
                   help="client processes per case; a list sweeps them (1,2,4,8)")
    p.add_argument("--requests", type=int, default=500, help="requests per client per case (after 20 warm-up)")
    p.add_argument("--duration", type=float, default=0.0, help="or: stop each client after this many seconds")
    p.add_argument("--rate", type=float, default=0.0, metavar="N",
                   help="requests/s of all clients together, each due at its time (open loop); 0: back to back")
    p.add_argument("--json", action="store_true", help="print the results as one line of JSON instead of the table")
    p.add_argument("--json-out", metavar="FILE", help="write the results here too, as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw every case's latency percentiles (needs matplotlib)")
    args = p.parse_args(argv)
    if args.rate < 0:
        p.error("--rate must be 0 or more")
    try:
        sizes = [parse_size(s) for s in args.payload.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(f"--payload: {exc}")
    for option, target in (("--json-out", args.json_out), ("--plot", args.plot)):
        if target:
            try:
                open(target, "a").close()  # refused now, not after the run
            except OSError as exc:
                p.error(f"{option}: cannot write {target}: {exc.strerror or exc}")
    modes = ["inline", "zero-copy"] if args.mode == "both" else [args.mode]
    tmp = tempfile.TemporaryDirectory(prefix="shmserve-bench-")
    proc = None
    if args.spawn_server:
        proc, path = spawn_server(Path(tmp.name))
        model = args.model or MODEL
    else:
        from shmserve.config import resolve_socket

        path = resolve_socket(args.socket, None, args.instance)
        model, problem = pick_model(path, args.model)
        if problem:
            print(f"shmserve bench: {problem[1]}", file=sys.stderr)
            return problem[0]
    results = []
    progress = Progress(len(sizes) * (len(modes) * len(args.clients) + 1))
    try:
        for size in sizes:
            reps = max(20, min(2000, (256 << 20) // max(size, 1)))
            progress.step(f"floor for {human(size)}")
            floor = echo_floor(size, reps)
            copy = memcpy_floor(size, min(reps, 50)) if size >= (1 << 20) else 0.0
            for mode in modes:
                for clients in args.clients:
                    progress.step(f"{mode} {human(size)} x {plural(clients, 'client')}")
                    r = run_case(path, mode, size, clients, args.requests, args.duration, model, args.rate)
                    r.update(payload=size, mode=mode, clients=clients, rate=args.rate,
                             echo_floor_p50_us=round(floor, 1), memcpy_p50_us=round(copy, 1),
                             ratio_to_floor=round(r["p50_us"] / (floor + copy), 2))
                    results.append(r)
    finally:
        progress.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        tmp.cleanup()
    pacing = f"at {args.rate:g} req/s in all (latency from each request's due time)" if args.rate else "back to back"
    report = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "model": model, "run_id": RUN_ID,
              "rate": args.rate, "results": results}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(results, args.plot, f"shmserve bench, model {model}, {pacing}, {time.strftime('%Y-%m-%d')}")
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\nshmserve bench, model {model}, clients {pacing}, {plural(os.cpu_count(), 'CPU')}, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| payload | tensor | mode | clients | p50 µs | p90 µs | p99 µs | max µs | req/s | GB/s | floor p50 µs "
          "| p50 / floor |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        floor = r["echo_floor_p50_us"] + r["memcpy_p50_us"]
        print(f"| {human(r['payload'])} | {human(r['tensor_bytes'])} | {r['mode']} | {r['clients']} | {r['p50_us']} | "
              f"{r['p90_us']} | {r['p99_us']} | {r['max_us']} | {r['rps']} | {r['GBps']} | {floor:.1f} | "
              f"{r['ratio_to_floor']} |")
    print("\nfloor = uvloop Unix-socket echo of the same payload (+ one memcpy into shared memory from 1 MiB up)")
    return 0


if __name__ == "__main__":
    try:
        if len(sys.argv) > 1 and sys.argv[1] == "--client":
            client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]),
                        sys.argv[7], float(sys.argv[8]))
        else:
            sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: each client leaves quietly
        sys.exit(130)
