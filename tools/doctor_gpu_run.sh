#!/bin/bash
# shmserve doctor on a GPU machine (the lead runs it on the H200 device; docs/gpu.md records it):
# from the repository root, with the wheels its image lacks in .whl/ if any (as tools/gpu_perf_run.sh),
# and $OUT a folder for what comes back.  Captures, as JSON and as the table:
#   1. doctor with no server (the host and GPU checks; the GPU model's config for memlock and placement);
#   2. doctor against a live server: a torch convnet on cuda:0 (2 workers, copy mode), an ONNX Runtime
#      CPU model whose 2 workers share CPUs 0-1 with 4 intra-op threads each (placement.threads must
#      fire), a python model fed a new input shape on every call (service.shapes must fire);
#   3. nvidia-smi's raw answer to doctor's query (which fields this driver refused), and doctor's tests.
set -u
OUT=${OUT:-/tmp/doctor-gpu}
. tools/device_env.sh || exit 1
nproc; nvidia-smi --query-gpu=name,pci.bus_id,driver_version --format=csv,noheader; date -u
export COLUMNS=120

echo "== nvidia-smi as doctor asks it"
python3 - > "$OUT/nvidia_smi.json" <<'EOF'
import json
from shmserve.doctor import gpu
facts = gpu.query(gpu.find_nvidia_smi())
print(json.dumps({"command": facts.command, "error": facts.error, "dropped": facts.dropped,
                  "cuda_version": facts.cuda_version, "tensorrt": facts.tensorrt, "rows": facts.rows}, indent=1))
EOF
python3 -c "import json; d = json.load(open('$OUT/nvidia_smi.json')); print('dropped:', d['dropped'], 'cuda:', d['cuda_version'], 'error:', d['error'])"
cat /sys/bus/pci/devices/*/current_link_speed 2>/dev/null | sort | uniq -c | head -5

WORK=$(mktemp -d)
python3 - "$WORK" <<'EOF'
import sys
from pathlib import Path
from shmserve.config import demo_config
from shmserve.models.torchnets import save_models
work = Path(sys.argv[1])
paths = save_models(work)
spec = ('inputs = [{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}]\n'
        'outputs = [{name = "scores", dtype = "float32", shape = ["batch", 10]}]\n')
(work / "gpu.toml").write_text(f"""[server]
instance = "doctorgpu"

[[models]]
name = "convnet"
backend = "torch"
path = "{paths['torchscript']}"
device = "cuda:0"
io_mode = "copy"
instances = 2
{spec}
[[models]]
name = "crowded"
backend = "onnxruntime"
path = "{demo_config().models[0].path}"
instances = 2
cpus = "0-1"
[models.options]
intra_op_threads = 4

[[models]]
name = "shifting"
backend = "python"
path = "shmserve.models:identity"
""")
EOF

echo "== doctor, no server (exit status: 0, or 1 with a critical finding)"
timeout 120 shmserve doctor --instance doctorgpu --config "$WORK/gpu.toml" --json > "$OUT/doctor_none.json"; echo "exit $?"
timeout 120 shmserve doctor --instance doctorgpu --config "$WORK/gpu.toml" -v | tee "$OUT/doctor_none.txt"

echo "== doctor, a live server"
SOCK="$WORK/s.sock"
shmserve serve --config "$WORK/gpu.toml" --socket "$SOCK" > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 240); do shmserve info --socket "$SOCK" >/dev/null 2>&1 && break; sleep 0.5; done
shmserve health --socket "$SOCK"  # degraded (exit 1) if a model did not load: the log says why
shmserve info --socket "$SOCK" >/dev/null || { tail -30 "$OUT/server.log"; kill "$SERVER"; exit 1; }
timeout 120 python3 - "$SOCK" <<'EOF'
import sys, time
import numpy as np
from shmserve import Client
image = np.random.rand(1, 3, 32, 32).astype(np.float32)
calls = {"convnet": [{"image": image}] * 300, "crowded": [{"image": image}] * 50,
         "shifting": [{"x": np.arange(n, dtype=np.uint8)} for n in range(1, 101)]}  # a new shape on every call
with Client(sys.argv[1]) as c:
    for model, inputs in calls.items():
        try:
            for x in inputs:
                c.infer(model, x)
        except Exception as exc:
            print(f"{model}: {exc}")
time.sleep(2)  # the workers tell their signature counts within a second
EOF
timeout 120 shmserve doctor --instance doctorgpu --json > "$OUT/doctor_live.json"; echo "exit $?"
timeout 120 shmserve doctor --instance doctorgpu -v | tee "$OUT/doctor_live.txt"
shmserve info --socket "$SOCK" --json > "$OUT/info.json"
kill -TERM "$SERVER"; wait "$SERVER"; echo "server exit $?"
python3 - "$OUT" <<'EOF'
import json, sys
for name in ("doctor_none", "doctor_live"):
    d = json.load(open(f"{sys.argv[1]}/{name}.json"))
    print(name, d["server"], d["summary"])
    for f in d["findings"]:
        print(f"  {f['severity']:8} {f['check']:18} {f['subject'][:60]}: {f['title']}")
EOF

echo "== doctor's tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_doctor_host.py tests/test_doctor_gpu.py \
    tests/test_doctor_service.py tests/test_doctor_live.py 2>&1 | tail -8
rm -rf "$WORK"
