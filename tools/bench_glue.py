#!/usr/bin/env python3
"""What the torch (CPU) and Python backends' glue adds over the bare model (issue 26 item 2).

Three measurements, the first and last interleaved in shuffled rounds so the machine's noise falls
on every case alike, with the bare model run in this process on one thread (as the workers run
here: OMP_NUM_THREADS=1 for this process and the server it starts):

  small (4 KiB, uint8[4096])   the Python identity (the floor: a lane's or infer's round trip),
                               a Python ``x + 0`` and a TorchScript ``x + 0``; per path (lane:
                               ``Client.zero_copy``, infer: ``Client.infer``) the glue is the
                               model's p50 less the identity's on the same path less the bare
                               model's p50 (target, as for ONNX Runtime: at most 5 us); and the
                               backend's own part, its adapter called in this process into memory
                               of its own, against the bare call; and each model's ``compute``
                               stage in its worker (the backend's call and its output copies, the
                               mean over the round, from the arena's histograms); then each
                               model's lane calls in parts, from their slots' stamps (p50: the
                               worker's claim, decode, compute, finish, the client's wake)
  after a sleep                the bare calls and the adapters of the small models again, each
                               call made after this thread slept ``--sleep-us`` (not timed): a
                               call met as a worker meets its requests, after waiting for them
                               (a worker that sleeps between requests runs its model cold)
  ~10 ms                       a TorchScript conv net of PP-OCRv4 recognition's sizes (float32
                               [1, 3, 48, 320] in, [1, 40, 6625] out, 1.06 MB), a Python model
                               of numpy work sized here to ~10 ms and a Python model that sleeps
                               10 ms (the path alone: no CPU work to slow or warm); through a
                               lane, ``Client.infer`` and the socket (``lanes=False``); the
                               overhead is p50 over the bare p50 (target: at most 1 %)

``--repeat N`` measures N times against the same server; the tables give the median over the
runs of each p50 and of each run's glue and overhead (each against the floor of its own run).

With ``--pin N`` every worker runs on CPU N (its model's ``cpus``), the bare models too, and the
client on CPU N + a quarter of the CPUs (at least 1): on a VM whose vCPUs run the same code at
different speeds (the H200 host's differ up to 1.8x, docs/gpu.md) only that compares a worker
with the bare model.

usage: python tools/bench_glue.py [--rounds 20] [--per-round 100] [--heavy-rounds 30]
                                  [--heavy-per-round 4] [--repeat 1] [--sleep-us 50] [--pin CPU]
                                  [--json-out FILE]
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
import time

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


def sleepy(inputs):
    """10 ms asleep, then its input back: the path's own cost, with no CPU work to slow or warm."""
    time.sleep(0.010)
    return {{"y": inputs["x"]}}


sleepy.inputs = heavy.inputs
sleepy.outputs = heavy.outputs
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


def config_text(instance: str, add: Path, conv: Path, pin: int | None = None) -> str:
    u8 = '[{name = "x", dtype = "uint8", shape = ["n"]}]'
    text = (f'[server]\ninstance = "{instance}"\nmax_request_bytes = {64 << 20}\n'
            '[[models]]\nname = "identity"\nbackend = "python"\npath = "shmserve.models:identity"\n'
            f'[[models]]\nname = "py_add"\nbackend = "python"\npath = "glue_models:add"\n'
            f'[[models]]\nname = "torch_add"\nbackend = "torch"\npath = "{add}"\ninputs = {u8}\n'
            f'outputs = [{{name = "y", dtype = "uint8", shape = ["n"]}}]\n'
            f'[[models]]\nname = "torch_conv"\nbackend = "torch"\npath = "{conv}"\n'
            f'inputs = [{{name = "x", dtype = "float32", shape = [1, 3, 48, 320]}}]\n'
            f'outputs = [{{name = "y", dtype = "float32", shape = [1, {STEPS}, {CLASSES}]}}]\n'
            f'[[models]]\nname = "py_heavy"\nbackend = "python"\npath = "glue_models:heavy"\n'
            f'[[models]]\nname = "py_sleep"\nbackend = "python"\npath = "glue_models:sleepy"\n')
    if pin is not None:  # every worker on the CPU the bare models run on
        text = text.replace('[[models]]\n', f'[[models]]\ncpus = "{pin}"\n')
    return text


def table(samples: dict, scale: float, unit: str) -> dict:
    return {k: {"p50": statistics.median(v) * scale, "p90": float(np.percentile(v, 90)) * scale, "n": len(v),
                "unit": unit} for k, v in samples.items()}


def after_sleep(cases: dict, calls: int, sleep_s: float, cpu: int | None) -> dict[str, list[float]]:
    """Seconds per call of each of ``cases``, each call made after this thread slept ``sleep_s``
    (the calls alternate): a call met as a worker meets its requests, after waiting for them,
    its caches cooled by whatever ran meanwhile (the sleep is not timed)."""
    mine = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    samples: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for _ in range(calls):
            for key, f in cases.items():
                time.sleep(sleep_s)
                t0 = time.perf_counter()
                f()
                samples[key].append(time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, mine)
    return samples


LANE_STAGES = ("claim", "decode", "compute", "finish", "client")  # between the slot's stamps, and DONE to read


def lane_stages(calls: dict, n: int, cpu: int | None) -> dict[str, dict[str, float]]:
    """The p50 (µs) of each part of ``n`` lane calls (``ZeroCopyCall``s by model, each model's back to back),
    from the stamps in each call's lane slot, read just before the client frees it: ready to
    claimed (``claim``: the worker's wait and wake-up), claimed to compute start (``decode``), the
    backend's call with its output copies (``compute``), compute end to DONE (``finish``), DONE to
    the client's read (``client``: its wait and wake-up).  ``ClientLane.read`` is wrapped only
    for this pass, made on CPU ``cpu`` (the client's; None: where it runs)."""
    from shmserve import lanes, layout

    stamps: list = []
    read = lanes.ClientLane.read

    def stamped_read(lane, index, generation, *rest):
        stamps.append((layout.read_stages(lane.buf, layout.LANE.slot_off(index)), time.monotonic_ns()))
        return read(lane, index, generation, *rest)

    parts: dict[str, list] = {m: [] for m in calls}
    mine = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    lanes.ClientLane.read = stamped_read
    try:
        for model, call in calls.items():
            for _ in range(n):
                call.run()
                (_, ready, claimed, start, end, done), now = stamps.pop()
                parts[model].append((claimed - ready, start - claimed, end - start, done - end, now - done))
    finally:
        lanes.ClientLane.read = read
        os.sched_setaffinity(0, mine)
    return {m: {stage: statistics.median(r[i] for r in rows) / 1e3 for i, stage in enumerate(LANE_STAGES)}
            for m, rows in parts.items()}


def compute_means(instance: str, models) -> dict[str, tuple[int, float]]:
    """Each model's workers' ``compute`` stage so far (the backend's call with its output copies,
    timed in the worker): (count, sum in µs), from the arena (``shmserve.inspection``)."""
    from shmserve.inspection import snapshot

    latency = snapshot(instance)["latency_us"]
    out = {}
    for model in models:
        stage = latency.get(model, {}).get("compute") or {}
        n = stage.get("count") or 0
        out[model] = (n, (stage.get("mean_us") or 0.0) * n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--heavy-rounds", type=int, default=30)
    ap.add_argument("--heavy-per-round", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="measure this many times against the same server; "
                    "the tables give the median of the runs' p50s and of their per-run glue and overheads")
    ap.add_argument("--sleep-us", type=float, default=50.0, help="the wait before each 'after a sleep' call "
                    "(a worker's wait for its next request)")
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
                    "torch_threads": torch.get_num_threads(), "repeat": args.repeat, "sleep_us": args.sleep_us}
    runs: list[dict] = []
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

        instance = f"glue-{uuid.uuid4().hex[:8]}"
        cfg_path = workdir / "glue.toml"
        cfg_path.write_text(config_text(instance, add_path, conv_path, args.pin))
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
                cold = dict(small)
                for name, call in calls.items():
                    small[f"lane, {name}"] = call.run
                    small[f"infer, {name}"] = (lambda n: lambda: c.infer(n, {"x": x_small}))(name)

                ref_conv = bare_torch(torch_conv, t_img)
                with torch.inference_mode():
                    expect_conv = torch_conv(t_img).numpy()
                expect_py = glue_models.heavy({"x": x_img})["y"]
                heavy_calls = {}
                for name, expect in (("torch_conv", expect_conv), ("py_heavy", expect_py), ("py_sleep", x_img)):
                    call = c.zero_copy(name, {"x": (IN_SHAPE, np.float32)})
                    call.inputs["x"][...] = x_img
                    np.testing.assert_allclose(call.run()["y"], expect, rtol=1e-5, atol=1e-6)
                    np.testing.assert_allclose(sock.infer(name, {"x": x_img})["y"], expect, rtol=1e-5, atol=1e-6)
                    heavy_calls[name] = call
                heavy = {"bare torch conv net (this process)": ref_conv,
                         "bare Python numpy model (this process)": lambda: glue_models.heavy({"x": x_img}),
                         "bare Python 10 ms sleep (this process)": lambda: glue_models.sleepy({"x": x_img})}
                for name, call in heavy_calls.items():
                    heavy[f"lane, {name}"] = call.run
                    heavy[f"infer, {name}"] = (lambda n: lambda: c.infer(n, {"x": x_img}))(name)
                    heavy[f"socket, {name}"] = (lambda n: lambda: sock.infer(n, {"x": x_img}))(name)

                for run in range(args.repeat):
                    before = compute_means(instance, calls)
                    s_small = interleaved(small, args.rounds, args.per_round, SEED + run, warm=200,
                                          cpus=cpus_of(small))
                    after = compute_means(instance, calls)
                    s_cold = after_sleep(cold, args.rounds * args.per_round // 2, args.sleep_us / 1e6, args.pin)
                    s_heavy = interleaved(heavy, args.heavy_rounds, args.heavy_per_round, SEED + run, warm=3,
                                          cpus=cpus_of(heavy))
                    worker = {m: (after[m][1] - before[m][1]) / max(1, after[m][0] - before[m][0]) for m in calls}
                    stages = lane_stages({**calls, **heavy_calls}, args.rounds, client_cpu)
                    runs.append({"small": table(s_small, 1e6, "us"), "cold": table(s_cold, 1e6, "us"),
                                 "heavy": table(s_heavy, 1e3, "ms"), "worker_compute_mean_us": worker,
                                 "lane_stages_p50_us": stages})
                    print(f"run {run + 1} of {args.repeat} done", file=sys.stderr)
                for call in (*calls.values(), *heavy_calls.values()):
                    call.release()
        finally:
            proc.terminate()
            proc.wait(30)
    report.update(runs=runs, python_heavy_rounds=rounds)
    report["summary"] = summary = summarize(runs)
    print(f"{report['date']}, {report['cpus']} CPUs, one thread; {args.repeat} run(s) of {args.rounds} rounds x "
          f"{args.per_round}; pinned: {report['pin']}; medians over the runs")
    print("\n| case (4 KiB) | p50 µs | glue: p50 − identity − bare µs (per run) |\n| --- | ---: | ---: |")
    for key, row in summary["small"].items():
        per_run = f" ({', '.join(f'{g:+.1f}' for g in row['glue_runs'])})" if row.get("glue_runs") else ""
        glue = f"{row['glue']:+.1f}{per_run}" if "glue" in row else ""
        print(f"| {key} | {row['p50']:.1f} | {glue} |")
    print(f"\nafter a {args.sleep_us:g} µs sleep (this process; a worker's wait) and in the workers\n"
          "| case (4 KiB) | p50 µs |\n| --- | ---: |")
    for key, value in summary["cold"].items():
        print(f"| {key}, after a sleep | {value:.1f} |")
    for model, value in summary["worker_compute_mean_us"].items():
        print(f"| worker's compute stage, {model} (mean) | {value:.1f} |")
    print(f"\na lane call's parts, from its slot's stamps (p50 µs; {args.rounds} calls each per run)\n"
          f"| model | {' | '.join(LANE_STAGES)} |\n| --- |{' ---: |' * len(LANE_STAGES)}")
    for model, row in summary["lane_stages_p50_us"].items():
        print(f"| {model} | {' | '.join(f'{row[stage]:.1f}' for stage in LANE_STAGES)} |")
    print(f"\n~10 ms models, {args.heavy_rounds} rounds x {args.heavy_per_round}\n"
          "| case | p50 ms | p50 over bare (per run) |\n| --- | ---: | ---: |")
    for key, row in summary["heavy"].items():
        over = ""
        if "over" in row:
            over = f"{row['over']:+.2f} % ({', '.join(f'{o:+.2f}' for o in row['over_runs'])})"
        print(f"| {key} | {row['p50']:.3f} | {over} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


BARE_SMALL = {"py_add": "bare Python x + 0 (this process)", "torch_add": "bare torch x + 0 (this process)"}
BARE_HEAVY = {"torch_conv": "bare torch conv net (this process)", "py_heavy": "bare Python numpy model (this process)",
              "py_sleep": "bare Python 10 ms sleep (this process)"}


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs: each case's p50, each model's glue (p50 − the identity's p50 on the
    same path − the bare model's p50, per run) and each ~10 ms case's overhead over its bare
    model (per run, in %)."""
    small: dict = {}
    for key in runs[0]["small"]:
        path, _, model = key.partition(", ")
        p50s = [r["small"][key]["p50"] for r in runs]
        row = small[key] = {"p50": statistics.median(p50s)}
        if model in BARE_SMALL:
            glue = [r["small"][key]["p50"] - r["small"][f"{path}, identity"]["p50"] - r["small"][BARE_SMALL[model]]["p50"]
                    for r in runs]
            row.update(glue=statistics.median(glue), glue_runs=glue)
    heavy: dict = {}
    for key in runs[0]["heavy"]:
        model = key.partition(", ")[2]
        row = heavy[key] = {"p50": statistics.median(r["heavy"][key]["p50"] for r in runs)}
        if model in BARE_HEAVY:
            over = [100 * (r["heavy"][key]["p50"] / r["heavy"][BARE_HEAVY[model]]["p50"] - 1) for r in runs]
            row.update(over=statistics.median(over), over_runs=over)
    cold = {key: statistics.median(r["cold"][key]["p50"] for r in runs) for key in runs[0]["cold"]}
    worker = {m: statistics.median(r["worker_compute_mean_us"][m] for r in runs)
              for m in runs[0]["worker_compute_mean_us"]}
    stages = {m: {stage: statistics.median(r["lane_stages_p50_us"][m][stage] for r in runs) for stage in LANE_STAGES}
              for m in runs[0].get("lane_stages_p50_us", {})}
    return {"small": small, "heavy": heavy, "cold": cold, "worker_compute_mean_us": worker,
            "lane_stages_p50_us": stages}


if __name__ == "__main__":
    sys.exit(main())
