"""ONNX Runtime writing straight into the output area (issue 14 part 5), with real ORT models.

Through the real adapter (``workers.adapter.BackendAdapter``, as a worker
builds it): where output shapes follow from the inputs the backend binds the
output views ``allocate`` hands it, and says so in its ``io`` counts; the
outputs are bit for bit those of ONNX Runtime's own run and of the copying
path (``io_binding = false``), at several batch sizes; a model whose output
shapes the spec cannot predict, or predicts wrongly, copies; a model whose
output is its input (ORT answers with its own buffer) is caught by the
pointer check and copies from then on; a binding is kept per address set and
run again as it is (small outputs bound when their addresses are met a second
time, large ones at once).  Through a real server: the same
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
from workers.backends import onnxruntime as ort_backend

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


@pytest.fixture
def bind_at_once(monkeypatch):
    """Every address set bound the first time it is met, whatever its size (the binding mechanics
    alone, without the rule that binds a small one only when met again)."""
    monkeypatch.setattr(ort_backend, "BIND_FRESH_BYTES", 0)


class Seat:
    """Inputs and an output area at fixed addresses, run again and again, as a lane's seat is."""

    def __init__(self, inputs):
        self.area = Area()
        self.inputs = {}
        for name, value in inputs.items():
            self.inputs[name] = value.copy()
            self.inputs[name].flags.writeable = False

    def run(self, adapter) -> dict[str, np.ndarray]:
        self.area.pos, self.area.views = 64, {}
        adapter.run_into(self.inputs, self.area.allocate)
        return {name: view.copy() for name, view in self.area.views.items()}


def _binding_of(backend, view):
    """The kept binding whose first output ORT wrote at ``view``'s address."""
    found = [b for b in backend._bindings.values() if b.get_outputs()[0].data_ptr() == view.ctypes.data]
    assert len(found) == 1
    return found[0]


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
    seats = {}
    for batch in (1, 3, 1, 8, 3):
        image = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
        want = _reference(DEMO, {"image": image})["probabilities"]
        seat = seats.setdefault(batch, Seat({"image": image}))
        seat.inputs["image"].flags.writeable = True
        seat.inputs["image"][...] = image
        seat.inputs["image"].flags.writeable = False
        before = dict(bound.backend.io)
        answers = [seat.run(bound)["probabilities"] for _ in range(3)]
        assert all(a.tobytes() == want.tobytes() for a in answers)
        assert _run(copied, {"image": image})["probabilities"].tobytes() == want.tobytes()
        # each seat: copied while its signature is checked and once more (its addresses met first),
        # then bound and kept; a seat met again runs its kept binding (ORT writes where it wrote)
        io = bound.backend.io
        assert io["bound"] - before["bound"] >= 1
    # copied: the warm-up's batch 1, batches 3 and 8 once each to check them, each seat once (met first)
    assert bound.backend.io["copied"] == 1 + 2 + 3
    assert bound.backend.io["reused"] == 1 + 3 + 3  # seat 1's third run, then seats 1 and 3 met again


def test_the_bound_output_is_the_view_it_was_given_and_inputs_are_not_copied(bind_at_once):
    adapter, _ = _adapter(DEMO)
    backend = adapter.backend
    image = np.random.default_rng(2).standard_normal((1, 3, 32, 32), dtype=np.float32)
    image.flags.writeable = False
    area = Area()
    bound = backend.io["bound"]
    adapter.run_into({"image": image}, area.allocate)
    assert backend.io["bound"] == bound + 1
    # ORT's own record of where it wrote, and what it read: the area and the (read-only) input
    _binding_of(backend, area.views["probabilities"])
    assert area.views["probabilities"].tobytes() == _reference(DEMO, {"image": image})["probabilities"].tobytes()


def test_a_kept_binding_runs_again_only_for_the_same_addresses_and_a_small_one_is_bound_when_met_again():
    adapter, _ = _adapter(DEMO)
    backend = adapter.backend
    rng = np.random.default_rng(4)
    seat = Seat({"image": rng.standard_normal((1, 3, 32, 32), dtype=np.float32)})  # batch 1: warmed up
    want = _reference(DEMO, seat.inputs)["probabilities"]
    io = dict(backend.io)
    assert seat.run(adapter)["probabilities"].tobytes() == want.tobytes()
    assert backend.io["copied"] == io["copied"] + 1 and not backend._bindings  # met once: plain, a copy
    assert seat.run(adapter)["probabilities"].tobytes() == want.tobytes()
    assert backend.io["bound"] == io["bound"] + 1 and len(backend._bindings) == 1  # met again: bound, kept
    for _ in range(3):
        assert seat.run(adapter)["probabilities"].tobytes() == want.tobytes()
    assert backend.io["reused"] == io["reused"] + 3 and len(backend._bindings) == 1
    other = Seat({"image": np.flip(seat.inputs["image"], 0).copy()})  # other addresses: never the kept one
    got = [other.run(adapter)["probabilities"] for _ in range(3)]
    assert all(g.tobytes() == want.tobytes() for g in got)
    assert len(backend._bindings) == 2 and backend.io["reused"] == io["reused"] + 4
    seat.inputs["image"].flags.writeable = True
    seat.inputs["image"][...] = rng.standard_normal((1, 3, 32, 32), dtype=np.float32)  # new data, same place
    assert seat.run(adapter)["probabilities"].tobytes() == _reference(DEMO, seat.inputs)["probabilities"].tobytes()


def test_outputs_as_large_as_a_copy_costs_more_than_binding_are_bound_when_first_met(monkeypatch):
    adapter, _ = _adapter(DEMO)
    monkeypatch.setattr(ort_backend, "BIND_FRESH_BYTES", 40)  # the demo's output: 10 float32 a row
    backend = adapter.backend
    seat = Seat({"image": np.ones((1, 3, 32, 32), np.float32)})
    bound = backend.io["bound"]
    seat.run(adapter)
    assert backend.io["bound"] == bound + 1 and len(backend._bindings) == 1


def test_a_batch_of_several_requests_goes_into_each_requests_own_rows(bind_at_once):
    adapter, _ = _adapter(DEMO)
    rng = np.random.default_rng(3)
    image = rng.standard_normal((5, 3, 32, 32), dtype=np.float32)
    want = _reference(DEMO, {"image": image})["probabilities"]
    for _ in range(2):  # checked, then bound to ORT's own buffer and copied row by row
        views = [np.full((2, 10), np.nan, np.float32), np.full((3, 10), np.nan, np.float32)]
        adapter.run_into({"image": image}, lambda name, shape, dtype: RowSplit(
            tuple(shape), np.dtype(dtype), (RowPart(0, 2, views[0]), RowPart(2, 5, views[1]))))
        assert np.concatenate(views).tobytes() == want.tobytes()
    assert not adapter.backend._bindings  # one with an output ORT allocates is never kept
    one = np.full((5, 10), np.nan, np.float32)  # a batch of one request: its view is bound as it is
    bound = adapter.backend.io["bound"]
    adapter.run_into({"image": image}, lambda name, shape, dtype: RowSplit(tuple(shape), np.dtype(dtype),
                                                                          (RowPart(0, 5, one),)))
    assert one.tobytes() == want.tobytes() and adapter.backend.io["bound"] == bound + 1
    _binding_of(adapter.backend, one)


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


def test_an_output_ort_does_not_write_into_the_bound_buffer_is_caught_and_copied(models, bind_at_once):
    adapter, _ = _adapter(models["passthrough"])
    backend = adapter.backend
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(3):  # checked, bound (ORT answers with its own buffer: caught), then copied
        assert _run(adapter, {"x": x})["x"].tobytes() == x.tobytes()
    assert backend.binding_off is not None and "buffer of its own" in backend.binding_off
    assert backend.io == {"bound": 1, "copied": 3, "reused": 0}  # the warm-up's run, the check, the one after
    assert not backend._bindings  # (not kept)


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
