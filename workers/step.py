"""One request on a worker: claim it, hand the backend its inputs, place its outputs, publish the answer.

Owns: the slot tables a worker serves (``Space``: the arena's, or a lane's),
and the request step (``Step``): claim a READY slot (READY -> RUNNING),
decode and validate its inputs into numpy views (a bytes input unpacked into
an object array, its elements checked), lay its outputs out in its output
area (``OutputPlacer``; a bytes output serialized; outputs that outgrow the area: the short answer
of ``shmserve.reservations``, counted in ``short_answers``), run the backend, publish DONE or ERROR, count
it, push the completion and ring whoever waits, and add its stage times to
the worker's latency histograms; and the count of requests that brought an
input signature the worker had not met (``new_signatures``, for ``shmserve
doctor``: from the signature a lane's decode checks anyway, and the arena's
requests' shapes).

Each request's own work on the slot's bytes (claim, a lane slot's decode, the
output descriptors, publish) is ``shmserve.hotpath``'s: compiled by default,
the Python reference with ``SHMSERVE_HOTPATH=python``; this module does what
lies around it (numpy views, the backend, the spec check, the output area).

Nothing read from a slot is trusted: every descriptor is decoded through
``shmserve.layout`` against the bounds of the space it names, and a lane's
(its client wrote every byte of it) must also lie in the lane's own region
at ``lanes.DATA_FLOOR`` or above.  A request that cannot run fails alone with
a stable code (``RequestFailed``); the worker goes on serving.

Must not: decide what runs together (``workers.batching``), wait on rings or
carry out commands (``workers.worker``), ask a backend what it can do
(``workers.adapter`` did, once), allocate arena space, or free slots.
"""

from __future__ import annotations

import math
import time

import numpy as np

from shmserve import hotpath, lanes, layout, reservations
from shmserve._atomics import fetch_add64
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import TensorMeta
from shmserve.rings import Ring
from shmserve.spec import ModelSpec, bind_inputs

LANE_SIGNATURES_MAX = 1024  # input signatures of lane requests remembered as valid (then forgotten at once);
# the arena's requests' signatures are remembered as many (for doctor's count of new ones)

_BYTES = layout.BYTES_DTYPE
_LANE_FUTEX = hotpath.LANE_FUTEX
_put_u64 = layout.U64.pack_into  # a stage time (layout.stamp's encoding), where run() stamps two a request
_T_COMPUTE_START, _T_COMPUTE_END = layout.SLOT.offset("t_compute_start"), layout.SLOT.offset("t_compute_end")
_HOT = hotpath.active  # claim, decode_lane, encode_outputs, publish: compiled, or the reference


class RequestFailed(Exception):
    """This request fails with ``code`` (an ErrorCode) and ``message``; the worker serves on."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def model_failure(exc: Exception) -> tuple[ErrorCode, str]:
    """(code, message) for an exception raised while the backend ran: its own if it is a
    RequestFailed (the worker's checks on what the backend produced), else MODEL_ERROR."""
    if isinstance(exc, RequestFailed):
        return exc.code, exc.message
    return ErrorCode.MODEL_ERROR, f"{type(exc).__name__}: {exc}"


def worker_failure(exc: Exception) -> tuple[ErrorCode, str]:
    """(code, message) for an exception raised by the step itself: a bug here fails one request
    (INTERNAL), not the worker."""
    if isinstance(exc, RequestFailed):
        return exc.code, exc.message
    return ErrorCode.INTERNAL, f"worker: {type(exc).__name__}: {exc}"


class Space:
    """A slot table this worker serves: the arena's, or a lane's (a client region's own queue).

    ``buf``/``geometry`` hold the slots and ``submissions``/``completions`` their rings;
    ``outbox`` wakes whoever collects completions (the front-end's eventfd, or the lane
    client's futex).  A lane's tensors may only lie in its own region (``region``), above its
    queue (``data_floor``): the client wrote every byte of it and is trusted with none.
    """

    __slots__ = ("buf", "geometry", "submissions", "completions", "outbox", "region", "data_floor", "is_lane",
                 "wake")

    def __init__(self, buf, geometry, submissions: Ring, completions: Ring, outbox, *, region: int = 0,
                 data_floor: int = 0, eventfd: bool = False):
        """``eventfd``: a door process's lane (``outbox`` rings its eventfd), not a client's futex."""
        self.buf, self.geometry = buf, geometry
        self.submissions, self.completions, self.outbox = submissions, completions, outbox
        self.region, self.data_floor = region, data_floor
        self.is_lane = region != 0
        # who wakes the collector (hotpath.publish's ``lane``): publish itself only for a client's futex
        self.wake = hotpath.ARENA if not self.is_lane else hotpath.LANE_EVENTFD if eventfd else hotpath.LANE_FUTEX

    def outside(self, what: str) -> RequestFailed:
        """The error for a lane tensor (``what``) outside the lane's own data space."""
        return RequestFailed(ErrorCode.BAD_REGION, hotpath.outside_message(self.region, self.data_floor, what))


class OutputPlacer:
    """Lays a request's outputs out in its output area, 64-byte aligned, in the order they come,
    and writes their descriptors once the backend is done (after its stream is synchronized).

    Outputs that outgrow the area are not an error while the model runs: each one that does not
    fit gets a throwaway array, the layout goes on counting, and ``finish`` answers the short
    answer (``shmserve.reservations``: OUTPUT_TOO_LARGE saying how many bytes they need), so
    the call can be run again once with exactly that much."""

    __slots__ = ("step", "space", "index", "first", "region", "base", "capacity", "target", "pos", "placed",
                 "scratch")

    def __init__(self, step: "Step", space: Space, index: int, first_tensor: int, region: int, base: int,
                 capacity: int, target):
        self.step, self.space, self.index, self.first = step, space, index, first_tensor
        self.region, self.base, self.capacity, self.target = region, base, capacity, target
        self.pos = 0
        self.placed: dict[str, tuple[int, tuple, np.dtype, int]] = {}  # name -> (offset, shape, dtype, nbytes)
        self.scratch: list[np.ndarray] | None = None  # outputs that outgrew the area: kept until finish (a GPU
        # may write them)

    def allocate(self, name: str, shape, dtype) -> np.ndarray:
        """A writable view of the output area for output ``name``.

        RequestFailed: MODEL_ERROR for an undeclared output, a dtype other than
        the declared one, a bytes output (its size is known only once it is
        made: ``put`` it), or an output produced twice; OUTPUT_TOO_LARGE if it
        is larger than the model's ``max_output_bytes``.  An output that does not
        fit in what is left of the area gets a throwaway array (``finish`` says so).
        """
        declared = self._declared(name)
        dtype = np.dtype(dtype)
        if dtype != declared:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"output {name!r} is {layout.dtype_name(dtype)}, "
                                                       f"declared {layout.dtype_name(declared)}")
        if dtype is _BYTES:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"output {name!r} is bytes: a backend returns it from run() "
                                                       f"(its size is known only once it is made)")
        shape = tuple(int(d) for d in shape)
        nbytes = dtype.itemsize * math.prod(shape)
        offset = self._reserve(name, nbytes)
        self.placed[name] = (offset, shape, dtype, nbytes)
        if offset < 0:  # outgrew the area: finish() gives the short answer
            scratch = np.empty(shape, dtype)
            self.scratch = (self.scratch or []) + [scratch]
            return scratch
        return np.ndarray(shape, dtype, buffer=self.target, offset=offset)

    def put(self, name: str, value) -> None:
        """Copy the model's output ``value`` (an array, or what numpy makes one of) into the output
        area: a fixed-size output as it is (its dtype must be the declared one, no casting), a
        bytes output serialized (``layout.encode_bytes``: elements bytes, or str taken as UTF-8).
        RequestFailed as ``allocate``; MODEL_ERROR for a bytes output with another element."""
        if self.step.output_dtypes.get(name) is not _BYTES:
            arr = np.asarray(value)
            np.copyto(self.allocate(name, arr.shape, arr.dtype), arr, casting="no")
            return
        self._declared(name)
        arr = np.asarray(value, dtype=object)
        try:
            data = layout.encode_bytes(arr)
        except layout.LayoutError as exc:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"output {name!r}: {exc}") from None
        offset = self._reserve(name, len(data))
        if offset >= 0:
            self.target[offset:offset + len(data)] = data
        self.placed[name] = (offset, arr.shape, _BYTES, len(data))

    def _declared(self, name: str) -> np.dtype:
        """The declared dtype of output ``name``; RequestFailed(MODEL_ERROR) if it is not one, or is
        placed already."""
        declared = self.step.output_dtypes.get(name)
        if declared is None:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"model produced an undeclared output {name!r}")
        if name in self.placed:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"output {name!r} produced twice")
        return declared

    def _reserve(self, name: str, nbytes: int) -> int:
        """The offset of ``nbytes`` for output ``name``, next in the area, or -1 if they do not fit
        there (counted on: ``finish`` answers short).  OUTPUT_TOO_LARGE if they are more than the
        model's ``max_output_bytes`` (a limit: never run again)."""
        limit = self.step.max_output_bytes
        if limit and nbytes > limit:
            raise RequestFailed(ErrorCode.OUTPUT_TOO_LARGE,
                                f"output {name!r} is {nbytes} bytes, more than the model's max_output_bytes "
                                f"({limit}): raise it in the model's config, or set 0 (no limit of its own)")
        pos = layout.align_tensor(self.pos)
        self.pos = pos + nbytes
        return self.base + pos if pos + nbytes <= self.capacity else -1

    def finish(self) -> int:
        """Write the output descriptors (the backend's writes have landed); how many.
        RequestFailed: MODEL_ERROR if an output was not produced; OUTPUT_TOO_LARGE, the short
        answer (``reservations.short_message``), if the outputs outgrew the area."""
        outputs, placed = self.step.spec.outputs, self.placed
        if len(placed) != len(outputs):
            missing = [t.name for t in outputs if t.name not in placed]
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"model did not return outputs {missing}")
        if self.pos > self.capacity:
            self.step.short_answers += 1
            raise RequestFailed(ErrorCode.OUTPUT_TOO_LARGE, reservations.short_message(self.pos, self.capacity))
        _HOT.encode_outputs(self.space.buf, self.space.geometry, self.index, self.first, self.region,
                            [placed[t.name] for t in outputs])
        return len(outputs)


def _bytes_input(source, desc: layout.TensorDesc, name: str) -> np.ndarray:
    """A bytes input as the model gets it; RequestFailed(BAD_INPUT) if its serialized elements do
    not take exactly its nbytes (the client wrote them)."""
    try:
        return layout.decode_bytes(source, desc.shape, desc.offset, desc.nbytes)
    except layout.LayoutError as exc:
        raise RequestFailed(ErrorCode.BAD_INPUT, f"bytes input {name!r}: {exc}") from None


class Step:
    """Runs requests of one model on this worker (worker ``index`` of ``arena``), one at a time.

    ``serve(space, entry)`` is the whole life of one request; ``claim``,
    ``decode``, ``place``, ``finish`` and ``record_batch`` are its parts, which
    ``workers.batching`` composes for a batch.  ``regions`` maps the client
    regions tensors lie in; ``adapter`` is the loaded backend
    (``workers.adapter.BackendAdapter``); ``spec`` its final specs.
    """

    def __init__(self, arena, index: int, regions, adapter, spec: ModelSpec, version: int = 0,
                 max_output_bytes: int = 0):
        self.arena_buf, self.geometry, self.index = arena.buf, arena.geometry, index
        self.max_output_bytes = max_output_bytes  # the most one output may take (0: no limit of its own)
        self.short_answers = 0  # runs whose outputs outgrew their area (each is run again once: reservations)
        self.version = version  # the model version served: a lane call naming another is refused
        self.regions, self.adapter, self.spec = regions, adapter, spec
        self.input_names = tuple(t.name for t in spec.inputs)
        self.output_dtypes = {t.name: layout.numpy_dtype(t.dtype) for t in spec.outputs}
        self._outputs = tuple(t.name for t in spec.outputs)
        entry_off = arena.geometry.worker_off(index)
        self._requests_off = entry_off + layout.WORKER.offset("requests")
        self._errors_off = entry_off + layout.WORKER.offset("errors")
        self._hist_off = arena.geometry.hist_off(index, layout.HIST_STAGES[0])
        # a run of one request in the batch-size histogram (serve_claimed: every unbatched request)
        self._one_run, self._one_run_sum = layout.sample_offsets(arena.geometry, index, "batch_size", 1)
        self._uncounted = bytearray(64 + layout.HIST_WORKER_SIZE)  # where a short answer's counts go (finish)
        # Hot path: what the adapter states, bound once.
        self._run_into, self._run, self._sync = adapter.run_into, adapter.run, adapter.synchronize
        self._checked_lane_inputs: set[tuple] = set()  # input signatures bind_inputs accepted
        # For `shmserve doctor` (service.shapes): requests whose input signature this worker had not met
        # (or had forgotten, past LANE_SIGNATURES_MAX of a kind), and the arena requests' signatures met.
        self.new_signatures = 0
        self._arena_signatures: set[tuple] = set()

    # -- one request, whole -------------------------------------------------------------------

    def serve(self, space: Space, entry: int) -> None:
        """Claim, run and answer the request of ring ``entry`` (nothing if it is not ours to run)."""
        index = self.claim(space, entry)
        if index is not None:
            self.serve_claimed(space, entry, index)

    def serve_claimed(self, space: Space, entry: int, index: int) -> None:
        """Run and answer the claimed request in slot ``index`` (of ring ``entry``) alone."""
        try:
            n_outputs, failure = self.run(space, index), None
        except Exception as exc:  # a bug here must fail one request, not kill the worker
            n_outputs, failure = 0, worker_failure(exc)
        self.finish(space, entry, index, n_outputs, failure)
        fetch_add64(self.arena_buf, self._one_run, 1)  # record_batch(1), its offsets bound once
        fetch_add64(self.arena_buf, self._one_run_sum, 1)

    def run(self, space: Space, index: int) -> int:
        """Run the claimed slot ``index``: its outputs placed and described; how many.  RequestFailed
        if it cannot run (its inputs or output area are bad, or the model failed)."""
        slot, inputs = self.decode(space, index)
        placer = self.place(space, index, slot)
        buf, slot_off = space.buf, space.geometry.slot_off(index)
        _put_u64(buf, slot_off + _T_COMPUTE_START, time.monotonic_ns())  # layout.stamp, inline
        try:
            if self._run_into is not None:  # writes outputs itself (GPU: straight into shared memory)
                self._run_into(inputs, placer.allocate)
            else:
                results = self._run(inputs)
                for name in self._outputs:
                    if name not in results:
                        raise RequestFailed(ErrorCode.MODEL_ERROR, f"model did not return output {name!r}")
                    placer.put(name, results[name])
                del results
        except Exception as exc:  # the model's failure is this request's error, not the worker's
            self.settle()
            raise RequestFailed(*model_failure(exc)) from None
        finally:
            del inputs
        _put_u64(buf, slot_off + _T_COMPUTE_END, time.monotonic_ns())
        self._sync()  # a GPU backend's writes must land before the descriptors and DONE
        return placer.finish()

    def settle(self) -> None:
        """After a failed run: wait for whatever the backend still has in flight (a GPU stream may
        be writing into the output area), so nothing lands after ERROR is published."""
        try:
            self._sync()
        except Exception:  # the request fails anyway; its own error is the one to report
            pass

    # -- its parts ----------------------------------------------------------------------------

    def claim(self, space: Space, entry: int) -> int | None:
        """READY -> RUNNING for a ring entry; the slot index, or None if it is not ours to run
        (a hostile or corrupt entry; failed or reused meanwhile: timeout, shutdown, a lane
        client's second thoughts)."""
        return _HOT.claim(space.buf, space.geometry, entry)

    def regions_of(self, space: Space, entry: int) -> set[int]:
        """The client regions the request of ring ``entry`` (not yet run) names: a lane's own, or
        those an arena slot's descriptors name (the front-end wrote them); empty for a bad entry."""
        if space.is_lane:
            return {space.region}
        index, _ = layout.split_entry(entry)
        if not 0 <= index < space.geometry.slot_count:
            return set()
        try:
            slot = layout.decode_slot_request(space.buf, space.geometry, index)
            found = {layout.region_of_tensor(space.buf, space.geometry, index, t)
                     for t in range(min(slot.n_inputs, layout.MAX_TENSORS))}
        except layout.LayoutError:
            return set()
        found.add(slot.out_region)
        found.discard(0)
        return found

    def decode(self, space: Space, index: int):
        """The slot's request record and read-only numpy views of its inputs by name (a bytes
        input: a new object array of ``bytes``).

        RequestFailed: BAD_REGION for a descriptor out of bounds (or, in a lane,
        outside its data space); INTERNAL for a malformed arena slot (the
        front-end wrote it) and BAD_INPUT for a malformed lane slot or a bytes
        input whose elements do not take exactly its size; whatever
        ``bind_inputs`` says of a lane's inputs that do not fit the model.
        """
        if space.is_lane:
            return self._decode_lane(space, index)
        g, buf, names = space.geometry, space.buf, self.input_names
        slot = layout.decode_slot_request(buf, g, index)
        n_inputs = slot.n_inputs
        if not 0 < n_inputs <= len(names) or n_inputs >= layout.MAX_TENSORS:
            raise RequestFailed(ErrorCode.INTERNAL, f"slot has {n_inputs} inputs")
        regions = self.regions
        maps, sizes = regions.maps, regions.sizes
        inputs = {}
        signature = []
        try:
            for t in range(n_inputs):
                region = layout.region_of_tensor(buf, g, index, t)
                if region:
                    regions.ensure(region)
                desc = layout.decode_tensor(buf, g, index, t, sizes)
                if desc.role != layout.ROLE_INPUT or desc.name_index >= len(names):
                    raise RequestFailed(ErrorCode.INTERNAL, f"tensor {t} is not an input of this model")
                source = maps[region] if region else self.arena_buf
                if desc.dtype is _BYTES:
                    view = _bytes_input(source, desc, names[desc.name_index])
                else:
                    view = np.ndarray(desc.shape, desc.dtype, buffer=source, offset=desc.offset)
                view.flags.writeable = False
                inputs[names[desc.name_index]] = view
                signature.append((desc.name_index, desc.dtype, desc.shape))
        except layout.LayoutError as exc:
            raise RequestFailed(ErrorCode.BAD_REGION, f"input descriptor rejected: {exc}") from None
        signature = tuple(signature)
        if signature not in self._arena_signatures:
            if len(self._arena_signatures) >= LANE_SIGNATURES_MAX:
                self._arena_signatures.clear()
            self._arena_signatures.add(signature)
            self.new_signatures += 1
        return slot, inputs

    def _decode_lane(self, space: Space, index: int):
        """``decode`` for a lane slot: its descriptors checked by ``hotpath.decode_lane``, then the
        views made in order (a bytes input decoded) and the inputs checked against the spec once per
        signature (the front-end checked the arena's requests; nobody checked a lane's)."""
        names, source = self.input_names, space.buf
        slot, descs, signature, failure = _HOT.decode_lane(space.buf, index, space.region, space.data_floor,
                                                           len(names))
        inputs = {}
        for name_index, dtype, shape, offset, nbytes in descs:
            name = names[name_index]
            if dtype is _BYTES:
                view = _bytes_input(source, layout.TensorDesc(layout.ROLE_INPUT, name_index, dtype, shape, offset,
                                                              nbytes, space.region), name)
            else:
                view = np.ndarray(shape, dtype, buffer=source, offset=offset)
            view.flags.writeable = False
            inputs[name] = view
        if failure is not None:
            raise RequestFailed(*failure)
        if slot.model_id and slot.model_id != self.version:  # its client planned it from another version's spec
            raise RequestFailed(ErrorCode.MODEL_UNAVAILABLE, f"{lanes.VERSION_MOVED} {self.version} of the model "
                                                             f"now, not version {slot.model_id}: ask for its spec again")
        if signature not in self._checked_lane_inputs:
            try:
                bind_inputs(self.spec, [TensorMeta(n, layout.dtype_name(v.dtype), v.shape) for n, v in inputs.items()])
            except ShmserveError as exc:
                raise RequestFailed(exc.code, exc.message) from None
            if len(self._checked_lane_inputs) >= LANE_SIGNATURES_MAX:
                self._checked_lane_inputs.clear()
            self._checked_lane_inputs.add(signature)
            self.new_signatures += 1
        return slot, inputs

    @property
    def distinct_signatures(self) -> int:
        """Input signatures this worker remembers having met (lane and arena requests apart)."""
        return len(self._checked_lane_inputs) + len(self._arena_signatures)

    def place(self, space: Space, index: int, slot) -> OutputPlacer:
        """An OutputPlacer for the slot's output area, after checking the area.

        RequestFailed: BAD_REGION if it lies outside its region (or a lane's
        data space) or the region does not exist; INTERNAL if an arena slot's
        area lies outside the data region or there are too many tensors.
        """
        region, base, capacity = slot.out_region, slot.out_off, slot.out_capacity
        if space.is_lane and (region != space.region or base < space.data_floor):
            raise space.outside("the output area")
        if region:
            self.regions.ensure(region)
            if base + capacity > self.regions.sizes[region]:
                raise RequestFailed(ErrorCode.BAD_REGION, "output area lies outside the region")
        elif not space.geometry.contains_data(base, capacity):
            raise RequestFailed(ErrorCode.INTERNAL, "output area lies outside the data region")
        if slot.n_inputs + len(self._outputs) > layout.MAX_TENSORS:
            raise RequestFailed(ErrorCode.INTERNAL, "too many tensors for one slot")
        return OutputPlacer(self, space, index, slot.n_inputs, region, base, capacity,
                            self.regions.maps[region] if region else self.arena_buf)

    def finish(self, space: Space, entry: int, index: int, n_outputs: int,
               failure: tuple[ErrorCode, str] | None = None) -> None:
        """Publish DONE (``n_outputs`` described) or ERROR (``failure``: code and message), count it,
        add its stage times to the histograms (not a short answer's: its call's second run is
        counted), and hand the slot back through the completion ring.
        A lane slot its client rewrote meanwhile is left alone; an arena slot raises SlotConflict."""
        if failure is not None and reservations.needed(*failure) is not None:
            # A short answer: its call runs again, and that run is the one the worker's counters and
            # histograms count (a run whose outputs were thrown away is neither an answer nor an error).
            published = _HOT.publish(space.buf, space.geometry, index, entry, 0, failure, space.completions,
                                     space.wake, self._uncounted, 0, 8, 64)
        else:
            published = _HOT.publish(space.buf, space.geometry, index, entry, n_outputs, failure, space.completions,
                                     space.wake, self.arena_buf, self._requests_off, self._errors_off,
                                     self._hist_off)
        if published and space.wake != _LANE_FUTEX:
            space.outbox.notify()  # an arena slot's front-end, or a door's lane (its eventfd); a client's lane
                                   # was woken by publish (its futex doorbell)

    def record_batch(self, size: int) -> None:
        """Count one backend run of ``size`` requests in the batch-size histogram."""
        layout.record_sample(self.arena_buf, self.geometry, self.index, "batch_size", size)
