#!/bin/bash
# The device run behind docs/gpu.md "Real models on the H200" and docs/performance.md "ONNX Runtime glue
# on the H200 host" (2026-12-02): from the repository root on a machine with an NVIDIA GPU, the wheels its
# image lacks in .whl/ (as tools/gpu_perf_run.sh; torchvision, transformers and onnx are the image's), $OUT
# a folder for the JSON.  In order:
#   1. tools/gpu_zoo.py: resnet50 and a BERT-base encoder (random weights) on cuda:0 through lanes against
#      the bare model, 16-client batched throughput, correctness against the CPU;
#   2. tools/bench_ort_glue.py: a 4 KiB ONNX Runtime model against the Python identity and the bare run;
#   3. the gRPC system-shared-memory case the security round slowed (1 MiB, 8 clients of one token),
#      after the reservation fix (b610ad5);
#   4. shmserve bench --during-canary (lane p50 during a canary against without), where this checkout has it.
# usage: OUT=/tmp/round2 bash tools/device_round2_run.sh
set -u
OUT=${OUT:-/tmp/round2}
. tools/device_env.sh || exit 1
export PYTHONUNBUFFERED=1
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -c "import torch, torchvision, transformers; print(torch.__version__, torchvision.__version__, transformers.__version__)"
echo "== 1. gpu zoo ($(date -u +%T))"
timeout 330 python3 tools/gpu_zoo.py --json-out "$OUT/zoo.json" 2>&1 | grep -v -i -E "warn|is_causal|padding_length|loss_type" | tail -45
echo "== 2. ort glue ($(date -u +%T))"
timeout 100 python3 tools/bench_ort_glue.py --json-out "$OUT/glue.json" 2>&1 | tail -12
echo "== 3. grpc shm 1 MiB x 8 ($(date -u +%T))"
timeout 100 shmserve bench --spawn-server --protocol grpc --mode shm --payload 1MiB --clients 1,8 --duration 3 \
    --json-out "$OUT/grpc_shm.json" 2>&1 | grep "^|"
if shmserve bench --help | grep -q -- --during-canary; then
    echo "== 4. lanes during a canary ($(date -u +%T))"
    timeout 150 shmserve bench --spawn-server --during-canary --json-out "$OUT/canary.json" 2>&1 | tail -15
fi
echo "== done ($(date -u +%T))"
