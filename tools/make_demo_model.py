#!/usr/bin/env python3
"""Build the embedded demo model, shmserve/models/demo.onnx, reproducibly (same bytes every run).

A small real convolutional image classifier with fixed random weights:

    image float32[batch, 3, 32, 32]
      -> Conv 3->16, 3x3, pad 1 -> Relu -> MaxPool 2x2
      -> Conv 16->32, 3x3, pad 1 -> Relu -> GlobalAveragePool -> Flatten
      -> Gemm 32->10 -> Softmax
    probabilities float32[batch, 10]

usage: python tools/make_demo_model.py [OUTPUT]   (default: shmserve/models/demo.onnx)
Needs the `onnx` package (pip install '.[onnx]').
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SEED = 20261129
OPSET = 17
IR_VERSION = 8


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(SEED)

    def weight(name, shape, fan_in):
        return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32), name)

    inits = [
        weight("conv1_w", (16, 3, 3, 3), 27), numpy_helper.from_array(np.zeros(16, np.float32), "conv1_b"),
        weight("conv2_w", (32, 16, 3, 3), 144), numpy_helper.from_array(np.zeros(32, np.float32), "conv2_b"),
        weight("fc_w", (32, 10), 32), numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "conv1_w", "conv1_b"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        helper.make_node("Conv", ["p1", "conv2_w", "conv2_b"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes, "shmserve_demo",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        initializer=inits)
    model = helper.make_model(graph, producer_name="shmserve", producer_version="1",
                              opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "shmserve/models/demo.onnx"
    data = build().SerializeToString(deterministic=True)
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
