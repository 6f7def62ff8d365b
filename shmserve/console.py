"""What every command shares with its user: exit codes, help, tables and progress.

Owns: the exit codes (``EXIT_CODES``, printed by every ``--help``), the help
format (every option's default shown), the ``--instance`` argument type, tables
(rich) that fit the terminal's width and, piped, print whole (no cell cut or
wrapped: a reader of a pipe has no width), and progress (``Steps``): a line per
step with the seconds so far and, on a terminal, a live line with the step in
hand below them; piped, the plain lines only.  ``shmserve.cli`` and ``shmserve.bench`` both use
it, so neither imports the other for these.

Must not: talk to a server or decide what a command does; write markup that
came from a server (names are printed as plain text).
"""

from __future__ import annotations

import argparse
import sys
import time

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_SERVER, EXIT_PERMISSION, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_OUTPUT_CLOSED = 128 + 13  # the shell's status for a process SIGPIPE stopped
EXIT_CODES = """exit codes:
  0    success
  1    the operation failed (the server answered with an error), or the instance is unhealthy
       (doctor: a critical finding, or one at --fail-on)
  2    usage, input or configuration error (also the server's bad_argument: a value it refuses)
  3    no server answers at the socket
  4    permission denied (the socket's group gives access; an arena of another user)
  130  interrupted (Ctrl-C)
  141  the reader of the output left (`| head`)"""
PIPED_WIDTH = 1 << 16  # a table's width when stdout is not a terminal: wide enough that nothing wraps


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help (unless the help already says it); epilogs as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is None:
            return text + " (default: none)"
        return text + " (default: %(default)s)"


def instance_name(text: str) -> str:
    """argparse type: an instance name (``layout.validate_instance``)."""
    from shmserve.layout import validate_instance

    try:
        return validate_instance(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def table(*columns: str, title: str | None = None):
    """A rich Table with these columns; a cell too wide for a terminal folds onto more lines
    (never cut to an ellipsis), and piped it is printed whole (``stdout_console``)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, overflow="fold")
    return t


def row(t, *cells) -> None:
    """Add a row of plain text (names come from the server: never rich markup)."""
    from rich.text import Text

    t.add_row(*(Text(str(c)) for c in cells))


def stdout_console(file=None):
    """A rich Console on stdout (or ``file``): a terminal's width on a terminal; otherwise wide
    enough that no table wraps or cuts a cell, whatever ``$COLUMNS`` says.  A reader's leaving
    (``| head``) reaches ``main`` as the BrokenPipeError it is (rich's own turns it into exit
    status 1)."""
    from rich.console import Console

    class PipedConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    stream = file or sys.stdout
    terminal = stream.isatty()
    return PipedConsole(file=stream, width=None if terminal else PIPED_WIDTH, soft_wrap=not terminal)


def show(*renderables) -> None:
    """Print tables and text on stdout through ``stdout_console``."""
    out = stdout_console()
    for r in renderables:
        out.print(r)


class Steps:
    """What a long operation is doing, on ``stream`` (stderr): each step a line with the seconds
    since the start, as it begins; on a terminal also a live line below them (a spinner and the
    step in hand) until ``close``; elsewhere only the plain lines (logs and pipes stay readable).  ``step`` may be called from any
    thread; ``close`` ends it (idempotent)."""

    def __init__(self, stream=None, clock=time.monotonic):
        self.stream, self.clock = stream or sys.stderr, clock
        self.started = clock()
        self.status = None
        if self.stream.isatty():
            from rich.console import Console

            self.console = Console(file=self.stream)
            self.status = self.console.status("")
            self.status.start()

    def step(self, text: str) -> None:
        """A new step begins: ``text`` says what is happening (one line, plain text)."""
        elapsed = self.clock() - self.started
        if self.status is not None:
            from rich.text import Text

            self.console.print(Text(f"[{elapsed:5.1f} s] {text}"))
            self.status.update(Text(text))
        else:
            print(f"[{elapsed:5.1f} s] {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
