"""CUDA graphs for torch GPU models (issue 14 part 3): what runs on the CPU.

Which batch-size buckets a model's graphs are captured for, which request
shapes take a captured graph, and the ``cuda_graphs`` switch, checked on a
CPU torch model (where graphs are off and say why).  The graphs themselves,
against the eager path through a real server, are in ``test_gpu_graphs.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shmserve.config import ModelConfig  # noqa: E402
from shmserve.spec import TensorSpec  # noqa: E402
from workers.adapter import BackendAdapter  # noqa: E402
from workers.backends.torch import bucket_of, graph_buckets  # noqa: E402

from helpers.torch_models import save_models  # noqa: E402

IMAGE = TensorSpec("image", "float32", ("batch", 3, 32, 32))
SCORES = TensorSpec("scores", "float32", ("batch", 10))


def test_buckets_are_the_warmed_batch_sizes_with_the_fixed_dimensions():
    assert graph_buckets([IMAGE], [SCORES], (1, 4, 16)) == (((1, 3, 32, 32),), ((4, 3, 32, 32),),
                                                             ((16, 3, 32, 32),))
    two = [IMAGE, TensorSpec("mask", "bool", (None, 7))]
    assert graph_buckets(two, [SCORES], (8, 1, 8, 0)) == (((1, 3, 32, 32), (1, 7)), ((8, 3, 32, 32), (8, 7)))
    fixed = TensorSpec("x", "float32", (2, 5))
    assert graph_buckets([fixed], [TensorSpec("y", "float32", (2,))], (1, 8)) == (((2, 5),),)


@pytest.mark.parametrize("inputs, outputs, why", [
    ([TensorSpec("x", "float32", ("batch", "width"))], [SCORES], "other than the leading one"),
    ([IMAGE], [TensorSpec("y", "float32", ("batch", None))], "'y' has a dynamic dimension"),
    ([TensorSpec("s", "float32", ())], [SCORES], "'s' has a dynamic dimension"),  # a scalar has no batch
    ([IMAGE, TensorSpec("w", "float32", (4, 3))], [SCORES], "fixed leading dimension and others a batch"),
    ([], [SCORES], "not declared"),
])
def test_models_that_cannot_be_captured_say_why(inputs, outputs, why):
    got = graph_buckets(inputs, outputs, (1, 8))
    assert isinstance(got, str) and why in got


def test_only_a_buckets_exact_shapes_take_its_graph():
    graph = object()
    buckets = {((1, 3, 32, 32),): graph, ((8, 3, 32, 32),): "pending"}
    assert bucket_of(((1, 3, 32, 32),), buckets) is graph
    assert bucket_of(((8, 3, 32, 32),), buckets) == "pending"
    assert bucket_of(((5, 3, 32, 32),), buckets) is None  # not padded up to 8: eager
    assert bucket_of(((1, 3, 32, 31),), buckets) is None


def _config(path, **options):
    return ModelConfig(name="m", backend="torch", path=path, options=options, max_batch_size=4,
                       inputs=(IMAGE,), outputs=(SCORES,))


def test_the_switch_and_why_a_cpu_model_runs_eagerly(tmp_path):
    path = save_models(tmp_path)["torchscript"]
    with pytest.raises(ValueError, match="option cuda_graphs must be true or false"):
        BackendAdapter.load(_config(path, cuda_graphs="on"))
    for options, why in (({}, "not a CUDA model"), ({"cuda_graphs": False}, "cuda_graphs = false")):
        config = _config(path, **options)
        adapter = BackendAdapter.load(config)
        adapter.warm_up(config, adapter.prepare(config))
        assert adapter.backend.graphs_off == why
        assert adapter.backend.runs == {"graph": 0, "eager": 2}  # warmed at batch sizes 1 and 4
