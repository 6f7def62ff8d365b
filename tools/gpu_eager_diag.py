#!/usr/bin/env python3
"""Where an eager torch GPU call served through a lane loses time against the bare call (issue 26).

docs/gpu.md found resnet50 on cuda:0, eager, copy mode, through a lane +362 us over the bare eager
call in-process, while the graph lane was ~100 us over the bare replay.  This separates the parts,
every comparison on one CPU so that the VM's vCPUs, which run the same launch-bound call at
different speeds, fall alike on both sides:

  vCPUs       the bare eager call pinned to each CPU in turn (two passes)
  in-process  on one CPU: the bare eager call, the torch backend's run_into (this checkout's), and
              the one before (``--before FILE``: a copy of workers/backends/torch.py to compare)
  served      the eager model's worker pinned to CPU 4 (``cpus = "4"``), the graphs model's to 5,
              this client on 8; the bare call on CPU 4 interleaved with the lanes, each lane with
              and without its nap before spinning (``ClientLane.nap``); then blocks of each lane
              with the worker's stage histograms read before and after (decode, the backend's
              call, sync and publish)

usage: python tools/gpu_eager_diag.py [--rounds 10] [--per-round 20] [--before FILE] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

SEED = 20261202


def p50(values) -> float:
    return statistics.median(values) * 1e6


def pinned_rounds(cases: dict, rounds: int, per_round: int, seed: int, warm: int = 5) -> dict[str, list[float]]:
    """``shmserve.bench.interleaved`` with ``cases`` as name -> (cpu, callable): each case's calls on
    its CPU."""
    from shmserve.bench import interleaved

    return interleaved({k: f for k, (_, f) in cases.items()}, rounds, per_round, seed, warm=warm,
                       cpus={k: cpu for k, (cpu, _) in cases.items()})


def load_backend(path: str):
    """The TorchBackend class of a copy of workers/backends/torch.py (the one before a change)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_backend_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TorchBackend


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--before", help="a copy of workers/backends/torch.py to compare with this checkout's")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import torch
    import torchvision

    from shmserve import Client, layout
    from shmserve.arena import Arena
    from shmserve.bench import serve_config, wait_models_ready
    from shmserve.config import ModelConfig
    from shmserve.spec import TensorSpec
    from workers.adapter import BackendAdapter

    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nproc": os.cpu_count(),
                    "torch": torch.__version__}
    dev = torch.device("cuda:0")
    torch.manual_seed(SEED)
    x = np.random.default_rng(SEED).standard_normal((1, 3, 224, 224), dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="eager-diag-") as tmp:
        workdir = Path(tmp)
        path = workdir / "resnet50.pt"
        with torch.no_grad():
            net = torchvision.models.resnet50(weights=None).eval().to(dev)
            torch.jit.trace(net, torch.from_numpy(np.repeat(x, 2, 0)).to(dev)).save(str(path))
        module = torch.jit.load(str(path), map_location=dev).eval()
        x_host = torch.from_numpy(x).pin_memory()
        y_host = torch.empty(1, 1000).pin_memory()
        stream = torch.cuda.Stream(dev)
        with torch.inference_mode():
            static_in = x_host.to(dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(3):
                    module(static_in)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = module(static_in)

        def bare():
            with torch.inference_mode(), torch.cuda.stream(stream):
                y_host.copy_(module(x_host.to(dev, non_blocking=True)), non_blocking=True)
            stream.synchronize()

        def bare_graph():
            with torch.inference_mode(), torch.cuda.stream(stream):
                static_in.copy_(x_host, non_blocking=True)
                graph.replay()
                y_host.copy_(static_out, non_blocking=True)
            stream.synchronize()

        # 1. the vCPUs: the same call pinned to each
        per_cpu: dict[int, list[float]] = {}
        for _ in range(2):
            got = pinned_rounds({str(c): (c, bare) for c in sorted(os.sched_getaffinity(0))}, 1, 20, SEED, warm=3)
            for k, v in got.items():
                per_cpu.setdefault(int(k), []).extend(v)
        report["bare_eager_p50_us_by_cpu"] = {c: round(p50(v), 1) for c, v in per_cpu.items()}
        print("bare eager p50 us by CPU:", json.dumps(report["bare_eager_p50_us_by_cpu"]), flush=True)

        # 2. in-process on one CPU: the backend's run_into (now, and before) against the bare call
        spec_in = TensorSpec("image", "float32", ("batch", 3, 224, 224))
        spec_out = TensorSpec("scores", "float32", ("batch", 1000))
        config = ModelConfig(name="eager", backend="torch", path=str(path), device="cuda:0", io_mode="copy",
                             inputs=(spec_in,), outputs=(spec_out,), options={"cuda_graphs": False})
        backends = {"now": BackendAdapter.load(config)}
        if args.before:
            backends["before"] = BackendAdapter(load_backend(args.before)(config))
        x_ro = x_host.numpy().view()
        x_ro.flags.writeable = False  # as the worker's views of a request are
        y_np = y_host.numpy()
        cases = {"bare eager": (4, bare)}
        for name, adapter in backends.items():
            adapter.warm_up(config, adapter.prepare(config))
            cases[f"backend run_into + synchronize, {name}"] = (4, (lambda a: lambda: (
                a.run_into({"image": x_ro}, lambda n, s, d: y_np), a.synchronize()))(adapter))
        got = pinned_rounds(cases, args.rounds, args.per_round, SEED)
        report["in_process_cpu4_p50_us"] = {k: round(p50(v), 1) for k, v in got.items()}
        print("in-process, CPU 4:", json.dumps(report["in_process_cpu4_p50_us"], indent=1), flush=True)
        torch.cuda.set_stream(torch.cuda.default_stream(dev))  # the backend left its stream current here

        bare()
        reference = y_host.numpy().copy()
        # 3. served: the eager worker on CPU 4, the graphs worker on CPU 5, this client on CPU 8
        instance = f"diag-{uuid.uuid4().hex[:8]}"
        models = "".join(f"""
[[models]]
name = "{name}"
backend = "torch"
path = "{path}"
device = "cuda:0"
io_mode = "copy"
cpus = "{cpu}"
inputs = [{{name = "image", dtype = "float32", shape = ["batch", 3, 224, 224]}}]
outputs = [{{name = "scores", dtype = "float32", shape = ["batch", 1000]}}]
[models.options]
cuda_graphs = {flag}
""" for name, flag, cpu in (("eager", "false", 4), ("graphs", "true", 5)))
        cfg = workdir / "diag.toml"
        cfg.write_text(f'[server]\ninstance = "{instance}"\nrequest_timeout_s = 60\n' + models)
        sock = str(workdir / "diag.sock")
        proc = serve_config(cfg, sock)
        try:
            with Client(sock) as c:
                wait_models_ready(c, 180)
                calls = {}
                for name in ("eager", "graphs"):
                    call = c.zero_copy(name, {"image": (x.shape, np.float32)})
                    call.inputs["image"][...] = x
                    np.testing.assert_allclose(call.run()["scores"], reference, rtol=1e-3, atol=1e-3)
                    calls[name] = call

                def no_nap(call):
                    lane = call.region.lane

                    def go():
                        lane.nap = lambda spin: 0.0
                        try:
                            call.run()
                        finally:
                            del lane.nap
                    return go

                cases = {"bare eager (CPU 4)": (4, bare), "bare graph replay (CPU 5)": (5, bare_graph),
                         "lane eager": (8, calls["eager"].run), "lane eager, no nap": (8, no_nap(calls["eager"])),
                         "lane graphs": (8, calls["graphs"].run), "lane graphs, no nap": (8, no_nap(calls["graphs"]))}
                served = pinned_rounds(cases, args.rounds, args.per_round, SEED, warm=10)
                report["served_p50_us"] = {k: round(p50(v), 1) for k, v in served.items()}
                report["served_p90_us"] = {k: round(float(np.percentile(v, 90)) * 1e6, 1) for k, v in served.items()}
                print("served:", json.dumps(report["served_p50_us"], indent=1), flush=True)
                arena = Arena.attach(instance, read_only=True)
                g = arena.geometry
                workers = {}
                for i in range(g.max_workers):
                    w = layout.WORKER.read(arena.buf, g.worker_off(i))
                    if w.pid:
                        workers.setdefault(w.name.rstrip(b"\0").decode(errors="replace"), []).append(i)
                blocks = {}
                os.sched_setaffinity(0, {8})
                for name, call in calls.items():
                    idx = workers.get(name, [])
                    stages = ("copy_in", "compute", "copy_out")
                    before = {s: layout.read_histograms(arena.buf, g, idx, s) for s in stages}
                    t0 = time.perf_counter()
                    for _ in range(args.block):
                        call.run()
                    row = {"mean_call_us": round((time.perf_counter() - t0) / args.block * 1e6, 1)}
                    after = {s: layout.read_histograms(arena.buf, g, idx, s) for s in stages}
                    for s in stages:
                        n = sum(after[s][0]) - sum(before[s][0])
                        row[f"{s}_mean_us"] = round((after[s][1] - before[s][1]) / max(n, 1), 1)
                    blocks[name] = row
                os.sched_setaffinity(0, set(range(os.cpu_count())))
                report["worker_stages"] = blocks
                print("worker stages (decode, backend call, sync + publish):", json.dumps(blocks), flush=True)
                arena.close()
                for call in calls.values():
                    call.release()
        finally:
            proc.terminate()
            proc.wait(60)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
