"""A worker process: one model on one device, running requests in place in shared memory.

Owns: the worker's life (attach the arena, load and warm the model, report
its spec, serve, stop) and the request step: claim a READY slot, hand the
backend numpy views of its inputs, write the outputs into the slot's output
area, publish DONE or ERROR, push the completion and ring whoever waits.
Slots come from the arena (queued by the front-end) or from lanes the
front-end attached (client regions with their own queue, ``layout.LANE``):
one ``Space`` each, all waited on at once.

Started by the front-end as ``python -m workers.main`` (argv in
``shmserve.workerlink``), never forked from a process that touched CUDA.  It
trusts nothing it reads from the arena: every descriptor is decoded through
``shmserve.layout`` against the bounds of the space it names.

Must not: accept connections, allocate arena space, or free slots.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import signal
import socket
import sys
import time

import numpy as np
import orjson
import posix_ipc

from shmserve import _atomics as atomics
from shmserve import lanes, layout, workerlink
from shmserve.arena import SHM_DIR, Arena, ArenaError, SlotConflict, transition_slot
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import TensorMeta
from shmserve.rings import EventfdDoorbell, Ring, wait_any
from shmserve.slotstate import Actor, SlotState
from shmserve.spec import ModelSpec, bind_inputs, merge_overrides
from workers.backends import find, warmup_inputs

CPUS = os.cpu_count() or 1
IDLE_TICK_S = 0.5  # heartbeat period while idle, and how often an orphan notices
PR_SET_PDEATHSIG = 1


class RequestFailed(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class RegionCache:
    """Client regions (``shmserve.<instance>.r<id>``) mapped on first use, dropped once unlinked.

    On a GPU worker each region is page-locked while mapped (``gpu`` set):
    registered after mapping, unregistered before unmapping.
    """

    def __init__(self, instance: str, gpu=None):
        self.instance = instance
        self.gpu = gpu  # a GpuMemory, or None on CPU
        self.maps: dict[int, object] = {}
        self.sizes: dict[int, int] = {}

    def ensure(self, region: int) -> None:
        if region == 0 or region in self.maps:
            return
        import mmap

        try:
            shm = posix_ipc.SharedMemory(layout.region_name(self.instance, region))
        except posix_ipc.Error:
            raise RequestFailed(ErrorCode.BAD_REGION, f"region {region} does not exist") from None
        try:
            size = os.fstat(shm.fd).st_size
            self.maps[region] = mmap.mmap(shm.fd, size) if size else None
            self.sizes[region] = size
        finally:
            shm.close_fd()
        if self.gpu is not None and size:
            try:
                self.gpu.register(("region", region), self.maps[region], f"region {region}")
            except Exception as exc:
                self.maps.pop(region).close()
                self.sizes.pop(region)
                raise RequestFailed(ErrorCode.INTERNAL, f"cannot page-lock region {region}: {exc}") from None

    def buffer(self, region: int, arena_buf):
        return arena_buf if region == 0 else self.maps[region]

    def collect(self) -> list[int]:
        """Unmap regions whose name is gone (their client disconnected or closed them); their ids."""
        gone = [r for r in self.maps if not os.path.exists(os.path.join(SHM_DIR, layout.region_name(self.instance, r)[1:]))]
        for region in gone:
            self.drop(region)
        return gone

    def drop(self, region: int) -> None:
        """Unmap ``region`` (after unregistering it from the GPU); nothing if it is not mapped."""
        if region not in self.maps:
            return
        if self.gpu is not None:
            self.gpu.unregister(("region", region))
        m = self.maps.pop(region)
        self.sizes.pop(region)
        if m is not None:
            m.close()

    def close(self) -> None:
        for region in list(self.maps):
            self.drop(region)


class GpuMemory:
    """The GPU worker's page-locked ranges: the arena at start, client regions as they come.

    Each registration is a context manager kept open until ``unregister`` (or
    ``close``), which always runs before the memory is unmapped.
    """

    def __init__(self, device_index: int):
        from workers import cuda

        self.cuda = cuda
        self.device_index = device_index
        cuda.set_device(device_index)
        self.memory = cuda.DeviceMemory()
        self._open: dict[object, tuple[object, object]] = {}  # key -> (context manager, registration)

    def register(self, key, buf, what: str) -> None:
        cm = self.cuda.registered(buf, what)
        reg = cm.__enter__()
        self._open[key] = (cm, reg)
        self.memory.add(reg)

    def unregister(self, key) -> None:
        entry = self._open.pop(key, None)
        if entry is not None:
            cm, reg = entry
            self.memory.remove(reg.host)
            cm.__exit__(None, None, None)

    def describe(self) -> dict:
        """What is registered, for the front-end's info: device and arena host/device addresses."""
        _, reg = self._open["arena"]
        return {"device": self.device_index, "arena_host": hex(reg.host), "arena_device": hex(reg.device),
                "arena_bytes": reg.size, "flags": "Portable|Mapped"}

    def close(self) -> None:
        for key in list(self._open):
            self.unregister(key)


class Space:
    """A slot table this worker serves: the arena's, or a lane's (a client region's own queue).

    ``buf``/``geometry`` hold the slots and ``submissions``/``completions`` their rings;
    ``outbox`` wakes whoever collects completions (the front-end's eventfd, or the lane
    client's futex).  A lane's tensors may only lie in its own region (``region``), above its
    queue (``data_floor``): the client wrote every byte of it and is trusted with none.
    """

    def __init__(self, buf, geometry, submissions: Ring, completions: Ring, outbox, *, region: int = 0,
                 data_floor: int = 0):
        self.buf, self.geometry = buf, geometry
        self.submissions, self.completions, self.outbox = submissions, completions, outbox
        self.region, self.data_floor = region, data_floor

    @property
    def is_lane(self) -> bool:
        return self.region != 0

    def stamp(self, index: int, stage: str) -> None:
        layout.stamp(self.buf, self.geometry, index, stage, time.monotonic_ns())

    def check_region(self, region: int, offset: int, what: str) -> None:
        """RequestFailed(BAD_REGION) unless a lane's tensor lies in its own data space."""
        if self.is_lane and (region != self.region or offset < self.data_floor):
            raise RequestFailed(ErrorCode.BAD_REGION, f"{what} must lie in this lane's region {self.region} "
                                                      f"at offset {self.data_floor} or above")


class OutputPlacer:
    """Lays a request's outputs out in its output area, 64-byte aligned, in the order they come,
    and writes their descriptors once the backend is done (after its stream is synchronized)."""

    def __init__(self, worker: "Worker", space: Space, index: int, first_tensor: int, region: int, base: int,
                 capacity: int):
        self.worker, self.space, self.index, self.first = worker, space, index, first_tensor
        self.region, self.base, self.capacity = region, base, capacity
        self.target = worker.regions.buffer(region, worker.buf)
        self.pos = 0
        self.placed: dict[str, tuple[int, tuple, np.dtype]] = {}

    def allocate(self, name: str, shape, dtype) -> np.ndarray:
        """A writable view of the output area for output ``name``; RequestFailed if it does not fit."""
        declared = self.worker.output_dtypes.get(name)
        if declared is None:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"model produced an undeclared output {name!r}")
        dtype = np.dtype(dtype)
        if dtype != declared:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"output {name!r} is {dtype.name}, declared {declared.name}")
        if name in self.placed:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"output {name!r} produced twice")
        shape = tuple(int(d) for d in shape)
        nbytes = dtype.itemsize * math.prod(shape)
        pos = layout.align_tensor(self.pos)
        if pos + nbytes > self.capacity:
            raise RequestFailed(ErrorCode.OUTPUT_TOO_LARGE,
                                f"outputs need more than the {self.capacity} bytes reserved for them "
                                f"(output {name!r} is {nbytes} bytes); raise max_output_bytes")
        self.pos = pos + nbytes
        self.placed[name] = (self.base + pos, shape, dtype)
        return np.ndarray(shape, dtype, buffer=self.target, offset=self.base + pos)

    def finish(self) -> int:
        spec, w = self.worker.spec, self.worker
        missing = [t.name for t in spec.outputs if t.name not in self.placed]
        if missing:
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"model did not return outputs {missing}")
        sync = getattr(w.backend, "synchronize", None)
        if sync is not None:
            sync()  # a GPU backend's writes must land before DONE is published
        for i, t in enumerate(spec.outputs):
            offset, shape, dtype = self.placed[t.name]
            layout.encode_tensor(self.space.buf, self.space.geometry, self.index, self.first + i,
                                 role=layout.ROLE_OUTPUT, name_index=i, dtype=dtype, shape=shape, offset=offset,
                                 region=self.region)
        return len(spec.outputs)


class Worker:
    def __init__(self, arena: Arena, index: int, config: ModelConfig, control: socket.socket,
                 completion_fd: int, spin_s: float):
        self.arena, self.index, self.config, self.control = arena, index, config, control
        self.buf, self.geometry = arena.buf, arena.geometry
        self.entry_off = self.geometry.worker_off(index)
        completions = Ring.of_worker(arena, index, completion=True)
        self.main = Space(arena.buf, arena.geometry, Ring.of_worker(arena, index, completion=False), completions,
                          EventfdDoorbell(completions, completion_fd))
        self.lanes: dict[int, Space] = {}  # region id -> lane attached by the front-end
        self._rings = [self.main.submissions]
        self._stopping = False  # a stop command arrived while a batch was being gathered
        self.spin_s = spin_s
        self.gpu: GpuMemory | None = None
        if config.device.startswith("cuda"):
            # Register the arena once, before the model loads (DESIGN.md section 6).
            self.gpu = GpuMemory(int(config.device.split(":")[1]))
            self.gpu.register("arena", arena.buf, f"arena {arena.name}")
        self.regions = RegionCache(arena.instance, self.gpu)
        self.backend = None
        self.spec: ModelSpec | None = None
        self.output_dtypes: dict[str, np.dtype] = {}
        self._checked_lane_inputs: set[tuple] = set()  # input signatures bind_inputs accepted
        self.ppid = os.getppid()

    # -- worker table ---------------------------------------------------------------------

    def _set_state(self, state: int) -> None:
        atomics.store32(self.buf, self.entry_off + layout.WORKER.offset("state"), state)

    def _beat(self) -> None:
        atomics.store64(self.buf, self.entry_off + layout.WORKER.offset("heartbeat_ns"), time.monotonic_ns())

    def _count(self, field: str) -> None:
        atomics.fetch_add64(self.buf, self.entry_off + layout.WORKER.offset(field), 1)

    # -- life -----------------------------------------------------------------------------

    def load(self) -> None:
        cfg = self.config
        self.backend = find(cfg.backend)(cfg)
        bind = getattr(self.backend, "bind_memory", None)
        if bind is not None and self.gpu is not None:
            bind(self.gpu.memory)
        inputs = merge_overrides(self.backend.inputs, cfg.inputs)
        outputs = merge_overrides(self.backend.outputs, cfg.outputs)
        if not inputs or not outputs:
            raise ValueError(f"model {cfg.name!r}: the backend cannot tell its inputs/outputs; "
                             f"declare them in the config")
        self.spec = ModelSpec(cfg.name, cfg.backend, inputs, outputs,
                              {"path": cfg.path, "device": cfg.device})
        self.output_dtypes = {t.name: np.dtype(t.dtype) for t in outputs}
        declare = getattr(self.backend, "declare", None)
        if declare is not None:
            declare(inputs, outputs)
        custom = getattr(self.backend, "warmup_inputs", None)
        warm = custom() if custom is not None else warmup_inputs(inputs)
        if hasattr(self.backend, "run_into"):
            scratch: list[np.ndarray] = []
            self.backend.run_into(warm, lambda name, shape, dtype: scratch.append(np.empty(shape, dtype)) or scratch[-1])
            got = len(scratch)
        else:
            got = len(set(self.backend.run(warm)) & {t.name for t in outputs})
        if got != len(outputs):
            raise ValueError(f"model {cfg.name!r}: warm-up run produced {got} of {len(outputs)} outputs")

    def start_heartbeat(self) -> None:
        """Beat from a thread every IDLE_TICK_S, busy or idle: the front-end's watchdog reads it.
        It stops only when the whole process stops (SIGSTOP, a hang in the kernel, death)."""
        import threading

        def beat():
            while not self._stop_beating.wait(IDLE_TICK_S):
                self._beat()

        self._stop_beating = threading.Event()
        self._beat()
        self._beater = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._beater.start()

    def serve(self) -> int:
        self._set_state(layout.WORKER_READY)
        batching = self.config.max_batch_size > 1 and self._batchable()
        backlog: list[tuple[Space, int]] = []  # popped but not yet run (a batch was full)
        while True:
            if not backlog and not self._wait(IDLE_TICK_S, self.spin_s):
                if os.getppid() != self.ppid:
                    return workerlink.EXIT_ORPHANED
                for region in self.regions.collect():
                    self._detach_lane(region)
                continue
            work, stop = self._gather()
            work = backlog + work
            backlog = []
            if batching and not stop:
                backlog = self._run_batched(work)
                if not self._stopping:
                    continue
                work, backlog, stop = backlog, [], True  # a stop came while a batch gathered
            for space, entry in work:
                claimed = self._claim(space, entry)
                if claimed is not None:
                    self._finish(space, entry, claimed, self._attempt(lambda: self._run(space, claimed)))
                    self._record_batch(1)
            if stop:
                self._set_state(layout.WORKER_STOPPING)
                return workerlink.EXIT_OK

    # -- submissions: the arena's ring and the lanes' -------------------------------------

    def _wait(self, timeout: float, spin: float) -> bool:
        return wait_any(self._rings, timeout, spin)

    def _gather(self) -> tuple[list[tuple[Space, int]], bool]:
        """Everything submitted now, in arrival order per ring: (work, stop).  Commands on the
        worker's own ring are carried out here; entries after a stop are dropped (the front-end
        fails them)."""
        work: list[tuple[Space, int]] = []
        stop = False
        for entry in self.main.submissions.pop_all():
            if not layout.is_command(entry):
                work.append((self.main, entry))
                continue
            op, argument = layout.split_entry(entry)
            if op == layout.CMD_STOP:
                stop = True
                break
            if op == layout.CMD_ATTACH_LANE:
                self._attach_lane(argument)
            elif op == layout.CMD_DETACH_LANE:
                self._detach_lane(argument)
        for lane in self.lanes.values():
            try:
                work.extend((lane, entry) for entry in lane.submissions.pop_all())
            except RuntimeError:  # the client corrupted its ring indices: resynchronize, drop them
                lane.submissions.discard()
        return work, stop

    def _attach_lane(self, region: int) -> None:
        """Serve the queue at the start of client region ``region`` (front-end command)."""
        if region in self.lanes:
            return
        try:
            self.regions.ensure(region)
        except RequestFailed:
            return  # the client left before we got here
        buf = self.regions.maps[region]
        if buf is None or not lanes.usable(self.regions.sizes[region]):
            return
        submissions, completions, doorbell = lanes.worker_rings(buf)
        self.lanes[region] = Space(buf, layout.LANE, submissions, completions, doorbell, region=region,
                                   data_floor=lanes.DATA_FLOOR)
        self._rings = [self.main.submissions] + [lane.submissions for lane in self.lanes.values()]

    def _detach_lane(self, region: int) -> None:
        if self.lanes.pop(region, None) is not None:
            self._rings = [self.main.submissions] + [lane.submissions for lane in self.lanes.values()]
        self.regions.drop(region)

    # -- one request ----------------------------------------------------------------------

    def _claim(self, space: Space, entry: int) -> int | None:
        """READY -> RUNNING for a ring entry; the slot index, or None if it is not ours to run."""
        index, generation = layout.split_entry(entry)
        if not 0 <= index < space.geometry.slot_count:
            return None  # hostile or corrupt entry: nothing to answer
        try:
            transition_slot(space.buf, space.geometry, index, generation, SlotState.READY, SlotState.RUNNING,
                            Actor.WORKER)
        except SlotConflict:
            return None  # failed or reused meanwhile (timeout, shutdown, a lane client's second thoughts)
        space.stamp(index, "t_claimed")
        return index

    @staticmethod
    def _attempt(run):
        """Run ``run()``; (n_outputs, None) or (None, (code, message))."""
        try:
            return run(), None
        except RequestFailed as exc:
            return None, (exc.code, exc.message)
        except Exception as exc:  # a bug here must fail one request, not kill the worker
            return None, (ErrorCode.INTERNAL, f"worker: {type(exc).__name__}: {exc}")

    def _finish(self, space: Space, entry: int, index: int, outcome) -> None:
        """Publish DONE or ERROR, count it, and hand the slot back through the completion ring."""
        _, generation = layout.split_entry(entry)
        buf, g, slot_off = space.buf, space.geometry, space.geometry.slot_off(index)
        n_outputs, failure = outcome
        if failure is not None:
            layout.encode_error(buf, g, index, *failure)
        layout.set_n_outputs(buf, g, index, 0 if failure is not None else n_outputs)
        space.stamp(index, "t_done")
        try:
            # Order matters here: outputs and descriptors are written before DONE is published.
            transition_slot(buf, g, index, generation, SlotState.RUNNING,
                            SlotState.ERROR if failure is not None else SlotState.DONE, Actor.WORKER)
        except SlotConflict:
            if not space.is_lane:
                raise
            return  # the lane's client rewrote a running slot: nothing to publish
        self._count("requests")
        if failure is not None:
            self._count("errors")
        layout.record_stages(self.buf, self.geometry, self.index, buf, slot_off)
        space.completions.push(entry)  # a lane's ring may be full if its client does not drain it: the
        space.outbox.notify()           # entry is only a wake-up there, the status word is the answer

    def _record_batch(self, size: int) -> None:
        layout.record_sample(self.buf, self.geometry, self.index, "batch_size", size)

    def _run(self, space: Space, index: int) -> int:
        slot, inputs = self._decode(space, index)
        placer = self._output_placer(space, index, slot)
        space.stamp(index, "t_compute_start")
        try:
            if hasattr(self.backend, "run_into"):  # writes outputs itself (GPU: straight into shared memory)
                self.backend.run_into(inputs, placer.allocate)
            else:
                results = self.backend.run(inputs)
                for t in self.spec.outputs:
                    if t.name not in results:
                        raise RequestFailed(ErrorCode.MODEL_ERROR, f"model did not return output {t.name!r}")
                    arr = np.asarray(results[t.name])
                    np.copyto(placer.allocate(t.name, arr.shape, arr.dtype), arr, casting="no")
                del results
        except RequestFailed:
            raise
        except Exception as exc:  # the model's failure is this request's error, not the worker's
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"{type(exc).__name__}: {exc}") from None
        finally:
            del inputs
        space.stamp(index, "t_compute_end")
        return placer.finish()

    def _decode(self, space: Space, index: int):
        """The slot's record and numpy views of its inputs (validated against their space)."""
        g, buf, spec = space.geometry, space.buf, self.spec
        slot = layout.decode_slot_request(buf, g, index)
        if not 0 < slot.n_inputs <= len(spec.inputs) or slot.n_inputs >= layout.MAX_TENSORS:
            raise RequestFailed(ErrorCode.BAD_INPUT if space.is_lane else ErrorCode.INTERNAL,
                                f"slot has {slot.n_inputs} inputs")
        inputs = {}
        try:
            for t in range(slot.n_inputs):
                region = layout.region_of_tensor(buf, g, index, t)
                space.check_region(region, space.data_floor, f"input {t}")
                self.regions.ensure(region)
                desc = layout.decode_tensor(buf, g, index, t, self.regions.sizes)
                space.check_region(desc.region, desc.offset, f"input {t}")
                if desc.role != layout.ROLE_INPUT or desc.name_index >= len(spec.inputs):
                    raise RequestFailed(ErrorCode.BAD_INPUT if space.is_lane else ErrorCode.INTERNAL,
                                        f"tensor {t} is not an input of this model")
                view = np.ndarray(desc.shape, desc.dtype, buffer=self.regions.buffer(desc.region, self.buf),
                                  offset=desc.offset)
                view.flags.writeable = False
                inputs[spec.inputs[desc.name_index].name] = view
        except layout.LayoutError as exc:
            raise RequestFailed(ErrorCode.BAD_REGION, f"input descriptor rejected: {exc}") from None
        if space.is_lane:  # the front-end checked the arena's requests; nobody checked a lane's
            signature = tuple((n, v.dtype, v.shape) for n, v in inputs.items())
            if signature not in self._checked_lane_inputs:
                try:
                    bind_inputs(spec, [TensorMeta(n, layout.dtype_name(v.dtype), v.shape) for n, v in inputs.items()])
                except ShmserveError as exc:
                    raise RequestFailed(exc.code, exc.message) from None
                if len(self._checked_lane_inputs) >= 1024:
                    self._checked_lane_inputs.clear()
                self._checked_lane_inputs.add(signature)
        return slot, inputs

    # -- dynamic batching -----------------------------------------------------------------

    def _batchable(self) -> bool:
        """Every input and output of the model has a dynamic leading (batch) dimension."""
        tensors = self.spec.inputs + self.spec.outputs
        return all(t.shape and not isinstance(t.shape[0], int) for t in tensors)

    def _run_batched(self, work: list[tuple[Space, int]]) -> list[tuple[Space, int]]:
        """Claim up to max_batch_size requests (waiting at most max_queue_delay_us for more), run
        compatible ones as one batch, answer each.  Returns work left for the next batch."""
        cfg = self.config
        preferred = set(cfg.preferred_batch_sizes)
        claimed: list[tuple[Space, int, int]] = []
        pending = list(work)
        deadline = time.monotonic() + cfg.max_queue_delay_us / 1e6
        while True:
            while pending and len(claimed) < cfg.max_batch_size:
                space, entry = pending.pop(0)
                index = self._claim(space, entry)
                if index is not None:
                    claimed.append((space, entry, index))
            full = len(claimed) >= cfg.max_batch_size
            remaining = deadline - time.monotonic()
            if full or remaining <= 0 or (len(claimed) in preferred and not _any_submitted(self._rings)):
                break
            # Spinning here would take the CPU from the very clients whose requests we wait for
            # once they outnumber the cores: then sleep (futex) until one arrives.
            spin = min(remaining, self.spin_s) if len(self.lanes) <= CPUS // 2 else 0.0
            if self._wait(remaining, spin):
                more, stop = self._gather()
                pending += more
                if stop:  # run what we have, then stop: the front-end fails what is left
                    self._stopping = True
                    break
        groups: dict[tuple, list] = {}
        for space, entry, index in claimed:
            try:
                slot, inputs = self._decode(space, index)
            except RequestFailed as exc:
                self._finish(space, entry, index, (None, (exc.code, exc.message)))
                continue
            key = tuple(sorted((n, v.dtype.name, v.shape[1:]) for n, v in inputs.items()))
            groups.setdefault(key, []).append((space, entry, index, slot, inputs))
        for members in groups.values():
            self._execute_batch(members)
        return pending

    def _execute_batch(self, members: list) -> None:
        """One backend run for compatible requests: inputs concatenated along the batch dimension
        (one copy), outputs split back into each request's own output area."""
        rows = [next(iter(m[4].values())).shape[0] for m in members]
        names = [t.name for t in self.spec.inputs]
        now = time.monotonic_ns()
        for space, _, index, _, _ in members:
            layout.stamp(space.buf, space.geometry, index, "t_compute_start", now)
        try:
            batch = {n: np.concatenate([m[4][n] for m in members], axis=0) if len(members) > 1 else members[0][4][n]
                     for n in names}
            if hasattr(self.backend, "run_into"):
                scratch: dict[str, np.ndarray] = {}

                def allocate(name, shape, dtype):
                    scratch[name] = np.empty(shape, dtype)
                    return scratch[name]

                self.backend.run_into(batch, allocate)
                sync = getattr(self.backend, "synchronize", None)
                if sync is not None:
                    sync()
                results = scratch
            else:
                results = self.backend.run(batch)
            del batch
            total = sum(rows)
            for t in self.spec.outputs:
                if t.name not in results:
                    raise RequestFailed(ErrorCode.MODEL_ERROR, f"model did not return output {t.name!r}")
                if np.ndim(results[t.name]) == 0 or np.shape(results[t.name])[0] != total:
                    raise RequestFailed(ErrorCode.MODEL_ERROR, f"output {t.name!r} does not have the batch's "
                                                               f"{total} rows; this model cannot be batched")
        except Exception as exc:
            failure = (exc.code, exc.message) if isinstance(exc, RequestFailed) else \
                (ErrorCode.MODEL_ERROR, f"{type(exc).__name__}: {exc}")
            for space, entry, index, _, _ in members:
                self._finish(space, entry, index, (None, failure))
            return
        now = time.monotonic_ns()
        start = 0
        for (space, entry, index, slot, inputs), n in zip(members, rows):
            layout.stamp(space.buf, space.geometry, index, "t_compute_end", now)

            def place(space=space, index=index, slot=slot, start=start, n=n):
                placer = self._output_placer(space, index, slot)
                for t in self.spec.outputs:
                    part = np.asarray(results[t.name][start:start + n])
                    np.copyto(placer.allocate(t.name, part.shape, part.dtype), part, casting="no")
                return placer.finish()

            self._finish(space, entry, index, self._attempt(place))
            start += n
        self._record_batch(len(members))

    def _output_placer(self, space: Space, index: int, slot) -> "OutputPlacer":
        region = slot.out_region
        space.check_region(region, slot.out_off, "the output area")
        self.regions.ensure(region)
        base, capacity = slot.out_off, slot.out_capacity
        if region == 0 and not space.geometry.contains_data(base, capacity):
            raise RequestFailed(ErrorCode.INTERNAL, "output area lies outside the data region")
        if region and base + capacity > self.regions.sizes[region]:
            raise RequestFailed(ErrorCode.BAD_REGION, "output area lies outside the region")
        if slot.n_inputs + len(self.spec.outputs) > layout.MAX_TENSORS:
            raise RequestFailed(ErrorCode.INTERNAL, "too many tensors for one slot")
        return OutputPlacer(self, space, index, slot.n_inputs, region, base, capacity)

    def close(self) -> None:
        """Unregister before unmapping: regions, the backend, then the arena's registration."""
        if getattr(self, "_stop_beating", None) is not None:
            self._stop_beating.set()
            self._beater.join(2.0)  # it writes into the arena: done before the arena is unmapped
        self.regions.close()
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self.gpu is not None:
            self.gpu.close()


def _any_submitted(rings: list[Ring]) -> bool:
    return any(not ring.empty() for ring in rings)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # the idle-tick ppid check still catches orphaning


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workers.main")
    parser.add_argument("--instance", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--model", required=True, help="ModelConfig as JSON")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--completion-fd", type=int, required=True)
    parser.add_argument("--spin-us", type=int, default=0)
    args = parser.parse_args(argv)
    # The front-end owns Ctrl-C and SIGTERM (a terminal or `kill` of the process group
    # reaches us too) and stops us in order with a STOP entry; SIGKILL is the last resort.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ppid = os.getppid()
    _die_with_parent()
    if os.getppid() != ppid:
        return workerlink.EXIT_ORPHANED
    control = socket.socket(fileno=args.control_fd)
    config = ModelConfig.from_dict(orjson.loads(args.model))
    try:
        arena = Arena.attach(args.instance)
    except ArenaError as exc:
        control.send(workerlink.encode({"event": "failed", "error": f"cannot attach the arena: {exc}"}))
        return workerlink.EXIT_ARENA_FAILED
    try:
        worker = Worker(arena, args.index, config, control, args.completion_fd, args.spin_us / 1e6)
    except Exception as exc:  # no device, no cuda-python, or page-locking refused (memlock)
        control.send(workerlink.encode({"event": "failed", "error": f"cannot use {config.device} for "
                                                                    f"model {config.name!r}: {exc}"}))
        arena.close()
        return workerlink.EXIT_ARENA_FAILED
    worker.start_heartbeat()  # loading a large model takes a while: the front-end sees us alive
    try:
        try:
            worker.load()
        except Exception as exc:
            message = f"cannot load model {config.name!r} ({config.backend}, {config.path}): " \
                      f"{type(exc).__name__}: {exc}"
            control.send(workerlink.encode({"event": "failed", "error": message}))
            return workerlink.EXIT_LOAD_FAILED
        control.send(workerlink.encode({"event": "ready", "spec": worker.spec.to_dict(),
                                        "gpu": worker.gpu.describe() if worker.gpu else None}))
        return worker.serve()
    finally:
        worker.close()
        del worker
        arena.close()
        control.close()


if __name__ == "__main__":
    code = main()
    if code == workerlink.EXIT_LOAD_FAILED:
        # A runtime that failed half-way (TensorRT 11.4 lean without CUDA, for one) can crash in
        # its destructor at interpreter exit, which would turn this named exit code into a
        # SIGSEGV and a restart loop.  Everything of ours is closed: leave without finalizers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
