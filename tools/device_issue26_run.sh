#!/bin/bash
# The device runs behind docs/gpu.md "Eager GPU lanes and the glue" and docs/performance.md "torch and
# Python backend glue" (issue 26, 2026-12-02): from the repository root on a machine with an NVIDIA GPU,
# the wheels its image lacks in .whl/, $OUT a folder for the JSON.  Two parts (each within one call; b's pytest -m gpu over tests/ stopped at a tritonclient import, c runs the GPU files):
#   a: tools/gpu_eager_diag.py (--before: the torch backend before the change, if tools/_torch_before.py
#      is there), tools/gpu_zoo.py, and test_zoo's torchvision tests (torchvision is installed there)
#   c: the GPU test files, tools/bench_glue.py and tools/bench_backend_io.py with --pin 2
#   b: tools/gpu_eager_diag.py again, tools/bench_cuda_graphs.py, tools/bench_glue.py, tools/bench_backend_io.py, pytest -m gpu
# usage: OUT=/tmp/i26 bash tools/device_issue26_run.sh a|b|c
set -u
OUT=${OUT:-/tmp/i26}
. tools/device_env.sh || exit 1
export PYTHONUNBUFFERED=1
quiet() { grep -v -i -E "warn|is_causal|padding_length|loss_type|^ *$|deprecat"; }
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null
if [ "$1" = a ]; then
    before=(); [ -f tools/_torch_before.py ] && before=(--before tools/_torch_before.py)
    echo "== eager diag ($(date -u +%T))"
    timeout 200 python3 tools/gpu_eager_diag.py --rounds 10 --per-round 20 "${before[@]}" --json-out "$OUT/diag.json" 2>&1 | quiet | tail -60
    echo "== gpu zoo ($(date -u +%T))"
    timeout 260 python3 tools/gpu_zoo.py --rounds 6 --per-round 20 --seconds 6 --json-out "$OUT/zoo.json" 2>&1 | quiet | tail -40
    echo "== zoo torchvision tests ($(date -u +%T))"
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_zoo.py -k torchvision 2>&1 | tail -6
elif [ "$1" = c ]; then
    echo "== pytest gpu files ($(date -u +%T))"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_graphs.py \
        tests/test_gpu_lifecycle.py tests/test_gpu_placement.py tests/test_gpu_check_tool.py 2>&1 | tail -6
    echo "== glue, pinned ($(date -u +%T))"
    timeout 170 python3 tools/bench_glue.py --rounds 20 --per-round 100 --heavy-rounds 30 --heavy-per-round 4 \
        --pin 2 --json-out "$OUT/glue_pinned.json" 2>&1 | quiet | tail -30
    echo "== backend io, pinned ($(date -u +%T))"
    timeout 100 python3 tools/bench_backend_io.py --rounds 40 --per-round 5 --pin 2 --json-out "$OUT/io_pinned.json" \
        2>&1 | quiet | tail -16
else
    echo "== eager diag again ($(date -u +%T))"
    timeout 150 python3 tools/gpu_eager_diag.py --rounds 10 --per-round 20 --json-out "$OUT/diag_b.json" 2>&1 | quiet | tail -30
    echo "== cuda graphs bench ($(date -u +%T))"
    timeout 120 python3 tools/bench_cuda_graphs.py --rounds 20 --per-round 100 2>&1 | quiet | tail -14
    echo "== glue ($(date -u +%T))"
    timeout 170 python3 tools/bench_glue.py --rounds 20 --per-round 100 --heavy-rounds 30 --heavy-per-round 4 \
        --json-out "$OUT/glue.json" 2>&1 | quiet | tail -30
    echo "== backend io ($(date -u +%T))"
    timeout 100 python3 tools/bench_backend_io.py --rounds 40 --per-round 5 --json-out "$OUT/io.json" 2>&1 | quiet | tail -16
    echo "== pytest -m gpu ($(date -u +%T))"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/ 2>&1 | tail -6
fi
echo "== done ($(date -u +%T))"
