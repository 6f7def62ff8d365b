"""A door process's own inference: an inline INFER through one of its lanes to a worker, and back.

Owns: the decision whether the door serves a request itself or relays it to
main (``carries``), a lane call's life (``begin``: a slot and the views its
payload is received into; ``submit`` once it has arrived; ``collect``: the
finished calls, read and answered; deadlines), and waking up for
completions: the door's one eventfd, which a worker rings after it publishes
a call of one of its lanes if the door armed that lane's completion ring
(``rings.EventfdDoorbell``).  ``collect`` arms every busy lane and then
looks once more, so a completion published between the look and the arming
is not lost.

A lane call carries its request's priority and deadline into its lane slot
(``ClientLane.submit``'s ``priority``, ``deadline_ns`` and ``flags``: whether the
deadline is the client's own timeout), as main's
dispatcher writes them into an arena slot; a relayed request keeps its
meta, ``priority`` included.

What the door serves itself is only what main would accept as it is: an
INFER (inline) whose model and version the directory routes (no rollout, a
serving version with a spec), every input a fixed-size dtype the spec
accepts (``spec.bind_inputs``), the payload exactly its inputs' bytes, no
bytes output, inputs and outputs within the lane slot's part and within
``max_request_bytes``.  Everything else is relayed and main answers it, with
main's words.  A lane call the worker refuses because its lane serves
another version now (``lanes.VERSION_MOVED``), or whose outputs outgrew
their reservation, is relayed too (its inputs still lie in its part).

Must not: route by any rule of its own (``directory`` says), touch the
client's socket (``Call.answer`` does, through the connection), or block.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import numpy as np

from shmserve import layout, lanes, protocol
from shmserve.doors.directory import Directory, VersionView
from shmserve.doors.lanepool import DoorLane, LanePool
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import InferRequest, Kind
from shmserve.spec import bind_inputs, estimate_output_bytes

log = logging.getLogger("shmserve.doors.dispatcher")

_FIXED = frozenset(protocol.SUPPORTED_DTYPES) - {protocol.BYTES}


class Plan(NamedTuple):
    """How a carried request lies in a lane slot's part: input offsets from its base, then outputs."""

    view: VersionView
    offsets: tuple[int, ...]  # each input's offset from the part's base
    name_indices: tuple[int, ...]  # each input's index among the model's inputs
    out_offset: int  # from the part's base
    out_capacity: int


class Call:
    """One lane call: its connection's entry (``answer(parts)`` / ``relay()``), where it lies."""

    __slots__ = ("conn", "entry", "parsed", "plan", "lane", "slot", "generation", "deadline", "base", "sinks",
                 "arrays")

    def __init__(self, conn, entry, parsed: InferRequest, plan: Plan, lane: DoorLane, slot: int, deadline: float):
        self.conn, self.entry, self.parsed, self.plan, self.lane, self.slot = conn, entry, parsed, plan, lane, slot
        self.generation = -1  # submitted: the slot's generation
        self.deadline = deadline
        self.base = lane.base(slot)
        mem = lane.mem
        # the inputs as the lane describes them (``ClientLane.submit``), and their bytes for the payload
        self.arrays = [np.ndarray(t.shape, layout.numpy_dtype(t.dtype), buffer=mem, offset=self.base + o)
                       for o, t in zip(plan.offsets, parsed.inputs)]
        self.sinks = [a.reshape(-1).view(np.uint8) for a in self.arrays]


class LaneDispatcher:
    """The door's lane calls.  ``count(name, version, outcome)`` records each answer no worker
    counts (the error code's wire name, as main's ``Dispatcher.outcomes``; the door's report to
    main): a TIMEOUT; what a worker published, ok or an error, its own lane counters count (main
    reads them as it reads every lane's).  ``limits()`` returns (request_timeout_s,
    max_request_bytes) as main said."""

    def __init__(self, directory: Directory, pool: LanePool, count: Callable[[str, int, str], None],
                 limits: Callable[[], tuple[float, int]], clock: Callable[[], float] = time.monotonic):
        self.directory, self.pool, self.count, self.limits, self.clock = directory, pool, count, limits, clock
        self.calls: set[Call] = set()
        self.next_id = 1

    # -- lane or relay --------------------------------------------------------------------

    def carries(self, parsed: InferRequest, payload_bytes: int, kind: Kind = Kind.INFER) -> Plan | None:
        """How the door serves ``parsed`` itself, or None: relay it to main (see the module)."""
        if kind is not Kind.INFER or parsed.region is not None:
            return None
        view = self.directory.route(parsed.model, parsed.version, parsed.key)
        if view is None:
            return None
        spec = view.spec
        if any(t.dtype not in _FIXED for t in parsed.inputs) or any(t.dtype == protocol.BYTES for t in spec.outputs) \
                or len(parsed.inputs) + len(spec.outputs) > layout.MAX_TENSORS:
            return None
        try:
            symbols = bind_inputs(spec, parsed.inputs)
        except ShmserveError:
            return None  # main says what is wrong
        if payload_bytes != sum(t.nbytes for t in parsed.inputs):
            return None
        offsets, pos = [], 0
        for t in parsed.inputs:
            offsets.append(pos)
            pos += layout.align_tensor(t.nbytes)
        capacity = estimate_output_bytes(spec, symbols, view.max_output_bytes)
        _, max_request = self.limits()
        if pos + capacity > max_request:
            return None  # main answers TOO_LARGE
        names = [t.name for t in spec.inputs]
        return Plan(view, tuple(offsets), tuple(names.index(t.name) for t in parsed.inputs), pos, capacity)

    def begin(self, conn, entry, parsed: InferRequest, plan: Plan) -> Call | None:
        """A lane slot for ``parsed`` (its payload goes into ``call.sinks``), or None: no lane of
        its version can take it now (none yet, none routable, every slot busy, its part too
        small): relay it."""
        lane = self.pool.pick(plan.view)
        if lane is None or plan.out_offset + plan.out_capacity > lane.part:
            return None
        slot = lane.free_slot()
        if slot is None:
            return None
        timeout_limit, _ = self.limits()
        timeout = min(parsed.timeout_s or timeout_limit, timeout_limit)
        call = Call(conn, entry, parsed, plan, lane, slot, self.clock() + timeout)
        # Reserved while its payload arrives (other connections' calls begin meanwhile): out of the
        # lane's free list until ``submit`` hands it back to ``ClientLane.submit``, which takes it.
        lane.lane.free.remove(slot)
        lane.calls[slot] = call
        self.calls.add(call)
        return call

    def submit(self, call: Call) -> None:
        """``call``'s payload has arrived: publish it to the lane's worker.  A lane that cannot take
        it after all (overwritten, or a descriptor it cannot hold) relays it."""
        lane, plan = call.lane, call.plan
        inputs = [(i, call.base + o, a) for i, o, a in zip(plan.name_indices, plan.offsets, call.arrays)]
        request_id, self.next_id = self.next_id, self.next_id + 1
        lane.arm()  # before it is published: its worker rings the door's eventfd when it is done
        lane.lane.free.append(call.slot)  # the slot it reserved: the one ClientLane.submit takes next
        # Scheduled as main's requests are (``Dispatcher._publish``): the client's level (its worker
        # takes 0 or one above the model's levels as the default), the deadline on CLOCK_MONOTONIC, and
        # its connection as the caller (the worker takes turns between a door lane's connections).
        deadline_ns = time.monotonic_ns() + max(1, int((call.deadline - self.clock()) * 1e9))
        try:
            slot, call.generation = lane.lane.submit(request_id, plan.view.version, inputs,
                                                     call.base + plan.out_offset, plan.out_capacity,
                                                     priority=call.parsed.priority, deadline_ns=deadline_ns,
                                                     caller=1 + call.conn.cid % 0xFFFFFFFF,  # its connection
                                                     flags=layout.SLOT_FLAG_OWN_TIMEOUT
                                                     if call.parsed.timeout_s is not None else 0)
        except Exception as exc:  # noqa: BLE001 - a lane we cannot use: main serves the request
            log.warning("lane %d refused a call (%s); relaying it", lane.region, exc)
            self._forget(call)
            call.conn.relay_call(call, self._frame_of(call))
            return
        assert slot == call.slot

    def abandon(self, call: Call) -> str | None:
        """Its caller gave up (its connection is gone, a CANCEL) or its deadline passed: taken back
        if its worker has not claimed it (``ClientLane.abandon``: the slot is free at once), else
        the slot is recycled once the worker has finished with it.  Where it was, as main's
        ``dispatcher.CANCEL_STAGES``: "queued" (never runs) or "running"; None if not this door's."""
        if call not in self.calls:
            return None
        if call.generation >= 0:
            stage = "queued" if call.lane.lane.abandon(call.slot, call.generation) else "running"
        else:  # never submitted: the slot it reserved is free again
            call.lane.lane.free.append(call.slot)
            stage = "queued"
        self._forget(call)
        return stage

    # -- completions ------------------------------------------------------------------------

    def collect(self) -> int:
        """Answer every finished call; arm the lanes that still have calls, then look again (a
        completion published meanwhile); returns how many calls were answered."""
        done = self._collect_once()
        busy = [lane for lane in self.pool.all() if lane.calls]
        for lane in busy:
            lane.arm()
        if busy:
            done += self._collect_once()
        return done

    def _collect_once(self) -> int:
        done = 0
        for call in list(self.calls):
            if call.generation >= 0 and call.lane.lane.finished(call.slot, call.generation):
                self._finish(call)
                done += 1
        for lane in self.pool.all():
            lane.lane.completions.discard()
        return done

    def expire(self, now: float) -> None:
        """Answer TIMEOUT to every call past its deadline (its slot is abandoned)."""
        for call in list(self.calls):
            if call.generation >= 0 and now >= call.deadline and not call.lane.lane.finished(call.slot,
                                                                                             call.generation):
                self.abandon(call)
                self.count(call.plan.view.name, call.plan.view.version, ErrorCode.TIMEOUT.wire)
                call.conn.answer_call(call, [protocol.error_frame(
                    call.parsed.id, ErrorCode.TIMEOUT, f"no answer from model {call.parsed.model!r} within "
                                                       f"{call.deadline - call.conn.started_at(call):.3g} s")])

    def _finish(self, call: Call) -> None:
        lane, plan, parsed = call.lane, call.plan, call.parsed
        view = plan.view
        self._forget(call)
        try:
            placed = lane.lane.read(call.slot, call.generation, call.base + plan.out_offset, plan.out_capacity)
        except ShmserveError as exc:
            if lanes.version_moved(exc) or exc.code is ErrorCode.OUTPUT_TOO_LARGE:
                call.conn.relay_call(call, self._frame_of(call))  # its inputs are still in its part
                return
            call.conn.answer_call(call, [protocol.error_frame(parsed.id, exc.code, exc.message)])
            return
        buf, names = lane.buf, view.spec.outputs
        metas, data = [], []
        for index, (dtype, shape, offset) in sorted(placed.items()):
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            metas.append({"name": names[index].name, "dtype": layout.dtype_name(dtype), "shape": list(shape)})
            if nbytes:
                data.append(bytes(buf[offset:offset + nbytes]))  # the slot is free again: copied now
        total = sum(len(d) for d in data)
        call.conn.answer_call(call, [protocol.encode_frame(Kind.RESULT, {"id": parsed.id, "outputs": metas},
                                                           total), *data])

    def _frame_of(self, call: Call) -> bytes:
        """The INFER frame of ``call`` again, its payload read back from its part (to relay it)."""
        parsed = call.parsed
        meta = {"id": parsed.id, "model": parsed.model, "inputs": [t.to_wire() for t in parsed.inputs]}
        for field in ("timeout_s", "version", "key"):
            value = getattr(parsed, field)
            if value is not None:
                meta[field] = value
        if parsed.priority:
            meta["priority"] = parsed.priority
        payload = b"".join(bytes(s) for s in call.sinks)
        return protocol.encode_frame(Kind.INFER, meta, len(payload)) + payload

    def _forget(self, call: Call) -> None:
        self.calls.discard(call)
        if call.lane.calls.get(call.slot) is call:
            del call.lane.calls[call.slot]

    @property
    def in_flight(self) -> int:
        return len(self.calls)

