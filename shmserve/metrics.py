"""Prometheus metrics: a collector over the front-end's live state, served over HTTP.

Owns: metric names and labels (Prometheus conventions: ``shmserve_`` prefix,
base units, ``_total`` counters) and the small HTTP endpoint
(``--metrics ADDR``: a Unix socket path, or a loopback ``host:port``).  Values
are read at scrape time from the front-end and from the arena's counters and
per-worker latency histograms, so nothing is double-counted and nothing costs
anything between scrapes.

Must not: listen on a non-loopback address, or block the event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from shmserve import layout

log = logging.getLogger("shmserve.metrics")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FrontendCollector:
    def __init__(self, frontend):
        self.fe = frontend

    def collect(self):
        fe = self.fe
        arena, g = fe.arena, fe.arena.geometry
        requests = CounterMetricFamily("shmserve_requests", "Requests answered through the socket, by model and "
                                       "outcome (ok or the error code); lane calls are in shmserve_worker_requests",
                                       labels=["model", "outcome"])
        for (model, outcome), n in sorted(fe.outcomes.items()):
            requests.add_metric([model, outcome], n)
        yield requests

        stages = HistogramMetricFamily("shmserve_request_stage_seconds",
                                       "Time per request stage in the worker: queue, copy_in, compute, "
                                       "copy_out, and total (slot acquired to done)", labels=["model", "stage"])
        batch = HistogramMetricFamily("shmserve_batch_size", "Requests per model execution (dynamic batching)",
                                      labels=["model"])
        for name, state in fe.models.items():
            for stage in layout.HIST_STAGE_BOUNDS:
                buckets, total = _histogram(arena, g, state.workers, stage, scale=1e6)
                stages.add_metric([name, stage], buckets, total / 1e6)
            buckets, total = _histogram(arena, g, state.workers, "batch_size", scale=1)
            batch.add_metric([name], buckets, total)
        yield stages
        yield batch

        queued = GaugeMetricFamily("shmserve_queue_depth", "Requests admitted but not yet claimed by a worker, "
                                   "plus requests waiting for arena space", labels=["model"])
        inflight = GaugeMetricFamily("shmserve_inflight_requests", "Requests handed to workers and not yet "
                                     "answered", labels=["model"])
        for name, state in fe.models.items():
            mine = [r for r in fe.pending.values() if r.model is state]
            ready = sum(1 for r in mine if arena.slot_status(r.slot)[1] == 2)
            waiting = sum(1 for r in fe.waiting if r.model is state)
            queued.add_metric([name], ready + waiting)
            inflight.add_metric([name], len(mine))
        yield queued
        yield inflight

        served = CounterMetricFamily("shmserve_worker_requests", "Requests a worker finished, socket and lane "
                                     "calls alike (outcome ok or error), since the worker started",
                                     labels=["model", "worker", "outcome"])
        lanes = GaugeMetricFamily("shmserve_lanes", "Lanes (client regions with their own queue) attached, by "
                                  "model and worker", labels=["model", "worker"])
        for w in fe.supervisor.workers:
            counters = fe.worker_counters(w)
            served.add_metric([w.model.name, str(w.index), "ok"], counters["requests"] - counters["errors"])
            served.add_metric([w.model.name, str(w.index), "error"], counters["errors"])
            lanes.add_metric([w.model.name, str(w.index)], counters["lanes"])
        yield served
        yield lanes

        restarts = CounterMetricFamily("shmserve_worker_restarts", "Worker restarts", labels=["model", "worker"])
        workers = GaugeMetricFamily("shmserve_workers", "Workers by model and state", labels=["model", "state"])
        states: dict = {}
        for w in fe.supervisor.workers:
            restarts.add_metric([w.model.name, str(w.index)], w.restarts)
            states[(w.model.name, w.state)] = states.get((w.model.name, w.state), 0) + 1
        for (model, state), n in sorted(states.items()):
            workers.add_metric([model, state], n)
        yield restarts
        yield workers

        yield GaugeMetricFamily("shmserve_arena_bytes_in_use", "Arena data bytes held by requests",
                                value=arena.stat("extent_bytes_in_use"))
        yield GaugeMetricFamily("shmserve_arena_data_bytes", "Arena data region size", value=g.data_size)
        yield GaugeMetricFamily("shmserve_slots_in_use", "Arena slots held by requests", value=arena.stat("slots_in_use"))
        yield GaugeMetricFamily("shmserve_slots", "Arena slots", value=g.slot_count)


def _histogram(arena, g, workers, stage: str, scale: float) -> tuple[list, int]:
    """Cumulative Prometheus buckets (upper bound hist_upper_bound(i) / scale) summed over ``workers``."""
    counts = [0] * layout.HIST_BUCKETS
    total = 0
    for w in workers:
        buckets, worker_total = layout.read_histogram(arena.buf, g, w.index, stage)
        counts = [a + b for a, b in zip(counts, buckets)]
        total += worker_total
    buckets, running = [], 0
    for i, n in enumerate(counts[:-1]):
        running += n
        buckets.append((repr(layout.hist_upper_bound(i) / scale), running))
    buckets.append(("+Inf", running + counts[-1]))
    return buckets, total


class MetricsServer:
    """A minimal HTTP/1.1 endpoint for GET /metrics on the front-end's loop."""

    def __init__(self, frontend):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FrontendCollector(frontend))
        self.server = None
        self.path = None

    async def start(self, address: str) -> "MetricsServer":
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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method != "GET" or target.split("?")[0] not in ("/metrics", "/"):
                body, status, ctype = b"not found\n", "404 Not Found", "text/plain"
            else:
                body, status, ctype = generate_latest(self.registry), "200 OK", CONTENT_TYPE
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
    raise ValueError(f"metrics address {host!r} is not a loopback address; use 127.0.0.1, ::1 or a Unix socket path")
