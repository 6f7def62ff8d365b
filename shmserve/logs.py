"""Logging setup: one line per event on stderr, as text or JSON lines.

Owns: the log format.  Text under journald (``$JOURNAL_STREAM`` set) leaves
out the timestamp journald adds itself and prefixes the syslog priority
(``<3>``) so ``journalctl -p err`` works; ``--log-format json`` writes one JSON
object per line (ts, level, logger, msg, pid).  Lifecycle events and errors
log at INFO and above; per-request lines only at DEBUG (``-v``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage(),
               "pid": record.process}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"<{_PRIORITY.get(record.levelno, 6)}>{text}"


def configure(fmt: str = "text", verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
