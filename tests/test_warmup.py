"""Warm-up: which inputs a version is run on before it takes traffic, at which batch sizes, how often.

The inputs themselves (``workers.warmup``) are pure and checked alone; a
real server then shows that every configured batch size is run
``warmup.requests`` times, that a sample file's exact data is fed, and that
a sample file that does not fit its input keeps the model from loading with
the file named.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from shmserve.config import ModelConfig
from shmserve.spec import TensorSpec
from workers import warmup

from helpers.server import serving, wait_for

ROWS = (TensorSpec("x", "float32", ("batch", 3)),)


def model(**kw) -> ModelConfig:
    return ModelConfig(name="m", backend="python", path="-", **kw)


def shapes(config: ModelConfig, specs=ROWS, own=None) -> list:
    return [(size, {name: a.shape for name, a in inputs.items()}) for size, inputs in warmup.runs(config, specs, own)]


# -- the inputs, alone ------------------------------------------------------------------------

def test_a_batching_model_is_warmed_requests_times_at_one_its_preferred_sizes_and_its_largest():
    config = model(max_batch_size=8, preferred_batch_sizes=(4,), warmup_requests=2)
    assert shapes(config) == [(1, {"x": (1, 3)})] * 2 + [(4, {"x": (4, 3)})] * 2 + [(8, {"x": (8, 3)})] * 2


def test_no_warm_up_requests_still_runs_once_to_check_the_outputs():
    assert shapes(model(max_batch_size=8, warmup_requests=0)) == [(1, {"x": (1, 3)})]
    assert shapes(model(warmup_requests=0)) == [(None, {"x": (1, 3)})]


def test_a_model_that_does_not_batch_is_warmed_on_its_samples_as_they_are():
    fixed = (TensorSpec("x", "float32", (2, 3)),)
    assert shapes(model(max_batch_size=8, warmup_requests=3), fixed) == [(None, {"x": (2, 3)})] * 3
    own = {"x": np.ones((7, 3), np.float32)}  # the backend's own warm-up inputs
    assert shapes(model(warmup_requests=1), ROWS, own) == [(None, {"x": (7, 3)})]
    # batch sizes named in the config count even without max_batch_size
    assert shapes(model(warmup_batch_sizes=(2, 5)), ROWS, own) == [(2, {"x": (2, 3)}), (5, {"x": (5, 3)})]


def test_a_samples_rows_are_repeated_in_turn_to_fill_a_batch(tmp_path):
    np.save(tmp_path / "x.npy", np.array([[1, 2, 3], [4, 5, 6]], np.float32))
    config = model(warmup_inputs=(("x", str(tmp_path / "x.npy")),), warmup_batch_sizes=(1, 3))
    (_, one), (_, three) = warmup.runs(config, ROWS, None)
    np.testing.assert_array_equal(one["x"], [[1, 2, 3]])
    np.testing.assert_array_equal(three["x"], [[1, 2, 3], [4, 5, 6], [1, 2, 3]])


def test_generated_inputs_take_the_named_sizes_a_sample_file_gives(tmp_path):
    specs = (TensorSpec("tokens", "int64", ("batch", "seq")), TensorSpec("mask", "bool", ("batch", "seq")))
    np.save(tmp_path / "tokens.npy", np.arange(5, dtype=np.int64)[None, :])
    config = model(warmup_inputs=(("tokens", str(tmp_path / "tokens.npy")),), max_batch_size=2)
    assert shapes(config, specs)[-1] == (2, {"tokens": (2, 5), "mask": (2, 5)})


@pytest.mark.parametrize("sample, why", [
    (np.zeros((1, 3), np.float64), "dtype float64, but input 'x' is float32"),
    (np.zeros((1, 4), np.float32), "shape [1, 4], but dimension 1 of input 'x' must be 3 (shape ['batch', 3])"),
    (np.zeros(3, np.float32), "shape [3], but input 'x' has rank 2 (shape ['batch', 3])"),
    (np.zeros((0, 3), np.float32), "shape [0, 3] has no row to fill a batch with"),
    (np.array([{"a": 1}], dtype=object), "not a readable .npy file"),  # pickled objects are not loaded
])
def test_a_sample_file_that_does_not_fit_its_input_is_refused_naming_it(tmp_path, sample, why):
    path = tmp_path / "bad.npy"
    np.save(path, sample, allow_pickle=True)
    config = model(warmup_inputs=(("x", str(path)),), max_batch_size=4)
    with pytest.raises(ValueError) as info:
        list(warmup.runs(config, ROWS, None))
    assert str(info.value).startswith(f"warmup.inputs.x ({path}): {why}")


def test_a_sample_for_an_input_the_model_does_not_have_is_refused(tmp_path):
    np.save(tmp_path / "z.npy", np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"warmup.inputs names 'z', which is not an input of model 'm' "
                                         r"\(its inputs: x\)"):
        list(warmup.runs(model(warmup_inputs=(("z", str(tmp_path / "z.npy")),)), ROWS, None))


# -- in a real server -------------------------------------------------------------------------

RECORDING = """
[[models]]
name = "{name}"
backend = "python"
path = "serving_models:recording"
max_batch_size = 8
preferred_batch_sizes = [4]
warmup = {warmup}
[models.options]
factory = true
record = "{record}"
"""


def recorded(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_server_warms_every_batch_size_on_the_configured_samples_before_serving(tmp_path):
    np.save(tmp_path / "x.npy", np.array([[1.5, -2, 3]], np.float32))
    np.save(tmp_path / "wide.npy", np.zeros((1, 4), np.float32))
    np.save(tmp_path / "double.npy", np.zeros((1, 3), np.float64))
    models = {
        "plain": "{requests = 2}",
        "sampled": '{requests = 1, inputs = {x = "x.npy"}, batch_sizes = [1, 3]}',
        "checked": "{requests = 0}",
        "wide": '{inputs = {x = "wide.npy"}}',
        "double": '{inputs = {x = "double.npy"}}',
    }
    config = "".join(RECORDING.format(name=name, warmup=warm, record=tmp_path / f"{name}.jsonl")
                     for name, warm in models.items())
    with serving(tmp_path, config) as srv:
        with srv.client() as c:
            listing = wait_for(lambda: (m := {d["name"]: d for d in c.models()})
                               and all(d["state"] in ("ready", "unavailable") for d in m.values()) and m,
                               "every model to load or fail")
            runs = {name: recorded(tmp_path / f"{name}.jsonl") for name in models}
            assert [len(x) for x in runs["plain"]] == [1, 1, 4, 4, 8, 8]  # sizes 1, preferred 4, max 8; twice each
            assert all(x == [[0, 0, 0]] * len(x) for x in runs["plain"])  # generated: zeros
            assert runs["sampled"] == [[[1.5, -2, 3]], [[1.5, -2, 3]] * 3]  # the file's exact data, tiled
            assert runs["checked"] == [[[0, 0, 0]]]  # no warm-up asked: the one check run
            for name, why in (("wide", "shape [1, 4], but dimension 1 of input 'x' must be 3"),
                              ("double", "dtype float64, but input 'x' is float32")):
                assert listing[name]["state"] == "unavailable" and runs[name] == []
                assert f"ValueError: warmup.inputs.x ({tmp_path / f'{name}.npy'}): {why}" in listing[name]["error"]
            np.testing.assert_array_equal(c.infer("sampled", {"x": np.ones((2, 3), np.float32)})["y"],
                                          np.full((2, 3), 2, np.float32))
        assert len(recorded(tmp_path / "sampled.jsonl")) == 3  # served after warm-up, not before
        assert {w["model"]: w["restarts"] for w in srv.info()["workers"]}["wide"] == 0  # not retried
