"""What outputs of unknown size cost (issue 26 part 1): the first call of a shape, and every call after.

Owns: one measurement, printed as JSON: a server of its own serving two ONNX Relu models that differ
only in their output's dimension names — ``guess`` (named per tensor, as exporters do: no input
names them, so the output's space is a guess) and ``exact`` (the input's names: reserved exactly) —
and ``Client.infer`` through a lane and over the socket:

* ``first``: the first call of a new shape whose 1.2 MB output outgrows the 1 MiB guess (it answers
  short and runs again), against the same call of ``exact`` (no guess): each shape new (640 x
  (480 + k)), the two models alternating;
* ``steady``: later calls of one shape, ``guess`` against ``exact``, at 4 KiB and at 1.2 MB;
* the same first calls of the Python identity (``py_guess``: its output's dimension overridden
  to -1, against ``py_exact``: the model's own), where a run costs next to nothing beside the
  copies, so the re-run's own cost shows (ONNX Runtime's first run of a shape plans its memory).

Medians and 10th percentiles in microseconds.  Run it with another checkout's interpreter to compare (its server and
workers are that checkout's: ``/work/main/.venv/bin/python tools/bench_output_sizes.py``); a call
that fails there is reported as its error code.

Must not: be imported by the package (a tool).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def relu(path: Path, out_dims: list[str]) -> str:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [f"x_{i}" for i in range(4)])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def timed(call) -> float | str:
    start = time.perf_counter()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - another checkout may refuse it: say how
        return getattr(getattr(exc, "code", None), "wire", type(exc).__name__)
    return (time.perf_counter() - start) * 1e6


def median(samples: list) -> dict | str:
    """The median and the 10th percentile (on a shared machine, the calls nobody disturbed), or the
    error code of a call that failed."""
    numbers = [s for s in samples if isinstance(s, float)]
    if len(numbers) < len(samples):
        return next(s for s in samples if not isinstance(s, float))
    return {"median": round(statistics.median(numbers), 1),
            "p10": round(statistics.quantiles(numbers, n=10)[0], 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=int, default=40, help="new shapes for the first-call cost (default 40)")
    p.add_argument("--calls", type=int, default=300, help="steady calls per case (default 300)")
    args = p.parse_args()
    from shmserve import Client

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = work / "bench.toml"
        instance = f"outbench{os.getpid()}"
        config.write_text(f'[server]\ninstance = "{instance}"\nmax_request_bytes = {32 << 20}\n\n'
                          f'[[models]]\nname = "guess"\nbackend = "onnxruntime"\n'
                          f'path = "{relu(work / "guess.onnx", [f"unk__{i}" for i in range(4)])}"\n\n'
                          f'[[models]]\nname = "exact"\nbackend = "onnxruntime"\n'
                          f'path = "{relu(work / "exact.onnx", [f"x_{i}" for i in range(4)])}"\n\n'
                          f'[[models]]\nname = "py_exact"\nbackend = "python"\npath = "shmserve.models:identity"\n\n'
                          f'[[models]]\nname = "py_guess"\nbackend = "python"\npath = "shmserve.models:identity"\n'
                          f'outputs = [{{name = "y", dtype = "uint8", shape = [-1]}}]\n')
        sock = str(work / "s.sock")
        log = open(work / "server.log", "wb")
        server = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "serve", "--config", str(config),
                                   "--socket", sock], stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                try:
                    with Client(sock, timeout=10) as c:
                        c.health()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if server.poll() is not None:
                        raise SystemExit((work / "server.log").read_text())
                    time.sleep(0.1)
            result = {"python": sys.executable, "shmserve": __import__("shmserve").__file__}
            rng = np.random.default_rng(0)
            for lanes in (True, False):
                path = "lane" if lanes else "socket"
                with Client(sock, timeout=30, lanes=lanes) as c:
                    first = {"guess": [], "exact": []}
                    for k in range(args.shapes):
                        x = rng.standard_normal((1, 1, 640, 480 + k)).astype(np.float32)
                        for model in ("guess", "exact") if k % 2 else ("exact", "guess"):
                            first[model].append(timed(lambda m=model: c.infer(m, {"x": x})))
                    result[f"{path} first call, 1.2 MB"] = {m: median(s) for m, s in first.items()}
                    first = {"py_guess": [], "py_exact": []}
                    for k in range(args.shapes):
                        x = rng.integers(0, 255, 1_200_000 + 64 * k, dtype=np.uint8)
                        for model in ("py_guess", "py_exact") if k % 2 else ("py_exact", "py_guess"):
                            first[model].append(timed(lambda m=model: c.infer(m, {"x": x})))
                    result[f"{path} first call, 1.2 MB, python"] = {m: median(s) for m, s in first.items()}
                    for label, shape in (("4 KiB", (1, 1, 32, 32)), ("1.2 MB", (1, 1, 640, 480))):
                        x = rng.standard_normal(shape).astype(np.float32)
                        steady = {"guess": [], "exact": []}
                        for model in steady:
                            timed(lambda m=model: c.infer(m, {"x": x}))  # its first call
                        for i in range(args.calls):
                            for model in ("guess", "exact") if i % 2 else ("exact", "guess"):
                                steady[model].append(timed(lambda m=model: c.infer(m, {"x": x})))
                        result[f"{path} steady, {label}"] = {m: median(s) for m, s in steady.items()}
            print(json.dumps(result, indent=1))
        finally:
            server.terminate()
            server.wait(60)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
