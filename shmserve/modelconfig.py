"""What a model file says about itself, written as shmserve configuration: ``shmserve config FILE``.

Owns: reading a model file's inputs and outputs without serving it (an ONNX file through
onnxruntime, a ``torch.export`` program (``.pt2``) and a TorchScript file through torch, each
through the backend that would serve it, so the answer is what a worker would see), the guesses
Triton's auto-complete makes (which dimension is a batch, a ``max_batch_size``), the named
dimensions worth listing in ``check_dims``, the notes a user needs (dimensions only a run sizes,
what a TorchScript file does not record), and the TOML (a ``[[models]]`` table, or a repository's
``config.toml``) and JSON forms of all that.

Must not: start workers, touch an arena or a socket, or write a file (the command prints; the user
decides where it goes).

Errors: ``ModelFileError`` (a one-line reason: no such file, a suffix no backend reads, the runtime
not installed (naming the command that installs it), or the runtime's own refusal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec

# A model file's suffix -> the backend that serves it.
BACKEND_OF_SUFFIX = {".onnx": "onnxruntime", ".pt2": "torch", ".pt": "torch", ".pth": "torch",
                     ".ts": "torch", ".torchscript": "torch"}
# What installs each runtime (the torch package is the user's choice of build: CPU or CUDA).
INSTALL = {"onnxruntime": "pip install onnxruntime", "torch": "pip install torch"}
SUGGESTED_MAX_BATCH_SIZE = 8  # a start, as Triton's auto-complete starts at 4: tune it with shmserve bench


class ModelFileError(Exception):
    """A model file that cannot be read here; its message is one line that says why and what to do.
    ``usage``: the caller named something that is not a model file (no such file, an unknown suffix),
    as opposed to a file the runtime refused or a runtime not installed."""

    def __init__(self, message: str, *, usage: bool = False):
        super().__init__(message)
        self.usage = usage


@dataclass
class ModelFile:
    """What one model file declares and what follows from it.  ``inputs``/``outputs``: as the
    backend reads them (a dimension: an int, a name, or None for one the file leaves unnamed);
    ``batch``: the name of the leading dimension every input and output shares, if any (None: no
    batch dimension; '' for one left unnamed); ``check_dims``: the input dimension names that appear
    more than once across the inputs (candidates: list them if they truly mean one size)."""

    name: str
    backend: str
    path: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch: str | None = None
    check_dims: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    @property
    def max_batch_size(self) -> int:
        return SUGGESTED_MAX_BATCH_SIZE if self.batch is not None else 0

    def to_dict(self) -> dict:
        tensor = lambda t: {"name": t.name, "dtype": t.dtype, "shape": [_dim_json(d) for d in t.shape]}
        return {"name": self.name, "backend": self.backend, "path": self.path,
                "inputs": [tensor(t) for t in self.inputs], "outputs": [tensor(t) for t in self.outputs],
                "batch_dimension": self.batch, "max_batch_size": self.max_batch_size,
                "check_dims_candidates": list(self.check_dims), "notes": list(self.notes)}


def read(path: str, *, name: str | None = None, backend: str | None = None) -> ModelFile:
    """Read ``path`` with the backend that serves it (``backend``, else chosen by its suffix:
    ``BACKEND_OF_SUFFIX``).  ModelFileError, one line, if it cannot be read."""
    file = Path(path)
    if not file.is_file():
        raise ModelFileError(f"{path}: no such file", usage=True)
    backend = backend or BACKEND_OF_SUFFIX.get(file.suffix.lower())
    if backend not in INSTALL:
        raise ModelFileError(f"{path}: shmserve config reads .onnx, .pt2 and TorchScript (.pt) files; name the "
                             f"backend with --backend onnxruntime|torch if the suffix is another", usage=True)
    config = ModelConfig(name=name or _name_of(file), backend=backend, path=str(file.resolve()))
    loaded = _load(config)
    try:
        inputs, outputs = tuple(loaded.inputs), tuple(loaded.outputs)
        notes = []
        if backend == "torch" and not inputs:
            inputs, outputs = _torchscript_arguments(loaded), ()
            notes.append("a TorchScript file records its inputs' names but not their dtypes or shapes, nor its "
                         "outputs: fill in each '?' (or export with torch.export to a .pt2 file, which records them)")
    finally:
        close = getattr(loaded, "close", None)
        if close is not None:
            close()
    found = ModelFile(config.name, backend, config.path, inputs, outputs, notes=notes)
    found.batch = _batch_dimension(inputs, outputs)
    found.check_dims = _repeated_names(inputs)
    named = {d for t in inputs for d in t.shape if isinstance(d, str)}
    for t in outputs:
        for i, d in enumerate(t.shape):
            if not isinstance(d, int) and (d is None or d not in named) and not (i == 0 and found.batch is not None):
                found.notes.append(f"output {t.name!r} dimension {i} ({d or 'unnamed'}) is named by no input: "
                                   f"its size is known only once the model has run")
    if found.batch is not None:
        found.notes.append(f"the leading dimension{f' {found.batch!r}' if found.batch else ''} of every input and "
                           f"output looks like a batch: max_batch_size = {SUGGESTED_MAX_BATCH_SIZE} batches requests "
                           f"(0 turns batching off; tune it with shmserve bench)")
    return found


def to_toml(found: ModelFile, *, repository: bool = False) -> str:
    """The configuration as TOML: a ``[[models]]`` table for a config file, or (``repository``) a
    repository's ``config.toml``: the same keys at the top level, no name, the path as the file's
    name inside each version directory.  Notes are comments above the keys."""
    lines = [f"# {note}" for note in found.notes]
    if repository:
        lines += [f'backend = "{found.backend}"', f'path = {_toml_str(Path(found.path).name)}']
    else:
        lines += ["[[models]]", f"name = {_toml_str(found.name)}", f'backend = "{found.backend}"',
                  f"path = {_toml_str(found.path)}"]
    if found.max_batch_size:
        lines.append(f"max_batch_size = {found.max_batch_size}")
    if found.check_dims:
        lines.append(f"# check_dims = [{', '.join(map(_toml_str, found.check_dims))}]  # if each name means "
                     f"one size across the inputs")
    for key, tensors in (("inputs", found.inputs), ("outputs", found.outputs)):
        if tensors:
            lines.append(f"{key} = [")
            lines += [f"  {{name = {_toml_str(t.name)}, dtype = {_toml_str(t.dtype)}, "
                      f"shape = [{', '.join(_dim_toml(d) for d in t.shape)}]}}," for t in tensors]
            lines.append("]")
    return "\n".join(lines) + "\n"


def _load(config: ModelConfig):
    from workers.backends import find

    try:
        loader = find(config.backend)
        return loader(config)
    except ModuleNotFoundError as exc:
        raise ModelFileError(f"the {config.backend} backend needs {exc.name}, which is not installed: "
                             f"{INSTALL[config.backend]}") from None
    except Exception as exc:  # the runtime's refusal: its first line says why
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(f"{config.path}: {config.backend} cannot read it: {reason}") from None


def _torchscript_arguments(backend) -> tuple[TensorSpec, ...]:
    schema = backend.module.forward.schema
    return tuple(TensorSpec(a.name, "?", ()) for a in schema.arguments[1:])  # [0] is self


def _batch_dimension(inputs, outputs) -> str | None:
    """The leading dimension shared by every input and output, if it is not fixed: its name ('' when
    the file leaves it unnamed), else None.  An output's leading dimension must be that same name or
    unnamed: one the inputs do not name (a detector's boxes after NMS, ``nonzero``) is sized by the
    data, so its rows are not the requests' rows and the model cannot be batched by rows."""
    if not inputs or any(t.dtype == "?" or not t.shape for t in (*inputs, *outputs)):
        return None
    names = {t.shape[0] for t in inputs}
    if len(names) != 1:
        return None
    (name,) = names
    if isinstance(name, int) or any(t.shape[0] not in (name, None) for t in outputs):
        return None
    return name or ""


def _repeated_names(inputs) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    for t in inputs:
        for d in t.shape:
            if isinstance(d, str):
                seen[d] = seen.get(d, 0) + 1
    return tuple(sorted(n for n, count in seen.items() if count > 1))


def _name_of(file: Path) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in file.stem)
    return stem or "model"


def _dim_toml(d) -> str:
    return str(d) if isinstance(d, int) else _toml_str(d or "?")


def _dim_json(d):
    return d if isinstance(d, int) else (d or None)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
