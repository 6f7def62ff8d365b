"""Python-backend models used by the serving tests (imported by worker processes via PYTHONPATH)."""

import time

import numpy as np


def slow(inputs):
    """Sleeps x[0] seconds, then returns 2x."""
    x = inputs["x"]
    time.sleep(float(x[0]) if x.size else 0.0)
    return {"y": x * 2}


slow.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
slow.outputs = [{"name": "y", "dtype": "float32", "shape": ["n"]}]


def fails(inputs):
    if inputs["x"].size and inputs["x"][0] < 0:
        raise ValueError("negative input")
    return {"y": inputs["x"]}


fails.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
fails.outputs = [{"name": "y", "dtype": "float32", "shape": ["n"]}]


def broken_factory(config):
    raise RuntimeError("this model cannot be loaded")


def wrong_dtype(inputs):
    return {"y": inputs["x"].astype(np.float64)}


wrong_dtype.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
wrong_dtype.outputs = [{"name": "y", "dtype": "float32", "shape": ["n"]}]


def grow(inputs):
    """An output 1000x larger than its input: more than the space reserved for it."""
    return {"y": np.zeros(inputs["x"].size * 1000, np.float32)}


grow.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
grow.outputs = [{"name": "y", "dtype": "float32", "shape": [None]}]


def double_rows(inputs):
    """2x, row by row: batching must hand each request back exactly its own rows."""
    return {"y": inputs["x"] * 2}


double_rows.inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", None]}]
double_rows.outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", None]}]


def dies_soon_after_load(config):
    """A crash loop: loads (an identity on float32), then its process exits 1 half a second later."""
    import os
    import threading

    threading.Timer(0.5, os._exit, (1,)).start()

    def identity(inputs):
        return {"y": inputs["x"]}

    identity.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
    identity.outputs = [{"name": "y", "dtype": "float32", "shape": ["n"]}]
    return identity


def recording(config):
    """2x over rows of 3 float32s that appends each run's input, as one JSON line, to the file named by
    ``options.record``: what a warm-up (or a request) ran it on.  ``options = {factory = true, record = ...}``."""
    import json

    path = config.options["record"]

    def run(inputs):
        x = inputs["x"]
        with open(path, "a") as f:
            f.write(json.dumps(x.tolist()) + "\n")
        return {"y": x * 2}

    run.inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", 3]}]
    run.outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]
    return run


def holds_device_memory(config):
    """An identity on float32 that holds ``options.bytes`` of its device's memory (torch) while loaded:
    a model whose device memory its backend cannot tell.  ``options = {factory = true, bytes = n}``."""
    import torch

    held = torch.empty(config.options["bytes"], dtype=torch.uint8, device=config.device)

    def identity(inputs):
        return {"y": inputs["x"]}

    identity.held = held
    identity.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
    identity.outputs = [{"name": "y", "dtype": "float32", "shape": ["n"]}]
    return identity


def two_outputs(inputs):
    """x back as y, and 2x as z (float32 vectors): a request may ask for either, both, or none."""
    x = inputs["x"]
    return {"y": x, "z": x * 2}


two_outputs.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
two_outputs.outputs = [{"name": "y", "dtype": "float32", "shape": ["n"]},
                       {"name": "z", "dtype": "float32", "shape": ["n"]}]


def two_inputs(inputs):
    """a + b (int32 vectors of one length): inputs given in any mix of JSON, binary and regions."""
    return {"sum": inputs["a"] + inputs["b"]}


two_inputs.inputs = [{"name": "a", "dtype": "int32", "shape": ["n"]}, {"name": "b", "dtype": "int32", "shape": ["n"]}]
two_inputs.outputs = [{"name": "sum", "dtype": "int32", "shape": ["n"]}]


def bytes_of_ints(inputs):
    """A bytes output whose elements are ints: the worker must refuse it (MODEL_ERROR)."""
    return {"y": np.arange(len(inputs["x"]), dtype=object)}


bytes_of_ints.inputs = [{"name": "x", "dtype": "bytes", "shape": ["n"]}]
bytes_of_ints.outputs = [{"name": "y", "dtype": "bytes", "shape": ["n"]}]


def bytes_grow(inputs):
    """A bytes output of one element 1000 times the input's total size: more than max_output_bytes."""
    return {"y": np.array([b"x" * 1000 * sum(len(e) for e in inputs["x"])], dtype=object)}


bytes_grow.inputs = [{"name": "x", "dtype": "bytes", "shape": ["n"]}]
bytes_grow.outputs = [{"name": "y", "dtype": "bytes", "shape": [1]}]


def digits(inputs):
    """Each int64 element as its decimal digits: a bytes output made of str elements (sent as UTF-8)."""
    return {"y": np.array([str(v) for v in inputs["x"].tolist()], dtype=object).reshape(inputs["x"].shape)}


digits.inputs = [{"name": "x", "dtype": "int64", "shape": ["n"]}]
digits.outputs = [{"name": "y", "dtype": "bytes", "shape": ["n"]}]


def typed_echo(config):
    """Each input back as ``out_<name>``: one vector input per dtype in ``options.dtypes``, named
    by its dtype.  ``options = {factory = true, dtypes = ["int8", ...]}`` (at most 8: a slot holds
    16 tensors, inputs and outputs together)."""
    dtypes = list(config.options["dtypes"])

    def echo(inputs):
        return {f"out_{d}": inputs[d] for d in dtypes}

    echo.inputs = [{"name": d, "dtype": d, "shape": ["n"]} for d in dtypes]
    echo.outputs = [{"name": f"out_{d}", "dtype": d, "shape": ["n"]} for d in dtypes]
    return echo


def rendezvous(inputs):
    """Leaves a mark in the directory $SHMSERVE_TEST_MEETING, waits (at most 20 s) until two calls
    have, and returns how many marks it saw: 2 when two calls were in the model at once."""
    import os
    import uuid

    where = os.environ["SHMSERVE_TEST_MEETING"]
    open(os.path.join(where, uuid.uuid4().hex), "w").close()
    deadline = time.monotonic() + 20
    while len(os.listdir(where)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"y": np.array([len(os.listdir(where))], np.uint8)}


rendezvous.inputs = [{"name": "x", "dtype": "uint8", "shape": [1]}]
rendezvous.outputs = [{"name": "y", "dtype": "uint8", "shape": [1]}]


def counted(inputs):
    """``n[0]`` float32s counting up from 0: an output whose length the data decides (a detector's
    boxes after NMS), not the inputs' shapes."""
    return {"y": np.arange(int(inputs["n"][0]), dtype=np.float32)}


counted.inputs = [{"name": "n", "dtype": "int64", "shape": [1]}]
counted.outputs = [{"name": "y", "dtype": "float32", "shape": ["count"]}]


def counted_stateful(inputs):
    """``counted``, and its calls so far as a second output ``calls`` (state a re-run shows)."""
    counted_stateful.calls += 1
    return {"y": np.arange(int(inputs["n"][0]), dtype=np.float32),
            "calls": np.array([counted_stateful.calls], np.int64)}


counted_stateful.calls = 0
counted_stateful.inputs = counted.inputs
counted_stateful.outputs = [counted.outputs[0], {"name": "calls", "dtype": "int64", "shape": [1]}]


def tag_words(inputs):
    """A text model of the zoo (tests/test_zoo.py): each string's words upper-cased and joined in
    reverse order, and its word count.  ``words_reference`` is the same, run in-process."""
    upper, count = words_reference(inputs["text"])
    return {"upper": upper, "words": count}


def words_reference(text):
    words = [element.decode("utf-8").split() for element in text]
    upper = np.array([" ".join(w.upper() for w in reversed(ws)).encode("utf-8") for ws in words], dtype=object)
    return upper, np.array([len(ws) for ws in words], dtype=np.int64)


tag_words.inputs = [{"name": "text", "dtype": "bytes", "shape": ["batch"]}]
tag_words.outputs = [{"name": "upper", "dtype": "bytes", "shape": ["batch"]},
                     {"name": "words", "dtype": "int64", "shape": ["batch"]}]


def gated(config):
    """Records every run and can hold one: x = [tag, hold] (float32).  Each run appends its tag as
    a line to the file ``options.record`` (what a worker ran, in order); with ``hold`` > 0 it then
    waits, at most 60 s, until the file ``<options.gates>/<tag>`` exists; with ``hold`` < 0 it
    sleeps -``hold`` seconds (a slow model: tools/bench_cancel.py).  Returns 2x.  The
    cancellation tests (tests/test_cancellation.py) hold the one worker with a call while they
    give up on others.  ``options = {factory = true, record = ..., gates = ...}``."""
    import os

    record, gates = config.options["record"], config.options["gates"]

    def run(inputs):
        x = inputs["x"]
        tag = int(x[0])
        with open(record, "a") as f:
            f.write(f"{tag}\n")
        if x[1] > 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(gates, str(tag))) and time.monotonic() < deadline:
                time.sleep(0.005)
        elif x[1] < 0:
            time.sleep(float(-x[1]))
        return {"y": x * 2}

    run.inputs = [{"name": "x", "dtype": "float32", "shape": [2]}]
    run.outputs = [{"name": "y", "dtype": "float32", "shape": [2]}]
    return run


def gated_rows(config):
    """``gated`` for batches: x = [[tag, hold], ...] (float32, rows); each run appends its rows'
    tags as one line (what a batch held, in row order) to ``options.record``, and a run with a
    row whose ``hold`` > 0 waits, at most 60 s, until ``<options.gates>/<tag>`` exists.  Returns
    2x.  ``options = {factory = true, record = ..., gates = ...}``."""
    import os

    record, gates = config.options["record"], config.options["gates"]

    def run(inputs):
        x = inputs["x"]
        with open(record, "a") as f:
            f.write(" ".join(str(int(tag)) for tag in x[:, 0]) + "\n")
        for tag, hold in x:
            deadline = time.monotonic() + 60
            while hold > 0 and not os.path.exists(os.path.join(gates, str(int(tag)))) and time.monotonic() < deadline:
                time.sleep(0.005)
        return {"y": x * 2}

    run.inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", 2]}]
    run.outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", 2]}]
    return run
