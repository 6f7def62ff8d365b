"""Where a call's tensors go, decided from the model's spec: pure functions and plans, no I/O.

Owns: a model's route as the server lists it (``route_of``), a zero-copy
call's place (``ZeroCopyPlan``: which region, of what size, with or without
a lane — of which version —, and what to ask for after the server refuses one),
how a zero-copy call names its tensors to a lane worker of one version
(``call_plan``: planned again, and checked as that version's workers will
check it, after a swap), how an ``infer`` call of one input signature goes
through a lane (``lane_form``), output capacities from a spec
(``estimate``), and reading the server's listing and limits (``spec_of``,
``version_of``, ``region_limit``).

Must not: talk to the server or wait (``ZeroCopyPlan`` says what to ask; the
core asks), or touch a region's bytes beyond placing views in it.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np

from shmserve import layout, protocol
from shmserve.client.memory import Region
from shmserve.errors import BadArgument, ErrorCode, ShmserveError
from shmserve.reservations import guess_bytes
from shmserve.protocol import TensorMeta
from shmserve.routing import Route
from shmserve.session import check_tensor
from shmserve.spec import ModelSpec, bind_inputs, estimate_output_bytes, output_shapes

DEFAULT_REGION_BYTES = 64 * 1024 * 1024
DEFAULT_OUTPUT_CAPACITY = 16 * 1024 * 1024
SPEC_RETRIES = 3  # a zero-copy lane call refused for its version: planned again from a fresh spec this often
LANE_FORMS_MAX = 256  # signatures remembered per client (then forgotten at once)


# -- the server's listing and limits --------------------------------------------------------

def region_limit(info: dict) -> int:
    """The largest region a server makes, from its ``info`` (its max_request_bytes + slack)."""
    limit = info.get("max_request_bytes")
    if type(limit) is not int or limit <= 0:
        raise ShmserveError(ErrorCode.INTERNAL, f"the server's info has no usable max_request_bytes: {limit!r}")
    return limit + protocol.REGION_SLACK


def version_of(spec: ModelSpec | None) -> int:
    """The version the server listed ``spec`` for (0: not said): a lane call names it, and a worker
    of another version refuses the call (MODEL_UNAVAILABLE) instead of reading it by the wrong spec."""
    version = spec.extra.get("version") if spec is not None else None
    return version if type(version) is int and 0 < version < 2**32 else 0


def route_of(listing: list[dict], model: str) -> tuple[Route, ModelSpec | None]:
    """The route the server lists for ``model`` (``routing.Route``; epoch 0 and no split if it
    lists none) and its split canary's candidate's spec (None without one).  INTERNAL if either is
    unreadable."""
    entry = next((m for m in listing if m["name"] == model), None)
    d = entry.get("route") if entry is not None else None
    if d is None:
        return Route(0), None
    try:
        route = Route.from_dict(d)
        spec = d.get("candidate_spec")
        candidate = ModelSpec.from_dict(spec) if route.candidate is not None and spec is not None else None
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ShmserveError(ErrorCode.INTERNAL, f"the server's route of {model!r} is unreadable: {exc!r}") from None
    if candidate is None or version_of(candidate) != route.candidate:
        return Route(route.epoch), None  # (no spec of the candidate: the default takes every call)
    return route, candidate


def spec_of(listing: list[dict], model: str) -> ModelSpec | None:
    """The spec the server lists for ``model`` (None: not listed, or listed without inputs)."""
    entry = next((m for m in listing if m["name"] == model and m.get("inputs")), None)
    if entry is None:
        return None
    try:
        return ModelSpec.from_dict(entry)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ShmserveError(ErrorCode.INTERNAL, f"the server's listing of {model!r} is unreadable: {exc!r}") from None


# -- sizes ----------------------------------------------------------------------------------

def needed_bytes(sizes: dict, output_capacity: int) -> int:
    """The least region space one call needs: its inputs and its output area."""
    return sum(layout.tensor_span(s) for s in sizes.values()) + layout.tensor_span(output_capacity)


def estimate(spec: ModelSpec | None, specs: dict, fallback: int = DEFAULT_OUTPUT_CAPACITY) -> tuple[int, bool]:
    """(bytes to reserve for the outputs, whether that is exact: every output's shape follows
    from the inputs); ``fallback`` for each output whose size it cannot tell."""
    if spec is None:
        return fallback, False
    metas = [protocol.TensorMeta(n, dt.name, shape) for n, (shape, dt) in specs.items()]
    try:
        symbols = bind_inputs(spec, metas)
    except ShmserveError:
        return fallback, False  # the server will say what is wrong
    capacity = estimate_output_bytes(spec, symbols, fallback)
    return capacity, capacity == estimate_output_bytes(spec, symbols, 0)


def check_fixed_outputs(spec: ModelSpec) -> None:
    """BadArgument (BAD_DTYPE) if the model has a bytes output: a zero-copy call cannot carry one."""
    carried = [t.name for t in spec.outputs if t.dtype == protocol.BYTES]
    if carried:
        raise BadArgument(ErrorCode.BAD_DTYPE, f"model {spec.name!r} outputs {', '.join(map(repr, carried))} as "
                                               f"bytes: {layout.NO_ZERO_COPY_BYTES}")


def _outputs_need(spec: ModelSpec, symbols: dict[str, int]) -> int | None:
    """The bytes a worker lays ``spec``'s outputs out in (each 64-byte aligned, in order) when the
    inputs' ``symbols`` fix every output's shape; None if they do not."""
    pos = 0
    for t, shape in zip(spec.outputs, output_shapes(spec.outputs, symbols)):
        if shape is None:
            return None
        pos = layout.align_tensor(pos) + protocol.tensor_nbytes(t.dtype, shape)
    return pos


# -- a zero-copy call: where it goes ----------------------------------------------------------

def _normalize(inputs: Mapping[str, tuple]) -> tuple[dict, dict]:
    specs = {name: check_tensor(name, shape, dtype) for name, (shape, dtype) in inputs.items()}
    return specs, {name: protocol.tensor_nbytes(dt.name, shape) for name, (shape, dt) in specs.items()}


def _fits(region: Region, sizes: list[int]) -> bool:
    free = sorted((length for _, length in region.allocator.free), reverse=True)
    for size in sorted(sizes, reverse=True):
        need = layout.tensor_span(size)
        if not free or free[0] < need:
            return False
        free[0] -= need
        free.sort(reverse=True)
    return True


def _find_region(regions: list[Region], sizes: list[int]) -> Region | None:
    return next((r for r in regions if not r.gone and _fits(r, sizes)), None)


def _place(region: Region, specs: dict, sizes: dict, output_capacity: int) -> tuple[dict, int]:
    placed = {}
    for name, (shape, dt) in specs.items():
        off = region.allocator.allocate(sizes[name])
        placed[name] = (off, np.ndarray(shape, dt, buffer=region.buf, offset=off))
    return placed, region.allocator.allocate(output_capacity)


class ZeroCopyPlan:
    """Where a zero-copy call of ``model`` goes: a lane of the model when ``lane`` is set and the
    model is known, else a region without one; output capacity from the spec unless given.

    ``region`` is an open region of the planned kind with room for the call, or None: then
    open one of ``region_size`` (with ``lane``) and report it with ``opened``, or the server's
    refusal with ``refused``, until ``region`` is set; then ``place``.

    ``region_limit``: the largest region the server makes (``region_limit``), None while
    unknown; the default region is cut to it, never below what the call needs (a call larger
    than the server allows gets the server's TOO_LARGE, which names the key to raise).
    """

    def __init__(self, spec: ModelSpec | None, lane: str | None, inputs: Mapping[str, tuple],
                 output_capacity: int | None, regions: list[Region], region_limit: int | None = None,
                 version: int | None = None):
        self.specs, self.sizes = _normalize(inputs)
        if spec is not None:
            check_fixed_outputs(spec)
        self.output_capacity = estimate(spec, self.specs)[0] if output_capacity is None else output_capacity
        self.wanted = list(self.sizes.values()) + [self.output_capacity]
        self.lane = lane if spec is not None else None
        self.version = version  # the lane's version, if the call asked for one (None: the default's)
        self.serves = version_of(spec)  # a lane region of this call serves this version (0: any)
        self.needed = needed_bytes(self.sizes, self.output_capacity)
        self.region_limit = region_limit
        self.region_size = self._sized(DEFAULT_REGION_BYTES)  # room for the calls that follow
        self.regions = regions
        self.region = self._region_in()

    def opened(self, region: Region) -> None:
        self.region = region

    def limited(self, region_limit: int) -> int:
        """The server makes regions of at most ``region_limit`` bytes: ask for no more unless the
        call needs more.  Returns ``region_limit`` (the client keeps it for its next plans)."""
        self.region_limit = region_limit
        self.region_size = self._sized(self.region_size)
        return region_limit

    def refused(self, exc: ShmserveError) -> bool:
        """The server refused the region.  Too large while the server's limit is unknown and
        the region is larger than the call needs: returns True, the caller learns the limit
        (``region_limit`` of its ``info``), passes it to ``limited`` and asks again.  Overloaded
        (a region limit of the connection or uid, or a lane whose workers serve all they can):
        first ask for only what this call needs, then for a region without a lane.  Any other
        refusal, or the last, is raised."""
        if exc.code is ErrorCode.TOO_LARGE and self.region_limit is None and self.region_size > self.needed:
            return True
        if exc.code is not ErrorCode.OVERLOADED:
            raise exc
        if self.region_size > self.needed:
            self.region_size = self.needed
        elif self.lane is not None:
            self.lane = None
            self.region = self._region_in()
        else:
            raise exc
        return False

    def place(self) -> tuple:
        """(region, inputs placed, output offset, output capacity) of the call."""
        placed, out_off = _place(self.region, self.specs, self.sizes, self.output_capacity)
        return self.region, placed, out_off, self.output_capacity

    def _sized(self, size: int) -> int:
        limit = self.region_limit
        return max(self.needed, size if limit is None else min(size, limit))

    def _region_in(self) -> Region | None:
        return _find_region([r for r in self.regions if (r.lane.model if r.lane else None) == self.lane
                             and (r.lane is None or not self.serves or r.lane.serves() in (0, self.serves))], self.wanted)


# -- a zero-copy call: how it names its tensors to a lane worker -----------------------------

class CallPlan(NamedTuple):
    """How one zero-copy call names its tensors to a lane worker of one version (from its spec)."""

    version: int  # the version whose spec planned it (a worker of another refuses the call)
    described: list  # (input index in that spec, offset in the region, view), in the call's order
    outputs: tuple[str, ...]  # the output names by index, as that spec lists them


def call_plan(model: str, spec: ModelSpec, inputs: dict[str, tuple[int, np.ndarray]], out_capacity: int,
              before: CallPlan | None) -> CallPlan:
    """Plan a zero-copy call of ``model`` (``inputs``: name -> (offset, view)) from ``spec``.
    BAD_INPUT for an input the model does not have.  Planned again (``before``: the plan of
    another version) the call is checked as that version's workers will check it, and refused
    with their code (BAD_INPUT, BAD_DTYPE, BAD_SHAPE; OUTPUT_TOO_LARGE if outputs whose sizes the
    inputs fix would not fit ``out_capacity``; BAD_DTYPE for a bytes output), in a message that
    names both versions."""
    names = [t.name for t in spec.inputs]
    version = version_of(spec)
    try:
        if before is not None:
            check_fixed_outputs(spec)
            symbols = bind_inputs(spec, [TensorMeta(n, v.dtype.name, v.shape) for n, (_, v) in inputs.items()])
            need = _outputs_need(spec, symbols)
            if need is not None and need > out_capacity:
                raise ShmserveError(ErrorCode.OUTPUT_TOO_LARGE, f"its outputs take {need} bytes for these inputs, "
                                                                f"more than the {out_capacity} this call reserved")
        elif any(n not in names for n in inputs):
            raise ShmserveError(ErrorCode.BAD_INPUT, f"model {model!r} inputs are {names}, got {list(inputs)}")
    except ShmserveError as exc:
        if before is None:
            raise
        raise ShmserveError(exc.code, f"model {model!r} changed from version {before.version} to version "
                                      f"{version}, which refuses this call: {exc.message}; make a new zero_copy "
                                      f"call for it") from None
    return CallPlan(version, [(names.index(n), offset, view) for n, (offset, view) in inputs.items()],
                    tuple(t.name for t in spec.outputs))


# -- an infer call through a lane: its form per input signature ------------------------------

class LaneForm(NamedTuple):
    """What a lane call of one input signature needs, worked out once per model and signature."""

    name_indices: tuple[int, ...]  # each input's index among the model's inputs, in the caller's order
    sizes: tuple[int, ...]  # each input's bytes
    output_capacity: int
    exact: bool  # every output's size follows from the inputs (else a guess, corrected by a short answer)
    needed: int  # the least lane space one call takes
    version: int  # the version whose spec planned it (the worker refuses the call if it serves another)
    outputs: tuple[str, ...]  # the output names by index, as that spec lists them


def lane_form(spec: ModelSpec, arrays: dict[str, np.ndarray]) -> LaneForm | None:
    """How ``arrays`` go through a lane of the model ``spec`` describes; None if they cannot (an
    input the model does not have, a bytes output): then the socket carries the call, and the
    server's answer says what is wrong, as for any other client."""
    names = [t.name for t in spec.inputs]
    if any(t.dtype == protocol.BYTES for t in spec.outputs) or any(n not in names for n in arrays) \
            or len(arrays) + len(spec.outputs) > layout.MAX_TENSORS or any(a.ndim > protocol.MAX_DIMS
                                                                           for a in arrays.values()):
        return None  # (the last two: more than a slot's descriptors hold; the socket says what is wrong)
    specs = {n: (a.shape, a.dtype) for n, a in arrays.items()}
    sizes = {n: a.nbytes for n, a in arrays.items()}
    limit = spec.extra.get("max_output_bytes")  # the most one output may take (0: no limit of its own)
    # A guess, as the server's (a short answer corrects it: InferOperation.answer)
    capacity, exact = estimate(spec, specs, guess_bytes(limit if type(limit) is int and limit > 0 else 0))
    return LaneForm(tuple(names.index(n) for n in arrays), tuple(sizes.values()), capacity, exact,
                    needed_bytes(sizes, capacity), version_of(spec), tuple(t.name for t in spec.outputs))
