"""The GPU tests' precondition: torch sees a CUDA GPU and cuda-python is installed."""

from __future__ import annotations

import pytest


def require_gpu():
    """Skip the calling test module (with the reason) unless torch sees a CUDA GPU and cuda-python
    is installed; returns torch.  Call it at module level, before importing what needs a GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch", allow_module_level=True)
    try:
        from workers import cuda
    except ImportError:  # pragma: no cover
        cuda = None
    if cuda is None or cuda.available() is not None:
        pytest.skip("cuda-python is not installed", allow_module_level=True)
    return torch
