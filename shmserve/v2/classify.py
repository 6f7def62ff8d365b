"""The classification extension of the v2 protocol, as Triton's server answers it.

Owns: an output asked for with the ``classification`` parameter (k > 0)
turned into its top k classes: a BYTES tensor of ``"value:index"`` strings,
or ``"value:index:label"`` where the model has labels, highest value first
(ties in index order), one row of ``min(k, classes)`` per batch item when the
model batches (``max_batch_size`` > 0: the first dimension is the batch's);
the values formatted as Triton's server does (C++ ``std::to_string``: six
decimals for floating point, integers as they are); and the labels, read
from the file ``labels.txt`` in the model's directory (one label a line, the
line's index the class's) — the directory of the model's file, or for a
python model the directory of its configuration file.  Read once per
version, at most ``MAX_LABELS_BYTES``.

Must not: touch a socket, or read any file but a model's own ``labels.txt``.
"""

from __future__ import annotations

import math
import os

import numpy as np

from shmserve.errors import ErrorCode
from shmserve.v2.messages import DATATYPES, V2Error

LABELS_FILE = "labels.txt"
MAX_LABELS_BYTES = 4 << 20  # a label file larger than this is not read (no model has 4 MiB of class names)
MAX_CLASSES = 1_000_000  # Triton's kMaxClassificationElements: a larger output is refused
_LEN = 4


def labels_path(config) -> str | None:
    """Where a model version's labels would be (``config``: its ``config.ModelConfig``), or None."""
    path = config.path
    if os.path.isabs(path) and os.path.isfile(path):
        return os.path.join(os.path.dirname(path), LABELS_FILE)
    if config.base_dir:
        return os.path.join(config.base_dir, LABELS_FILE)
    return None


def read_labels(config) -> tuple[str, ...]:
    """The labels of a model version (empty: it has none, or they cannot be read: the answer
    then has no labels, as Triton's for a model without a label file)."""
    path = labels_path(config)
    if path is None:
        return ()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_LABELS_BYTES + 1)
    except OSError:
        return ()
    if len(data) > MAX_LABELS_BYTES:
        return ()
    return tuple(data.decode("utf-8", "replace").splitlines())


def _text(value) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{float(value):f}"
    if isinstance(value, (bool, np.bool_)):
        return str(int(value))
    return str(int(value))


def top_k(datatype: str, shape: tuple[int, ...], data, k: int, batched: bool, labels: tuple[str, ...],
          what: str) -> tuple[tuple[int, ...], bytes]:
    """The classification of an output (``datatype``, ``shape``, raw ``data``) as its new shape and
    BYTES data (v2 binary form).  V2Error BAD_INPUT, in Triton's words, for a datatype that has no
    order (BYTES, FP16, BF16, BOOL: as Triton) or more than ``MAX_CLASSES`` classes a row."""
    if datatype in ("BYTES", "FP16", "BF16", "BOOL"):
        raise V2Error(ErrorCode.BAD_INPUT, f"class result not available for output due to unsupported type "
                                           f"'{datatype}' ({what})", "INVALID_ARG")
    batch = shape[0] if batched and shape else 0
    rows = max(batch, 1)
    per = math.prod(shape[1:]) if batch else math.prod(shape)
    if per > MAX_CLASSES:
        raise V2Error(ErrorCode.BAD_INPUT, f"classification output tensor too large ({what}: {per} classes)",
                      "INVALID_ARG")
    values = np.frombuffer(data, np.dtype(DATATYPES[datatype]).newbyteorder("<"), rows * per).reshape(rows, per)
    count = min(per, k)
    out = []
    for row in values:
        order = np.argsort(-row.astype(np.float64), kind="stable")[:count]
        for i in order:
            text = f"{_text(row[i])}:{i}" + (f":{labels[i]}" if i < len(labels) else "")
            encoded = text.encode()
            out.append(len(encoded).to_bytes(_LEN, "little") + encoded)
    return ((batch, count) if batch else (count,)), b"".join(out)
