"""What a model takes and returns, and how a request is checked against it.

Owns: ``TensorSpec``/``ModelSpec`` (names, dtypes, shapes with dynamic
dimensions), merging config overrides into what a backend reports, checking
a request's inputs (names, dtypes, ranks, fixed dimensions, symbolic
dimensions bound consistently), and estimating output sizes before running.

Must not: import a model runtime.  Workers build specs from their backend and
send them to the front-end as plain dicts (``to_dict``/``from_dict``).

A dimension is an int (fixed), a str (a named dynamic dimension: every use
of the same name in one request must agree, and outputs may refer to it), or
None (dynamic, unnamed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np

from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import SUPPORTED_DTYPES, TensorMeta, tensor_nbytes

Dim = Union[int, str, None]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        dtype = np.dtype(d["dtype"]).name
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"tensor {d['name']!r}: dtype {dtype} is not supported")
        shape = tuple(None if (x is None or (isinstance(x, int) and x < 0)) else x for x in d["shape"])
        for x in shape:
            if not (x is None or isinstance(x, (int, str))):
                raise ValueError(f"tensor {d['name']!r}: bad dimension {x!r}")
        return cls(str(d["name"]), dtype, shape)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    backend: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    extra: dict = field(default_factory=dict, compare=False)  # path, device, ... for listings

    def to_dict(self) -> dict:
        return {"name": self.name, "backend": self.backend, **self.extra,
                "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        extra = {k: v for k, v in d.items() if k not in ("name", "backend", "inputs", "outputs")}
        return cls(d["name"], d["backend"], tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                   tuple(TensorSpec.from_dict(t) for t in d["outputs"]), extra)

    def input_index(self, name: str) -> int:
        for i, t in enumerate(self.inputs):
            if t.name == name:
                return i
        raise KeyError(name)


def merge_overrides(reported: Sequence[TensorSpec], overrides: Sequence[TensorSpec] | None) -> tuple[TensorSpec, ...]:
    """Config overrides replace reported tensors by name; an override naming a tensor the
    model does not have is an error (a typo would otherwise be silently ignored)."""
    if not overrides:
        return tuple(reported)
    by_name = {t.name: t for t in reported}
    for o in overrides:
        if reported and o.name not in by_name:
            raise ValueError(f"override for tensor {o.name!r}, which the model does not have "
                             f"(it has {', '.join(by_name)})")
        by_name[o.name] = o
    return tuple(by_name.values())


def bind_inputs(spec: ModelSpec, inputs: Sequence[TensorMeta]) -> dict[str, int]:
    """Check a request's inputs against ``spec``; return the bound symbolic dimensions.

    Raises ShmserveError with BAD_INPUT (names), BAD_DTYPE or BAD_SHAPE.
    """
    given = {t.name: t for t in inputs}
    expected = {t.name for t in spec.inputs}
    missing, extra = expected - given.keys(), given.keys() - expected
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {sorted(missing)}")
        if extra:
            parts.append(f"unknown {sorted(extra)}")
        raise ShmserveError(ErrorCode.BAD_INPUT, f"model {spec.name!r} inputs: {', '.join(parts)}; "
                                                 f"expected {[t.name for t in spec.inputs]}")
    symbols: dict[str, int] = {}
    for t in spec.inputs:
        got = given[t.name]
        if got.dtype != t.dtype:
            raise ShmserveError(ErrorCode.BAD_DTYPE, f"input {t.name!r} must be {t.dtype}, got {got.dtype}")
        if len(got.shape) != len(t.shape):
            raise ShmserveError(ErrorCode.BAD_SHAPE, f"input {t.name!r} must have rank {len(t.shape)} "
                                                     f"(shape {_show(t.shape)}), got {list(got.shape)}")
        for axis, (want, have) in enumerate(zip(t.shape, got.shape)):
            if isinstance(want, int) and want != have:
                raise ShmserveError(ErrorCode.BAD_SHAPE, f"input {t.name!r} dimension {axis} must be {want}, "
                                                         f"got {have} (shape {_show(t.shape)})")
            if isinstance(want, str):
                if symbols.setdefault(want, have) != have:
                    raise ShmserveError(ErrorCode.BAD_SHAPE, f"input {t.name!r} dimension {axis} ({want!r}) is "
                                                             f"{have}, but another input has {want!r} = {symbols[want]}")
    return symbols


def estimate_output_bytes(spec: ModelSpec, symbols: dict[str, int], fallback: int) -> int:
    """Bytes to reserve for outputs: exact where every dimension is fixed or bound by the
    inputs, ``fallback`` for each output that has an unknown dimension."""
    total = 0
    for t in spec.outputs:
        dims = [d if isinstance(d, int) else symbols.get(d) if isinstance(d, str) else None for d in t.shape]
        total += fallback if any(d is None for d in dims) else tensor_nbytes(t.dtype, dims)
        total += 64  # each output starts on a cache line
    return total


def _show(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
