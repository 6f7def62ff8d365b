"""What a model takes and returns, and how a request is checked against it.

Owns: ``TensorSpec``/``ModelSpec`` (names, dtypes, shapes with dynamic
dimensions), merging config overrides into what a backend reports, checking
a request's inputs (names, dtypes, ranks, fixed dimensions, and the named
dimensions the config asks to agree), and estimating output sizes before
running.

Must not: import a model runtime, or refuse a request the model's runtime
would run: what a dimension's name means is the exporter's business.
Workers build specs from their backend and send them to the front-end as
plain dicts (``to_dict``/``from_dict``).

A dimension is an int (fixed), a str (a named dynamic dimension), or None
(dynamic, unnamed; the placeholders exporters write, ``?`` and ``None``,
are read as None).  Only rank and fixed dimensions are checked by default:
exporters give unrelated dimensions one name (``DynamicDimension.0`` on
every input) and runtimes do not hold them equal, so neither do we.  The
names in ``ModelSpec.check_dims`` (the model's ``check_dims`` config key)
must agree across one request's inputs.  Outputs may refer to a name the
inputs bind to one value; one bound to several values, or to none, leaves
that output's size unknown (``estimate_output_bytes`` reserves the
fallback for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np

from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import BYTES, SUPPORTED_DTYPES, TensorMeta, tensor_nbytes

Dim = Union[int, str, None]
PLACEHOLDER_DIMS = frozenset({"", "?", "None"})  # names exporters write for "unknown": read as None


def dim_of(x) -> Dim:
    """A dimension as a spec keeps it: an int >= 0, a name, or None (negative ints and placeholders)."""
    if x is None or (isinstance(x, int) and x < 0) or (isinstance(x, str) and x in PLACEHOLDER_DIMS):
        return None
    return x


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self):  # however a backend built it, placeholders and negative sizes are None
        object.__setattr__(self, "shape", tuple(dim_of(x) for x in self.shape))

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        """``d``'s dtype is one of ``SUPPORTED_DTYPES`` or a numpy dtype (or name) of one of the
        fixed-size ones ("f4", numpy.float32, ml_dtypes.bfloat16).  ValueError otherwise, or for
        a dimension that is not an int, a str or None."""
        given = d["dtype"]
        dtype = given if isinstance(given, str) and given in SUPPORTED_DTYPES else np.dtype(given).name
        if dtype not in SUPPORTED_DTYPES or (dtype == BYTES and given != BYTES):  # numpy's "bytes" is S0
            raise ValueError(f"tensor {d['name']!r}: dtype {given!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_DTYPES)})")
        for x in d["shape"]:
            if not (x is None or isinstance(x, (int, str))) or isinstance(x, bool):
                raise ValueError(f"tensor {d['name']!r}: bad dimension {x!r}")
        return cls(str(d["name"]), dtype, tuple(d["shape"]))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    backend: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    extra: dict = field(default_factory=dict, compare=False)  # path, device, ... for listings
    check_dims: tuple[str, ...] = ()  # named dimensions that must agree across a request's inputs

    def to_dict(self) -> dict:
        return {"name": self.name, "backend": self.backend, **self.extra,
                "inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs],
                "check_dims": list(self.check_dims)}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        extra = {k: v for k, v in d.items() if k not in ("name", "backend", "inputs", "outputs", "check_dims")}
        return cls(d["name"], d["backend"], tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                   tuple(TensorSpec.from_dict(t) for t in d["outputs"]), extra,
                   tuple(str(n) for n in d.get("check_dims", ())))

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


def check_dims_used(spec: ModelSpec) -> None:
    """ValueError if ``spec.check_dims`` names a dimension no input has (a typo would check nothing)."""
    used = {d for t in spec.inputs for d in t.shape if isinstance(d, str)}
    unused = [n for n in spec.check_dims if n not in used]
    if unused:
        raise ValueError(f"check_dims names {', '.join(map(repr, unused))}, which no input of model "
                         f"{spec.name!r} has (its named dimensions: {', '.join(sorted(used)) or 'none'})")


def bind_inputs(spec: ModelSpec, inputs: Sequence[TensorMeta]) -> dict[str, int]:
    """Check a request's inputs against ``spec``; return the named dimensions they bind to one
    value each (a name given several values is left out: it fixes no output's size).

    Checks names, dtypes, ranks, fixed dimensions, and that each name of ``spec.check_dims``
    has one value; no other name is held equal (the runtime decides).
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
    ambiguous: set[str] = set()
    checked = spec.check_dims
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
            if isinstance(want, str) and symbols.setdefault(want, have) != have:
                if want in checked:
                    raise ShmserveError(ErrorCode.BAD_SHAPE, f"input {t.name!r} dimension {axis} ({want!r}) is "
                                                             f"{have}, but another input has {want!r} = "
                                                             f"{symbols[want]} (the model's check_dims)")
                ambiguous.add(want)
    for name in ambiguous:
        del symbols[name]
    return symbols


def output_shapes(outputs: Sequence[TensorSpec], symbols: dict[str, int]) -> list[tuple[int, ...] | None]:
    """Each output's shape where every dimension is fixed or bound by the inputs (``symbols``, as
    ``bind_inputs`` returns them), else None; None for a bytes output (its size is known only
    once the model has made it)."""
    shapes: list[tuple[int, ...] | None] = []
    for t in outputs:
        dims = [d if isinstance(d, int) else symbols.get(d) if isinstance(d, str) else None for d in t.shape]
        shapes.append(None if t.dtype == BYTES or any(d is None for d in dims) else tuple(dims))
    return shapes


def estimate_output_bytes(spec: ModelSpec, symbols: dict[str, int], fallback: int) -> int:
    """Bytes to reserve for outputs: exact where ``output_shapes`` knows the shape, ``fallback``
    for each other output."""
    total = 0
    for t, shape in zip(spec.outputs, output_shapes(spec.outputs, symbols)):
        total += fallback if shape is None else tensor_nbytes(t.dtype, shape)
        total += 64  # each output starts on a cache line
    return total


def _show(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
