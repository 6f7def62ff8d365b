"""The backend interface and the registry that finds backends by name.

Owns: what a backend must provide (``Backend``; ``RowSplit``, the
destination of a batch's output), and name -> loader resolution: the
built-ins, then any installed package's ``shmserve.backends`` entry point
(``name = "pkg.module:load"``); which names exist is the worker contract's
(``shmserve.workerlink.BUILTIN_BACKENDS``, ``backend_names``), so the
configuration checks names without importing this package.  Adding a backend
touches neither the front-end nor the protocol.

A loader is ``load(config: ModelConfig) -> Backend``; it raises on failure
(the worker reports the message and exits with EXIT_LOAD_FAILED).

Must not: import a backend's module or its runtime until ``find`` is asked
for it: backends import model runtimes.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Callable, Mapping, NamedTuple, Protocol

import numpy as np

from shmserve import layout, workerlink
from shmserve.spec import TensorSpec

ENTRY_POINT_GROUP = workerlink.BACKEND_ENTRY_POINTS
BUILTIN = workerlink.BUILTIN_BACKENDS


class Backend(Protocol):
    """A loaded model.

    ``inputs``/``outputs`` are what the runtime can tell (config overrides are
    merged by the worker).  A backend provides one of:

    * ``run(inputs) -> {name: array}``: receives numpy views of shared memory
      (do not keep them after returning); the worker copies the returned
      arrays into the output area;
    * ``run_into(inputs, allocate)``: writes each output itself into
      ``allocate(name, shape, dtype)`` (a writable numpy view of the output
      area) — how GPU backends put results straight into shared memory.
      ``allocate`` raises when the output is not what the model declared or
      does not fit: let that propagate (it fails the request).

    With both, ``run_into`` is used.  Optional: ``declare(inputs, outputs)``
    (the final specs, before warm-up), ``bind_memory(device_memory)`` (GPU
    workers: host view -> device address), ``synchronize()`` (called before
    DONE or ERROR is published: wait for the stream), ``warmup_inputs()``
    (a sample of each input for the warm-up at load, for those the config's
    ``warmup.inputs`` does not give; default: zeros of the smallest valid
    shape; ``workers.warmup``), ``device_bytes()`` (the device memory it holds,
    in bytes, or None if it cannot tell: counted against the memory budget
    instead of the device's use around the load; ``workers.memory``),
    ``close()``.

    Batches written in place: a ``run_into`` backend with
    ``accepts_row_splits = True`` (a class attribute, say) may, when the
    worker runs several requests as one batch, get a ``RowSplit`` from
    ``allocate`` instead of an array: the batch's output is not one area but
    each request's rows, to be written into each request's own output view
    (``RowSplit.parts``), as that request's output would be alone.  Without
    it, the worker hands the backend host scratch arrays for a batch and
    copies each request's rows out of them.

    The worker asks what a backend has once, at load (``workers.adapter``);
    attributes added later are not seen.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def run(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]: ...

    def close(self) -> None: ...


class RowPart(NamedTuple):
    """Rows ``[start, stop)`` of a batch's output, and the view (``stop - start`` rows) they go to."""

    start: int
    stop: int
    view: np.ndarray


class RowSplit(NamedTuple):
    """Where one output of a batch goes: each request's rows into its own output area.

    ``shape``/``dtype`` are the whole batch's output (as the backend asked for
    it); ``parts`` cover its rows in order, one per request, each with a
    writable numpy view of that request's output area (in page-locked shared
    memory on a GPU worker; a throwaway array for a request that has already
    failed).  Handed only to backends that declare ``accepts_row_splits``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: tuple[RowPart, ...]


class BackendNotFound(LookupError):
    pass


def refuse_bytes(backend: str, inputs, outputs) -> None:
    """For a backend whose models take only fixed-size tensors (its ``declare``): ValueError naming
    the tensors the final specs declare bytes, so that the model does not load."""
    carried = [t.name for t in (*inputs, *outputs) if t.dtype == layout.BYTES]
    if carried:
        raise ValueError(f"tensors {', '.join(map(repr, carried))} are declared bytes, which a {backend} model "
                         f"cannot take or return: serve it with the python or onnxruntime backend")


names = workerlink.backend_names


def find(name: str) -> Callable:
    """Return the loader of backend ``name``; BackendNotFound lists what exists."""
    target = BUILTIN.get(name)
    if target is None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                return ep.load()
        raise BackendNotFound(f"no backend {name!r} (available: {', '.join(names())})")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)

