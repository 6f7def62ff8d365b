#!/usr/bin/env python3
"""CUDA graphs for a small torch GPU model: bare eager vs graph replay in-process vs through a lane.

Issue 14 part 3's target: "GPU, 4 KiB small model through a lane, copy mode:
<= 60 us above the bare model's eager call in-process; with CUDA graphs,
faster than that eager call".  The model is a 4-layer MLP (1024 -> 1024,
ReLU; float32[batch, 1024] in and out: 4 KiB a row), TorchScript, batch 1.
Cases, interleaved in rounds (each round runs every case ``--per-round``
times, in a shuffled order) so the machine's noise falls on all alike:

  bare eager          in this process: page-locked input -> H2D -> forward -> D2H -> page-locked output, sync
  bare graph          the same with the forward captured once (torch.cuda.CUDAGraph) and replayed
  forward only        eager forward on a device-resident input, sync (no copies)
  adapter, eager|graphs   the real torch backend (workers.adapter) in this process, views of page-locked memory
  lane, eager|graphs      Client.zero_copy through a real server, io_mode copy, cuda_graphs false|true

usage: python tools/bench_cuda_graphs.py [--rounds N] [--per-round K] [--json-out FILE]
Prints a Markdown table of p50/p90 in microseconds and each p50 minus bare eager's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

WIDTH, LAYERS, SEED = 1024, 4, 20261202


def build(path: Path):
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers).eval()
    torch.jit.trace(model, torch.zeros(2, WIDTH)).save(str(path))
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import torch

    from shmserve import Client
    from shmserve.bench import interleaved, serve_config, wait_models_ready
    from shmserve.config import ModelConfig
    from shmserve.spec import TensorSpec
    from workers.adapter import BackendAdapter

    dev = torch.device("cuda:0")
    spec_in, spec_out = TensorSpec("x", "float32", ("batch", WIDTH)), TensorSpec("output0", "float32", ("batch", WIDTH))
    with tempfile.TemporaryDirectory(prefix="bench-graphs-") as tmp:
        workdir = Path(tmp)
        path = workdir / "mlp.pt"
        build(path)
        module = torch.jit.load(str(path), map_location=dev).eval()
        stream = torch.cuda.Stream(dev)
        x_host = torch.empty(1, WIDTH).pin_memory()
        x_host.copy_(torch.from_numpy(np.random.default_rng(SEED).standard_normal((1, WIDTH), dtype=np.float32)))
        y_host = torch.empty(1, WIDTH).pin_memory()
        x_dev = x_host.to(dev)
        with torch.inference_mode():
            reference = module(x_dev).cpu().numpy()
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

        def bare_eager():
            with torch.inference_mode(), torch.cuda.stream(stream):
                y_host.copy_(module(x_host.to(dev, non_blocking=True)), non_blocking=True)
            stream.synchronize()

        def bare_graph():
            with torch.inference_mode(), torch.cuda.stream(stream):
                static_in.copy_(x_host, non_blocking=True)
                graph.replay()
                y_host.copy_(static_out, non_blocking=True)
            stream.synchronize()

        def forward_only():
            with torch.inference_mode(), torch.cuda.stream(stream):
                module(x_dev)
            stream.synchronize()

        adapters = {}
        x_np, y_np = x_host.numpy(), y_host.numpy()
        for name, flag in (("eager", False), ("graphs", True)):
            config = ModelConfig(name=name, backend="torch", path=str(path), device="cuda:0", io_mode="copy",
                                 inputs=(spec_in,), outputs=(spec_out,), options={"cuda_graphs": flag})
            adapter = BackendAdapter.load(config)
            adapter.warm_up(config, adapter.prepare(config))
            adapters[name] = adapter

        def via_adapter(adapter):
            def go():
                adapter.run_into({"x": x_np}, lambda name, shape, dtype: y_np)
                adapter.synchronize()
            return go

        models = "".join(f"""
[[models]]
name = "{name}"
backend = "torch"
path = "{path}"
device = "cuda:0"
io_mode = "copy"
inputs = [{{name = "x", dtype = "float32", shape = ["batch", {WIDTH}]}}]
outputs = [{{name = "output0", dtype = "float32", shape = ["batch", {WIDTH}]}}]
[models.options]
cuda_graphs = {flag}
""" for name, flag in (("eager", "false"), ("graphs", "true")))
        cfg = workdir / "graphs.toml"
        cfg.write_text(f'[server]\ninstance = "benchgraphs-{uuid.uuid4().hex[:8]}"\n' + models)
        proc = serve_config(cfg, str(workdir / "graphs.sock"))
        try:
            with Client(str(workdir / "graphs.sock")) as c:
                wait_models_ready(c, 180)
                calls = {}
                for name in ("eager", "graphs"):
                    call = c.zero_copy(name, {"x": ((1, WIDTH), np.float32)})
                    call.inputs["x"][...] = x_np
                    got = call.run()["output0"]
                    calls[name] = call
                    print(f"lane {name}: max |diff| vs in-process eager {np.abs(got - reference).max():.3g}")
                same = calls["eager"].run()["output0"].tobytes() == calls["graphs"].run()["output0"].tobytes()
                print(f"graph and eager lanes bit for bit identical: {same}")
                cases = {
                    "bare eager (H2D, forward, D2H, sync)": bare_eager,
                    "bare graph replay (H2D, replay, D2H, sync)": bare_graph,
                    "forward only, eager (device input, sync)": forward_only,
                    "adapter, eager": via_adapter(adapters["eager"]),
                    "adapter, graphs": via_adapter(adapters["graphs"]),
                    "lane, copy mode, eager": calls["eager"].run,
                    "lane, copy mode, graphs": calls["graphs"].run,
                }
                samples = interleaved(cases, args.rounds, args.per_round, SEED, warm=50)
                for call in calls.values():
                    call.release()
        finally:
            proc.terminate()
            proc.wait(60)
    p50 = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    base = p50["bare eager (H2D, forward, D2H, sync)"]
    print(f"\n{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {args.rounds} rounds x {args.per_round}\n")
    print("| case | p50 µs | p90 µs | p50 − bare eager µs |")
    print("| --- | ---: | ---: | ---: |")
    rows = []
    for key, values in samples.items():
        p90 = float(np.percentile(values, 90)) * 1e6
        rows.append({"case": key, "p50_us": p50[key], "p90_us": p90, "n": len(values)})
        print(f"| {key} | {p50[key]:.1f} | {p90:.1f} | {p50[key] - base:+.1f} |")
    print(f"\ngraph pool bytes (adapter): {adapters['graphs'].backend.graph_pool_bytes}; "
          f"runs: {adapters['graphs'].backend.runs}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "rounds": args.rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
