"""shmserve: single-host inference serving over POSIX shared memory.

Front-end, arena, protocol and client live in this package; model workers in
the sibling package ``workers``.
"""

__version__ = "0.1.0"
