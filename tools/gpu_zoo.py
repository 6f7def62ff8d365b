#!/usr/bin/env python3
"""Real models on the GPU (issue 26 item 4): resnet50 and a BERT-base-sized encoder, random weights.

For each model, saved as TorchScript (traced) and served by a real server on ``--device`` in
copy mode in three configurations: ``eager`` (no batching, cuda_graphs false), ``graphs`` (no
batching, cuda_graphs true) and ``batched`` (cuda_graphs true, max_batch_size 16):

  correctness   each configuration's answer to the same inputs against the model run on the CPU
                in this process (max |diff| / max |reference|: TF32 convolutions on the GPU)
  latency       one request at a time, interleaved in rounds with the bare model in this process:
                bare eager (page-locked input -> H2D -> forward -> D2H -> sync), bare graph replay,
                and through a lane (Client.zero_copy) to the eager and the graphs configuration;
                p50 and p90 in us, and each lane p50 minus bare eager's (target: eager lane <= +30 us,
                graphs lane below bare eager)
  throughput    16 client processes, batch 1 each, on the batched configuration for --seconds, in
                items/s, against the bare model in this process at batch 8 and 16 (target >= 90 %)

usage: python tools/gpu_zoo.py [--device cuda:0] [--models resnet50,bert] [--rounds 10] [--per-round 20]
                               [--seconds 8] [--json-out FILE] [--small]
--small: a tiny encoder and a resnet18 at 64x64, to try the script out on a CPU.
Prints Markdown tables; --json-out writes every number.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

SEED = 20261202
CLIENTS = 16


class Zoo:
    """One model: its TorchScript file, its inputs (batch 1 and batch n), its spec lines, its CPU
    reference."""

    def __init__(self, name: str, module, example: dict, spec: str, output: str):
        self.name, self.module, self.example, self.spec, self.output = name, module, example, spec, output

    def batch(self, n: int) -> dict:
        return {k: np.repeat(v, n, axis=0) for k, v in self.example.items()}


def build(name: str, small: bool, directory: Path, device: str) -> Zoo:
    """The model (on the CPU: the reference), traced on ``device`` (a trace keeps the device of the
    tensors it makes inside, as BERT's position ids: traced on the CPU it fails on a GPU)."""
    import copy

    import torch

    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    if name == "resnet50":
        import torchvision

        side = 64 if small else 224
        module = (torchvision.models.resnet18 if small else torchvision.models.resnet50)(weights=None).eval()
        example = {"image": rng.standard_normal((1, 3, side, side), dtype=np.float32)}
        spec = (f'inputs = [{{name = "image", dtype = "float32", shape = ["batch", 3, {side}, {side}]}}]\n'
                f'outputs = [{{name = "scores", dtype = "float32", shape = ["batch", 1000]}}]\n')
        with torch.no_grad():
            traced = torch.jit.trace(copy.deepcopy(module).to(device),
                                     torch.from_numpy(np.repeat(example["image"], 2, 0)).to(device))
        output = "scores"
    elif name == "bert":
        from transformers import BertConfig, BertModel

        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) \
            if small else BertConfig()  # BERT-base: 12 layers, 768 hidden, 12 heads
        seq = 32 if small else 128

        class Encoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bert = BertModel(config, add_pooling_layer=False).eval()

            def forward(self, input_ids, attention_mask):
                return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

        module = Encoder().eval()
        ids = rng.integers(1, config.vocab_size, (1, seq), dtype=np.int64)
        mask = np.ones((1, seq), np.int64)
        mask[0, seq * 3 // 4:] = 0  # padding at the end, as a tokenizer's batch has
        example = {"input_ids": ids, "attention_mask": mask}
        spec = (f'inputs = [{{name = "input_ids", dtype = "int64", shape = ["batch", {seq}]}}, '
                f'{{name = "attention_mask", dtype = "int64", shape = ["batch", {seq}]}}]\n'
                f'outputs = [{{name = "hidden", dtype = "float32", shape = ["batch", {seq}, {config.hidden_size}]}}]\n')
        with torch.no_grad():
            traced = torch.jit.trace(copy.deepcopy(module).to(device),
                                     (torch.from_numpy(np.repeat(ids, 2, 0)).to(device),
                                      torch.from_numpy(np.repeat(mask, 2, 0)).to(device)), strict=False)
        output = "hidden"
    else:
        raise SystemExit(f"no model {name!r} (resnet50, bert)")
    path = directory / f"{name}.pt"
    traced.save(str(path))
    zoo = Zoo(name, module, example, spec, output)
    zoo.path = path
    return zoo


def config_text(zoos: list[Zoo], device: str, instance: str) -> str:
    text = f'[server]\ninstance = "{instance}"\nrequest_timeout_s = 120\n'
    for z in zoos:
        for kind, graphs, batching in (("eager", "false", ""), ("graphs", "true", ""),
                                       ("batched", "true", "max_batch_size = 16\nmax_queue_delay_us = 2000\n"
                                                           "preferred_batch_sizes = [8, 16]\n")):
            text += (f'\n[[models]]\nname = "{z.name}_{kind}"\nbackend = "torch"\npath = "{z.path}"\n'
                     f'device = "{device}"\nio_mode = "copy"\n{batching}{z.spec}[models.options]\ncuda_graphs = {graphs}\n')
    return text


def reference(z: Zoo, inputs: dict) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = z.module(*[torch.from_numpy(inputs[k]) for k in z.example])
    return out.numpy()


def client_loop(sock: str, model: str, inputs: dict, output: str, seconds: float, start, out) -> None:
    from shmserve import Client

    with Client(sock) as c:
        c.infer(model, inputs)  # the lane opened and the spec read before the clock starts
        start.wait()
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            c.infer(model, inputs)
            n += 1
    out.put(n)


def throughput(sock: str, z: Zoo, seconds: float) -> float:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=client_loop, args=(sock, f"{z.name}_batched", z.example, z.output, seconds, start, out))
             for _ in range(CLIENTS)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # every client connected and warmed (their first call waits for nothing else)
    t0 = time.monotonic()
    start.set()
    total = sum(out.get(timeout=seconds + 120) for _ in procs)
    elapsed = time.monotonic() - t0
    for p in procs:
        p.join(30)
    return total / max(elapsed, seconds)


def bare_throughput(z: Zoo, device: str, batch: int, seconds: float = 3.0) -> float:
    """Items/s of the bare model in this process at ``batch``: page-locked input -> H2D -> forward ->
    D2H -> sync, back to back."""
    import torch

    dev = torch.device(device)
    module = torch.jit.load(str(z.path), map_location=dev).eval()
    host = [torch.from_numpy(v).pin_memory() if dev.type == "cuda" else torch.from_numpy(v)
            for v in z.batch(batch).values()]
    with torch.inference_mode():
        for _ in range(3):
            module(*[h.to(dev) for h in host]).cpu()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            module(*[h.to(dev, non_blocking=True) for h in host]).cpu()
            n += 1
        elapsed = time.monotonic() - t0
    return n * batch / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import torch

    from shmserve import Client
    from shmserve.bench import interleaved, serve_config

    dev = torch.device(args.device)
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "models": {}}
    print(f"{report['device']}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory(prefix="gpu-zoo-") as tmp:
        workdir = Path(tmp)
        zoos = []
        for name in args.models.split(","):
            t0 = time.monotonic()
            try:
                zoos.append(build(name, args.small, workdir, args.device))
                print(f"built {name} in {time.monotonic() - t0:.1f} s")
            except Exception as exc:  # one model's failure does not stop the other's run
                print(f"{name}: cannot build: {type(exc).__name__}: {exc}")
                report["models"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        if not zoos:
            return 1
        cfg = workdir / "zoo.toml"
        cfg.write_text(config_text(zoos, args.device, f"zoo-{uuid.uuid4().hex[:8]}"))
        sock = str(workdir / "zoo.sock")
        t0 = time.monotonic()
        proc = serve_config(cfg, sock)
        try:
            with Client(sock) as c:
                deadline = time.monotonic() + 300  # every model ready, or one unavailable (its reason said)
                while time.monotonic() < deadline:
                    states = {m["name"]: m.get("state") for m in c.models()}
                    if all(state in ("ready", "unavailable") for state in states.values()):
                        break
                    time.sleep(0.5)
                print(f"server settled in {time.monotonic() - t0:.1f} s: "
                      f"{', '.join(m['name'] + ' ' + str(m.get('state')) for m in c.models())}")
                for m in c.models():
                    if m.get("state") != "ready":
                        print(f"  {m['name']}: {m.get('reason')}")
                        print("  server log:", (workdir / "server.log").read_text()[-1500:])
                        break
                for z in zoos:
                    if not all(states.get(f"{z.name}_{kind}") == "ready" for kind in ("eager", "graphs", "batched")):
                        report["models"][z.name] = {"error": "not served (above)"}
                        continue
                    row: dict = {}
                    report["models"][z.name] = row
                    # correctness: batch 1 and batch 4 against the CPU reference
                    errors = {}
                    for n in (1, 4):
                        inputs = z.batch(n)
                        ref = reference(z, inputs)
                        for kind in ("eager", "graphs", "batched"):
                            got = c.infer(f"{z.name}_{kind}", inputs)[z.output]
                            errors[f"{kind} batch {n}"] = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-12))
                    row["relative_error"] = errors
                    print(f"\n## {z.name}: max |diff| / max |CPU reference|: "
                          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
                    # latency: bare in-process against lanes, interleaved
                    module = torch.jit.load(str(z.path), map_location=dev).eval()
                    host = [torch.from_numpy(v) for v in z.example.values()]
                    if dev.type == "cuda":
                        host = [h.pin_memory() for h in host]
                    stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
                    y_host = torch.from_numpy(reference(z, z.example)).clone()
                    if dev.type == "cuda":
                        y_host = y_host.pin_memory()

                    def bare_eager():
                        with torch.inference_mode():
                            if stream is None:
                                y_host.copy_(module(*host))
                                return
                            with torch.cuda.stream(stream):
                                y_host.copy_(module(*[h.to(dev, non_blocking=True) for h in host]), non_blocking=True)
                            stream.synchronize()

                    cases = {"bare eager (H2D, forward, D2H, sync)": bare_eager}
                    if dev.type == "cuda":
                        with torch.inference_mode():
                            static_in = [h.to(dev) for h in host]
                            side = torch.cuda.Stream(dev)
                            side.wait_stream(torch.cuda.current_stream(dev))
                            with torch.cuda.stream(side):
                                for _ in range(3):
                                    module(*static_in)
                            torch.cuda.current_stream(dev).wait_stream(side)
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph):
                                static_out = module(*static_in)

                        def bare_graph():
                            with torch.inference_mode(), torch.cuda.stream(stream):
                                for s, h in zip(static_in, host):
                                    s.copy_(h, non_blocking=True)
                                graph.replay()
                                y_host.copy_(static_out, non_blocking=True)
                            stream.synchronize()
                        cases["bare graph replay"] = bare_graph
                    calls = {}
                    for kind in ("eager", "graphs"):
                        call = c.zero_copy(f"{z.name}_{kind}", {k: (v.shape, v.dtype) for k, v in z.example.items()})
                        for k, v in z.example.items():
                            call.inputs[k][...] = v
                        call.run()
                        calls[kind] = call
                        cases[f"lane (zero_copy), {kind}"] = call.run
                    cases["infer (lane, copies), graphs"] = lambda: c.infer(f"{z.name}_graphs", z.example)
                    samples = interleaved(cases, args.rounds, args.per_round, SEED, warm=10)
                    for call in calls.values():
                        call.release()
                    base = statistics.median(samples["bare eager (H2D, forward, D2H, sync)"]) * 1e6
                    print("\n| case | p50 µs | p90 µs | p50 − bare eager µs |\n| --- | ---: | ---: | ---: |")
                    row["latency"] = []
                    for key, values in samples.items():
                        p50, p90 = statistics.median(values) * 1e6, float(np.percentile(values, 90)) * 1e6
                        row["latency"].append({"case": key, "p50_us": p50, "p90_us": p90, "n": len(values)})
                        print(f"| {key} | {p50:.1f} | {p90:.1f} | {p50 - base:+.1f} |")
                    # throughput: 16 clients on the batched configuration against the bare model
                    served = throughput(sock, z, args.seconds)
                    bare = {b: bare_throughput(z, args.device, b) for b in (8, 16)}
                    row["throughput"] = {"served_items_s": served, **{f"bare_batch{b}_items_s": v for b, v in bare.items()}}
                    print(f"\n{CLIENTS} clients, batch 1 each, batched configuration: {served:.0f} items/s; bare in-process "
                          + ", ".join(f"batch {b}: {v:.0f} items/s ({served / v:.0%})" for b, v in bare.items()))
        finally:
            proc.terminate()
            proc.wait(60)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
