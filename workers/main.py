"""The worker process's entry: ``python -m workers.main`` (argv in ``shmserve.workerlink``).

Owns: what happens between the front-end spawning a worker and the serve
loop: arguments, signals (the front-end owns SIGINT; SIGTERM from the
supervisor means "leave now"; we die with the front-end, PR_SET_PDEATHSIG), pinning
itself to the CPUs the supervisor chose (``--cpus``: before any import that
starts a thread), mapping the arena and selecting the device, the one
``ExitStack`` that everything the worker holds is entered on
(``workers.worker.open_worker``), the control-socket messages ("ready" with
the spec, the memory it measured and what its warm-up ran, or "failed" with
why; "ready" also says where it runs: its device and its CPUs as read back),
and the exit codes (``workerlink``).

A worker is one model on one device, spawned, never forked from a process
that touched CUDA.  It trusts nothing it reads from the arena.

Must not: serve requests (``workers.worker``, ``workers.step``), accept
connections, allocate arena space, or free slots.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # Order matters here: pin this process to its CPUs before any import below starts a thread.
    # numpy's BLAS starts its pool at import, and a thread keeps the affinity it was created
    # with; torch and OpenMP size their pools from the affinity they find at import.
    from shmserve import placement as _placement

    _early = _placement.cpus_argument(sys.argv)
    try:
        _EARLY_PIN = (_early, _placement.pin(None if _early is None else _placement.parse_cpulist(_early)))
    except ValueError as _exc:
        _EARLY_PIN = (_early, f"--cpus {_early!r}: {_exc}")
else:
    _EARLY_PIN = None

import argparse
import contextlib
import ctypes
import functools
import os
import signal
import socket

import orjson

from shmserve import _atomics as atomics
from shmserve import layout, placement, workerlink
from shmserve.arena import Arena, ArenaError
from shmserve.config import ModelConfig
from workers.regions import GpuMemory
from workers.worker import StartFailed, Worker, device_unusable, open_worker

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # the idle-tick ppid check still catches orphaning


def _terminated(buf, state_offset: int, signum, frame) -> None:
    """SIGTERM: the supervisor's step after a STOP entry that was not enough (a wedged worker, a stop
    that outlasts its time).  It marks our worker-table entry STOPPING before it signals; then we
    leave at once, unwinding the ExitStack (unregister before unmap; the front-end fails the
    request in hand).  A TERM without that mark (a shell's pkill, a kill of the process group) is
    ignored: the front-end stops us in order."""
    if atomics.load32(buf, state_offset) == layout.WORKER_STOPPING:
        raise SystemExit(workerlink.EXIT_TERMINATED)


def _start(stack: contextlib.ExitStack, args: argparse.Namespace, config: ModelConfig,
           control: socket.socket) -> Worker:
    """Map the arena and open the worker on ``stack``; StartFailed says why not."""
    try:
        arena = stack.enter_context(Arena.attach(args.instance))
    except ArenaError as exc:
        raise StartFailed(workerlink.EXIT_ARENA_FAILED, f"cannot attach the arena: {exc}") from None
    state_offset = arena.geometry.worker_off(args.index) + layout.WORKER.offset("state")
    signal.signal(signal.SIGTERM, functools.partial(_terminated, arena.buf, state_offset))
    stack.callback(signal.signal, signal.SIGTERM, signal.SIG_IGN)  # before the arena is unmapped
    gpu = None
    if config.device.startswith("cuda"):
        try:
            gpu = GpuMemory(int(config.device.split(":")[1]))
        except Exception as exc:
            raise device_unusable(config, exc) from None
    return open_worker(stack, arena, args.index, config, args.completion_fd, args.spin_us / 1e6,
                       functools.partial(workerlink.receive_regions, control), gpu,
                       functools.partial(workerlink.tell_dropped, control),
                       functools.partial(workerlink.tell_lane_failed, control),
                       functools.partial(workerlink.tell_signatures, control))


def _pin(cpus: str | None) -> str | None:
    """Pin to ``cpus`` (done already at import when run as a program with the same --cpus); None
    when pinned or nothing asked, else why not."""
    if _EARLY_PIN is not None and _EARLY_PIN[0] == cpus:
        return _EARLY_PIN[1]
    try:
        return placement.pin(None if cpus is None else placement.parse_cpulist(cpus))
    except ValueError as exc:
        return f"--cpus {cpus!r}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workers.main")
    parser.add_argument("--instance", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--model", required=True, help="ModelConfig as JSON")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--completion-fd", type=int, required=True)
    parser.add_argument("--spin-us", type=int, default=0)
    parser.add_argument("--cpus", default=None, help="pin to this cpulist (default: not pinned)")
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal, or a `kill`/`pkill` of the whole process group, reaches us too: the
    # front-end owns those, drains, and stops us in order with a STOP entry.  Until the arena is
    # mapped both are ignored; then SIGTERM counts only when our supervisor sent it (_terminated).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ppid = os.getppid()
    workerlink.raise_descriptor_limit()
    _die_with_parent()
    if os.getppid() != ppid:
        return workerlink.EXIT_ORPHANED
    with socket.socket(fileno=args.control_fd) as control, contextlib.ExitStack() as stack:
        refused = _pin(args.cpus)
        if refused is not None:
            control.send(workerlink.encode({"event": "failed", "error": refused}))
            return workerlink.EXIT_PLACEMENT_FAILED
        config = ModelConfig.from_dict(orjson.loads(args.model))
        try:
            worker = _start(stack, args, config, control)
        except StartFailed as exc:
            control.send(workerlink.encode({"event": "failed", "error": exc.message}))
            return exc.exit_code
        where = {"device": config.device, "cpus": placement.format_cpulist(os.sched_getaffinity(0)),
                 "threads": {**worker.threads, "env": {name: os.environ[name] for name in workerlink.THREAD_VARIABLES
                                                       if name in os.environ}}}
        control.send(workerlink.encode({"event": "ready", "spec": worker.spec.to_dict(), "gpu": worker.gpu_info,
                                        "memory": worker.memory, "warmup": worker.warmup, "placement": where}))
        return worker.serve()


if __name__ == "__main__":
    code = main()
    if code == workerlink.EXIT_LOAD_FAILED:
        # A runtime that failed half-way (TensorRT 11.4 lean without CUDA, for one) can crash in
        # its destructor at interpreter exit, which would turn this named exit code into a
        # SIGSEGV and a restart loop.  Everything of ours is closed: leave without finalizers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
