"""The canary split rule, written once for the front-end and the clients: ``Route``, ``sticky_point``.

Owns: which version of a model a request that names none goes to while a
split canary ramps (``Route.pick``: a routing key's fixed point, or the
request's uniform draw, below the candidate's share), the key's fixed point
(``sticky_point``: blake2b of the model's name and the key, the same in every
process), and a route's wire form (``Route.to_dict``, ``Route.from_dict``: the
``route`` field of a model's entry in the ``models`` answer).

The front-end's rollout (``shmserve.frontend.canary.Rollout.route``) and a lane
client (``shmserve.client``) both call ``pick``: a client that routes its own
lane calls splits them by exactly the server's rule.  A route carries the
``epoch`` it was valid in: the front-end writes the model's epoch into every
lane header of the model whenever its routing changes (a canary starts, steps,
ends; the default moves), and a client that reads another epoch there than its
route's asks for the route again before it routes a call.

Must not: keep state, read a clock or draw random numbers (the draw is passed
in), do I/O.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple


def sticky_point(model: str, key: bytes) -> float:
    """A routing key's fixed point in [0, 1): blake2b of the model and the key (the same in every process)."""
    name = model.encode()
    digest = hashlib.blake2b(len(name).to_bytes(4, "little") + name + key, digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / (1 << 53)  # 53 bits: exactly representable, never 1.0


def split(model: str, stable: int, candidate: int, percent: float, sticky: bool, key: bytes | None,
          draw: float) -> int:
    """The version a request goes to while a split canary's candidate takes ``percent`` % of the
    traffic: a keyed request (``sticky``) goes to the candidate when its key's fixed point lies
    below the share — so a key once on the candidate stays there as the share grows — and any
    other request when ``draw`` (uniform in [0, 1)) does."""
    point = sticky_point(model, key) if key is not None and sticky else draw
    return candidate if point < percent / 100.0 else stable


class Route(NamedTuple):
    """A model's routing as a lane client evaluates it: ``epoch`` (the lane headers' word it is
    valid for), and while a split canary ramps its ``stable`` and ``candidate`` versions, the
    candidate's ``percent`` and whether keys are ``sticky`` (``candidate`` None: every request
    goes to the default)."""

    epoch: int
    stable: int | None = None
    candidate: int | None = None
    percent: float = 0.0
    sticky: bool = True

    def pick(self, model: str, default: int, key: bytes | None, draw: float) -> int:
        """The version a request for ``model`` that names none goes to: ``default`` without a
        split, else ``split``'s answer."""
        if self.candidate is None:
            return default
        return split(model, self.stable, self.candidate, self.percent, self.sticky, key, draw)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"epoch": self.epoch}
        if self.candidate is not None:
            d.update(stable=self.stable, candidate=self.candidate, percent=self.percent, sticky=self.sticky)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Route:
        """A route from its wire form; ValueError for one that is not well formed (the server's
        bytes are checked like any other input)."""
        if not isinstance(d, dict) or type(d.get("epoch")) is not int or not 0 <= d["epoch"] < 2**32:
            raise ValueError(f"a route needs an epoch in [0, 2**32): {d!r:.200}")
        if d.get("candidate") is None:
            return cls(d["epoch"])
        stable, candidate, percent, sticky = d.get("stable"), d.get("candidate"), d.get("percent"), d.get("sticky")
        if type(stable) is not int or type(candidate) is not int or not 0 < stable < 2**32 or \
                not 0 < candidate < 2**32 or isinstance(percent, bool) or not isinstance(percent, (int, float)) \
                or not math.isfinite(percent) or not 0 <= percent <= 100 or not isinstance(sticky, bool):
            raise ValueError(f"a split route needs versions, a percent in [0, 100] and sticky: {d!r:.200}")
        return cls(d["epoch"], stable, candidate, float(percent), sticky)
