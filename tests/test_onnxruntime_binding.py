"""ONNX Runtime writing straight into the output area (issue 14 part 5), with real ORT models.

Through the real adapter (``workers.adapter.BackendAdapter``, as a worker
builds it): where output shapes follow from the inputs the backend binds the
output views ``allocate`` hands it, and says so in its ``io`` counts; the
outputs are bit for bit those of ONNX Runtime's own run and of the copying
path (``io_binding = false``), at several batch sizes; a model whose output
shapes the spec cannot predict, or predicts wrongly, copies; a model whose
output is its input (ORT answers with its own buffer) is caught by the
pointer check and copies from then on.  Through a real server: the same
answers through a lane and ``Client.infer``, a batched model, and hostile
lane shapes refused before anything runs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from shmserve import ErrorCode, ShmserveError, lanes
from shmserve.config import ModelConfig, demo_config
from workers.adapter import BackendAdapter
from workers.backends import RowPart, RowSplit

from helpers.server import serving

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

DEMO = demo_config().models[0].path


def _save(path, nodes, inputs, outputs):
    graph = helper.make_graph(nodes, path.stem, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def _float(name, shape, kind=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, kind, shape)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("binding_models")
    return {
        # y = nonzero(x): its size depends on the data
        "nonzero": _save(d / "nonzero.onnx", [helper.make_node("NonZero", ["x"], ["y"])],
                         [_float("x", ["n"])], [_float("y", [1, "k"], TensorProto.INT64)]),
        # the exporter named both inputs' and the output's leading dimension alike; y has a + b rows
        "concat": _save(d / "concat.onnx", [helper.make_node("Concat", ["a", "b"], ["y"], axis=0)],
                        [_float("a", ["D", 3]), _float("b", ["D", 3])], [_float("y", ["D", 3])]),
        # the graph input is its output: ORT answers with the input's buffer
        "passthrough": _save(d / "passthrough.onnx", [], [_float("x", ["n", 4])], [_float("x", ["n", 4])]),
    }


def _adapter(path, **options) -> tuple[BackendAdapter, ModelConfig]:
    config = ModelConfig(name="m", backend="onnxruntime", path=path, options=options)
    adapter = BackendAdapter.load(config)
    adapter.warm_up(config, adapter.prepare(config))
    return adapter, config


class Area:
    """A stand-in for a request's output area: views of one buffer, placed in order, as the
    worker's OutputPlacer places them."""

    def __init__(self, size=1 << 20):
        self.buf = np.zeros(size, np.uint8)
        self.pos, self.views = 64, {}

    def allocate(self, name, shape, dtype):
        view = np.ndarray(shape, dtype, buffer=self.buf, offset=self.pos)
        self.pos += (view.nbytes + 63) // 64 * 64 + 64
        self.views[name] = view
        return view


def _run(adapter, inputs) -> dict[str, np.ndarray]:
    area = Area()
    frozen = {}
    for name, value in inputs.items():
        frozen[name] = value.copy()
        frozen[name].flags.writeable = False  # as the worker's views of shared memory are
    if adapter.run_into is not None:
        adapter.run_into(frozen, area.allocate)
        return {name: view.copy() for name, view in area.views.items()}
    return {name: np.asarray(v).copy() for name, v in adapter.run(frozen).items()}


def _reference(path, inputs):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))


def test_the_demo_model_writes_into_the_area_bit_for_bit_at_every_batch_size():
    bound, _ = _adapter(DEMO)
    copied, _ = _adapter(DEMO, io_binding=False)
    assert bound.writes_outputs and bound.writes_row_splits and bound.backend.binding_off is None
    assert not copied.writes_outputs  # io_binding = false: the plain run, the worker copies
    rng = np.random.default_rng(14)
    for batch in (1, 3, 1, 8, 3):
        image = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
        want = _reference(DEMO, {"image": image})["probabilities"]
        before = dict(bound.backend.io)
        first = _run(bound, {"image": image})["probabilities"]
        second = _run(bound, {"image": image})["probabilities"]
        assert first.tobytes() == want.tobytes() == second.tobytes()
        assert _run(copied, {"image": image})["probabilities"].tobytes() == want.tobytes()
        # a new signature is copied once (its output shapes checked), then bound; batch 1 was warmed up
        io = bound.backend.io
        assert io["bound"] - before["bound"] >= 1
    assert bound.backend.io["copied"] == 3  # the warm-up's batch 1, then batches 3 and 8 once each


def test_the_bound_output_is_the_view_it_was_given_and_inputs_are_not_copied():
    adapter, _ = _adapter(DEMO)
    backend = adapter.backend
    image = np.random.default_rng(2).standard_normal((1, 3, 32, 32), dtype=np.float32)
    image.flags.writeable = False
    area = Area()
    bound = backend.io["bound"]
    adapter.run_into({"image": image}, area.allocate)
    assert backend.io["bound"] == bound + 1
    # ORT's own record of where it wrote, and what it read: the area and the (read-only) input
    out = backend._binding.get_outputs()[0]
    assert out.data_ptr() == area.views["probabilities"].ctypes.data
    assert area.views["probabilities"].tobytes() == _reference(DEMO, {"image": image})["probabilities"].tobytes()


def test_a_batch_of_several_requests_goes_into_each_requests_own_rows():
    adapter, _ = _adapter(DEMO)
    rng = np.random.default_rng(3)
    image = rng.standard_normal((5, 3, 32, 32), dtype=np.float32)
    want = _reference(DEMO, {"image": image})["probabilities"]
    for _ in range(2):  # checked, then bound to ORT's own buffer and copied row by row
        views = [np.full((2, 10), np.nan, np.float32), np.full((3, 10), np.nan, np.float32)]
        adapter.run_into({"image": image}, lambda name, shape, dtype: RowSplit(
            tuple(shape), np.dtype(dtype), (RowPart(0, 2, views[0]), RowPart(2, 5, views[1]))))
        assert np.concatenate(views).tobytes() == want.tobytes()
    one = np.full((5, 10), np.nan, np.float32)  # a batch of one request: its view is bound as it is
    bound = adapter.backend.io["bound"]
    adapter.run_into({"image": image}, lambda name, shape, dtype: RowSplit(tuple(shape), np.dtype(dtype),
                                                                          (RowPart(0, 5, one),)))
    assert one.tobytes() == want.tobytes() and adapter.backend.io["bound"] == bound + 1
    assert adapter.backend._binding.get_outputs()[0].data_ptr() == one.ctypes.data


def test_output_shapes_the_inputs_do_not_fix_are_copied(models):
    adapter, _ = _adapter(models["nonzero"])
    for x in (np.array([0, 1, 0, 2], np.float32), np.array([3, 1, 0, 2], np.float32), np.zeros(4, np.float32)):
        for _ in range(2):
            got = _run(adapter, {"x": x})["y"]
            assert got.tobytes() == _reference(models["nonzero"], {"x": x})["y"].tobytes()
    assert adapter.backend.io["bound"] == 0 and adapter.backend.io["copied"] == 7


def test_a_wrong_prediction_from_alike_names_is_copied_not_an_error(models):
    adapter, _ = _adapter(models["concat"])
    a, b = np.ones((2, 3), np.float32), np.full((2, 3), 2, np.float32)  # 'D' = 2, but y has 4 rows
    for _ in range(3):
        got = _run(adapter, {"a": a, "b": b})["y"]
        assert got.tobytes() == _reference(models["concat"], {"a": a, "b": b})["y"].tobytes()
    assert adapter.backend.io["bound"] == 0


def test_an_output_ort_does_not_write_into_the_bound_buffer_is_caught_and_copied(models):
    adapter, _ = _adapter(models["passthrough"])
    backend = adapter.backend
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(3):  # checked, bound (ORT answers with its own buffer: caught), then copied
        assert _run(adapter, {"x": x})["x"].tobytes() == x.tobytes()
    assert backend.binding_off is not None and "buffer of its own" in backend.binding_off
    assert backend.io == {"bound": 1, "copied": 3}  # the warm-up's run, the check, then the one after


def test_io_binding_takes_only_a_switch():
    with pytest.raises(ValueError, match="io_binding must be true or false"):
        _adapter(DEMO, io_binding="yes")


# -- through a real server ------------------------------------------------------------------------

def _config() -> str:
    return "".join(f'\n[[models]]\nname = "{name}"\nbackend = "onnxruntime"\npath = "{DEMO}"\n{extra}\n'
                   for name, extra in (("demo", ""), ("demo_copy", "[models.options]\nio_binding = false"),
                                       ("demo_batched", "max_batch_size = 8\nmax_queue_delay_us = 20000")))


def test_the_same_answers_through_a_lane_and_infer_bound_or_copied(tmp_path):
    rng = np.random.default_rng(5)
    with serving(tmp_path, _config()) as srv, srv.client() as c:
        for batch in (1, 2, 2, 7):
            image = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
            want = _reference(DEMO, {"image": image})["probabilities"].tobytes()
            for model in ("demo", "demo_copy", "demo_batched"):
                assert c.infer(model, {"image": image})["probabilities"].tobytes() == want, model
                with c.zero_copy(model, {"image": (image.shape, np.float32)}) as call:
                    call.inputs["image"][...] = image
                    for _ in range(2):
                        assert call.run()["probabilities"].tobytes() == want, model


def test_a_batch_across_lanes_gives_each_request_its_rows(tmp_path):
    rng = np.random.default_rng(6)
    images = [rng.standard_normal((n, 3, 32, 32), dtype=np.float32) for n in (1, 3, 2)]
    with serving(tmp_path, _config()) as srv, srv.client() as c:
        calls = []
        for image in images:
            call = c.zero_copy("demo_batched", {"image": (image.shape, np.float32)})
            call.inputs["image"][...] = image
            calls.append(call)
        for _ in range(3):  # submitted together: the worker gathers them within 20 ms
            handles = [call.region.lane.submit(*_lane_args(call)) for call in calls]
            for call, (index, generation) in zip(calls, handles):
                call.region.lane.wait(index, generation, time.monotonic() + 20, 0.0, lambda: None)
            for image, call, (index, generation) in zip(images, calls, handles):
                placed = call.region.lane.read(index, generation, call.out_offset, call.out_capacity)
                (dtype, shape, offset), = placed.values()
                got = np.ndarray(shape, dtype, buffer=call.region.buf, offset=offset)
                assert got.tobytes() == _reference(DEMO, {"image": image})["probabilities"].tobytes()
        for call in calls:
            call.release()


def _lane_args(call):
    (offset, view), = call._op.inputs.values()
    return (call.client._core.session.reserve_id(), 0, [(0, offset, view)], call.out_offset, call.out_capacity)


@pytest.mark.parametrize("shape, capacity, code", [
    ((1, 3, 32, 31), 4096, ErrorCode.BAD_SHAPE),      # a fixed dimension wrong
    ((3, 32, 32), 4096, ErrorCode.BAD_SHAPE),         # the rank wrong
    ((1, 3, 32, 32), 16, ErrorCode.OUTPUT_TOO_LARGE),  # a 40-byte output into 16 bytes: before ORT runs
    ((200, 3, 32, 32), 64, ErrorCode.OUTPUT_TOO_LARGE),
])
def test_hostile_lane_shapes_are_still_refused(tmp_path, shape, capacity, code):
    with serving(tmp_path, _config()) as srv, srv.client() as c:
        region = c.open_region(4 << 20, lane="demo")
        view = np.ndarray(shape, np.float32, buffer=region.buf, offset=lanes.DATA_FLOOR)
        out = lanes.DATA_FLOOR + (view.nbytes + 4095) // 4096 * 4096
        index, generation = region.lane.submit(1, 0, [(0, lanes.DATA_FLOOR, view)], out, capacity)
        region.lane.wait(index, generation, time.monotonic() + 20, 0.0, lambda: None)
        with pytest.raises(ShmserveError) as info:
            region.lane.read(index, generation, out, capacity)
        assert info.value.code is code
        image = np.zeros((1, 3, 32, 32), np.float32)  # and the model serves on
        assert c.infer("demo", {"image": image})["probabilities"].shape == (1, 10)
