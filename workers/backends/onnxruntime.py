"""ONNX Runtime backend: CPU, or the CUDA execution provider where it is installed.

Owns: turning an ONNX file into a Backend; reading input/output names,
dtypes and shapes (symbolic dimensions keep their names) from the session.

Options (``[models.options]``): ``intra_op_threads`` (default 1: one worker
per model instance should not fight the others for cores),
``inter_op_threads`` (default 1), ``graph_optimization`` ("all" | "basic" |
"extended" | "disabled", default "all").
"""

from __future__ import annotations


from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec

_ORT_TYPES = {
    "tensor(bool)": "bool", "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(int16)": "int16",
    "tensor(uint16)": "uint16", "tensor(int32)": "int32", "tensor(uint32)": "uint32", "tensor(int64)": "int64",
    "tensor(uint64)": "uint64", "tensor(float16)": "float16", "tensor(float)": "float32",
    "tensor(double)": "float64",
}


def _spec(arg) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ValueError(f"tensor {arg.name!r} has type {arg.type}, which shmserve does not carry")
    shape = tuple(d if isinstance(d, int) and d >= 0 else (d if isinstance(d, str) and d else None)
                  for d in (arg.shape or []))
    return TensorSpec(arg.name, dtype, shape)


class OnnxRuntimeBackend:
    def __init__(self, config: ModelConfig):
        import onnxruntime as ort

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

    def run(self, inputs):
        results = self.session.run(self._output_names, dict(inputs))
        return dict(zip(self._output_names, results))

    def close(self) -> None:
        self.session = None


def load(config: ModelConfig) -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(config)
