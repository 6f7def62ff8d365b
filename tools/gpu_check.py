#!/usr/bin/env python3
"""Prove the GPU path on a machine with an NVIDIA GPU; print a table and write JSON.

Runs without editing (needs torch with CUDA, cuda-python, onnx and onnxruntime):

  1. starts the real server with GPU workers (torch backend) in both I/O modes:
     a small conv-net (torch.export .pt2, two workers on one GPU), the demo
     model converted to torch (TorchScript), and a scale-by-2 model for timing;
  2. sends requests through the real client, inline and zero-copy, with random
     inputs each time and zero-copy output areas poisoned with NaN first, and
     checks every output against a CPU reference (onnxruntime for the demo);
  3. measures, in the same run: H2D/D2H bandwidth from a registered arena vs
     cudaHostAlloc memory vs pageable memory; 4 KiB request p50/p99 end to end
     vs the bare model on the GPU; 16 MiB request throughput in both modes;
  4. shows both workers of one model registered the same arena and both served;
  5. shows client regions are sealed memfds (no /dev/shm name), received by the
     GPU workers by descriptor, mapped at the recorded size and page-locked
     there (mapped mode reads them through their device addresses).

With --multi-gpu (two GPUs or more; issue 16) it checks placement instead:

  1. starts one server with a conv-net on cuda:0, another on cuda:1, a scale-by-2
     model with ``instances = 4`` over ``device = ["cuda:0", "cuda:1"]``, and per
     GPU a scale model on its local CPUs (the default) and one on deliberately
     remote CPUs (``cpus`` = another GPU's local CPUs, else the CPUs outside its own);
  2. runs 8 concurrent clients, each through lanes (``Client.zero_copy``) and
     inline (``Client.infer``), random inputs, against CPU references;
  3. reports per worker its device (as ``info`` says and as the worker registered
     it), its CPUs (``info``, and the kernel's Cpus_allowed_list) and why;
  4. per GPU, local vs remote CPUs: a 4 KiB round trip (p50, p99) and 16 MiB
     bandwidth, inline and through a lane, measured from a thread pinned to the
     worker's CPUs.

usage: python tools/gpu_check.py [--json-out FILE] [--quick] [--multi-gpu]
Exit status 0 only if every correctness check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shmserve import Client, placement  # noqa: E402
from shmserve.config import demo_config  # noqa: E402
from shmserve.errors import ConnectionClosed  # noqa: E402

TOLERANCE = dict(rtol=2e-3, atol=2e-4)  # TF32 convolutions on the GPU vs float32 on the CPU
MiB = 1024 * 1024


def pct(samples, q):
    return float(np.percentile(np.asarray(samples), q))


# -- models -----------------------------------------------------------------------------------

def build_models(directory: Path) -> dict:
    import torch

    from shmserve.models.torchnets import save_models

    paths = save_models(directory, with_demo=True)

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    scale = directory / "scale.pt"
    torch.jit.script(Scale()).save(str(scale))
    paths["scale"] = str(scale)
    return paths


def config_text(instance: str, paths: dict) -> str:
    conv_pt2 = paths["export"]
    blocks = [f'[server]\ninstance = "{instance}"\nrequest_timeout_s = 60\nmax_request_bytes = {80 * MiB}\n']
    for mode in ("mapped", "copy"):
        blocks.append(f"""
[[models]]
name = "conv_{mode}"
backend = "torch"
path = "{conv_pt2}"
device = "cuda:0"
io_mode = "{mode}"
instances = {2 if mode == "mapped" else 1}

[[models]]
name = "demo_{mode}"
backend = "torch"
path = "{paths['demo_torchscript']}"
device = "cuda:0"
io_mode = "{mode}"
inputs = [{{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}}]
outputs = [{{name = "probabilities", dtype = "float32", shape = ["batch", 10]}}]

[[models]]
name = "scale_{mode}"
backend = "torch"
path = "{paths['scale']}"
device = "cuda:0"
io_mode = "{mode}"
inputs = [{{name = "x", dtype = "float32", shape = ["n"]}}]
outputs = [{{name = "y", dtype = "float32", shape = ["n"]}}]
""")
    return "\n".join(blocks)


class Server:
    def __init__(self, workdir: Path, paths: dict, make_config=config_text):
        self.instance = f"gpucheck-{uuid.uuid4().hex[:8]}"
        self.socket = str(workdir / "run" / "s.sock")
        cfg = workdir / "gpu.toml"
        cfg.write_text(make_config(self.instance, paths))
        self.log = open(workdir / "server.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "serve", "--config", str(cfg),
                                      "--socket", self.socket], stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited {self.proc.returncode}; see {workdir / 'server.log'}")
            try:
                with Client(self.socket) as c:
                    c.health()
                return
            except ConnectionClosed:
                time.sleep(0.1)
        raise SystemExit("server not ready in 300 s")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        self.log.close()
        return code


# -- checks -----------------------------------------------------------------------------------

def both_paths(c: Client, model: str, in_name: str, out_name: str, x: np.ndarray, ref: np.ndarray) -> float:
    """``x`` through ``model`` inline, then zero-copy (a lane, unless the client has lanes off) with
    its output area poisoned with NaN first; each answer checked against ``ref`` (AssertionError);
    the largest absolute error."""
    got = c.infer(model, {in_name: x})[out_name]
    np.testing.assert_allclose(got, ref, **TOLERANCE)
    worst = float(np.max(np.abs(got - ref)))
    with c.zero_copy(model, {in_name: (x.shape, np.float32)}) as call:
        call.inputs[in_name][...] = x
        np.ndarray(call.out_capacity // 4, np.float32, buffer=call.region.buf, offset=call.out_offset)[...] = np.nan
        got = call.run()[out_name]
        np.testing.assert_allclose(got, ref, **TOLERANCE)
    return max(worst, float(np.max(np.abs(got - ref))))


def correctness(server: Server, rounds: int) -> list[dict]:
    import onnxruntime as ort
    import torch

    from shmserve.models.torchnets import convnet

    conv = convnet()
    demo = ort.InferenceSession(demo_config().models[0].path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    rows = []
    with Client(server.socket, timeout=60) as c:
        listing = {m["name"]: m for m in c.models()}
        for mode in ("mapped", "copy"):
            conv_in = listing[f"conv_{mode}"]["inputs"][0]["name"]
            conv_out = listing[f"conv_{mode}"]["outputs"][0]["name"]
            cases = [
                (f"conv_{mode}", conv_in, conv_out,
                 lambda x: conv(torch.from_numpy(x)).detach().numpy(), lambda b: (b, 3, 32, 32)),
                (f"demo_{mode}", "image", "probabilities",
                 lambda x: demo.run(None, {"image": x})[0], lambda b: (b, 3, 32, 32)),
                (f"scale_{mode}", "x", "y", lambda x: x * 2, lambda b: (b * 1000 + 1,)),
            ]
            for model, in_name, out_name, reference, shape_of in cases:
                worst, checks = 0.0, 0
                for r in range(rounds):
                    x = rng.standard_normal(shape_of(1 + r * 5), dtype=np.float32)
                    with torch.inference_mode():
                        ref = reference(x)
                    worst = max(worst, both_paths(c, model, in_name, out_name, x, ref))
                    checks += 2
                rows.append({"model": model, "checks": checks, "max_abs_err": worst, "ok": True})
                print(f"  ok  {model:14s} {checks} checks, max |err| {worst:.2e}", flush=True)
    return rows


def bandwidth(size: int = 256 * MiB, reps: int = 10) -> dict:
    from shmserve.arena import Arena
    from workers import cuda

    rt = cuda.cudart
    cuda.set_device(0)
    dev = int(cuda.check(rt.cudaMalloc(size), "cudaMalloc"))
    stream = cuda.check(rt.cudaStreamCreate(), "cudaStreamCreate")
    start, stop = (cuda.check(rt.cudaEventCreate(), "cudaEventCreate") for _ in range(2))

    def measure(host: int) -> tuple[float, float]:
        out = []
        for kind in (rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost):
            dst, src = (dev, host) if kind == rt.cudaMemcpyKind.cudaMemcpyHostToDevice else (host, dev)
            times = []
            for _ in range(reps + 2):
                cuda.check(rt.cudaEventRecord(start, stream), "cudaEventRecord")
                cuda.check(rt.cudaMemcpyAsync(dst, src, size, kind, stream), "cudaMemcpyAsync")
                cuda.check(rt.cudaEventRecord(stop, stream), "cudaEventRecord")
                cuda.check(rt.cudaEventSynchronize(stop), "cudaEventSynchronize")
                times.append(cuda.check(rt.cudaEventElapsedTime(start, stop), "cudaEventElapsedTime"))
            out.append(size / (statistics.median(times[2:]) / 1e3) / 1e9)
        return out[0], out[1]

    result = {}
    with Arena.create(f"gpucheck-bw-{os.getpid()}", slot_count=1, max_workers=1,
                      size_classes=[(size, 1)]) as arena:
        with cuda.registered(arena.buf, "bandwidth arena") as reg:
            host = reg.host + arena.geometry.classes[0].offset
            result["registered arena"] = measure(host)
    pinned = int(cuda.check(rt.cudaHostAlloc(size, rt.cudaHostAllocDefault), "cudaHostAlloc"))
    result["cudaHostAlloc"] = measure(pinned)
    cuda.check(rt.cudaFreeHost(pinned), "cudaFreeHost")
    pageable = np.ones(size, np.uint8)
    result["pageable"] = measure(pageable.ctypes.data)
    cuda.check(rt.cudaFree(dev), "cudaFree")
    return {k: {"h2d_GBps": round(v[0], 1), "d2h_GBps": round(v[1], 1)} for k, v in result.items()}


STAGES = (("client -> slot acquired", None, "t_acquired"), ("input received, published", "t_acquired", "t_ready"),
          ("queued -> worker claimed", "t_ready", "t_claimed"), ("worker decode", "t_claimed", "t_compute_start"),
          ("backend (torch + copies)", "t_compute_start", "t_compute_end"),
          ("sync, descriptors, DONE", "t_compute_end", "t_done"), ("DONE -> client has result", "t_done", None))


def stage_breakdown(server: Server, model: str, n: int) -> dict:
    """Where a 4 KiB request over the socket goes (``lanes=False``: through the front-end and an
    arena slot), from the slot's own monotonic timestamps."""
    from shmserve import layout
    from shmserve.arena import Arena

    arena = Arena.attach(server.instance, read_only=True)
    g = arena.geometry
    x = np.random.default_rng(0).standard_normal(1024, dtype=np.float32)
    rows = []
    try:
        with Client(server.socket, timeout=60, lanes=False) as c:
            for i in range(n + 100):
                t0 = time.monotonic_ns()
                c.infer(model, {"x": x})
                t1 = time.monotonic_ns()
                rid = c._core.session.last_request_id
                slot = next(s for s in (layout.SLOT.read(arena.buf, g.slot_off(k)) for k in range(g.slot_count))
                            if s.request_id == rid)
                if i >= 100:
                    stamps = {**slot._asdict(), None: None}
                    rows.append([((stamps[b] if b else t1) - (stamps[a] if a else t0)) / 1e3 for _, a, b in STAGES])
    finally:
        arena.close()
    cols = np.asarray(rows).T
    return {name: round(float(np.median(col)), 1) for (name, _, _), col in zip(STAGES, cols)}


def latency(server: Server, n: int) -> dict:
    import torch

    x = np.random.default_rng(0).standard_normal(1024, dtype=np.float32)  # 4 KiB
    out = {}
    with Client(server.socket, timeout=60) as c:
        for mode in ("mapped", "copy"):
            for path in ("inline", "zero-copy"):
                samples = []
                if path == "inline":
                    for i in range(n + 200):
                        t0 = time.perf_counter_ns()
                        c.infer(f"scale_{mode}", {"x": x})
                        if i >= 200:
                            samples.append((time.perf_counter_ns() - t0) / 1e3)
                else:
                    with c.zero_copy(f"scale_{mode}", {"x": (x.shape, np.float32)}) as call:
                        call.inputs["x"][...] = x
                        for i in range(n + 200):
                            t0 = time.perf_counter_ns()
                            call.run()
                            if i >= 200:
                                samples.append((time.perf_counter_ns() - t0) / 1e3)
                out[f"{mode} {path}"] = {"p50_us": round(pct(samples, 50), 1), "p99_us": round(pct(samples, 99), 1)}
    # the bare model: pinned 4 KiB in, kernel, pinned out, synchronize
    dev = torch.device("cuda:0")
    host_in = torch.from_numpy(x).pin_memory()
    host_out = torch.empty_like(host_in).pin_memory()
    samples = []
    with torch.inference_mode():
        for i in range(n + 200):
            t0 = time.perf_counter_ns()
            y = host_in.to(dev, non_blocking=True) * 2
            host_out.copy_(y, non_blocking=True)
            torch.cuda.synchronize()
            if i >= 200:
                samples.append((time.perf_counter_ns() - t0) / 1e3)
    out["bare model on the GPU (in-process)"] = {"p50_us": round(pct(samples, 50), 1),
                                                  "p99_us": round(pct(samples, 99), 1)}
    return out


def throughput(server: Server, reps: int) -> dict:
    x = np.random.default_rng(1).standard_normal(4 * MiB, dtype=np.float32)  # 16 MiB
    out = {}
    with Client(server.socket, timeout=120) as c:
        for mode in ("mapped", "copy"):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                y = c.infer(f"scale_{mode}", {"x": x})["y"]
                times.append(time.perf_counter() - t0)
            assert np.array_equal(y, x * 2)
            out[f"{mode} inline"] = round(16 * MiB / statistics.median(times) / 1e9, 2)
            times = []
            with c.zero_copy(f"scale_{mode}", {"x": (x.shape, np.float32)}) as call:
                call.inputs["x"][...] = x
                for _ in range(reps):
                    t0 = time.perf_counter()
                    y = call.run()["y"]
                    times.append(time.perf_counter() - t0)
                assert np.array_equal(y, x * 2)
            out[f"{mode} zero-copy"] = round(16 * MiB / statistics.median(times) / 1e9, 2)
    return out


def two_workers(server: Server) -> dict:
    with Client(server.socket) as c:
        info = c.info()
    x = np.zeros((2, 3, 32, 32), np.float32)

    def hammer():
        with Client(server.socket) as c:
            name = next(m["inputs"][0]["name"] for m in c.models() if m["name"] == "conv_mapped")
            for _ in range(40):
                c.infer("conv_mapped", {name: x})

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with Client(server.socket) as c:
        after = c.info()
    workers = [w for w in after["workers"] if w["model"] == "conv_mapped"]
    return {"arena": info["arena"]["name"], "arena_bytes": info["arena"]["size"],
            "workers": [{"pid": w["pid"], "gpu": w["gpu"], "requests": w["requests"]} for w in workers],
            "both_registered": all(w["gpu"] and w["gpu"]["arena_bytes"] == info["arena"]["size"] for w in workers),
            "both_served": all(w["requests"] > 0 for w in workers)}


def sealed_regions(server: Server) -> dict:
    """Zero-copy calls through a lane of each I/O mode: the region's descriptor (kept here, as a
    hostile client would) is sealed and cannot be resized; the GPU worker that served it maps it
    as a memfd of the recorded size; the answers are right (mapped mode reads it on the device)."""
    import fcntl

    from shmserve import client as client_module

    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    kept, real_init = {}, client_module.Region.__init__

    def keep(self, region_id, size, fd, lane=None):
        kept[region_id] = os.dup(fd)
        real_init(self, region_id, size, fd, lane)

    client_module.Region.__init__ = keep
    rows = []
    try:
        with Client(server.socket, timeout=60) as c:
            pids = [w["pid"] for w in c.info()["workers"]]
            for model in ("scale_mapped", "scale_copy"):
                x = np.random.default_rng().standard_normal(4096, dtype=np.float32)
                with c.zero_copy(model, {"x": (x.shape, np.float32)}) as call:
                    call.inputs["x"][...] = x
                    np.testing.assert_allclose(call.run()["y"], x * 2, **TOLERANCE)
                    rid, size = call.region.id, call.region.size
                    fd = kept[rid]
                    refused = []
                    for attack in (0, size * 2):
                        try:
                            os.ftruncate(fd, attack)
                        except PermissionError:
                            refused.append(attack)
                    marker = f"/memfd:shmserve.{server.instance}.r{rid} "
                    mapped = {}
                    for pid in pids:
                        with open(f"/proc/{pid}/maps") as f:
                            for line in f:
                                if marker in line + " ":
                                    lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                                    mapped[pid] = mapped.get(pid, 0) + hi - lo
                rows.append({"model": model, "region": rid, "size": size,
                             "sealed": fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals == seals,
                             "resize_refused": len(refused) == 2, "worker_maps_bytes": sorted(mapped.values()),
                             "in_dev_shm": any(n.startswith(f"shmserve.{server.instance}.r")
                                               for n in os.listdir("/dev/shm"))})
                print(f"  {rows[-1]}", flush=True)
    finally:
        client_module.Region.__init__ = real_init
        for fd in kept.values():
            os.close(fd)
    ok = all(r["sealed"] and r["resize_refused"] and r["size"] in r["worker_maps_bytes"] and not r["in_dev_shm"]
             for r in rows)
    return {"regions": rows, "ok": ok}


# -- multi-GPU placement (issue 16) -----------------------------------------------------------

CONV_SPEC = ('inputs = [{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}]\n'
             'outputs = [{name = "scores", dtype = "float32", shape = ["batch", 10]}]')
SCALE_SPEC = ('inputs = [{name = "x", dtype = "float32", shape = ["n"]}]\n'
              'outputs = [{name = "y", dtype = "float32", shape = ["n"]}]')


def model_block(name: str, path: str, device, spec: str, **extra) -> str:
    """One [[models]] table of the torch backend (``device``: a string or a list)."""
    dev = json.dumps(device)
    lines = [f'[[models]]\nname = "{name}"\nbackend = "torch"\npath = "{path}"\ndevice = {dev}']
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n" + spec + "\n"


def remote_cpus(local: frozenset[int], allowed: frozenset[int], others: list[frozenset[int]]) -> frozenset[int] | None:
    """CPUs that are deliberately remote to a GPU whose local CPUs are ``local``: the first other
    GPU's local CPUs that are not also this one's, else every allowed CPU outside ``local``; None
    when every allowed CPU is local to it (one NUMA node: nothing is remote)."""
    for other in others:
        rest = (other - local) & allowed
        if rest:
            return frozenset(rest)
    return frozenset(allowed - local) or None


def placement_plan(devices: int, allowed: frozenset[int], local_of=placement.gpu_local_cpus) -> dict[int, dict]:
    """Per GPU: its local CPUs as the server will find them (None: unknown, and why), and the
    remote set its remote scale model is pinned to (None: none, and why)."""
    found = {d: local_of(f"cuda:{d}") for d in range(devices)}
    plan = {}
    for d, (local, why) in found.items():
        local = (local & allowed) if local else None
        others = [cpus for e, (cpus, _) in found.items() if e != d and cpus]
        remote = remote_cpus(local, allowed, others) if local else None
        plan[d] = {"local": placement.format_cpulist(local) if local else None, "local_why": why,
                   "remote": placement.format_cpulist(remote) if remote else None,
                   "remote_why": "" if remote else ("its local CPUs are unknown" if not local
                                                     else "every CPU the server may use is local to it")}
    return plan


def multi_gpu_config(instance: str, paths: dict, plan: dict[int, dict]) -> str:
    """Two GPU models (cuda:0, cuda:1), one spread over both (instances = 4), and per GPU a scale
    model on its local CPUs (the default) and, where some exist, one on remote CPUs."""
    blocks = [f'[server]\ninstance = "{instance}"\nrequest_timeout_s = 60\nmax_request_bytes = {80 * MiB}\n',
              model_block("conv0", paths["torchscript"], "cuda:0", CONV_SPEC),
              model_block("conv1", paths["torchscript"], "cuda:1", CONV_SPEC),
              model_block("spread", paths["scale"], ["cuda:0", "cuda:1"], SCALE_SPEC, instances=4)]
    for d, p in sorted(plan.items()):
        blocks.append(model_block(f"scale_local_{d}", paths["scale"], f"cuda:{d}", SCALE_SPEC))
        if p["remote"]:
            blocks.append(model_block(f"scale_remote_{d}", paths["scale"], f"cuda:{d}", SCALE_SPEC, cpus=p["remote"]))
    return "\n".join(blocks)


def kernel_cpus(pid: int) -> str | None:
    """A process's Cpus_allowed_list as the kernel says (canonical form); None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
    except (OSError, StopIteration):
        return None
    return placement.format_cpulist(placement.parse_cpulist(line.partition(":")[2]))


def worker_rows(info: dict) -> list[dict]:
    """Per worker: model, device (info's, and the one it registered: gpu.device), its CPUs (info's
    and the kernel's) and why, requests served."""
    rows = []
    for w in info["workers"]:
        rows.append({"index": w["index"], "model": w["model"], "device": w["device"],
                     "registered_device": (w.get("gpu") or {}).get("device"), "pid": w["pid"],
                     "cpus": w.get("cpus"), "kernel_cpus": kernel_cpus(w["pid"]) if w["pid"] else None,
                     "cpus_from": w.get("cpus_from"), "requests": w["requests"]})
    return rows


def placement_problems(rows: list[dict], plan: dict[int, dict]) -> list[str]:
    """What is wrong with where the workers run (empty: all as configured)."""
    problems = []
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
        if r["cpus"] != r["kernel_cpus"]:
            problems.append(f"worker {r['index']} ({r['model']}): info says CPUs {r['cpus']}, "
                            f"the kernel {r['kernel_cpus']}")
        if r["device"] != "cpu" and r["registered_device"] != int(r["device"].partition(":")[2]):
            problems.append(f"worker {r['index']} ({r['model']}): info says {r['device']}, it registered "
                            f"on device {r['registered_device']}")
        d = int(r["device"].partition(":")[2]) if r["device"].startswith("cuda:") else None
        if d in plan:
            want = plan[d]["remote"] if r["model"].startswith("scale_remote_") else plan[d]["local"]
            if want is not None and r["kernel_cpus"] != want:
                problems.append(f"worker {r['index']} ({r['model']} on {r['device']}): CPUs {r['kernel_cpus']}, "
                                f"expected {want}")
    for name, device in (("conv0", "cuda:0"), ("conv1", "cuda:1")):
        if [r["device"] for r in by_model.get(name, [])] != [device]:
            problems.append(f"{name}: workers on {[r['device'] for r in by_model.get(name, [])]}, expected [{device!r}]")
    spread = sorted(r["device"] for r in by_model.get("spread", []))
    if spread != ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]:
        problems.append(f"spread: workers on {spread}, expected two on cuda:0 and two on cuda:1")
    return problems


def concurrent_clients(socket_path: str, cases: list[tuple], clients: int = 8, rounds: int = 3) -> dict:
    """``clients`` threads, each with its own Client, all released together: every round, every
    case (model, input name, output name, reference(x) -> y, shape(round) -> input shape) once
    inline and once through a lane (its output area poisoned with NaN first), each answer
    compared with the reference.  Failures are collected, never raised."""
    barrier = threading.Barrier(clients)
    results = [None] * clients

    def run(k: int) -> None:
        rng = np.random.default_rng(1000 + k)
        checks, worst, failures = 0, 0.0, []
        try:
            with Client(socket_path, timeout=120) as c:
                barrier.wait(120)
                for r in range(rounds):
                    for model, in_name, out_name, reference, shape_of in cases:
                        x = rng.standard_normal(shape_of(r), dtype=np.float32)
                        ref = reference(x)
                        try:
                            worst = max(worst, both_paths(c, model, in_name, out_name, x, ref))
                            checks += 2
                        except Exception as exc:  # noqa: BLE001 - reported, the others go on
                            failures.append(f"client {k} {model} round {r}: {type(exc).__name__}: {str(exc)[:300]}")
        except Exception as exc:  # noqa: BLE001
            failures.append(f"client {k}: {type(exc).__name__}: {str(exc)[:300]}")
        results[k] = (checks, worst, failures)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    done = [r for r in results if r is not None]
    failures = [f for r in done for f in r[2]] + [f"client {k}: did not finish" for k, r in enumerate(results)
                                                  if r is None]
    return {"clients": clients, "rounds": rounds, "checks": sum(r[0] for r in done),
            "max_abs_err": max((r[1] for r in done), default=0.0), "failures": failures[:20],
            "ok": not failures and sum(r[0] for r in done) == clients * rounds * len(cases) * 2}


def measure_pinned(socket_path: str, model: str, cpus: str | None, n: int, reps: int) -> dict:
    """From a thread pinned to ``cpus`` (the worker's; None: unpinned): a 4 KiB round trip of
    ``model`` (y = 2x), p50 and p99 in us, inline and through a lane, and 16 MiB GB/s both ways."""
    out: dict = {}
    error: list[BaseException] = []

    def run() -> None:
        try:
            if cpus:
                os.sched_setaffinity(0, placement.parse_cpulist(cpus))  # this thread only
            small = np.random.default_rng(0).standard_normal(1024, dtype=np.float32)  # 4 KiB
            big = np.random.default_rng(1).standard_normal(4 * MiB, dtype=np.float32)  # 16 MiB
            warm = max(20, n // 10)
            with Client(socket_path, timeout=120) as c:
                for name, x, count in (("4KiB", small, n), ("16MiB", big, reps)):
                    inline = []
                    for i in range(count + (warm if name == "4KiB" else 1)):
                        t0 = time.perf_counter_ns()
                        y = c.infer(model, {"x": x})["y"]
                        inline.append((time.perf_counter_ns() - t0) / 1e3)
                    assert np.array_equal(y, x * 2), f"{model}: wrong inline answer"
                    lane = []
                    with c.zero_copy(model, {"x": (x.shape, np.float32)}) as call:
                        call.inputs["x"][...] = x
                        for i in range(count + (warm if name == "4KiB" else 1)):
                            t0 = time.perf_counter_ns()
                            y = call.run()["y"]
                            lane.append((time.perf_counter_ns() - t0) / 1e3)
                        assert np.array_equal(y, x * 2), f"{model}: wrong lane answer"
                    skip = warm if name == "4KiB" else 1
                    for path, samples in (("inline", inline[skip:]), ("lane", lane[skip:])):
                        if name == "4KiB":
                            out[f"4KiB {path} p50_us"] = round(pct(samples, 50), 1)
                            out[f"4KiB {path} p99_us"] = round(pct(samples, 99), 1)
                        else:
                            out[f"16MiB {path} GBps"] = round(16 * MiB / (statistics.median(samples) / 1e6) / 1e9, 2)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            error.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(900)
    if error:
        raise error[0]
    return {"model": model, "client_cpus": cpus, **out}


def build_multi_models(directory: Path) -> dict:
    import torch

    from shmserve.models.torchnets import save_models

    paths = save_models(directory)

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    paths["scale"] = str(directory / "scale.pt")
    torch.jit.script(Scale()).save(paths["scale"])
    return paths


def multi_gpu_main(args) -> int:
    import torch

    from shmserve.models.torchnets import convnet

    count = torch.cuda.device_count()
    if count < 2:
        print(f"--multi-gpu needs two GPUs; torch sees {count}", file=sys.stderr)
        return 2
    allowed = placement.allowed_cpus()
    plan = placement_plan(2, allowed)
    report = {"date": time.strftime("%Y-%m-%d"), "gpus": [torch.cuda.get_device_name(d) for d in range(count)],
              "torch": torch.__version__, "python": sys.version.split()[0],
              "allowed_cpus": placement.format_cpulist(allowed), "plan": plan,
              "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}}
    gpus = placement.nvidia_gpus()
    report["bus_ids"] = {}
    for d in range(2):
        props = torch.cuda.get_device_properties(d)
        mine, _ = placement.cuda_gpu(d, gpus, os.environ)
        theirs = (f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                  if hasattr(props, "pci_bus_id") else None)
        report["bus_ids"][d] = {"sysfs": mine.bus_id if mine else None, "torch": theirs}
    print(f"GPUs: {report['gpus']}  torch {report['torch']}  CPUs allowed {report['allowed_cpus']}", flush=True)
    for d, p in plan.items():
        print(f"  cuda:{d}: bus {report['bus_ids'][d]}  local CPUs {p['local']} ({p['local_why']})  "
              f"remote {p['remote'] or '-'} {p['remote_why']}", flush=True)
    problems = [f"cuda:{d}: /sys says {b['sysfs']}, torch {b['torch']}" for d, b in report["bus_ids"].items()
                if b["torch"] and b["sysfs"] != b["torch"]]
    conv = convnet()

    def conv_ref(x):
        with torch.inference_mode():
            return conv(torch.from_numpy(x)).numpy()

    rounds, n, reps = (2, 300, 5) if args.quick else (4, 2000, 20)
    with tempfile.TemporaryDirectory(prefix="gpucheck-multi-") as tmp:
        workdir = Path(tmp)
        paths = build_multi_models(workdir)
        server = Server(workdir, paths, lambda instance, p: multi_gpu_config(instance, p, plan))
        try:
            cases = [("conv0", "image", "scores", conv_ref, lambda r: (1 + r, 3, 32, 32)),
                     ("conv1", "image", "scores", conv_ref, lambda r: (1 + r, 3, 32, 32)),
                     ("spread", "x", "y", lambda x: x * 2, lambda r: (1000 * r + 1,))]
            print("8 concurrent clients, inline and through lanes:", flush=True)
            report["concurrent"] = concurrent_clients(server.socket, cases, clients=8, rounds=rounds)
            print(f"  {report['concurrent']}", flush=True)
            with Client(server.socket) as c:
                rows = worker_rows(c.info())
            report["workers"] = rows
            print("\n| # | model | device | registered | CPUs (info) | CPUs (kernel) | why | requests |\n"
                  "| ---: | --- | --- | ---: | --- | --- | --- | ---: |")
            for r in rows:
                print(f"| {r['index']} | {r['model']} | {r['device']} | {r['registered_device']} | {r['cpus']} | "
                      f"{r['kernel_cpus']} | {r['cpus_from']} | {r['requests']} |")
            problems += placement_problems(rows, plan)
            if any(r["requests"] == 0 for r in rows if r["model"] == "spread"):
                problems.append("spread: a worker served nothing under 8 concurrent clients")
            report["timing"] = {}
            by_model = {r["model"]: r for r in rows}
            for d in range(2):
                for kind in ("local", "remote"):
                    model = f"scale_{kind}_{d}"
                    if model not in by_model:
                        continue
                    print(f"timing {model} (CPUs {by_model[model]['kernel_cpus']})...", flush=True)
                    report["timing"][model] = measure_pinned(server.socket, model, by_model[model]["kernel_cpus"],
                                                             n, reps)
        finally:
            report["server_exit"] = server.stop()
            report["server_log_tail"] = (workdir / "server.log").read_text(errors="replace")[-3000:]
    timing = report["timing"]
    if timing:
        keys = [k for k in next(iter(timing.values())) if k not in ("model", "client_cpus")]
        print("\n| model | CPUs | " + " | ".join(keys) + " |\n| --- | --- |" + " ---: |" * len(keys))
        for model, t in timing.items():
            print(f"| {model} | {t['client_cpus']} | " + " | ".join(str(t.get(k, "")) for k in keys) + " |")
    report["problems"] = problems
    ok = report["concurrent"]["ok"] and not problems and report["server_exit"] == 0
    report["ok"] = ok
    Path(args.json_out).write_text(json.dumps(report, indent=2, default=str))
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"\n{'PASS' if ok else 'FAIL'}; JSON in {args.json_out}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", metavar="FILE", help="write the report here",
                        default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--multi-gpu", action="store_true",
                        help="placement over two GPUs: devices, local and remote CPUs (needs 2 GPUs)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError as exc:  # a checkout's make serve installs no torch: say what the tool needs
        print(f"gpu_check: {exc}: it needs torch with CUDA, cuda-python, onnx and onnxruntime "
              "(pip install -e '.[torch,gpu,onnx]', on a machine with an NVIDIA GPU)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    if args.multi_gpu:
        if args.json_out.endswith("gpu_check.json"):
            args.json_out = args.json_out[:-len("gpu_check.json")] + "gpu_check_multi.json"
        return multi_gpu_main(args)
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "python": sys.version.split()[0]}
    print(f"GPU: {report['gpu']}  torch {report['torch']}", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        workdir = Path(tmp)
        paths = build_models(workdir)
        server = Server(workdir, paths)
        try:
            print("correctness (inline and zero-copy, random inputs, poisoned outputs):", flush=True)
            try:
                report["correctness"] = correctness(server, 2 if args.quick else 4)
            except AssertionError as exc:
                ok = False
                report["correctness_failure"] = str(exc)[:2000]
                print(f"  FAILED: {exc}", flush=True)
            print("sealed client regions on GPU workers:", flush=True)
            report["sealed_regions"] = sealed_regions(server)
            report["two_workers_one_gpu"] = two_workers(server)
            print(f"two workers on one GPU: {report['two_workers_one_gpu']}", flush=True)
            report["latency_4KiB"] = latency(server, 300 if args.quick else 2000)
            report["stages_4KiB_p50_us"] = {m: stage_breakdown(server, m, 300 if args.quick else 1000)
                                            for m in ("scale_mapped", "scale_copy")}
            report["throughput_16MiB_GBps"] = throughput(server, 5 if args.quick else 20)
        finally:
            report["server_exit"] = server.stop()
            report["server_log_tail"] = (workdir / "server.log").read_text(errors="replace")[-3000:]
    report["bandwidth_256MiB"] = bandwidth(reps=3 if args.quick else 10)
    bw = report["bandwidth_256MiB"]
    ratio = {d: round(bw["registered arena"][f"{d}_GBps"] / bw["cudaHostAlloc"][f"{d}_GBps"], 3) for d in ("h2d", "d2h")}
    report["arena_vs_cudaHostAlloc"] = ratio
    lat = report["latency_4KiB"]
    bare = lat["bare model on the GPU (in-process)"]["p50_us"]
    report["server_overhead_p50_us"] = {k: round(v["p50_us"] - bare, 1) for k, v in lat.items() if "bare" not in k}

    print("\n| bandwidth, 256 MiB | H2D GB/s | D2H GB/s |\n| --- | ---: | ---: |")
    for k, v in bw.items():
        print(f"| {k} | {v['h2d_GBps']} | {v['d2h_GBps']} |")
    print(f"\nregistered arena / cudaHostAlloc: H2D {ratio['h2d']:.1%}, D2H {ratio['d2h']:.1%} (goal >= 95%)")
    print("\n| 4 KiB request | p50 µs | p99 µs | overhead vs bare p50 µs |\n| --- | ---: | ---: | ---: |")
    for k, v in lat.items():
        over = report["server_overhead_p50_us"].get(k, "")
        print(f"| {k} | {v['p50_us']} | {v['p99_us']} | {over} |")
    stages = report["stages_4KiB_p50_us"]
    print("\n| 4 KiB inline, stage p50 µs | " + " | ".join(stages) + " |\n| --- |" + " ---: |" * len(stages))
    for name, _, _ in STAGES:
        print(f"| {name} | " + " | ".join(str(stages[m][name]) for m in stages) + " |")
    print("\n| 16 MiB request | GB/s |\n| --- | ---: |")
    for k, v in report["throughput_16MiB_GBps"].items():
        print(f"| {k} | {v} |")
    ok = ok and report["server_exit"] == 0 and report["sealed_regions"]["ok"] \
        and report["two_workers_one_gpu"]["both_registered"] \
        and report["two_workers_one_gpu"]["both_served"]
    report["ok"] = ok
    Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(f"\n{'PASS' if ok else 'FAIL'}; JSON in {args.json_out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
