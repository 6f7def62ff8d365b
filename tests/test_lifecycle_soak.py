"""The lifecycle soak (issue 24): clients of every kind against one server while its models go
through every lifecycle step, in a seeded random order, for SHMSERVE_LIFECYCLE_SOAK_S seconds
(default 45; ``.ci/run`` sets 600).  Every answer right, no failure but the injected ones, and
the server back to where it began.

The clients (``helpers/lifecycle_soak.py``, one process each): ``Client.infer`` through lanes,
``Client.zero_copy(...).run()`` on kept calls, ``infer`` over the socket (lanes off; half its
calls with a routing key), ``tritonclient.http`` and ``tritonclient.grpc`` against the v2 doors
with a client token.  Each calls model ``m`` in a loop, and now and then an on-demand model.
Version v of ``m`` answers ``x + 1000 v``, so each answer names its version; a *flaky* version
fails half its inputs with ``soak: injected failure of version v``.

The driver (this module) takes the steps of ``STEPS``, every one once per round in a random
order (SHMSERVE_LIFECYCLE_SOAK_SEED replays an order), rounds until the time is up and at least
one round is done (a round took about 80 s on 2 busy cores): a swap (``load`` of a new version), a new version by SIGHUP, a split canary
of a flaky version (rolled back by its error rate), split canaries that complete by themselves,
by ``promote`` and that are aborted, a shadow canary that rolls back on its mismatches and one
that is verified and promoted, ``scale``, SIGHUPs that change the instance count or the settings
of ``m`` (new workers), and an on-demand round: a SIGHUP sets ``memory_budget`` to what ``m``
holds plus room for two and a half on-demand models, and the three are asked for in turn, so
that one is evicted.  After each step the driver unloads what is left of older versions (a
version loaded by ``load`` stays loaded across a reload: docs/models.md) and notes when each
version stopped being loaded.

What is checked at the end:
* no wrong answer (values that are no version's), and each version answered only while it may
  have: from the step that loaded it (a shadow candidate: from its promotion; never if it was
  not promoted) until the driver saw it unloaded;
* no failed call but a flaky version's injected errors, and those only while it was loaded;
* the server, brought back to the shape it began with (one worker of ``m``, no on-demand model
  loaded, no client), holds exactly the descriptors, /dev/shm entries (this instance's), regions
  and lanes it held before the clients started, no worker restarted by a fault, nothing logged a
  traceback, and its front-end's resident memory grew by less than RSS_GROWTH_BOUND.
On a failure it prints the seed, the step log and every client's tally.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from shmserve import Client

from conftest import shm_names
from helpers import lifecycle_soak as soak
from helpers.soak import ClientProcess
from helpers.server import TESTS_DIR, wait_for
from helpers.v2_server import TOKENS, authed, v2_serving
from test_model_lifecycle import ECHO as GOOD, add_version, fds

pytestmark = [pytest.mark.slow, pytest.mark.soak]

SOAK_S = float(os.environ.get("SHMSERVE_LIFECYCLE_SOAK_S", "45"))
CLIENT_KINDS = tuple(soak.KINDS)
STEP_TIMEOUT_S = 240.0  # one step (a load, a canary's decision, a reload) on a small, shared machine
CLIENT_END_S = soak.TIMEOUT_S + 60  # a client ends its last call and reports after the stop file
# The front-end's resident memory may grow by this much over the soak.  It keeps bounded history
# (500 lifecycle events, 10 finished rollouts per model, canary windows of a bounded number of
# samples), a record of each version ever seen (a few KiB each: some hundreds in 10 minutes) and
# the metrics' label sets per version, and Python's allocator keeps some of the arenas a burst of
# requests used.  A leak of 25 bytes per call (two million calls in 10 minutes) or of 400 KiB per
# step (some hundred) would exceed it.  Measured: +2 MiB (172 -> 174 MiB) over 600 s, 2.1 million
# calls and 108 steps.
RSS_GROWTH_BOUND = 48 << 20

FLAKY = """\
import numpy as np
VERSION = {version}
def model(inputs):
    x = inputs["x"]
    if 0 < x[0] < 0.5:  # half the soak's inputs; never the warm-up's zeros
        raise ValueError(f"soak: injected failure of version {{VERSION}}")
    return {{"y": x + np.float32(VERSION * 1000)}}
model.inputs = [{{"name": "x", "dtype": "float32", "shape": ["n"]}}]
model.outputs = [{{"name": "y", "dtype": "float32", "shape": ["n"]}}]
"""
ON_DEMAND = """\
import numpy as np
BALLAST = np.ones(BALLAST_BYTES, np.uint8)  # touched: resident, measured as the version's memory
def model(inputs):
    return {{"y": inputs["x"] + np.float32(OFFSET)}}
model.inputs = [{{"name": "x", "dtype": "float32", "shape": ["n"]}}]
model.outputs = [{{"name": "y", "dtype": "float32", "shape": ["n"]}}]
"""
# An on-demand model must weigh at least twice a worker of m (checked at start): the budget an
# on-demand step sets leaves room for 2.5 of them beside what m holds then, and m may grow by three
# workers afterwards (scaled to 2, a candidate of 2): one on-demand model still fits, so a request
# for one never waits for room in vain.
BALLAST = 96 << 20
M_CONFIG = 'backend = "python"\npath = "vmodel:model"\ninstances = {instances}\nwarmup = {{requests = {warmup}}}\n'

SPLIT = {"hold_s": 1, "window_s": 10, "min_samples": 30, "max_p99_ratio": None}  # latency is no signal here
PLANS = {
    "rollback": {**SPLIT, "steps": [20, 50, 100], "max_error_rate_increase": 0.05},
    "complete": {**SPLIT, "steps": [25, 100]},
    "manual": {**SPLIT, "steps": [30, 100], "hold_s": 1e6},
    "shadow_rollback": {**SPLIT, "mode": "shadow", "shadow_percent": 50, "max_mismatch_rate": 0.0},
    "shadow_verify": {**SPLIT, "mode": "shadow", "shadow_percent": 50, "max_mismatch_rate": 1.0},
}
TERMINAL = ("complete", "rolled_back", "aborted")
GONE = ("unloaded", "unavailable", "evicted")


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def steady_fd_count(pid: int) -> int:
    """The descriptor count of ``pid`` once two looks 0.5 s apart agree."""
    last = len(fds(pid))
    for _ in range(60):
        time.sleep(0.5)
        now = len(fds(pid))
        if now == last:
            return now
        last = now
    raise AssertionError(f"pid {pid}'s descriptors never settled")


def client_process(kind: str, args: dict, token: str) -> ClientProcess:
    """One client of ``helpers.lifecycle_soak`` (its arguments on stdin, the token in its environment)."""
    env = dict(os.environ, SOAK_V2_TOKEN=token,
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    return ClientProcess(kind, [sys.executable, "-m", "helpers.lifecycle_soak", kind], env, json.dumps(args))


class Driver:
    """The lifecycle steps on one server, and what the clients' tallies are judged by: when each
    version of ``m`` may have answered (``windows``: version -> [from, until], monotonic seconds;
    from None: it never may; until None: it still may)."""

    def __init__(self, srv, repo: Path, rng: random.Random, admin: Client):
        self.srv, self.repo, self.rng, self.admin = srv, repo, rng, admin
        self.od_bytes = 0  # what an on-demand model weighs, as measured
        self.t0 = time.monotonic()
        self.windows: dict[int, list] = {1: [0.0, None]}
        self.flaky: set[int] = set()
        self.next_version = 2
        self.instances, self.warmup = 1, 1
        self.log: list[str] = []
        self.done: Counter = Counter()

    # -- what the driver knows ------------------------------------------------------------------

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self.t0:7.1f} s  {what}"
        self.log.append(line)
        print(line, flush=True)

    def versions(self) -> dict[int, dict]:
        return {v["version"]: v for v in self.admin.repository()["models"] if v["name"] == soak.MODEL}

    def default(self) -> dict:
        (d,) = [v for v in self.versions().values() if v.get("default")]
        return d

    def new_version(self, body: str = GOOD, *, answers: bool = True) -> int:
        v = self.next_version
        self.next_version += 1
        add_version(self.repo, soak.MODEL, v, body)
        self.windows[v] = [time.monotonic() if answers else None, None]
        return v

    def forget(self, v: int) -> None:
        """A candidate that will not be the default again: its files go (a reload would load the
        newest version in the repository)."""
        shutil.rmtree(self.repo / soak.MODEL / str(v))

    def settle(self) -> None:
        """Wait until no version of ``m`` is loading or draining, unload versions other than the
        default (left loaded by a reload: docs/models.md), and note when each stopped serving."""
        wait_for(lambda: not any(v["state"] in ("loading", "draining") for v in self.versions().values()),
                 "m's versions to settle", timeout=STEP_TIMEOUT_S)
        for number, v in self.versions().items():
            if v["state"] == "ready" and not v.get("default"):
                self.note(f"  unload version {number} (left loaded)")
                assert self.admin.unload(soak.MODEL, version=number)["unloaded"] == [number]
        now = time.monotonic()
        for number, v in self.versions().items():
            if v["state"] in GONE and number in self.windows and self.windows[number][1] is None:
                self.windows[number][1] = now

    def reload(self) -> None:
        """SIGHUP, and wait until the server logged that the reload is done."""
        count = self.srv.log().count("reload: done")
        self.srv.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: self.srv.log().count("reload: done") > count, "the reload", timeout=STEP_TIMEOUT_S)

    def write_m_config(self) -> None:
        (self.repo / soak.MODEL / "config.toml").write_text(M_CONFIG.format(instances=self.instances,
                                                                              warmup=self.warmup))

    def set_budget(self, budget: int | None) -> None:
        """Rewrite the server's config file with ``memory_budget = {cpu = budget}`` (None: none)."""
        lines = [line for line in self.srv.config_path.read_text().splitlines() if not line.startswith("memory_budget")]
        if budget is not None:
            lines.insert(lines.index("[server]") + 1, f"memory_budget = {{cpu = {budget}}}")
        self.srv.config_path.write_text("\n".join(lines) + "\n")

    def canary(self, v: int, plan: str) -> dict:
        status = self.admin.canary(soak.MODEL, "start", version=v, plan=PLANS[plan])
        assert status["state"] not in TERMINAL, status
        return status

    def canary_until(self, states: tuple[str, ...]) -> dict:
        return wait_for(lambda: (lambda s: s if s["state"] in states else None)(
            self.admin.canary(soak.MODEL, "status")), f"the canary to reach {states}", timeout=STEP_TIMEOUT_S)

    def candidate_requests(self, n: int) -> None:
        wait_for(lambda: self.admin.canary(soak.MODEL, "status")["candidate"]["requests"] >= n,
                 f"{n} requests on the candidate", timeout=STEP_TIMEOUT_S)

    # -- the steps ------------------------------------------------------------------------------

    def swap(self) -> str:
        v = self.new_version()
        reply = self.admin.load(soak.MODEL, version=v)
        assert reply["version"] == v and reply["state"] == "ready", reply
        return f"version {v} loaded and the default"

    def reload_new_version(self) -> str:
        v = self.new_version()
        self.reload()
        assert self.default()["version"] == v, self.versions()
        return f"version {v} the default after SIGHUP"

    def canary_flaky(self) -> str:
        v = self.new_version(FLAKY)
        self.flaky.add(v)
        self.canary(v, "rollback")
        status = self.canary_until(TERMINAL)
        assert status["state"] == "rolled_back", status["decisions"]
        assert "max_error_rate_increase" in status["decisions"][-1]["reason"], status["decisions"]
        self.forget(v)
        return f"flaky version {v} rolled back: {status['decisions'][-1]['reason']}"

    def canary_complete(self) -> str:
        v = self.new_version()
        self.canary(v, "complete")
        status = self.canary_until(TERMINAL)
        assert status["state"] == "complete", status["decisions"]
        return f"version {v} completed its canary"

    def canary_promote(self) -> str:
        v = self.new_version()
        self.canary(v, "manual")
        self.candidate_requests(30)
        assert self.admin.canary(soak.MODEL, "promote")["state"] == "complete"
        return f"version {v} promoted"

    def canary_abort(self) -> str:
        v = self.new_version()
        self.canary(v, "manual")
        self.candidate_requests(30)
        assert self.admin.canary(soak.MODEL, "abort")["state"] == "aborted"
        self.forget(v)
        return f"version {v}'s canary aborted"

    def shadow_rollback(self) -> str:
        v = self.new_version(answers=False)  # answers only the server: its answers differ from stable's
        self.canary(v, "shadow_rollback")
        status = self.canary_until(TERMINAL)
        assert status["state"] == "rolled_back", status["decisions"]
        assert status["shadow"]["mismatches"] > 0, status["shadow"]
        self.forget(v)
        return f"shadow version {v} rolled back: {status['decisions'][-1]['reason']}"

    def shadow_promote(self) -> str:
        v = self.new_version(answers=False)
        self.canary(v, "shadow_verify")
        self.canary_until(("verified",))
        self.windows[v][0] = time.monotonic()  # it may answer from the promotion on
        assert self.admin.canary(soak.MODEL, "promote")["state"] == "complete"
        return f"shadow version {v} verified and promoted"

    def scale(self) -> str:
        current = self.default()
        n = 2 if current["workers"] == 1 else 1
        assert self.admin.scale(soak.MODEL, n)["workers"] == n
        return f"version {current['version']} scaled to {n}"

    def reload_instances(self) -> str:
        self.instances = 3 - self.instances
        self.write_m_config()
        self.reload()
        wait_for(lambda: self.default()["workers_ready"] == self.instances, f"{self.instances} workers ready")
        return f"config instances = {self.instances} by SIGHUP"

    def reload_settings(self) -> str:
        self.warmup = 3 - self.warmup
        self.write_m_config()
        before = self.default()
        self.reload()
        after = self.default()
        assert after["version"] == before["version"] and after["state"] == "ready", after
        return f"version {after['version']}: new workers for warmup.requests = {self.warmup} by SIGHUP"

    def on_demand(self) -> str:
        held = sum(v.get("memory_bytes") or 0 for v in self.versions().values() if v["state"] == "ready")
        budget = held + int(2.5 * self.od_bytes)
        self.set_budget(budget)
        self.reload()
        order = self.rng.sample(sorted(soak.OD_OFFSETS), 3)
        order.append(order[0])
        evictions = self.evictions()
        self.touch(*order)
        wait_for(lambda: self.evictions() > evictions, "an eviction", timeout=STEP_TIMEOUT_S)
        return f"budget {budget >> 20} MiB (m holds {held >> 20} MiB), asked {' '.join(order)}: " \
               f"{self.evictions() - evictions} eviction(s)"

    def evictions(self) -> int:
        return sum(e["event"] == "evict" for e in self.admin.repository()["events"])

    STEPS = ("swap", "reload_new_version", "canary_flaky", "canary_complete", "canary_promote", "canary_abort",
             "shadow_rollback", "shadow_promote", "scale", "reload_instances", "reload_settings", "on_demand")

    def run(self, seconds: float) -> None:
        """Steps, every one once per round in a random order, until ``seconds`` have passed and at
        least one round is done."""
        pending: list[str] = []
        while time.monotonic() - self.t0 < seconds or pending or not self.done:
            if not pending:
                if self.done and time.monotonic() - self.t0 >= seconds:
                    break
                pending = self.rng.sample(self.STEPS, len(self.STEPS))
            step = pending.pop()
            self.note(f"{step} ...")
            self.note(f"  {getattr(self, step)()}")
            self.settle()
            self.done[step] += 1
            assert self.srv.proc.poll() is None, f"the server died during {step}"

    def normalize(self) -> None:
        """Back to the shape the soak began with: m's config as it was and one worker of its
        default (the on-demand models stay as the budget left them)."""
        self.instances = self.warmup = 1
        self.write_m_config()
        self.reload()
        if self.default()["workers"] != 1:
            self.admin.scale(soak.MODEL, 1)
        self.settle()

    def touch(self, *names: str) -> None:
        """Ask each model of ``names`` once, in order, over a connection of its own."""
        x = np.zeros(soak.N, np.float32) + 0.25
        with Client(self.srv.socket, timeout=soak.TIMEOUT_S, lanes=False) as c:
            for name in names:
                assert soak.answer_version(name, x, c.infer(name, {"x": x})["y"]) == 1


def judge(results: list[dict], windows: dict[int, list], flaky: set[int]) -> list[str]:
    """What is wrong in the clients' tallies: wrong answers, failures that were not injected, a
    version that answered (or failed by injection) outside its window."""
    problems = []
    for r in results:
        kind = r["kind"]
        if "calls" not in r:
            problems.append(f"{kind}: ended without a tally: {r}")
            continue
        if r["wrong_count"]:
            problems.append(f"{kind}: {r['wrong_count']} wrong answers, e.g. {r['wrong']}")
        if r["failures"]:
            problems.append(f"{kind}: failed calls {r['failures']}, e.g. {r['failure_samples']}")
        for key, (count, first_end, last_start) in r["answers"].items():
            model, v = key.split(":")
            if model != soak.MODEL:
                continue
            window = windows.get(int(v))
            if window is None or window[0] is None:
                problems.append(f"{kind}: {count} answers from version {v}, which never served")
            elif first_end < window[0] or (window[1] is not None and last_start > window[1]):
                problems.append(f"{kind}: version {v} answered between {first_end:.3f} and {last_start:.3f}, "
                                f"outside its window {window}")
        for v, (count, first_end, last_start) in r["injected"].items():
            window = windows.get(int(v))
            if int(v) not in flaky or window is None:
                problems.append(f"{kind}: {count} injected failures from version {v}, which is not flaky")
            elif first_end < window[0] or (window[1] is not None and last_start > window[1]):
                problems.append(f"{kind}: flaky version {v} failed outside its window {window}")
    return problems


def instance_shm(srv) -> set[str]:
    return {name for name in shm_names() if srv.instance in name}


def warm_up(srv) -> None:
    """A call of each kind, so that what the server opens on first use exists before counting."""
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    x = np.zeros(soak.N, np.float32) + 0.75
    for lanes in (True, False):
        with Client(srv.socket, timeout=soak.TIMEOUT_S, lanes=lanes) as c:
            assert soak.answer_version("m", x, c.infer("m", {"x": x})["y"]) == 1
            with c.zero_copy("m", {"x": ((soak.N,), np.float32)}) as zc:
                zc.inputs["x"][...] = x
                assert soak.answer_version("m", x, zc.run()["y"]) == 1
    for tc, address in ((thttp, srv.http), (tgrpc, srv.grpc)):
        client = authed(tc.InferenceServerClient(address), "client")
        given = tc.InferInput("x", [soak.N], "FP32")
        given.set_data_from_numpy(x)
        assert soak.answer_version("m", x, client.infer("m", [given]).as_numpy("y")) == 1
        client.close()


def test_every_client_kind_through_every_lifecycle_step(tmp_path):
    seed = int(os.environ.get("SHMSERVE_LIFECYCLE_SOAK_SEED", random.SystemRandom().randrange(2**32)))
    print(f"lifecycle soak: seed={seed} seconds={SOAK_S} (replay with SHMSERVE_LIFECYCLE_SOAK_SEED={seed})")
    rng = random.Random(seed)
    repo = tmp_path / "repo"
    add_version(repo, soak.MODEL, 1)
    (repo / soak.MODEL / "config.toml").write_text(M_CONFIG.format(instances=1, warmup=1))
    for name, offset in soak.OD_OFFSETS.items():
        add_version(repo, name, 1, ON_DEMAND.replace("BALLAST_BYTES", str(BALLAST)).replace("OFFSET", str(offset)), 'load = "on_demand"\n')
    section = f'model_repository = "{repo}"\nmax_workers = 16\nrequest_timeout_s = {soak.TIMEOUT_S}\n'
    results: list[dict] = []
    driver = None
    with v2_serving(tmp_path, models="", extra=section, deadlines=60) as srv:
        try:
            with Client(srv.socket, timeout=soak.TIMEOUT_S) as admin:
                driver = Driver(srv, repo, rng, admin)
                warm_up(srv)
                pid = srv.proc.pid
                # What a worker costs the front-end in descriptors, and what an on-demand model weighs
                # (measured by its first load) against a worker of m.
                counts = [steady_fd_count(pid)]
                for name in ("od_a", "od_b"):
                    driver.touch(name)
                    counts.append(steady_fd_count(pid))
                per_worker = counts[1] - counts[0]
                assert counts[2] - counts[1] == per_worker, f"descriptors with 1, 2, 3 workers: {counts}"
                sizes = {v["name"]: v["memory_bytes"] for v in admin.repository()["models"] if v["state"] == "ready"}
                print(f"measured: {sizes}; descriptors per worker: {per_worker}")
                assert sizes["od_a"] >= 2 * sizes["m"], f"raise BALLAST: an on-demand model must weigh twice m: {sizes}"
                driver.od_bytes = sizes["od_a"]
                driver.set_budget(sizes["m"] + int(2.5 * driver.od_bytes))  # room for two of the three
                driver.reload()
                srv.wait_idle()
                before = {"fds": steady_fd_count(pid), "workers": len(srv.info()["workers"]), "rss": rss(pid),
                          "shm": instance_shm(srv), "regions": srv.recorded_regions(), "lanes": srv.info()["lanes"]}
                print(f"before: {before}")

                stop = tmp_path / "stop"
                args = {"socket": srv.socket, "http": srv.http, "grpc": srv.grpc, "stop": str(stop)}
                clients = [client_process(kind, dict(args, seed=seed + i), TOKENS["client"])
                           for i, kind in enumerate(CLIENT_KINDS)]
                try:
                    for client in clients:
                        line = client.next_line(STEP_TIMEOUT_S)
                        assert line == "ready", f"the {client.kind} client did not start: {line!r}"
                    driver.run(SOAK_S)
                    stop.touch()
                    results = [client.result(CLIENT_END_S) for client in clients]
                finally:
                    for client in clients:
                        client.kill()
                driver.note(f"steps: {dict(driver.done)}")
                for r in results:
                    print(f"  {r.get('kind')}: {r.get('calls')} calls, answers {r.get('answers')}, "
                          f"injected {r.get('injected')}")
                problems = judge(results, driver.windows, driver.flaky)
                assert not problems, "\n".join(problems)
                assert all(r["calls"] > 0 for r in results), results
                assert set(driver.done) == set(Driver.STEPS), driver.done

                # The server as it began.
                driver.normalize()
                srv.wait_idle()
                states = {f"{v['name']}:{v['version']}": v["state"] for v in admin.repository()["models"]
                          if v["state"] not in GONE}
                assert states == {f"m:{driver.default()['version']}": "ready", **{
                    k: "ready" for k in states if k.startswith("od_")}}, states
                workers = srv.info()["workers"]
                assert [w["model"] for w in workers].count("m") == 1, workers
                assert all(w["restarts"] == 0 for w in workers), workers
                wait_for(lambda: not srv.recorded_regions() and not any(srv.mapped_regions().values())
                         and not srv.info()["lanes"], "no region or lane left", timeout=60)
                assert srv.recorded_regions() == before["regions"] and srv.info()["lanes"] == before["lanes"]
                want = before["fds"] + per_worker * (len(workers) - before["workers"])
                wait_for(lambda: len(fds(pid)) == want, f"the front-end's {want} descriptors ({before['fds']} with "
                         f"{before['workers']} workers, {len(workers)} now)", timeout=60)
                assert instance_shm(srv) == before["shm"]
                grown = rss(pid) - before["rss"]
                print(f"front-end RSS {before['rss'] >> 20} MiB -> {rss(pid) >> 20} MiB")
                assert grown < RSS_GROWTH_BOUND, f"the front-end's RSS grew by {grown >> 20} MiB"
                assert "Traceback" not in srv.log(), srv.log()[-5000:]
        except BaseException:
            print(f"lifecycle soak FAILED: seed={seed} (replay with SHMSERVE_LIFECYCLE_SOAK_SEED={seed})")
            if driver is not None:
                print("steps:\n" + "\n".join(driver.log))
                print(f"windows: {driver.windows}\nflaky: {sorted(driver.flaky)}")
            for r in results:
                print(f"  {json.dumps(r)}")
            print("server log (tail):\n" + srv.log()[-6000:])
            raise
