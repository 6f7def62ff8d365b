"""A model zoo, built offline in the test session (issue 26, part 3).

Real architectures with random weights (no hub downloads), built once per test session
(``zoo_files``, ``vision_files``: session-scoped, in ``tmp_path_factory``), each exported to ONNX
by ``torch.onnx.export(..., dynamo=False)`` with ``dynamic_axes`` given as lists of axes — so the
dimension names are the exporter's own, and no input names an output's dimension: the server
learns those outputs' sizes (docs/models.md, "Outputs of any size") — and to TorchScript or
``torch.export``.  Each is served by a real server through the onnxruntime and torch backends,
plain and with dynamic batching (``max_batch_size``), and every answer is compared with the same
model run in-process.  No config carries a size hint (no ``max_output_bytes``, no ``-1``).

* a transformers encoder from a small ``BertConfig``: int64 ``input_ids`` and ``attention_mask``,
  dynamic batch and sequence, ``last_hidden_state`` out;
* a python model taking and returning strings (bytes tensors);
* a data-dependent model that acts like a detector after NMS (its output length is the number of
  candidates whose score passes a threshold: ``NonZero``/``Gather`` in ONNX), called with more
  boxes kept call after call, past the 1 MiB first guess;
* torchvision's resnet18, ssdlite320_mobilenet_v3_large and lraspp_mobilenet_v3_large
  (``weights=None``): skipped where ``import torchvision`` fails (the CPU-only test machine has
  only CUDA builds of torchvision; they run where torchvision works).  The detector's TorchScript
  calls ``torchvision::nms``: the torch backend imports torchvision before loading a file whose
  code names it (tests/test_torch_backend.py checks that where torchvision is not installed).

Tolerances: an answer from the torch backend is the same program on the same CPU, so
``rtol=1e-5, atol=1e-5`` (thread counts may change the order of sums); onnxruntime runs other
kernels, so ``rtol=1e-4, atol=1e-4`` against torch; integers, strings and counts are exact.  The
torchvision detector is compared with its served files run in-process (see its test).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

import serving_models  # noqa: E402  (the python model and its in-process reference)

from helpers.server import batch_stats, serving, wait_for  # noqa: E402

SAME_PROGRAM = dict(rtol=1e-5, atol=1e-5)  # torch backend against torch in-process
OTHER_KERNELS = dict(rtol=1e-4, atol=1e-4)  # onnxruntime against torch in-process
BATCHING = "max_batch_size = 8\nmax_queue_delay_us = 200000\n"
VOCAB, HIDDEN = 100, 32
FEATURES = 128  # per box kept by the detector


def torchvision_or_skip():
    """torchvision, or a skip naming why it cannot be imported here (a CUDA build of torchvision
    next to a CPU torch fails: ``operator torchvision::nms does not exist``)."""
    try:
        import torchvision
    except Exception as e:  # ImportError, or the RuntimeError of a torchvision built for another torch
        pytest.skip(f"torchvision cannot be imported here ({type(e).__name__}: {e}); a CUDA build of torchvision "
                    "next to a CPU-only torch fails: operator torchvision::nms does not exist")
    return torchvision


def onnx_export(module, args, path, inputs, outputs, axes) -> str:
    """``module`` to ONNX with dynamic axes as lists: the exporter names every dynamic dimension."""
    torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17, input_names=inputs,
                      output_names=outputs, dynamic_axes=axes)
    return str(path)


def model_table(name: str, backend: str, path: str, *, batched: bool = False, specs: str = "") -> str:
    return (f'[[models]]\nname = "{name}"\nbackend = "{backend}"\npath = "{path}"\n'
            + (BATCHING if batched else "") + specs + "\n")


def served_both_ways(name: str, backend: str, path: str, specs: str = "") -> str:
    """``name`` plain and ``name_batched`` with dynamic batching."""
    return model_table(name, backend, path, specs=specs) + model_table(f"{name}_batched", backend, path,
                                                                      batched=True, specs=specs)


class Encoder(torch.nn.Module):
    """A BERT encoder's ``last_hidden_state`` from ids and mask (a tensor out, for the exporters)."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class ThresholdDetector(torch.nn.Module):
    """Acts like a detector after NMS: of N candidates (cx, cy, w, h, logit), for those whose logit
    is above 0, in order: the corner boxes (x1, y1, x2, y2), sigmoid scores and 128 features (a
    linear head, as a segmenting detector's mask coefficients).  How many come out depends only on
    the data (and exactly: no arithmetic decides membership); the features make the outputs 27
    times the inputs' bytes when every candidate is kept."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(5, FEATURES)

    def forward(self, candidates):
        keep = torch.nonzero(candidates[:, 4] > 0.0).squeeze(1)
        kept = candidates[keep]
        half = kept[:, 2:4] / 2
        boxes = torch.cat([kept[:, 0:2] - half, kept[:, 0:2] + half], dim=1)
        return boxes, torch.sigmoid(kept[:, 4]), self.head(kept)


@pytest.fixture(scope="session")
def zoo_files(tmp_path_factory):
    """The zoo's models and their files, built once per session: ``{"bert": (module, onnx, pt2),
    "detector": (module, onnx, torchscript)}``."""
    d = tmp_path_factory.mktemp("zoo")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                     attn_implementation="eager")
    bert = Encoder(transformers.BertModel(config, add_pooling_layer=False)).eval()
    ids = torch.randint(1, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    axes = {"input_ids": [0, 1], "attention_mask": [0, 1], "last_hidden_state": [0, 1]}
    with torch.no_grad():
        bert_onnx = onnx_export(bert, (ids, mask), d / "bert.onnx", ["input_ids", "attention_mask"],
                                ["last_hidden_state"], axes)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=1, max=64)
    program = torch.export.export(bert, (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    torch.export.save(program, str(d / "bert.pt2"))

    detector = ThresholdDetector().eval()
    sample = torch.randn(16, 5)
    det_onnx = onnx_export(detector, (sample,), d / "detector.onnx", ["candidates"], ["boxes", "scores", "features"],
                           {"candidates": [0], "boxes": [0], "scores": [0], "features": [0]})
    torch.jit.script(detector).save(str(d / "detector.pt"))
    return {"bert": (bert, bert_onnx, str(d / "bert.pt2")), "detector": (detector, det_onnx, str(d / "detector.pt"))}


DETECTOR_SPECS = ('inputs = [{name = "candidates", dtype = "float32", shape = ["n", 5]}]\n'
                  'outputs = [{name = "boxes", dtype = "float32", shape = ["kept", 4]}, '
                  '{name = "scores", dtype = "float32", shape = ["kept"]}, '
                  '{name = "features", dtype = "float32", shape = ["kept", 128]}]\n')


@pytest.fixture(scope="module")
def server(zoo_files, tmp_path_factory):
    bert, bert_onnx, bert_pt2 = zoo_files["bert"]
    detector, det_onnx, det_ts = zoo_files["detector"]
    models = (served_both_ways("bert_onnx", "onnxruntime", bert_onnx)
              + served_both_ways("bert_torch", "torch", bert_pt2)
              + served_both_ways("words", "python", "serving_models:tag_words")
              + model_table("detector_onnx", "onnxruntime", det_onnx)
              + model_table("detector_torch", "torch", det_ts, specs=DETECTOR_SPECS))
    with serving(tmp_path_factory.mktemp("zoo_server"), models) as srv:
        yield srv


def together(srv, model: str, requests: list[dict]) -> list[dict]:
    """Each request from its own client, released together (a batching model may run them in one
    batch); every answer, in order."""
    barrier = threading.Barrier(len(requests))
    answers: list = [None] * len(requests)

    def call(i):
        try:
            with srv.client() as c:
                barrier.wait(60)
                answers[i] = c.infer(model, requests[i])
        except BaseException as e:  # noqa: BLE001 — handed to the test's thread below
            answers[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a call was not answered in 120 s"
    for a in answers:
        if isinstance(a, BaseException):
            raise a
    return answers


def batched_together(srv, model: str, requests: list[dict]) -> list[dict]:
    """``together`` on a batching model; asserts that at least two of the requests shared a run
    (the arena's batch-size counters: no timing)."""
    runs_before, requests_before = batch_stats(srv, model)
    answers = together(srv, model, requests)
    runs, counted = batch_stats(srv, model)
    assert counted - requests_before == len(requests)
    assert runs - runs_before < len(requests), "no two requests shared a run"
    return answers


def bert_request(rng, batch: int, seq: int) -> dict:
    ids = rng.integers(1, VOCAB, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - seq // 3:] = 0  # padding on the first row: the mask matters
    return {"input_ids": ids, "attention_mask": mask}


def hidden_state(answer: dict) -> np.ndarray:
    """The encoder's one output: ``last_hidden_state`` from ONNX; a ``.pt2`` program names it itself."""
    (out,) = answer.values()
    return out


def bert_reference(bert, request: dict) -> np.ndarray:
    with torch.inference_mode():
        return bert(torch.from_numpy(request["input_ids"]), torch.from_numpy(request["attention_mask"])).numpy()


@pytest.mark.parametrize("model, tolerance", [("bert_onnx", OTHER_KERNELS), ("bert_torch", SAME_PROGRAM)])
def test_bert_encoder_answers_as_run_in_process(server, zoo_files, model, tolerance):
    bert = zoo_files["bert"][0]
    rng = np.random.default_rng(1)
    with server.client() as lanes, server.client(lanes=False) as socket:
        for client, (batch, seq) in [(lanes, (1, 5)), (lanes, (3, 11)), (socket, (2, 9)), (lanes, (4, 33))]:
            request = bert_request(rng, batch, seq)
            out = hidden_state(client.infer(model, request))
            assert out.shape == (batch, seq, HIDDEN)
            np.testing.assert_allclose(out, bert_reference(bert, request), **tolerance)


@pytest.mark.parametrize("model, tolerance", [("bert_onnx_batched", OTHER_KERNELS),
                                              ("bert_torch_batched", SAME_PROGRAM)])
def test_bert_encoder_batched_answers_each_request_its_own_rows(server, zoo_files, model, tolerance):
    bert = zoo_files["bert"][0]
    rng = np.random.default_rng(2)
    requests = [bert_request(rng, batch, 12) for batch in (1, 2, 3, 1)]  # one sequence length: they batch
    for request, answer in zip(requests, batched_together(server, model, requests)):
        np.testing.assert_allclose(hidden_state(answer), bert_reference(bert, request), **tolerance)


TEXTS = [["the quick brown fox", "", "jumps"], ["über  straße", "a b c d e f"], ["one"],
         ["zero-copy lanes", "shared memory", "π ≈ 3.14159", "x" * 300]]


def text_array(texts: list[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=object)


@pytest.mark.parametrize("model", ["words", "words_batched"])
def test_python_string_model_answers_as_run_in_process(server, model):
    requests = [{"text": text_array(texts)} for texts in TEXTS]
    with server.client() as c:
        answers = [c.infer(model, r) for r in requests]
    answers += (batched_together if model.endswith("_batched") else together)(server, model, requests)
    for request, answer in zip(requests * 2, answers):
        upper, words = serving_models.words_reference(request["text"])
        assert answer["upper"].tolist() == upper.tolist()
        assert answer["words"].tolist() == words.tolist()


def candidates(rng, n: int, kept: int) -> np.ndarray:
    """``n`` candidate rows of which exactly ``kept`` (spread over the rows) have a positive logit."""
    rows = rng.uniform(0.1, 10.0, (n, 5)).astype(np.float32)
    rows[:, 4] = -rows[:, 4]
    rows[rng.choice(n, kept, replace=False), 4] *= -1
    return rows


@pytest.mark.parametrize("model, tolerance", [("detector_onnx", OTHER_KERNELS), ("detector_torch", SAME_PROGRAM)])
def test_data_dependent_outputs_growing_call_by_call_are_all_answered(server, zoo_files, model, tolerance):
    """The number of boxes kept grows from 0 to every candidate, on one input signature per path
    (lanes, the socket): the last calls need more than the first guesses (1 MiB an output; 10000
    boxes: 5.3 MB of outputs for 200 KB of inputs) and than what the signature learned before, and
    are run again with what they need (each path's short answers are counted by the worker)."""
    detector = zoo_files["detector"][0]
    rng = np.random.default_rng(3)
    short_before = short_answers(server, model)
    with server.client() as lanes, server.client(lanes=False) as socket:
        for client, n in [(lanes, 10000), (socket, 12000)]:
            for kept in (0, 3, 1000, n // 2, n - 1, n):
                x = candidates(rng, n, kept)
                answer = client.infer(model, {"candidates": x})
                with torch.inference_mode():
                    boxes, scores, features = (t.numpy() for t in detector(torch.from_numpy(x)))
                assert answer["boxes"].shape == (kept, 4) and answer["features"].shape == (kept, FEATURES)
                np.testing.assert_allclose(answer["boxes"], boxes, **tolerance)
                np.testing.assert_allclose(answer["scores"], scores, **tolerance)
                np.testing.assert_allclose(answer["features"], features, **tolerance)
    wait_for(lambda: short_answers(server, model) >= short_before + 2, f"{model}'s workers to count short answers")


def short_answers(srv, model: str) -> int:
    return sum((w.get("signatures") or {}).get("short", 0) for w in srv.info()["workers"] if w["model"] == model)


# --- torchvision: skipped where it cannot be imported -------------------------------------------


class SegmentationOut(torch.nn.Module):
    """A torchvision segmentation model's ``out`` map (a tensor, for the exporters)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, image):
        return self.model(image)["out"]


class Detections(torch.nn.Module):
    """A torchvision detector on one image: its boxes, scores and labels (as many as it finds)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, image):
        found = self.model([image])[0]
        return found["boxes"], found["scores"], found["labels"]


IMAGE = (3, 64, 64)  # classification and segmentation inputs: small
DETECTOR_IMAGE = (3, 240, 320)  # the detector's: its transform resizes to 320x320 anyway


@pytest.fixture(scope="session")
def vision_files(tmp_path_factory):
    """torchvision's resnet18, lraspp_mobilenet_v3_large and ssdlite320_mobilenet_v3_large with
    random weights, each as (module, onnx, torchscript), built once per session."""
    tv = torchvision_or_skip()
    d = tmp_path_factory.mktemp("zoo_vision")
    torch.manual_seed(0)
    built = {}
    image = torch.randn(2, *IMAGE)
    with torch.no_grad():
        resnet = tv.models.resnet18(weights=None).eval()
        built["resnet"] = (resnet, onnx_export(resnet, (image,), d / "resnet.onnx", ["image"], ["logits"],
                                               {"image": [0], "logits": [0]}))
        lraspp = SegmentationOut(tv.models.segmentation.lraspp_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=4)).eval()
        built["lraspp"] = (lraspp, onnx_export(lraspp, (image,), d / "lraspp.onnx", ["image"], ["out"],
                                               {"image": [0, 2, 3], "out": [0, 2, 3]}))
        ssd = Detections(tv.models.detection.ssdlite320_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=5)).eval()
        one = torch.rand(*DETECTOR_IMAGE)
        built["ssd"] = (ssd, onnx_export(ssd, (one,), d / "ssd.onnx", ["image"], ["boxes", "scores", "labels"],
                                         {"image": [1, 2], "boxes": [0], "scores": [0], "labels": [0]}))
        for name, example in [("resnet", image), ("lraspp", image), ("ssd", one)]:
            module, onnx_path = built[name]
            torch.jit.trace(module, (example,), check_trace=False).save(str(d / f"{name}.pt"))
            built[name] = (module, onnx_path, str(d / f"{name}.pt"))
    return built


VISION_SPECS = {
    "resnet": ('inputs = [{name = "image", dtype = "float32", shape = ["batch", 3, 64, 64]}]\n'
               'outputs = [{name = "logits", dtype = "float32", shape = ["batch", 1000]}]\n'),
    "lraspp": ('inputs = [{name = "image", dtype = "float32", shape = ["batch", 3, 64, 64]}]\n'
               'outputs = [{name = "out", dtype = "float32", shape = ["batch", 4, 64, 64]}]\n'),
    "ssd": ('inputs = [{name = "image", dtype = "float32", shape = [3, 240, 320]}]\n'
            'outputs = [{name = "boxes", dtype = "float32", shape = ["found", 4]}, '
            '{name = "scores", dtype = "float32", shape = ["found"]}, '
            '{name = "labels", dtype = "int64", shape = ["found"]}]\n'),
}


@pytest.fixture(scope="module")
def vision_server(vision_files, tmp_path_factory):
    models = ""
    for name in ("resnet", "lraspp"):
        _, onnx_path, ts = vision_files[name]
        models += (served_both_ways(f"{name}_onnx", "onnxruntime", onnx_path)
                   + served_both_ways(f"{name}_torch", "torch", ts, specs=VISION_SPECS[name]))
    _, onnx_path, ts = vision_files["ssd"]  # one image in, as many boxes out as it finds: not batched
    models += model_table("ssd_onnx", "onnxruntime", onnx_path) + model_table("ssd_torch", "torch", ts,
                                                                              specs=VISION_SPECS["ssd"])
    with serving(tmp_path_factory.mktemp("zoo_vision_server"), models) as srv:
        yield srv


def run_in_process(module, *args) -> list[np.ndarray]:
    with torch.inference_mode():
        out = module(*(torch.from_numpy(a) for a in args))
    return [t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,))]


@pytest.mark.parametrize("name, output", [("resnet", "logits"), ("lraspp", "out")])
@pytest.mark.parametrize("backend, tolerance", [("onnx", OTHER_KERNELS), ("torch", SAME_PROGRAM)])
def test_torchvision_classifier_and_segmenter_answer_as_run_in_process(vision_server, vision_files, name, output,
                                                                       backend, tolerance):
    module = vision_files[name][0]
    rng = np.random.default_rng(4)
    requests = [{"image": rng.standard_normal((batch, *IMAGE), dtype=np.float32)} for batch in (1, 3, 2)]
    with vision_server.client() as c:
        plain = [c.infer(f"{name}_{backend}", r) for r in requests]
    batched = batched_together(vision_server, f"{name}_{backend}_batched", requests)
    for request, answer in zip(requests * 2, plain + batched):
        np.testing.assert_allclose(answer[output], run_in_process(module, request["image"])[0], **tolerance)


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_torchvision_detector_answers_as_run_in_process(vision_server, vision_files, backend):
    """Its reference is the served file itself run in-process (onnxruntime on one thread, as the
    worker runs it; the TorchScript file): with random weights many scores are nearly equal, so
    another runtime's rounding may choose other boxes at the 300-detection cut."""
    _, onnx_path, ts = vision_files["ssd"]
    if backend == "onnx":
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
        reference = lambda image: session.run(None, {"image": image})  # noqa: E731
    else:
        module = torch.jit.load(ts)
        reference = lambda image: run_in_process(module, image)  # noqa: E731
    rng = np.random.default_rng(5)
    with vision_server.client() as c:
        for _ in range(3):
            image = rng.uniform(0, 1, DETECTOR_IMAGE).astype(np.float32)
            answer = c.infer(f"ssd_{backend}", {"image": image})
            boxes, scores, labels = reference(image)
            assert answer["labels"].tolist() == labels.tolist()
            np.testing.assert_allclose(answer["boxes"], boxes, **SAME_PROGRAM)
            np.testing.assert_allclose(answer["scores"], scores, **SAME_PROGRAM)
