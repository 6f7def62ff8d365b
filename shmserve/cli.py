"""The `shmserve` command line: one subcommand per user-facing action.

Owns: argument parsing and exit codes.  Each subcommand delegates to the
module that owns the work; nothing here touches the arena layout directly.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _cmd_serve(args: argparse.Namespace) -> int:
    print("shmserve serve: the serving path is not implemented yet (issue: 'Serving path end to end')",
          file=sys.stderr)
    return EXIT_FAILURE


def _cmd_cleanup(args: argparse.Namespace) -> int:
    from shmserve import stale

    records = stale.sweep(args.instance, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for record in records:
        print(f"{verb} /dev/shm/{record.name} ({record.size} bytes): {record.reason}")
    if not records:
        print("no stale arenas")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from shmserve import __version__

    parser = argparse.ArgumentParser(prog="shmserve", description="Local inference over shared memory.")
    parser.add_argument("--version", action="version", version=f"shmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service")
    serve.set_defaults(func=_cmd_serve)

    cleanup = sub.add_parser("cleanup", help="remove arenas whose server is gone (never a live one)")
    cleanup.add_argument("--instance", help="only this instance's arena")
    cleanup.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    cleanup.set_defaults(func=_cmd_cleanup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
