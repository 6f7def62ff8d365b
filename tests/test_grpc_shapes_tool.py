"""tools/grpc_shapes.py (issue 25's gRPC server-shape comparison), the parts with logic: shape names,
the summary of a case, and a real run: its echo servers (grpc.aio, the sync server with the loop
hop, two processes sharing a port) answer grpcio's stub and tritonclient with the request's bytes,
and the JSON report carries every case.  Nothing here is timed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))  # the spawned client processes import the tool by its name
_spec = importlib.util.spec_from_file_location("grpc_shapes", ROOT / "tools" / "grpc_shapes.py")
grpc_shapes = importlib.util.module_from_spec(_spec)
sys.modules["grpc_shapes"] = grpc_shapes
_spec.loader.exec_module(grpc_shapes)
DEADLINE_S = 60.0  # a call to a broken server fails instead of hanging the suite (generous: a busy machine)


def test_shape_names_parse_into_their_parts():
    shape = grpc_shapes.parse_shape("sync-t8-p4-iomgr")
    assert (shape.kind, shape.threads, shape.procs) == ("sync", 8, 4)
    assert dict(shape.env)["GRPC_EXPERIMENTS"] == grpc_shapes.IOMGR_EXPERIMENTS
    shape = grpc_shapes.parse_shape("aio-asyncio-latency-look1024k")
    assert (shape.kind, shape.loop, shape.procs) == ("aio", "asyncio", 1)
    assert dict(shape.options) == {"grpc.optimization_target": "latency", "grpc.http2.lookahead_bytes": 1 << 20}
    assert grpc_shapes.parse_shape("aio-uvloop").handlers == ("unary", "stream")
    assert "hop" in grpc_shapes.parse_shape("sync-t1").handlers
    assert grpc_shapes.parse_shape("grpclib-uvloop").handlers == ("stream",)
    assert grpc_shapes.parse_shape("h2lean-uvloop-p2").procs == 2


def test_the_door_options_stay_unless_a_shape_changes_one():
    options = dict(grpc_shapes._server_options(grpc_shapes.parse_shape("aio-uvloop")))
    assert options["grpc.http2.bdp_probe"] == 0 and options["grpc.so_reuseport"] == 0
    options = dict(grpc_shapes._server_options(grpc_shapes.parse_shape("aio-uvloop-bdp-p2")))
    assert options["grpc.http2.bdp_probe"] == 1 and options["grpc.so_reuseport"] == 1


@pytest.mark.parametrize("name, word", [("tornado", "kind"), ("aio-t4", "unknown token"),
                                        ("sync-uvloop", "unknown token"), ("sync-t0", "at least 1"),
                                        ("grpclib-iomgr", "unknown token"), ("h2lean-bdp", "unknown token")])
def test_a_wrong_shape_name_says_what_is_wrong(name, word):
    with pytest.raises(ValueError, match=word):
        grpc_shapes.parse_shape(name)


def test_the_command_line_refuses_a_bad_shape_handler_or_size_without_a_traceback(capsys):
    for argv in (["--shapes", "aio-t4"], ["--handlers", "bidi"], ["--clients", "curl"]):
        with pytest.raises(SystemExit) as exc:
            grpc_shapes.main(argv)
        assert "grpc_shapes:" in str(exc.value)
    with pytest.raises(SystemExit):
        grpc_shapes.main(["--sizes", "4 KB"])
    assert "is not a size" in capsys.readouterr().err


def test_a_case_summary_reads_its_percentiles_and_rounds():
    case = grpc_shapes.Case("aio-uvloop", "stream", 4096, "stub", 1)
    case.samples_ns = [i * 1000 for i in range(1, 101)]  # 1..100 µs
    case.round_p50_us, case.round_rps = [40.0, 60.0], [100.0, 300.0, 200.0]
    case.server_cpu_us, case.server_wait_us, case.server_vcs = [10.0, 30.0, 20.0], [1.0], [9.0]
    case.server_ivcs, case.client_cpu_us = [0.5], [7.0]
    row = case.summary()
    assert (row["p50_us"], row["p90_us"], row["p99_us"]) == (51.0, 91.0, 100.0)
    assert row["rps"] == 200.0 and row["server_cpu_us_per_req"] == 20.0 and row["busiest_process_share"] is None
    assert row["requests"] == 100 and row["round_p50_us"] == [40.0, 60.0]


def test_a_run_serves_the_echo_to_both_clients_and_reports_every_case(tmp_path, capsys):
    out = tmp_path / "shapes.json"
    rc = grpc_shapes.main(["--shapes", "aio-uvloop,sync-t2,aio-asyncio-p2", "--handlers", "stream,hop",
                           "--sizes", "4KiB", "--clients", "stub,triton", "--concurrency", "1,2",
                           "--rounds", "1", "--requests", "5", "--duration", "0.2", "--json-out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["params"]["rounds_done"] == 1 and report["params"]["seed"] == grpc_shapes.SEED
    cases = {(c["shape"], c["handler"], c["client"], c["concurrency"]): c for c in report["cases"]}
    # aio shapes have no loop hop (they are on the loop); the sync one has both
    assert set(cases) == {(s, h, c, n) for s, h in [("aio-uvloop", "stream"), ("sync-t2", "stream"),
                                                    ("sync-t2", "hop"), ("aio-asyncio-p2", "stream")]
                          for c in ("stub", "triton") for n in (1, 2)}
    for case in cases.values():  # every block answered (the echo's bytes were checked when warming up)
        assert case["requests"] >= 1 and case["server_cpu_us_per_req"] > 0
    assert cases["aio-asyncio-p2", "stream", "stub", 2]["busiest_process_share"] is not None
    assert "| aio-uvloop | stream | 4 KiB | stub | 1 |" in capsys.readouterr().out


def test_the_processes_of_a_shape_share_one_port():
    server = grpc_shapes.Server(grpc_shapes.parse_shape("sync-t1-p2"), "stream")
    try:
        assert len(server.pids) == 2
        assert all(p.poll() is None for p in server.procs)  # both bound the same port and serve
        call = grpc_shapes.StubCaller(server.address, 1000, timeout=DEADLINE_S)
        try:
            assert call() == grpc_shapes._payload(1000)
        finally:
            call.close()
    finally:
        server.stop()
    assert all(p.poll() is not None for p in server.procs)


@pytest.mark.parametrize("shape", ["h2lean-uvloop", "h2-uvloop"])
def test_the_own_http2_prototypes_answer_grpcio_clients_small_and_large(shape):
    """The prototypes speak HTTP/2 to grpc core's client: a message over several frames and windows
    (1 MiB, both ways) and one in a single frame, over one connection, with tritonclient too."""
    pytest.importorskip("hpack" if shape.startswith("h2lean") else "h2")
    server = grpc_shapes.Server(grpc_shapes.parse_shape(shape), "stream")
    try:
        for size in (4096, 1 << 20):
            for caller in (grpc_shapes.StubCaller, grpc_shapes.TritonCaller):
                call = caller(server.address, size, timeout=DEADLINE_S)
                try:
                    for _ in range(3):
                        assert call() == grpc_shapes._payload(size)
                finally:
                    call.close()
    finally:
        server.stop()
