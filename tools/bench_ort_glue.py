#!/usr/bin/env python3
"""What the ONNX Runtime glue adds to a small model (issue 26 item 2): 4 KiB through a lane and infer.

The target: a 4 KiB ORT model through a lane or ``Client.infer`` costs at most the Python
identity's round trip plus the bare ``session.run`` plus 5 us.  One server serves

  identity   the Python identity (shmserve.models:identity), uint8[n] -> the same
  ort        an ONNX Add of zero on uint8[n], ONNX Runtime bound to the arena (the default)
  ort_copy   the same with io_binding = false (a plain run, its output copied)

and, interleaved in rounds so the machine's noise falls on every case alike, this measures the
bare ``session.run`` in this process (one thread, as the worker's), and each model through a lane
(``Client.zero_copy``: one call reused) and through ``Client.infer``.  It prints p50/p90 in us and,
per path, the glue: model p50 - identity p50 - bare run p50 (target <= 5 us).

usage: python tools/bench_ort_glue.py [--payload 4096] [--rounds 20] [--per-round 200] [--json-out FILE]
Needs the onnx package (pip install 'shmserve[onnx]').
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

SEED = 20261202


def build_model(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    zero = helper.make_tensor("zero", TensorProto.UINT8, [1], [0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "zero"], ["y"])], "ort_identity",
                              [helper.make_tensor_value_info("x", TensorProto.UINT8, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, ["n"])], [zero])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--payload", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=200)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import onnxruntime as ort

    from shmserve import Client
    from shmserve.bench import interleaved, serve_config, wait_models_ready

    with tempfile.TemporaryDirectory(prefix="bench-glue-") as tmp:
        workdir = Path(tmp)
        model = workdir / "add.onnx"
        build_model(model)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(SEED).integers(0, 255, args.payload, dtype=np.uint8)
        cfg = workdir / "glue.toml"
        cfg.write_text(f'[server]\ninstance = "glue-{uuid.uuid4().hex[:8]}"\n'
                       '[[models]]\nname = "identity"\nbackend = "python"\npath = "shmserve.models:identity"\n'
                       + "".join(f'[[models]]\nname = "{name}"\nbackend = "onnxruntime"\npath = "{model}"\n'
                                 f'[models.options]\nio_binding = {flag}\n'
                                 for name, flag in (("ort", "true"), ("ort_copy", "false"))))
        sock = str(workdir / "glue.sock")
        proc = serve_config(cfg, sock)
        try:
            with Client(sock) as c:
                wait_models_ready(c, 120)
                cases = {"bare session.run (this process)": lambda: session.run(["y"], {"x": x})}
                calls = {}
                for name in ("identity", "ort", "ort_copy"):
                    call = c.zero_copy(name, {"x": (x.shape, np.uint8)})
                    call.inputs["x"][...] = x
                    assert np.array_equal(call.run()["y"], x) and np.array_equal(c.infer(name, {"x": x})["y"], x)
                    calls[name] = call
                    cases[f"lane, {name}"] = call.run
                    cases[f"infer, {name}"] = (lambda n: lambda: c.infer(n, {"x": x}))(name)
                samples = interleaved(cases, args.rounds, args.per_round, SEED, warm=200)
                for call in calls.values():
                    call.release()
        finally:
            proc.terminate()
            proc.wait(30)
    p50 = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    bare = p50["bare session.run (this process)"]
    rows = []
    print(f"{args.payload} bytes, {args.rounds} rounds x {args.per_round}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| case | p50 µs | p90 µs | glue: p50 − identity − bare run µs |\n| --- | ---: | ---: | ---: |")
    for key, values in samples.items():
        p90 = float(np.percentile(values, 90)) * 1e6
        path = key.split(",")[0]
        glue = p50[key] - p50.get(f"{path}, identity", 0) - bare if key.endswith(("ort", "ort_copy")) else None
        rows.append({"case": key, "p50_us": p50[key], "p90_us": p90, "glue_us": glue, "n": len(values)})
        print(f"| {key} | {p50[key]:.1f} | {p90:.1f} | {'' if glue is None else f'{glue:+.1f}'} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "payload": args.payload}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
