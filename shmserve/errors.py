"""Stable error codes and the exceptions that carry them.

Owns: the list of error codes a client can see.  Codes are strings on the
wire and never change meaning; numbers are used inside the arena (a slot's
``error_code``).  Codes split into the client's fault ("bad request") and
ours or the situation's ("server").

Must not: import anything from the serving path; the client library, the
protocol, workers and the front-end all depend on it.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    # The client's fault: fix the request.
    BAD_FRAME = 1  # malformed, truncated or hostile frame or metadata
    VERSION_MISMATCH = 2  # protocol version the server does not speak
    FRAME_TOO_LARGE = 3  # metadata or payload over the protocol limits
    UNKNOWN_MODEL = 4
    BAD_INPUT = 5  # missing, extra or unknown input names
    BAD_DTYPE = 6
    BAD_SHAPE = 7  # rank or a fixed dimension differs from the model's
    TOO_LARGE = 8  # tensors larger than the configured limit or the arena
    BAD_REGION = 9  # zero-copy region, offset or size outside the client's space
    PERMISSION_DENIED = 10
    BAD_ARGUMENT = 11  # a client library call's own argument (a timeout of 0): refused before sending
    UNAUTHENTICATED = 12  # a credential that proves nothing (a v2 bearer token this server does not know)
    NOT_FOUND = 13  # a v2 door has no route at that path (HTTP 404)
    CANCELLED = 14  # the client gave up on the request (a CANCEL frame, a closed connection, a cancelled RPC)
    # Ours, or the situation's: retry later or tell an operator.
    TIMEOUT = 20
    OVERLOADED = 21
    WORKER_CRASHED = 22
    SHUTTING_DOWN = 23
    MODEL_UNAVAILABLE = 24  # its workers could not load it
    MODEL_ERROR = 25  # the backend raised while running this request
    OUTPUT_TOO_LARGE = 26  # outputs larger than a limit or than the server delivers (or a worker's short
    # answer, shmserve.reservations: its call is run again)
    INTERNAL = 27
    UNAVAILABLE = 28  # no server answers, or the connection to it was lost

    @property
    def wire(self) -> str:
        """The stable string form used on the wire and in logs, e.g. 'unknown_model'."""
        return self.name.lower()

    @property
    def client_fault(self) -> bool:
        return self.value < 20

    @classmethod
    def from_wire(cls, text: str) -> "ErrorCode":
        try:
            return cls[text.upper()]
        except KeyError:
            return cls.INTERNAL

    @classmethod
    def from_number(cls, number: int) -> "ErrorCode":
        """The code a slot's ``error_code`` names (INTERNAL for a number that names none)."""
        try:
            return cls(number)
        except ValueError:
            return cls.INTERNAL


class ShmserveError(Exception):
    """An error with a stable code and a human message; raised by the client library and
    used inside the server to turn a failure into an error response.

    ``retry_after``: seconds after which the same request would be let in (a rate limit's
    refusal, OVERLOADED: docs/config.md "Rate limits"); None when the server said nothing."""

    def __init__(self, code: ErrorCode, message: str, retry_after: float | None = None):
        super().__init__(f"[{code.wire}] {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after


class ConnectionClosed(ShmserveError):
    """The server closed the connection (or none is listening)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.UNAVAILABLE, message)


class BadArgument(ShmserveError, ValueError):
    """A client library call's argument is invalid (a timeout, a dtype, a shape): raised in the
    caller's process before anything is sent.  Both a ShmserveError (``.code``) and a ValueError."""
