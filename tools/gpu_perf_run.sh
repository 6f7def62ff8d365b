#!/bin/bash
# The device run behind docs/gpu.md "Performance round two on the H200" (2026-12-02): from the
# repository root on a machine with an NVIDIA GPU, with the wheels its image lacks in .whl/
# (posix_ipc, orjson, httptools, tritonclient and its deps; docs/gpu.md) and $OUT a folder for
# the JSON reports.  GPU tests, the compiled hot path under that Python, shmserve bench on the
# CPU identity model (one client, a client sweep, a fairness mix), CUDA graphs, gpu_check.
set -u
OUT=${OUT:-/tmp/gpu-perf}
. tools/device_env.sh || exit 1
nproc; nvidia-smi --query-gpu=name,pci.bus_id --format=csv,noheader; date -u
echo "== gpu tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_v2.py \
    tests/test_gpu_lifecycle.py tests/test_gpu_graphs.py tests/test_gpu_placement.py tests/test_worker_ready.py \
    tests/test_cuda_graphs.py 2>&1 | tail -8
echo "== hot path"; timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_hotpath.py tests/test_infer_lanes.py 2>&1 | tail -3
echo "== bench, one client"
timeout 150 shmserve bench --spawn-server --payload 4KiB,16MiB --requests 3000 --json-out "$OUT/bench1.json" | grep "^|"
echo "== bench, client sweep"
timeout 150 shmserve bench --spawn-server --payload 4KiB --mode inline --clients 1,2,4,8,16 --duration 3 \
    --json-out "$OUT/sweep_inline.json" | grep "^|"
timeout 120 shmserve bench --spawn-server --payload 4KiB --mode zero-copy --clients 1,8,16 --duration 3 | grep "^|"
echo "== fairness"; timeout 60 shmserve bench --spawn-server --payload 4KiB --mix inline:4,zero-copy:4 --duration 5 | tail -6
echo "== cuda graphs"; timeout 120 python3 tools/bench_cuda_graphs.py | tail -14
echo "== gpu_check"; timeout 200 python3 tools/gpu_check.py --quick --json-out "$OUT/gpu_check.json" | tail -45
