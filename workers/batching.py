"""Dynamic batching: requests that arrive close together run as one backend call.

Owns: gathering a batch (take up to ``max_batch_size`` requests in the order
the worker's scheduler gives them — highest priority level first,
``shmserve.scheduling`` —, waiting at most ``max_queue_delay_us`` for more,
stopping early at a preferred size when nothing else is queued), grouping what was claimed by everything but
the leading (batch) dimension of its inputs, running each group once with
its inputs concatenated along that dimension (one copy), and answering each
request from its own rows.  A request whose inputs do not share one leading
size is no set of rows: it runs alone.

Where a batch's outputs go depends on what the backend states
(``workers.adapter``):

* ``writes_row_splits`` (torch, TensorRT): ``allocate`` returns a
  ``workers.backends.RowSplit`` per output, naming each request's rows and
  its output view; the backend writes them straight into each request's
  output area, as it would for a single request.  The worker copies nothing.
* another ``run_into`` backend: host scratch arrays for the whole batch,
  then each request's rows copied into its output area;
* a ``run`` backend: the arrays it returns, each request's rows copied.

Either way a batch's outputs equal those of its requests run one by one, and
an output without the batch's rows fails the whole batch ("this model cannot
be batched").  A request whose own output area cannot take its rows fails
alone; the others are answered.

Must not: read ring entries, carry out commands or order requests
(``Submissions`` does: the serve loop and its scheduler, which also claims), or
decode, place and publish other than through ``workers.step.Step``.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

import numpy as np

from shmserve import layout
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode
from shmserve.spec import ModelSpec
from workers.backends import RowPart, RowSplit
from workers.step import RequestFailed, Space, Step, model_failure, worker_failure


class Submissions(Protocol):
    """What batching needs of the serve loop while it gathers a batch."""

    def gather(self) -> tuple[list[tuple[Space, int]], bool]:
        """Everything submitted now as (space, ring entry) pairs, and whether a stop came."""

    def wait_for_more(self, timeout: float) -> bool:
        """Sleep until something is submitted (True) or ``timeout`` seconds pass (False)."""

    def pending(self) -> bool:
        """Whether anything is submitted and not gathered yet."""

    def hold(self, work: list[tuple[Space, int]]) -> None:
        """Hold gathered entries for ``take``, in the scheduler's order."""

    def take(self) -> tuple[Space, int, int] | None:
        """The next request held, claimed: (space, entry, slot index); None if none is held."""



class Request(NamedTuple):
    """A claimed and decoded request of a batch."""

    space: Space
    entry: int
    index: int
    slot: layout.SlotRequest
    inputs: dict[str, np.ndarray]


def batchable(spec: ModelSpec) -> bool:
    """Every input and output of the model has a dynamic leading (batch) dimension."""
    return all(t.shape and not isinstance(t.shape[0], int) for t in spec.inputs + spec.outputs)


class Batcher:
    """Runs a worker's requests in batches as ``config`` asks (``max_batch_size`` > 1)."""

    def __init__(self, step: Step, config: ModelConfig):
        self.step = step
        self.max_batch_size = config.max_batch_size
        self.delay_s = config.max_queue_delay_us / 1e6
        self.preferred = frozenset(config.preferred_batch_sizes)

    def run(self, work: list[tuple[Space, int]], source: Submissions) -> bool:
        """Take up to max_batch_size requests of ``work`` and of what ``source`` holds and gathers
        meanwhile, in its order (the highest priority level first), run compatible ones as one
        batch, answer each; the rest stays held by ``source`` for the next batch.  Returns whether
        a stop came (then the caller runs what is held and stops)."""
        step = self.step
        claimed: list[tuple[Space, int, int]] = []
        source.hold(work)
        stop = False
        deadline = time.monotonic() + self.delay_s
        while True:
            while len(claimed) < self.max_batch_size:
                taken = source.take()
                if taken is None:
                    break
                claimed.append(taken)
            remaining = deadline - time.monotonic()
            if len(claimed) >= self.max_batch_size or remaining <= 0 or \
                    (len(claimed) in self.preferred and not source.pending()):
                break
            if source.wait_for_more(remaining):
                more, stop = source.gather()
                source.hold(more)
                if stop:  # run what we have, then stop: the caller runs what is held
                    break
        groups: dict[tuple, list[Request]] = {}
        for space, entry, index in claimed:
            try:
                slot, inputs = step.decode(space, index)
            except Exception as exc:
                step.finish(space, entry, index, 0, worker_failure(exc))
                continue
            if len({v.shape[0] for v in inputs.values()}) > 1:
                # Inputs that disagree on the leading dimension are not rows of one batch (the spec does
                # not hold them equal unless check_dims asks): the model runs this request alone.
                step.serve_claimed(space, entry, index)
                continue
            key = tuple(sorted((n, v.dtype.name, v.shape[1:]) for n, v in inputs.items()))
            groups.setdefault(key, []).append(Request(space, entry, index, slot, inputs))
        for members in groups.values():
            self.execute(members)
        return stop

    def execute(self, members: list[Request]) -> None:
        """One backend run for compatible requests (their inputs agree but for the leading
        dimension): inputs concatenated along it, outputs written or copied into each request's
        own output area; every request answered."""
        step, adapter = self.step, self.step.adapter
        placers, ready = [], []
        for r in members:  # a request whose output area is unusable fails before the run
            try:
                placers.append(step.place(r.space, r.index, r.slot))
            except Exception as exc:
                step.finish(r.space, r.entry, r.index, 0, worker_failure(exc))
                continue
            ready.append(r)
        if not ready:
            return
        rows = [next(iter(r.inputs.values())).shape[0] for r in ready]
        total = sum(rows)
        failures: list[tuple[ErrorCode, str] | None] = [None] * len(ready)
        now = time.monotonic_ns()
        for r in ready:
            layout.stamp(r.space.buf, r.space.geometry, r.index, "t_compute_start", now)
        try:
            batch = {n: np.concatenate([r.inputs[n] for r in ready], axis=0) if len(ready) > 1 else ready[0].inputs[n]
                     for n in step.input_names}
            if adapter.writes_row_splits:
                results = None
                written = self._run_in_place(batch, placers, rows, total, failures)
            elif adapter.writes_outputs:
                results = {}

                def scratch(name, shape, dtype):
                    results[name] = np.empty(shape, dtype)
                    return results[name]

                adapter.run_into(batch, scratch)
                written = results
            else:
                results = written = adapter.run(batch)
            del batch
            adapter.synchronize()  # a GPU backend's writes land before anything is read or published
            for name in step.output_dtypes:
                if name not in written:
                    raise RequestFailed(ErrorCode.MODEL_ERROR, f"model did not return output {name!r}")
                if results is not None and (np.ndim(results[name]) == 0 or np.shape(results[name])[0] != total):
                    raise _not_batchable(name, total)
        except Exception as exc:
            step.settle()
            failure = model_failure(exc)
            for r in ready:
                step.finish(r.space, r.entry, r.index, 0, failure)
            return
        now = time.monotonic_ns()
        start = 0
        for r, placer, n, failure in zip(ready, placers, rows, failures):
            layout.stamp(r.space.buf, r.space.geometry, r.index, "t_compute_end", now)
            n_outputs = 0
            if failure is None:
                try:
                    if results is not None:
                        for name in step.output_dtypes:
                            placer.put(name, results[name][start:start + n])
                    n_outputs = placer.finish()
                except Exception as exc:
                    failure = worker_failure(exc)
            step.finish(r.space, r.entry, r.index, n_outputs, failure)
            start += n
        step.record_batch(len(ready))

    def _run_in_place(self, batch: dict[str, np.ndarray], placers: list, rows: list[int], total: int,
                      failures: list) -> dict[str, RowSplit]:
        """Run a backend that writes a batch's outputs into each request's own output area: its
        ``allocate`` answers with a RowSplit of the requests' views.  A request whose area cannot
        take its rows gets its failure in ``failures`` and a throwaway array for them.  Returns
        the RowSplit of each output the backend asked for (keep it until the backend is
        synchronized: a GPU may still be writing into its throwaway arrays)."""
        written: dict[str, RowSplit] = {}

        def allocate(name: str, shape, dtype) -> RowSplit:
            shape = tuple(int(d) for d in shape)
            if not shape or shape[0] != total:
                raise _not_batchable(name, total)
            dtype, tail = np.dtype(dtype), shape[1:]
            parts, start = [], 0
            for k, (placer, n) in enumerate(zip(placers, rows)):
                try:
                    view = placer.allocate(name, (n, *tail), dtype)
                except RequestFailed as exc:
                    failures[k] = failures[k] or (exc.code, exc.message)
                    view = np.empty((n, *tail), dtype)  # unread: this request is answered with its error
                parts.append(RowPart(start, start + n, view))
                start += n
            written[name] = split = RowSplit(shape, dtype, tuple(parts))
            return split

        self.step.adapter.run_into(batch, allocate)
        return written


def _not_batchable(name: str, total: int) -> RequestFailed:
    return RequestFailed(ErrorCode.MODEL_ERROR, f"output {name!r} does not have the batch's {total} rows; "
                                                f"this model cannot be batched")
