"""The `shmserve` command line: one subcommand per user-facing action.

Owns: argument parsing, output formatting and exit codes.  Each subcommand
delegates to the module that owns the work (server, client, stale).

Exit codes: 0 success; 1 the operation failed (the server answered with an
error, or a model failed); 2 usage or configuration error; 3 no server
answers at the socket.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import zlib
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_SERVER = 0, 1, 2, 3


def _socket_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", help="server socket (default: $SHMSERVE_SOCKET, else "
                                         "$XDG_RUNTIME_DIR/shmserve/<instance>.sock, else /tmp/shmserve-<uid>/)")
    parser.add_argument("--instance", default=None, help="instance name used for the default socket path")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for an answer")


def _client(args):
    from shmserve.client import Client
    from shmserve.config import DEFAULT_INSTANCE

    try:
        return Client(args.socket, timeout=args.timeout, instance=args.instance or DEFAULT_INSTANCE)
    except ValueError as exc:  # $SHMSERVE_SERVER_UID names no user
        raise SystemExit(f"shmserve {args.command}: {exc}") from None


def _talks_to_server(func):
    """Turn client errors of a subcommand into messages and exit codes (3: no server, 1: an error)."""
    import functools

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        from shmserve.errors import ConnectionClosed, ShmserveError

        try:
            return func(args)
        except ConnectionClosed as exc:
            print(f"shmserve {args.command}: {exc.message}", file=sys.stderr)
            return EXIT_NO_SERVER
        except ShmserveError as exc:
            print(f"shmserve {args.command}: {exc}", file=sys.stderr)
            return EXIT_FAILURE

    return wrapper


def _cmd_serve(args: argparse.Namespace) -> int:
    from shmserve import config as cfg
    from shmserve import logs, systemd
    from shmserve.server import serve

    logs.configure(args.log_format, args.verbose)
    try:
        config = cfg.load(args.config, instance=args.instance) if args.config else \
            cfg.demo_config(args.instance or cfg.DEFAULT_INSTANCE)
    except cfg.ConfigError as exc:
        print(f"shmserve: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.strict:
        from dataclasses import replace

        config = replace(config, strict=True)
    if args.metrics and "/" not in args.metrics:
        from shmserve.metrics import check_loopback

        try:
            check_loopback(args.metrics.rpartition(":")[0].strip("[]") or "127.0.0.1")
        except ValueError as exc:
            print(f"shmserve: --metrics: {exc}", file=sys.stderr)
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

    try:
        return serve(config, path, listen_sock=listen_sock, config_path=args.config, metrics_address=args.metrics)
    except ArenaError as exc:  # e.g. the instance is already being served
        print(f"shmserve serve: {exc}", file=sys.stderr)
        return EXIT_FAILURE


@_talks_to_server
def _cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    with _client(args) as client:
        inputs = {}
        for item in args.input or []:
            name, sep, path = item.partition("=")
            if not sep:
                print(f"shmserve infer: --input expects NAME=FILE.npy, got {item!r}", file=sys.stderr)
                return EXIT_USAGE
            inputs[name] = np.load(path, allow_pickle=False)
        if args.random:
            spec = next((m for m in client.models() if m["name"] == args.model), None)
            if spec is None:
                print(f"shmserve infer: the server has no model {args.model!r}", file=sys.stderr)
                return EXIT_FAILURE
            rng = np.random.default_rng(args.seed)
            for t in spec["inputs"]:
                if t["name"] not in inputs:
                    shape = [d if isinstance(d, int) and d >= 0 else args.dynamic_dim for d in t["shape"]]
                    inputs[t["name"]] = _random(rng, t["dtype"], shape)
        if not inputs:
            print("shmserve infer: give --input NAME=FILE.npy or --random", file=sys.stderr)
            return EXIT_USAGE
        outputs = client.infer(args.model, inputs, timeout=args.timeout)
    rows = [{"name": n, "dtype": a.dtype.name, "shape": list(a.shape),
             "crc32": f"{zlib.crc32(np.ascontiguousarray(a).tobytes()):08x}"} for n, a in outputs.items()]
    if args.save:
        out_dir = Path(args.save)
        out_dir.mkdir(parents=True, exist_ok=True)
        for n, a in outputs.items():
            np.save(out_dir / f"{_safe(n)}.npy", a)
    if args.json:
        print(json.dumps({"model": args.model, "outputs": rows}))
    else:
        for r in rows:
            print(f"{r['name']}\t{r['dtype']}\t{tuple(r['shape'])}\tcrc32={r['crc32']}")
    return EXIT_OK


def _random(rng, dtype: str, shape):
    import numpy as np

    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.random(shape, dtype=np.float64).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    info = np.iinfo(dt)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True).astype(dt)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "output"


@_talks_to_server
def _cmd_models(args: argparse.Namespace) -> int:
    with _client(args) as client:
        models = client.models()
    if args.json:
        print(json.dumps(models))
        return EXIT_OK
    for m in models:
        print(f"{m['name']}\t{m['backend']}\t{m['device']}\t{m['state']}\t{m['path']}")
        for role in ("inputs", "outputs"):
            for t in m[role]:
                dims = ", ".join("?" if d is None else str(d) for d in t["shape"])
                print(f"  {role[:-1]:6} {t['name']}\t{t['dtype']}\t[{dims}]")
        if m.get("error"):
            print(f"  error: {m['error']}")
    return EXIT_OK


@_talks_to_server
def _cmd_control(args: argparse.Namespace) -> int:
    with _client(args) as client:
        answer = client.health() if args.command == "health" else client.info()
    print(json.dumps(answer, indent=None if args.json else 2))
    if args.command == "health" and answer.get("status") != "ok":
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    from shmserve import inspection, stale
    from shmserve.arena import ArenaError, ArenaNotFound
    from shmserve.config import DEFAULT_INSTANCE

    def instances() -> list[str]:
        if args.all:  # only our own and root's: another user could shrink its arena under our mapping
            trusted = stale.trusted_uids()
            return sorted({r.instance for r in stale.list_arenas() if r.valid and r.uid in trusted})
        return [args.instance or DEFAULT_INSTANCE]

    def take() -> dict:
        snaps, errors = [], []
        for name in instances():
            try:
                snaps.append(inspection.snapshot(name, stuck_after_s=args.stuck_after))
            except ArenaNotFound as exc:
                errors.append((EXIT_NO_SERVER, str(exc)))
            except ArenaError as exc:
                errors.append((EXIT_USAGE, str(exc)))
        return {"instances": snaps, "leftovers": inspection.leftovers(), "errors": errors}

    state = take()
    if args.watch:
        from rich.console import Group
        from rich.live import Live

        import time as _time
        try:
            with Live(Group(*[inspection.render(s) for s in state["instances"]]), refresh_per_second=4) as live:
                while True:
                    _time.sleep(args.watch)
                    state = take()
                    live.update(Group(*[inspection.render(s) for s in state["instances"]]))
        except KeyboardInterrupt:
            return EXIT_OK
    for code, message in state["errors"]:
        print(f"shmserve inspect: {message}", file=sys.stderr)
    if args.json:
        if args.all:
            print(json.dumps({"instances": state["instances"], "leftovers": state["leftovers"]}))
        elif state["instances"]:
            print(json.dumps({**state["instances"][0], "leftovers": state["leftovers"]}))
    elif not args.check:
        from rich.console import Console

        console = Console()
        for snap in state["instances"]:
            console.print(inspection.render(snap))
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
            print("OK: " + ", ".join(f"{s['instance']} ({len(s['workers'])} workers)" for s in state["instances"]))
        return EXIT_FAILURE if found else EXIT_OK
    return EXIT_OK


def _cmd_cleanup(args: argparse.Namespace) -> int:
    from shmserve import stale
    from shmserve.arena import uid_words

    records = stale.sweep(args.instance, dry_run=args.dry_run)
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
    for record in stale.list_arenas(args.instance):
        if record.refused and not record.owner_alive:  # another user's live instance is none of our business
            print(f"left /dev/shm/{record.name}: {record.refused}")
        elif record.stale and not args.dry_run:
            print(f"could not remove /dev/shm/{record.name} (owned by {uid_words(record.uid)}): "
                  f"run 'shmserve cleanup' as its owner or root")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from shmserve import __version__

    parser = argparse.ArgumentParser(prog="shmserve", description="Local inference over shared memory.")
    parser.add_argument("--version", action="version", version=f"shmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service (no --config: the embedded demo model on CPU)")
    serve.add_argument("--config", help="TOML configuration file")
    serve.add_argument("--socket", help="socket path (overrides the config and $SHMSERVE_SOCKET)")
    serve.add_argument("--instance", help="instance name (overrides the config)")
    serve.add_argument("--metrics", metavar="ADDR", help="serve Prometheus metrics on a Unix socket path or a "
                                                          "loopback host:port")
    serve.add_argument("--strict", action="store_true", help="a model that cannot load stops the start "
                                                             "(exit 1) instead of serving the others ([server] strict)")
    serve.add_argument("--log-format", choices=("text", "json"), default="text", help="stderr log format")
    serve.add_argument("-v", "--verbose", action="store_true", help="debug logging (one line per request)")
    serve.set_defaults(func=_cmd_serve)

    infer = sub.add_parser("infer", help="run a model once and print its outputs' dtype, shape and checksum")
    infer.add_argument("model")
    infer.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="an input from a .npy file")
    infer.add_argument("--random", action="store_true", help="random inputs for every input not given")
    infer.add_argument("--dynamic-dim", type=int, default=1, help="size of dynamic dimensions with --random")
    infer.add_argument("--seed", type=int, default=None, help="seed for --random")
    infer.add_argument("--save", metavar="DIR", help="write each output to DIR/NAME.npy")
    infer.add_argument("--json", action="store_true")
    _socket_arg(infer)
    infer.set_defaults(func=_cmd_infer)

    models = sub.add_parser("models", help="list the server's models with their inputs and outputs")
    models.add_argument("--json", action="store_true")
    _socket_arg(models)
    models.set_defaults(func=_cmd_models)

    for name, text in (("health", "is the server healthy (exit 1 if not)"), ("info", "server and arena facts")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help="one line of JSON")
        _socket_arg(p)
        p.set_defaults(func=_cmd_control)

    inspect = sub.add_parser("inspect", help="read-only view of a live or dead instance's arena")
    which = inspect.add_mutually_exclusive_group()
    which.add_argument("--instance", help="instance name (default: default)")
    which.add_argument("--all", action="store_true",
                       help="every instance in /dev/shm owned by you or root (name another with --instance)")
    inspect.add_argument("--json", action="store_true", help="JSON for scripts (includes owner_alive)")
    inspect.add_argument("--watch", nargs="?", const=1.0, type=float, metavar="SECONDS", help="live view")
    inspect.add_argument("--check", action="store_true", help="exit 1 with the reasons if anything is unhealthy")
    inspect.add_argument("--stuck-after", type=float, default=30.0, metavar="S",
                         help="a slot RUNNING longer than this is stuck")
    inspect.set_defaults(func=_cmd_inspect)

    sub.add_parser("bench", help="latency and throughput against floors measured in the same run "
                                 "(see 'shmserve bench --help')")

    cleanup = sub.add_parser("cleanup", help="remove arenas whose server is gone (never a live one)")
    cleanup.add_argument("--instance", help="only this instance's arena")
    cleanup.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    cleanup.set_defaults(func=_cmd_cleanup)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # its own parser: `shmserve bench --help`
        from shmserve import bench

        return bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
