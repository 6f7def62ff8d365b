"""Models shipped inside the package.

* ``demo.onnx``: the embedded demo (``shmserve serve`` with no config), a
  small real convolutional classifier, rebuilt bit-for-bit by
  ``tools/make_demo_model.py``.
* Python-backend models for benchmarks and tests (``backend = "python"``,
  ``path = "shmserve.models:identity"`` and so on): numpy only.

  - ``identity``: ``y = x``, uint8 of shape ``["n"]``; ``identity_f32``: the
    same in float32 of shape ``["batch", "features"]``.
  - ``nonzero``: the indices of a float32 vector's non-zero elements (an output
    whose size is known only after running).
  - ``typed_identity``: ``y = x`` of shape ``["n"]`` in any dtype shmserve
    carries, a factory that reads it from the options::

        path = "shmserve.models:typed_identity"
        options = {factory = true, dtype = "bfloat16"}   # or bool, uint8 .. float64, bytes

  - ``bytes_reverse``: each element of a bytes vector (shape ``["n"]``)
    reversed, so a test sees that the model really ran.
  - ``sleepy``: ``identity`` that takes ``sleep_us`` microseconds a run,
    sleeping (a model bound by something other than this CPU, a GPU say), so
    a few clients saturate it (``shmserve bench --priority-mix``)::

        path = "shmserve.models:sleepy"
        options = {factory = true, sleep_us = 1000}

  A bfloat16 tensor is a numpy array of ``ml_dtypes.bfloat16``; a bytes tensor
  an object array of ``bytes`` (a model may return ``str`` elements: they are
  sent as UTF-8).
"""

from __future__ import annotations

import time

import numpy as np

from shmserve.protocol import SUPPORTED_DTYPES


def identity(inputs):
    """Returns its input unchanged: one uint8 vector of any length."""
    return {"y": inputs["x"]}


identity.inputs = [{"name": "x", "dtype": "uint8", "shape": ["n"]}]
identity.outputs = [{"name": "y", "dtype": "uint8", "shape": ["n"]}]


def identity_f32(inputs):
    """Returns its input unchanged: float32 of any rank-2 shape."""
    return {"y": inputs["x"]}


identity_f32.inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", "features"]}]
identity_f32.outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", "features"]}]


def nonzero(inputs):
    """Indices of the non-zero elements of a vector: an output whose size is known only after running."""
    return {"indices": np.flatnonzero(inputs["x"]).astype(np.int64)}


nonzero.inputs = [{"name": "x", "dtype": "float32", "shape": [None]}]
nonzero.outputs = [{"name": "indices", "dtype": "int64", "shape": [None]}]


def typed_identity(config):
    """A factory (``options = {factory = true, dtype = ...}``): a model returning its input ``x`` as
    ``y``, both of that dtype and shape ``["n"]``.  ValueError for a dtype shmserve does not carry."""
    dtype = config.options.get("dtype")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"typed_identity needs options.dtype, one of {', '.join(SUPPORTED_DTYPES)}; got {dtype!r}")

    def model(inputs):
        return {"y": inputs["x"]}

    model.inputs = [{"name": "x", "dtype": dtype, "shape": ["n"]}]
    model.outputs = [{"name": "y", "dtype": dtype, "shape": ["n"]}]
    return model


def bytes_reverse(inputs):
    """Each element of a bytes vector, its bytes in reverse order."""
    x = inputs["x"]
    return {"y": np.fromiter((element[::-1] for element in x), dtype=object, count=len(x))}


bytes_reverse.inputs = [{"name": "x", "dtype": "bytes", "shape": ["n"]}]
bytes_reverse.outputs = [{"name": "y", "dtype": "bytes", "shape": ["n"]}]


def sleepy(config):
    """A factory (``options = {factory = true, sleep_us = N}``): ``identity`` that sleeps ``N``
    microseconds (0-10 s) a run.  ValueError for a missing or bad ``sleep_us``."""
    us = config.options.get("sleep_us")
    if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= 10_000_000:
        raise ValueError(f"sleepy needs options.sleep_us, microseconds a run (0-10000000); got {us!r}")

    def model(inputs):
        time.sleep(us / 1e6)
        return {"y": inputs["x"]}

    model.inputs = identity.inputs
    model.outputs = identity.outputs
    return model
