"""Per-caller rate limits through a real server (issue 29, part 2): the native socket (inline,
lanes, zero-copy), tritonclient over HTTP and gRPC, the metrics and ``info``, and a SIGHUP that
changes the limits.  The bucket arithmetic is tested in-process: tests/test_ratelimit.py.

Every assertion counts answers; none times anything (a refusal's ``retry_after`` is waited for,
then the same caller is served).  Each model here has limits of its own, so the tests do not
share buckets."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
import grpc  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from helpers import raw_http  # noqa: E402
from helpers.server import scrape_text, wait_for  # noqa: E402
from helpers.v2_server import auth, grpc_stub, python_model, triton_client, v2_serving  # noqa: E402
from shmserve.errors import ErrorCode, ShmserveError  # noqa: E402

UID = os.getuid()
MODELS = "".join(python_model(name, "shmserve.models:identity")
                 for name in ("sock", "lane", "anon", "bytes", "free", "later"))
LIMITS = f"""
[rate_limits.socket_uid]
uids = [{UID}]
model = "sock"
requests_per_s = 0.5
burst = 3

[rate_limits.lane_uid]
uids = [{UID}]
model = "lane"
requests_per_s = 0.5
burst = 3

[rate_limits.anon]
anonymous = true
model = "anon"
requests_per_s = 0.5
burst = 3

[rate_limits.client_bytes]
roles = ["client"]
model = "bytes"
bytes_per_s = 100
burst_bytes = 3000
"""
X = np.arange(1000, dtype=np.uint8) % 251
MAX_CALLS = 40  # a burst of 3 at 0.5/s is spent long before this many calls, however slow the machine


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ratelimit")
    with v2_serving(workdir, models=MODELS + LIMITS, deadlines=30,
                    extra_args=["--metrics", str(workdir / "m.sock")]) as s:
        s.metrics = str(workdir / "m.sock")
        yield s


def until_refused(call):
    """Call ``call()`` until it raises; (how many were served, the exception)."""
    for served in range(MAX_CALLS):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - each test checks what it is
            return served, exc
    raise AssertionError(f"{MAX_CALLS} calls were all served")


def refused_overloaded(exc, limit: str) -> float:
    assert isinstance(exc, ShmserveError) and exc.code is ErrorCode.OVERLOADED, exc
    assert f"rate limit '{limit}'" in exc.message and "retry after" in exc.message, exc.message
    assert exc.retry_after is not None and 0 < exc.retry_after <= 2.0 + 1e-6, exc.retry_after
    return exc.retry_after


# -- the native socket ---------------------------------------------------------------------------

def test_a_socket_client_is_refused_with_retry_after_and_served_again_after_it(srv):
    with srv.client(lanes=False) as c:
        served, exc = until_refused(lambda: c.infer("sock", {"x": X}))
        assert served >= 3
        wait = refused_overloaded(exc, "socket_uid")
        # another model is not limited: every call of it is served at once
        assert all(np.array_equal(c.infer("free", {"x": X})["y"], X) for _ in range(10))
        time.sleep(wait)
        assert np.array_equal(c.infer("sock", {"x": X})["y"], X)


def test_the_async_client_raises_retry_after_too(srv):
    import asyncio

    from shmserve import AsyncClient

    async def run():
        async with AsyncClient(srv.socket, lanes=False) as c:
            for _ in range(MAX_CALLS):
                try:
                    await c.infer("sock", {"x": X})
                except ShmserveError as exc:
                    return exc
        raise AssertionError("never refused")

    refused_overloaded(asyncio.run(run()), "socket_uid")


def test_a_lane_client_is_given_no_lane_and_its_calls_are_limited_on_the_socket(srv):
    with srv.client() as c:  # lanes on: infer and zero_copy would take a lane of "lane"
        served, exc = until_refused(lambda: c.infer("lane", {"x": X}))
        refused_overloaded(exc, "lane_uid")
        with c.zero_copy("lane", {"x": ((1000,), np.uint8)}) as call:
            call.inputs["x"][:] = X
            served, exc = until_refused(call.run)
        refused_overloaded(exc, "lane_uid")
        assert c.info()["lanes"] == 0 or all(  # no lane of "lane" was given to this uid
            w["lanes"] == 0 for w in c.info()["workers"] if w["model"] == "lane")


# -- the v2 doors ------------------------------------------------------------------------------

def anon_body() -> dict:
    return {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [4], "data": [1, 2, 3, 4]}]}


def four_bytes(module):
    x = module.InferInput("x", [4], "UINT8")
    x.set_data_from_numpy(np.arange(4, dtype=np.uint8))
    return x


def spend_anonymous(module, address: str) -> InferenceServerException:
    """Call "anon" as the anonymous caller through ``module`` (tritonclient.http or .grpc) until it
    is refused; the refusal."""
    anonymous = module.InferenceServerClient(address)
    try:
        x = four_bytes(module)
        served, exc = until_refused(lambda: anonymous.infer("anon", [x]))
    finally:
        anonymous.close()
    assert isinstance(exc, InferenceServerException) and "rate limit 'anon'" in exc.message(), exc
    return exc


def test_http_answers_429_with_retry_after_and_the_limits_name(srv):
    assert spend_anonymous(tritonhttp, srv.http).status() == "429"
    answer = raw_http.one(srv.http, raw_http.json_infer("anon", anon_body()))
    assert answer.status == 429 and "rate limit 'anon'" in json.loads(bytes(answer.body))["error"]
    retry = int(answer.headers["retry-after"])
    assert 1 <= retry <= 2
    time.sleep(retry)
    assert raw_http.one(srv.http, raw_http.json_infer("anon", anon_body())).status == 200


def test_grpc_answers_resource_exhausted_with_retry_after_in_trailing_metadata(srv):
    exc = spend_anonymous(tritongrpc, srv.grpc)
    assert "RESOURCE_EXHAUSTED" in str(exc.status()) and "retry after" in exc.message(), exc
    request = pb.ModelInferRequest(model_name="anon", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="UINT8", shape=[4])], raw_input_contents=[bytes(4)])
    with grpc_stub(srv.grpc, role=None) as stub:
        with pytest.raises(grpc.RpcError) as err:
            for _ in range(MAX_CALLS):
                stub.ModelInfer(request)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(err.value.trailing_metadata())
        assert trailing["shmserve-code"] == "overloaded"
        wait = float(trailing["retry-after"])
        assert 0 < wait <= 2.0 + 1e-3
        time.sleep(wait)
        assert stub.ModelInfer(request).outputs[0].name == "y"


def test_a_limited_caller_does_not_limit_another(srv):
    """The anonymous caller spent its burst of "anon": a token holder's calls of "anon" are all
    served at once, and so are the same uid's socket calls of an unlimited model."""
    spend_anonymous(tritonhttp, srv.http)
    x = four_bytes(tritonhttp)
    with triton_client(tritonhttp, srv.http, role="admin") as admin:
        served = sum(admin.infer("anon", [x]).as_numpy("y") is not None for _ in range(20))
    assert served == 20


def test_a_bytes_limit_of_a_token_role_counts_the_body(srv):
    x = tritonhttp.InferInput("x", [1000], "UINT8")
    x.set_data_from_numpy(X)
    with triton_client(tritonhttp, srv.http, role="client") as client:
        served, exc = until_refused(lambda: client.infer("bytes", [x]))
        assert 1 <= served <= 3 and exc.status() == "429" and "rate limit 'client_bytes'" in exc.message(), exc
    with triton_client(tritonhttp, srv.http, role="admin") as admin:  # role admin: not held
        assert all(admin.infer("bytes", [x]).as_numpy("y") is not None for _ in range(5))
    # a chunked body (its size unknown before it is read) is refused under a bytes limit
    answer = raw_http.one(srv.http, raw_http.request(
        "POST", "/v2/models/bytes/infer", b"", {**auth("client"), "Transfer-Encoding": "chunked"}))
    assert answer.status == 400 and "Content-Length" in answer.error


# -- visible ----------------------------------------------------------------------------------

def test_refusals_show_in_info_and_metrics_by_configured_labels(srv):
    with srv.client(lanes=False) as c:
        until_refused(lambda: c.infer("sock", {"x": X}))
        limits = {d["limit"]: d for d in c.info()["rate_limits"]}
    assert set(limits) == {"socket_uid", "lane_uid", "anon", "client_bytes"}
    assert limits["socket_uid"]["refused"] >= 1 and limits["socket_uid"]["model"] == "sock"
    assert limits["socket_uid"]["requests_per_s"] == 0.5 and limits["socket_uid"]["burst"] == 3
    text = scrape_text(srv.metrics)
    assert 'shmserve_rate_limited_total{limit="socket_uid",model="sock"}' in text
    labels = {line.split("{")[1].split("}")[0] for line in text.splitlines()
              if line.startswith("shmserve_rate_limited_total{")}
    assert all('limit="' in lab and str(UID) not in lab for lab in labels)
    assert 'shmserve_rate_limited_total{limit="lane_uid",model="lane"}' in text  # (0 until it refuses)
    shown = subprocess.run([sys.executable, "-m", "shmserve.cli", "inspect", "--instance", srv.instance, "--json"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    inspected = {d["limit"]: d for d in json.loads(shown.stdout)["lifecycle"]["rate_limits"]}
    assert inspected["socket_uid"]["refused"] >= limits["socket_uid"]["refused"]
    table = subprocess.run([sys.executable, "-m", "shmserve.cli", "inspect", "--instance", srv.instance],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert "rate limits" in table.stdout and "socket_uid" in table.stdout, table.stdout


# -- reload ----------------------------------------------------------------------------------

def reload(srv, text: str) -> None:
    reloads = srv.log().count("reload: done")
    srv.config_path.write_text(text)
    srv.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: srv.log().count("reload: done") > reloads, "the reload")


def test_sighup_changes_a_limit_and_diverts_a_lane_a_new_limit_holds(srv):
    original = srv.config_path.read_text()
    try:
        with srv.client() as c:
            for _ in range(5):  # "later" is unlimited: Client.infer takes a lane of it
                c.infer("later", {"x": X})
            lanes_before = sum(w["lanes"] for w in c.info()["workers"] if w["model"] == "later")
            assert lanes_before >= 1
            reload(srv, original + f'\n[rate_limits.later]\nuids = [{UID}]\nmodel = "later"\n'
                                   'requests_per_s = 0.5\nburst = 2\n')
            diverted = re.findall(r"(\d+) lane\(s\) diverted to the socket", srv.log())
            assert diverted and int(diverted[-1]) >= 1, diverted
            served, exc = until_refused(lambda: c.infer("later", {"x": X}))  # its lane diverted: the socket
            refused_overloaded(exc, "later")
            # and a limit raised by a reload lets the same client through
            reload(srv, original.replace("requests_per_s = 0.5\nburst = 3\n\n[rate_limits.lane_uid]",
                                         "requests_per_s = 1000\nburst = 1000\n\n[rate_limits.lane_uid]"))
            assert all(np.array_equal(c.infer("sock", {"x": X})["y"], X) for _ in range(20))
    finally:
        reload(srv, original)


# -- door processes ----------------------------------------------------------------------------

def test_door_processes_relay_a_limited_model_so_the_limit_is_not_multiplied(tmp_path):
    """With two door processes, each connection may land on either: the one set of buckets in main
    refuses the uid's calls of "sock" after its burst whichever door carried them; "free" is served
    by the doors themselves, all of it."""
    from helpers.server import serving

    models = python_model("sock", "shmserve.models:identity") + python_model("free", "shmserve.models:identity")
    limit = f'[rate_limits.socket_uid]\nuids = [{UID}]\nmodel = "sock"\nrequests_per_s = 0.5\nburst = 3\n'
    with serving(tmp_path, models + limit, server_section="doors = 2\n") as s:
        clients = [s.client(lanes=False) for _ in range(4)]
        try:
            served, refusal = 0, None
            for i in range(MAX_CALLS):
                try:
                    clients[i % 4].infer("sock", {"x": X})
                    served += 1
                except ShmserveError as exc:
                    refusal = exc
                    break
            assert refusal is not None and served <= 4, served  # 3, and 1 more if a token refilled meanwhile
            refused_overloaded(refusal, "socket_uid")
            assert all(np.array_equal(c.infer("free", {"x": X})["y"], X) for c in clients for _ in range(5))
        finally:
            for c in clients:
                c.close()
