"""CUDA for GPU workers: one checker for every cuda-python call, and page-locking shared memory.

Owns: the worker's use of the CUDA runtime through cuda-python (after the
TensorRT samples' ``cuda_call``): every call's ``(err, *result)`` tuple goes
through ``check``, which raises ``CudaError`` naming the call and the CUDA
error.  ``registered()`` page-locks a mapping with
``cudaHostRegister(Portable | Mapped)`` and is a context manager so that
unregister always runs before the mapping is closed (enter it inside the
mapping's lifetime).  ``DeviceMemory`` translates host addresses inside
registered ranges to the device addresses kernels use in mapped mode.

Must not: be imported by the front-end, or by a CPU worker.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

import numpy as np

try:  # cuda-python >= 12.6 ("cuda-bindings"); older releases spell it cuda.cudart
    from cuda.bindings import runtime as cudart
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    try:
        from cuda import cudart  # type: ignore[no-redef]
    except ImportError:
        cudart = None


class CudaError(RuntimeError):
    """A CUDA runtime call failed; ``call`` and ``error`` name what and how."""

    def __init__(self, call: str, error: str, hint: str = ""):
        self.call, self.error = call, error
        super().__init__(f"{call} failed: {error}" + (f"; {hint}" if hint else ""))


def available() -> str | None:
    """None if cuda-python is importable, else why not."""
    return None if cudart is not None else "cuda-python is not installed (pip install 'shmserve[gpu]')"


def _error_name(err) -> str:
    try:
        name = cudart.cudaGetErrorName(err)[1]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the error-name lookup itself must not mask the error
        return str(err)


def check(result, call: str, hint: str = ""):
    """The chokepoint: unpack a cuda-python ``(err, *values)`` result or raise CudaError."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(call, _error_name(err), hint)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def set_device(index: int) -> None:
    if cudart is None:
        raise CudaError("import cuda-python", "not installed", available() or "")
    count = check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount",
                  "is the NVIDIA driver installed and the device visible to this service?")
    if not 0 <= index < count:
        raise CudaError("cudaSetDevice", f"no device cuda:{index} ({count} visible)")
    check(cudart.cudaSetDevice(index), f"cudaSetDevice({index})")


def device_bytes_in_use() -> int:
    """How much of the current device's memory is in use, by every process (cudaMemGetInfo: total - free)."""
    free, total = check(cudart.cudaMemGetInfo(), "cudaMemGetInfo")
    return int(total) - int(free)


def host_address(buf) -> int:
    """Address of the first byte of a buffer (mmap, numpy array)."""
    return np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data if len(buf) else 0


@dataclass(frozen=True)
class Registration:
    host: int
    device: int
    size: int


@contextlib.contextmanager
def registered(buf, what: str):
    """Page-lock ``buf`` for the current device, Portable | Mapped; yields a Registration.

    A failure raises CudaError with what to change (the memlock limit is the
    usual cause); unregistration runs on every exit path.
    """
    size = len(buf)
    anchor = np.frombuffer(buf, dtype=np.uint8)  # keeps the mapping exported while registered
    host = anchor.ctypes.data
    flags = cudart.cudaHostRegisterPortable | cudart.cudaHostRegisterMapped
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    check(cudart.cudaHostRegister(host, size, flags), f"cudaHostRegister({what}, {size} bytes)",
          f"page-locking needs RLIMIT_MEMLOCK >= {size} bytes (now {limit}): set LimitMEMLOCK=infinity in the "
          f"systemd unit or 'ulimit -l unlimited' in the shell that starts shmserve")
    try:
        device = check(cudart.cudaHostGetDevicePointer(host, 0), f"cudaHostGetDevicePointer({what})")
        yield Registration(host, int(device), size)
    finally:
        check(cudart.cudaHostUnregister(host), f"cudaHostUnregister({what})")
        del anchor


class DeviceMemory:
    """Registered host ranges and their device addresses (mapped mode)."""

    def __init__(self):
        self._ranges: dict[int, Registration] = {}

    def add(self, reg: Registration) -> None:
        self._ranges[reg.host] = reg

    def remove(self, host: int) -> None:
        self._ranges.pop(host, None)

    def registrations(self) -> set[Registration]:
        return set(self._ranges.values())

    def locate(self, view: np.ndarray) -> tuple[Registration, int]:
        """The registration holding a numpy view, and the view's offset in it; ValueError if none."""
        addr = view.__array_interface__["data"][0]
        for reg in self._ranges.values():
            if reg.host <= addr and addr + view.nbytes <= reg.host + reg.size:
                return reg, addr - reg.host
        raise ValueError("buffer is not inside registered memory")

    def device_pointer(self, view: np.ndarray) -> int:
        """Device address of a numpy view that lies inside a registered range; ValueError otherwise."""
        reg, offset = self.locate(view)
        return reg.device + offset
