"""Who a v2 caller is and what it may do: kernel credentials, bearer tokens, the anonymous caller.

Owns: the ``Identity`` of a v2 request, the scopes (what each operation
needs, ``SCOPE_OF``), the token table (``[server] v2_tokens``: a TOML file
the operator keeps 0600), reading ``Authorization: Bearer <token>`` (HTTP
header or gRPC metadata), and the one check that says why a caller may not
do something (``Authenticator.check``).

Identity is only what the kernel vouches for, or a secret the operator
issued:

- a **Unix-socket** caller is the uid ``SO_PEERCRED`` reports (the same
  allow-list and admin list as the native socket: ``allowed``/``is_admin``);
- a **loopback TCP** caller is *anonymous* unless it presents a token from
  the table: the kernel vouches for nothing on TCP (a ``/proc/net/tcp``
  entry can be a closed socket's, listed with uid 0; a port can be taken
  over the moment its owner lets go), so nothing about the connection is
  looked up and nothing is remembered per address;
- a **token** holder is what its entry says: a name (its limits are its
  own), a role (``client``, or ``admin``: repository control too), and
  optionally a uid whose ``/dev/shm`` objects it may register: that uid's
  own objects only (``uid = 0`` is root's objects, never "anyone's" as for
  root over the Unix socket; the server's own uid, for a caller that is the
  operator);
- the **anonymous** caller gets ``health`` and what ``[server] v2_anonymous``
  grants (default ``metadata`` and ``infer``), never ``shared_memory`` (the
  server would open objects with its own rights for someone it cannot name:
  a confused deputy) nor ``repository``; all anonymous callers share one set
  of limits.

Tokens are compared by their SHA-256 digests with ``hmac.compare_digest``,
against every entry (no early exit), so neither the token nor the table
leaks through timing; the file holds digests, never tokens
(``shmserve token new`` makes one).

Must not: look up a TCP peer anywhere (``/proc``, a cache by address), log
or echo a token, or decide anything about a request beyond who may make it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from typing import Callable, Iterable

from shmserve.errors import ErrorCode
from shmserve.v2.messages import V2Error


class Scope(enum.Enum):
    """What an operation needs.  ``health`` is everyone's who can reach a door."""

    HEALTH = "health"  # live, ready
    METADATA = "metadata"  # server and model metadata, model readiness and configuration
    INFER = "infer"
    STATISTICS = "statistics"
    SHARED_MEMORY = "shared_memory"  # system and CUDA shared-memory registration and status
    REPOSITORY = "repository"  # the repository index, load and unload (admins)


# Every v2 operation (``rest.route``'s names; the gRPC door maps its methods onto them) and its scope.
SCOPE_OF: dict[str, Scope] = {
    "live": Scope.HEALTH, "ready": Scope.HEALTH,
    "server_metadata": Scope.METADATA, "model_metadata": Scope.METADATA, "model_ready": Scope.METADATA,
    "model_config": Scope.METADATA,
    "infer": Scope.INFER,
    "statistics": Scope.STATISTICS,
    "shm_status": Scope.SHARED_MEMORY, "shm_register": Scope.SHARED_MEMORY, "shm_unregister": Scope.SHARED_MEMORY,
    "cuda_shm_status": Scope.SHARED_MEMORY, "cuda_shm_register": Scope.SHARED_MEMORY,
    "cuda_shm_unregister": Scope.SHARED_MEMORY,
    "repository_index": Scope.REPOSITORY, "repository_load": Scope.REPOSITORY,
    "repository_unload": Scope.REPOSITORY,
}
# What configuration may grant the anonymous caller (server.v2_anonymous); the others never.
ANONYMOUS_GRANTABLE = frozenset({Scope.METADATA, Scope.INFER, Scope.STATISTICS})
CLIENT = frozenset({Scope.HEALTH, Scope.METADATA, Scope.INFER, Scope.STATISTICS, Scope.SHARED_MEMORY})
ADMIN = CLIENT | {Scope.REPOSITORY}
ROLES = {"client": CLIENT, "admin": ADMIN}

MAX_TOKEN_CHARS = 512  # a header longer than this is refused before it is hashed
_TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750's b64token
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
ANONYMOUS_KEY = "anonymous"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who makes a request.  ``key``: what its limits and registered regions are kept under
    (``uid:N``, ``token:NAME``, ``anonymous``); ``uid``: the uid whose ``/dev/shm`` objects it may
    register (None: none); ``scopes``: what it may do; ``who``: for messages and logs."""

    key: str
    uid: int | None
    scopes: frozenset[Scope]
    who: str
    gids: frozenset[int] = frozenset()  # a Unix-socket peer's groups (SO_PEERCRED, SO_PEERGROUPS)

    @property
    def anonymous(self) -> bool:
        return self.key == ANONYMOUS_KEY


@dataclass(frozen=True, slots=True)
class Token:
    """One entry of the token table (its secret only as a digest)."""

    name: str
    digest: bytes
    role: str
    uid: int | None


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file, the entry and the fix."""


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


def load_tokens(path: str, *, server_uid: int | None = None) -> tuple[Token, ...]:
    """The entries of the token file at ``path``::

        [[token]]
        name = "ingest"          # who it is, in logs and limits
        sha256 = "9f86…"         # hex SHA-256 of the token (``shmserve token new`` prints both)
        role = "client"          # or "admin": repository load, unload and index too
        uid = 1001               # optional: may register this uid's own /dev/shm objects

    TokenFileError naming the fix if the file is not a regular file of the server's uid (or
    root), is readable or writable by anyone else, is not TOML, or has a bad entry (names and
    digests must be unique)."""
    me = os.geteuid() if server_uid is None else server_uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenFileError(f"server.v2_tokens: cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"server.v2_tokens: {path} is not a regular file")
        if st.st_uid not in (me, 0):
            raise TokenFileError(f"server.v2_tokens: {path} belongs to uid {st.st_uid}, not to the server's uid {me} "
                                 f"or root: chown it")
        if st.st_mode & 0o077:
            raise TokenFileError(f"server.v2_tokens: {path} is mode {stat.S_IMODE(st.st_mode):04o}: others can read "
                                 f"or change who may call; chmod 600 {path}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise TokenFileError(f"server.v2_tokens: {path} is not valid TOML: {exc}") from None
    finally:
        os.close(fd)
    unknown = set(raw) - {"token"}
    if unknown:
        raise TokenFileError(f"server.v2_tokens: {path}: unknown key {sorted(unknown)[0]!r} (only [[token]] entries)")
    entries = raw.get("token", [])
    if not isinstance(entries, list):
        raise TokenFileError(f"server.v2_tokens: {path}: 'token' must be an array of tables ([[token]])")
    tokens, names, digests = [], set(), set()
    for i, e in enumerate(entries):
        where = f"server.v2_tokens: {path}: token[{i}]"
        if not isinstance(e, dict):
            raise TokenFileError(f"{where}: expected a table")
        extra = set(e) - {"name", "sha256", "role", "uid"}
        if extra:
            raise TokenFileError(f"{where}: unknown key {sorted(extra)[0]!r} (name, sha256, role, uid)")
        name, hexdigest, role, uid = e.get("name"), e.get("sha256"), e.get("role", "client"), e.get("uid")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise TokenFileError(f"{where}.name: 1 to 64 letters, digits, '.', '_' or '-' (starting with a letter "
                                 "or digit)")
        if name in names:
            raise TokenFileError(f"{where}.name: {name!r} is given twice")
        if not isinstance(hexdigest, str) or not _DIGEST_RE.fullmatch(hexdigest):
            raise TokenFileError(f"{where}.sha256: 64 lower-case hex digits, the token's SHA-256 "
                                 "(shmserve token new makes a token and its entry)")
        if hexdigest in digests:
            raise TokenFileError(f"{where}.sha256: the same token as another entry")
        if role not in ROLES:
            raise TokenFileError(f"{where}.role: 'client' or 'admin', not {str(role)[:20]!r}")
        if uid is not None and (type(uid) is not int or uid < 0 or uid > 2**32 - 2):
            raise TokenFileError(f"{where}.uid: a uid from 0 to {2**32 - 2}")
        names.add(name)
        digests.add(hexdigest)
        tokens.append(Token(name, bytes.fromhex(hexdigest), role, uid))
    return tuple(tokens)


def token_entry(name: str, token: str, role: str = "client", uid: int | None = None) -> str:
    """The TOML entry of ``token`` for the token file (its digest, never the token)."""
    lines = ["[[token]]", f'name = "{name}"', f'sha256 = "{digest(token).hex()}"', f'role = "{role}"']
    if uid is not None:
        lines.append(f"uid = {uid}")
    return "\n".join(lines) + "\n"


class Authenticator:
    """Identities for the v2 doors of one server (see the module header).

    ``allowed(uid, groups)``, ``is_admin(uid, groups)``: the Unix door's allow-list and admin
    list; ``tokens``: the token table; ``anonymous``: the scopes granted to anonymous callers
    (only ``ANONYMOUS_GRANTABLE``).  The server replaces ``tokens`` and ``anonymous`` on reload."""

    def __init__(self, *, allowed: Callable[[int, set], bool], is_admin: Callable[[int, set], bool],
                 tokens: Iterable[Token] = (), anonymous: Iterable[Scope] = (Scope.METADATA, Scope.INFER)):
        self.allowed, self.is_admin = allowed, is_admin
        self.configure(tokens, anonymous)

    def configure(self, tokens: Iterable[Token], anonymous: Iterable[Scope]) -> None:
        anonymous = frozenset(anonymous)
        if not anonymous <= ANONYMOUS_GRANTABLE:
            raise ValueError(f"anonymous callers may not be granted {sorted(s.value for s in anonymous - ANONYMOUS_GRANTABLE)}")
        self.tokens = tuple(tokens)
        self.anonymous = Identity(ANONYMOUS_KEY, None, frozenset({Scope.HEALTH}) | anonymous, "an anonymous caller")

    def peer(self, uid: int, groups: frozenset[int]) -> Identity:
        """The identity of a Unix-socket peer (``SO_PEERCRED``).  V2Error PERMISSION_DENIED if it
        is not on the allow-list."""
        if not self.allowed(uid, set(groups)):
            raise V2Error(ErrorCode.PERMISSION_DENIED, f"uid {uid} is not allowed to use this server")
        scopes = ADMIN if self.is_admin(uid, set(groups)) else CLIENT
        return Identity(f"uid:{uid}", uid, scopes, f"uid {uid}", frozenset(groups))

    def bearer(self, authorization: str | None) -> Identity:
        """The identity an ``Authorization`` value proves (None or absent: anonymous).
        V2Error UNAUTHENTICATED for anything but ``Bearer <token>`` of a token in the table."""
        if authorization is None:
            return self.anonymous
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS or not _TOKEN_RE.fullmatch(token):
            raise V2Error(ErrorCode.UNAUTHENTICATED, "the Authorization header must be 'Bearer <token>' with one "
                                                     "token this server issued (server.v2_tokens)")
        presented, found = digest(token), None
        for t in self.tokens:  # every entry, no early exit: the time does not tell which one matched
            if hmac.compare_digest(presented, t.digest):
                found = t
        if found is None:
            raise V2Error(ErrorCode.UNAUTHENTICATED, "the bearer token is not one this server knows "
                                                     "(server.v2_tokens)")
        return Identity(f"token:{found.name}", found.uid, ROLES[found.role], f"token {found.name!r}")

    @staticmethod
    def check(identity: Identity, op: str) -> None:
        """V2Error PERMISSION_DENIED, naming what to do, if ``identity`` may not run ``op`` (a
        ``SCOPE_OF`` name; one not listed needs ``repository``)."""
        scope = SCOPE_OF.get(op, Scope.REPOSITORY)
        if scope in identity.scopes:
            return
        if identity.anonymous:
            hint = ("present a token (Authorization: Bearer <token>; server.v2_tokens)"
                    + ("" if scope in ANONYMOUS_GRANTABLE else ", or call over the Unix socket"))
            if scope in ANONYMOUS_GRANTABLE:
                hint += f", or grant it to anonymous callers (server.v2_anonymous = [..., \"{scope.value}\"])"
        elif scope is Scope.REPOSITORY:
            hint = ("only the server's uid, root, server.admin_uids / admin_groups and admin tokens may "
                    "(role = \"admin\" in server.v2_tokens)")
        else:
            hint = "ask the operator for it"
        raise V2Error(ErrorCode.PERMISSION_DENIED, f"{identity.who} may not use {scope.value} operations "
                                                   f"({op}): {hint}")
