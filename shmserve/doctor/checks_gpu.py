"""GPU checks: persistence mode, clocks and throttle reasons, the PCIe link, ECC, memory against the
budget, TensorRT engines against the TensorRT, CUDA and GPU they were built for.

Owns: the judgement of each, from ``nvidia-smi``'s rows (``ctx.gpus``), the
PCIe link in sysfs (``ctx.host``) and what each engine says it was built with
(``shmserve.doctor.gpu``).

Must not: import CUDA, TensorRT or a model runtime, or change a GPU setting.
"""

from __future__ import annotations

import os

from shmserve import placement
from shmserve.doctor import gpu as gpuinfo
from shmserve.doctor.checks_host import Skip, size
from shmserve.doctor.context import Context
from shmserve.doctor.findings import CRITICAL, INFO, WARNING, Finding

MEMORY_FULL = 0.95  # a GPU with more of its memory in use than this has no room for a load or a workspace


def _rows(ctx: Context) -> list[dict]:
    if ctx.gpus.rows:
        return ctx.gpus.rows
    if ctx.gpus.error and (ctx.gpus.hung or placement.nvidia_gpus(ctx.host.root)):
        raise Skip(f"the GPUs could not be asked: {ctx.gpus.error}")
    raise Skip("no NVIDIA GPU (nvidia-smi shows none" + (f": {ctx.gpus.error}" if ctx.gpus.error else "") + ")")


def _who(row: dict) -> str:
    return f"GPU {row.get('index')} {row.get('name') or '?'} (PCI {row.get('pci.bus_id') or '?'})"


def _bus(row: dict) -> str | None:
    return placement.normalize_bus_id(str(row.get("pci.bus_id") or ""))


def nvidia_smi(ctx: Context) -> list[Finding]:
    """The query itself: a hung or failing nvidia-smi on a machine that has GPUs."""
    if ctx.gpus.rows:
        return []
    present = placement.nvidia_gpus(ctx.host.root)
    if not ctx.gpus.hung and not (ctx.gpus.error and present):
        raise Skip("no NVIDIA GPU" + (f" ({ctx.gpus.error})" if ctx.gpus.error else ""))
    return [Finding(
        "gpu.nvidia_smi", CRITICAL if ctx.gpus.hung else WARNING,
        "nvidia-smi did not answer" if ctx.gpus.hung else "the GPUs' state cannot be read",
        ", ".join(g.bus_id for g in present) or "the NVIDIA driver", ctx.gpus.error or "?",
        "an answer within seconds",
        "A hung nvidia-smi usually means a GPU the driver lost (an Xid error): the workers on it hang too."
        if ctx.gpus.hung else "Without nvidia-smi the GPU checks cannot look.",
        "sudo dmesg | grep -i xid; nvidia-smi -q; drain and reset the GPU (nvidia-smi -r -i N) or reboot"
        if ctx.gpus.hung else "install the driver's utilities (nvidia-utils) so nvidia-smi is on the PATH",
        {"error": ctx.gpus.error})]


def persistence(ctx: Context) -> list[Finding]:
    found = []
    for row in _rows(ctx):
        if str(row.get("persistence_mode") or "").lower() == "disabled":
            found.append(Finding(
                "gpu.persistence", WARNING, "persistence mode is off", _who(row),
                "persistence_mode = Disabled (nvidia-smi)", "Enabled (or nvidia-persistenced running)",
                "Without it the driver tears the GPU down whenever no process holds it: the next worker start "
                "pays seconds of initialization, and clocks and ECC state are reset in between.",
                "sudo systemctl enable --now nvidia-persistenced (or: sudo nvidia-smi -pm 1)",
                {"index": row.get("index")}))
    return found


def clocks(ctx: Context) -> list[Finding]:
    found = []
    for row in _rows(ctx):
        mask = row.get("clocks_event_reasons.active", row.get("clocks_throttle_reasons.active"))
        reasons = gpuinfo.throttle_reasons(mask)
        slow = sorted(set(reasons) & gpuinfo.SLOWDOWN)
        evidence = (f"clocks_event_reasons.active = {mask:#x} ({', '.join(reasons) or 'none'}); SM clock "
                    f"{row.get('clocks.sm')} of {row.get('clocks.max.sm')} MHz; {row.get('temperature.gpu')} C; "
                    f"{row.get('power.draw')} of {row.get('power.limit')} W (nvidia-smi)") if isinstance(mask, int) \
            else "clocks_event_reasons.active not reported"
        if slow:
            found.append(Finding(
                "gpu.clocks", WARNING, "the GPU is slowing its clocks down", _who(row), evidence,
                "no hardware, thermal or power-brake slowdown",
                "A slowdown reason cuts the SM clock, so every kernel takes longer: thermal ones mean the "
                "cooling cannot keep up, hardware ones a power supply or an external signal asking for less.",
                "check cooling and airflow (temperature.gpu, fan), the power cables and the PSU; nvidia-smi -q "
                "-d PERFORMANCE,TEMPERATURE,POWER shows which and since when",
                {"mask": mask, "reasons": reasons}))
        elif "sw_power_cap" in reasons and (row.get("utilization.gpu") or 0) > 0:
            found.append(Finding(
                "gpu.clocks", INFO, "the GPU runs at its power limit", _who(row), evidence,
                "below the power limit", "At the power cap the clocks drop to stay within it: expected under "
                "full load, a surprise when lightly loaded (a lowered power limit).",
                "nvidia-smi -q -d POWER (a lowered limit: sudo nvidia-smi -pl <default watts>)",
                {"mask": mask, "reasons": reasons}))
    return found


def pcie(ctx: Context) -> list[Finding]:
    found = []
    for row in _rows(ctx):
        bus = _bus(row)
        link = ctx.host.pci_link(bus) if bus else {}
        gen, gen_max = row.get("pcie.link.gen.current"), row.get("pcie.link.gen.max")
        width, width_max = row.get("pcie.link.width.current"), row.get("pcie.link.width.max")
        width = width if isinstance(width, int) else link.get("current_width")
        width_max = width_max if isinstance(width_max, int) else link.get("max_width")
        sysfs = (f"; sysfs: {link.get('current_speed')} x{link.get('current_width')} of {link.get('max_speed')} "
                 f"x{link.get('max_width')} (sys/bus/pci/devices/{bus}/current_link_*)") \
            if link.get("current_speed") or link.get("current_width") else ""
        evidence = f"gen {gen} of {gen_max}, width x{width} of x{width_max} (nvidia-smi pcie.link.*){sysfs}"
        data = {"gen": gen, "gen_max": gen_max, "width": width, "width_max": width_max}
        if isinstance(width, int) and isinstance(width_max, int) and width < width_max:
            found.append(Finding(
                "gpu.pcie", WARNING, f"the PCIe link trained at x{width} of x{width_max}", _who(row), evidence,
                f"x{width_max}", "Each lane missing divides the bandwidth of every copy between the arena and "
                "the GPU: a card not fully seated, a riser or a slot wired narrower than it looks.",
                "reseat the card or move it to a full-width slot; lspci -vv -s <bus> shows LnkCap against LnkSta",
                data))
        if isinstance(gen, int) and isinstance(gen_max, int) and gen < gen_max:
            idle = (row.get("utilization.gpu") or 0) == 0 or "gpu_idle" in gpuinfo.throttle_reasons(
                row.get("clocks_event_reasons.active", row.get("clocks_throttle_reasons.active")))
            found.append(Finding(
                "gpu.pcie", INFO if idle else WARNING,
                f"the PCIe link runs at generation {gen} of {gen_max}" + (" (the GPU is idle)" if idle else ""),
                _who(row), evidence, f"generation {gen_max} while busy",
                "GPUs lower the link's generation when idle to save power and raise it under load, so an idle "
                "reading says nothing; a busy GPU below its maximum copies at a fraction of the speed."
                if idle else "A busy GPU whose link stays below its maximum generation copies at half the "
                "speed or less per generation missing: a slot, riser or BIOS setting limits it.",
                "" if idle else "check the slot's generation and the BIOS PCIe setting; lspci -vv -s <bus> (LnkSta)",
                data))
    return found


def ecc(ctx: Context) -> list[Finding]:
    found = []
    for row in _rows(ctx):
        uncorrected = row.get("ecc.errors.uncorrected.volatile.total")
        pending = str(row.get("remapped_rows.pending") or "").lower() == "yes"
        failed = str(row.get("remapped_rows.failure") or "").lower() == "yes"
        evidence = (f"uncorrected volatile {uncorrected}, corrected volatile "
                    f"{row.get('ecc.errors.corrected.volatile.total')}, remapped rows pending "
                    f"{row.get('remapped_rows.pending')}, failure {row.get('remapped_rows.failure')} (nvidia-smi)")
        if (isinstance(uncorrected, int) and uncorrected > 0) or pending or failed:
            found.append(Finding(
                "gpu.ecc", CRITICAL, "the GPU's memory has uncorrectable errors" if not failed else
                "the GPU's memory could not remap a failing row", _who(row), evidence,
                "0 uncorrected errors, no row remapping pending", "An uncorrectable error can corrupt results "
                "silently or kill the process that touched it; a pending remap takes effect only after a "
                "reset; a remapping failure means the GPU needs service.",
                "drain the GPU's models, then sudo nvidia-smi -r -i <index> (or reboot); a remapping failure: "
                "replace the GPU (nvidia-smi -q -d ROW_REMAPPER,ECC)",
                {"uncorrected": uncorrected, "pending": pending, "failure": failed}))
    return found


def memory(ctx: Context) -> list[Finding]:
    rows = _rows(ctx)
    by_bus = ctx.gpus.by_bus()
    budget = {d: b for d, b in ctx.settings.memory_budget.items() if d.startswith("cuda")}
    found = []
    gpus, env = placement.nvidia_gpus(ctx.host.root), ctx.server_environ()
    for device, limit in sorted(budget.items()):
        ordinal = int(device.partition(":")[2])
        gpu, _ = placement.cuda_gpu(ordinal, gpus, env)
        row = by_bus.get(gpu.bus_id) if gpu else next((r for r in rows if r.get("index") == ordinal), None)
        total = row.get("memory.total") if row else None
        if not isinstance(total, int):
            continue
        if limit > total << 20:
            found.append(Finding(
                "gpu.memory", WARNING, f"memory_budget for {device} is more than the GPU has", _who(row),
                f"memory_budget {device} = {size(limit)}; memory.total = {size(total << 20)} (nvidia-smi)",
                f"below {size(total << 20)}, less what the driver, CUDA contexts and workspaces take",
                "Eviction keeps the loaded versions within the budget; a budget above the GPU's memory never "
                "evicts in time, so a load fails with out-of-memory instead.",
                f"memory_budget = {{\"{device}\" = \"{int(total * 0.9) >> 10}GiB\"}} in [server] (about 90 % "
                f"of it)", {"budget": limit, "total": total << 20, "device": device}))
    for row in rows:
        total, used = row.get("memory.total"), row.get("memory.used")
        if isinstance(total, int) and isinstance(used, int) and total and used / total > MEMORY_FULL:
            found.append(Finding(
                "gpu.memory", WARNING, "the GPU's memory is nearly full", _who(row),
                f"{size(used << 20)} used of {size(total << 20)} ({used / total:.0%}; nvidia-smi memory.*)",
                f"at most {MEMORY_FULL:.0%} used", "A load, a new batch size or a CUDA graph capture needs "
                "memory: at the edge they fail with out-of-memory, and allocators that retry add latency.",
                "see who holds it (nvidia-smi --query-compute-apps=pid,used_memory --format=csv); set "
                "memory_budget for the device so idle on-demand versions are evicted",
                {"used": used << 20, "total": total << 20}))
    return found


def engines(ctx: Context) -> list[Finding]:
    trt = [m for m in ctx.settings.models if m.backend == "tensorrt"]
    failed = [e for e in (ctx.service.repository or {}).get("models", [])
              if "is not a TensorRT engine that TensorRT" in str(e.get("reason") or "")]
    if not trt and not failed:
        raise Skip("no TensorRT model")
    installed = ctx.gpus.tensorrt
    found = []
    for e in failed:
        found.append(Finding(
            "gpu.engines", CRITICAL, "a TensorRT engine could not be loaded: it must be rebuilt",
            f"model {e['name']} v{e.get('version')}", str(e.get("reason")),
            f"an engine built by TensorRT {installed[1] if installed else '(this one)'} for this GPU",
            "An engine is tied to the TensorRT version and the GPU it was built on; the model serves nothing "
            "until it is rebuilt.", _rebuild(e.get("path") or e["name"]), {"model": e["name"]}))
    driver_cuda = ctx.gpus.cuda_version
    if installed and driver_cuda:
        wants = gpuinfo.cuda_major_of(installed[0])
        if wants and int(driver_cuda.split(".")[0]) < wants:
            found.append(Finding(
                "gpu.engines", CRITICAL, f"TensorRT for CUDA {wants} on a driver that supports CUDA {driver_cuda}",
                f"{installed[0]} {installed[1]}", f"the driver supports CUDA up to {driver_cuda} (nvidia-smi)",
                f"a driver for CUDA {wants} or newer", "TensorRT cannot create its runtime on an older driver: "
                "every TensorRT worker fails to load.", f"upgrade the NVIDIA driver to one for CUDA {wants}, or "
                f"install the TensorRT build for CUDA {driver_cuda.split('.')[0]}",
                {"distribution": installed[0], "driver_cuda": driver_cuda}))
    rows = ctx.gpus.rows
    for m in trt:
        build, why = gpuinfo.engine_build(m.path) if m.path else (None, "its path is not known here")
        if build is None:
            found.append(Finding(
                "gpu.engines", INFO, "what built this engine is not known", f"model {m.name} ({m.path})", why,
                f"a record {os.path.basename(m.path or 'ENGINE')}.build.json beside it (docs/operations.md)",
                "Without a record doctor cannot tell whether a driver, CUDA or TensorRT upgrade left the engine "
                "behind before a worker tries to load it.",
                "write the record when you build the engine (docs/operations.md, 'TensorRT engines')", {}))
            continue
        problems = []
        if installed and gpuinfo.same_release(build.tensorrt, installed[1]) is False:
            problems.append(f"built by TensorRT {build.tensorrt}, this Python has {installed[0]} {installed[1]}")
        if build.cuda and installed and gpuinfo.cuda_major_of(installed[0]) and \
                build.cuda.split(".")[0] != str(gpuinfo.cuda_major_of(installed[0])):
            problems.append(f"built against CUDA {build.cuda}, the TensorRT here is for CUDA "
                            f"{gpuinfo.cuda_major_of(installed[0])}")
        names = {str(r.get("name")) for r in rows}
        caps = {str(r.get("compute_cap")) for r in rows if r.get("compute_cap") is not None}
        if build.gpu and rows and build.gpu not in names:
            problems.append(f"built on a {build.gpu}, this machine has {', '.join(sorted(names))}")
        if build.compute_capability and caps and build.compute_capability not in caps:
            problems.append(f"built for compute capability {build.compute_capability}, the GPUs here are "
                            f"{', '.join(sorted(caps))}")
        drivers = {str(r.get("driver_version")) for r in rows if r.get("driver_version")}
        notes = []
        if build.driver and drivers and build.driver.split(".")[0] not in {d.split(".")[0] for d in drivers}:
            notes.append(f"built under driver {build.driver}, running {', '.join(sorted(drivers))}")
        if not problems and not notes:
            continue
        source = "its .build.json record" if build.source == "record" else \
            "its header's version bytes (an undocumented layout: NVIDIA/TensorRT#3073)"
        severe = problems and build.source == "record"
        found.append(Finding(
            "gpu.engines", CRITICAL if severe else WARNING,
            "a TensorRT engine must be rebuilt" if severe else "a TensorRT engine may need a rebuild",
            f"model {m.name} ({m.path})", "; ".join(problems + notes) + f" (from {source})",
            "the TensorRT release, CUDA major and GPU of this machine",
            "TensorRT refuses an engine built by another release or for another GPU (the worker fails to load "
            "it and the model is unavailable); one built under an older driver or CUDA runs, but without the "
            "kernels the newer one would have chosen.", _rebuild(m.path),
            {"build": build.__dict__, "installed": installed}))
    return found


def _rebuild(path: str) -> str:
    return (f"rebuild it on this machine: trtexec --onnx=<model.onnx> --saveEngine={path} (with your shapes and "
            f"precision), write its .build.json record, then 'shmserve load <model>' (or systemctl reload "
            f"shmserve)")
