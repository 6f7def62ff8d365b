"""The system shared-memory extension of KServe v2: regions a client registers by POSIX name.

Owns: the registered regions (per caller, ``owner``: an identity's key, so
one caller's names never reach another's; the object must belong to the
caller's uid), the checks at registration and at every use, reading a
request's inputs out of a region and writing its outputs into one, and
unregistering (which lets the requests that use the region finish first).

Triton's security history (CVE-2025-23319, -23320, -23334: a key naming the
server's own segments, offsets past the end, use after unregister) sets the
rules here:

- registration is off unless the server enables it (``[server]
  v2_system_shared_memory = true``);
- a key is one name in /dev/shm (any number of leading slashes; no other
  slash, no ``..``, no NUL); it may never name one of shmserve's own
  segments (``shmserve.*``, of any instance) nor the same file as this
  server's arena;
- the object is opened ``O_NOFOLLOW|O_NONBLOCK`` and checked with ``fstat``:
  a regular file, owned by the caller's uid (root may register anyone's but
  ours), not writable by others, and ``offset + byte_size`` inside its real
  size;
- every use checks offset + size against the registered range; reads go
  through ``pread`` on the descriptor, and a client that shrinks its object
  under us makes its own request fail (BAD_REGION), never the server;
- writes go through ``pwrite``, the object's size checked before (a short
  object gets nothing) and after: a client that truncates its object while
  an output is written into it fails that request (BAD_REGION).  What
  ``pwrite`` cannot promise is that the object is never grown: truncated
  between the check and the write, it is grown back to the end of that
  write (never past the registered range).  No call writes a file without
  extending it, and the one way that cannot grow it (a mapping of the range
  written through ``/proc/self/mem`` or ``process_vm_writev``, where the
  kernel turns a page past the end into an error, never a SIGBUS) was built
  and measured at 0.5 GB/s against pwrite's 10 GB/s for 1 MiB on the 2-vCPU
  VM: too dear for what it prevents, since a client makes the server write
  pages into its object anyway by registering a sparse one;
- every failure of a read or a write (ENOSPC into a sparse object when
  /dev/shm is full included) is a ``V2Error`` of the request, never an
  ``OSError`` on the answer path;
- keys never appear in an error message (``status`` shows a caller its own);
- unregistering returns at once, as Triton's does: a region no request uses
  goes then; one in use is marked closing (no new request may name it, where
  Triton would still serve them: so every unregister ends), is still listed
  by ``status``, and goes — its descriptor closed, its name free again — when
  its last user gives it back.

Costs: one copy in (``pread`` straight into the request's arena space) and
one out (``pwrite`` from the arena), the same as the Unix socket's inline
path, with no socket in between.

Must not: decide anything about a request (``shmserve.v2.service``), or map a
client's object (a truncation under a mapping is a SIGBUS in the server).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from shmserve import layout
from shmserve.errors import ErrorCode
from shmserve.v2.messages import ShmRef, V2Error

SHM_DIR = "/dev/shm"
KEY_MAX = 255
NAME_MAX = 256
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(eq=False)
class ShmRegion:
    name: str
    key: str
    owner: str  # the caller that registered it (an identity's key)
    fd: int
    offset: int
    byte_size: int
    users: int = 0  # requests reading or writing it now
    closing: bool = False  # unregistered: it goes when its last user gives it back


def _bad(message: str, triton: str | None = None) -> V2Error:
    """A BAD_REGION refusal (``triton``: its message is Triton's wording, of that status class)."""
    return V2Error(ErrorCode.BAD_REGION, message, triton)


def object_name(key: str, region: str = "") -> str:
    """The /dev/shm entry a key names (leading slashes stripped) for registering ``region``.
    V2Error BAD_REGION for a key that is not one plain name, in Triton's words where it has them
    (the message does not repeat the key)."""
    refused = f"cannot register shared memory region '{region}' - invalid shm key"
    if not isinstance(key, str) or not key or len(key) > KEY_MAX:
        raise _bad(f"{refused}: it must be a shared-memory name of 1 to {KEY_MAX} characters", "INVALID_ARG")
    name = key.lstrip("/")
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise _bad(f"{refused}: it must be one shared-memory name (like '/my_region'), not a path", "INVALID_ARG")
    if name.startswith(layout.NAME_PREFIX):
        raise _bad(f"cannot register shared memory region '{region}' as the key contains the reserved prefix "
                   f"'{layout.NAME_PREFIX}' (shmserve's own segments)", "INVALID_ARG")
    return name


def _write_failed(ref: ShmRef, what: str, code: int) -> V2Error:
    """A write into the region ``ref`` names failed with ``code`` (an errno)."""
    if code in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
        return _bad(f"{what}: region {ref.region!r} could not be written: no room for its pages (is /dev/shm "
                    f"full? write the object's pages when you create it, so writes into it need none)")
    return _bad(f"{what}: region {ref.region!r} could not be written ({os.strerror(code)})")


class SystemShm:
    """The registered regions of one server.  ``enabled``: registration allowed.  ``own``:
    (st_dev, st_ino) of segments that can never be registered (the arena).  Each holds a
    descriptor: ``max_per_uid`` per caller, ``max_total`` in all (the server counts both in its
    descriptor budget)."""

    def __init__(self, *, enabled: bool, own: set[tuple[int, int]], max_per_uid: int = 256, max_total: int = 1024,
                 server_uid: int | None = None):
        self.enabled, self.own, self.max_per_uid, self.max_total = enabled, own, max_per_uid, max_total
        self.server_uid = os.getuid() if server_uid is None else server_uid
        self.regions: dict[tuple[str, str], ShmRegion] = {}

    # -- registration -----------------------------------------------------------------

    def register(self, owner: str, uid: int, name: str, key: str, offset: int, byte_size: int, *,
                 exact: bool = False) -> ShmRegion:
        """See ``V2Service.shm_register``: ``owner`` registers ``key``, an object of ``uid`` (root,
        unless ``exact``, may register any but the server uid's: a token's uid is always exact)."""
        if not self.enabled:
            raise V2Error(ErrorCode.PERMISSION_DENIED, "registering system shared memory is off on this server "
                                                       "(server.v2_system_shared_memory = true turns it on)")
        if not isinstance(name, str) or not name or len(name) > NAME_MAX:
            raise _bad(f"a region name must be 1 to {NAME_MAX} characters")
        if type(offset) is not int or type(byte_size) is not int or offset < 0 or byte_size < 0:
            raise _bad(f"region {name!r}: offset and byte_size must be integers >= 0")
        if (owner, name) in self.regions:
            raise V2Error(ErrorCode.BAD_REGION, f"shared memory region '{name}' already in manager", "ALREADY_EXISTS")
        if sum(r.owner == owner for r in self.regions.values()) >= self.max_per_uid:
            raise V2Error(ErrorCode.OVERLOADED, f"{self.max_per_uid} regions registered by this caller "
                                                f"(server.max_regions_per_uid)")
        if len(self.regions) >= self.max_total:
            raise V2Error(ErrorCode.OVERLOADED, f"{self.max_total} regions registered on this server "
                                                f"(server.max_regions)")
        path = os.path.join(SHM_DIR, object_name(key, name))
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise _bad(f"Unable to open shared memory region for '{name}': no shared-memory object by that key",
                       "INVALID_ARG") from None
        except OSError as exc:
            raise _bad(f"Unable to open shared memory region for '{name}': the key cannot be opened "
                       f"({os.strerror(exc.errno)}); it must be a shared-memory object of the caller's uid",
                       "INVALID_ARG") from None
        try:
            st = os.fstat(fd)
            problem = self._problem(st, uid, offset, byte_size, exact)
            if problem:
                raise _bad(f"failed to register shared memory region '{name}': invalid args: {problem}",
                           "INVALID_ARG")
        except BaseException:
            os.close(fd)
            raise
        region = ShmRegion(name, key, owner, fd, offset, byte_size)
        self.regions[(owner, name)] = region
        return region

    def _problem(self, st: os.stat_result, uid: int, offset: int, byte_size: int, exact: bool = False) -> str:
        if not stat.S_ISREG(st.st_mode):
            return "the key does not name a shared-memory object"
        if (st.st_dev, st.st_ino) in self.own:
            return "the key names one of the server's own segments"
        if (uid != 0 or exact) and st.st_uid != uid:
            return "the object belongs to another uid; register only your own"
        if st.st_uid == self.server_uid and uid != self.server_uid:
            return "the object belongs to the server's uid"
        if st.st_mode & stat.S_IWOTH:
            return "the object is writable by every user (mode o+w): create it 0600 or 0660"
        if offset + byte_size > st.st_size:
            return (f"offset {offset} + byte_size {byte_size} is past the end of the object "
                    f"({st.st_size} bytes)")
        return ""

    def unregister(self, owner: str, name: str | None) -> None:
        """Unregister ``name`` (None: all of ``owner``'s; unknown names are ignored), as Triton
        does: at once if no request uses it, else it is marked closing and goes (its descriptor
        closed, its name free again) when its last request gives it back; meanwhile ``status``
        still lists it.  Unlike Triton, no new request may name a closing region, so an
        unregister always ends."""
        for r in [r for (o, n), r in self.regions.items() if o == owner and (name is None or n == name)]:
            r.closing = True
            if r.users == 0:
                self._remove(r)

    def _remove(self, r: ShmRegion) -> None:
        """Forget a closing region nobody uses and close its descriptor (once)."""
        if self.regions.get((r.owner, r.name)) is r:
            del self.regions[(r.owner, r.name)]
        if r.fd >= 0:
            os.close(r.fd)
            r.fd = -1

    def status(self, owner: str, name: str | None) -> list[dict]:
        """``owner``'s regions (``name``: that one), those being unregistered included until their
        last request is done (as Triton lists them).  V2Error BAD_REGION (Triton's NOT_FOUND) for
        an unknown ``name``."""
        if name is not None and (owner, name) not in self.regions:
            raise _bad(f"Unable to find system shared memory region: '{name}'", "NOT_FOUND")
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for (o, n), r in sorted(self.regions.items(), key=lambda kv: kv[0][1])
                if o == owner and (name is None or n == name)]

    def close_all(self) -> None:
        for r in self.regions.values():
            if r.fd >= 0:
                os.close(r.fd)
                r.fd = -1
        self.regions.clear()

    # -- use --------------------------------------------------------------------------

    def take(self, owner: str, ref: ShmRef, nbytes: int, what: str) -> ShmRegion:
        """The region ``ref`` names among ``owner``'s, counted as in use until ``give_back``.
        V2Error BAD_REGION: no such region (or it is being unregistered), or ``nbytes`` at
        ``ref.offset`` does not fit in ``ref.byte_size`` or the registered range."""
        r = self.regions.get((owner, ref.region))
        if r is None:
            raise _bad(f"Unable to find shared memory region: '{ref.region}'", "NOT_FOUND")
        if r.closing:  # Triton would still serve it: see docs/v2.md, "Differences from Triton"
            raise _bad(f"Unable to find shared memory region: '{ref.region}' (it is being unregistered: its "
                       "requests in flight finish, no new one may name it)", "NOT_FOUND")
        if type(ref.offset) is not int or type(ref.byte_size) is not int or ref.offset < 0 or ref.byte_size < 0:
            raise _bad(f"{what}: shared_memory_offset and shared_memory_byte_size must be integers >= 0")
        if ref.offset >= r.byte_size and (ref.offset or ref.byte_size):
            raise _bad(f"Invalid offset for shared memory region: '{ref.region}' ({what}: offset {ref.offset}, "
                       f"the region has {r.byte_size} bytes)", "INVALID_ARG")
        if ref.offset + ref.byte_size > r.byte_size:
            raise _bad(f"Invalid offset + byte size for shared memory region: '{ref.region}' ({what}: offset "
                       f"{ref.offset} + byte_size {ref.byte_size}, the region has {r.byte_size} bytes)", "INVALID_ARG")
        SystemShm.fits(ref, nbytes, what)
        r.users += 1
        return r

    @staticmethod
    def fits(ref: ShmRef, nbytes: int, what: str) -> None:
        """V2Error BAD_REGION if ``nbytes`` do not fit in ``ref.byte_size``."""
        if nbytes > ref.byte_size:
            raise _bad(f"shared memory size specified with the request for {what} ({ref.byte_size} bytes) should "
                       f"be at least {nbytes} bytes to hold the results", "INVALID_ARG")

    def give_back(self, r: ShmRegion) -> None:
        """A request is done with ``r`` (``take``); the last user of a closing region removes it."""
        r.users -= 1
        if r.users == 0 and r.closing:
            self._remove(r)

    @staticmethod
    def read_into(r: ShmRegion, ref: ShmRef, sink: memoryview, what: str) -> None:
        """Fill ``sink`` from the region at ``ref.offset``.  V2Error BAD_REGION if the object has
        shrunk under it or cannot be read."""
        want, got, at = len(sink), 0, r.offset + ref.offset
        while got < want:
            try:
                n = os.preadv(r.fd, [sink[got:]], at + got)
            except OSError as exc:
                raise _bad(f"{what}: region {ref.region!r} could not be read ({os.strerror(exc.errno)})") from None
            if n <= 0:
                raise _bad(f"{what}: region {ref.region!r} is shorter than registered (was it truncated?)")
            got += n

    @staticmethod
    def write_from(r: ShmRegion, ref: ShmRef, data: memoryview, what: str) -> None:
        """Write ``data`` into the region at ``ref.offset``.  V2Error BAD_REGION if the object is
        shorter than that (nothing is written), is truncated while it is written, or has no room
        for its pages (a sparse object when /dev/shm is full).  See the module header for the one
        thing this cannot promise."""
        n, at = len(data), r.offset + ref.offset
        try:
            before = os.fstat(r.fd).st_size
            if before < at + n:
                raise _bad(f"{what}: region {ref.region!r} is shorter than registered (was it truncated?)")
            done = 0
            while done < n:
                k = os.pwrite(r.fd, data[done:], at + done)
                if k <= 0:
                    raise _bad(f"{what}: region {ref.region!r} could not be written")
                done += k
            if os.fstat(r.fd).st_size < before:
                raise _bad(f"{what}: region {ref.region!r} was truncated while its output was written")
        except OSError as exc:
            raise _write_failed(ref, what, exc.errno) from None
