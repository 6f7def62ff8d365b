"""Torch model files for tests (the builders live in the package: shmserve.models.torchnets)."""

from shmserve.models.torchnets import save_models  # noqa: F401
