"""shmserve: single-host inference serving over POSIX shared memory.

Front-end, arena, protocol and client live in this package; model workers in
the sibling package ``workers``.
"""

__version__ = "0.1.0"

from shmserve.client import AsyncClient, Client  # noqa: E402
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError  # noqa: E402

__all__ = ["AsyncClient", "Client", "ConnectionClosed", "ErrorCode", "ShmserveError", "__version__"]
