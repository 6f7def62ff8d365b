"""`shmserve doctor`'s service checks over an instance given as data (the arena's snapshot and a live
server's answers, in their shapes), each triggered and not; the server's hourly history
(`shmserve.frontend.history`) with times passed in; the report, its JSON schema and exit status."""

from __future__ import annotations

import json
import time

import pytest

from shmserve.doctor import CHECKS, run_checks
from shmserve.doctor.context import Service
from shmserve.doctor.findings import CRITICAL, INFO, SCHEMA, WARNING, CheckResult, Finding, Report, render
from shmserve.frontend.history import STAGES, History, Sample, WorkerSample

from helpers.fake_host import service, stage_means, window, worker
from test_doctor_host import check, context


def svc_check(check_id, tmp_path, svc):
    return check(check_id, context(tmp_path, svc))


# -- service.stages ----------------------------------------------------------------------------

def test_compute_dominating_is_info_and_names_the_split(tmp_path):
    svc = service([worker(0, "m", 1)], latency={"m": stage_means(compute=900)})
    (f,) = svc_check("service.stages", tmp_path, svc)[0]
    assert f.severity == INFO and f.title.startswith("model m: compute dominates")
    assert "queue 50, copy in 20, compute 900, copy out 20, hand-off 10 us" in f.measured
    assert "no baseline yet" in f.measured and f.data["dominant"] == "compute"


@pytest.mark.parametrize("stage, fix", [("queue", "shmserve scale m"), ("copy_in", "zero-copy"),
                                        ("copy_out", "zero-copy"), ("handoff", "host.cgroup_cpu")])
def test_another_stage_dominating_by_milliseconds_is_a_warning(tmp_path, stage, fix):
    svc = service([worker(0, "m", 1)], latency={"m": stage_means(**{stage: 8000.0})})
    (f,) = svc_check("service.stages", tmp_path, svc)[0]
    assert f.severity == WARNING and f.data["dominant"] == stage and fix in f.fix


def test_a_stage_dominating_by_microseconds_is_not_a_problem(tmp_path):
    svc = service([worker(0, "m", 1)], latency={"m": stage_means(queue=300.0, compute=50.0)})
    (f,) = svc_check("service.stages", tmp_path, svc)[0]
    assert f.severity == INFO and f.data["dominant"] == "queue"


def test_a_model_slower_than_its_last_hour_is_a_warning_naming_the_stage_that_grew(tmp_path):
    history = {"models": {"m": {"recent": window(300, 500, queue=9000.0, p99=32768),
                                "baseline": window(3600, 6000, p99=1024)}}}
    svc = service([worker(0, "m", 1)], latency={"m": stage_means()}, history=history)
    found = svc_check("service.stages", tmp_path, svc)[0]
    slower = [f for f in found if "slower" in f.title]
    (f,) = slower
    assert f.severity == WARNING and "queue grew most" in f.title and "15.9x" in f.title
    assert "last 300 s (p99 32768 us) against 600 us over the 3600 s before (p99 1024 us)" in f.measured
    assert f.data["grew"] == "queue"
    steady = {"models": {"m": {"recent": window(300, 500), "baseline": window(3600, 6000)}}}
    found = svc_check("service.stages", tmp_path, service([worker(0, "m", 1)], latency={"m": stage_means()},
                                                          history=steady))[0]
    assert [f.severity for f in found] == [INFO] and "over the last 300 s" in found[0].measured


def test_too_few_requests_in_a_window_are_not_compared(tmp_path):
    history = {"models": {"m": {"recent": window(300, 5, queue=9000.0), "baseline": window(3600, 6000)}}}
    found = svc_check("service.stages", tmp_path, service([worker(0, "m", 1)], latency={"m": stage_means()},
                                                          history=history))[0]
    assert not [f for f in found if "slower" in f.title]


def test_a_dead_instance_is_judged_on_its_arena_alone(tmp_path):
    svc = service([worker(0, "m", 1, alive=False)], owner_alive=False, latency={"m": stage_means()})
    (f,) = svc_check("service.stages", tmp_path, svc)[0]
    assert "no baseline (a live server keeps one" in f.measured


# -- service.shapes ----------------------------------------------------------------------------

def test_a_model_whose_requests_keep_bringing_new_shapes_is_a_warning(tmp_path):
    svc = service([worker(0, "m", 1, requests=200, signatures={"new": 150, "distinct": 150}),
                   worker(1, "m", 2, requests=200, signatures={"new": 140, "distinct": 140}),
                   worker(2, "steady", 3, requests=5000, signatures={"new": 4, "distinct": 4})])
    (f,) = svc_check("service.shapes", tmp_path, svc)[0]
    assert f.subject == "model m" and "290 of 400 requests" in f.measured and "150 distinct" in f.measured
    assert "pad inputs" in f.fix


def test_a_few_shapes_or_few_requests_are_fine(tmp_path):
    svc = service([worker(0, "m", 1, requests=100000, signatures={"new": 40, "distinct": 40}),
                   worker(1, "n", 2, requests=10, signatures={"new": 10, "distinct": 10})])
    assert svc_check("service.shapes", tmp_path, svc)[0] == []
    found, skipped = svc_check("service.shapes", tmp_path, service([worker(0, "m", 1)]))
    assert found == [] and "no worker reports" in skipped


# -- service.workers ---------------------------------------------------------------------------

def test_crash_loops_and_wedged_workers_are_critical_restarts_a_warning(tmp_path):
    svc = service([worker(0, "loop", 1, crash_streak=4, restarts=4, last_exit="killed by SIGSEGV"),
                   worker(1, "stuck", 2, heartbeat_age_s=25.0),
                   worker(2, "once", 3, restarts=1, last_exit="exit 1 (error)"),
                   worker(3, "fine", 4)],
                  stuck=[{"slot": 7, "request_id": 99, "worker": 1, "model": "stuck", "running_s": 61.0}])
    found = svc_check("service.workers", tmp_path, svc)[0]
    got = [(f.severity, f.title) for f in found]
    assert got == [(CRITICAL, "model loop: a worker is crash-looping"), (CRITICAL, "model stuck: a worker is wedged"),
                   (WARNING, "model once: a worker was restarted"),
                   (WARNING, "model stuck: a request has been running for 61.0 s")]
    assert "killed by SIGSEGV" in found[0].measured and "py-spy dump --pid 2" in found[1].fix
    assert svc_check("service.workers", tmp_path, service([worker(0, "fine", 1)]))[0] == []


def test_a_dead_front_end_is_critical(tmp_path):
    svc = service([worker(0, "m", 1, alive=False)], owner_alive=False, owner_pid=4242)
    (f,) = svc_check("service.workers", tmp_path, svc)[0]
    assert f.severity == CRITICAL and "pid 4242 is not running" in f.measured and "cleanup" in f.fix


def test_an_unavailable_model_is_critical(tmp_path):
    repo = {"models": [{"name": "m", "version": 2, "state": "unavailable", "reason": "cannot load: boom"}],
            "canaries": {}, "events": []}
    (f,) = svc_check("service.workers", tmp_path, service([], repository=repo))[0]
    assert f.severity == CRITICAL and f.measured == "cannot load: boom"


# -- service.canaries --------------------------------------------------------------------------

def canary(state, ago_s=30.0, reason="p99 3.1x the stable version's"):
    return {"state": state, "mode": "split", "percent": 25.0, "candidate": {"version": 2}, "stable": {"version": 1},
            "decisions": [{"kind": "rollback", "reason": reason, "ago_s": ago_s, "percent": 25.0}]}


def test_a_running_canary_is_info_and_a_recent_rollback_a_warning(tmp_path):
    repo = {"models": [], "events": [], "canaries": {"a": canary("ramping"), "b": canary("rolled_back"),
                                                     "c": canary("rolled_back", ago_s=7200), "d": canary("complete")}}
    found = svc_check("service.canaries", tmp_path, service([], repository=repo))[0]
    assert [(f.severity, f.subject) for f in found] == [(INFO, "model a"), (WARNING, "model b")]
    assert "p99 3.1x" in found[1].measured and "shmserve canary b status" in found[1].fix


# -- service.evictions -------------------------------------------------------------------------

def events(model, kinds_ago):
    now = time.time()
    return [{"time_unix": now - ago, "model": model, "version": 1, "event": kind, "reason": f"{kind} {ago}"}
            for kind, ago in kinds_ago]


def test_a_version_evicted_three_times_in_the_hour_is_thrashing(tmp_path):
    thrash = events("m", [("load", 3000), ("evict", 2900), ("load", 2000), ("evict", 1900), ("load", 900),
                          ("evict", 800)])
    calm = events("n", [("evict", 7000), ("evict", 6000), ("evict", 100)])
    repo = {"models": [], "canaries": {}, "events": thrash + calm}
    (f,) = svc_check("service.evictions", tmp_path, service([], repository=repo))[0]
    assert f.subject == "model m v1" and "3 evictions in the last hour" in f.measured and "memory_budget" in f.fix


# -- service.starved ---------------------------------------------------------------------------

def test_requests_refused_or_timed_out_are_a_warning(tmp_path):
    history = {"models": {"m": {"recent": window(300, 1000, outcomes={"ok": 900, "overloaded": 80, "timeout": 20})},
                          "n": {"recent": window(300, 1000, outcomes={"ok": 1000, "timeout": 2})}}}
    (f,) = svc_check("service.starved", tmp_path, service([], history=history))[0]
    assert f.subject == "model m" and "80 overloaded, 20 timeout of 1000 requests" in f.measured
    found, skipped = svc_check("service.starved", tmp_path, service([], history=None))
    assert found == [] and "does not report its history" in skipped


@pytest.mark.parametrize("check_id", ["service.shapes", "service.canaries", "service.evictions", "service.starved",
                                      "host.smt", "placement.threads", "placement.frontend"])
def test_checks_of_a_live_instance_skip_without_one(tmp_path, check_id):
    found, skipped = check(check_id, context(tmp_path, Service("fake", "none")))
    assert found == [] and "live instance" in skipped


# -- the server's history: one sample a minute, windows as differences --------------------------

def sample(t, workers, outcomes=None):
    return Sample(t, workers, outcomes or {})


def ws(model, count, mean_us, bucket=10):
    total = [0] * 32
    total[bucket] = count
    stages = tuple((count, count * mean_us) if s in ("compute", "total") else (count, 0) for s in STAGES)
    return WorkerSample(model, stages, tuple(total))


def test_history_takes_a_sample_a_minute_and_keeps_an_hour_and_a_bit():
    h = History(interval_s=60, keep_s=3960)
    assert h.due(0.0)
    h.record(sample(0.0, {}))
    assert not h.due(59.0) and h.due(60.0)
    for t in range(60, 8000, 60):
        h.record(sample(float(t), {}))
    assert h.samples[-1].time - h.samples[0].time <= 3960 and len(h.samples) == 67


def test_windows_are_the_last_five_minutes_against_the_hour_before():
    a, b = object(), object()  # two workers of model m; b starts after the baseline began
    h = History()
    h.record(sample(0.0, {a: ws("m", 0, 0)}))
    h.record(sample(3600.0, {a: ws("m", 3600, 1000), b: ws("m", 400, 1000)}, {("m", "ok"): 4000}))
    h.record(sample(3900.0, {a: ws("m", 3700, 1000), b: ws("m", 500, 1000)}, {("m", "ok"): 4150}))
    now = sample(3960.0, {a: ws("m", 3800, 1200, bucket=12), b: ws("m", 600, 1000)},
                 {("m", "ok"): 4300, ("m", "overloaded"): 7})
    got = h.windows(now, recent_s=300, baseline_s=3600)["models"]["m"]
    assert got["recent"]["seconds"] == 360.0 and got["baseline"]["seconds"] == 3600.0
    assert got["recent"]["stages"]["compute"] == [400, 3800 * 1200 - 3600 * 1000 + 200 * 1000]
    assert got["baseline"]["stages"]["compute"] == [4000, 4000 * 1000]
    assert got["recent"]["outcomes"] == {"ok": 300, "overloaded": 7}
    assert got["recent"]["p99_us"] == 2 ** 13  # a's counts moved to bucket 12: its upper bound


def test_a_worker_whose_entry_was_given_to_a_new_one_counts_whole():
    a, new = object(), object()
    h = History()
    h.record(sample(0.0, {a: ws("m", 100, 500)}))
    now = sample(100.0, {new: ws("m", 30, 500)})  # a retired, its entry reused: new counts from zero
    got = h.windows(now, recent_s=300)["models"]["m"]
    assert got["recent"]["stages"]["total"] == [30, 30 * 500] and "baseline" not in got


def test_an_empty_history_has_no_windows():
    assert History().windows(sample(5.0, {}))["models"] == {}


# -- the report ------------------------------------------------------------------------------

def finding(severity, check_id="host.thp"):
    return Finding(check_id, severity, "t", "s", "m", "e", "w", "f", {"x": 1})


def report(*findings):
    return Report("0.1.0", "prod", "live", 1.5, "/", {"arena": "/shmserve.prod"},
                  [CheckResult("host.thp", "transparent huge pages", True),
                   CheckResult("host.cpufreq", "the CPU frequency governor", False, skipped="no cpufreq"),
                   CheckResult("gpu.ecc", "ECC", False, error="KeyError: 'x'")], list(findings))


def test_the_exit_status_follows_the_most_severe_finding():
    assert report().exit_status() == 0 and report(finding(WARNING), finding(INFO)).exit_status() == 0
    assert report(finding(CRITICAL)).exit_status() == 1
    assert report(finding(WARNING)).exit_status("warning") == 1 and report(finding(INFO)).exit_status("warning") == 0


def test_the_json_schema_is_stable():
    """docs/operations.md documents these keys; a change here is a change there (and SCHEMA's)."""
    d = json.loads(json.dumps(report(finding(INFO), finding(CRITICAL, "gpu.ecc")).to_dict()))
    assert SCHEMA == 1 and list(d) == ["schema", "shmserve", "instance", "server", "time_unix", "root", "sources",
                                       "summary", "findings", "checks"]
    assert d["summary"] == {"critical": 1, "warning": 0, "info": 1, "checks_run": 1, "checks_skipped": 2,
                            "exit_status": 1}
    assert list(d["findings"][0]) == ["check", "area", "severity", "title", "subject", "evidence", "why", "fix",
                                      "data"]
    assert d["findings"][0]["severity"] == CRITICAL and d["findings"][0]["area"] == "gpu"
    assert d["findings"][0]["evidence"] == {"measured": "m", "expected": "e"}
    assert [c["status"] for c in d["checks"]] == ["ran", "skipped", "error"]
    assert list(d["checks"][0]) == ["id", "area", "title", "status", "why"]


def test_the_table_shows_each_finding_and_what_was_skipped(tmp_path):
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(render(report(finding(WARNING), finding(CRITICAL, "gpu.ecc")), verbose=True))
    text = console.export_text()
    assert text.index("CRITICAL") < text.index("WARNING") and "measured m" in text and "fix      f" in text
    assert "skipped  host.cpufreq: no cpufreq" in text and "ERROR    gpu.ecc: the check failed: KeyError" in text
    assert "1 critical, 1 warning, 0 info; 1 checks ran, 1 skipped" in text


def test_a_check_that_fails_is_reported_and_the_others_still_run(tmp_path):
    from shmserve.doctor import Check

    def broken(ctx):
        raise KeyError("boom")

    results, findings = run_checks(context(tmp_path), [Check("host.x", "x", broken), *CHECKS[:2]])
    assert results[0].error == "KeyError: 'boom'" and len(results) == 3


def test_every_check_id_is_unique_and_in_its_area():
    from shmserve.doctor.findings import AREAS

    ids = [c.id for c in CHECKS]
    assert len(ids) == len(set(ids)) and all(i.partition(".")[0] in AREAS for i in ids)
