"""What a loaded backend can do, asked once at load.

Owns: the only questions the worker asks a backend object about itself.
``BackendAdapter`` looks at the backend once, when it is built, and states
what it found: whether it writes its outputs itself (``run_into``) or
returns arrays (``run``), and whether it synchronizes a stream, takes the
GPU's registered memory, wants the final specs declared, supplies its own
warm-up inputs, or writes a batch's outputs straight into each request's
output area (``accepts_row_splits``, see ``workers.backends.RowSplit``).
Every optional call is offered in one shape (missing means a no-op), so the
rest of the worker calls without asking.  ``prepare`` turns the backend and
the model's config into its ``ModelSpec`` and warms it up.

Must not: run requests, touch shared memory, or be bypassed: nothing else in
the worker uses ``hasattr``/``getattr`` on a backend (a backend object is
asked once; attributes it grows later are not seen).
"""

from __future__ import annotations

import numpy as np

from shmserve.config import ModelConfig
from shmserve.spec import ModelSpec, check_dims_used, merge_overrides
from workers.backends import find, warmup_inputs


def _nothing(*_args) -> None:
    return None


class BackendAdapter:
    """A loaded backend and what it can do, fixed at construction (a context manager that closes it).

    Statements: ``writes_outputs`` (``run_into``; else ``run``),
    ``synchronizes``, ``takes_memory``, ``takes_declare``, ``own_warmup``,
    ``writes_row_splits`` (only with ``writes_outputs``), ``closes``.
    Calls: ``run_into`` or ``run`` (the one it has; the other is None),
    ``synchronize()``, ``bind_memory(memory)``, ``declare(inputs, outputs)``,
    ``warmup_inputs(specs)``, ``close()`` — the optional ones are no-ops
    where the backend lacks them.  ``inputs``/``outputs``: what the backend
    tells of its tensors (empty if nothing).

    Raises TypeError for an object with neither ``run`` nor ``run_into``.
    """

    __slots__ = ("backend", "run", "run_into", "synchronize", "bind_memory", "declare", "close", "inputs", "outputs",
                 "writes_outputs", "synchronizes", "takes_memory", "takes_declare", "own_warmup",
                 "writes_row_splits", "closes", "_warmup")

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
        warmup = getattr(backend, "warmup_inputs", None)
        close = getattr(backend, "close", None)
        self.synchronizes, self.takes_memory, self.takes_declare = sync is not None, bind is not None, \
            declare is not None
        self.own_warmup, self.closes = warmup is not None, close is not None
        self.synchronize = sync or _nothing
        self.bind_memory = bind or _nothing
        self.declare = declare or _nothing
        self.close = close or _nothing
        self._warmup = warmup
        self.inputs = tuple(getattr(backend, "inputs", None) or ())
        self.outputs = tuple(getattr(backend, "outputs", None) or ())

    @classmethod
    def load(cls, config: ModelConfig) -> "BackendAdapter":
        """Load ``config``'s model with its backend's loader (raises what the loader raises)."""
        return cls(find(config.backend)(config))

    def __enter__(self) -> "BackendAdapter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warmup_inputs(self, specs) -> dict[str, np.ndarray]:
        """The backend's own warm-up inputs, or zeros of the smallest valid shape of ``specs``."""
        return self._warmup() if self._warmup is not None else warmup_inputs(specs)

    def prepare(self, config: ModelConfig, memory=None) -> ModelSpec:
        """Make the loaded backend ready to serve ``config``; its final spec.

        Binds the GPU's registered ``memory`` (None on a CPU worker), merges
        the config's tensor overrides into what the backend tells, declares
        the result, and runs it once on warm-up inputs.  ValueError if the
        specs are unknown or the warm-up run does not produce every output;
        whatever the backend raises otherwise.
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
        warm = self.warmup_inputs(inputs)
        if self.writes_outputs:
            scratch: list[np.ndarray] = []
            self.run_into(warm, lambda name, shape, dtype: scratch.append(np.empty(shape, dtype)) or scratch[-1])
            self.synchronize()
            got = len(scratch)
        else:
            got = len(set(self.run(warm)) & {t.name for t in outputs})
        if got != len(outputs):
            raise ValueError(f"model {config.name!r}: warm-up run produced {got} of {len(outputs)} outputs")
        return spec
