#!/usr/bin/env python3
"""What the torch (CPU) and Python backends' glue adds over the bare model (issue 26 item 2).

Two measurements, each interleaved in shuffled rounds so the machine's noise falls on every case
alike, with the bare model run in this process on one thread (as the workers run here:
OMP_NUM_THREADS=1 for this process and the server it starts):

  small (4 KiB, uint8[4096])   the Python identity (the floor: a lane's or infer's round trip),
                               a Python ``x + 0`` and a TorchScript ``x + 0``; per path (lane:
                               ``Client.zero_copy``, infer: ``Client.infer``) the glue is the
                               model's p50 less the identity's on the same path less the bare
                               model's p50 (target, as for ONNX Runtime: at most 5 us); and the
                               backend's own part, its adapter called in this process into memory
                               of its own, against the bare call
  ~10 ms                       a TorchScript conv net of PP-OCRv4 recognition's sizes (float32
                               [1, 3, 48, 320] in, [1, 40, 6625] out, 1.06 MB) and a Python model
                               of numpy work sized here to ~10 ms; through a lane, ``Client.infer``
                               and the socket (``lanes=False``); the overhead is p50 over the bare
                               p50 (target: at most 1 %)

With ``--pin N`` every worker runs on CPU N (its model's ``cpus``), the bare models too, and the
client on CPU N + a quarter of the CPUs (at least 1): on a VM whose vCPUs run the same code at
different speeds (the H200 host's differ up to 1.8x, docs/gpu.md) only that compares a worker
with the bare model.

usage: python tools/bench_glue.py [--rounds 20] [--per-round 100] [--heavy-rounds 30]
                                  [--heavy-per-round 4] [--pin CPU] [--json-out FILE]
Needs torch.  Prints Markdown tables.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in the server it starts

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

SEED = 20261202
SMALL = 4096
IN_SHAPE, STEPS, CLASSES = (1, 3, 48, 320), 40, 6625
PY_MODELS = '''"""The Python models of tools/bench_glue.py."""
import numpy as np

ROUNDS = {rounds}


def add(inputs):
    return {{"y": inputs["x"] + np.uint8(0)}}


add.inputs = [{{"name": "x", "dtype": "uint8", "shape": ["n"]}}]
add.outputs = [{{"name": "y", "dtype": "uint8", "shape": ["n"]}}]


def heavy(inputs):
    """~10 ms of numpy on one thread: ROUNDS passes of a sine over the input."""
    y = inputs["x"]
    for _ in range(ROUNDS):
        y = np.sin(y)
    return {{"y": y}}


heavy.inputs = [{{"name": "x", "dtype": "float32", "shape": [1, 3, 48, 320]}}]
heavy.outputs = [{{"name": "y", "dtype": "float32", "shape": [1, 3, 48, 320]}}]
'''


def build_torch(workdir: Path) -> tuple[Path, Path]:
    """A TorchScript ``x + 0`` and the ~10 ms conv net (seeded), traced; their paths."""
    import torch

    class Add(torch.nn.Module):
        def forward(self, x):
            return x + 0

    class OcrLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layers, cin = [], 3
            for cout, stride in ((64, 2), (128, 2), (256, 2), (256, 1), (256, 1), (256, 1)):
                layers += [torch.nn.Conv2d(cin, cout, 3, stride, 1), torch.nn.ReLU()]
                cin = cout
            self.body = torch.nn.Sequential(*layers)
            self.proj = torch.nn.Linear(256, CLASSES, bias=False)

        def forward(self, x):
            pooled = self.body(x).mean(2).transpose(1, 2)  # [b, 40, 256]
            return torch.softmax(self.proj(pooled), -1)

    torch.manual_seed(SEED)
    add, conv = workdir / "add.pt", workdir / "ocr_like.pt"
    torch.jit.trace(Add(), torch.zeros(8, dtype=torch.uint8)).save(str(add))
    with torch.no_grad():
        torch.jit.trace(OcrLike().eval(), torch.zeros(IN_SHAPE)).save(str(conv))
    return add, conv


def size_python_heavy(x: np.ndarray, target_s: float = 0.010) -> int:
    """How many sine passes over ``x`` take ``target_s`` here."""
    y, n, t0 = x, 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        y = np.sin(y)
        n += 1
    return max(1, round(target_s / ((time.perf_counter() - t0) / n)))


def config_text(workdir: Path, add: Path, conv: Path, pin: int | None = None) -> str:
    u8 = '[{name = "x", dtype = "uint8", shape = ["n"]}]'
    text = (f'[server]\ninstance = "glue-{uuid.uuid4().hex[:8]}"\nmax_request_bytes = {64 << 20}\n'
            '[[models]]\nname = "identity"\nbackend = "python"\npath = "shmserve.models:identity"\n'
            f'[[models]]\nname = "py_add"\nbackend = "python"\npath = "glue_models:add"\n'
            f'[[models]]\nname = "torch_add"\nbackend = "torch"\npath = "{add}"\ninputs = {u8}\n'
            f'outputs = [{{name = "y", dtype = "uint8", shape = ["n"]}}]\n'
            f'[[models]]\nname = "torch_conv"\nbackend = "torch"\npath = "{conv}"\n'
            f'inputs = [{{name = "x", dtype = "float32", shape = [1, 3, 48, 320]}}]\n'
            f'outputs = [{{name = "y", dtype = "float32", shape = [1, {STEPS}, {CLASSES}]}}]\n'
            f'[[models]]\nname = "py_heavy"\nbackend = "python"\npath = "glue_models:heavy"\n')
    if pin is not None:  # every worker on the CPU the bare models run on
        text = text.replace('[[models]]\n', f'[[models]]\ncpus = "{pin}"\n')
    return text


def table(samples: dict, scale: float, unit: str) -> dict:
    return {k: {"p50": statistics.median(v) * scale, "p90": float(np.percentile(v, 90)) * scale, "n": len(v),
                "unit": unit} for k, v in samples.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--heavy-rounds", type=int, default=30)
    ap.add_argument("--heavy-per-round", type=int, default=4)
    ap.add_argument("--pin", type=int, help="pin every worker and the bare models to this CPU, the client to "
                    "N + a quarter of the CPUs (a VM whose vCPUs differ in speed: the fair floor)")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import torch

    from shmserve import Client
    from shmserve.bench import interleaved, serve_config, wait_models_ready
    from shmserve.config import ModelConfig
    from shmserve.spec import TensorSpec
    from workers.adapter import BackendAdapter

    torch.set_num_threads(1)
    rng = np.random.default_rng(SEED)
    x_small = rng.integers(0, 255, SMALL, dtype=np.uint8)
    x_img = rng.standard_normal(IN_SHAPE, dtype=np.float32)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="bench-glue-") as tmp:
        workdir = Path(tmp)
        add_path, conv_path = build_torch(workdir)
        rounds = size_python_heavy(x_img)
        (workdir / "glue_models.py").write_text(PY_MODELS.format(rounds=rounds))
        sys.path.insert(0, str(workdir))
        import glue_models

        torch_add = torch.jit.load(str(add_path)).eval()
        torch_conv = torch.jit.load(str(conv_path)).eval()
        t_small, t_img = torch.from_numpy(x_small), torch.from_numpy(x_img)

        def bare_torch(module, x):
            def go():
                with torch.inference_mode():
                    module(x).numpy().copy()  # the model's answer, out of torch's memory (as the backend's copy)
            return go

        # the backends' own part, in this process (the worker's code; its outputs into memory of its own)
        spec = (TensorSpec("x", "uint8", ("n",)),), (TensorSpec("y", "uint8", ("n",)),)
        torch_cfg = ModelConfig(name="torch_add", backend="torch", path=str(add_path), inputs=spec[0], outputs=spec[1])
        py_cfg = ModelConfig(name="py_add", backend="python", path="glue_models:add", base_dir=str(workdir))
        adapters = {}
        for cfg in (torch_cfg, py_cfg):
            adapter = BackendAdapter.load(cfg)
            adapter.warm_up(cfg, adapter.prepare(cfg))
            adapters[cfg.name] = adapter
        out = np.empty(SMALL, np.uint8)
        x_ro = x_small.view()
        x_ro.flags.writeable = False  # as a request's views are

        def torch_adapter():
            adapters["torch_add"].run_into({"x": x_ro}, lambda name, shape, dtype: out)

        def py_adapter():  # what workers.step does with a run backend's outputs
            for value in adapters["py_add"].run({"x": x_ro}).values():
                np.copyto(out, value, casting="no")

        cfg_path = workdir / "glue.toml"
        cfg_path.write_text(config_text(workdir, add_path, conv_path, args.pin))
        client_cpu = None if args.pin is None else (args.pin + max(1, os.cpu_count() // 4)) % os.cpu_count()
        report["pin"] = {"workers_and_bare": args.pin, "client": client_cpu}

        def cpus_of(cases: dict) -> dict | None:
            if args.pin is None:
                return None
            return {k: args.pin if "this process" in k else client_cpu for k in cases}
        proc = serve_config(cfg_path, str(workdir / "glue.sock"))
        try:
            with Client(str(workdir / "glue.sock")) as c, Client(str(workdir / "glue.sock"), lanes=False) as sock:
                wait_models_ready(c, 180)
                calls = {}
                for name in ("identity", "py_add", "torch_add"):
                    call = c.zero_copy(name, {"x": (x_small.shape, np.uint8)})
                    call.inputs["x"][...] = x_small
                    assert np.array_equal(call.run()["y"], x_small), name
                    assert np.array_equal(c.infer(name, {"x": x_small})["y"], x_small), name
                    calls[name] = call
                small = {"bare torch x + 0 (this process)": bare_torch(torch_add, t_small),
                         "bare Python x + 0 (this process)": lambda: glue_models.add({"x": x_small}),
                         "torch backend's run_into (this process)": torch_adapter,
                         "Python backend's run + copy (this process)": py_adapter}
                for name, call in calls.items():
                    small[f"lane, {name}"] = call.run
                    small[f"infer, {name}"] = (lambda n: lambda: c.infer(n, {"x": x_small}))(name)
                s_small = interleaved(small, args.rounds, args.per_round, SEED, warm=200, cpus=cpus_of(small))
                for call in calls.values():
                    call.release()

                ref_conv = bare_torch(torch_conv, t_img)
                with torch.inference_mode():
                    expect_conv = torch_conv(t_img).numpy()
                expect_py = glue_models.heavy({"x": x_img})["y"]
                heavy_calls = {}
                for name, expect in (("torch_conv", expect_conv), ("py_heavy", expect_py)):
                    call = c.zero_copy(name, {"x": (IN_SHAPE, np.float32)})
                    call.inputs["x"][...] = x_img
                    np.testing.assert_allclose(call.run()["y"], expect, rtol=1e-5, atol=1e-6)
                    np.testing.assert_allclose(sock.infer(name, {"x": x_img})["y"], expect, rtol=1e-5, atol=1e-6)
                    heavy_calls[name] = call
                heavy = {"bare torch conv net (this process)": ref_conv,
                         "bare Python numpy model (this process)": lambda: glue_models.heavy({"x": x_img})}
                for name, call in heavy_calls.items():
                    heavy[f"lane, {name}"] = call.run
                    heavy[f"infer, {name}"] = (lambda n: lambda: c.infer(n, {"x": x_img}))(name)
                    heavy[f"socket, {name}"] = (lambda n: lambda: sock.infer(n, {"x": x_img}))(name)
                s_heavy = interleaved(heavy, args.heavy_rounds, args.heavy_per_round, SEED, warm=3, cpus=cpus_of(heavy))
                for call in heavy_calls.values():
                    call.release()
        finally:
            proc.terminate()
            proc.wait(30)
    small_t, heavy_t = table(s_small, 1e6, "us"), table(s_heavy, 1e3, "ms")
    report.update(small=small_t, heavy=heavy_t, python_heavy_rounds=rounds)
    p = {k: v["p50"] for k, v in small_t.items()}
    bare = {"py_add": p["bare Python x + 0 (this process)"], "torch_add": p["bare torch x + 0 (this process)"]}
    print(f"{report['date']}, {report['cpus']} CPUs, one thread; {args.rounds} rounds x {args.per_round}; "
          f"pinned: {report['pin']}")
    print("\n| case (4 KiB) | p50 µs | p90 µs | glue: p50 − identity − bare µs |\n| --- | ---: | ---: | ---: |")
    for key, row in small_t.items():
        path, _, model = key.partition(", ")
        glue = ""
        if model in bare:
            glue = f"{row['p50'] - p[f'{path}, identity'] - bare[model]:+.1f}"
        elif key.startswith("torch backend"):
            glue = f"{row['p50'] - bare['torch_add']:+.1f} (over the bare call)"
        elif key.startswith("Python backend"):
            glue = f"{row['p50'] - bare['py_add']:+.1f} (over the bare call)"
        print(f"| {key} | {row['p50']:.1f} | {row['p90']:.1f} | {glue} |")
    h = {k: v["p50"] for k, v in heavy_t.items()}
    floors = {"torch_conv": h["bare torch conv net (this process)"], "py_heavy": h["bare Python numpy model (this process)"]}
    print(f"\n~10 ms models, {args.heavy_rounds} rounds x {args.heavy_per_round}\n"
          "| case | p50 ms | p90 ms | p50 over bare |\n| --- | ---: | ---: | ---: |")
    for key, row in heavy_t.items():
        model = key.partition(", ")[2]
        over = f"{100 * (row['p50'] / floors[model] - 1):+.2f} %" if model in floors else ""
        print(f"| {key} | {row['p50']:.3f} | {row['p90']:.3f} | {over} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
