"""shmserve: single-host inference serving over POSIX shared memory.

Front-end, arena, protocol and client live in this package; model workers in
the sibling package ``workers``.

The public API (``Client``, ``AsyncClient``, the errors) is loaded on first
use (PEP 562), so that importing a foundation module such as
``shmserve.arena`` — as every worker does — does not import the client
library.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Client": "shmserve.client",
    "AsyncClient": "shmserve.client",
    "ShmserveError": "shmserve.errors",
    "BadArgument": "shmserve.errors",
    "ConnectionClosed": "shmserve.errors",
    "ErrorCode": "shmserve.errors",
}

__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'shmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
