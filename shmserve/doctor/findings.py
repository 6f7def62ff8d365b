"""What ``shmserve doctor`` says: findings, the report, its JSON form (schema 1) and its table.

Owns: ``Finding`` (one problem or fact: check, severity, subject, evidence as
the measured value beside the expected one, why it matters, the exact fix),
the severities and what each means, ``CheckResult`` (whether a check ran, and
if not why), ``Report`` (all of it, its exit status) and the two renderings.

Severities:

* ``critical``: serving fails or will fail (a worker cannot start, an engine
  must be rebuilt, a crash loop, memory errors on the GPU).  ``doctor`` exits 1.
* ``warning``: it costs latency or throughput now (throttling, oversubscribed
  thread pools, a link trained below its maximum, a model whose latency
  doubled).  Exit 0 unless ``--fail-on warning``.
* ``info``: a fact worth knowing, with nothing to fix (which stage dominates,
  a canary running, a check that could not look).

Must not: run a check or read the machine; the JSON keys are stable (a new key
may be added, none renamed or removed without raising ``SCHEMA``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA = 1
CRITICAL, WARNING, INFO = "critical", "warning", "info"
SEVERITIES = (CRITICAL, WARNING, INFO)  # most severe first
RANK = {s: i for i, s in enumerate(SEVERITIES)}
AREAS = ("host", "placement", "gpu", "service")


@dataclass(frozen=True)
class Finding:
    """One thing ``doctor`` found.  ``measured`` and ``expected`` are the evidence, each a short
    phrase with its numbers and where they come from (a file, a field of ``nvidia-smi``, a key)."""

    check: str  # the check's id, e.g. "host.cgroup_cpu"
    severity: str  # CRITICAL, WARNING or INFO
    title: str  # one line: what is wrong (or what is so)
    subject: str  # what it is about: "cgroup /system.slice/shmserve.service", "worker 2 (resnet)", "cuda:0"
    measured: str
    expected: str
    why: str
    fix: str  # the exact change: a config key, a systemd line, a command ("" for a fact with nothing to do)
    data: dict = field(default_factory=dict)  # the raw values, for scripts

    def __post_init__(self):
        if self.severity not in RANK:
            raise ValueError(f"unknown severity {self.severity!r}")

    def to_dict(self) -> dict:
        return {"check": self.check, "area": self.check.partition(".")[0], "severity": self.severity,
                "title": self.title, "subject": self.subject,
                "evidence": {"measured": self.measured, "expected": self.expected},
                "why": self.why, "fix": self.fix, "data": self.data}


@dataclass(frozen=True)
class CheckResult:
    """One check's run: ``ran`` False with ``skipped`` saying why (no GPU, no live instance...);
    ``error`` when the check itself failed (a bug: reported, never raised)."""

    check: str
    title: str
    ran: bool
    skipped: str | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        status = "error" if self.error else "ran" if self.ran else "skipped"
        return {"id": self.check, "area": self.check.partition(".")[0], "title": self.title, "status": status,
                "why": self.error or self.skipped}


@dataclass
class Report:
    """Everything one run of ``doctor`` found, in the order the checks ran, most severe first."""

    version: str
    instance: str
    server: str  # "live", "dead" (its arena only), "none" (no arena), or "unreadable" (why in sources)
    time_unix: float
    root: str
    sources: dict  # what was read: {"arena": ..., "status": ..., "config": ..., "nvidia_smi": ...}
    checks: list[CheckResult]
    findings: list[Finding]

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: RANK[f.severity])  # stable: check order within a severity

    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}

    def exit_status(self, fail_on: str = CRITICAL) -> int:
        """1 when a finding is at least as severe as ``fail_on`` (critical, or warning), else 0."""
        return 1 if any(RANK[f.severity] <= RANK[fail_on] for f in self.findings) else 0

    def to_dict(self, fail_on: str = CRITICAL) -> dict:
        return {"schema": SCHEMA, "shmserve": self.version, "instance": self.instance, "server": self.server,
                "time_unix": round(self.time_unix, 3), "root": self.root, "sources": self.sources,
                "summary": {**self.counts(), "checks_run": sum(c.ran for c in self.checks),
                            "checks_skipped": sum(not c.ran for c in self.checks),
                            "exit_status": self.exit_status(fail_on)},
                "findings": [f.to_dict() for f in self.sorted_findings()],
                "checks": [c.to_dict() for c in self.checks]}


_STYLE = {CRITICAL: "bold red", WARNING: "yellow", INFO: "cyan"}


def render(report: Report, *, verbose: bool = False):
    """A rich renderable for people: each finding (most severe first) with its evidence, why and
    fix; then what was not checked and why (every check with ``verbose``); then a summary line.
    Everything that comes from the machine or the server is plain text, never markup."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = [Text(f"shmserve doctor: instance {report.instance} ({_server_words(report.server)}), "
                  f"root {report.root}", style="bold")]
    for f in report.sorted_findings():
        head = Text()
        head.append(f"{f.severity.upper():8} ", style=_STYLE[f.severity])
        head.append(f"{f.check}  ", style="dim")
        head.append(f.title)
        body = Table.grid(padding=(0, 1))
        body.add_column(width=3)
        body.add_column(style="dim", no_wrap=True)
        body.add_column(overflow="fold")
        for label, value in (("about", f.subject), ("measured", f.measured), ("expected", f.expected),
                             ("why", f.why), ("fix", f.fix)):
            if value:
                body.add_row("", label, Text(value))
        parts += [head, body]
    for c in report.checks:
        if c.error:
            parts.append(Text(f"ERROR    {c.check}: the check failed: {c.error}", style="red"))
        elif not c.ran and verbose:
            parts.append(Text(f"skipped  {c.check}: {c.skipped}", style="dim"))
        elif verbose:
            parts.append(Text(f"ran      {c.check}: {c.title}", style="dim"))
    skipped = [c for c in report.checks if not c.ran and not c.error]
    n = report.counts()
    summary = (f"{n[CRITICAL]} critical, {n[WARNING]} warning{'s' * (n[WARNING] != 1)}, {n[INFO]} info; "
               f"{sum(c.ran for c in report.checks)} checks ran")
    if skipped:
        summary += f", {len(skipped)} skipped" + ("" if verbose else " (--verbose says why)")
    parts.append(Text(summary, style="bold"))
    return Group(*parts)


def _server_words(server: str) -> str:
    return {"live": "a live server", "dead": "its front-end is gone: the arena only",
            "none": "no arena: host checks only"}.get(server, server)
