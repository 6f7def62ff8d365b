"""Output space reserved before a model runs: a guess that a short answer corrects.

Owns: how much space a call reserves for its outputs before the model has
made them (``reserve``), the worker's *short answer* (``short_message``,
``needed``: an OUTPUT_TOO_LARGE that says how many bytes the outputs took),
and what a model version learns from short answers, per input signature
(``Learned``).

Must not: touch shared memory, a socket or a clock, or decide who runs a call
again (the dispatcher does for arena requests; the client for its lanes and
zero-copy calls).

Rules
-----
=====================  ==========================================================
what happens           what follows
=====================  ==========================================================
a call is planned      its outputs get exactly their size where the inputs fix
                       every dimension; each other output ``guess_bytes`` (1 MiB,
                       or ``max_output_bytes`` if that is smaller); the total is
                       at least what this version's calls of the same input
                       signature were seen to need (``Learned``)
the outputs fit        the answer; nothing learned, nothing run again
an output is larger    the worker runs the model to its end anyway (an output
than what is left      that does not fit goes to a throwaway array), answers
                       OUTPUT_TOO_LARGE with ``short_message(needed, reserved)``
                       and counts a short answer
a short answer         if ``needed`` fits what the server can deliver
                       (``max_request_bytes``; a lane or zero-copy call: its
                       region), the signature learns it (the most seen: data-
                       dependent outputs only grow it) and the call is run
                       again once with exactly ``needed`` bytes for its
                       outputs; else the error names the limit (an ``infer``
                       whose lane cannot hold it goes to the socket first)
short again            (data-dependent outputs grew between the two runs) the
                       error is the answer: a call runs at most twice
an output larger than  the worker's limit error (no ``needed``: never run
``max_output_bytes``   again); 0, the default, sets no limit of its own
=====================  ==========================================================

A model that keeps state between calls sees the first call of a shape whose
outputs outgrow the guess twice (docs/models.md, "Outputs of any size"); its
config can fix the outputs' shapes (``outputs`` overrides) so that no guess is
made.
"""

from __future__ import annotations

from typing import Hashable

from shmserve import layout
from shmserve.errors import ErrorCode
from shmserve.protocol import tensor_nbytes
from shmserve.spec import ModelSpec, output_shapes

GUESS_BYTES = 1 << 20  # reserved per output whose size the inputs do not fix, before anything was learned
LEARNED_MAX = 1024  # input signatures remembered per model version (then all forgotten at once)
SHORT = "outputs need "  # how a short answer's message begins: the bytes follow, then " bytes"


def guess_bytes(limit: int) -> int:
    """What is reserved per output of unknown size: GUESS_BYTES, or ``limit`` (a model's
    ``max_output_bytes``, 0: none) if smaller."""
    return min(GUESS_BYTES, limit) if limit > 0 else GUESS_BYTES


def reserve(spec: ModelSpec, symbols: dict[str, int], limit: int = 0, learned: int = 0) -> tuple[int, bool]:
    """(bytes to reserve for ``spec``'s outputs given the inputs' ``symbols``, whether that is
    exact: every output's shape follows from the inputs).  Laid out as a worker lays them out
    (each output on a cache line, in order, from the area's start); ``guess_bytes(limit)`` for
    each output of unknown size; never less than ``learned`` when it is not exact."""
    pos, exact, guess = 0, True, guess_bytes(limit)
    for t, shape in zip(spec.outputs, output_shapes(spec.outputs, symbols)):
        if shape is None:
            exact = False
        pos = layout.align_tensor(pos) + (guess if shape is None else tensor_nbytes(t.dtype, shape))
    return (pos if exact else max(pos, learned)), exact


def short_message(needed: int, reserved: int) -> str:
    """The worker's answer when outputs took ``needed`` bytes and ``reserved`` were reserved."""
    return (f"{SHORT}{needed} bytes, {reserved} were reserved for them (a first call of this shape, or "
            f"data-dependent outputs larger than before: it is run again with the space they need)")


def needed(code: ErrorCode, message: str) -> int | None:
    """The bytes a short answer (``code``, ``message``) says the outputs needed; None if it is not
    one (another error, or a limit's OUTPUT_TOO_LARGE: never run again)."""
    if code is not ErrorCode.OUTPUT_TOO_LARGE or not message.startswith(SHORT):
        return None
    digits = message[len(SHORT):].partition(" ")[0]
    if not digits.isdigit() or len(digits) > 15:
        return None
    return int(digits)


class Learned:
    """What one model version's calls needed for their outputs, per input signature: the most a
    short answer said (``learn``), ``get`` 0 for a signature never short.  Bounded: past
    ``limit`` signatures all are forgotten at once (their next calls guess again)."""

    __slots__ = ("_needed", "limit")

    def __init__(self, limit: int = LEARNED_MAX):
        self._needed: dict[Hashable, int] = {}
        self.limit = limit

    def get(self, signature: Hashable) -> int:
        return self._needed.get(signature, 0)

    def learn(self, signature: Hashable, needed: int) -> int:
        """Note that a call of ``signature`` needed ``needed`` bytes; returns what it reserves now."""
        seen = self._needed.get(signature, 0)
        if needed <= seen:
            return seen
        if signature not in self._needed and len(self._needed) >= self.limit:
            self._needed.clear()
        self._needed[signature] = needed
        return needed

    def __len__(self) -> int:
        return len(self._needed)
