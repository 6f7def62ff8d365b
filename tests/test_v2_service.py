"""``V2Service`` and its ``Catalog`` in-process: the real dispatcher, arena, model table and region
table with in-process fake workers and a fake clock (``helpers.fake_frontend``), no door, no
socket, no loop.  Through real servers: ``test_v2_conformance.py``, ``test_v2_triton.py``."""

from __future__ import annotations

import numpy as np
import pytest

from shmserve.errors import ErrorCode
from shmserve.v2 import rest
from shmserve.v2.auth import Authenticator, Scope
from shmserve.v2.catalog import Catalog, version_number
from shmserve.v2.messages import V2Error
from shmserve.v2.service import Caller, V2Service
from shmserve.v2.sysshm import SystemShm

from helpers.fake_frontend import make_fixture, no_children_left, no_processes  # noqa: F401 (fixtures)


def service_of(fe) -> V2Service:
    auth = Authenticator(allowed=lambda uid, groups: True, is_admin=lambda uid, groups: False)
    return V2Service(dispatcher=fe.dispatcher, models=fe.models, status=None, lifecycle=None,
                     shm=SystemShm(enabled=False, own=set(), max_per_uid=1), auth=auth)


def add_request(x: np.ndarray, model: str = "add", version: str | None = None):
    return rest.parse_infer(model, version, {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                                         "data": x.tolist()}]})


def test_an_infer_request_is_served_through_the_dispatcher_and_its_result_released(make):
    fe = make()
    service = service_of(fe)
    door = service.open_door()
    caller = Caller(service.auth.anonymous, door)
    x = np.arange(8, dtype=np.float32)
    answers = []
    call = service.start(caller, add_request(x), lambda result, error: answers.append((result, error)))
    assert not call.ended and door.in_flight() == 1 and service.ledger.requests[caller.key] == 1
    fe.settle()
    [(result, error)] = answers
    assert error is None and result.model_name == "add" and result.model_version == "1"
    [y] = result.outputs
    assert (y.name, y.datatype, y.shape) == ("y", "FP32", (8,))
    assert np.array_equal(np.frombuffer(bytes(y.data), np.float32), x + 1)
    result.release()
    assert door.in_flight() == 0 and service.ledger.requests[caller.key] == 0


def test_a_cancelled_call_is_never_answered_and_holds_nothing(make):
    fe = make()
    service = service_of(fe)
    door = service.open_door()
    answers = []
    call = service.start(Caller(service.auth.anonymous, door), add_request(np.ones(4, np.float32)),
                         lambda result, error: answers.append(error))
    call.cancel()
    fe.settle()
    assert not answers and door.in_flight() == 0


def test_closing_a_door_drops_what_it_has_in_flight(make):
    fe = make()
    service = service_of(fe)
    door = service.open_door()
    answers = []
    service.start(Caller(service.auth.anonymous, door), add_request(np.ones(4, np.float32)),
                  lambda result, error: answers.append(error))
    service.close_door(door)
    fe.settle()
    assert not answers and door not in service.doors


def test_refusals_come_at_once_in_triton_s_words_and_hold_nothing(make):
    fe = make()
    service = service_of(fe)
    caller = Caller(service.auth.anonymous, service.open_door())
    with pytest.raises(V2Error) as refused:
        service.start(caller, add_request(np.ones(2, np.float32), model="nope"), lambda r, e: None)
    assert refused.value.code in (ErrorCode.UNKNOWN_MODEL, ErrorCode.MODEL_UNAVAILABLE)
    request = rest.parse_infer("add", None, {"inputs": [{"name": "z", "datatype": "FP32", "shape": [2],
                                                         "data": [1, 2]}]})
    with pytest.raises(V2Error) as refused:  # an input the model does not have
        service.start(caller, request, lambda r, e: None)
    assert refused.value.code is ErrorCode.BAD_INPUT and "'z'" in refused.value.message
    assert service.ledger.requests[caller.key] == 0 and caller.door.in_flight() == 0


def test_an_anonymous_caller_may_not_read_statistics_or_the_repository(make):
    fe = make()
    service = service_of(fe)
    caller = Caller(service.auth.anonymous, service.open_door())
    assert Scope.STATISTICS not in service.auth.anonymous.scopes
    for call in (lambda: service.statistics(caller, None, None), lambda: service.repository_index(caller)):
        with pytest.raises(V2Error) as refused:
            call()
        assert refused.value.code is ErrorCode.PERMISSION_DENIED


def test_the_catalog_names_versions_and_describes_models_in_triton_s_forms(make):
    fe = make()
    catalog = Catalog(fe.models, status=None)
    assert catalog.version("add", None).version == 1 and catalog.version("add", "1").version == 1
    assert catalog.model_metadata("add", None) == {
        "name": "add", "versions": ["1"], "platform": "fake",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}
    assert catalog.model_ready("add", "") is True
    config = catalog.model_config("add", None)
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}] and config["max_batch_size"] == 0
    assert catalog.raw_input("add", None).name == "x"
    for name, version in (("nope", None), ("add", "7"), ("add", "x1")):
        with pytest.raises(V2Error) as refused:
            catalog.version(name, version)
        assert refused.value.code is ErrorCode.UNKNOWN_MODEL
    assert version_number("add", "") is None and version_number("add", "12") == 12


def test_the_service_hands_metadata_calls_to_its_catalog(make):
    fe = make()
    service = service_of(fe)
    assert service.model_metadata("add", None) == service.catalog.model_metadata("add", None)
    assert service.model_config("add", "1") == service.catalog.model_config("add", "1")
    assert service.server_metadata()["name"] == "shmserve" and service.live()


def test_the_service_checks_the_right_to_infer_before_the_inference_half_sees_the_request(make):
    fe = make()
    service = service_of(fe)
    service.auth = Authenticator(allowed=lambda uid, groups: True, is_admin=lambda uid, groups: False,
                                 anonymous=[Scope.METADATA])
    caller = Caller(service.auth.anonymous, service.open_door())
    with pytest.raises(V2Error) as refused:
        service.start(caller, add_request(np.ones(2, np.float32)), lambda r, e: None)
    assert refused.value.code is ErrorCode.PERMISSION_DENIED
    assert service.ledger.requests[caller.key] == 0 and caller.door.in_flight() == 0
    answers = []  # the inference half itself checks no right: the door behind the service does not call it
    service.inference.start(caller, add_request(np.ones(2, np.float32)), lambda r, e: answers.append((r, e)))
    fe.settle()
    [(result, error)] = answers
    assert error is None
    result.release()
    del result, answers  # the frame outlives the test in ``refused``'s traceback: no view of the arena with it
