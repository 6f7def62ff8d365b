"""``infer``, written once for both faces: through a lane of the model when it can take the call, else the socket.

Owns: the decision which way an ``infer`` call goes (``lane_wanted``: lanes
on, the model's spec known, the version it goes to — the one it names, else
the one its route picks for its key or a draw of its own, else the default —
one whose spec the client holds, every input a fixed-size array the model
has; that version's lane routable, of the route's epoch, a slot and space
free), opening a version's infer lane (and backing off to the socket for
LANE_RETRY_S when the server refuses one), copying the inputs into the lane
and submitting the call, reading its outputs into new arrays, running it
again once in the lane when the worker's short answer says its outputs
outgrew a guessed capacity (``shmserve.reservations``: the signature's form
keeps the size), and falling back to the socket when the lane cannot answer
(its version went away: the spec is read again next time; outputs larger
than the lane holds).

Its state is the ``ClientCore``'s (``infer_lanes``, ``lane_forms``,
``no_lane_until``, ``opening``): a new connection or a new spec forgets it with
the rest.

``InferOperation`` is an ``Operation`` (``shmserve.client.steps``): its
common case — a lane open, the form of this input signature known, a slot
free — is ``begin`` and ``answer`` around the pump's wait, without a
generator; everything else is ``steps``.

Must not: touch a socket or wait (the pumps do); decide how a lane call is
written (``lanes.ClientLane`` and ``shmserve.hotpath`` do).
"""

from __future__ import annotations

from types import GeneratorType
from typing import Mapping

import numpy as np

from shmserve import lanes, layout, reservations
from shmserve.client.core import ClientCore
from shmserve.client.memory import Region
from shmserve.client.planning import DEFAULT_REGION_BYTES, LANE_FORMS_MAX, LaneForm, lane_form, needed_bytes, \
    region_limit, version_of
from shmserve.client.steps import CONNECT, Exchange, left
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError
from shmserve.lanes import DATA_FLOOR
from shmserve.session import FIXED_DTYPES, check_priority, check_timeout

LANE_RETRY_S = 1.0  # a lane refused for Client.infer (the server's limits, no version serving): ask again after
VERSION_LANES_MAX = 4  # infer lanes per model besides its default's (versions called by name or a canary's)
NEED_SPEC = object()  # lane_wanted: ask the server for the model's spec first
NO_SCHED = (0, 0)  # a call's (priority, slot flags): the model's default level, the server's timeout


class InferOperation:
    """``Client.infer`` and ``AsyncClient.infer`` over ``core`` (an ``Operation`` of ``(model,
    inputs, timeout, version, key, priority)``): see the module."""

    __slots__ = ("core",)

    def __init__(self, core: ClientCore):
        self.core = core

    # -- the operation ----------------------------------------------------------------------

    def begin(self, args: tuple):
        """The lane call the common case submitted — ``(region, slot, generation, deadline, seat,
        form, model, inputs, version, key, sched)`` —, the call's request over the socket (no lane
        wanted, or it cannot take the call now), or the steps of the call.  BadArgument for a
        timeout out of range or a priority that is no int in [0, 2**32) (``session.check_priority``).
        ``args``: ``(model, inputs, timeout, version, key, priority)``."""
        model, inputs, timeout, version, key, priority = args
        core = self.core
        seconds = core.timeout if timeout is None else check_timeout(timeout)
        sched = (check_priority(priority), 0 if timeout is None else layout.SLOT_FLAG_OWN_TIMEOUT)
        if core.session.failure is not None:
            return self.steps(model, inputs, seconds, version, key, None, sched)  # it connects again first
        wanted = self.lane_wanted(model, inputs, version, key)
        if wanted is None:
            return self.request(model, inputs, seconds, version, key, sched)
        if wanted is NEED_SPEC:
            return self.steps(model, inputs, seconds, version, key, wanted, sched)
        region = core.infer_lane(model, wanted[3])
        if region is None or core.route_stale(model, region):
            return self.steps(model, inputs, seconds, version, key, wanted, sched)
        deadline = core.clock() + seconds
        arrays, form, signature, _ = wanted
        call = self.lane_start(region, arrays, form, signature, deadline, model, inputs, version, key, sched)
        if call is None:
            return self.request(model, inputs, left(deadline, core.clock()), version, key, sched)
        return call

    def answer(self, call: tuple, failure: BaseException | None, again: bool = True):
        """The outputs of a lane call that finished (new arrays), or the request that carries the
        call over the socket after all, with what is left of its timeout: the lane lost its
        version before the call ran (``lanes.version_moved``: the socket path loads it again or says
        why; the next call reads the spec again).  Outputs that outgrew a guessed capacity (a short
        answer, ``shmserve.reservations``): the steps that run it ``again`` once with the space they
        need (``run_again``); a second short answer is raised.  ``failure``: waiting
        for it failed (a timeout keeps its space until the worker is done with it); raised."""
        region, index, generation, deadline, seat, form, model, inputs, version, key, sched = call
        needed = None
        lane = region.lane
        if failure is not None:
            if lane is not None and not lane.finished(index, generation):
                # Timed out, interrupted or cancelled: taken back if no worker claimed it (nothing of
                # it runs), else the worker may still write its outputs there.
                if lane.abandon(index, generation):
                    seat.release()
                else:
                    region.defer_release(seat, index, generation)
                raise failure
            if lane is None:
                seat.release()
                raise failure
            # (it finished as the wait was interrupted: read it, so that its slot is freed)
        try:
            placed = lane.read(index, generation, seat.out_offset, seat.out_capacity)
            if failure is not None:
                raise failure
            buf, names = region.buf, form.outputs
            # New arrays the caller owns, copied out of the lane (as the socket path's are new).
            return {names[name_index]: np.ndarray(shape, dtype, buffer=buf, offset=offset).copy()
                    for name_index, (dtype, shape, offset) in sorted(placed.items())}
        except ShmserveError as exc:
            if exc is failure:
                raise
            if lanes.version_moved(exc):
                # The lane's version changed under the spec this call was planned from, and nothing
                # of it ran: the socket answers this one (the server routes it, by its own rule),
                # the next asks for the spec and the route again.
                self.core.forget_spec(model)
            elif exc.code is ErrorCode.MODEL_UNAVAILABLE:
                self.core.forget_spec(model)  # (it ran: its error is the answer; the next call asks again)
                raise
            else:
                needed = reservations.needed(exc.code, exc.message)
                if needed is None or not again:
                    raise
        finally:
            seat.release()
        if needed is not None:  # (on the version it ran on: a split does not draw again)
            return self.run_again(model, inputs, deadline, needed, form.version, version, key, sched)
        return self.request(model, inputs, left(deadline, self.core.clock()), version, key, sched)

    def run_again(self, model: str, inputs: Mapping[str, np.ndarray], deadline: float, needed: int, ran_on: int,
                  version: int | None, key: str | None, sched: tuple[int, int] = NO_SCHED):
        """Steps: the call once more, through the lane of ``ran_on`` (the version it ran on), its
        outputs given the ``needed`` bytes a short answer said (its signature's form keeps them: the
        next calls of that signature reserve them at once); else (the lane cannot take it) over the
        socket, with the caller's ``version`` and ``key`` (the server routes it)."""
        core = self.core
        wanted = self.lane_wanted(model, inputs, ran_on, None)
        region = core.infer_lane(model, wanted[3]) if wanted is not None and wanted is not NEED_SPEC else None
        if wanted is not None and wanted is not NEED_SPEC and region is not None:
            arrays, form, signature, _ = wanted
            grown = form._replace(output_capacity=needed, needed=needed_bytes(dict(enumerate(form.sizes)), needed))
            call = None
            if grown.needed <= region.size - DATA_FLOOR:  # (else not learned: the socket says why)
                if form.output_capacity < needed:
                    form = core.lane_forms[signature] = grown
                    region.drop_seats()  # (the seat kept for this signature is too small now)
                call = self.lane_start(region, arrays, form, signature, deadline, model, inputs, version, key,
                                       sched)
            if call is not None:
                try:
                    yield call
                except BaseException as exc:
                    outputs = self.answer(call, exc, again=False)
                else:
                    outputs = self.answer(call, None, again=False)
                if type(outputs) is not Exchange:
                    return outputs
                return self.answered((yield outputs))
        return self.answered((yield self.request(model, inputs, left(deadline, core.clock()), version, key, sched)))

    @staticmethod
    def answered(event) -> dict[str, np.ndarray]:
        """The outputs of the INFER request (``request``) that ended the call: new arrays."""
        return event.outputs

    def steps(self, model: str, inputs: Mapping[str, np.ndarray], seconds: float, version: int | None,
              key: str | None, wanted, sched: tuple[int, int] = NO_SCHED):
        """The call when ``begin`` could not submit it: a new connection first if this one is over,
        the model's spec if not known (``wanted``: ``NEED_SPEC``), its infer lane opened if not
        open; through the lane if it takes the call, else (or after) over the socket."""
        core = self.core
        if core.session.failure is not None:
            yield CONNECT
            wanted = self.lane_wanted(model, inputs, version, key)
        if wanted is not None and wanted is not NEED_SPEC:
            region = core.infer_lane(model, wanted[3]) or core.infer_lanes.get(model)
            if region is not None and region.lane is not None and core.route_stale(model, region):
                core.forget_spec(model)  # its routing changed: the route (and spec) of the new epoch first
                wanted = NEED_SPEC
        if wanted is NEED_SPEC:
            listing = yield from core.models()
            if model not in core.specs:  # (another call may have read it meanwhile)
                core.spec_read(model, listing)
            wanted = self.lane_wanted(model, inputs, version, key)
        if wanted is not None and wanted is not NEED_SPEC:
            deadline = core.clock() + seconds
            region = core.infer_lane(model, wanted[3])
            if region is None:
                region = yield from self.open_lane(model, wanted[1], wanted[3])
            arrays, form, signature, _ = wanted
            call = self.lane_start(region, arrays, form, signature, deadline, model, inputs, version, key, sched) \
                if region else None
            if call is not None:
                try:
                    yield call
                except BaseException as exc:
                    outputs = self.answer(call, exc)
                else:
                    outputs = self.answer(call, None)
                if type(outputs) is GeneratorType:  # a short answer: run again
                    return (yield from outputs)
                if type(outputs) is not Exchange:
                    return outputs
                return self.answered((yield outputs))  # over the socket after all
            seconds = left(deadline, core.clock())  # the socket gets what the lane left of the timeout
        return self.answered((yield self.request(model, inputs, seconds, version, key, sched)))

    @staticmethod
    def request(model: str, inputs: Mapping[str, np.ndarray], seconds: float, version: int | None,
                key: str | None, sched: tuple[int, int] = NO_SCHED) -> Exchange:
        """The call as an INFER request over the socket, waited for ``seconds`` (``sched``: its
        priority and slot flags; the socket carries the priority, the server its own deadline)."""
        return Exchange((lambda session: session.infer(model, inputs, seconds, version, key, sched[0]), seconds))

    # -- the lane -----------------------------------------------------------------------------

    def lane_wanted(self, model: str, inputs: Mapping[str, np.ndarray], version, key):
        """(arrays, form, signature, version) for a call that may go through a lane of that
        version, ``NEED_SPEC`` if the model's spec must be fetched first, or None: the socket
        carries it (lanes off, a version the client has no spec of, the lane refused lately, a
        bytes or unsupported tensor, an input the model does not have).  The version: the one
        named, else the one the model's route picks (``ClientCore.pick``: a split canary's rule,
        the server's own, by ``key`` or a draw), else the default's, as the socket's would be."""
        core = self.core
        if not core.lanes:
            return None
        until = core.no_lane_until.get(model)
        if until is not None:
            if core.clock() < until:
                return None
            del core.no_lane_until[model]
            core.forget_spec(model)  # ask again: a model loaded meanwhile has a spec now, a new version another
        if model not in core.specs:
            return NEED_SPEC
        spec = core.specs[model]
        if spec is None:
            core.no_lane_until[model] = core.clock() + LANE_RETRY_S
            return None
        target = version if version is not None else core.pick(model, key)  # (None: the default's)
        if target is not None and target == version_of(spec):
            target = None  # (the default's, named: the same forms)
        elif target is not None:
            spec = core.version_spec(model, target)
            if spec is None:
                return None  # a version the client has no spec of: the socket
        arrays = {}
        for name, value in inputs.items():
            a = np.ascontiguousarray(value)
            if a.dtype not in FIXED_DTYPES:
                return None  # bytes or unsupported: the socket path serializes or refuses it
            arrays[name] = a
        signature = (model, tuple((n, a.dtype, a.shape) for n, a in arrays.items()), target)
        forms = core.lane_forms
        form = forms.get(signature, NEED_SPEC)
        if form is NEED_SPEC:
            if len(forms) >= LANE_FORMS_MAX:
                forms.clear()
            form = forms[signature] = lane_form(spec, arrays)
        return None if form is None else (arrays, form, signature, form.version)

    def open_lane(self, model: str, form: LaneForm, version: int):
        """Steps: open ``model``'s infer lane to ``version`` (the default's is the model's own, the
        others are filed by version: at most VERSION_LANES_MAX), sized for many calls within the
        server's largest region (learned from its ``info`` when a region is refused as too large);
        returns it, or None — the socket carries the call — if another call is opening one, if
        even this call is larger than the server's largest region, or if the server refuses it
        (no lane for LANE_RETRY_S then; a lost connection is raised)."""
        core = self.core
        spec = core.specs.get(model)
        name = model if model not in core.infer_lanes and version == version_of(spec) else (model, version)
        moved = core.infer_lanes.pop(name) if type(name) is tuple and name in core.infer_lanes else None
        if moved is not None:  # filed for this version, moved by a drain to another: filed as that one's
            core.infer_lanes[(model, moved.lane.serves() if moved.lane is not None else 0, moved.id)] = moved
        if model in core.opening or (type(name) is tuple and sum(
                type(k) is tuple and k[0] == model for k in core.infer_lanes) >= VERSION_LANES_MAX):
            return None  # another call (AsyncClient) is opening one, or enough are open: the socket
        core.opening.add(model)
        try:
            size = self.lane_size(form)
            while size is not None:
                try:
                    region = core.infer_lanes[name] = yield from core.open_region(size, model, version)
                    return region
                except ShmserveError as exc:
                    if exc.code is not ErrorCode.TOO_LARGE or core.region_limit is not None:
                        raise
                    core.region_limit = region_limit((yield from core.info()))
                    size = self.lane_size(form)
        except ShmserveError as exc:
            if isinstance(exc, ConnectionClosed):
                raise
            core.no_lane_until[model] = core.clock() + LANE_RETRY_S
        finally:
            core.opening.discard(model)
        return None

    def lane_size(self, form: LaneForm) -> int | None:
        """The size to open a model's infer lane with: room for many calls, within the server's
        largest region; None if even this call is larger than that (the socket says TOO_LARGE)."""
        limit = self.core.region_limit
        if limit is not None and form.needed > limit:
            return None
        return max(form.needed, DEFAULT_REGION_BYTES if limit is None else min(DEFAULT_REGION_BYTES, limit))

    def lane_start(self, region: Region, arrays: dict[str, np.ndarray], form: LaneForm, signature: tuple,
                   deadline: float, model: str, inputs: Mapping[str, np.ndarray], version: int | None = None,
                   key: str | None = None, sched: tuple[int, int] = NO_SCHED) -> tuple | None:
        """Copy ``arrays`` into the lane and submit the call with ``sched`` (its priority and slot
        flags) and its deadline: ``(region, slot, generation, deadline, seat, form, model, inputs,
        version, key, sched)``, or None if the lane cannot take it
        now (no worker serves it, the front-end diverts its calls, all its slots or its space are
        taken): then the socket carries it."""
        if region.abandoned:
            region.reclaim()
        lane = region.lane
        if lane is None or not lane.routable() or not lane.has_free_slot():
            return None
        seat = region.seat(signature, arrays, form)
        if seat is None:
            return None
        seat.busy = True
        try:
            for view, a in zip(seat.views, arrays.values()):
                view[...] = a  # the one copy the socket path makes too (there: into the server's arena)
            index, generation = lane.submit(self.core.session.reserve_id(), form.version, seat.described,
                                            seat.out_offset, seat.out_capacity, sched[0],
                                            self.core.deadline_ns(deadline), sched[1])
        except BaseException:
            seat.release()
            raise
        return region, index, generation, deadline, seat, form, model, inputs, version, key, sched
