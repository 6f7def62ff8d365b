"""Each model's latency and outcomes over the last hour: the baseline `shmserve doctor` compares the
last minutes with.

Owns: ``History``, a sample a minute (``INTERVAL_S``) of every worker's
cumulative stage histograms and of the dispatcher's outcome counts, kept for
``KEEP_S``; and ``windows``: per model, what happened in the recent window
(the last ``RECENT_S``) and in the hour before it (``BASELINE_S``), as
differences of those samples.  The arena's histograms only ever grow (a
worker's are emptied when its entry is given to a new worker, which then is a
new key), so a difference is exact for every worker that lived through the
window; a worker retired within it takes its requests out of it.

Must not: read the arena, a clock or a part's state itself (the server hands it
samples and times), or hold anything but its samples.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from shmserve import layout

INTERVAL_S = 60.0
RECENT_S = 300.0  # the window compared: the last five minutes
BASELINE_S = 3600.0  # against the hour before them
KEEP_S = RECENT_S + BASELINE_S + INTERVAL_S
STAGES = tuple(s for s in layout.HIST_STAGES if s != "batch_size")


@dataclass(frozen=True)
class WorkerSample:
    """One worker's cumulative histograms: (count, sum in us) per stage of ``STAGES``, and the
    bucket counts of its "total" stage."""

    model: str
    stages: tuple[tuple[int, int], ...]
    total: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """Everything cumulative at ``time`` (monotonic seconds): each worker's histograms by a key that
    names that worker alone for the server's life, and the answers by (model, code)."""

    time: float
    workers: dict
    outcomes: dict


class History:
    """Samples of the last ``keep_s`` seconds, one per ``interval_s`` at most."""

    def __init__(self, interval_s: float = INTERVAL_S, keep_s: float = KEEP_S):
        self.interval_s, self.keep_s = interval_s, keep_s
        self.samples: collections.deque[Sample] = collections.deque()

    def due(self, now: float) -> bool:
        """Whether a sample should be taken at ``now``."""
        return not self.samples or now - self.samples[-1].time >= self.interval_s

    def record(self, sample: Sample) -> None:
        self.samples.append(sample)
        while self.samples and sample.time - self.samples[0].time > self.keep_s:
            self.samples.popleft()

    def windows(self, current: Sample, recent_s: float = RECENT_S, baseline_s: float = BASELINE_S) -> dict:
        """Per model: ``recent`` (from the last sample at least ``recent_s`` old, else the oldest, to
        ``current``) and ``baseline`` (the ``baseline_s`` before that, or as much of it as there is;
        absent when there is none), each ``{"seconds", "stages": {stage: [count, sum_us]}, "p50_us",
        "p99_us", "outcomes": {code: n}}``."""
        out = {"interval_s": self.interval_s, "recent_s": recent_s, "baseline_s": baseline_s, "models": {}}
        if not self.samples:
            return out
        start = self._at_or_before(current.time - recent_s) or self.samples[0]
        base = self._at_or_before(start.time - baseline_s) or self.samples[0]
        recent = _difference(start, current)
        baseline = _difference(base, start) if base is not start else {}
        for model in sorted(set(recent) | set(baseline)):
            entry = {}
            if model in recent:
                entry["recent"] = _window(recent[model], current.time - start.time)
            if model in baseline:
                entry["baseline"] = _window(baseline[model], start.time - base.time)
            out["models"][model] = entry
        return out

    def _at_or_before(self, when: float) -> Sample | None:
        found = None
        for sample in self.samples:
            if sample.time > when:
                break
            found = sample
        return found


def _difference(earlier: Sample, later: Sample) -> dict[str, dict]:
    """Per model, what ``later`` holds beyond ``earlier``: {"stages": [[count, sum]...], "total":
    [buckets], "outcomes": {code: n}}.  A worker not in ``earlier`` counts whole (it started after)."""
    models: dict[str, dict] = {}

    def model(name: str) -> dict:
        return models.setdefault(name, {"stages": [[0, 0] for _ in STAGES], "total": [0] * layout.HIST_BUCKETS,
                                        "outcomes": {}})

    for key, now in later.workers.items():
        before = earlier.workers.get(key)
        m = model(now.model)
        for i, (count, total_us) in enumerate(now.stages):
            was = before.stages[i] if before is not None else (0, 0)
            m["stages"][i][0] += max(0, count - was[0])
            m["stages"][i][1] += max(0, total_us - was[1])
        for i, n in enumerate(now.total):
            m["total"][i] += max(0, n - (before.total[i] if before is not None else 0))
    for (name, code), n in later.outcomes.items():
        grew = n - earlier.outcomes.get((name, code), 0)
        if grew > 0:
            model(name)["outcomes"][code] = model(name)["outcomes"].get(code, 0) + grew
    return models


def _window(m: dict, seconds: float) -> dict:
    return {"seconds": round(seconds, 1), "stages": dict(zip(STAGES, m["stages"])),
            "p50_us": layout.hist_quantile(m["total"], 0.5), "p99_us": layout.hist_quantile(m["total"], 0.99),
            "outcomes": m["outcomes"]}
