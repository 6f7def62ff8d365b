"""Python backend: any ``module:callable`` that takes and returns numpy arrays by name.

Owns: importing the callable and finding its tensor specs.  Specs come from
the config (``inputs``/``outputs``) or, failing that, from ``inputs`` and
``outputs`` attributes on the callable (lists of {name, dtype, shape}).  The
callable receives read-only-by-contract numpy views of shared memory.

The module is looked up in the config file's directory (``ModelConfig.base_dir``)
first, then the worker's current directory, then the Python path.

An optional ``load(config) -> callable`` factory is supported too: set
``path = "module:factory"`` and ``options = {factory = true}``.
"""

from __future__ import annotations

import importlib
import os
import sys

from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec


class PythonBackend:
    def __init__(self, config: ModelConfig):
        module_name, sep, attr = config.path.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"python backend path must be 'module:callable', got {config.path!r}")
        target = getattr(_import(module_name, config.base_dir), attr)
        if config.options.get("factory"):
            target = target(config)
        if not callable(target):
            raise TypeError(f"{config.path} is not callable")
        self.fn = target
        self.inputs = tuple(TensorSpec.from_dict(t) for t in getattr(target, "inputs", ()))
        self.outputs = tuple(TensorSpec.from_dict(t) for t in getattr(target, "outputs", ()))

    def run(self, inputs):
        result = self.fn(inputs)
        if not isinstance(result, dict):
            raise TypeError(f"model returned {type(result).__name__}, expected a dict of arrays")
        return result

    def close(self) -> None:
        close = getattr(self.fn, "close", None)
        if callable(close):
            close()


def _import(module_name: str, base_dir: str):
    """Import ``module_name`` looking in ``base_dir`` (the config file's directory) first, then
    the worker's current directory, then the Python path.  (The worker starts with ``python -P``,
    so the current directory is put here, for its model, once shmserve itself is imported.)"""
    for directory in reversed([d for d in (base_dir, os.getcwd()) if d]):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    return importlib.import_module(module_name)


def load(config: ModelConfig) -> PythonBackend:
    return PythonBackend(config)
