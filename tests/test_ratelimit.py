"""Per-caller rate limits (issue 29, part 2), in-process: the buckets with times passed in, and
the ``[rate_limits]`` configuration.  Through real servers: tests/test_ratelimit_serving.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmserve import config
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.config import ConfigError, RateLimit
from shmserve.frontend.ratelimit import ANONYMOUS, MAX_BUCKETS, Caller, RateLimiter, holds

ALICE, BOB = Caller.of_uid(1001, {100}), Caller.of_uid(1002, {200})
INGEST = Caller("token:ingest", token="ingest", role="client")


def limiter(**kw) -> RateLimiter:
    kw.setdefault("key", "lim")
    kw.setdefault("each_caller", True)
    if "requests_per_s" in kw:
        kw.setdefault("burst", max(1.0, kw["requests_per_s"]))
    if "bytes_per_s" in kw:
        kw.setdefault("burst_bytes", kw["bytes_per_s"])
    return RateLimiter((RateLimit(**kw),))


# -- requests/s ---------------------------------------------------------------------------------

def test_a_full_bucket_lets_its_burst_through_at_once_then_refills_at_its_rate():
    rate = limiter(requests_per_s=2, burst=5)
    assert [rate.admit(ALICE, "m", 0, 100.0) for _ in range(5)] == [None] * 5
    refusal = rate.admit(ALICE, "m", 0, 100.0)
    assert refusal is not None and refusal.limit == "lim"
    assert refusal.retry_after == pytest.approx(0.5)  # one request at 2/s
    assert rate.admit(ALICE, "m", 0, 100.49) is not None  # not yet
    assert rate.admit(ALICE, "m", 0, 100.5) is None  # exactly then
    assert rate.admit(ALICE, "m", 0, 100.5) is not None
    # a long pause refills no more than the burst
    assert [rate.admit(ALICE, "m", 0, 1000.0) for _ in range(6)].count(None) == 5


def test_retry_after_is_when_the_request_would_enter_and_a_refusal_charges_nothing():
    rate = limiter(requests_per_s=4, burst=1)
    assert rate.admit(ALICE, "m", 0, 10.0) is None
    first = rate.admit(ALICE, "m", 0, 10.1)
    assert first.retry_after == pytest.approx(0.15)
    for t in (10.12, 10.2, 10.24):  # refused again and again: each says the same moment
        again = rate.admit(ALICE, "m", 0, t)
        assert t + again.retry_after == pytest.approx(10.25)
    assert rate.admit(ALICE, "m", 0, 10.25) is None
    assert "retry after" in first.message and "rate_limits.lim" in first.message


def test_each_caller_has_its_own_bucket_and_the_anonymous_caller_is_one():
    rate = limiter(requests_per_s=1, burst=1)
    assert rate.admit(ALICE, "m", 0, 0.0) is None
    assert rate.admit(ALICE, "m", 0, 0.0) is not None
    assert rate.admit(BOB, "m", 0, 0.0) is None  # Bob is not slowed by Alice
    assert rate.admit(INGEST, "m", 0, 0.0) is None
    assert rate.admit(ANONYMOUS, "m", 0, 0.0) is None
    assert rate.admit(Caller("anonymous"), "m", 0, 0.0) is not None  # every anonymous caller is that one


# -- bytes/s ------------------------------------------------------------------------------------

def test_bytes_per_second_charges_each_request_its_bytes():
    rate = limiter(bytes_per_s=1000, burst_bytes=3000)
    assert rate.admit(ALICE, "m", 2000, 0.0) is None
    assert rate.admit(ALICE, "m", 1000, 0.0) is None
    refusal = rate.admit(ALICE, "m", 500, 0.0)
    assert refusal.retry_after == pytest.approx(0.5)
    assert rate.admit(ALICE, "m", 500, 0.5) is None


def test_a_request_larger_than_the_burst_enters_on_a_full_bucket_and_leaves_it_in_debt():
    rate = limiter(bytes_per_s=1000, burst_bytes=1000)
    assert rate.admit(ALICE, "m", 5000, 0.0) is None  # full: it enters (never refused forever)
    refusal = rate.admit(ALICE, "m", 1, 0.0)
    assert refusal.retry_after == pytest.approx(4.001)  # -4000 back up to 1 byte
    assert rate.admit(ALICE, "m", 5000, 4.5) is not None  # needs the whole burst again
    assert rate.admit(ALICE, "m", 5000, 5.0) is None


def test_both_dimensions_must_admit_and_the_longest_wait_is_said():
    rate = limiter(requests_per_s=10, burst=10, bytes_per_s=100, burst_bytes=100)
    assert rate.admit(ALICE, "m", 100, 0.0) is None
    refusal = rate.admit(ALICE, "m", 50, 0.0)  # requests left, bytes not
    assert refusal.retry_after == pytest.approx(0.5)
    # the requests bucket was not charged by the refusal: ten more fit once bytes are back
    assert [rate.admit(ALICE, "m", 0, 1.0) for _ in range(10)].count(None) >= 9


def test_several_limits_all_or_nothing_and_the_worst_is_named():
    rate = RateLimiter((RateLimit("global", each_caller=True, requests_per_s=100, burst=100),
                        RateLimit("slow", uids=(1001,), model="big", requests_per_s=1, burst=1)))
    assert rate.admit(ALICE, "big", 0, 0.0) is None
    refusal = rate.admit(ALICE, "big", 0, 0.0)
    assert refusal.limit == "slow" and refusal.retry_after == pytest.approx(1.0)
    for _ in range(99):  # the refusals took nothing from "global"; "small" is not "big"
        assert rate.admit(ALICE, "small", 0, 0.0) is None
    assert rate.admit(ALICE, "small", 0, 0.0).limit == "global"
    assert rate.refused == {("slow", "big"): 1, ("global", "*"): 1}


# -- who and which model ------------------------------------------------------------------------

@pytest.mark.parametrize("limit, yes, no", [
    (RateLimit("k", uids=(1001,)), [ALICE], [BOB, INGEST, ANONYMOUS]),
    (RateLimit("k", gids=(200,)), [BOB], [ALICE, INGEST, ANONYMOUS]),
    (RateLimit("k", tokens=("ingest",)), [INGEST], [ALICE, ANONYMOUS, Caller("token:other", token="other")]),
    (RateLimit("k", roles=("client",)), [INGEST], [ALICE, ANONYMOUS, Caller("token:a", token="a", role="admin")]),
    (RateLimit("k", anonymous=True), [ANONYMOUS], [ALICE, INGEST]),
    (RateLimit("k", each_caller=True), [ALICE, BOB, INGEST, ANONYMOUS], []),
])
def test_who_a_limit_holds(limit, yes, no):
    assert all(holds(limit, c) for c in yes) and not any(holds(limit, c) for c in no)


def test_a_token_holder_is_never_its_registration_uid():
    token_with_uid = Caller("token:ingest", uid=None, token="ingest", role="client")
    assert not holds(RateLimit("k", uids=(1001,)), token_with_uid)


def test_a_limit_of_one_model_covers_that_model_only():
    rate = RateLimiter((RateLimit("k", uids=(1001,), model="m", requests_per_s=1, burst=1),))
    assert rate.covering(ALICE, "m").key == "k"
    assert rate.covering(ALICE, "other") is None and rate.covering(BOB, "m") is None
    assert rate.model_limited("m") and not rate.model_limited("other")
    assert not rate.counts_bytes(ALICE, "m")
    assert [rate.admit(ALICE, "other", 0, 0.0) for _ in range(5)] == [None] * 5


def test_no_limits_admit_everything_and_are_false():
    rate = RateLimiter()
    assert not rate and rate.admit(ALICE, "m", 1 << 40, 0.0) is None and rate.describe() == []


# -- reload and bookkeeping ---------------------------------------------------------------------

def test_a_reload_keeps_the_buckets_of_an_unchanged_limit_and_starts_a_changed_one_full():
    same = RateLimit("same", each_caller=True, requests_per_s=1, burst=1)
    changed = RateLimit("changed", each_caller=True, model="m", requests_per_s=1, burst=1)
    rate = RateLimiter((same, changed))
    assert rate.admit(ALICE, "m", 0, 0.0) is None
    rate.configure((same, RateLimit("changed", each_caller=True, model="m", requests_per_s=1, burst=2)))
    refusal = rate.admit(ALICE, "m", 0, 0.0)
    assert refusal is not None and refusal.limit == "same"
    rate.configure(())
    assert rate.admit(ALICE, "m", 0, 0.0) is None


def test_full_buckets_are_forgotten_past_the_bound():
    rate = limiter(requests_per_s=10, burst=1)
    for uid in range(MAX_BUCKETS + 1):
        assert rate.admit(Caller.of_uid(uid), "m", 0, 0.0) is None
    assert rate.admit(Caller.of_uid(10**6), "m", 0, 1.0) is None  # the others are full again by now
    assert len(rate.buckets) == 1


def test_describe_names_no_caller():
    rate = limiter(requests_per_s=1, burst=1)
    rate.admit(ALICE, "m", 0, 0.0)
    rate.admit(ALICE, "m", 0, 0.0)
    (d,) = rate.describe()
    assert d == {"limit": "lim", "model": "*", "requests_per_s": 1, "burst": 1, "bytes_per_s": None,
                 "burst_bytes": None, "callers": 1, "refused": 1}


@settings(max_examples=200, deadline=None)
@given(rps=st.floats(0.5, 50), burst=st.integers(1, 20),
       gaps=st.lists(st.floats(0, 2), min_size=1, max_size=60))
def test_never_more_than_burst_plus_rate_times_elapsed(rps, burst, gaps):
    rate = limiter(requests_per_s=rps, burst=burst)
    now, admitted = 0.0, 0
    for gap in gaps:
        now += gap
        refusal = rate.admit(ALICE, "m", 0, now)
        if refusal is None:
            admitted += 1
        else:  # and it would have entered at the time it says
            probe = RateLimiter(rate.limits)
            probe.buckets = {k: type(b)(b.tokens, b.at) for k, b in rate.buckets.items()}
            assert probe.admit(ALICE, "m", 0, now + refusal.retry_after) is None
        assert admitted <= burst + rps * now + 1e-6


# -- configuration ------------------------------------------------------------------------------

def parse(rate_limits: dict):
    return config.parse({"models": [{"name": "m", "backend": "python", "path": "shmserve.models.echo:make"}],
                         "rate_limits": rate_limits}).rate_limits


def test_config_reads_a_limit_with_its_defaults():
    (limit,) = parse({"batch": {"uids": [1001], "model": "m", "requests_per_s": 2.5, "bytes_per_s": "1MiB"}})
    assert limit == RateLimit("batch", uids=(1001,), model="m", requests_per_s=2.5, burst=2.5,
                              bytes_per_s=1048576.0, burst_bytes=1048576.0)
    (small,) = parse({"s": {"anonymous": True, "requests_per_s": 0.2}})
    assert small.burst == 1.0  # at least one request
    assert config.parse({"models": [{"name": "m", "backend": "python", "path": "shmserve.models.echo:make"}]}
                        ).rate_limits == ()


@pytest.mark.parametrize("table, says", [
    ({"x": {"requests_per_s": 1}}, "rate_limits.x: names no caller; add uids"),
    ({"x": {"each_caller": True}}, "rate_limits.x: limits nothing; add requests_per_s"),
    ({"x": {"each_caller": True, "requests_per_s": 0}}, "rate_limits.x.requests_per_s: expected a number"),
    ({"x": {"each_caller": True, "bytes_per_s": 1, "burst": 3}}, "rate_limits.x.burst: a burst of requests needs"),
    ({"x": {"each_caller": True, "requests_per_s": 1, "burst_bytes": 3}}, "rate_limits.x.burst_bytes: a burst of"),
    ({"x": {"each_caller": True, "requests_per_s": 1, "per": 3}}, "rate_limits.x.per: unknown key"),
    ({"x": {"roles": ["root"], "requests_per_s": 1}}, "rate_limits.x.roles[0]: a v2 token's role"),
    ({"x": {"users": ["no-such-user-here"], "requests_per_s": 1}}, "rate_limits.x.users[0]: no user"),
    ({"x": {"groups": ["no-such-group-here"], "requests_per_s": 1}}, "rate_limits.x.groups[0]: no group"),
    ({"x y": {"each_caller": True, "requests_per_s": 1}}, "rate_limits.x y: a limit's name is"),
    ({"x": {"each_caller": "yes", "requests_per_s": 1}}, "rate_limits.x.each_caller: expected true or false"),
    ({"x": 3}, "rate_limits.x: expected a table"),
])
def test_config_errors_name_the_key_and_the_fix(table, says):
    with pytest.raises(ConfigError) as err:
        parse(table)
    assert str(err.value).startswith(says), str(err.value)


def test_config_resolves_users_and_groups():
    import grp
    import os
    import pwd

    me, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name
    (limit,) = parse({"x": {"users": [me], "groups": [group], "requests_per_s": 1}})
    assert limit.uids == (os.getuid(),) and limit.gids == (os.getgid(),)


# -- retry_after on the wire --------------------------------------------------------------------

def answered(data_for_id) -> "ShmserveError":
    from shmserve.session import ClientSession, RequestFailed

    session = ClientSession()
    rid = session.health()[0]
    session.receive_data(data_for_id(rid))
    event = session.next_event()
    assert type(event) is RequestFailed
    return event.error


def test_retry_after_travels_in_the_error_frame():
    from shmserve.protocol import error_frame

    error = answered(lambda rid: error_frame(rid, ErrorCode.OVERLOADED, "slow down", 0.25))
    assert (error.code, error.message, error.retry_after) == (ErrorCode.OVERLOADED, "slow down", 0.25)
    assert answered(lambda rid: error_frame(rid, ErrorCode.TIMEOUT, "late")).retry_after is None


@pytest.mark.parametrize("literal, read", [(b"3", 3.0), (b"1.5", 1.5), (b"0", 0.0), (b"86400", 86400.0), (b"-1", None),
                                           (b'"1"', None), (b"true", None), (b"86401", None),
                                           (b"[1]", None), (b"null", None)])
def test_the_client_believes_retry_after_only_as_seconds_within_a_day(literal, read):
    """A hostile server's ``retry_after`` is dropped, the error kept."""
    from shmserve.protocol import FRAME_HEADER, MAGIC, PROTOCOL_VERSION, Kind

    def frame(rid: int) -> bytes:
        body = b'{"id": %d, "code": "overloaded", "message": "slow down", "retry_after": %s}' % (rid, literal)
        return FRAME_HEADER.pack(MAGIC, PROTOCOL_VERSION, Kind.ERROR, len(body), 0) + body

    error = answered(frame)
    assert error.code is ErrorCode.OVERLOADED and error.message == "slow down" and error.retry_after == read
