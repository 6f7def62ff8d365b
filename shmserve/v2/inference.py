"""A v2 infer request on its way: the inference half of ``V2Service``.

Owns: submitting a request to the dispatcher (``Inference.start``: its inputs checked in Triton's
words, its shared-memory regions taken, its place in its caller's count), the dispatcher ``Door``
of a v2 connection (``V2Door``: a request's input bytes copied in from the message, read in from a
registered region, on a thread when large, or received by the request's ``body`` straight from the
socket), each call until it ends exactly once (``InferCall``), and the result in the order asked
for (outputs written into regions, classification, Triton's binary rules).

Must not: check who asks (``V2Service.start`` does), parse HTTP or protobuf, touch a socket, or
block the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Callable

from shmserve import protocol
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.dispatcher import Answer, Dispatcher, Failure, Outputs, new_caller
from shmserve.frontend.models import ModelState, Models
from shmserve.frontend.requests import Request
from shmserve.v2 import classify
from shmserve.v2.catalog import Catalog, version_number
from shmserve.v2.messages import (DATATYPES, ITEMSIZE, V2_NAMES, Incoming, InferRequest, InferResult, OutputTensor,
                                  ShmRef, V2Error)
from shmserve.v2.sysshm import SystemShm
from shmserve.v2.wording import byte_size_mismatch, check_inputs, triton_unavailable, unexpected_output

if TYPE_CHECKING:
    from shmserve.v2.service import Caller, Ledger

log = logging.getLogger("shmserve.v2")


def v2_error(exc: ShmserveError) -> V2Error:
    """A shmserve refusal as a V2Error, code and message as they are."""
    return V2Error(exc.code, exc.message)


class V2Door:
    """The dispatcher's door for one v2 caller: its requests' inputs in, their answers out.

    A request's inputs come from three sources (its ``InferCall.sources``, one per input with
    bytes, in input order): bytes of the message (copied into the arena), a registered region
    (``(region, ref, what)``: read into it, on a thread when it is ``OFFLOAD_BYTES`` or more so
    the loop serves others meanwhile), or ``Incoming`` (received into it by the request's
    ``body``, straight from the socket; the request is published once all have landed).

    While a thread reads into a request's space (``copying``), nothing frees that space: a drop
    then waits for the read to end.

    A method of it that raises (``Door.abort``): the connection's own end first (``on_abort``,
    which the HTTP door sets: its transport aborted, its calls cancelled), then every call still
    pending is answered INTERNAL (a gRPC caller's: its replies hold no view of the arena)."""

    def __init__(self, service: "Inference"):
        self.service = service
        self.dispatcher = service.dispatcher
        self.pending: dict[Request, InferCall] = {}
        self.receiving: set[Request] = set()  # admitted; their Incoming bytes are being received
        self.copying: dict[Request, asyncio.Future] = {}  # a thread reads regions into their space
        self.dropped: set[Request] = set()  # dropped while copying: freed when the copy ends
        self.ids = itertools.count(1)
        self.on_abort: Callable[[Exception], None] | None = None  # the connection's end (HTTP)
        self.caller_key = new_caller()  # its requests' key for fairness between callers (Door.caller_key)

    def in_flight(self) -> int:
        return len(self.pending)

    def waiting(self, req: Request) -> None:
        pass

    def admitted(self, req: Request, sinks: list | None) -> None:
        call = self.pending.get(req)
        if call is None or sinks is None:
            return
        incoming, reads = [], []
        for sink, source in zip(sinks, call.sources):
            if isinstance(source, Incoming):
                incoming.append(sink)
            elif isinstance(source, tuple):
                reads.append((sink, source))
            else:
                sink[:] = source
        call.sources = ()
        if sum(len(sink) for sink, _ in reads) >= OFFLOAD_BYTES:
            copy = asyncio.get_running_loop().run_in_executor(None, _read_regions, reads)
            self.copying[req] = copy
            copy.add_done_callback(lambda f: self._copied(req, f, incoming))
            return
        try:
            _read_regions(reads)
        except Exception as exc:
            self._fail(req, _internal(exc, "reading a region"))
            return
        self._inputs_read(req, incoming)

    def _copied(self, req: Request, copy: asyncio.Future, incoming: list) -> None:
        del self.copying[req]
        if req in self.dropped:
            self.dropped.discard(req)
            self.dispatcher.drop(req)
            return
        exc = copy.exception()
        if exc is not None:
            self._fail(req, _internal(exc, "reading a region"))
        else:
            self._inputs_read(req, incoming)

    def _inputs_read(self, req: Request, incoming: list) -> None:
        """The message's and the regions' bytes are in: the socket's next, or publish."""
        if not incoming:
            self.dispatcher.received(req)
            return
        self.receiving.add(req)
        self.pending[req].request.body.fill(incoming, lambda: self._received(req))

    def _received(self, req: Request) -> None:
        if req in self.receiving:
            self.receiving.discard(req)
            self.dispatcher.received(req)

    def drop(self, req: Request) -> None:
        """Nobody is left to answer ``req``: free what it holds (once a read into it has ended)."""
        self._stop_receiving(req)
        if req in self.copying:
            self.dropped.add(req)
        else:
            self.dispatcher.drop(req)

    def _fail(self, req: Request, exc: V2Error) -> None:
        """Fail a request this door holds (its inputs could not be read) and free its space."""
        call = self.pending[req]
        self.drop(req)
        del self.pending[req]
        call.failed(exc)

    def _stop_receiving(self, req: Request) -> None:
        if req in self.receiving:
            self.receiving.discard(req)
            call = self.pending.get(req)
            if call is not None and call.request.body is not None:
                call.request.body.abort()

    def answer(self, req: Request, answer: Answer) -> None:
        if req in self.receiving:  # answered before its body was all in: no byte more lands in its space
            self._stop_receiving(req)
        call = self.pending.pop(req, None)
        if call is None:  # its caller gave up (cancelled) meanwhile
            if isinstance(answer, Outputs) and answer.in_arena:
                self.dispatcher.release(req)
            return
        call.answered(answer)

    def cancel(self, req: Request) -> None:
        """``req``'s caller gives up on it (its connection is gone, its RPC cancelled)."""
        if self.pending.pop(req, None) is not None:
            self.drop(req)

    def close(self) -> None:
        for call in list(self.pending.values()):
            call.cancel()
        self.receiving.clear()

    def abort(self, exc: Exception) -> None:
        """``Door.abort``: see the class docstring."""
        if self.on_abort is not None:
            self.on_abort(exc)
        for req in list(self.pending):
            if req in self.pending:
                self._fail(req, V2Error(ErrorCode.INTERNAL, f"internal server error ({type(exc).__name__}): "
                                                            f"see the server's log"))


class InferCall:
    """One v2 infer request on its way (``Inference.start``): what it holds until it ends (the
    regions its inputs and outputs name, its place in the uid's count) and whom to tell.  It ends
    exactly once: ``done(result, None)``, ``done(None, error)``, or ``cancel()`` (nobody is told).
    A region a thread still reads or writes for it stays held until the thread is done."""

    __slots__ = ("service", "caller", "request", "wanted", "req", "sources", "held", "outputs", "done", "ended",
                 "writing")

    def __init__(self, service: "Inference", caller: Caller, request: InferRequest, done):
        self.service, self.caller, self.request, self.done = service, caller, request, done
        self.wanted = self.req = self.writing = None
        self.sources: list | tuple = []
        self.held: list = []  # every region taken for it (given back once, when it ends)
        self.outputs: dict = {}  # output name -> the region it is written into
        self.ended = False

    def answered(self, answer: Answer) -> None:
        """The dispatcher's one answer (through the door)."""
        if isinstance(answer, Failure):
            self._end(None, V2Error(answer.code, answer.message))
            return
        service, req = self.service, self.req
        service.count_items(self)
        release = (lambda: service.dispatcher.release(req)) if answer.in_arena else None
        try:
            result, writes = service._result(self, answer)
        except Exception as exc:  # a region that cannot take an output, or our bug: its answer is an error
            if release is not None:
                release()
            self._end(None, _internal(exc, "writing the answer"))
            return
        result.releaser = release
        if not writes:
            self._end(result, None)
            return
        self.writing = asyncio.get_running_loop().run_in_executor(None, _write_regions, writes)  # large: a thread
        self.writing.add_done_callback(lambda job: self._written(result, job))

    def _written(self, result: InferResult, job: asyncio.Future) -> None:
        self.writing = None
        exc = job.exception()
        if exc is None and not self.ended:
            self._end(result, None)
            return
        result.release()
        if not self.ended:
            self._end(None, _internal(exc, "writing a region"))

    def failed(self, error: V2Error) -> None:
        """Its inputs could not be read (the door has freed its space)."""
        self._end(None, error)

    def _end(self, result: InferResult | None, error: V2Error | None) -> None:
        if self.ended:
            if result is not None:
                result.release()
            return
        self.let_go()
        self.done(result, error)

    def cancel(self) -> None:
        """Nobody waits for the answer any more: let go of everything."""
        if self.ended:
            return
        busy = self.writing
        if self.req is not None:
            door = self.caller.door
            door.cancel(self.req)
            busy = door.copying.get(self.req) or busy
        if busy is not None:  # a thread uses its regions: they stay registered until it ends
            held, self.held = self.held, []
            busy.add_done_callback(lambda job: self.service._give_back(held))
        self.let_go()

    def let_go(self) -> None:
        self.ended = True
        self.service._give_back(self.held)
        self.held = []
        self.service.ledger.give_request(self.caller.identity)


OFFLOAD_BYTES = 1 << 20  # a region copy this large runs on a thread (pread and pwrite let go of the GIL)


def _internal(exc: BaseException, doing: str) -> V2Error:
    """``exc`` as a request's error: a V2Error as it is; anything else is our fault, logged with its
    traceback and answered INTERNAL."""
    if isinstance(exc, V2Error):
        return exc
    log.error("v2: %s failed", doing, exc_info=exc)
    return V2Error(ErrorCode.INTERNAL, f"{doing} failed ({type(exc).__name__}): see the server's log")


def _read_regions(reads: list) -> None:
    for sink, (region, ref, what) in reads:
        SystemShm.read_into(region, ref, sink, what)


def _write_regions(writes: list) -> None:
    for region, ref, view, what in writes:
        SystemShm.write_from(region, ref, view, what)


class Inference:
    """Infer requests over the dispatcher (see the module).  ``ledger``: each caller's requests in
    flight (``V2Service.ledger``); ``catalog``: class labels."""

    def __init__(self, *, dispatcher: Dispatcher, models: Models, status, shm: SystemShm, ledger: "Ledger",
                 catalog: Catalog):
        self.dispatcher, self.models, self.status, self.shm = dispatcher, models, status, shm
        self.ledger, self.catalog = ledger, catalog

    def _refusal(self, exc: ShmserveError, request: InferRequest) -> V2Error:
        """The dispatcher's refusal of ``request`` as a V2Error: a model or version it cannot
        serve in Triton's words (``triton_unavailable``), anything else as it is."""
        if exc.code in (ErrorCode.UNKNOWN_MODEL, ErrorCode.MODEL_UNAVAILABLE):
            return triton_unavailable(self.models.get(request.model), request.model,
                                      version_number(request.model, request.version), exc)
        return v2_error(exc)

    def start(self, caller: Caller, request: InferRequest, done) -> InferCall:
        """(Its caller's right to infer checked by ``V2Service.start``.)  Serve one request through the dispatcher; ``done(result, None)`` or ``done(None,
        error)`` is called once it is answered (maybe before this returns), unless the returned
        call is cancelled first.  Inputs with ``shm`` are read from the caller's registered
        region, inputs whose data is ``Incoming`` are received by ``request.body``; outputs asked
        for with ``shm`` are written into one (their ``OutputTensor.data`` is then None).  Other
        outputs' data are views of the arena: the door calls ``result.release()`` once it has
        sent or copied them.

        Raises V2Error (the request is refused and holds nothing): every code the dispatcher
        refuses a request with, plus OVERLOADED (``max_inflight_per_uid``), BAD_INPUT (an
        unknown or duplicate input or output, data of the wrong size), BAD_DTYPE (an unknown
        datatype), BAD_SHAPE (a negative dimension), BAD_REGION (no such region for this caller,
        offset or size outside it), TOO_LARGE.  ``done``'s error: every code a request can fail
        with, plus BAD_REGION (an output larger than its region, a region shrunk under it)."""
        self.ledger.take_request(caller.identity)
        call = InferCall(self, caller, request, done)
        try:
            self._submit(call)
        except BaseException:
            call.let_go()
            raise
        return call

    def _submit(self, call: InferCall) -> None:
        caller, request = call.caller, call.request
        door = caller.door
        known = self._known(request)
        if known is not None:
            check_inputs(request, known)
        metas = _input_metas(request)
        for t, meta in zip(request.inputs, metas):
            what = f"input {t.name!r}"
            nbytes = meta.nbytes
            if t.shm is not None:
                if t.shm.byte_size != nbytes:  # Triton reads exactly the tensor's bytes, never a prefix
                    raise byte_size_mismatch(request, t.name, nbytes, t.shm.byte_size)
                region = self.shm.take(caller.key, t.shm, nbytes, what)
                call.held.append(region)
                if nbytes:
                    call.sources.append((region, t.shm, what))
            else:
                if t.data is None or len(t.data) != nbytes:
                    raise byte_size_mismatch(request, t.name, nbytes, 0 if t.data is None else len(t.data))
                if isinstance(t.data, Incoming) and request.body is None:
                    raise V2Error(ErrorCode.INTERNAL, f"{what}: its bytes have no receiver")
                if nbytes:
                    call.sources.append(t.data)
        call.wanted = self._wanted(request)
        for o in call.wanted or ():
            if o.shm is not None:
                call.outputs[o.name] = region = self.shm.take(caller.key, o.shm, 0, f"output {o.name!r}")
                call.held.append(region)
        parsed = protocol.InferRequest(next(door.ids), request.model, metas, request.timeout_s,
                                       version=version_number(request.model, request.version), key=request.key,
                                       priority=request.priority)
        try:
            call.req = self.dispatcher.submit(door, parsed, payload_bytes=sum(m.nbytes for m in metas))
        except ShmserveError as exc:
            raise self._refusal(exc, request) from None
        door.pending[call.req] = call
        self.dispatcher.admit(call.req)

    def count_items(self, call: InferCall) -> None:
        """Count the batch items of ``call``, answered ok, beyond its one request (Triton's
        ``inference_count`` counts a request of batch 4 as 4): its first input's first dimension
        when its version's ``max_batch_size`` > 0."""
        version = call.req.model
        shape = call.request.inputs[0].shape if call.request.inputs else ()
        if version.config.max_batch_size > 0 and shape and shape[0] > 1:
            self.status.batch_items[(version.name, version.version)] += shape[0] - 1

    def _give_back(self, regions: list) -> None:
        for region in regions:
            self.shm.give_back(region)

    def _wanted(self, request: InferRequest):
        if request.outputs is None:
            return None
        names = set()
        for o in request.outputs:
            if o.name in names:
                raise V2Error(ErrorCode.BAD_INPUT, f"output '{o.name}' already exists in request", "INVALID_ARG")
            names.add(o.name)
        v = self._known(request)
        if v is not None:
            known = {t.name for t in v.spec.outputs}
            for o in request.outputs:
                if o.name not in known:
                    raise unexpected_output(request.model, o.name)
        return request.outputs

    def _known(self, request: InferRequest) -> ModelState | None:
        """The version whose spec a request is checked against in Triton's words before the
        dispatcher sees it: the version it names, else the model's default; None when that is
        not known yet (never loaded: the dispatcher checks it once it is) or does not exist (the
        dispatcher refuses it: ``_refusal``)."""
        model = self.models.get(request.model)
        if model is None:
            return None
        try:
            number = version_number(request.model, request.version)
        except V2Error:
            return None
        v = model.versions.get(number if number is not None else model.default)
        return v if v is not None and v.spec is not None else None

    def _result(self, call: InferCall, answer: Outputs) -> tuple[InferResult, list]:
        """The result of ``answer`` in the order asked for, and the region writes of its
        shared-memory outputs still to make (done here when small; large ones are left for a
        thread: ``(region, ref, view, what)``)."""
        request, wanted = call.request, call.wanted
        by_name = {o.name: o for o in answer.outputs}
        order = [(o.name, o) for o in wanted] if wanted is not None else [(o.name, None) for o in answer.outputs]
        out, writes = [], []
        for name, asked in order:
            o = by_name.get(name)
            if o is None:
                raise unexpected_output(request.model, name)
            datatype = V2_NAMES.get(o.dtype, o.dtype.upper())
            if asked is not None and asked.shm is not None:
                what = f"output {name!r}"
                SystemShm.fits(asked.shm, o.nbytes, what)
                region = call.outputs[name]  # held by the call since it was submitted
                if o.nbytes >= OFFLOAD_BYTES:
                    writes.append((region, asked.shm, o.view, what))
                elif o.nbytes:
                    SystemShm.write_from(region, asked.shm, o.view, what)
                out.append(OutputTensor(name, datatype, tuple(o.shape), None,
                                        ShmRef(asked.shm.region, o.nbytes, asked.shm.offset), asked.binary))
            elif asked is not None and asked.classification:
                version = call.req.model
                shape, data = classify.top_k(datatype, tuple(o.shape), o.view, asked.classification,
                                             version.config.max_batch_size > 0, self.catalog.labels_of(version),
                                             f"output {name!r}")
                out.append(OutputTensor(name, "BYTES", shape, data, None, bool(asked.binary)))
            else:
                # As Triton's server: an output the request lists is binary only if its own
                # binary_data says so; binary_data_output is the form of those it does not list.
                out.append(OutputTensor(name, datatype, tuple(o.shape), o.view if o.nbytes else b"",
                                        None, bool(asked.binary) if asked is not None else None))
        return InferResult(request.model, str(call.req.model.version), request.id, out), writes


def _input_metas(request: InferRequest) -> tuple[protocol.TensorMeta, ...]:
    """The dispatcher's descriptions of a request's inputs, checked by the native protocol's own
    rules (names, counts, ranks, dimension sizes; one owner of them).  V2Error BAD_INPUT,
    BAD_DTYPE, BAD_SHAPE, BAD_FRAME (timeout, model name)."""
    items = []
    for t in request.inputs:
        dtype = DATATYPES.get(t.datatype)
        if dtype is None:
            raise V2Error(ErrorCode.BAD_DTYPE, f"input {str(t.name)[:64]!r}: unknown datatype "
                                               f"{str(t.datatype)[:20]!r} (one of {', '.join(DATATYPES)})")
        item = {"name": t.name, "dtype": dtype, "shape": list(t.shape)}
        if dtype not in FIXED_DTYPES:  # BYTES: its size is its data's
            item["nbytes"] = t.shm.byte_size if t.shm is not None else len(t.data or b"")
        items.append(item)
    timeout = request.timeout_s
    try:
        protocol.parse_name(request.model, "the model name")
        if timeout is not None and not (type(timeout) in (int, float) and 0 < timeout <= protocol.MAX_TIMEOUT_S):
            raise protocol.ProtocolViolation(ErrorCode.BAD_FRAME, f"the timeout must be in (0, "
                                                                  f"{protocol.MAX_TIMEOUT_S}] seconds")
        return protocol.parse_tensor_list(items, "inputs", with_offset=False)
    except protocol.ProtocolViolation as exc:
        raise V2Error(exc.code, exc.message) from None


FIXED_DTYPES = frozenset(dtype for datatype, dtype in DATATYPES.items() if datatype in ITEMSIZE)
