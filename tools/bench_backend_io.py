#!/usr/bin/env python3
"""What the server adds to a real-size ONNX model: in-process vs through a lane vs ``Client.infer``.

Issue 14 part 5 measures the server's overhead on PP-OCRv4 recognition
(1x3x48x320 float32 in, ~1 MB out, ~11 ms on one thread).  That model is not
available offline, so this builds one of the same sizes: a seeded conv net
(``build_model``: six 3x3 convolutions, a mean over the height, a 256->6625
projection and a softmax; ``x`` float32[batch, 3, 48, 320] -> ``y``
float32[batch, 40, 6625], 1.06 MB a row).  It serves the model twice in one
server, ``ocr`` (ONNX Runtime bound to the arena: ``io_binding``, the
default) and ``ocr_copy`` (``io_binding = false``: outputs copied, the path
before issue 14), and measures, interleaved in rounds so the machine's noise
falls on every case alike:

  in-process          InferenceSession.run, same options as the worker (1 thread)
  lane, <model>       Client.zero_copy: one call reused, inputs written once
  infer, <model>      Client.infer: through the lane, inputs copied in, outputs copied into new arrays
  socket, <model>     Client(lanes=False).infer: inputs and outputs inline over the Unix socket

and the worker's own part alone, in this process: the real adapter's ``run_into``
writing into a shared mapping, bound and copied (what the change saves, free
of the hand-offs' noise), plus the copy a torch CPU model pays for the same output (``torch`` tensor
``copy_`` into a shared-memory view: a general nn.Module cannot write into a
preallocated output).

usage: python tools/bench_backend_io.py [--rounds N] [--per-round K] [--pin CPU] [--json-out FILE]
Prints a Markdown table: p50/p90 in ms and the p50 above in-process (ms and %).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

SEED = 20261202
IN_SHAPE = (1, 3, 48, 320)
STEPS, CLASSES = 40, 6625  # PP-OCRv4 rec's output: 40 time steps of 6625 classes


def build_model(path: Path) -> None:
    """Write the benchmark model to ``path`` (needs the ``onnx`` package)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(SEED)

    def weight(name, shape):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32), name)

    channels = [(3, 64, 2), (64, 128, 2), (128, 256, 2), (256, 256, 1), (256, 256, 1), (256, 256, 1)]  # (in, out, stride): 48x320 -> 6x40
    nodes, inits, last = [], [], "x"
    for i, (cin, cout, stride) in enumerate(channels):
        inits += [weight(f"w{i}", (cout, cin, 3, 3)), numpy_helper.from_array(np.zeros(cout, np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [last, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1] * 4,
                                   strides=[stride, stride]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        last = f"r{i}"
    inits += [numpy_helper.from_array(np.array([2], np.int64), "axes"), weight("proj", (256, CLASSES))]
    nodes += [helper.make_node("ReduceMean", [last, "axes"], ["pooled"], keepdims=0),  # [b, 256, 40]
              helper.make_node("Transpose", ["pooled"], ["steps"], perm=[0, 2, 1]),  # [b, 40, 256]
              helper.make_node("MatMul", ["steps", "proj"], ["logits"]),
              helper.make_node("Softmax", ["logits"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "ocr_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               ["batch", 3, 48, 320])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", STEPS, CLASSES])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def start_server(workdir: Path, model: Path, pin: int | None = None) -> tuple[subprocess.Popen, str]:
    from shmserve.bench import serve_config

    sock = str(workdir / "bench.sock")
    cfg = workdir / "bench.toml"
    cpus = "" if pin is None else f'cpus = "{pin}"\n'
    models = "".join(f'[[models]]\nname = "{name}"\nbackend = "onnxruntime"\npath = "{model}"\n{cpus}'
                     f'[models.options]\nio_binding = {flag}\n' for name, flag in (("ocr", "true"),
                                                                                  ("ocr_copy", "false")))
    cfg.write_text(f'[server]\ninstance = "benchio-{uuid.uuid4().hex[:8]}"\nmax_request_bytes = {64 << 20}\n'
                   + models)
    return serve_config(cfg, sock), sock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--pin", type=int, help="pin the workers and the in-process cases to this CPU, the client to "
                    "N + a quarter of the CPUs (tools/bench_glue.py --pin says why)")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    try:
        import onnx  # noqa: F401 - build_model's; asked here, before anything starts
        import onnxruntime as ort
        import torch
    except ImportError as exc:  # make serve's environment has neither torch nor onnx: say so
        print(f"bench_backend_io: {exc}: it needs torch and onnx besides shmserve (make test's environment "
              "has both; or pip install -e '.[torch,onnx]')", file=sys.stderr)
        return 2

    from shmserve import Client
    from shmserve.bench import interleaved, wait_models_ready
    from shmserve.config import ModelConfig
    from workers.adapter import BackendAdapter

    with tempfile.TemporaryDirectory(prefix="bench-io-") as tmp:
        workdir = Path(tmp)
        model = workdir / "ocr_like.onnx"
        build_model(model)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(SEED).standard_normal(IN_SHAPE, dtype=np.float32)
        reference = session.run(["y"], {"x": x})[0]
        shm = mmap.mmap(-1, reference.nbytes)  # a shared mapping, as the arena is
        torch_out = torch.from_numpy(np.ndarray(reference.shape, reference.dtype, buffer=shm))
        torch_value = torch.from_numpy(reference.copy())
        out_area = mmap.mmap(-1, reference.nbytes + 4096)
        adapters = {}
        for name, flag in (("bound", True), ("copied", False)):
            config = ModelConfig(name=name, backend="onnxruntime", path=str(model), options={"io_binding": flag})
            adapter = BackendAdapter.load(config)
            adapter.warm_up(config, adapter.prepare(config))
            adapters[name] = adapter

        def run_into(adapter):
            def allocate(name, shape, dtype):
                return np.ndarray(shape, dtype, buffer=out_area, offset=64)
            if adapter.run_into is not None:
                adapter.run_into({"x": x}, allocate)
            else:  # what workers.step does with a run backend: put each output into the area
                for name, value in adapter.run({"x": x}).items():
                    np.copyto(allocate(name, value.shape, value.dtype), value, casting="no")

        proc, sock = start_server(workdir, model, args.pin)
        try:
            with Client(sock) as c, Client(sock, lanes=False) as over_socket:
                wait_models_ready(c, 120)
                calls = {}
                for name in ("ocr", "ocr_copy"):
                    call = c.zero_copy(name, {"x": (IN_SHAPE, np.float32)})
                    call.inputs["x"][...] = x
                    assert np.array_equal(call.run()["y"], reference), name  # bit for bit, both ways
                    assert np.array_equal(c.infer(name, {"x": x})["y"], reference), name
                    calls[name] = call
                def copied_lane(call):  # what infer does around a lane call: x copied in, y out into a new array
                    call.inputs["x"][...] = x
                    return {name: view.copy() for name, view in call.run().items()}

                cases = {
                    "in-process": lambda: session.run(["y"], {"x": x}),
                    "adapter run_into, bound (this process)": lambda: run_into(adapters["bound"]),
                    "adapter run_into, copied (this process)": lambda: run_into(adapters["copied"]),
                    "lane, ocr (bound)": calls["ocr"].run,
                    "lane, ocr_copy (copied)": calls["ocr_copy"].run,
                    "lane + the copies infer makes, ocr (bound)": lambda: copied_lane(calls["ocr"]),
                    "infer, ocr (bound)": lambda: c.infer("ocr", {"x": x}),
                    "infer, ocr_copy (copied)": lambda: c.infer("ocr_copy", {"x": x}),
                    "socket (infer, lanes=False), ocr (bound)": lambda: over_socket.infer("ocr", {"x": x}),
                    "torch copy_ of the output into shared memory": lambda: torch_out.copy_(torch_value),
                }
                cpus = None if args.pin is None else {
                    k: args.pin if k == "in-process" or "this process" in k or k.startswith("torch") else
                    (args.pin + max(1, os.cpu_count() // 4)) % os.cpu_count() for k in cases}
                samples = interleaved(cases, args.rounds, args.per_round, SEED, warm=3, cpus=cpus)
                for call in calls.values():
                    call.release()
        finally:
            proc.terminate()
            proc.wait(30)
    p50 = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    base = p50["in-process"]
    rows = []
    print("| case | p50 ms | p90 ms | p50 − in-process ms | % |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key, values in samples.items():
        p90 = float(np.percentile(values, 90)) * 1e3
        over = p50[key] - base
        is_model = key != "in-process" and not key.startswith("torch")
        rows.append({"case": key, "p50_ms": p50[key], "p90_ms": p90, "n": len(values)})
        print(f"| {key} | {p50[key]:.3f} | {p90:.3f} | {over:+.3f} | {100 * over / base:+.1f} % |" if is_model else
              f"| {key} | {p50[key]:.3f} | {p90:.3f} | | |")
    print(f"\nadapter counts: bound {adapters['bound'].backend.io}, copied {adapters['copied'].backend.io}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "rounds": args.rounds, "per_round": args.per_round},
                                                  indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
