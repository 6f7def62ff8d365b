"""TensorRT backend: a serialized engine, executed on the worker's stream, I/O in shared memory.

Owns: deserializing an engine once (TensorRT 10/11 Python API, the full
``tensorrt`` package or the lean runtime ``tensorrt_lean``), one execution
context per worker (one CUDA stream each), dynamic shapes within the
engine's optimization profile, and the two I/O modes:

* ``mapped``: ``set_tensor_address`` to the device address of the
  page-locked arena itself (inputs and outputs), so the engine's kernels read
  and write shared memory directly;
* ``copy``: device buffers kept per worker (grown on demand), filled with
  ``cudaMemcpyAsync`` from the page-locked arena and copied back the same way.

A batch's outputs are written in place too (``accepts_row_splits``): an
engine has one address per tensor and cannot write several requests' areas,
so for a ``RowSplit`` it executes into its device buffer and one
``cudaMemcpyAsync`` per request copies that request's rows into its output
view (page-locked shared memory, in either mode).

``synchronize`` waits for the stream before the worker publishes DONE.
bfloat16 tensors (``trt.DataType.BF16``) are shmserve's bfloat16 (``dtype_name``).
Errors say what to do: TensorRT missing, a file that is not an engine (or
was built for another TensorRT or GPU), a shape outside the profile.
Every CUDA call goes through ``workers.cuda.check``.
"""

from __future__ import annotations

import math

import numpy as np

from shmserve import layout
from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec
from workers.backends import RowSplit, refuse_bytes


def import_tensorrt():
    """The TensorRT module: the full package if installed, else the lean runtime."""
    try:
        import tensorrt as trt
        return trt
    except ImportError:
        pass
    try:
        import tensorrt_lean as trt
        return trt
    except ImportError:
        pass
    try:  # the lean runtime's binding module itself (tensorrt_lean only re-exports it)
        import tensorrt_lean_bindings as trt
        return trt
    except ImportError:
        raise ImportError("TensorRT is not installed: pip install 'shmserve[tensorrt]' (or the lean runtime, "
                          "tensorrt-lean-cu13, to run prebuilt engines)") from None


class TensorRTBackend:
    accepts_row_splits = True  # a batch's outputs go from the device into each request's output area

    def __init__(self, config: ModelConfig):
        if not config.device.startswith("cuda"):
            raise ValueError("TensorRT engines run on a GPU: set device = 'cuda:N' for this model")
        trt = import_tensorrt()
        from workers import cuda

        self.trt, self.cuda = trt, cuda
        self.io_mode = config.io_mode
        self.memory = None
        logger = _process_logger(trt)
        self.errors = logger.errors
        self.errors.clear()
        self.runtime = trt.Runtime(logger)
        if self.errors:
            # Destroying a runtime whose CUDA initialization failed crashes the process
            # (seen with tensorrt-lean 11.4 without a GPU): keep it until exit.
            _UNUSABLE_RUNTIMES.append(self.runtime)
            self.runtime = None
            raise RuntimeError(f"TensorRT {trt.__version__} cannot start: {'; '.join(self.errors)}")
        if cuda.available() is not None:
            raise ImportError(cuda.available())
        with open(config.path, "rb") as f:
            data = f.read()
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            detail = "; ".join(self.errors) or "deserialization failed"
            raise ValueError(f"{config.path} is not a TensorRT engine that TensorRT {trt.__version__} can run on "
                             f"this GPU (engines are tied to the TensorRT version and GPU they were built "
                             f"with; rebuild it here): {detail}")
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise RuntimeError(f"cannot create an execution context: {'; '.join(self.errors)}")
        self.stream = cuda.check(cuda.cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._buffers: dict[str, tuple[int, int]] = {}  # copy mode and batches: name -> (device pointer, capacity)
        self._pending_copies: list[tuple[np.ndarray, int, int]] = []  # device -> host after execution
        inputs, outputs, self.profiles = [], [], {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            dtype = dtype_name(trt, name, self.engine.get_tensor_dtype(name))
            shape = tuple(None if d < 0 else int(d) for d in self.engine.get_tensor_shape(name))
            spec = TensorSpec(name, dtype, shape)
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                inputs.append(spec)
                if any(d is None for d in shape):
                    lo, opt, hi = self.engine.get_tensor_profile_shape(name, 0)
                    self.profiles[name] = (tuple(lo), tuple(opt), tuple(hi))
            else:
                outputs.append(spec)
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)

    def bind_memory(self, memory) -> None:
        self.memory = memory

    def declare(self, inputs, outputs) -> None:
        """ValueError if the config declares a tensor bytes (an engine's tensors are fixed-size)."""
        refuse_bytes("TensorRT", inputs, outputs)

    def warmup_inputs(self) -> dict[str, np.ndarray]:
        """Zeros at the profile's optimal shape (dynamic inputs) or the fixed shape."""
        out = {}
        for t in self.inputs:
            shape = self.profiles[t.name][1] if t.name in self.profiles else t.shape
            out[t.name] = np.zeros(shape, dtype=layout.numpy_dtype(t.dtype))
        return out

    # -- running --------------------------------------------------------------------------

    def _device_address(self, view: np.ndarray, name: str, to_device: bool) -> int:
        """Mapped: the view's own device address.  Copy (or unregistered memory, as in warm-up):
        a device buffer, filled now (inputs) or copied back after execution (outputs)."""
        if self.io_mode == "mapped" and self.memory is not None:
            try:
                return self.memory.device_pointer(view)
            except ValueError:
                pass
        ptr = self._device_buffer(name, view.nbytes)
        host = view.__array_interface__["data"][0]
        if to_device:
            cuda = self.cuda
            cuda.check(cuda.cudart.cudaMemcpyAsync(ptr, host, view.nbytes,
                                                   cuda.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream),
                       "cudaMemcpyAsync(host to device)")
        else:
            self._pending_copies.append((view, host, ptr))
        return ptr

    def _device_buffer(self, name: str, nbytes: int) -> int:
        """The device buffer kept for tensor ``name``, grown (doubling) to at least ``nbytes``."""
        ptr, capacity = self._buffers.get(name, (0, 0))
        if capacity < nbytes:
            cuda = self.cuda
            if ptr:
                cuda.check(cuda.cudart.cudaFree(ptr), "cudaFree")
                del self._buffers[name]
            capacity = max(nbytes, 2 * capacity, 256)
            ptr = int(cuda.check(cuda.cudart.cudaMalloc(capacity), f"cudaMalloc({capacity})"))
            self._buffers[name] = (ptr, capacity)
        return ptr

    def _split_address(self, split: RowSplit, name: str) -> int:
        """For a batch's output: the device buffer the engine writes the whole batch into, and one
        copy back per request, of its rows into its own output view, queued for after execution."""
        ptr = self._device_buffer(name, split.dtype.itemsize * math.prod(split.shape))
        row_bytes = split.dtype.itemsize * math.prod(split.shape[1:])
        for start, _, view in split.parts:
            if view.nbytes:
                self._pending_copies.append((view, view.__array_interface__["data"][0], ptr + start * row_bytes))
        return ptr

    def run_into(self, inputs, allocate) -> None:
        ctx = self.context
        for t in self.inputs:
            view = np.ascontiguousarray(inputs[t.name])
            if not ctx.set_input_shape(t.name, view.shape):
                lo, _, hi = self.profiles.get(t.name, (t.shape, None, t.shape))
                raise ValueError(f"input {t.name!r} shape {list(view.shape)} is outside the engine's optimization "
                                 f"profile (min {list(lo)}, max {list(hi)})")
            ctx.set_tensor_address(t.name, self._device_address(view, t.name, to_device=True))
        self._pending_copies.clear()
        for t in self.outputs:
            shape = tuple(ctx.get_tensor_shape(t.name))
            if any(d < 0 for d in shape):
                raise ValueError(f"output {t.name!r} has a data-dependent shape, which this backend does not serve")
            dst = allocate(t.name, shape, t.dtype)
            if type(dst) is RowSplit:
                ctx.set_tensor_address(t.name, self._split_address(dst, t.name))
            else:
                ctx.set_tensor_address(t.name, self._device_address(dst, t.name, to_device=False))
        if not ctx.execute_async_v3(int(self.stream)):
            raise RuntimeError(f"execute_async_v3 failed: {'; '.join(self.errors[-3:])}")
        cuda = self.cuda
        for view, host, ptr in self._pending_copies:
            cuda.check(cuda.cudart.cudaMemcpyAsync(host, ptr, view.nbytes,
                                                   cuda.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream),
                       "cudaMemcpyAsync(device to host)")
        self._pending_copies.clear()

    def synchronize(self) -> None:
        self.cuda.check(self.cuda.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        cuda = self.cuda
        self.synchronize()
        for ptr, _ in self._buffers.values():
            cuda.check(cuda.cudart.cudaFree(ptr), "cudaFree")
        self._buffers.clear()
        cuda.check(cuda.cudart.cudaStreamDestroy(self.stream), "cudaStreamDestroy")
        self.context = self.engine = self.runtime = None


def dtype_name(trt, tensor: str, dtype) -> str:
    """shmserve's name of an engine tensor's ``trt.DataType``: bfloat16 for BF16 (numpy has none,
    so ``trt.nptype`` cannot name it; its memory is the same 2-byte elements), numpy's name of
    ``trt.nptype`` for the others.  ValueError for a type shmserve does not carry (FP8, INT4, ...)."""
    if dtype == trt.DataType.BF16:
        return "bfloat16"
    try:
        name = np.dtype(trt.nptype(dtype)).name
    except TypeError:
        name = None
    if name not in layout.ITEMSIZES:
        raise ValueError(f"tensor {tensor!r} has TensorRT type {dtype}, which shmserve does not carry")
    return name


_LOGGER = None
_UNUSABLE_RUNTIMES: list = []


def _process_logger(trt):
    """One logger for the whole process (TensorRT keeps a pointer to it: it must outlive every
    runtime), keeping TensorRT's errors so they can be put in our exceptions."""
    global _LOGGER
    if _LOGGER is None:
        class CollectingLogger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.errors: list[str] = []

            def log(self, severity, msg):
                if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                    self.errors.append(str(msg))

        _LOGGER = CollectingLogger()
    return _LOGGER


def load(config: ModelConfig) -> TensorRTBackend:
    return TensorRTBackend(config)
