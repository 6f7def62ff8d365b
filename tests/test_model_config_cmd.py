"""`shmserve config MODEL_FILE` (issue 26 item 5): what a model file says about itself, as a config.

Through the real command on files built here (an ONNX graph made with the onnx package, a
torch.export program, a TorchScript file), and the configuration it prints served by a real server,
as a [[models]] table and as a repository's config.toml; the batch rule in-process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from shmserve.modelconfig import _batch_dimension
from shmserve.spec import TensorSpec

from helpers.server import ServerProcess, serving


def config_cmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmserve.cli", "config", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def onnx_add_one(path, *, output_dim: str = "batch") -> None:
    """y = x + 1 for x of shape [batch, 4] float32; the output's first dimension named ``output_dim``."""
    import onnx
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "add_one",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [output_dim, 4])], [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def onnx_nonzero(path) -> None:
    """The indices of x's nonzero elements: an output sized by the data."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["idx"])], "nonzero",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("idx", TensorProto.INT64, [2, "nnz"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_an_onnx_file_is_described_and_the_printed_table_serves_it(tmp_path):
    onnx_add_one(tmp_path / "add.onnx")
    r = config_cmd(tmp_path / "add.onnx")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    table = tomllib.loads(r.stdout)["models"][0]
    assert table["name"] == "add" and table["backend"] == "onnxruntime" and table["max_batch_size"] == 8
    assert table["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
    assert table["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]
    assert "looks like a batch" in r.stdout
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with serving(tmp_path, r.stdout) as srv, srv.client() as c:
        np.testing.assert_array_equal(c.infer("add", {"x": x})["y"], x + 1)


def test_a_repository_config_toml_serves_the_file_from_its_version_directory(tmp_path):
    """Served by `serve --config FILE --model-repository DIR` with a FILE of server settings only (was:
    'models: at least one [[models]] table is required', though the flag names the repository)."""
    onnx_add_one(tmp_path / "add.onnx")
    r = config_cmd(tmp_path / "add.onnx", "--repository")
    assert r.returncode == 0, r.stderr
    keys = tomllib.loads(r.stdout)
    assert "name" not in keys and keys["path"] == "add.onnx" and keys["max_batch_size"] == 8
    version = tmp_path / "repo" / "add" / "1"
    version.mkdir(parents=True)
    shutil.copy(tmp_path / "add.onnx", version / "add.onnx")
    (version.parent / "config.toml").write_text(r.stdout)
    srv = ServerProcess(tmp_path, "", extra_args=["--model-repository", str(tmp_path / "repo")]).start()
    try:
        with srv.client() as c:
            out = c.infer("add", {"x": np.ones((2, 4), np.float32)})["y"]
        np.testing.assert_array_equal(out, np.full((2, 4), 2, np.float32))
    finally:
        assert srv.stop() == 0, srv.log()


def test_an_output_no_input_sizes_is_noted_and_keeps_the_model_unbatched(tmp_path):
    onnx_nonzero(tmp_path / "nz.onnx")
    r = config_cmd(tmp_path / "nz.onnx", "--json")
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["batch_dimension"] is None and found["max_batch_size"] == 0
    assert found["outputs"] == [{"name": "idx", "dtype": "int64", "shape": [2, "nnz"]}]
    assert any("output 'idx' dimension 1 (nnz) is named by no input" in note for note in found["notes"])
    assert set(found) == {"name", "backend", "path", "inputs", "outputs", "batch_dimension", "max_batch_size",
                          "check_dims_candidates", "notes"}  # the --json schema


def test_a_torch_export_program_is_described_and_serves_as_printed(tmp_path):
    torch = pytest.importorskip("torch")

    class Scale(torch.nn.Module):
        def forward(self, x, w):
            return x * w.sum(dim=1, keepdim=True)

    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Scale(), (torch.ones(2, 3), torch.ones(2, 5)),
                                  dynamic_shapes={"x": {0: batch}, "w": {0: batch}})
    torch.export.save(program, str(tmp_path / "scale.pt2"))
    r = config_cmd(tmp_path / "scale.pt2")
    assert r.returncode == 0, r.stderr
    table = tomllib.loads(r.stdout)["models"][0]
    (symbol,) = {t["shape"][0] for t in table["inputs"] + table["outputs"]}  # the one batch symbol
    assert table["backend"] == "torch" and table["max_batch_size"] == 8 and isinstance(symbol, str)
    assert [t["shape"][1:] for t in table["inputs"]] == [[3], [5]] and table["outputs"][0]["dtype"] == "float32"
    x, w = np.random.rand(4, 3).astype(np.float32), np.random.rand(4, 5).astype(np.float32)
    with serving(tmp_path, r.stdout) as srv, srv.client() as c:
        out = c.infer("scale", {"x": x, "w": w})[table["outputs"][0]["name"]]
    np.testing.assert_allclose(out, x * w.sum(axis=1, keepdims=True), rtol=1e-6)


def test_a_torchscript_file_names_its_inputs_and_says_what_it_does_not_record(tmp_path):
    torch = pytest.importorskip("torch")

    class Twice(torch.nn.Module):
        def forward(self, image, scale):
            return image * scale

    torch.jit.save(torch.jit.script(Twice()), str(tmp_path / "twice.pt"))
    r = config_cmd(tmp_path / "twice.pt")
    assert r.returncode == 0, r.stderr
    assert '{name = "image", dtype = "?", shape = []}' in r.stdout and "but not their dtypes or shapes" in r.stdout
    assert "outputs" not in r.stdout.split("# a TorchScript")[0]


@pytest.mark.parametrize("make, args, code, message", [
    (None, ["missing.onnx"], 2, "missing.onnx: no such file"),
    ("model.bin", ["model.bin"], 2, "reads .onnx, .pt2 and TorchScript"),
    ("junk.onnx", ["junk.onnx"], 1, "onnxruntime cannot read it"),
])
def test_what_is_not_a_model_file_is_one_line_and_an_exit_code(tmp_path, make, args, code, message):
    if make:
        (tmp_path / make).write_bytes(b"not a model at all")
    r = config_cmd(*(tmp_path / a for a in args))
    assert r.returncode == code and r.stdout == ""
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def spec(name, *shape, dtype="float32"):
    return TensorSpec(name, dtype, shape)


@pytest.mark.parametrize("inputs, outputs, batch", [
    ([spec("x", "b", 4), spec("m", "b", "s")], [spec("y", "b", 2)], "b"),
    ([spec("x", None, 4)], [spec("y", None, 4)], ""),           # unnamed, as Triton's -1
    ([spec("x", "b", 4)], [spec("y", None, 4)], "b"),           # an output left unnamed
    ([spec("x", "b", 4)], [spec("idx", "nnz", 2)], None),       # sized by the data: not rows
    ([spec("x", 1, 4)], [spec("y", 1, 4)], None),               # fixed
    ([spec("x", "b", 4), spec("m", "t", 4)], [spec("y", "b", 4)], None),  # the inputs disagree
    ([spec("x", "b", 4)], [spec("y", "b", 4), spec("s")], None),          # a scalar output
])
def test_the_batch_dimension_is_the_leading_one_every_tensor_shares(inputs, outputs, batch):
    assert _batch_dimension(inputs, outputs) == batch
