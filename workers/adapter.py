"""What a loaded backend can do, asked once at load.

Owns: the only questions the worker asks a backend object about itself.
``BackendAdapter`` looks at the backend once, when it is built, and states
what it found: whether it writes its outputs itself (``run_into``) or
returns arrays (``run``), and whether it synchronizes a stream, takes the
GPU's registered memory, wants the final specs declared, supplies its own
warm-up inputs, tells the device memory it holds, or writes a batch's
outputs straight into each request's output area (``accepts_row_splits``,
see ``workers.backends.RowSplit``), or runs thread pools (``threads``: a dict,
or a method returning one, of its runtime's ``intra_op`` and ``inter_op``
threads, for ``shmserve doctor``).
Every optional call is offered in one shape (missing means a no-op), so the
rest of the worker calls without asking.  ``prepare`` turns the backend and
the model's config into its ``ModelSpec``; ``warm_up`` runs it on the
config's warm-up inputs (``workers.warmup``), checking every output comes out.

Must not: run requests, touch shared memory, or be bypassed: nothing else in
the worker uses ``hasattr``/``getattr`` on a backend (a backend object is
asked once; attributes it grows later are not seen).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from shmserve.config import ModelConfig
from shmserve.spec import ModelSpec, check_dims_used, merge_overrides
from workers import warmup
from workers.backends import find


@dataclass(frozen=True)
class Warmup:
    """What a warm-up ran: ``runs`` runs in ``seconds`` (the ready message's ``warmup``)."""

    runs: int
    seconds: float

    def to_dict(self) -> dict:
        return {"runs": self.runs, "seconds": round(self.seconds, 6)}


def _nothing(*_args) -> None:
    return None


class BackendAdapter:
    """A loaded backend and what it can do, fixed at construction (a context manager that closes it).

    Statements: ``writes_outputs`` (``run_into``; else ``run``),
    ``synchronizes``, ``takes_memory``, ``takes_declare``, ``own_warmup``,
    ``tells_device_bytes``, ``writes_row_splits`` (only with
    ``writes_outputs``), ``closes``.
    Calls: ``run_into`` or ``run`` (the one it has; the other is None),
    ``synchronize()``, ``bind_memory(memory)``, ``declare(inputs, outputs)``,
    ``device_bytes()`` (int, or None: it cannot tell), ``threads()`` (a dict,
    {} if it does not say), ``close()`` — the
    optional ones are no-ops (returning None) where the backend lacks them.
    ``inputs``/``outputs``: what the backend tells of its tensors (empty if
    nothing).

    Raises TypeError for an object with neither ``run`` nor ``run_into``.
    """

    __slots__ = ("backend", "run", "run_into", "synchronize", "bind_memory", "declare", "device_bytes", "close",
                 "inputs", "outputs", "writes_outputs", "synchronizes", "takes_memory", "takes_declare", "own_warmup",
                 "tells_device_bytes", "writes_row_splits", "closes", "_warmup", "_threads")

    def __init__(self, backend):
        self.backend = backend
        run_into = getattr(backend, "run_into", None)
        run = getattr(backend, "run", None) if run_into is None else None
        if run_into is None and run is None:
            raise TypeError(f"{type(backend).__name__} is not a backend: it has neither run nor run_into")
        self.run_into, self.run = run_into, run
        self.writes_outputs = run_into is not None
        self.writes_row_splits = self.writes_outputs and getattr(backend, "accepts_row_splits", False) is True
        sync = getattr(backend, "synchronize", None)
        bind = getattr(backend, "bind_memory", None)
        declare = getattr(backend, "declare", None)
        own_inputs = getattr(backend, "warmup_inputs", None)
        device_bytes = getattr(backend, "device_bytes", None)
        close = getattr(backend, "close", None)
        self.synchronizes, self.takes_memory, self.takes_declare = sync is not None, bind is not None, \
            declare is not None
        self.own_warmup, self.closes = own_inputs is not None, close is not None
        self.tells_device_bytes = device_bytes is not None
        self.synchronize = sync or _nothing
        self.bind_memory = bind or _nothing
        self.declare = declare or _nothing
        self.device_bytes = device_bytes or _nothing
        self.close = close or _nothing
        self._warmup = own_inputs
        self.inputs = tuple(getattr(backend, "inputs", None) or ())
        self.outputs = tuple(getattr(backend, "outputs", None) or ())
        self._threads = getattr(backend, "threads", None)

    def threads(self) -> dict:
        """The thread pools the backend says its runtime runs (``{"runtime", "intra_op", "inter_op"}``;
        {} when it does not say, or says something that is not a dict)."""
        found = self._threads() if callable(self._threads) else self._threads
        return dict(found) if isinstance(found, dict) else {}

    @classmethod
    def load(cls, config: ModelConfig) -> "BackendAdapter":
        """Load ``config``'s model with its backend's loader (raises what the loader raises)."""
        return cls(find(config.backend)(config))

    def __enter__(self) -> "BackendAdapter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prepare(self, config: ModelConfig, memory=None) -> ModelSpec:
        """Make the loaded backend ready to serve ``config`` (then ``warm_up``); its final spec.

        Binds the GPU's registered ``memory`` (None on a CPU worker), merges
        the config's tensor overrides into what the backend tells, and
        declares the result.  ValueError if the specs are unknown or name a
        dimension ``check_dims`` does not have; whatever the backend raises
        otherwise.
        """
        if memory is not None:
            self.bind_memory(memory)
        inputs = merge_overrides(self.inputs, config.inputs)
        outputs = merge_overrides(self.outputs, config.outputs)
        if not inputs or not outputs:
            raise ValueError(f"model {config.name!r}: the backend cannot tell its inputs/outputs; "
                             f"declare them in the config")
        spec = ModelSpec(config.name, config.backend, inputs, outputs, {"path": config.path, "device": config.device},
                         check_dims=config.check_dims)
        check_dims_used(spec)
        self.declare(inputs, outputs)
        return spec

    def warm_up(self, config: ModelConfig, spec: ModelSpec) -> Warmup:
        """Run the prepared model as ``config``'s warm-up asks (``workers.warmup``: its samples, at
        each batch size, ``warmup_requests`` times; at least once), checking that every run
        produces every output of ``spec``; what it ran.

        ValueError if a sample file does not fit (naming it) or a run leaves out an output;
        whatever the backend raises otherwise.
        """
        own = self._warmup() if self._warmup is not None else None
        started = time.monotonic()
        count = 0
        for size, inputs in warmup.runs(config, spec.inputs, own):
            if self.writes_outputs:
                scratch: list[np.ndarray] = []
                self.run_into(inputs, lambda name, shape, dtype: scratch.append(np.empty(shape, dtype)) or scratch[-1])
                self.synchronize()
                got = len(scratch)
            else:
                got = len(set(self.run(inputs)) & {t.name for t in spec.outputs})
            count += 1
            if got != len(spec.outputs):
                at = "" if size is None else f" at batch size {size}"
                raise ValueError(f"model {config.name!r}: warm-up run{at} produced {got} of {len(spec.outputs)} "
                                 f"outputs")
        return Warmup(count, time.monotonic() - started)
