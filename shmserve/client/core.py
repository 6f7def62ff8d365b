"""What both client faces keep, and what they decide, without I/O: ``ClientCore``.

Owns: the client's state besides its socket (the ``ClientSession`` of the
connection, the regions it granted, the model specs and the server's region
limit it told, each model's route — ``shmserve.routing``: a split canary's
versions, share and the candidate's spec — ``infer``'s lanes, lane forms and
back-offs), what makes a
connection over and what a new one forgets (``connection_over``,
``forget_connection``), whether a request is sent again (``retry_unsent``),
which spec a model's calls are planned from (``spec_read``, ``forget_spec``,
``version_spec``), which version a call that names none goes to (``pick``: the
route's rule, the server's own) and which of ``infer``'s lanes serves it
(``infer_lane``),
and, as steps (``shmserve.client.steps``), the operations that are one
request or a few: ``models``, ``health``, ``info``, ``repository``, the
lifecycle calls, ``open_region`` and opening a ``zero_copy`` call.
``infer``'s logic is ``InferOperation``'s (``shmserve.client.infer``) and a
zero-copy call's is ``ZeroCopyOperation``'s, over this state.

The clock is passed in (``time.monotonic`` in production: the pumps' waits
read the same one); tests pass a fake (tests/test_client_core.py).

Must not: touch a socket, an event loop, or block (the pumps do); parse or
build frames (the session does).
"""

from __future__ import annotations

import time
import random
from typing import Callable, Mapping

from shmserve.client.memory import Region
from shmserve.client.planning import ZeroCopyPlan, region_limit, route_of, spec_of, version_of
from shmserve.client.steps import CONNECT, Exchange
from shmserve.client.zerocopy import ZeroCopyOperation
from shmserve.config import resolve_socket, trusted_server_uids
from shmserve.routing import Route
from shmserve.errors import ConnectionClosed, ShmserveError
from shmserve.protocol import Kind
from shmserve.reservations import Learned
from shmserve.session import ClientSession, RegionGranted, check_priority, check_routing, check_timeout
from shmserve.spec import ModelSpec

LIFECYCLE_TIMEOUT_S = 900.0  # a control call's default wait: a load of large engines plus a drain


def _core_attribute(name: str, doc: str) -> property:
    return property(lambda face: getattr(face._core, name), lambda face, value: setattr(face._core, name, value),
                    doc=doc)


class ClientFace:
    """What both faces show of their core, as attributes (settable, as they always were)."""

    _core: ClientCore

    path = _core_attribute("path", "The server's socket path.")
    trusted = _core_attribute("trusted", "The uids trusted to serve the socket (checked before anything is sent).")
    timeout = _core_attribute("timeout", "Seconds a call waits by default.")
    lanes = _core_attribute("lanes", "Whether calls go through lanes where they can.")


class ClientCore:
    """The state of one client, and the decisions both its faces share (see the module).

    ``path``, ``trusted``, ``timeout`` and ``lanes`` are the face's arguments, checked;
    ``session`` the current connection's ``ClientSession`` (a new one per connection).
    """

    def __init__(self, socket_path: str | None, timeout: float, instance: str, lanes: bool,
                 server_uid: int | str | None, clock: Callable[[], float] = time.monotonic):
        self.path = resolve_socket(socket_path, None, instance)
        self.trusted = trusted_server_uids(server_uid)  # who may serve us: the pumps check before sending
        self.timeout = check_timeout(timeout)
        # Zero-copy calls and infer go through lanes (a region with its own queue to a worker: no
        # socket round trip) unless this is False (then each is a request over the socket).
        self.lanes = lanes
        self.clock = clock
        self.session = ClientSession()
        self.regions: list[Region] = []
        self.specs: dict[str, ModelSpec | None] = {}
        self.region_limit: int | None = None  # the server's largest region, learned when one is refused
        # Client.infer's lanes: model -> the lane opened for its default; (model, version) -> one opened for a
        # version the client routed a call to (a canary's candidate, a version named); each serves what its
        # header says (a drain moves a lane to another version: ``infer_lane``).
        self.infer_lanes: dict = {}
        self.routes: dict[str, Route] = {}  # model -> its route as the server listed it with its spec
        self.candidate_specs: dict[str, ModelSpec] = {}  # model -> its split canary's candidate's spec
        self.lane_forms: dict = {}  # (model, signature) -> how it goes through a lane (planning.LaneForm)
        # (model, signature) -> output bytes a zero-copy call of it was seen to need (short answers)
        self.zero_copy_outputs = Learned()
        self.no_lane_until: dict[str, float] = {}  # model -> clock time: until then infer uses the socket
        self.opening: set[str] = set()  # models whose infer lane is being opened (by another call)
        self.closed = False  # close() was called: no new connection is made

    def deadline_ns(self, deadline: float) -> int:
        """A call's ``deadline`` (this core's clock) as a lane slot's ``deadline_ns`` (CLOCK_MONOTONIC
        ns: past it its worker answers TIMEOUT unrun); 0 (none) unless the clock is ``time.monotonic``."""
        return int(deadline * 1e9) if self.clock is time.monotonic else 0

    def timeout_of(self, timeout: float | None) -> float:
        """A call's timeout: ``timeout``, else the client's.  BadArgument if out of range."""
        return self.timeout if timeout is None else check_timeout(timeout)

    # -- regions --------------------------------------------------------------------------

    def add_region(self, grant: RegionGranted) -> Region:
        """Map the region the server granted (its descriptor is the region's now)."""
        region = Region(grant.region, grant.size, grant.fd, grant.lane)
        self.regions.append(region)
        return region

    def plan(self, model: str, inputs: Mapping[str, tuple], output_capacity: int | None,
             version: int | None = None) -> ZeroCopyPlan:
        """Where a zero-copy call of ``model`` goes (a lane of ``version``, planned from its spec; None:
        the default's), in the regions of zero-copy calls (infer's own lanes stay out of it: a
        zero-copy call's misuse of its space cannot reach them)."""
        infer_lanes = set(map(id, self.infer_lanes.values()))
        spec = self.specs[model] if version is None else self.version_spec(model, version)
        return ZeroCopyPlan(spec, model if self.lanes else None, inputs, output_capacity,
                            [r for r in self.regions if id(r) not in infer_lanes], self.region_limit, version)

    def release(self) -> None:
        """Unmap the regions; the session closes the descriptors it still holds."""
        for region in self.regions:
            region.close()
        self.regions.clear()
        self.infer_lanes.clear()
        self.session.close()

    def close(self) -> None:
        """The face was closed: release everything, and make no new connection from now on."""
        self.closed = True
        self.release()

    # -- the connection -------------------------------------------------------------------

    def connection_over(self) -> bool:
        """Whether the connection is over (the server closed it, went away, or a call gave up on
        it), so that the next call needs a new one; ConnectionClosed if this client was closed."""
        if self.session.failure is None:
            return False
        if self.closed:
            self.session.ensure_open()
        return True

    def forget_connection(self) -> None:
        """The connection is over: forget what was of it (its regions — zero-copy calls made in them
        fail from now on —, the specs, lanes and limits it told) and start a new session."""
        self.release()
        self.specs.clear()
        self.routes.clear()
        self.candidate_specs.clear()
        self.lane_forms.clear()
        self.no_lane_until.clear()
        self.region_limit = None
        self.session = ClientSession()

    def reconnect_refused(self, exc: ShmserveError) -> ShmserveError:
        """Connecting again failed with ``exc``: the new session is over too (the next call tries
        again); the error to raise."""
        self.session.fail(exc.message, None if isinstance(exc, ConnectionClosed) else exc.code)
        return exc

    def retry_unsent(self, exc: OSError, attempt: int) -> bool:
        """Whether a request whose send failed with ``exc`` is sent again on a new connection: not one
        byte of it went (the connection was over before this call: it never reached the server),
        the server left no reason (``ConnectionFailed.code``), and it is the first attempt."""
        failure = self.session.failure
        return not getattr(exc, "sent", True) and attempt == 0 and not self.closed and \
            (failure is None or failure.code is None)

    def region_gone(self) -> ConnectionClosed:
        """The error of a zero-copy call whose region belonged to a connection that ended."""
        if self.closed:
            return ConnectionClosed("client closed")
        failure = self.session.failure
        why = f" ({failure.message})" if failure is not None else ""
        return ConnectionClosed(f"this zero-copy call's space was in a region of a connection to {self.path} "
                                f"that ended{why}; the client connects again by itself: make a new zero_copy call")

    # -- specs ----------------------------------------------------------------------------

    def spec_read(self, model: str, listing: list[dict]) -> ModelSpec | None:
        """Keep the spec ``listing`` (``models()``) gives ``model``; if it is of another version than
        the one kept, what was planned from the old one goes first (``forget_spec``)."""
        spec = spec_of(listing, model)
        route, candidate = route_of(listing, model)
        if model in self.specs and (version_of(self.specs[model]) != version_of(spec)
                                    or self.routes.get(model) != route):
            self.forget_spec(model)
        self.specs[model] = spec
        self.routes[model] = route
        if candidate is not None:
            self.candidate_specs[model] = candidate
        return spec

    def version_spec(self, model: str, version: int) -> ModelSpec | None:
        """The spec of ``version`` of ``model`` as the client knows it (its default's, or its split
        canary's candidate's), or None."""
        for spec in (self.specs.get(model), self.candidate_specs.get(model)):
            if spec is not None and version_of(spec) == version:
                return spec
        return None

    def pick(self, model: str, key: str | None) -> int | None:
        """The version a call of ``model`` that names none goes to by the route the client holds
        (``routing.Route.pick``: the server's rule, a draw of the client's own for a call without
        a key), or None: the default, whatever the lane serves."""
        route, spec = self.routes.get(model), self.specs.get(model)
        if route is None or route.candidate is None or spec is None:
            return None
        return route.pick(model, version_of(spec), key.encode() if key is not None else None, random.random())

    def route_stale(self, model: str, region: Region) -> bool:
        """Whether the route the client holds for ``model`` is of another epoch than the one
        ``region``'s lane header says (its routing changed: read it again before routing a call)."""
        route = self.routes.get(model)
        return route is None or region.lane.route_epoch() != route.epoch

    def infer_lane(self, model: str, version: int) -> Region | None:
        """``infer``'s lane of ``model`` that serves ``version`` now (its header says), or None."""
        for key in (model, (model, version)):
            region = self.infer_lanes.get(key)
            if region is not None and region.lane is not None and (region.lane.serves() == version or (
                    key == model and 0 in (version, region.lane.serves()))):  # (0: not said)
                return region
        for key, region in list(self.infer_lanes.items()):  # a drain moved one: file it under what it serves
            if type(key) is tuple and key[0] == model and region.lane is not None and region.lane.serves() == version:
                if (model, version) not in self.infer_lanes:
                    del self.infer_lanes[key]
                    self.infer_lanes[(model, version)] = region
                return region
        return None

    def forget_spec(self, model: str) -> None:
        """Drop what was planned from ``model``'s spec (its spec, its lane forms, the space kept in
        its infer lane for them): the next call asks the server for the spec again."""
        self.specs.pop(model, None)
        self.routes.pop(model, None)
        self.candidate_specs.pop(model, None)
        for signature in [sig for sig in self.lane_forms if sig[0] == model]:
            del self.lane_forms[signature]
        for key, region in self.infer_lanes.items():
            if key == model or (type(key) is tuple and key[0] == model):
                region.drop_seats()

    # -- operations of a request or a few, as steps -------------------------------------------

    def reply(self, build: Callable[[ClientSession], tuple[int, list]], timeout: float | None = None):
        """Steps: the request ``build`` makes; returns its answer's value."""
        return (yield Exchange((build, timeout))).value

    def models(self):
        """Steps: the served models (``Client.models``)."""
        return self.reply(ClientSession.models)

    def health(self):
        return self.reply(ClientSession.health)

    def info(self):
        return self.reply(ClientSession.info)

    def repository(self):
        return self.reply(ClientSession.repository)

    def control(self, kind: Kind, model: str, timeout: float | None, **fields):
        """Steps: a lifecycle call (LOAD, UNLOAD, SCALE, CANARY), waited for ``timeout`` s
        (default LIFECYCLE_TIMEOUT_S)."""
        return self.reply(lambda session: session.lifecycle(kind, model, **fields),
                          LIFECYCLE_TIMEOUT_S if timeout is None else timeout)

    def open_region(self, size: int, lane: str | None, version: int | None = None):
        """Steps: a region of ``size`` bytes for this connection (with a lane of model ``lane``, to a
        worker of its ``version`` if given, else of its default)."""
        return self.add_region((yield Exchange((lambda session: session.open_region(size, lane, version), None))))

    def zero_copy(self, model: str, inputs: Mapping[str, tuple], output_capacity: int | None,
                  version: int | None = None, key: str | None = None, priority: int = 0):
        """Steps: space for one zero-copy call of ``model`` (``Client.zero_copy``): its spec (and
        route) read first if not known, then a region with room found or opened — in a lane of
        ``version``, else of the version ``key`` routes to now (``pick``), else of the default;
        through ``ZeroCopyPlan``'s answers to the server's refusals —, then placed; returns its
        ``ZeroCopyOperation`` (which routes each run again), each run of ``priority``.  BadArgument
        for a version or key ``session.check_routing`` refuses, a priority ``check_priority`` refuses."""
        check_routing(version, key)
        check_priority(priority)
        yield CONNECT
        if model not in self.specs or version is not None or key is not None:  # (routed: the route of now)
            self.spec_read(model, (yield from self.models()))
        learned = (model, tuple((name, str(shape), str(dtype)) for name, (shape, dtype) in inputs.items()))
        if output_capacity is None and self.zero_copy_outputs.get(learned):
            output_capacity = self.zero_copy_outputs.get(learned)  # (more than the guess: a short answer said)
        # (a version the client has no spec of: a region without a lane, and the socket says what it says)
        plan = self.plan(model, inputs, output_capacity,
                         version if version is not None else self.pick(model, key) if key is not None else None)
        while plan.region is None:
            try:
                plan.opened((yield from self.open_region(plan.region_size, plan.lane, plan.version)))
            except ShmserveError as exc:
                if plan.refused(exc):
                    self.region_limit = plan.limited(region_limit((yield from self.info())))
        operation = ZeroCopyOperation(self, model, *plan.place(), version=version, key=key, priority=priority)
        operation.learned = learned
        return operation
