"""The torch backend's CPU call path (issue 26's glue), in-process: the short path answers the
same bytes as the general one and as the model run alone.

``TorchBackend.run_into`` on a CPU model takes its inputs as ``torch.from_numpy`` views and
copies each output out with numpy (``_run_host``); what numpy cannot take (bfloat16, a tensor
that requires grad) goes through torch's copy (``_write_tensor``).  Each case here runs the
same model through both paths (the general one forced with ``_on_cpu = False``, which on a CPU
model is the path every call took before) and against the module called directly.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmserve import layout  # noqa: E402
from shmserve.config import ModelConfig  # noqa: E402
from shmserve.spec import TensorSpec  # noqa: E402
from workers.adapter import BackendAdapter  # noqa: E402
from workers.backends import RowPart, RowSplit  # noqa: E402

DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class Many(torch.nn.Module):
    """One output per dtype of DTYPES, one of them a transposed (non-contiguous) view."""

    def forward(self, x):
        outs = [(x * 3).to(getattr(torch, name)) for name in DTYPES]
        outs[0] = (x * 3).t()  # float32, strided
        return tuple(outs)


class Weighted(torch.nn.Module):
    """Returns its own parameter (it requires grad: numpy cannot take it) and a product."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))

    def forward(self, x):
        return self.w, x @ self.w


class Halve(torch.nn.Module):
    def forward(self, x):
        return x / 2, (x / 2).float()


def load(tmp_path, module, example, inputs, outputs, name):
    path = tmp_path / f"{name}.pt"
    with torch.no_grad():
        torch.jit.trace(module.eval(), example).save(str(path))
    adapter = BackendAdapter.load(ModelConfig(name=name, backend="torch", path=str(path), inputs=inputs,
                                              outputs=outputs))
    adapter.declare(inputs, outputs)
    return adapter


def run(adapter, inputs, general: bool = False) -> tuple[dict, list]:
    """The outputs ``run_into`` writes (into fresh arrays) and what it asked ``allocate`` for."""
    backend = adapter.backend
    backend._on_cpu = not general
    asked, written = [], {}

    def allocate(name, shape, dtype):
        asked.append((name, tuple(shape), np.dtype(dtype)))
        written[name] = np.full(shape, 0x5A, np.uint8).view(dtype) if np.dtype(dtype).itemsize == 1 \
            else np.empty(shape, dtype)
        return written[name]

    try:
        adapter.run_into(inputs, allocate)
    finally:
        backend._on_cpu = True
    return written, asked


def through_torch(adapter) -> list:
    """The names of the outputs the backend writes through torch's copy from now on."""
    names: list = []
    write = adapter.backend._write_tensor
    adapter.backend._write_tensor = lambda name, value, allocate: names.append(name) or write(name, value, allocate)
    return names


def readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False  # as a request's views of shared memory are
    return view


def same_bytes(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.ascontiguousarray(a[name]).tobytes() == np.ascontiguousarray(b[name]).tobytes(), name


def test_every_dtype_and_a_strided_output_come_out_as_the_general_path_and_the_model_write_them(tmp_path):
    outputs = tuple(TensorSpec(f"y_{n}", n, (3, 4) if n == "float32" else (4, 3)) for n in DTYPES)
    adapter = load(tmp_path, Many(), torch.zeros(4, 3), (TensorSpec("x", "float32", (4, 3)),), outputs, "many")
    x = np.random.default_rng(26).standard_normal((4, 3)).astype(np.float32)
    torch_copied = through_torch(adapter)
    short, asked = run(adapter, {"x": readonly(x)})
    assert torch_copied == []
    general, asked_general = run(adapter, {"x": readonly(x)}, general=True)
    same_bytes(short, general)
    assert asked == asked_general  # the same shapes and dtypes asked for, in the same order
    assert [a[2] for a in asked] == [layout.numpy_dtype(n) for n in DTYPES]
    with torch.inference_mode():
        expect = Many()(torch.from_numpy(x))
    same_bytes(short, {f"y_{n}": t.contiguous().numpy() for n, t in zip(DTYPES, expect)})
    assert adapter.backend.runs["eager"] == 2


def test_bfloat16_in_and_out_and_a_parameter_output_take_torchs_copy_with_the_same_bytes(tmp_path):
    bf16 = layout.numpy_dtype("bfloat16")
    x16 = np.arange(8, dtype=np.float32).reshape(2, 4).astype(bf16)
    halve = load(tmp_path, Halve(), torch.zeros(2, 4, dtype=torch.bfloat16),
                 (TensorSpec("x", "bfloat16", (2, 4)),),
                 (TensorSpec("half", "bfloat16", (2, 4)), TensorSpec("wide", "float32", (2, 4))), "halve")
    torch_copied = through_torch(halve)
    short, asked = run(halve, {"x": readonly(x16)})
    assert torch_copied == ["half"]  # numpy has no bfloat16; the float32 output is numpy's copy
    general, _ = run(halve, {"x": readonly(x16)}, general=True)
    same_bytes(short, general)
    assert [a[2] for a in asked] == [bf16, np.dtype(np.float32)]
    assert short["wide"].tolist() == (np.arange(8, dtype=np.float32).reshape(2, 4) / 2).tolist()

    weighted = load(tmp_path, Weighted(), torch.zeros(1, 2), (TensorSpec("x", "float32", (1, 2)),),
                    (TensorSpec("w", "float32", (2, 3)), TensorSpec("xw", "float32", (1, 3))), "weighted")
    x = np.array([[1.0, -2.0]], np.float32)
    torch_copied = through_torch(weighted)
    short, _ = run(weighted, {"x": x})
    assert torch_copied == ["w"]
    general, _ = run(weighted, {"x": x}, general=True)
    same_bytes(short, general)
    assert short["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and short["xw"].tolist() == [[-6, -7, -8]]


def test_a_batch_writes_each_requests_rows_into_its_own_view(tmp_path):
    adapter = load(tmp_path, Halve(), torch.zeros(5, 4, dtype=torch.float64), (TensorSpec("x", "float64", ("b", 4)),),
                   (TensorSpec("half", "float64", ("b", 4)), TensorSpec("wide", "float32", ("b", 4))), "rows")
    x = np.random.default_rng(3).standard_normal((5, 4))
    for general in (False, True):
        views: dict = {}

        def allocate(name, shape, dtype):
            views[name] = [np.zeros((2, 4), dtype), np.zeros((3, 4), dtype)]
            return RowSplit(tuple(shape), np.dtype(dtype), (RowPart(0, 2, views[name][0]), RowPart(2, 5, views[name][1])))

        adapter.backend._on_cpu = not general
        adapter.run_into({"x": x}, allocate)
        adapter.backend._on_cpu = True
        for name, expect in (("half", x / 2), ("wide", (x / 2).astype(np.float32))):
            assert np.concatenate(views[name]).tobytes() == expect.tobytes(), (name, general)


def test_a_model_returning_more_outputs_than_declared_is_refused_before_anything_is_written(tmp_path):
    adapter = load(tmp_path, Halve(), torch.zeros(2, 4), (TensorSpec("x", "float32", (2, 4)),),
                   (TensorSpec("half", "float32", (2, 4)),), "short")
    asked = []
    with pytest.raises(ValueError, match="model returned 2 outputs, 1 declared"):
        adapter.run_into({"x": np.zeros((2, 4), np.float32)}, lambda *a: asked.append(a))
    assert asked == []
    assert not torch.is_inference_mode_enabled()  # the guard is left behind the call
