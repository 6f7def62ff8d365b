"""ONNX Runtime backend: CPU, or the CUDA execution provider where it is installed.

Owns: turning an ONNX file into a Backend; reading input/output names,
dtypes and shapes (symbolic dimensions keep their names) from the session;
the two element types numpy and ONNX Runtime do not share:

* ``tensor(bfloat16)`` is shmserve's bfloat16 (``ml_dtypes.bfloat16``, which
  ORT's numpy conversion does not know): such a model runs through an
  ``IOBinding``, each bfloat16 input an ``OrtValue`` over the same memory
  (``ortvalue_from_numpy_with_onnx_type`` on a uint16 view: no copy), every
  output bound to CPU memory and each bfloat16 one copied out of its OrtValue.
* ``tensor(string)`` is shmserve's bytes.  ORT's string tensors hold text:
  an input's elements are decoded as UTF-8 (an element that is not fails the
  request with BAD_INPUT; ORT would take a ``bytes`` element as its repr), and
  an output's ``str`` elements go back as their UTF-8 (the worker does that for
  any bytes output).

A model without either runs ``InferenceSession.run`` on the views as they are.

Options (``[models.options]``): ``intra_op_threads`` (default 1: one worker
per model instance should not fight the others for cores),
``inter_op_threads`` (default 1), ``graph_optimization`` ("all" | "basic" |
"extended" | "disabled", default "all").
"""

from __future__ import annotations

import ctypes

import numpy as np

from shmserve import layout
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode
from shmserve.spec import TensorSpec
from workers.step import RequestFailed

_ORT_TYPES = {
    "tensor(bool)": "bool", "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(int16)": "int16",
    "tensor(uint16)": "uint16", "tensor(int32)": "int32", "tensor(uint32)": "uint32", "tensor(int64)": "int64",
    "tensor(uint64)": "uint64", "tensor(float16)": "float16", "tensor(float)": "float32",
    "tensor(double)": "float64", "tensor(bfloat16)": "bfloat16", "tensor(string)": layout.BYTES,
}
ONNX_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16 (the onnx package is not needed to serve)
_BF16 = layout.numpy_dtype("bfloat16")


def _spec(arg) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ValueError(f"tensor {arg.name!r} has type {arg.type}, which shmserve does not carry")
    shape = tuple(d if isinstance(d, int) and d >= 0 else (d if isinstance(d, str) and d else None)
                  for d in (arg.shape or []))
    return TensorSpec(arg.name, dtype, shape)


def _text(name: str, array: np.ndarray) -> np.ndarray:
    """A bytes input as ORT's string tensors take it: its elements decoded as UTF-8 (a new object
    array of str).  RequestFailed(BAD_INPUT) naming the first element that is not UTF-8."""
    flat = array.reshape(-1)
    try:
        text = np.fromiter((element.decode() for element in flat), dtype=object, count=flat.size)
    except UnicodeDecodeError as exc:
        raise RequestFailed(ErrorCode.BAD_INPUT, f"input {name!r}: an element is not UTF-8 ({exc.reason} at byte "
                                                 f"{exc.start}), and ONNX Runtime string tensors hold text") from None
    return text.reshape(array.shape)


def _bf16_array(value) -> np.ndarray:
    """A copy of a bfloat16 OrtValue (in CPU memory) as an ml_dtypes.bfloat16 array."""
    out = np.empty(value.shape(), _BF16)
    if out.nbytes != value.tensor_size_in_bytes():
        raise RuntimeError(f"a bfloat16 output of shape {value.shape()} holds {value.tensor_size_in_bytes()} bytes")
    if out.nbytes:
        ctypes.memmove(out.ctypes.data, value.data_ptr(), out.nbytes)
    return out


class OnnxRuntimeBackend:
    def __init__(self, config: ModelConfig):
        import onnxruntime as ort

        self.ort = ort
        opts = ort.SessionOptions()
        o = config.options
        opts.intra_op_num_threads = int(o.get("intra_op_threads", 1))
        opts.inter_op_num_threads = int(o.get("inter_op_threads", 1))
        level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                 "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                 "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                 "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[o.get("graph_optimization", "all")]
        opts.graph_optimization_level = level
        providers = ["CPUExecutionProvider"]
        if config.device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeError(f"device {config.device} asked for, but this onnxruntime has no CUDA "
                                   f"provider (install onnxruntime-gpu)")
            providers = [("CUDAExecutionProvider", {"device_id": int(config.device.split(":")[1])})]
        self.session = ort.InferenceSession(config.path, opts, providers=providers)
        self.inputs = tuple(_spec(a) for a in self.session.get_inputs())
        self.outputs = tuple(_spec(a) for a in self.session.get_outputs())
        self._output_names = [t.name for t in self.outputs]
        self._text_inputs = tuple(t.name for t in self.inputs if t.dtype == layout.BYTES)
        self._bf16_inputs = frozenset(t.name for t in self.inputs if t.dtype == "bfloat16")
        self._bf16_outputs = frozenset(t.name for t in self.outputs if t.dtype == "bfloat16")
        # Chosen once: a model with neither bfloat16 nor string tensors keeps the plain run.
        if self._bf16_inputs or self._bf16_outputs:
            self.run = self._run_bound
        elif self._text_inputs:
            self.run = self._run_text

    def run(self, inputs):
        results = self.session.run(self._output_names, dict(inputs))
        return dict(zip(self._output_names, results))

    def _run_text(self, inputs):
        feeds = dict(inputs)
        for name in self._text_inputs:
            feeds[name] = _text(name, feeds[name])
        return dict(zip(self._output_names, self.session.run(self._output_names, feeds)))

    def _run_bound(self, inputs):
        """A run through an IOBinding: bfloat16 inputs as OrtValues over their own memory, outputs in
        CPU memory (bfloat16 ones copied out, the others as ORT's numpy arrays)."""
        OrtValue, binding = self.ort.OrtValue, self.session.io_binding()
        held = []  # an OrtValue does not keep the array it wraps alive: these do, until the run is over
        for name, view in inputs.items():
            if name in self._bf16_inputs:
                array = np.ascontiguousarray(view).view(np.uint16)
                value = OrtValue.ortvalue_from_numpy_with_onnx_type(array, ONNX_BFLOAT16)
            else:
                array = _text(name, view) if name in self._text_inputs else np.ascontiguousarray(view)
                value = OrtValue.ortvalue_from_numpy(array)
            held.append((array, value))
            binding.bind_ortvalue_input(name, value)
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        del held
        return {name: _bf16_array(value) if name in self._bf16_outputs else value.numpy()
                for name, value in zip(self._output_names, binding.get_outputs())}

    def close(self) -> None:
        self.session = None


def load(config: ModelConfig) -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(config)
