"""Canary shadow mode: copies of finished requests to a candidate version, and their comparison.

Owns: whether a finished inline request of a model's stable version is copied (a shadow rollout
runs and the request is drawn for its share: ``Rollout.shadow``), the copy — a request of its own,
submitted through the dispatcher's front-door interface like any other door's, its inputs copied
arena to arena from the original's extent —, and what becomes of the copy's answer: compared with
the original's outputs (``canary.outputs_match``; an error the candidate answered is a mismatch),
recorded in the rollout (``Rollout.record_shadow``), never sent anywhere.  The copy's own outcome
(ok or error, its latency) reaches the rollout as every request's does: the dispatcher's
``observe``.

A copy never waits and never costs a client anything: it is not made when the candidate has no
ready worker, a request waits for arena space, the server stops, or an output of the original
does not unpack; one that would have to wait anyway is dropped at once (``ShadowDoor.waiting``);
one refused before it ran is not compared.

Must not: route requests (``Models.resolve`` decides, for the version the copy names), answer a
client, or hold what a copy took past its answer.
"""

from __future__ import annotations

import logging
from typing import Callable

from shmserve import layout
from shmserve.errors import ShmserveError
from shmserve.frontend import canary
from shmserve.frontend.dispatcher import Dispatcher, Outputs, output_array
from shmserve.frontend.models import SERVING, ModelState, Models
from shmserve.frontend.requests import Request
from shmserve.protocol import InferRequest

log = logging.getLogger("shmserve.shadow")


class ShadowDoor:
    """The front door of one shadow copy: its payload is the original's inputs (``sources``,
    views of the arena, copied as the copy is admitted); its answer is compared with the
    original's outputs (``theirs``, arrays) and recorded in ``rollout``."""

    def __init__(self, dispatcher: Dispatcher, rollout: canary.Rollout, sources: list, theirs: dict,
                 now: Callable[[], float]):
        self.dispatcher, self.rollout, self.sources, self.theirs, self.now = dispatcher, rollout, sources, theirs, now
        self.ran = False  # admitted: its answer, whatever it is, is the candidate's

    def in_flight(self) -> int:
        return 0

    def waiting(self, req: Request) -> None:
        self.dispatcher.drop(req)  # a copy never waits: no space or no worker now, no copy

    def admitted(self, req: Request, sinks: list | None) -> None:
        self.ran = True
        if sinks is not None:
            for sink, source in zip(sinks, self.sources):
                sink[:] = source
            self.sources = []
            self.dispatcher.received(req)

    def answer(self, req: Request, answer) -> None:
        try:
            if self.ran and self.rollout.candidate == req.model.version:
                self.rollout.record_shadow(self._matches(answer), self.now())
        finally:
            if isinstance(answer, Outputs) and answer.in_arena:
                self.dispatcher.release(req)

    def abort(self, exc: Exception) -> None:
        """``Door.abort``: a copy has no connection; nothing more is copied into it."""
        self.sources = []

    def _matches(self, answer) -> bool:
        if not isinstance(answer, Outputs):
            return False
        try:
            mine = {o.name: output_array(o) for o in answer.outputs}
        except layout.LayoutError:  # a bytes output the worker wrote badly: not a match
            return False
        return canary.outputs_match(self.theirs, mine, self.rollout.plan)


class Shadowing:
    """Shadow copies of one front-end's requests.  ``offer`` is the dispatcher's hook for every
    inline request that finished with outputs (the server wires it); ``now`` the lifecycle's
    clock, ``draw`` the dispatcher's uniform draw in [0, 1)."""

    def __init__(self, dispatcher: Dispatcher, models: Models, now: Callable[[], float]):
        self.dispatcher, self.models, self.now = dispatcher, models, now

    def target(self, req: Request) -> tuple[canary.Rollout, ModelState] | None:
        """The rollout and candidate a finished request of a stable version is copied to (a canary
        in shadow mode, and this request drawn for its share), else None."""
        model = self.models.get(req.model.name)
        rollout = model.rollout if model is not None else None
        if rollout is None or rollout.plan.mode != canary.SHADOW or req.model.version != rollout.stable \
                or rollout.state in canary.TERMINAL or not rollout.shadow(self.dispatcher.draw()):
            return None
        candidate = model.versions.get(rollout.candidate)
        return (rollout, candidate) if candidate is not None and candidate.phase == SERVING else None

    def offer(self, req: Request, outputs: Outputs) -> None:
        """Inline request ``req`` finished with ``outputs`` (views of the arena it still holds): copy
        it to its canary's candidate if it is drawn for that (module docstring)."""
        chosen = self.target(req)
        d = self.dispatcher
        if chosen is None or d.waiting or d.stopping:
            return
        rollout, candidate = chosen
        if candidate.pick_worker() is None:
            return
        try:
            theirs = {o.name: output_array(o) for o in outputs.outputs}
        except layout.LayoutError:  # a bytes output that does not unpack: its client gets it as it is
            return
        sources = d.input_views(req)
        door = ShadowDoor(d, rollout, sources, theirs, self.now)
        parsed = InferRequest(req.id, candidate.name, req.inputs, req.timeout_s, version=candidate.version)
        try:
            copy = d.submit(door, parsed, payload_bytes=sum(len(s) for s in sources))
        except ShmserveError as exc:  # the candidate refuses what the stable version took: not compared
            log.debug("shadow copy of request %d to %s not made: %s", req.id, candidate.key, exc.message)
            return
        copy.shadow = True  # its outcome is not a client's (the dispatcher's counts leave it out)
        d.admit(copy)
