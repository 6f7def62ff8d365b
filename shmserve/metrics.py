"""Prometheus metrics: a collector over the front-end's status snapshot, served over HTTP.

Owns: metric names and labels (Prometheus conventions: ``shmserve_`` prefix,
base units, ``_total`` counters), Triton's metric families beside them
(``nv_inference_*``, with Triton's names, units and ``model``/``version``
labels, so dashboards made for Triton read shmserve: ``triton_families``), the
queues by priority level (``_priorities``: depth, and the waits of claimed
requests as a summary's ``_sum``/``_count``) and
the small HTTP endpoint
(``--metrics ADDR``: a Unix socket path, or a loopback ``host:port``).  Values
are read at scrape time from one ``shmserve.frontend.status`` snapshot (which
reads the arena's counters and per-worker latency histograms), so nothing is
double-counted and nothing costs anything between scrapes.

Must not: listen on a non-loopback address, or block the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import os

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    SummaryMetricFamily)

from shmserve import layout
from shmserve.frontend.dispatcher import CANCEL_STAGES
from shmserve.frontend.status import triton_counts

log = logging.getLogger("shmserve.metrics")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StatusCollector:
    """Prometheus families from one ``Status.snapshot()`` per scrape."""

    def __init__(self, status):
        self.status = status

    def collect(self):
        snap = self.status.snapshot()
        requests = CounterMetricFamily("shmserve_requests", "Requests answered, by model, version (empty: refused "
                                       "before one was chosen) and outcome (ok, or the error code; door "
                                       "processes' own answers included; lane calls, counted from the workers' "
                                       "counters each heartbeat: ok or error)",
                                       labels=["model", "version", "outcome"])
        outcomes = collections.Counter(snap.outcomes)
        for (model, version), (ok, failed) in (snap.lane_calls or {}).items():
            outcomes[(model, version, "ok")] += ok
            if failed:
                outcomes[(model, version, "error")] += failed
        for (model, version, outcome), n in sorted(outcomes.items(), key=lambda kv: str(kv[0])):
            requests.add_metric([model, str(version), outcome], n)
        yield requests
        cancelled = CounterMetricFamily("shmserve_cancelled_requests", "Requests whose caller gave up (a CANCEL, "
                                        "a closed connection, a cancelled RPC, an HTTP client gone), by model, "
                                        "version and stage: queued (taken back before a worker claimed it: never "
                                        "run), running (a worker ran it: its result discarded), answered (its "
                                        "answer was ready)", labels=["model", "version", "stage"])
        counts = dict(snap.cancelled or {})
        for m in snap.models:  # every stage of every version, from 0
            for stage in CANCEL_STAGES:
                counts.setdefault((m.name, m.version, stage), 0)
        for (model, version, stage), n in sorted(counts.items(), key=lambda kv: str(kv[0])):
            cancelled.add_metric([model, str(version), stage], n)
        yield cancelled
        yield from self._lifecycle(snap)

        stages = HistogramMetricFamily("shmserve_request_stage_seconds",
                                       "Time per request stage in the worker: queue, copy_in, compute, "
                                       "copy_out, and total (slot acquired to done)",
                                       labels=["model", "version", "stage"])
        batch = HistogramMetricFamily("shmserve_batch_size", "Requests per model execution (dynamic batching)",
                                      labels=["model", "version"])
        for m in snap.models:
            for stage in layout.HIST_STAGE_BOUNDS:
                buckets, total = m.histograms[stage]
                stages.add_metric([m.name, str(m.version), stage], _cumulative(buckets, scale=1e6), total / 1e6)
            buckets, total = m.histograms["batch_size"]
            batch.add_metric([m.name, str(m.version)], _cumulative(buckets, scale=1), total)
        yield stages
        yield batch

        queued = GaugeMetricFamily("shmserve_queue_depth", "Requests admitted but not yet claimed by a worker, "
                                   "plus requests waiting for arena space", labels=["model", "version"])
        inflight = GaugeMetricFamily("shmserve_inflight_requests", "Requests handed to workers and not yet "
                                     "answered", labels=["model", "version"])
        for m in snap.models:
            queued.add_metric([m.name, str(m.version)], m.queued)
            inflight.add_metric([m.name, str(m.version)], m.inflight)
        yield queued
        yield inflight
        yield from self._priorities(snap)

        served = CounterMetricFamily("shmserve_worker_requests", "Requests a worker finished, socket and lane "
                                     "calls alike (outcome ok or error), since the worker started",
                                     labels=["model", "version", "worker", "outcome"])
        lanes = GaugeMetricFamily("shmserve_lanes", "Lanes (client regions with their own queue) attached, by "
                                  "model and worker", labels=["model", "version", "worker"])
        restarts = CounterMetricFamily("shmserve_worker_restarts", "Worker restarts",
                                       labels=["model", "version", "worker"])
        short = CounterMetricFamily("shmserve_worker_short_answers", "Runs whose outputs outgrew the space reserved "
                                    "for them (each call run again once: docs/models.md, 'Outputs of any size'), "
                                    "as the worker last told", labels=["model", "version", "worker"])
        workers = GaugeMetricFamily("shmserve_workers", "Workers by model, version and state",
                                    labels=["model", "version", "state"])
        states: dict = {}
        for m in snap.models:
            for w in m.workers:
                v = str(w.version)
                served.add_metric([w.model, v, str(w.index), "ok"], w.requests - w.errors)
                served.add_metric([w.model, v, str(w.index), "error"], w.errors)
                lanes.add_metric([w.model, v, str(w.index)], w.lanes)
                restarts.add_metric([w.model, v, str(w.index)], w.restarts)
                short.add_metric([w.model, v, str(w.index)], (w.signatures or {}).get("short", 0))
                states[(w.model, v, w.state)] = states.get((w.model, v, w.state), 0) + 1
        for (model, version, state), n in sorted(states.items()):
            workers.add_metric([model, version, state], n)
        yield served
        yield lanes
        yield restarts
        yield short
        yield workers

        if snap.doors:
            up = GaugeMetricFamily("shmserve_door_up", "Whether a door process (docs/doors.md) is up",
                                   labels=["door"])
            conns = GaugeMetricFamily("shmserve_door_connections", "Client connections a door process serves",
                                      labels=["door"])
            door_restarts = CounterMetricFamily("shmserve_door_restarts", "Door process restarts", labels=["door"])
            for d in snap.doors:
                up.add_metric([str(d["index"])], int(d["up"]))
                conns.add_metric([str(d["index"])], d["connections"])
                door_restarts.add_metric([str(d["index"])], d["restarts"])
            yield up
            yield conns
            yield door_restarts

        limited = CounterMetricFamily("shmserve_rate_limited", "Requests a rate limit refused ([rate_limits]), "
                                      "by the limit's name and its model (* : every model), as configured",
                                      labels=["limit", "model"])
        for (limit, model), n in sorted((snap.rate_limited or {}).items()):
            limited.add_metric([limit, model], n)
        yield limited

        yield GaugeMetricFamily("shmserve_arena_bytes_in_use", "Arena data bytes held by requests",
                                value=snap.stats["extent_bytes_in_use"])
        yield GaugeMetricFamily("shmserve_arena_data_bytes", "Arena data region size", value=snap.data_bytes)
        yield GaugeMetricFamily("shmserve_slots_in_use", "Arena slots held by requests", value=snap.stats["slots_in_use"])
        yield GaugeMetricFamily("shmserve_slots", "Arena slots", value=snap.slots)


    @staticmethod
    def _priorities(snap):
        """Each model version's queue by priority level (only the levels it has: 1..max(priority_levels,
        1)), summed over its workers' scheduling counters: the depth now, and the wait of the requests
        claimed as a summary (``_count``: requests claimed, ``_sum``: their waits; mean wait =
        ``rate(_sum) / rate(_count)``); requests expired unrun and demoted."""
        depth = GaugeMetricFamily("shmserve_priority_queue_depth", "Requests a model's workers hold unclaimed "
                                  "now, by priority level (1: claimed first; a model without priority_levels "
                                  "has level 1 alone; lane and socket calls alike)",
                                  labels=["model", "version", "priority"])
        wait = SummaryMetricFamily("shmserve_queue_wait_seconds", "Time from ready to claimed of the requests "
                                   "a model's workers claimed, by priority level (_count: requests claimed, "
                                   "_sum: their waits)", labels=["model", "version", "priority"])
        expired = CounterMetricFamily("shmserve_queue_expired", "Requests answered timeout unrun: their "
                                      "deadline passed before a worker claimed them", labels=["model", "version"])
        demoted = CounterMetricFamily("shmserve_queue_demoted", "Requests whose queue timeout passed under "
                                      "timeout_action = \"delay\": moved behind every other",
                                      labels=["model", "version"])
        for m in snap.models:
            if m.queue is None:
                continue
            v = str(m.version)
            for lv in m.queue.levels:
                labels = [m.name, v, str(lv.level)]
                depth.add_metric(labels, lv.queued)
                wait.add_metric(labels, count_value=lv.claimed, sum_value=lv.wait_us / 1e6)
            expired.add_metric([m.name, v], m.queue.expired)
            demoted.add_metric([m.name, v], m.queue.demoted)
        yield depth
        yield wait
        yield expired
        yield demoted

    @staticmethod
    def _lifecycle(snap):
        """The model lifecycle: versions by phase, loads, failures, evictions and their times, canaries."""
        phases = GaugeMetricFamily("shmserve_model_versions", "Model versions by lifecycle phase (1 per version); "
                                   "default is 1 for the version requests naming none go to",
                                   labels=["model", "version", "phase", "default"])
        memory = GaugeMetricFamily("shmserve_model_memory_bytes", "Memory a loaded version uses on its device, "
                                   "measured after load", labels=["model", "version"])
        for m in snap.models:
            phases.add_metric([m.name, str(m.version), m.phase, "1" if m.default else "0"], 1)
        yield phases
        counts = snap.lifecycle.get("counts", {})
        seconds = snap.lifecycle.get("seconds", {})
        events = CounterMetricFamily("shmserve_model_lifecycle_events", "Loads, failed loads and evictions of a "
                                     "model's versions, and canary decisions (canary_step, canary_complete, "
                                     "canary_rollback, canary_promote, canary_abort)", labels=["model", "event"])
        for (what, model), n in sorted(counts.items()):
            events.add_metric([model, what], n)
        yield events
        spent = CounterMetricFamily("shmserve_model_lifecycle_seconds", "Seconds spent loading (start to all "
                                    "workers ready), warming up and evicting (draining) a model's versions",
                                    labels=["model", "what"])
        for (what, model), n in sorted(seconds.items()):
            spent.add_metric([model, what], n)
        yield spent
        for m in snap.models:
            if m.memory_bytes is not None and m.phase == "ready":
                memory.add_metric([m.name, str(m.version)], m.memory_bytes)
        yield memory
        canary = GaugeMetricFamily("shmserve_canary_percent", "Share of a model's traffic on its canary "
                                   "candidate (0 once rolled back or aborted, 100 once complete)",
                                   labels=["model", "candidate", "state"])
        for model, c in sorted(snap.lifecycle.get("canaries", {}).items()):
            canary.add_metric([model, str(c["candidate"]["version"]), str(c["state"])], float(c["percent"]))
        yield canary


# Triton's per-model counters (its metrics docs and core src/metric_model_reporter.cc): name, help,
# and what each is here (a TritonCounts field, or the sum in µs of one of the workers' stage histograms).
TRITON_FAMILIES = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", "success"),
    ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes", "failure"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", "items"),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     "executions"),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes "
     "cached requests)", "total"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached "
     "requests)", "queue"),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not "
     "include cached requests)", "copy_in"),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not "
     "include cached requests)", "compute"),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds "
     "(does not include cached requests)", "copy_out"),
)


def triton_families(snap) -> bytes:
    """Triton's per-model counters in Prometheus text, exactly as Triton names them (a counter's
    samples without ``_total``, which prometheus_client would add), one series per model version:
    requests and inferences count socket, v2 and lane calls alike (``status.triton_counts``), the
    durations are the workers' stage histograms' sums (request: slot acquired to done; queue;
    compute input, infer, output: copy in, compute, copy out)."""
    lines = []
    for name, help_text, what in TRITON_FAMILIES:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} counter")
        for m in snap.models:
            if what in layout.HIST_STAGES:
                value = m.histograms[what][1]
            else:
                value = getattr(triton_counts(snap, m), what)
            lines.append(f'{name}{{model="{_label(m.name)}",version="{m.version}"}} {value}')
    return ("\n".join(lines) + "\n").encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _cumulative(counts, scale: float) -> list:
    """Cumulative Prometheus buckets (upper bound hist_upper_bound(i) / scale) of bucket counts."""
    buckets, running = [], 0
    for i, n in enumerate(counts[:-1]):
        running += n
        buckets.append((repr(layout.hist_upper_bound(i) / scale), running))
    buckets.append(("+Inf", running + counts[-1]))
    return buckets


class MetricsServer:
    """A minimal HTTP/1.1 endpoint for GET /metrics on the front-end's loop."""

    def __init__(self, status):
        self.status = status
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(status))
        self.server = None
        self.path = None

    async def start(self, address: str) -> "MetricsServer":
        """Listen on ``address`` (a Unix socket path, or a loopback host:port).  SystemExit naming
        the flag and why if it cannot (a missing directory, an address in use)."""
        try:
            return await self._listen(address)
        except OSError as exc:
            raise SystemExit(f"shmserve serve: --metrics {address}: cannot listen: {exc.strerror or exc}") from None

    async def _listen(self, address: str) -> "MetricsServer":
        if "/" in address:
            self.path = address
            if os.path.exists(address):
                os.unlink(address)
            old = os.umask(0o117)
            try:
                self.server = await asyncio.start_unix_server(self._handle, path=address)
            finally:
                os.umask(old)
        else:
            host, _, port = address.rpartition(":")
            host = host.strip("[]") or "127.0.0.1"
            check_loopback(host)
            self.server = await asyncio.start_server(self._handle, host=host, port=int(port))
        log.info("metrics on %s", address)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)

    def render(self) -> bytes:
        """The scrape's body: shmserve's families, then Triton's (``triton_families``)."""
        return generate_latest(self.registry) + triton_families(self.status.snapshot())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method != "GET" or target.split("?")[0] not in ("/metrics", "/"):
                body, status, ctype = b"not found\n", "404 Not Found", "text/plain"
            else:
                body, status, ctype = self.render(), "200 OK", CONTENT_TYPE
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                ConnectionError):
            pass
        finally:
            writer.close()


def check_loopback(host: str) -> None:
    """Raise ValueError unless ``host`` is a loopback address (metrics are for this machine)."""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"{host!r} is not a loopback address (shmserve listens only for this machine); use "
                     "127.0.0.1, ::1 or a Unix socket path")
