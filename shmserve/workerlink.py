"""The contract between the front-end and a worker process.

Owns: how a worker is started (its argv and inherited descriptors), the
messages it sends on its control socket, the ring entry that stops it, and
the meaning of its exit codes.  Both sides import this module; it imports
nothing heavy.

Control socket: a SOCK_SEQPACKET socketpair, one JSON object per message,
worker -> front-end only:

    {"event": "ready", "spec": {...ModelSpec.to_dict()...}}   loaded and warmed
    {"event": "failed", "error": "..."}                        could not load

Front-end -> worker goes through the worker's submission ring: slot entries,
and commands (``layout.command_entry``): stop, attach or detach a client lane
(a region whose first ``layout.LANE_BYTES`` hold a private queue to this
worker).

Exit codes (after gunicorn's arbiter: named codes stop crash loops):
"""

from __future__ import annotations

import sys

import orjson

EXIT_OK = 0
EXIT_LOAD_FAILED = 3  # the model cannot be loaded: restarting would fail the same way
EXIT_ARENA_FAILED = 4  # cannot map or register the arena: a host problem, not retried
EXIT_ORPHANED = 5  # the front-end went away
EXIT_TERMINATED = 6  # SIGTERM from the supervisor: left at once, after releasing what it held
NO_RESTART = frozenset({EXIT_LOAD_FAILED, EXIT_ARENA_FAILED})
# Any other death is restarted after a back-off; this many in a row, each before the worker had served
# restart_healthy_s, is a crash loop: reported (health, info, inspect), and still restarted.
CRASH_LOOP_DEATHS = 3
EXIT_NAMES = {EXIT_OK: "stopped", EXIT_LOAD_FAILED: "model failed to load",
              EXIT_ARENA_FAILED: "could not use the arena", EXIT_ORPHANED: "front-end gone",
              EXIT_TERMINATED: "terminated"}

# Commands on a worker's submission ring (encoded by ``layout.command_entry``): CMD_STOP,
# CMD_ATTACH_LANE and CMD_DETACH_LANE with the lane's region id, and ``layout.STOP_ENTRY``.
MAX_LANES = 127  # per worker: it sleeps on its own ring and its lanes' in one futex_waitv (128 words)
CONTROL_MAX = 1 << 20


def worker_argv(*, instance: str, index: int, model_json: bytes, control_fd: int, completion_fd: int,
                spin_us: int) -> list[str]:
    return [sys.executable, "-m", "workers.main", "--instance", instance, "--index", str(index),
            "--model", model_json.decode(), "--control-fd", str(control_fd),
            "--completion-fd", str(completion_fd), "--spin-us", str(spin_us)]


def encode(message: dict) -> bytes:
    return orjson.dumps(message)


def decode(data: bytes) -> dict:
    message = orjson.loads(data)
    if not isinstance(message, dict) or "event" not in message:
        raise ValueError("control message without an event")
    return message


def describe_exit(status: int) -> str:
    """Words for a waitpid() status."""
    import os
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    code = os.WEXITSTATUS(status)
    return f"exit {code} ({EXIT_NAMES.get(code, 'error')})"
