"""The contract between the front-end and a worker process.

Owns: how a worker is started (its argv and inherited descriptors), the
messages it sends on its control socket, the ring entry that stops it, the
meaning of its exit codes, and which backends a worker can be asked to run
(their names and where each loader is, ``BUILTIN`` and the
``shmserve.backends`` entry points: ``backend_names``; the worker's registry,
``workers.backends``, loads them).  Both sides import this module; it imports
nothing heavy, and no backend.

Control socket: a SOCK_SEQPACKET socketpair, one JSON object per message.
Worker -> front-end:

    {"event": "ready", "spec": {...ModelSpec.to_dict()...},   loaded and warmed up;
     "gpu": {...} or null,                                     what the GPU registered;
     "memory": {"host_bytes": n, "device_bytes": n},           what it uses (workers.memory);
     "warmup": {"runs": n, "seconds": t},                      what its warm-up ran
     "placement": {"device": "cuda:1", "cpus": "0-3",          where it runs (its affinity, read back),
                   "threads": {...}}}                           and its runtime's thread pools
                                                               (``workers.adapter.BackendAdapter.threads``)
    {"event": "failed", "error": "..."}                        could not load
    {"event": "dropped", "region": id}                         a region it was told to drop is
                                                               unmapped and its descriptor closed
    {"event": "lane_failed", "region": id, "error": "..."}     a lane it was told to attach cannot
                                                               be served (not mapped or not locked)
    {"event": "signatures", "new": n, "distinct": n,           requests that brought an input signature
     "short": n}                                               it had not met, signatures it remembers,
                                                               runs whose outputs outgrew their space
                                                               (``workers.step``; at most one a second,
                                                               when idle, and after a short answer)

Front-end -> worker, only client regions (``send_region``):

    {"event": "region", "region": id, "size": n} + the region's sealed memfd (SCM_RIGHTS)

sent before the first ring entry that names the region reaches that worker;
the worker takes them off the socket when it meets a region it does not
have (``receive_regions``, never blocking) and maps ``size`` bytes, the size
the front-end recorded and sealed, whatever the descriptor claims.

Everything else front-end -> worker goes through the worker's submission
ring: slot entries, and commands (``layout.command_entry``): stop, attach
or detach a client lane (a region whose first ``layout.LANE_BYTES`` hold a
private queue to this worker), and drop a region (unmap it once no request
in hand uses it).

Exit codes (after gunicorn's arbiter: named codes stop crash loops):
"""

from __future__ import annotations

import array
import os
import socket
import sys

import orjson

# The environment variables that size a worker's OpenMP, MKL and OpenBLAS pools: its ready message
# reports them beside its runtime's own thread settings.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

EXIT_OK = 0
EXIT_LOAD_FAILED = 3  # the model cannot be loaded: restarting would fail the same way
EXIT_ARENA_FAILED = 4  # cannot map or register the arena: a host problem, not retried
EXIT_ORPHANED = 5  # the front-end went away
EXIT_TERMINATED = 6  # SIGTERM from the supervisor: left at once, after releasing what it held
EXIT_PLACEMENT_FAILED = 7  # the kernel refused its CPUs (sched_setaffinity): the same next time, not retried
NO_RESTART = frozenset({EXIT_LOAD_FAILED, EXIT_ARENA_FAILED, EXIT_PLACEMENT_FAILED})
# Any other death is restarted after a back-off; this many in a row, each before the worker had served
# restart_healthy_s, is a crash loop: reported (health, info, inspect), and still restarted.
CRASH_LOOP_DEATHS = 3
EXIT_NAMES = {EXIT_OK: "stopped", EXIT_LOAD_FAILED: "model failed to load",
              EXIT_ARENA_FAILED: "could not use the arena", EXIT_ORPHANED: "front-end gone",
              EXIT_TERMINATED: "terminated", EXIT_PLACEMENT_FAILED: "could not pin to its CPUs"}

# The backends a worker can run, by name: "module:loader" (imported only by the worker that runs one,
# ``workers.backends.find``), then any installed package's entry points of this group.
BACKEND_ENTRY_POINTS = "shmserve.backends"
BUILTIN_BACKENDS = {
    "onnxruntime": "workers.backends.onnxruntime:load",
    "python": "workers.backends.python:load",
    "torch": "workers.backends.torch:load",
    "tensorrt": "workers.backends.tensorrt:load",
}


def backend_names() -> list[str]:
    """Every backend name a worker can be asked to run, sorted; imports no backend or runtime
    (the configuration checks ``backend`` keys against it when a file is read)."""
    from importlib.metadata import entry_points

    return sorted(set(BUILTIN_BACKENDS) | {ep.name for ep in entry_points(group=BACKEND_ENTRY_POINTS)})


# Commands on a worker's submission ring (encoded by ``layout.command_entry``): CMD_STOP,
# CMD_ATTACH_LANE and CMD_DROP_REGION with a region id, and ``layout.STOP_ENTRY``.
MAX_LANES = 127  # per worker: it sleeps on its own ring and its lanes' in one futex_waitv (128 words)
CONTROL_MAX = 1 << 20
_FD_SIZE = array.array("i").itemsize


def raise_descriptor_limit() -> None:
    """Both sides hold a descriptor per client region (up to ``max_regions``) besides their own:
    lift the soft RLIMIT_NOFILE to the hard limit (the default soft 1024 is too few)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def worker_argv(*, instance: str, index: int, model_json: bytes, control_fd: int, completion_fd: int,
                spin_us: int, cpus: str | None = None) -> list[str]:
    """``cpus``: the cpulist the worker pins itself to before anything else (None: not pinned);
    ``model_json`` names the one device it runs on."""
    # -P: the front-end's current directory is not on the worker's sys.path (a module planted there,
    # or a checkout named shmserve beside it, is never imported in its place)
    return [sys.executable, "-P", "-m", "workers.main", "--instance", instance, "--index", str(index),
            "--model", model_json.decode(), "--control-fd", str(control_fd),
            "--completion-fd", str(completion_fd), "--spin-us", str(spin_us),
            *(("--cpus", cpus) if cpus is not None else ())]


def encode(message: dict) -> bytes:
    return orjson.dumps(message)


def decode(data: bytes) -> dict:
    message = orjson.loads(data)
    if not isinstance(message, dict) or "event" not in message:
        raise ValueError("control message without an event")
    return message


def send_region(sock: socket.socket, region: int, size: int, fd: int) -> bool:
    """Front-end: pass region ``region`` (``size`` bytes, descriptor ``fd``) to a worker over its
    control socket without blocking.  False if it cannot take it now (its socket is full: the
    worker is busy or wedged) or is gone."""
    try:  # not socket.send_fds: before Python 3.12 it drops its flags (and could block here)
        sock.sendmsg([encode({"event": "region", "region": region, "size": size})],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], socket.MSG_DONTWAIT)
    except OSError:
        return False
    return True


def tell_lane_failed(sock: socket.socket, region: int, why: str) -> None:
    """Worker: the lane of region ``region`` cannot be served here (``why``)."""
    try:
        sock.send(encode({"event": "lane_failed", "region": region, "error": why[:500]}))
    except OSError:
        pass  # the front-end is gone


def tell_signatures(sock: socket.socket, counts: dict) -> None:
    """Worker: its input-signature counts (``{"new", "distinct"}``), for ``shmserve doctor``."""
    try:
        sock.send(encode({"event": "signatures", **counts}))
    except OSError:
        pass  # the front-end is gone


def tell_dropped(sock: socket.socket, region: int) -> None:
    """Worker: region ``region`` is unmapped and its descriptor closed (the front-end frees its
    pages once every worker that had it said so).  Blocks only while the front-end's side is
    full, which it never leaves for long."""
    try:
        sock.send(encode({"event": "dropped", "region": region}))
    except OSError:
        pass  # the front-end is gone


def receive_regions(sock: socket.socket) -> list[tuple[int, int, int]]:
    """Worker: every region descriptor waiting on the control socket, as (region, size, fd), the
    caller owning each fd.  Never blocks; anything that is not a region message is discarded
    (its descriptors closed)."""
    received = []
    while True:
        try:  # not socket.recv_fds: before Python 3.12 it drops its flags (and would block here)
            data, ancillary, _, _ = sock.recvmsg(CONTROL_MAX, socket.CMSG_SPACE(4 * _FD_SIZE), socket.MSG_DONTWAIT)
        except OSError:  # BlockingIOError: nothing more now
            return received
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % _FD_SIZE])
        if not data and not fds:
            return received  # the front-end is gone
        try:
            message = decode(data)
            region, size = message["region"], message["size"]
            ok = message["event"] == "region" and len(fds) == 1 and type(region) is int and type(size) is int
        except (ValueError, KeyError):
            ok = False
        if ok:
            received.append((region, size, fds[0]))
        else:
            for fd in fds:
                os.close(fd)


def describe_exit(status: int) -> str:
    """Words for a waitpid() status."""
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    code = os.WEXITSTATUS(status)
    return f"exit {code} ({EXIT_NAMES.get(code, 'error')})"
