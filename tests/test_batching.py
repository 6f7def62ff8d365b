"""Dynamic batching in the worker, through a real server: correct, ordered, bounded, counted.

No timing assertions: batching is observed through the arena's batch-size
counters, and waiting through requests that finish at all.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from shmserve import protocol
from shmserve.protocol import Kind

from helpers.server import DOUBLE_BATCHED, ServerProcess, batch_stats, concurrent_infer

CONFIG = DOUBLE_BATCHED + """
[[models]]
name = "fixed"
backend = "python"
path = "serving_models:double_rows"
max_batch_size = 8
max_queue_delay_us = 300000
inputs = [{name = "x", dtype = "float32", shape = [2, 3]}]
outputs = [{name = "y", dtype = "float32", shape = [2, 3]}]

[[models]]
name = "slowpoke"
backend = "python"
path = "serving_models:double_rows"
max_batch_size = 4
max_queue_delay_us = 2000000
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("batch")
    srv = ServerProcess(workdir, CONFIG, extra_args=["--metrics", str(workdir / "metrics.sock")]).start()
    srv.metrics = str(workdir / "metrics.sock")
    yield srv
    assert srv.stop() == 0, srv.log()


def concurrent(srv, model: str, inputs: list[np.ndarray]) -> list:
    return concurrent_infer(srv, model, "x", "y", inputs)


def test_concurrent_requests_run_as_batches_and_each_gets_its_own_rows(server):
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1 + i % 3, 3), dtype=np.float32) for i in range(8)]
    runs0, reqs0 = batch_stats(server, "double")
    results = concurrent(server, "double", inputs)
    for x, y in zip(inputs, results):
        np.testing.assert_array_equal(y, x * 2)
    runs, reqs = batch_stats(server, "double")
    assert reqs - reqs0 == 8
    assert runs - runs0 < 8  # at least two requests shared a run


def test_incompatible_shapes_in_one_window_run_separately(server):
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((2, 3 if i % 2 else 5), dtype=np.float32) for i in range(6)]
    for x, y in zip(inputs, concurrent(server, "double", inputs)):
        np.testing.assert_array_equal(y, x * 2)


def test_a_model_without_a_batch_dimension_is_not_batched(server):
    inputs = [np.full((2, 3), i, np.float32) for i in range(4)]
    runs0, reqs0 = batch_stats(server, "fixed")
    for x, y in zip(inputs, concurrent(server, "fixed", inputs)):
        np.testing.assert_array_equal(y, x * 2)
    runs, reqs = batch_stats(server, "fixed")
    assert runs - runs0 == reqs - reqs0 == 4


def test_a_lone_request_is_not_held_forever_and_a_full_batch_runs_as_one(server):
    with server.client() as c:  # max_queue_delay 2 s: the lone request still finishes
        assert c.infer("slowpoke", {"x": np.ones((1, 2), np.float32)}, timeout=30)["y"].tolist() == [[2.0, 2.0]]
    runs0, reqs0 = batch_stats(server, "slowpoke")
    inputs = [np.full((1, 2), i, np.float32) for i in range(4)]
    for x, y in zip(inputs, concurrent(server, "slowpoke", inputs)):
        np.testing.assert_array_equal(y, x * 2)
    runs, reqs = batch_stats(server, "slowpoke")
    assert reqs - reqs0 == 4 and runs - runs0 <= 2


def test_one_connections_results_keep_their_order(server):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.socket)
    s.settimeout(30)
    sizes = [3, 1, 4, 1, 5, 2, 6, 2, 5, 3]
    out = b""
    for i, n in enumerate(sizes):  # pipelined: all sent before any answer is read
        x = np.full((n, 3), i, np.float32)
        out += protocol.encode_frame(Kind.INFER, {"id": 100 + i, "model": "double", "inputs": [
            {"name": "x", "dtype": "float32", "shape": [n, 3]}]}, x.nbytes) + x.tobytes()
    s.sendall(out)
    conn = protocol.Connection(protocol.Role.CLIENT)
    ids, values = [], []
    while len(ids) < len(sizes):
        conn.receive_data(s.recv(65536))
        while True:
            ev = conn.next_event()
            if ev is protocol.NEED_DATA:
                break
            if isinstance(ev, protocol.Frame):
                assert ev.kind is Kind.RESULT, ev
                ids.append(ev.meta["id"])
                sink = np.empty(ev.meta["outputs"][0]["shape"], np.float32)
                values.append(sink)
                conn.accept_payload([sink.reshape(-1).view(np.uint8)])
    s.close()
    assert ids == [100 + i for i in range(len(sizes))]
    for i, (n, v) in enumerate(zip(sizes, values)):
        assert v.shape == (n, 3) and np.all(v == 2 * i)


def test_batch_size_metrics_match_the_arena_counters(server):
    from test_operations import scrape

    runs, reqs = batch_stats(server, "double")
    metrics = scrape(server.metrics)
    assert metrics[("shmserve_batch_size_count", (("model", "double"), ("version", "1")))] == runs
    assert metrics[("shmserve_batch_size_sum", (("model", "double"), ("version", "1")))] == reqs
    # Client.infer goes through lanes: the workers' counters see every call, the front-end's only its own.
    served = sum(n for (name, labels), n in metrics.items() if name == "shmserve_worker_requests_total"
                 and ("model", "double") in labels and ("outcome", "ok") in labels)
    assert reqs == served > runs > 0
