"""The `shmserve` command line: one subcommand per user-facing action.

Owns: argument parsing, what each command prints, and which exit code each
outcome is.  Each subcommand delegates to the module that owns the work
(server, client, stale); the exit codes, help format, tables and progress are
``shmserve.console``'s.

Exit codes (``console.EXIT_CODES``, printed by ``--help``): 0 success; 1 the
operation failed or the instance is unhealthy; 2 usage, input or configuration
error (the server's ``bad_argument`` too); 3 no server answers at the socket;
4 permission denied; 130 interrupted (Ctrl-C); 141 the reader of the output
left (``| head``), as for a process SIGPIPE stopped, with nothing on stderr: a
closed stdout is never taken for a server's fault.  A user's mistake gets one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import zlib
from pathlib import Path

from shmserve.console import (EXIT_CODES, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_NO_SERVER, EXIT_OK,  # noqa: F401
                              EXIT_OUTPUT_CLOSED, EXIT_PERMISSION, EXIT_USAGE, HelpFormatter, instance_name)
from shmserve.console import row as _row
from shmserve.console import show as _print
from shmserve.console import stdout_console as _console
from shmserve.console import table as _table

PRINT_THRESHOLD = 100  # infer --print: arrays with more elements show only 3 at each edge


def _positive(text: str) -> float:
    """argparse type: a number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
    return value


def _natural(text: str) -> int:
    """argparse type: an integer of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def _sample(text: str) -> float:
    """argparse type: seconds from 0 to 60."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be 0 to 60, got {text!r}")
    return value


def _instances(text: str) -> int:
    """argparse type: a number of workers of one version, 1 to ``protocol.MAX_INSTANCES``."""
    from shmserve.protocol import MAX_INSTANCES

    value = _counting(text)
    if value > MAX_INSTANCES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INSTANCES} (workers of one version), got {text!r}")
    return value


def _counting(text: str) -> int:
    """argparse type: an integer of 1 or more (a version, a worker count)."""
    value = _natural(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text!r}")
    return value


def _socket_arg(parser: argparse.ArgumentParser, timeout: float = 60.0) -> None:
    parser.add_argument("--socket", help="server socket (default: $SHMSERVE_SOCKET, else "
                                         "$XDG_RUNTIME_DIR/shmserve/<instance>.sock, else /tmp/shmserve-<uid>/<instance>.sock)")
    parser.add_argument("--instance", type=instance_name, default="default",
                        help="instance name used for the default socket path")
    parser.add_argument("--timeout", type=_positive, default=timeout, help="seconds to wait for an answer")


def _client(args):
    from shmserve.client import Client
    from shmserve.config import DEFAULT_INSTANCE

    try:
        return Client(args.socket, timeout=args.timeout, instance=args.instance or DEFAULT_INSTANCE)
    except ValueError as exc:  # $SHMSERVE_SERVER_UID names no user: a configuration error
        raise SystemExit(_usage(args.command, str(exc))) from None


def _talks_to_server(func):
    """Turn client errors of a subcommand into messages and exit codes (3: no server, 4: the
    socket or its directory refuses us, or the server does; 2: the server refused a value we sent,
    bad_argument; 1: any other error)."""
    import functools

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        from shmserve.config import resolve_socket
        from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError

        path = resolve_socket(args.socket, None, args.instance)
        try:
            return func(args)
        except BrokenPipeError:  # our stdout's reader left (the client turns its socket's errors into its own)
            raise
        except ConnectionClosed as exc:
            refused = _access_refused(path)
            print(f"shmserve {args.command}: {refused or exc.message}", file=sys.stderr)
            return EXIT_PERMISSION if refused else EXIT_NO_SERVER
        except PermissionError as exc:  # connect(2) refused by the socket's or its directory's mode
            why = _access_refused(path) or f"permission denied: {exc.filename or path}"
            print(f"shmserve {args.command}: {why}", file=sys.stderr)
            return EXIT_PERMISSION
        except OSError as exc:  # e.g. a path that is not a socket, or too long for one
            print(f"shmserve {args.command}: {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_NO_SERVER
        except ShmserveError as exc:
            print(f"shmserve {args.command}: {exc}", file=sys.stderr)
            return {ErrorCode.PERMISSION_DENIED: EXIT_PERMISSION, ErrorCode.BAD_ARGUMENT: EXIT_USAGE}.get(
                exc.code, EXIT_FAILURE)

    return wrapper


def _access_refused(path: str) -> str | None:
    """Why this user may not connect to the socket at ``path`` (its directory or itself refuses
    us), naming the group that gives access; None if nothing there refuses us."""
    import grp
    import stat

    checks = [(str(Path(path).parent), os.X_OK, "directory"), (path, os.W_OK, "socket")]
    for where, mode, what in checks:
        try:
            st = os.stat(where)
        except OSError:
            return None  # a missing path is "no server", said by the client
        if what == "socket" and not stat.S_ISSOCK(st.st_mode):
            return None
        if not os.access(where, mode):
            try:
                group = grp.getgrgid(st.st_gid).gr_name
            except KeyError:
                group = str(st.st_gid)
            return (f"permission denied: the {what} {where} (mode {stat.S_IMODE(st.st_mode):04o}) lets in "
                    f"members of group {group!r}; ask to be added to it (then log in again)")
    return None


def _listen_address_problem(address: str) -> str | None:
    """Why ``address`` (a Unix socket path, or a loopback host:port) cannot be listened on, or
    None: a path needs its directory, a host must be loopback (nothing here is for the network)."""
    if "/" in address:
        directory = os.path.dirname(address) or "."
        return None if os.path.isdir(directory) else f"no directory {directory!r} for the socket {address}"
    from shmserve.metrics import check_loopback

    host, colon, port = address.rpartition(":")
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:  # str.isdigit takes "²"
        return f"expected a loopback host:port (like 127.0.0.1:8000) or a socket path, got {address!r}"
    try:
        check_loopback(host.strip("[]") or "127.0.0.1")
    except ValueError as exc:
        return str(exc)
    return None


def _doors_arg(value: str):
    """--doors: a number of door processes in [0, MAX_DOORS], or 'auto'."""
    from shmserve.config import MAX_DOORS

    if value == "auto":
        return value
    if not value.isascii() or not value.isdigit() or int(value) > MAX_DOORS:
        raise argparse.ArgumentTypeError(f"expected a number of door processes in [0, {MAX_DOORS}] or 'auto', "
                                         f"got {value!r}")
    return int(value)


def _cmd_serve(args: argparse.Namespace) -> int:
    from shmserve import config as cfg
    from shmserve import logs, systemd
    from shmserve.server import serve

    logs.configure(args.log_format, args.verbose)
    try:
        if args.config:
            config = cfg.load(args.config, instance=args.instance, repository_given=bool(args.model_repository))
        else:
            config = cfg.demo_config(args.instance or cfg.DEFAULT_INSTANCE)
    except cfg.ConfigError as exc:
        print(f"shmserve: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from dataclasses import replace

    if args.strict:
        config = replace(config, strict=True)
    if args.doors is not None:
        config = replace(config, doors=None if args.doors == "auto" else args.doors)
    config = replace(config, http=args.http or config.http, grpc=args.grpc or config.grpc,
                     v2_system_shared_memory=args.v2_system_shared_memory or config.v2_system_shared_memory)
    for flag, address in (("--metrics", args.metrics), ("--http", config.http), ("--grpc", config.grpc)):
        problem = address and _listen_address_problem(address)
        if problem:
            print(f"shmserve: {flag}: {problem}", file=sys.stderr)
            return EXIT_USAGE
    listen_sock = None
    activated = systemd.listen_sockets()  # socket activation: systemd made and bound the socket
    if activated:
        name, listen_sock = activated[0]
        for _, extra in activated[1:]:
            extra.close()
        path = listen_sock.getsockname()
        logging.getLogger("shmserve").info("socket activation: using %s (%s)", path, name)
    else:
        path = cfg.resolve_socket(args.socket, config.socket, config.instance)
    from shmserve.arena import ArenaError

    repository = None
    if args.model_repository:
        repository = str(Path(args.model_repository).resolve())
        if not os.path.isdir(repository):
            print(f"shmserve: --model-repository: no such directory {repository!r}", file=sys.stderr)
            return EXIT_USAGE
        config = replace(config, model_repository=repository)
        if not args.config:  # the repository alone, not the demo model beside it
            config = replace(config, models=())
    try:
        return serve(config, path, listen_sock=listen_sock, config_path=args.config, metrics_address=args.metrics,
                     repository_override=repository)
    except ArenaError as exc:  # e.g. the instance is already being served
        print(f"shmserve serve: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _load_inputs(items: list[str]) -> dict:
    """--input NAME=FILE.npy arguments as arrays; SystemExit (2) with why for a bad one."""
    import numpy as np

    inputs = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(_usage("infer", f"--input expects NAME=FILE.npy, got {item!r}"))
        try:
            inputs[name] = np.load(path, allow_pickle=False)
        except OSError as exc:
            raise SystemExit(_usage("infer", f"--input {name}: cannot read {path}: {exc.strerror or exc}")) from None
        except (ValueError, EOFError) as exc:  # not a .npy file, truncated, or a pickled object array
            raise SystemExit(_usage("infer", f"--input {name}: {path} is not a readable .npy array ({exc})")) \
                from None
        if not isinstance(inputs[name], np.ndarray):  # an .npz archive
            inputs[name].close()
            raise SystemExit(_usage("infer", f"--input {name}: {path} is an .npz archive; give one .npy array"))
    return inputs


def _usage(command: str, message: str) -> int:
    """Print a usage error of ``command``; returns EXIT_USAGE (for ``raise SystemExit(_usage(...))``)."""
    print(f"shmserve {command}: {message}", file=sys.stderr)
    return EXIT_USAGE


def _inputs_known(client, args: argparse.Namespace) -> dict | None:
    """The ``models`` entry of a model whose inputs were unknown (not loaded), once the server has
    been asked to run it with none: it answers why it cannot (raised: a ShmserveError with its code
    and reason, as ``unloaded by uid 0``), or loads it on demand and refuses the missing inputs,
    after which they are known.  None if they still are not."""
    from shmserve.errors import ErrorCode, ShmserveError

    try:
        client.infer(args.model, {}, timeout=args.timeout, version=args.version, key=args.key)
    except ShmserveError as exc:
        if exc.code is not ErrorCode.BAD_INPUT:
            raise
    spec = next((m for m in client.models() if m["name"] == args.model), None)
    return spec if spec is not None and spec["inputs"] else None


@_talks_to_server
def _cmd_infer(args: argparse.Namespace) -> int:
    import time

    import numpy as np

    inputs = _load_inputs(args.input or [])
    out_dir = Path(args.save) if args.save else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _usage("infer", f"--save: cannot create {out_dir}: {exc.strerror or exc}")
    with _client(args) as client:
        if args.random:
            spec = next((m for m in client.models() if m["name"] == args.model), None)
            if spec is None:
                print(f"shmserve infer: the server has no model {args.model!r} (see 'shmserve models')",
                      file=sys.stderr)
                return EXIT_FAILURE
            if spec["state"] != "ready" and not spec["inputs"]:  # not loaded: its inputs are unknown
                state, spec = spec["state"], _inputs_known(client, args)
                if spec is None:
                    print(f"shmserve infer: model {args.model!r} is {state}: its inputs are unknown",
                          file=sys.stderr)
                    return EXIT_FAILURE
            rng = np.random.default_rng(args.seed)
            for t in spec["inputs"]:
                if t["name"] not in inputs:
                    shape = [d if isinstance(d, int) and d >= 0 else args.dynamic_dim for d in t["shape"]]
                    inputs[t["name"]] = _random(rng, t["dtype"], shape)
        if not inputs:
            return _usage("infer", "give --input NAME=FILE.npy or --random")
        started = time.perf_counter()
        outputs = client.infer(args.model, inputs, timeout=args.timeout, version=args.version, key=args.key)
        round_trip_ms = (time.perf_counter() - started) * 1e3
    from shmserve import layout

    rows = [{"name": n, "dtype": layout.dtype_name(a.dtype), "shape": list(a.shape),
             "crc32": f"{zlib.crc32(_wire_bytes(a)):08x}"} for n, a in outputs.items()]
    if args.print:
        for row in rows:
            row["values"] = np.array2string(outputs[row["name"]], threshold=PRINT_THRESHOLD, edgeitems=3)
    if out_dir is not None:
        for n, a in outputs.items():
            try:
                np.save(out_dir / f"{_safe(n)}.npy", a)
            except OSError as exc:
                print(f"shmserve infer: --save: cannot write {out_dir / _safe(n)}.npy: {exc.strerror or exc}",
                      file=sys.stderr)
                return EXIT_FAILURE
    if args.json:
        print(json.dumps({"model": args.model, "round_trip_ms": round(round_trip_ms, 3), "outputs": rows}))
        return EXIT_OK
    table = _table("output", "dtype", "shape", "crc32")
    for r in rows:
        _row(table, r["name"], r["dtype"], tuple(r["shape"]), r["crc32"])
    _print(table)
    for r in rows if args.print else ():
        print(f"{r['name']} =\n{r['values']}")
    print(f"round trip: {round_trip_ms:.3f} ms")
    return EXIT_OK


def _wire_bytes(a) -> bytes:
    """An output's bytes as the wire carries them (a bytes output serialized), for its checksum."""
    import numpy as np

    from shmserve import layout

    return layout.encode_bytes(a) if a.dtype == layout.BYTES_DTYPE else np.ascontiguousarray(a).tobytes()


def _random(rng, dtype: str, shape):
    import numpy as np

    from shmserve import layout

    if dtype == layout.BYTES:  # elements of 0-16 random bytes
        count = int(np.prod(shape, dtype=np.int64))
        return np.fromiter((rng.bytes(int(n)) for n in rng.integers(0, 17, count)), dtype=object,
                           count=count).reshape(shape)
    dt = layout.numpy_dtype(dtype)
    if dt.kind == "f" or dtype == "bfloat16":
        return rng.random(shape, dtype=np.float64).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    info = np.iinfo(dt)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True).astype(dt)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "output"


def _ask(args: argparse.Namespace, question: str):
    """The server's answer to ``question`` (a Client method: models, health, info), printed as
    one line of JSON too with --json."""
    with _client(args) as client:
        answer = getattr(client, question)()
    if args.json:
        print(json.dumps(answer))
    return answer


@_talks_to_server
def _cmd_models(args: argparse.Namespace) -> int:
    models = _ask(args, "models")
    if args.json:
        return EXIT_OK
    table = _table("model", "version", "backend", "device", "state", "tensor", "dtype", "shape")
    for m in models:
        tensors = [(f"{role[:-1]} {t['name']}", t["dtype"],
                    "[" + ", ".join("?" if d is None else str(d) for d in t["shape"]) + "]")
                   for role in ("inputs", "outputs") for t in m[role]] or [("-", "-", "-")]
        for i, tensor in enumerate(tensors):
            head = (m["name"], _versions(m), m["backend"], m["device"], m["state"]) if i == 0 else ("",) * 5
            _row(table, *head, *tensor)
    _print(table)
    for m in models:
        print(f"{m['name']}: {m['path']}" + (f"\n  error: {m['error']}" if m.get("error") else ""))
    return EXIT_OK


def _versions(m: dict) -> str:
    """A ``models`` entry's version for people: the default one, and the others serving beside it."""
    if m.get("version") is None:
        return "-"
    others = [str(v) for v in m.get("versions", []) if v != m["version"]]
    return str(m["version"]) + (f" (also serving: {', '.join(others)})" if others else "")


@_talks_to_server
def _cmd_health(args: argparse.Namespace) -> int:
    answer = _ask(args, "health")
    if not args.json:
        table = _table("model", "state", "workers ready", "restarts", "crash loop")
        for name, m in answer.get("models", {}).items():
            _row(table, name, m["state"], f"{m['workers_ready']} of {m['workers']}", m["restarts"],
                 "yes" if m["crash_loop"] else "no")
        print(f"status: {answer.get('status')}")
        _print(table)
    return EXIT_OK if answer.get("status") == "ok" else EXIT_FAILURE


@_talks_to_server
def _cmd_info(args: argparse.Namespace) -> int:
    from shmserve.inspection import plural

    answer = _ask(args, "info")
    if args.json:
        return EXIT_OK
    facts = _table("fact", "value")
    arena = answer.get("arena", {})
    for key, value in (("version", answer.get("version")), ("protocol", answer.get("protocol")),
                       ("instance", answer.get("instance")), ("pid", answer.get("pid")),
                       ("socket", answer.get("socket")), ("uptime", f"{answer.get('uptime_s', 0):.0f} s"),
                       ("arena", f"{arena.get('name')}, {arena.get('size', 0) >> 20} MiB, "
                                 f"{plural(arena.get('slots', 0), 'slot')}"),
                       ("max_request_bytes", answer.get("max_request_bytes")),
                       ("request_timeout_s", answer.get("request_timeout_s")),
                       ("lanes", answer.get("lanes"))):
        _row(facts, key, "-" if value is None else value)
    workers = _table("#", "model", "version", "device", "cpus", "pid", "state", "requests", "errors", "restarts",
                     "in flight", title="workers")
    for w in answer.get("workers", []):
        _row(workers, w["index"], w["model"], w.get("version", "-"), w["device"], w.get("cpus") or "any",
             "-" if w["pid"] is None else w["pid"], w["state"],
             w["requests"], w["errors"], w["restarts"], w["inflight"])
    stats = _table("statistic", "value", title="arena statistics")
    for key, value in answer.get("stats", {}).items():
        _row(stats, key, value)
    tables = [facts, workers, stats]
    if answer.get("queues"):  # each model version's queue by priority level, and what was not run as asked
        from shmserve.inspection import render_queues

        tables.append(render_queues(answer["queues"]))
    if answer.get("cancelled") or answer.get("rate_limits"):
        given_up = _table("model", "version", "cancelled queued", "running", "answered",
                          title="cancelled requests (before a worker claimed them, while one ran them, once answered)")
        for c in answer.get("cancelled", []):
            _row(given_up, c["model"], c["version"], c.get("queued", 0), c.get("running", 0), c.get("answered", 0))
        tables.append(given_up)
        if answer.get("rate_limits"):
            limited = _table("limit", "model", "refused", title="rate limits (\\[rate_limits]): refusals since start")
            for r in answer["rate_limits"]:
                _row(limited, r["limit"], r["model"], r.get("refused", 0))
            tables.append(limited)
    if answer.get("doors"):  # door processes (docs/doors.md); this connection's is door_process
        doors = _table("door", "pid", "up", "connections", "lanes", "restarts", title="door processes")
        for d in answer["doors"]:
            _row(doors, d["index"], "-" if d.get("pid") is None else d["pid"], "yes" if d.get("up") else "no",
                 d.get("connections", 0), d.get("lanes", 0), d.get("restarts", 0))
        tables.append(doors)
    _print(*tables)
    return EXIT_OK


@_talks_to_server
def _cmd_repository(args: argparse.Namespace) -> int:
    answer = _ask(args, "repository")
    if args.json:
        return EXIT_OK
    table = _table("model", "version", "state", "default", "workers", "memory", "load", "reason")
    for m in answer.get("models", []):
        memory = m.get("memory_bytes")
        load = m.get("load_seconds")
        _row(table, m["name"], "-" if m.get("version") is None else m["version"], m["state"],
             "yes" if m.get("default") else "", f"{m.get('workers_ready', 0)} of {m.get('workers', 0)}"
             if "workers" in m else "-", "-" if memory is None else f"{memory / 2**20:.0f} MiB",
             "-" if load is None else f"{load:.2f} s", m.get("reason") or "")
    _print(table)
    for name, c in sorted(answer.get("canaries", {}).items()):
        print(f"canary {name}: version {c['candidate']['version']} vs {c['stable']['version']}: {c['state']}, "
              f"{c['percent']:g}% ({c['mode']})" + (f"; last: {c['decisions'][-1]['kind']}: "
                                                      f"{c['decisions'][-1]['reason']}" if c["decisions"] else ""))
    return EXIT_OK


def _lifecycle_call(args: argparse.Namespace, method: str, **fields) -> int:
    """Make the call and print its answer (stdout); while it runs, what happens to the model's
    versions on stderr (``watch.Watch``: a line per change, a live line on a terminal)."""
    from shmserve.client import Client
    from shmserve.console import Steps
    from shmserve.watch import Watch

    steps = Steps()
    try:
        with _client(args) as client, Watch(lambda: Client(args.socket, timeout=5.0, instance=args.instance),
                                            args.model, steps.step):
            answer = getattr(client, method)(args.model, timeout=args.timeout, **fields)
    finally:
        steps.close()
    print(json.dumps(answer) if args.json else _describe(method, answer))
    return EXIT_OK


def _describe(method: str, a: dict) -> str:
    if method == "load":
        return (f"model {a['model']} version {a['version']}: {a['state']}, {a['workers']} worker(s)"
                + (f", loaded in {a['load_seconds']:.2f} s" if a.get("load_seconds") is not None else ""))
    if method == "unload":
        if not a["unloaded"]:
            return f"model {a['model']}: nothing loaded to unload"
        return f"model {a['model']}: unloaded version(s) {', '.join(map(str, a['unloaded']))}"
    if method == "scale":
        return f"model {a['model']} version {a['version']}: {a['workers']} worker(s)"
    lines = [f"canary {a['model']}: version {a['candidate']['version']} vs {a['stable']['version']}: {a['state']}, "
             f"{a['percent']:g}% of traffic ({a['mode']})"]
    for v in ("stable", "candidate"):
        w = a[v]
        lines.append(f"  {v} {w['version']}: {w['requests']} requests, error rate {w['error_rate'] * 100:.2f}%, "
                     f"p99 {w.get('p99_ms', 0) or 0:.3f} ms")
    if a["mode"] == "shadow":
        lines.append(f"  shadow: {a['shadow']['compared']} compared, {a['shadow']['mismatches']} mismatched")
    lines += [f"  {d['kind']} at {d['percent']:g}%: {d['reason']}" for d in a["decisions"]]
    return "\n".join(lines)


@_talks_to_server
def _cmd_load(args: argparse.Namespace) -> int:
    return _lifecycle_call(args, "load", version=args.version, instances=args.instances, keep=args.keep)


@_talks_to_server
def _cmd_unload(args: argparse.Namespace) -> int:
    return _lifecycle_call(args, "unload", version=args.version)


@_talks_to_server
def _cmd_scale(args: argparse.Namespace) -> int:
    return _lifecycle_call(args, "scale", instances=args.instances, version=args.version)


CANARY_FLAGS = (("steps", "STEPS", "percentages of traffic, e.g. 1,5,25,100"),
                ("hold_s", "S", "hold each step at least this long"),
                ("window_s", "S", "window the thresholds are measured over"),
                ("min_samples", "N", "requests per version in the window before any decision (at least 100 "
                                     "while the p99 is judged)"),
                ("max_error_rate_increase", "X", "roll back if the candidate's error rate exceeds the stable "
                                                 "one's by more than this (0.01 = 1 point)"),
                ("max_p99_ratio", "R", "roll back if the candidate's p99 latency exceeds the stable one's by "
                                       "this factor ('off': errors alone decide)"),
                ("cold_requests", "N", "each version's first requests, counted for errors but not latency"),
                ("shadow_percent", "P", "shadow mode: share of requests copied to the candidate"),
                ("max_mismatch_rate", "X", "shadow mode: roll back above this share of mismatching outputs"))


@_talks_to_server
def _cmd_canary(args: argparse.Namespace) -> int:
    plan: dict = {}
    if args.action == "start":
        if args.version is None:
            return _usage("canary", "start needs --version (the candidate)")
        for field, _, _ in CANARY_FLAGS:
            value = getattr(args, field)
            if value is not None:
                plan[field] = None if value == "off" else value
        if args.shadow:
            plan["mode"] = "shadow"
        if args.no_sticky:
            plan["sticky"] = False
    return _lifecycle_call(args, "canary", action=args.action, version=args.version, plan=plan or None)


def _ratio_or_off(text: str) -> float | str:
    if text == "off":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None


def _steps(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected percentages like 1,5,25,100, got {text!r}") from None


def _with_lifecycle(snap: dict) -> dict:
    """``snap`` with ``lifecycle``: a live owner's model versions, canaries and recent decisions
    (its ``repository`` answer, asked over its socket), or None (dead, unreachable, or not ours
    to ask)."""
    snap["lifecycle"] = None
    if snap.get("owner_alive") and snap.get("socket"):
        from shmserve.client import Client
        from shmserve.errors import ShmserveError

        try:
            with Client(snap["socket"], timeout=2.0) as client:
                answer = client.repository()
            snap["lifecycle"] = {"models": answer.get("models", []), "canaries": answer.get("canaries", {}),
                                 "events": answer.get("events", [])[-50:],
                                 "rate_limits": answer.get("rate_limits", [])}
        except (ShmserveError, OSError, ValueError):
            pass
    return snap


def _cmd_inspect(args: argparse.Namespace) -> int:
    from shmserve import inspection, stale
    from shmserve.arena import ArenaError, ArenaNotFound, ArenaPermission
    from shmserve.inspection import plural

    def instances() -> list[str]:
        if args.all:  # only our own and root's: another user could shrink its arena under our mapping
            trusted = stale.trusted_uids()
            return sorted({r.instance for r in stale.list_arenas() if r.valid and r.uid in trusted})
        return [args.instance]

    def take() -> dict:
        snaps, errors = [], []
        for name in instances():
            try:
                snaps.append(_with_lifecycle(inspection.snapshot(name, stuck_after_s=args.stuck_after)))
            except ArenaNotFound as exc:
                errors.append((EXIT_NO_SERVER, str(exc)))
            except ArenaPermission as exc:
                errors.append((EXIT_PERMISSION, str(exc)))
            except ArenaError as exc:  # not an arena, still being created, corrupt
                errors.append((EXIT_USAGE, str(exc)))
        return {"instances": snaps, "leftovers": inspection.leftovers(), "errors": errors}

    state = take()
    if args.watch:
        import time

        from rich.console import Group
        from rich.live import Live
        from rich.text import Text

        def view(state: dict):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            head = Text(f"{stamp}  refreshing every {args.watch:g} s (Ctrl-C to stop)", style="dim")
            errors = [Text(f"shmserve inspect: {message}", style="red") for _, message in state["errors"]]
            return Group(head, *[inspection.render(s) for s in state["instances"]],
                         *[inspection.render_lifecycle(s["lifecycle"]) for s in state["instances"] if s["lifecycle"]],
                         *errors)

        if not sys.stdout.isatty():  # piped: each view printed whole as it is taken, not one at the end
            console = _console()
            while True:
                console.print(view(state))
                sys.stdout.flush()
                time.sleep(args.watch)
                state = take()
        with Live(view(state), refresh_per_second=4) as live:
            while True:
                time.sleep(args.watch)
                live.update(view(take()))
    for code, message in state["errors"]:
        print(f"shmserve inspect: {message}", file=sys.stderr)
    if args.json:
        if args.all:
            print(json.dumps({"instances": state["instances"], "leftovers": state["leftovers"]}))
        elif state["instances"]:
            print(json.dumps({**state["instances"][0], "leftovers": state["leftovers"]}))
    elif not args.check:
        console = _console()
        for snap in state["instances"]:
            console.print(inspection.render(snap))
            if snap["lifecycle"]:
                console.print(inspection.render_lifecycle(snap["lifecycle"]))
        for left in state["leftovers"]:
            if left["refused"]:
                print(f"not ours: /dev/shm/{left['name']} ({left['refused']})")
            else:
                print(f"leftover: /dev/shm/{left['name']} ({left['reason']}); 'shmserve cleanup' removes it")
    if state["errors"] and not state["instances"]:
        return state["errors"][0][0]
    if args.check:
        found = [p for snap in state["instances"] for p in snap["problems"]]
        found += [message for _, message in state["errors"]]
        for p in found:
            print(f"UNHEALTHY: {p}")
        if not found:
            print("OK: " + ", ".join(f"{s['instance']} ({plural(len(s['workers']), 'worker')})"
                                     for s in state["instances"]))
        return EXIT_FAILURE if found else EXIT_OK
    return EXIT_OK


def _cmd_config(args: argparse.Namespace) -> int:
    from shmserve import modelconfig

    try:
        found = modelconfig.read(args.file, name=args.name, backend=args.backend)
    except modelconfig.ModelFileError as exc:
        print(f"shmserve config: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.usage else EXIT_FAILURE
    if args.json:
        print(json.dumps(found.to_dict()))
    else:
        sys.stdout.write(modelconfig.to_toml(found, repository=args.repository))
    return EXIT_OK


def _cmd_doctor(args: argparse.Namespace) -> int:
    from shmserve import doctor
    from shmserve.config import ConfigError

    try:
        report = doctor.run(args.instance, root=args.root, config_path=args.config, socket=args.socket,
                            sample_s=args.sample)
    except ConfigError as exc:
        return _usage("doctor", f"--config: {exc}")
    if args.json:
        print(json.dumps(report.to_dict(args.fail_on)))
    else:
        from shmserve.doctor.findings import render

        _print(render(report, verbose=args.verbose))
    return EXIT_FAILURE if report.exit_status(args.fail_on) else EXIT_OK


def _cmd_cleanup(args: argparse.Namespace) -> int:
    from shmserve import stale
    from shmserve.arena import uid_words

    records = stale.sweep(args.instance, dry_run=args.dry_run)
    left = [r for r in stale.list_arenas(args.instance)
            if (r.refused and not r.owner_alive) or (r.stale and not args.dry_run)]
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "removed": [
            {"name": r.name, "size": r.size, "reason": r.reason, "socket": r.socket_path,
             "socket_kept": r.socket_kept or None} for r in records],
            "left": [{"name": r.name, "uid": r.uid, "why": r.refused or "owned by another user"} for r in left]}))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for record in records:
        print(f"{verb} /dev/shm/{record.name} ({record.size} bytes): {record.reason}")
        if record.socket_path and not record.region:
            if record.socket_kept:
                print(f"left its socket {record.socket_path}: {record.socket_kept}")
            else:
                print(f"{verb} its socket {record.socket_path}")
    if not records:
        print("no stale arenas")
    for record in left:
        if record.refused and not record.owner_alive:  # another user's live instance is none of our business
            print(f"left /dev/shm/{record.name}: {record.refused}")
        else:
            print(f"could not remove /dev/shm/{record.name} (owned by {uid_words(record.uid)}): "
                  f"run 'shmserve cleanup' as its owner or root")
    return EXIT_OK


def _cmd_token(args: argparse.Namespace) -> int:
    """A new bearer token for the v2 doors: its entry appended to the token file (made 0600 if
    missing), the token printed once (only its digest is kept)."""
    import secrets

    from shmserve.v2.auth import TokenFileError, load_tokens, token_entry

    token = secrets.token_urlsafe(32)
    entry = token_entry(args.name, token, args.role, args.uid)
    if args.file:
        try:
            if os.path.exists(args.file):
                if any(t.name == args.name for t in load_tokens(args.file)):
                    print(f"shmserve token: {args.file} already has a token named {args.name!r}: choose another name",
                          file=sys.stderr)
                    return EXIT_USAGE
            fd = os.open(args.file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(("\n" if f.tell() else "") + entry)
            load_tokens(args.file)  # the file as the server will read it
        except TokenFileError as exc:
            print(f"shmserve token: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        except OSError as exc:
            print(f"shmserve token: cannot write {args.file}: {exc.strerror}", file=sys.stderr)
            return EXIT_FAILURE
    if args.json:
        print(json.dumps({"name": args.name, "role": args.role, "uid": args.uid, "token": token,
                          "file": args.file, "entry": entry}))
    elif args.file:
        print(f"added token {args.name!r} ({args.role}) to {args.file}; 'systemctl reload shmserve' (SIGHUP) "
              f"applies it.  The token (shown once, only its digest is kept):\n{token}")
    else:
        print(f"# the entry for server.v2_tokens (append it to that file, mode 0600):\n{entry}\n"
              f"# the token (shown once): give it to the caller as 'Authorization: Bearer <token>'\n{token}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from shmserve import __version__
    from shmserve.protocol import MAX_INSTANCES

    parser = argparse.ArgumentParser(
        prog="shmserve", description="Local inference over shared memory.", formatter_class=HelpFormatter,
        epilog="examples:\n  shmserve serve                 # the demo model on CPU\n"
               "  shmserve infer demo --random   # in another terminal\n"
               "  shmserve <command> --help      # one command's options\n\n" + EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"shmserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    def command(name: str, text: str, *examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                              formatter_class=HelpFormatter,
                              epilog="examples:\n" + "".join(f"  {e}\n" for e in examples) + "\n" + EXIT_CODES)

    serve = command("serve", "run the service (no --config: the embedded demo model on CPU)",
                    "shmserve serve", "shmserve serve --config /etc/shmserve/config.toml --metrics 127.0.0.1:9464")
    serve.add_argument("--config", help="TOML configuration file")
    serve.add_argument("--socket", help="socket path (overrides the config and $SHMSERVE_SOCKET)")
    serve.add_argument("--instance", help="instance name (default: the config's, else 'default')")
    serve.add_argument("--metrics", metavar="ADDR", help="serve Prometheus metrics on a Unix socket path or a "
                                                          "loopback host:port")
    serve.add_argument("--model-repository", metavar="DIR",
                       help="serve the versioned models of DIR (docs/models.md); without --config, only those")
    serve.add_argument("--http", metavar="ADDR", help="KServe v2 over HTTP on a loopback host:port or a Unix "
                                                       "socket path ([server] http; docs/v2.md)")
    serve.add_argument("--grpc", metavar="ADDR", help="KServe v2 over gRPC on a loopback host:port or a Unix "
                                                       "socket path ([server] grpc)")
    serve.add_argument("--v2-system-shared-memory", action="store_true",
                       help="let v2 clients register their own /dev/shm objects ([server] v2_system_shared_memory)")
    serve.add_argument("--strict", action="store_true", help="a model that cannot load stops the start "
                                                             "(exit 1) instead of serving the others ([server] strict)")
    serve.add_argument("--doors", type=_doors_arg, metavar="N|auto",
                       help="door processes serving the Unix socket beside the main one (default: the config's "
                            "[server] doors, else 0; auto: a quarter of the CPUs it may run on, from 4, at most 8; "
                            "docs/doors.md)")
    serve.add_argument("--log-format", choices=("text", "json"), default="text", help="stderr log format")
    serve.add_argument("-v", "--verbose", action="store_true", help="debug logging (one line per request)")
    serve.set_defaults(func=_cmd_serve)

    infer = command("infer", "run a model once and print its outputs' dtype, shape and checksum",
                    "shmserve infer demo --random --print", "shmserve infer mymodel --input x=x.npy --save out/")
    infer.add_argument("model", help="the model's name (see 'shmserve models')")
    infer.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="an input from a .npy file")
    infer.add_argument("--random", action="store_true", help="random inputs for every input not given")
    infer.add_argument("--dynamic-dim", type=_natural, default=1, help="size of dynamic dimensions with --random")
    infer.add_argument("--seed", type=_natural, default=None, help="seed for --random (default: a fresh one)")
    infer.add_argument("--save", metavar="DIR", help="write each output to DIR/NAME.npy")
    infer.add_argument("--print", action="store_true",
                       help=f"print the outputs' values (numpy-style; over {PRINT_THRESHOLD} elements, the edges)")
    infer.add_argument("--version", type=_counting, default=None,
                       help="that version of the model (default: the model's default version)")
    infer.add_argument("--key", default=None, help="routing key: while a canary runs, one key reaches one version")
    infer.add_argument("--json", action="store_true", help="one line of JSON (with --print: the values too)")
    _socket_arg(infer)
    infer.set_defaults(func=_cmd_infer)

    models = command("models", "list the server's models with their inputs and outputs",
                     "shmserve models", "shmserve models --json | jq '.[].name'")
    models.add_argument("--json", action="store_true", help="JSON for scripts")
    _socket_arg(models)
    models.set_defaults(func=_cmd_models)

    for name, text, func in (("health", "is the server healthy (exit 1 if not)", _cmd_health),
                             ("info", "server and arena facts", _cmd_info)):
        p = command(name, text, f"shmserve {name}", f"shmserve {name} --instance prod --json")
        p.add_argument("--json", action="store_true", help="one line of JSON")
        _socket_arg(p)
        p.set_defaults(func=func)

    repo = command("repository", "every model and version: state, default, workers, memory, why",
                   "shmserve repository", "shmserve repository --json | jq '.models[] | select(.state != \"ready\")'")
    repo.add_argument("--json", action="store_true", help="one line of JSON (with canaries and recent events)")
    _socket_arg(repo)
    repo.set_defaults(func=_cmd_repository)

    load = command("load", "load a model version, warm it, make it the default; the one before drains "
                           "(admins only)", "shmserve load resnet", "shmserve load resnet --version 3 --instances 2")
    load.add_argument("model")
    load.add_argument("--version", type=_counting, default=None,
                      help="the version (default: the newest its version_policy selects)")
    load.add_argument("--instances", type=_instances, default=None,
                      help=f"workers, 1 to {MAX_INSTANCES} (default: its config's instances)")
    load.add_argument("--keep", action="store_true", help="keep the version serving before loaded (not the default)")
    load.add_argument("--json", action="store_true", help="one line of JSON")
    _socket_arg(load, timeout=900.0)
    load.set_defaults(func=_cmd_load)

    unload = command("unload", "drain and unload a model's version, or all its versions (admins only)",
                     "shmserve unload resnet --version 2", "shmserve unload resnet")
    unload.add_argument("model")
    unload.add_argument("--version", type=_counting, default=None, help="the version (default: every version)")
    unload.add_argument("--json", action="store_true", help="one line of JSON")
    _socket_arg(unload, timeout=900.0)
    unload.set_defaults(func=_cmd_unload)

    scale = command("scale", "run N workers for a model's default version; removed ones finish their queue "
                             "first (admins only)", "shmserve scale resnet 3")
    scale.add_argument("model")
    scale.add_argument("instances", type=_instances, help=f"workers, 1 to {MAX_INSTANCES}")
    scale.add_argument("--version", type=_counting, default=None, help="the version (default: the default one)")
    scale.add_argument("--json", action="store_true", help="one line of JSON")
    _socket_arg(scale, timeout=900.0)
    scale.set_defaults(func=_cmd_scale)

    canary = command("canary", "canary release: move traffic to a candidate version step by step, rolled "
                               "back on its own if it does worse (admins only)",
                     "shmserve canary resnet start --version 4 --steps 1,5,25,100 --hold-s 60",
                     "shmserve canary resnet start --version 4 --shadow", "shmserve canary resnet status",
                     "shmserve canary resnet promote")
    canary.add_argument("model")
    canary.add_argument("action", choices=("start", "status", "promote", "abort"))
    canary.add_argument("--version", type=_counting, default=None, help="start: the candidate version")
    from shmserve.frontend.canary import CanaryPlan

    defaults = CanaryPlan()
    for field, metavar, text in CANARY_FLAGS:
        default = getattr(defaults, field)
        shown = ",".join(f"{s:g}" for s in default) if field == "steps" else f"{default:g}"
        kind = {"steps": _steps, "min_samples": int, "cold_requests": int, "max_p99_ratio": _ratio_or_off}
        canary.add_argument(f"--{field.replace('_', '-')}", dest=field, metavar=metavar, default=None,
                            type=kind.get(field, float), help=f"{text} (default: {shown})")
    canary.add_argument("--shadow", action="store_true", help="shadow mode: copies of requests go to the candidate "
                                                               "and are compared; its answers are never returned")
    canary.add_argument("--no-sticky", action="store_true", help="split per request even when a --key is sent")
    canary.add_argument("--json", action="store_true", help="one line of JSON")
    _socket_arg(canary, timeout=900.0)
    canary.set_defaults(func=_cmd_canary)

    inspect = command("inspect", "read-only view of a live or dead instance's arena",
                      "shmserve inspect --watch 2", "shmserve inspect --all --check   # for monitoring")
    which = inspect.add_mutually_exclusive_group()
    which.add_argument("--instance", type=instance_name, default="default", help="instance name")
    which.add_argument("--all", action="store_true",
                       help="every instance in /dev/shm owned by you or root (name another with --instance)")
    inspect.add_argument("--json", action="store_true", help="JSON for scripts (includes owner_alive)")
    inspect.add_argument("--watch", nargs="?", const=1.0, type=_positive, metavar="SECONDS",
                         help="live view, refreshed every SECONDS (1 if not given)")
    inspect.add_argument("--check", action="store_true",
                         help="exit 1 with the reasons if anything is unhealthy (a model unavailable, "
                              "restarting or crash-looping; a process gone; a slot stuck)")
    inspect.add_argument("--stuck-after", type=_positive, default=30.0, metavar="S",
                         help="a slot RUNNING longer than this many seconds is stuck")
    inspect.set_defaults(func=_cmd_inspect)

    command("bench", "latency and throughput against floors measured in the same run "
                     "(its options: 'shmserve bench --help')",
            "shmserve bench --spawn-server", "shmserve bench --payload 4KiB,1MiB --json-out results.json")

    doctor = command("doctor", "read-only checks of the host, placement, GPUs and the instance: each finding "
                               "with its evidence, why it matters and the fix (docs/operations.md)",
                     "shmserve doctor", "shmserve doctor --instance prod --json | jq '.findings[]'",
                     "shmserve doctor --config /etc/shmserve/shmserve.toml   # before the first start")
    doctor.add_argument("--instance", type=instance_name, default="default", help="instance name")
    doctor.add_argument("--config", help="the limits and models to check the host against when no server answers "
                                         "(default: a live server's own, else the defaults)")
    doctor.add_argument("--socket", help="the live server's socket (default: the one its arena names)")
    doctor.add_argument("--root", default="/", metavar="DIR", help="read /proc and /sys under DIR (a copy of "
                                                                   "another machine's, or a container's host mount)")
    doctor.add_argument("--sample", type=_sample, default=1.0, metavar="S",
                        help="watch growing counters (CPU throttling) this many seconds; 0: read them once")
    doctor.add_argument("--fail-on", choices=("critical", "warning"), default="critical",
                        help="exit 1 when a finding is at least this severe")
    doctor.add_argument("--json", action="store_true", help="one line of JSON (schema: docs/operations.md)")
    doctor.add_argument("-v", "--verbose", action="store_true", help="also list every check and why one was skipped")
    doctor.set_defaults(func=_cmd_doctor)

    model_file = command("config", "print the configuration of a model file as shmserve reads it: inputs, outputs and "
                                   "dtypes, the dimension that looks like a batch, a max_batch_size to start from, "
                                   "check_dims candidates, and what only a run will size",
                         "shmserve config model.onnx >> models.toml",
                         "shmserve config resnet.pt2 --repository > repo/resnet/config.toml",
                         "shmserve config model.onnx --json | jq .inputs")
    model_file.add_argument("file", metavar="MODEL_FILE", help="an ONNX (.onnx), torch.export (.pt2) or TorchScript "
                                                             "(.pt) file")
    model_file.add_argument("--name", help="the model's name (default: the file's name without its suffix)")
    model_file.add_argument("--backend", choices=("onnxruntime", "torch"),
                            help="the backend that serves it (default: by the file's suffix)")
    model_file.add_argument("--repository", action="store_true",
                            help="a model repository's config.toml (keys at the top level, the path as the file's "
                                 "name in each version directory) instead of a [[models]] table")
    model_file.add_argument("--json", action="store_true", help="one line of JSON")
    model_file.set_defaults(func=_cmd_config)

    cleanup = command("cleanup", "remove arenas whose server is gone (never a live one)",
                      "shmserve cleanup --dry-run", "shmserve cleanup --instance prod")
    cleanup.add_argument("--instance", type=instance_name, help="only this instance's arena (default: every instance)")
    cleanup.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    cleanup.add_argument("--json", action="store_true", help="one line of JSON: what was (or would be) removed, "
                                                             "and what was left")
    cleanup.set_defaults(func=_cmd_cleanup)

    token = command("token", "make a bearer token for the v2 doors' TCP callers (server.v2_tokens; "
                             "docs/security.md)",
                    "shmserve token ingest --file /etc/shmserve/v2-tokens.toml",
                    "shmserve token ops --role admin --file /etc/shmserve/v2-tokens.toml")
    token.add_argument("name", type=_token_name, help="who it is for (letters, digits, '.', '_', '-'; in logs "
                                                      "and limits)")
    token.add_argument("--role", choices=("client", "admin"), default="client",
                       help="client: inference, metadata, statistics, shared memory; admin: also the repository "
                            "(default: client)")
    token.add_argument("--uid", type=_counting, default=None,
                       help="the uid whose /dev/shm objects it may register (default: none)")
    token.add_argument("--file", help="append the entry to this token file (made 0600 if missing); "
                                      "default: print it")
    token.add_argument("--json", action="store_true", help="one line of JSON (the token included)")
    token.set_defaults(func=_cmd_token)
    return parser


def _token_name(text: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"{text[:70]!r}: 1 to 64 letters, digits, '.', '_' or '-'")
    return text


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (``EXIT_CODES``)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "bench":  # its own parser: `shmserve bench --help`
            from shmserve import bench

            status = bench.main(argv[1:])
        else:
            parser = build_parser()
            args = parser.parse_args(argv)
            if args.command is None:
                parser.print_help()
                status = EXIT_OK
            else:
                status = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's flush at exit
        return status
    except KeyboardInterrupt:  # Ctrl-C: quietly, with the shell's convention for SIGINT
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `shmserve canary m status | head -1`: the reader left, nothing else did
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_OUTPUT_CLOSED
    except ImportError as exc:  # $SHMSERVE_HOTPATH names no implementation: a configuration error
        if exc.name != "shmserve.hotpath" or isinstance(exc, ModuleNotFoundError):
            raise  # a broken install is a bug to see whole
        print(f"shmserve: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
