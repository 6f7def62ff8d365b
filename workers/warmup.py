"""What a version's warm-up runs on: sample inputs, at each batch size it will run.

Owns: the warm-up inputs of issue 12 item 6, from the model's config
(``warmup = {requests, inputs, batch_sizes}``): the samples (``.npy``
files named in ``warmup.inputs``, loaded without pickle and checked against
the input's spec; the other inputs generated: the backend's own warm-up
inputs if it has them, else zeros of the smallest valid shape, a named
dimension taking the size a sample file gave it; a bytes input's zeros are
empty elements), the batch sizes, and the
sequence of inputs, one per run (``runs``).

Batch sizes: the batch dimension is the first dimension of every input when
all of them have a dynamic one.  A model like that that batches
(``max_batch_size`` > 1) or names ``warmup.batch_sizes`` is warmed at each
of ``ModelConfig.batch_sizes_to_warm()``, every sample's rows repeated in
turn to fill the batch (a sample of one row is tiled); any other model is
warmed on its samples as they are.  Each size gets ``warmup.requests``
runs; with 0 there is still one run (the check that every output comes
out, ``workers.adapter``).

Must not: run the model (``workers.adapter`` does) or read a clock.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from shmserve import layout
from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec


def _load(name: str, path: str, spec: TensorSpec, batched: bool) -> np.ndarray:
    """The sample file ``path`` for input ``name``, checked against ``spec``; ValueError naming the
    file and the config key if it cannot be read or does not fit."""
    where = f"warmup.inputs.{name} ({path})"
    if spec.dtype == layout.BYTES:
        raise ValueError(f"{where}: input {name!r} is bytes, which no .npy file holds without pickle; leave it "
                         f"out (its warm-up input is then empty elements)")
    try:
        sample = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{where}: not a readable .npy file: {exc}") from None
    if not isinstance(sample, np.ndarray):
        raise ValueError(f"{where}: an .npz archive, expected one array in an .npy file")
    if sample.dtype != layout.numpy_dtype(spec.dtype):
        raise ValueError(f"{where}: dtype {sample.dtype}, but input {name!r} is {spec.dtype}")
    shape = list(spec.shape)
    if sample.ndim != len(shape):
        raise ValueError(f"{where}: shape {list(sample.shape)}, but input {name!r} has rank {len(shape)} "
                         f"(shape {shape})")
    for axis, (want, have) in enumerate(zip(shape, sample.shape)):
        if isinstance(want, int) and want != have:
            raise ValueError(f"{where}: shape {list(sample.shape)}, but dimension {axis} of input {name!r} "
                             f"must be {want} (shape {shape})")
    if batched and sample.shape[0] == 0:
        raise ValueError(f"{where}: shape {list(sample.shape)} has no row to fill a batch with")
    return sample


def batched(config: ModelConfig, specs: tuple[TensorSpec, ...]) -> bool:
    """Whether the warm-up runs at batch sizes (the module's header says when)."""
    leading = bool(specs) and all(t.shape and not isinstance(t.shape[0], int) for t in specs)
    return leading and (config.max_batch_size > 1 or bool(config.warmup_batch_sizes))


def samples(config: ModelConfig, specs: tuple[TensorSpec, ...], own: dict[str, np.ndarray] | None) -> \
        dict[str, np.ndarray]:
    """One sample per input of ``specs``: its ``warmup.inputs`` file, else ``own`` (the backend's
    warm-up inputs, or None), else zeros.  ValueError for a file naming no input of the model, or
    one that does not fit its input (``_load``)."""
    by_name = {t.name: t for t in specs}
    unknown = [name for name, _ in config.warmup_inputs if name not in by_name]
    if unknown:
        raise ValueError(f"warmup.inputs names {', '.join(map(repr, unknown))}, which is not an input of model "
                         f"{config.name!r} (its inputs: {', '.join(by_name)})")
    batch = batched(config, specs)
    loaded = {name: _load(name, path, by_name[name], batch) for name, path in config.warmup_inputs}
    sizes: dict[str, int] = {}  # named dimensions as the sample files have them
    for name, sample in loaded.items():
        for axis, dim in enumerate(by_name[name].shape):
            if isinstance(dim, str) and not (batch and axis == 0):
                sizes.setdefault(dim, sample.shape[axis])
    out = {}
    for t in specs:
        if t.name in loaded:
            out[t.name] = loaded[t.name]
        elif own is not None and t.name in own:
            out[t.name] = own[t.name]
        else:
            shape = [d if isinstance(d, int) else sizes.get(d, 1) if isinstance(d, str) else 1 for d in t.shape]
            out[t.name] = np.full(shape, b"", dtype=object) if t.dtype == layout.BYTES else \
                np.zeros(shape, dtype=layout.numpy_dtype(t.dtype))
    return out


def at_batch(sample: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """``sample`` with ``size`` rows per input, its own rows repeated in turn."""
    return {name: np.take(a, np.arange(size) % a.shape[0], axis=0) for name, a in sample.items()}


def runs(config: ModelConfig, specs: tuple[TensorSpec, ...], own: dict[str, np.ndarray] | None) -> \
        Iterator[tuple[int | None, dict[str, np.ndarray]]]:
    """The warm-up's runs in order, as (batch size, or None for the samples as they are; inputs):
    ``config.warmup_requests`` at each batch size, or one run if that is 0.  The samples are read
    (and checked) first: ValueError as ``samples`` raises it, before anything runs."""
    sample = samples(config, specs, own)
    sizes: tuple[int | None, ...] = config.batch_sizes_to_warm() if batched(config, specs) else (None,)
    if config.warmup_requests == 0:
        sizes, repeat = sizes[:1], 1
    else:
        repeat = config.warmup_requests
    for size in sizes:
        inputs = sample if size is None else at_batch(sample, size)
        for _ in range(repeat):
            yield size, inputs
