"""The GPUs as ``doctor`` sees them: ``nvidia-smi``'s CSV, and what a TensorRT engine was built with.

Owns: running ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` (the
fields in ``FIELDS``; one the driver does not know is dropped, or replaced by its
older name, and the query asked again) and parsing its rows (``parse_csv``,
``parse_cuda_version``); the throttle-reason bits; which TensorRT this Python
has (package metadata: no import); what an engine file says it was built with
(``engine_build``: its ``<engine>.build.json`` record, else the version bytes of
its header).

Must not: import CUDA, TensorRT or a model runtime (the front-end's layer
never does), or change a GPU setting.  ``nvidia-smi`` is only ever asked to
query.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

NVIDIA_SMI_TIMEOUT_S = 15.0  # a GPU in trouble can hang nvidia-smi: that is itself a finding

# (field, older name the driver may know instead): what doctor asks nvidia-smi for.
FIELDS = (
    ("index", None), ("name", None), ("pci.bus_id", None), ("driver_version", None), ("compute_cap", None),
    ("persistence_mode", None), ("utilization.gpu", None), ("temperature.gpu", None),
    ("power.draw", None), ("power.limit", None),
    ("clocks.sm", None), ("clocks.max.sm", None), ("clocks.mem", None), ("clocks.max.mem", None),
    ("clocks_event_reasons.active", "clocks_throttle_reasons.active"),
    ("pcie.link.gen.current", None), ("pcie.link.gen.max", None),
    ("pcie.link.width.current", None), ("pcie.link.width.max", None),
    ("ecc.mode.current", None), ("ecc.errors.corrected.volatile.total", None),
    ("ecc.errors.uncorrected.volatile.total", None),
    ("remapped_rows.pending", None), ("remapped_rows.failure", None),
    ("memory.total", None), ("memory.used", None),
)

# nvmlClocksEventReasons (nvml.h): the bits of clocks_event_reasons.active.
THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}
SLOWDOWN = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})


@dataclass
class GpuFacts:
    """What ``nvidia-smi`` said: one dict per GPU (field name -> value: int, float, str or None for
    "[N/A]" and "[Not Supported]"), the CUDA version the driver supports, and if it could not be
    asked, why not (``error``; ``hung`` when it did not answer in time)."""

    command: str | None  # the nvidia-smi that was run (None: not found)
    rows: list[dict] = field(default_factory=list)
    cuda_version: str | None = None
    error: str | None = None
    hung: bool = False
    dropped: list[str] = field(default_factory=list)  # fields this driver does not know
    tensorrt: tuple[str, str] | None = None  # (distribution, version) installed here (``installed_tensorrt``)

    def by_bus(self) -> dict[str, dict]:
        from shmserve.placement import normalize_bus_id

        return {normalize_bus_id(str(r.get("pci.bus_id") or "")) or "?": r for r in self.rows}


def find_nvidia_smi(path: str | None = None) -> str | None:
    """The ``nvidia-smi`` on ``path`` (a PATH string; default the environment's), or None."""
    return shutil.which("nvidia-smi", path=path)


def query(command: str | None, *, timeout: float = NVIDIA_SMI_TIMEOUT_S) -> GpuFacts:
    """Ask ``command`` (an nvidia-smi) for ``FIELDS`` of every GPU, and see which TensorRT this
    Python has.  A field the driver refuses ("Field "x" is not a valid field to query") is replaced
    by its older name or dropped, and the query asked again."""
    facts = GpuFacts(command, tensorrt=installed_tensorrt())
    if command is None:
        facts.error = "nvidia-smi is not on the PATH"
        return facts
    fields = [name for name, _ in FIELDS]
    older = {name: old for name, old in FIELDS if old}
    for _ in range(len(FIELDS) + 1):
        try:
            proc = subprocess.run([command, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            facts.error, facts.hung = f"{command} did not answer within {timeout:g} s", True
            return facts
        except OSError as exc:
            facts.error = f"cannot run {command}: {exc.strerror or exc}"
            return facts
        if proc.returncode == 0:
            facts.rows = parse_csv(proc.stdout, fields)
            break
        bad = re.search(r'Field "([^"]+)" is not a valid field to query', proc.stdout + proc.stderr)
        if bad is None or bad.group(1) not in fields:
            text = " ".join((proc.stderr or proc.stdout).split())[:300]
            facts.error = f"{command} exited {proc.returncode}: {text or 'no output'}"
            return facts
        name = bad.group(1)
        index = fields.index(name)
        if name in older:
            fields[index] = older.pop(name)
        else:
            del fields[index]
            facts.dropped.append(name)
    # the CUDA version the driver supports: in the banner of plain nvidia-smi
    try:
        banner = subprocess.run([command], capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL).stdout
    except (subprocess.TimeoutExpired, OSError):
        banner = ""
    facts.cuda_version = parse_cuda_version(banner)
    return facts


_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]",
            "[gpu is lost]"}


def parse_csv(text: str, fields: list[str]) -> list[dict]:
    """Rows of ``nvidia-smi --format=csv,noheader,nounits`` as dicts over ``fields``: numbers as int
    or float, a bit mask ("0x0000000000000004") as int, missing values as None, text as text.
    A row with the wrong number of columns is skipped."""
    rows = []
    for cells in csv.reader(io.StringIO(text), skipinitialspace=True):
        if len(cells) != len(fields):
            continue
        rows.append({name: _value(cell) for name, cell in zip(fields, cells)})
    return rows


def _value(cell: str):
    cell = cell.strip()
    if cell.lower() in _MISSING:
        return None
    if re.fullmatch(r"0x[0-9a-fA-F]+", cell):
        return int(cell, 16)
    if re.fullmatch(r"-?\d+", cell):
        return int(cell)
    if re.fullmatch(r"-?\d+\.\d*", cell):
        return float(cell)
    return cell


def parse_cuda_version(banner: str) -> str | None:
    """The "CUDA Version: 13.0" of nvidia-smi's banner (the newest CUDA the driver supports)."""
    match = re.search(r"CUDA Version\s*:\s*(\d+\.\d+)", banner)
    return match.group(1) if match else None


def throttle_reasons(mask: int | None) -> list[str]:
    """The names of the bits set in a ``clocks_event_reasons.active`` mask."""
    if not isinstance(mask, int):
        return []
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


# -- TensorRT ---------------------------------------------------------------------------------

TRT_DISTRIBUTIONS = re.compile(r"^tensorrt([-_](lean|dispatch))?([-_]cu\d+)?([-_]bindings)?$")


def installed_tensorrt(path: list[str] | None = None) -> tuple[str, str] | None:
    """(distribution, version) of the TensorRT runtime installed in this Python (or on ``path``, a
    list of directories), from package metadata (nothing imported); None if there is none.  Its
    CUDA major is in its name (-cu13); the bindings' distribution is preferred (it carries the
    runtime's own version)."""
    from importlib import metadata

    found = []
    for dist in metadata.distributions(**({"path": path} if path is not None else {})):
        name = (dist.metadata["Name"] or "").lower()
        if TRT_DISTRIBUTIONS.match(name) and dist.version:
            found.append((name, dist.version))
    return sorted(found, key=lambda d: ("bindings" not in d[0], d[0]))[0] if found else None


def cuda_major_of(distribution: str) -> int | None:
    match = re.search(r"cu(\d+)", distribution)
    return int(match.group(1)) if match else None


HEADER_VERSION_AT = 24  # major, minor, patch bytes of a TensorRT 8.6-10 plan (undocumented: NVIDIA/TensorRT#3073)


@dataclass(frozen=True)
class EngineBuild:
    """What an engine was built with, and how that is known: ``source`` "record" (its
    ``<engine>.build.json``: tensorrt, cuda, driver, gpu, compute_capability) or "header" (the
    version bytes of the plan: the TensorRT version only, from an undocumented layout)."""

    source: str
    tensorrt: str | None = None
    cuda: str | None = None
    driver: str | None = None
    gpu: str | None = None
    compute_capability: str | None = None


def engine_build(path: str) -> tuple[EngineBuild | None, str]:
    """What built the engine at ``path``: (EngineBuild, "") or (None, why it cannot be told)."""
    record = path + ".build.json"
    try:
        with open(record, "rb") as f:
            data = json.loads(f.read(1 << 16))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return EngineBuild("record", **{k: str(data[k]) for k in ("tensorrt", "cuda", "driver", "gpu",
                                                                   "compute_capability") if data.get(k) is not None}), ""
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        return None, f"{record} is unreadable: {exc}"
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    version = header_version(head)
    if version is None:
        return None, f"no {os.path.basename(record)} beside it, and its header holds no version doctor can read"
    return EngineBuild("header", tensorrt=version), ""


def header_version(head: bytes) -> str | None:
    """"major.minor.patch" from a plan's header bytes (TensorRT 8.6 to 10 write it at byte 24);
    None where they do not look like a version."""
    if len(head) < HEADER_VERSION_AT + 3:
        return None
    major, minor, patch = head[HEADER_VERSION_AT:HEADER_VERSION_AT + 3]
    if not 8 <= major <= 30 or minor > 50:
        return None
    return f"{major}.{minor}.{patch}"


def same_release(a: str | None, b: str | None) -> bool | None:
    """Whether two versions share major.minor (None if either is unknown)."""
    if not a or not b:
        return None
    return a.split(".")[:2] == b.split(".")[:2]
