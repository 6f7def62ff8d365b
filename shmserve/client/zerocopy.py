"""Zero-copy calls: ``ZeroCopyCall`` and ``AsyncZeroCopyCall`` (the faces) over one ``ZeroCopyOperation``.

A zero-copy call works in a region of shared memory the server created for
the connection: the caller writes the inputs into it (``inputs``, numpy views),
``run`` has the model read them there and write its outputs there, and only
small descriptors cross the socket, or nothing at all: a lane region carries
its own queue to a worker.

Owns: one call's run, written once (``ZeroCopyOperation``, an ``Operation`` of
``(timeout,)``): routed each run to the version it names, else to the one the
model's route picks for its key (or a draw of its own: a split canary's rule,
the server's), read again when its lane's header says the routing changed;
through the lane when that is the version its lane serves and it has a free
slot, planned from the spec of the version the client knows
(``planning.call_plan``) and planned again, from the spec read afresh, when a
worker of another version refuses it (a swap: the caller sees nothing of it,
or a clear error naming both versions if the new one refuses the call);
through the other version's lane as ``infer`` goes (its inputs copied in,
its outputs out) when the route picks a version its lane does not serve; over
the socket as a descriptor naming the same region otherwise; its output area
moved to a larger one in its region when a worker's short answer says the
outputs outgrew it (``grow``: the faces run the call once more;
``shmserve.reservations``); read-only views of the outputs; giving its space
back.

The faces hold the operation and their client's pump, and ask the pump only
to ``perform`` it: the pump's one method a call uses.

Must not: touch a socket or wait (the pumps do), or keep a region of a
connection that ended (its calls fail with ConnectionClosed, saying why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from shmserve import lanes, layout, reservations
from shmserve.client.memory import Region
from shmserve.client.planning import SPEC_RETRIES, CallPlan, call_plan, version_of
from shmserve.client.steps import Exchange, left
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import TensorMeta
from shmserve.session import ClientSession, Placement
from shmserve.spec import ModelSpec

if TYPE_CHECKING:
    from shmserve.client.core import ClientCore


class ZeroCopyOperation:
    """One zero-copy call of ``model`` in ``region``: ``inputs`` (name -> (offset, view)) and
    the output area ``out_offset`` .. + ``out_capacity`` (see the module); an ``Operation`` of
    ``(timeout,)``."""

    def __init__(self, core: ClientCore, model: str, region: Region, inputs: dict[str, tuple[int, np.ndarray]],
                 out_offset: int, out_capacity: int, *, version: int | None = None, key: str | None = None,
                 priority: int = 0):
        self.core, self.model, self.region = core, model, region
        self.version, self.key = version, key  # as the caller asked: each run is routed by them
        self.priority = priority  # each run's (0: the model's default level)
        self.flags = 0  # the run's slot flags: SLOT_FLAG_OWN_TIMEOUT when it was given a timeout
        self.inputs = inputs
        self.out_offset, self.out_capacity = out_offset, out_capacity
        self.plan: CallPlan | None = None  # how its tensors are named to a lane worker (one version's spec)
        self.refused: ShmserveError | None = None  # the version serving now refuses this call: said once, kept
        self.looked_at: ModelSpec | None = None  # the client's spec the plan was last checked against
        self.learned: tuple | None = None  # its key in the core's zero_copy_outputs (a short answer teaches it)

    # -- the operation ----------------------------------------------------------------------

    def begin(self, args: tuple[float | None]):
        """The common case, without I/O: the lane call it submitted — ``(region, slot, generation,
        deadline)`` —; the request over the socket (no lane, or no lane slot free); or the steps
        of the call (its first run).  ConnectionClosed if its region was of a connection that
        ended."""
        core, (timeout,) = self.core, args
        seconds = core.timeout_of(timeout)  # checked before anything is submitted
        self.flags = 0 if timeout is None else layout.SLOT_FLAG_OWN_TIMEOUT
        if self.region.gone or core.session.failure is not None:
            raise core.region_gone()
        if not self.lane_usable():
            return Exchange((self.request(seconds), seconds))
        deadline = core.clock() + seconds
        if core.route_stale(self.model, self.region):
            return self.rerouted(deadline)
        target = self.target()
        if target is not None and target != self.region.lane.serves():
            return self.copied(target, deadline)
        if self.plan is None:
            return self.steps(deadline, None)
        index, generation = self.lane_submit(self.lane_plan(), deadline)
        return self.region, index, generation, deadline

    def answer(self, call: tuple, failure: BaseException | None):
        """The outputs of the lane call ``begin`` submitted, or, if a worker of another version
        refused it, the steps that plan it again; any other error is raised."""
        if failure is not None:
            self.give_up(call[1], call[2])
            raise failure
        try:
            return self.lane_collect(call[1], call[2])
        except ShmserveError as exc:
            if not self.stale(exc, 0):
                raise
            return self.steps(call[3], exc)

    def give_up(self, index: int, generation: int) -> None:
        """Waiting for lane slot ``index`` failed (timed out, interrupted, cancelled): the call is
        taken back if no worker claimed it, else its slot is recycled once it has finished
        (``ClientLane.abandon``; a call that finished meanwhile too)."""
        lane = self.region.lane
        if lane is not None:
            lane.abandon(index, generation)

    def answered(self, event) -> dict[str, np.ndarray]:
        """The outputs of the INFER_REGION request that ended the call: read-only views."""
        return self.views(event.outputs)

    def steps(self, deadline: float, refused: ShmserveError | None):
        """The rest of the call (``begin`` did not submit it, or a worker of another version refused
        it: ``refused``): through the lane, its spec read again (``models``) where a swap calls for
        it, else over the socket; returns the outputs."""
        core, first = self.core, 0
        if refused is not None:
            if core.spec_read(self.model, (yield from core.models())) is None:
                raise refused
            first = 1
            target = self.target()
            if target is not None and self.region.lane is not None and target != self.region.lane.serves():
                return (yield from self.copied(target, deadline))  # (the route moved it, and its lane)
        for attempt in range(first, SPEC_RETRIES + 1):
            if not self.lane_usable():
                break
            if self.plan is None and self.lane_spec() is None:
                core.spec_read(self.model, (yield from core.models()))  # infer forgot it (a swap): read it again
            plan = self.lane_plan()
            if plan is None:
                break  # the model lists no spec now: the socket says why
            index, generation = self.lane_submit(plan, deadline)
            try:
                yield self.region, index, generation, deadline
            except BaseException:
                self.give_up(index, generation)
                raise
            try:
                return self.lane_collect(index, generation)
            except ShmserveError as exc:
                if not self.stale(exc, attempt) or core.spec_read(self.model, (yield from core.models())) is None:
                    raise
        seconds = left(deadline, core.clock())
        return self.answered((yield Exchange((self.request(seconds), seconds))))

    def target(self) -> int | None:
        """The version this run goes to: the one the call names, else the one the model's route
        picks (``ClientCore.pick``), else None (the default: whatever its lane serves)."""
        return self.version if self.version is not None else self.core.pick(self.model, self.key)

    def rerouted(self, deadline: float):
        """Steps: the model's routing changed since the client read it (its lane's header says so):
        read its route (and spec) again, then run as ``begin`` would have."""
        core = self.core
        core.spec_read(self.model, (yield from core.models()))
        target = self.target()
        if target is not None and self.region.lane is not None and target != self.region.lane.serves():
            return (yield from self.copied(target, deadline))
        return (yield from self.steps(deadline, None))

    def copied(self, version: int, deadline: float):
        """Steps: this run through ``version``'s infer lane, as ``infer`` goes (the inputs copied into
        it, the outputs out, read-only): the route picked a version this call's own lane does not
        serve (a split canary's other side; a version named whose lane moved)."""
        from shmserve.client.infer import InferOperation  # (infer's module imports the core, which imports this one)

        infer = InferOperation(self.core)
        arrays = {name: view for name, (_, view) in self.inputs.items()}
        seconds = left(deadline, self.core.clock())
        # (over the socket after all, it carries the call's own version and key: the server routes it)
        outputs = yield from infer.steps(self.model, arrays, seconds, self.version, self.key,
                                         infer.lane_wanted(self.model, arrays, version, None),
                                         (self.priority, self.flags))
        for array in outputs.values():
            array.flags.writeable = False
        return outputs

    # -- the lane -----------------------------------------------------------------------------

    def lane_usable(self) -> bool:
        """Through the region's own queue if it has one with a free slot (all 16 busy: this call
        goes over the socket instead, as a descriptor naming the same region)."""
        return self.region.lane is not None and self.region.lane.has_free_slot()

    def lane_plan(self) -> CallPlan | None:
        """How this call names its tensors to a lane worker: planned from the client's spec of the
        model, again whenever that spec is of another version than the plan (a swap); None if the
        client has no spec of it.  Raises the clear error if the version the spec is of refuses
        the call (and keeps raising it)."""
        if self.refused is not None:
            raise self.refused
        spec, plan = self.lane_spec(), self.plan
        if spec is not None and spec is not self.looked_at:  # (the same spec object: nothing to do)
            if plan is None or version_of(spec) != plan.version:
                try:
                    plan = self.plan = call_plan(self.model, spec, self.inputs, self.out_capacity, plan)
                except ShmserveError as exc:
                    if plan is not None:  # it was planned from another version's spec: say what changed
                        self.refused = exc
                    raise
            self.looked_at = spec
        return plan

    def lane_spec(self) -> ModelSpec | None:
        """The client's spec of the version this call's lane serves (its header says; not said: the
        default's), or None if the client holds none of it."""
        serves = self.region.lane.serves() if self.region.lane is not None else 0
        return self.core.specs.get(self.model) if not serves else self.core.version_spec(self.model, serves)

    def lane_submit(self, plan: CallPlan, deadline: float) -> tuple[int, int]:
        return self.region.lane.submit(self.core.session.reserve_id(), plan.version, plan.described,
                                       self.out_offset, self.out_capacity, self.priority,
                                       self.core.deadline_ns(deadline), self.flags)

    def stale(self, exc: ShmserveError, attempt: int) -> bool:
        """Whether a lane call that failed with ``exc`` should be planned again from a spec read
        afresh and sent again: a worker of another version refused it before running it
        (``lanes.version_moved``; a call that failed MODEL_UNAVAILABLE otherwise, a drain that timed
        out, ran, and is never sent again), and fewer than SPEC_RETRIES attempts were made."""
        return lanes.version_moved(exc) and attempt < SPEC_RETRIES and self.plan is not None

    def lane_collect(self, index: int, generation: int) -> dict[str, np.ndarray]:
        """The outputs of the finished lane call in slot ``index`` (its error raised); frees the slot."""
        outputs = self.plan.outputs
        placed = self.region.lane.read(index, generation, self.out_offset, self.out_capacity)
        return self.views([(outputs[name_index], dtype, shape, offset)
                           for name_index, (dtype, shape, offset) in sorted(placed.items())])

    # -- the socket, the outputs, the space ---------------------------------------------------

    def request(self, timeout: float):
        """What builds the INFER_REGION frame naming this call's space (no lane, or its slots all
        busy) on a session: ConnectionClosed (``region_gone``) if its region is of a connection
        that ended."""
        tensors = [TensorMeta(name, view.dtype.name, view.shape, offset)
                   for name, (offset, view) in self.inputs.items()]

        def build(session: ClientSession) -> tuple[int, list]:
            if self.region.gone:  # (a new connection since: the id may name another region of ours there)
                raise self.core.region_gone()
            return session.infer_region(self.model, tensors, self.region.id, self.out_offset, self.out_capacity,
                                        timeout, self.version, self.key, self.priority)
        return build

    def views(self, placements: Iterable[Placement]) -> dict[str, np.ndarray]:
        """Read-only views of the region where the outputs were placed (checked to lie in the
        output area: by the session, or by ``ClientLane.read``)."""
        outputs = {}
        for name, dtype, shape, offset in placements:
            view = np.ndarray(shape, dtype, buffer=self.region.buf, offset=offset)
            view.flags.writeable = False
            outputs[name] = view
        return outputs

    def grow(self, exc: ShmserveError) -> bool:
        """A run failed with ``exc``: if it is a short answer (``shmserve.reservations``: the outputs
        took more than this call's output area), move the area to one of the size they need in the
        same region and return True (the caller runs the call once more); False for any other error.
        OUTPUT_TOO_LARGE naming the fix if the region has no room for it."""
        needed = reservations.needed(exc.code, exc.message)
        if needed is None or needed <= self.out_capacity:
            return False
        allocator = self.region.allocator
        allocator.release(self.out_offset, self.out_capacity)
        offset = allocator.allocate(needed)
        if offset is None:
            self.out_offset = allocator.allocate(self.out_capacity)  # (it was just free: it fits again)
            raise ShmserveError(ErrorCode.OUTPUT_TOO_LARGE,
                                f"the outputs took {needed} bytes, more than this call's {self.out_capacity}, and "
                                f"region {self.region.id} ({self.region.size} bytes) has no room for them: make the "
                                f"zero_copy call with output_capacity={needed}, or release other calls of the "
                                f"region first (a region holds at most server.max_request_bytes + 1 MiB)") from None
        self.out_offset, self.out_capacity = offset, needed
        if self.learned is not None:  # the client's next zero-copy calls of these inputs reserve it at once
            self.core.zero_copy_outputs.learn(self.learned, needed)
        return True

    def release(self) -> None:
        """Give the call's space back to its region (once)."""
        for offset, view in self.inputs.values():
            self.region.allocator.release(offset, view.nbytes)
        self.inputs = {}
        self.region.allocator.release(self.out_offset, self.out_capacity)


class ZeroCopyCall:
    """One zero-copy request: write ``inputs`` (numpy views into the region), call ``run``,
    read the returned views; ``release`` (or leaving the ``with`` block) returns the space."""

    def __init__(self, client, pump, operation: ZeroCopyOperation):
        self.client, self.model, self.region = client, operation.model, operation.region
        self._pump, self._op = pump, operation
        self.inputs = {name: view for name, (_, view) in operation.inputs.items()}
        self.out_offset, self.out_capacity = operation.out_offset, operation.out_capacity
        self.outputs: dict[str, np.ndarray] | None = None
        self._released = False

    def run(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run the model on what is in ``inputs`` now; returns read-only views valid until release.
        Raises the request's ShmserveError; TIMEOUT after ``timeout`` (default: the client's).

        A lane call that a worker of another version refuses (the model's default version
        changed under the spec it was planned from) is planned again from the spec the client
        reads afresh, and sent again: the caller sees nothing of the swap.  If the new version
        does not take this call's inputs (names, dtypes, shapes) or its outputs would not fit the
        space reserved for them, the call fails with the new version's own code (BAD_INPUT,
        BAD_DTYPE, BAD_SHAPE, OUTPUT_TOO_LARGE) and a message naming both versions and what the
        new one refuses, and keeps failing so (make a new ``zero_copy`` call).

        Outputs larger than ``out_capacity`` (a guess where the model's spec does not fix their
        sizes): the call's output area moves to one as large as they need, in its region, and it
        is run once more (the model runs twice; ``out_offset``/``out_capacity`` then name the
        new area, which this call keeps for its later runs).  A region without room for it:
        OUTPUT_TOO_LARGE naming the ``output_capacity`` to ask for."""
        try:
            self.outputs = outputs = self._pump.perform(self._op, (timeout,))
        except ShmserveError as exc:
            if not self._grown(exc):
                raise
            self.outputs = outputs = self._pump.perform(self._op, (timeout,))
        return outputs

    def _grown(self, exc: ShmserveError) -> bool:
        """Whether the call's output area grew after ``exc`` (``ZeroCopyOperation.grow``): run again."""
        if not self._op.grow(exc):
            return False
        self.out_offset, self.out_capacity = self._op.out_offset, self._op.out_capacity
        return True

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.inputs = {}
        self.outputs = None
        self._op.release()

    def __enter__(self) -> ZeroCopyCall:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AsyncZeroCopyCall(ZeroCopyCall):
    """``ZeroCopyCall`` for ``AsyncClient``: ``outputs = await call.run()``."""

    async def run(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """As ``ZeroCopyCall.run`` (a swap under it, and outputs larger than its area, included)."""
        try:
            self.outputs = outputs = await self._pump.perform(self._op, (timeout,))
        except ShmserveError as exc:
            if not self._grown(exc):
                raise
            self.outputs = outputs = await self._pump.perform(self._op, (timeout,))
        return outputs

    async def __aenter__(self) -> AsyncZeroCopyCall:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
