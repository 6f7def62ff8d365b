#!/bin/bash
# The device run behind docs/performance.md "Lanes during a canary on the H200 host" and "Door processes
# on the H200 host", and docs/gpu.md "Real models on the H200" (2026-12-02): from the repository root on a
# machine with an NVIDIA GPU and 16 cores, the wheels its image lacks in .whl/, $OUT a folder for the JSON.
#   1. shmserve bench --during-canary: lane p50 during a held split canary against without (issue 24);
#   2. the native socket with 0, 2 and 4 door processes, 4 KiB, 1 and 16 clients (issue 25);
#   3. tools/gpu_zoo.py: resnet50 and a BERT-base encoder on cuda:0 (issue 26 item 4).
# usage: OUT=/tmp/round3 bash tools/device_round3_run.sh
set -u
OUT=${OUT:-/tmp/round3}
. tools/device_env.sh || exit 1
export PYTHONUNBUFFERED=1
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
echo "== 1. lanes during a canary ($(date -u +%T))"
timeout 150 shmserve bench --spawn-server --during-canary --json-out "$OUT/canary.json" 2>&1 | tail -15
for doors in 0 2 4; do
    echo "== 2. socket, doors=$doors ($(date -u +%T))"
    timeout 100 shmserve bench --spawn-server --doors "$doors" --mode socket --payload 4KiB --clients 1,16 \
        --duration 3 --json-out "$OUT/doors$doors.json" 2>&1 | grep "^| 4"
done
echo "== 3. gpu zoo ($(date -u +%T))"
timeout 280 python3 tools/gpu_zoo.py --rounds 6 --per-round 20 --seconds 6 --json-out "$OUT/zoo.json" 2>&1 \
    | grep -v -i -E "warn|is_causal|padding_length|loss_type" | tail -45
echo "== done ($(date -u +%T))"
