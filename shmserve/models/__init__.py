"""Models shipped inside the package.

* ``demo.onnx``: the embedded demo (``shmserve serve`` with no config), a
  small real convolutional classifier, rebuilt bit-for-bit by
  ``tools/make_demo_model.py``.
* Python-backend models for benchmarks and tests (``backend = "python"``,
  ``path = "shmserve.models:identity"`` and so on): numpy only.
"""

from __future__ import annotations

import numpy as np


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
