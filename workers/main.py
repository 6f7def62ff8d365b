"""A worker process: one model on one device, running requests in place in shared memory.

Owns: the worker's life (attach the arena, load and warm the model, report
its spec, serve, stop) and the request step: claim a READY slot, hand the
backend numpy views of its inputs, write the outputs into the slot's output
area, publish DONE or ERROR, push the completion and ring the front-end.

Started by the front-end as ``python -m workers.main`` (argv in
``shmserve.workerlink``), never forked from a process that touched CUDA.  It
trusts nothing it reads from the arena: every descriptor is decoded through
``shmserve.layout`` against the bounds of the space it names.

Must not: accept connections, allocate arena space, or free slots.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
import time

import numpy as np
import orjson
import posix_ipc

from shmserve import _atomics as atomics
from shmserve import layout, workerlink
from shmserve.arena import Arena, ArenaError, SlotConflict
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring
from shmserve.slotstate import Actor, SlotState
from shmserve.spec import ModelSpec, merge_overrides
from workers.backends import find, warmup_inputs

IDLE_TICK_S = 0.5  # heartbeat period while idle, and how often an orphan notices
PR_SET_PDEATHSIG = 1


class RequestFailed(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class RegionCache:
    """Client regions (``shmserve.<instance>.r<id>``) mapped on first use, dropped once unlinked."""

    def __init__(self, instance: str):
        self.instance = instance
        self.maps: dict[int, object] = {}
        self.sizes: dict[int, int] = {}

    def ensure(self, region: int) -> None:
        if region == 0 or region in self.maps:
            return
        import mmap

        try:
            shm = posix_ipc.SharedMemory(f"/shmserve.{self.instance}.r{region}")
        except posix_ipc.Error:
            raise RequestFailed(ErrorCode.BAD_REGION, f"region {region} does not exist") from None
        try:
            size = os.fstat(shm.fd).st_size
            self.maps[region] = mmap.mmap(shm.fd, size) if size else None
            self.sizes[region] = size
        finally:
            shm.close_fd()

    def buffer(self, region: int, arena_buf):
        return arena_buf if region == 0 else self.maps[region]

    def collect(self) -> None:
        """Unmap regions whose name is gone (their client disconnected or closed them)."""
        for region in list(self.maps):
            if not os.path.exists(f"/dev/shm/shmserve.{self.instance}.r{region}"):
                m = self.maps.pop(region)
                self.sizes.pop(region)
                if m is not None:
                    m.close()

    def close(self) -> None:
        for m in self.maps.values():
            if m is not None:
                m.close()
        self.maps.clear()
        self.sizes.clear()


class Worker:
    def __init__(self, arena: Arena, index: int, config: ModelConfig, control: socket.socket,
                 completion_fd: int, spin_s: float):
        self.arena, self.index, self.config, self.control = arena, index, config, control
        self.buf, self.geometry = arena.buf, arena.geometry
        self.entry_off = self.geometry.worker_off(index)
        self.submissions = Ring.of_worker(arena, index, completion=False)
        self.completions = Ring.of_worker(arena, index, completion=True)
        self.inbox = FutexDoorbell(self.submissions)
        self.outbox = EventfdDoorbell(self.completions, completion_fd)
        self.spin_s = spin_s
        self.regions = RegionCache(arena.instance)
        self.backend = None
        self.spec: ModelSpec | None = None
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
        inputs = merge_overrides(self.backend.inputs, cfg.inputs)
        outputs = merge_overrides(self.backend.outputs, cfg.outputs)
        if not inputs or not outputs:
            raise ValueError(f"model {cfg.name!r}: the backend cannot tell its inputs/outputs; "
                             f"declare them in the config")
        self.spec = ModelSpec(cfg.name, cfg.backend, inputs, outputs,
                              {"path": cfg.path, "device": cfg.device})
        result = self.backend.run(warmup_inputs(inputs))
        missing = {t.name for t in outputs} - set(result)
        if missing:
            raise ValueError(f"model {cfg.name!r}: warm-up run did not return outputs {sorted(missing)}")

    def serve(self) -> int:
        self._set_state(layout.WORKER_READY)
        self._beat()
        while True:
            if not self.inbox.wait(timeout=IDLE_TICK_S, spin=self.spin_s):
                self._beat()
                if os.getppid() != self.ppid:
                    return workerlink.EXIT_ORPHANED
                self.regions.collect()
                continue
            for entry in self.submissions.pop_all():
                if entry == workerlink.STOP_ENTRY:
                    self._set_state(layout.WORKER_STOPPING)
                    return workerlink.EXIT_OK
                self.process(entry)
            self._beat()

    # -- one request ----------------------------------------------------------------------

    def process(self, entry: int) -> None:
        index, generation = entry & 0xFFFFFFFF, entry >> 32
        arena = self.arena
        if not 0 <= index < self.geometry.slot_count:
            return  # hostile or corrupt entry: nothing to answer
        if arena.slot_status(index) != (generation, SlotState.READY):
            return  # failed or reused by the front-end meanwhile (timeout, shutdown)
        try:
            arena.transition(index, generation, SlotState.READY, SlotState.RUNNING, Actor.WORKER)
        except SlotConflict:
            return
        arena.stamp(index, "t_claimed")
        try:
            n_outputs = self._run(index)
            failure = None
        except RequestFailed as exc:
            failure = (exc.code, exc.message)
        except Exception as exc:  # a bug here must fail one request, not kill the worker
            failure = (ErrorCode.INTERNAL, f"worker: {type(exc).__name__}: {exc}")
        if failure is not None:
            layout.encode_error(self.buf, self.geometry, index, *failure)
            layout.SLOT.write(self.buf, self.geometry.slot_off(index), n_outputs=0)
            arena.stamp(index, "t_done")
            arena.transition(index, generation, SlotState.RUNNING, SlotState.ERROR, Actor.WORKER)
            self._count("errors")
        else:
            layout.SLOT.write(self.buf, self.geometry.slot_off(index), n_outputs=n_outputs)
            arena.stamp(index, "t_done")
            # Order matters here: outputs and descriptors are written before DONE is published.
            arena.transition(index, generation, SlotState.RUNNING, SlotState.DONE, Actor.WORKER)
        self._count("requests")
        self.completions.push(entry)
        self.outbox.notify()

    def _run(self, index: int) -> int:
        g, buf, spec = self.geometry, self.buf, self.spec
        slot = layout.SLOT.read(buf, g.slot_off(index))
        if not 0 < slot.n_inputs <= len(spec.inputs) or slot.n_inputs >= layout.MAX_TENSORS:
            raise RequestFailed(ErrorCode.INTERNAL, f"slot has {slot.n_inputs} inputs")
        inputs = {}
        try:
            for t in range(slot.n_inputs):
                self.regions.ensure(layout.region_of_tensor(buf, g, index, t))
                desc = layout.decode_tensor(buf, g, index, t, self.regions.sizes)
                if desc.role != layout.ROLE_INPUT or desc.name_index >= len(spec.inputs):
                    raise RequestFailed(ErrorCode.INTERNAL, f"tensor {t} is not an input of this model")
                view = np.ndarray(desc.shape, desc.dtype, buffer=self.regions.buffer(desc.region, buf),
                                  offset=desc.offset)
                view.flags.writeable = False
                inputs[spec.inputs[desc.name_index].name] = view
        except layout.LayoutError as exc:
            raise RequestFailed(ErrorCode.BAD_REGION, f"input descriptor rejected: {exc}") from None
        self.arena.stamp(index, "t_compute_start")
        try:
            results = self.backend.run(inputs)
        except Exception as exc:  # the model's failure is this request's error, not the worker's
            raise RequestFailed(ErrorCode.MODEL_ERROR, f"{type(exc).__name__}: {exc}") from None
        finally:
            del inputs
        self.arena.stamp(index, "t_compute_end")
        return self._write_outputs(index, slot, results)

    def _write_outputs(self, index: int, slot, results) -> int:
        g, buf, spec = self.geometry, self.buf, self.spec
        region = slot.out_region
        self.regions.ensure(region)
        base, capacity = slot.out_off, slot.out_capacity
        limit = self.regions.sizes.get(region) if region else None
        if region == 0 and not g.contains_data(base, capacity):
            raise RequestFailed(ErrorCode.INTERNAL, "output area lies outside the data region")
        if region and base + capacity > limit:
            raise RequestFailed(ErrorCode.BAD_REGION, "output area lies outside the region")
        target = self.regions.buffer(region, buf)
        if slot.n_inputs + len(spec.outputs) > layout.MAX_TENSORS:
            raise RequestFailed(ErrorCode.INTERNAL, "too many tensors for one slot")
        pos = 0
        for i, t in enumerate(spec.outputs):
            if t.name not in results:
                raise RequestFailed(ErrorCode.MODEL_ERROR, f"model did not return output {t.name!r}")
            arr = np.asarray(results[t.name])
            if arr.dtype.name != t.dtype:
                raise RequestFailed(ErrorCode.MODEL_ERROR,
                                    f"output {t.name!r} is {arr.dtype.name}, declared {t.dtype}")
            pos = (pos + layout.TENSOR_ALIGN - 1) // layout.TENSOR_ALIGN * layout.TENSOR_ALIGN
            if pos + arr.nbytes > capacity:
                raise RequestFailed(ErrorCode.OUTPUT_TOO_LARGE,
                                    f"outputs need more than the {capacity} bytes reserved for them "
                                    f"(output {t.name!r} is {arr.nbytes} bytes); raise max_output_bytes")
            dst = np.ndarray(arr.shape, arr.dtype, buffer=target, offset=base + pos)
            np.copyto(dst, arr, casting="no")
            del dst
            layout.encode_tensor(buf, g, index, slot.n_inputs + i, role=layout.ROLE_OUTPUT, name_index=i,
                                 dtype=arr.dtype, shape=arr.shape, offset=base + pos, region=region)
            pos += arr.nbytes
        return len(spec.outputs)

    def close(self) -> None:
        self.regions.close()
        if self.backend is not None:
            self.backend.close()


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
    worker = Worker(arena, args.index, config, control, args.completion_fd, args.spin_us / 1e6)
    try:
        try:
            worker.load()
        except Exception as exc:
            message = f"cannot load model {config.name!r} ({config.backend}, {config.path}): " \
                      f"{type(exc).__name__}: {exc}"
            control.send(workerlink.encode({"event": "failed", "error": message}))
            return workerlink.EXIT_LOAD_FAILED
        control.send(workerlink.encode({"event": "ready", "spec": worker.spec.to_dict()}))
        return worker.serve()
    finally:
        worker.close()
        del worker
        arena.close()
        control.close()


if __name__ == "__main__":
    sys.exit(main())
