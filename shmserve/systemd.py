"""systemd integration, written to the protocols: sd_notify and socket activation.

Owns: sending notification datagrams to ``$NOTIFY_SOCKET`` (READY=1,
STATUS=…, WATCHDOG=1, STOPPING=1, RELOADING=1), the watchdog interval from
``$WATCHDOG_USEC``/``$WATCHDOG_PID``, and the listening sockets passed with
``$LISTEN_FDS``/``$LISTEN_PID``/``$LISTEN_FDNAMES`` (after gunicorn's
systemd.py).  Outside systemd every function is a no-op; none raises.

Must not: decide when to notify (the front-end does) or import anything heavy.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("shmserve.systemd")

SD_LISTEN_FDS_START = 3


def notify(*lines: str) -> bool:
    """Send ``lines`` (e.g. "READY=1", "STATUS=serving") to systemd; False if not under systemd
    or the send failed (never raises)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(lines).encode(), address)
        return True
    except OSError as exc:
        log.debug("sd_notify to %s failed: %s", address, exc)
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings systemd expects (half its timeout), or None if off."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec:
        return None
    try:
        if pid and int(pid) != os.getpid():
            return None
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


def listen_sockets() -> list[tuple[str, socket.socket]]:
    """Sockets passed by socket activation, as (name, socket); [] when there are none.

    Honours LISTEN_PID (they are ours only if it names this process) and
    clears the variables so children do not inherit them.
    """
    try:
        pid = int(os.environ.get("LISTEN_PID", "0"))
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)
    if pid != os.getpid() or count <= 0:
        return []
    out = []
    for i in range(count):
        fd = SD_LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            log.warning("passed descriptor %d is not a socket: %s", fd, exc)
            continue
        out.append((names[i] if i < len(names) and names[i] else f"fd{fd}", sock))
    return out


def monotonic_usec() -> int:
    return time.monotonic_ns() // 1000
