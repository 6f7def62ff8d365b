"""The backend adapter: what it states for each kind of backend, and how it prepares one at load.

Real backends where they run here (python, torch on CPU; TensorRT's class
without an engine), and small third-party-style backends written below: the
contract in ``workers.backends.Backend`` is for them.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec
from workers.adapter import BackendAdapter

X = TensorSpec("x", "float32", ("n",))
Y = TensorSpec("y", "float32", ("n",))

STATEMENTS = ("writes_outputs", "writes_row_splits", "synchronizes", "takes_memory", "takes_declare", "own_warmup",
              "tells_device_bytes", "closes")


def statements(adapter: BackendAdapter) -> dict[str, bool]:
    return {name: getattr(adapter, name) for name in STATEMENTS}


class RunsInto:
    """A third-party backend with only ``run_into`` (no close, no synchronize)."""

    inputs, outputs = (X,), (Y,)

    def run_into(self, inputs, allocate):
        allocate("y", inputs["x"].shape, np.float32)[...] = inputs["x"] * 2


class Everything:
    """A backend with every optional call, recording them."""

    inputs, outputs = (X,), (Y,)
    accepts_row_splits = True

    def __init__(self):
        self.calls = []

    def run_into(self, inputs, allocate):
        self.calls.append(("run_into", {n: v.shape for n, v in inputs.items()}))
        allocate("y", inputs["x"].shape, np.float32)[...] = 0

    def synchronize(self):
        self.calls.append(("synchronize",))

    def bind_memory(self, memory):
        self.calls.append(("bind_memory", memory))

    def declare(self, inputs, outputs):
        self.calls.append(("declare", inputs, outputs))

    def warmup_inputs(self):
        return {"x": np.zeros(7, np.float32)}

    def close(self):
        self.calls.append(("close",))


def test_a_run_backend_returns_arrays_and_has_nothing_optional():
    config = ModelConfig(name="identity", backend="python", path="shmserve.models:identity")
    with BackendAdapter.load(config) as adapter:
        assert statements(adapter) == dict.fromkeys(STATEMENTS, False) | {"closes": True}
        assert adapter.run_into is None and adapter.run is not None
        adapter.synchronize()  # no-ops, callable without asking
        adapter.bind_memory(object())
        adapter.declare((), ())
        assert adapter.device_bytes() is None


def test_a_third_party_run_into_backend_gets_scratch_for_batches_and_needs_no_close():
    adapter = BackendAdapter(RunsInto())
    assert statements(adapter) == dict.fromkeys(STATEMENTS, False) | {"writes_outputs": True}
    assert adapter.run is None
    config = ModelConfig(name="into", backend="x", path="-")
    assert adapter.prepare(config).outputs == (Y,)
    adapter.close()


def test_row_splits_are_only_for_backends_that_write_their_outputs():
    class RunsButSaysSplits:
        accepts_row_splits = True
        inputs, outputs = (X,), (Y,)

        def run(self, inputs):
            return {"y": inputs["x"]}

    class SaysMaybe(RunsInto):
        accepts_row_splits = "yes"  # only True counts

    assert not BackendAdapter(RunsButSaysSplits()).writes_row_splits
    assert not BackendAdapter(SaysMaybe()).writes_row_splits


def test_the_torch_backend_writes_in_place_and_batches_in_place(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "double.pt"
    torch.jit.trace(torch.nn.Identity(), torch.zeros(2)).save(str(path))
    config = ModelConfig(name="t", backend="torch", path=str(path), inputs=(X,), outputs=(Y,))
    with BackendAdapter.load(config) as adapter:
        assert statements(adapter) == {"writes_outputs": True, "writes_row_splits": True, "synchronizes": True,
                                       "takes_memory": True, "takes_declare": True, "own_warmup": False,
                                       "tells_device_bytes": True, "closes": True}
        assert adapter.device_bytes() is None  # on the CPU: nothing to tell


def test_the_tensorrt_backend_states_its_calls_without_an_engine():
    from workers.backends.tensorrt import TensorRTBackend

    adapter = BackendAdapter(object.__new__(TensorRTBackend))  # nothing runs: only what it has is read
    assert statements(adapter) == {"writes_outputs": True, "writes_row_splits": True, "synchronizes": True,
                                   "takes_memory": True, "takes_declare": True, "own_warmup": True,
                                   "tells_device_bytes": False, "closes": True}


def test_an_object_that_cannot_run_is_not_a_backend():
    class Nothing:
        inputs = outputs = ()

    with pytest.raises(TypeError, match="Nothing is not a backend: it has neither run nor run_into"):
        BackendAdapter(Nothing())


def test_prepare_binds_merges_declares_and_warm_up_runs_on_the_backends_own_inputs():
    backend = Everything()
    adapter = BackendAdapter(backend)
    override = TensorSpec("y", "float32", (7,))
    config = ModelConfig(name="all", backend="x", path="-", outputs=(override,), warmup_requests=2)
    memory = object()
    spec = adapter.prepare(config, memory)
    assert spec.inputs == (X,) and spec.outputs == (override,)
    assert backend.calls == [("bind_memory", memory), ("declare", (X,), (override,))]
    warmed = adapter.warm_up(config, spec)
    assert warmed.runs == 2 and warmed.seconds >= 0
    assert backend.calls[2:] == [("run_into", {"x": (7,)}), ("synchronize",)] * 2
    backend.calls.clear()
    adapter.prepare(config)  # a CPU worker: no memory to bind
    assert backend.calls[0][0] == "declare"
    with adapter:
        pass
    assert backend.calls[-1] == ("close",)


def test_prepare_refuses_unknown_specs_and_warm_up_a_run_without_every_output():
    class Unknowing(RunsInto):
        inputs = outputs = ()

    with pytest.raises(ValueError, match="cannot tell its inputs/outputs; declare them in the config"):
        BackendAdapter(Unknowing()).prepare(ModelConfig(name="u", backend="x", path="-"))

    class Forgetful(RunsInto):
        outputs = (Y, TensorSpec("z", "float32", ("n",)))

    config = ModelConfig(name="f", backend="x", path="-", warmup_requests=0)
    adapter = BackendAdapter(Forgetful())
    with pytest.raises(ValueError, match="warm-up run produced 1 of 2 outputs"):
        adapter.warm_up(config, adapter.prepare(config))  # with no warm-up asked for: the check run
