"""What a worker measures of its own memory use, for its ready message.

Owns: the ``memory`` of the ready message (``shmserve.workerlink``), what
the front-end's memory budget (``server.memory_budget``) counts for this
worker, measured once the model is loaded and warmed up, never guessed:

* ``host_bytes``: the process's resident memory that is its own, RssAnon +
  RssFile of ``/proc/self/status`` (the interpreter, the runtime, the
  weights).  RssShmem is left out: the arena and the client regions are
  shared with the front-end and counted there (a GPU worker page-locks the
  whole arena, which would otherwise count it once per worker).
* ``device_bytes``: on a GPU worker, what the backend says it holds when it
  can tell (torch: its caching allocator's reserved bytes), else how much
  more of the device is in use after warm-up than before the backend was
  loaded (``cudaMemGetInfo``; the CUDA context created before that is not
  counted, and another process allocating on the device meanwhile is).
  0 on a CPU worker.

Must not: import CUDA (``workers.regions.GpuMemory`` does, on a GPU worker).
"""

from __future__ import annotations

STATUS = "/proc/self/status"


def host_bytes(status: str = STATUS) -> int:
    """RssAnon + RssFile of ``status`` in bytes (VmRSS where the kernel has no split); 0 if unreadable."""
    fields = {}
    try:
        with open(status) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "VmRSS"):
                    fields[key] = int(value.split()[0]) * 1024  # "1234 kB"
    except (OSError, ValueError, IndexError):
        return 0
    if "RssAnon" in fields and "RssFile" in fields:
        return fields["RssAnon"] + fields["RssFile"]
    return fields.get("VmRSS", 0)


def measured(own_device_bytes: int | None, device_before: int | None, device_after: int | None) -> dict:
    """The ready message's ``memory``: this process's host bytes now, and its device bytes:
    ``own_device_bytes`` (the backend's statement) if not None, else ``device_after`` -
    ``device_before`` (the device's use around the load; never below 0), 0 without a device."""
    if own_device_bytes is not None:
        device = own_device_bytes
    elif device_before is not None and device_after is not None:
        device = max(0, device_after - device_before)
    else:
        device = 0
    return {"host_bytes": host_bytes(), "device_bytes": int(device)}
