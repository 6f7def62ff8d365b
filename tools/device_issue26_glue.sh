#!/bin/bash
# The device run behind docs/performance.md "Issue 26's glue: the torch and Python backends on the CPU, and ~10 ms
# models" (2026-12-03): from the repository root on the 16-core H200 host, the wheels its image lacks in .whl/
# (tools/device_env.sh installs them), $OUT a folder for the JSON.  Under 5 minutes, one call.
#   tools/bench_glue.py --pin 2 --repeat 3 on this tree: 4 KiB through a lane (zero_copy) and infer for the
#   Python identity (the floor), a Python x + 0 and a TorchScript x + 0, against the bare models in the tool's
#   process (warm, and after a 50 us sleep), the workers' own compute stage; the ~10 ms models (TorchScript
#   conv net, Python numpy, Python 10 ms sleep) through a lane, infer and the socket against the bare model;
#   then the same with --repeat 2 on the tree before the torch backend's CPU short path, if it is in
#   .ab/glue_before (`mkdir -p .ab/glue_before && git archive a9df4ac | tar -x -C .ab/glue_before`; built here).
# usage: OUT=/tmp/i26g bash tools/device_issue26_glue.sh
set -u
OUT=${OUT:-/tmp/i26g}
. tools/device_env.sh || exit 1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
HERE=$PWD
quiet() { grep -v -i -E "warn|^ *$|deprecat"; }
nproc; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null; date -u; git log -1 --format=%h 2>/dev/null
echo "== glue, this tree, pinned to CPU 2 ($(date -u +%T))"
timeout 150 python3 tools/bench_glue.py --pin 2 --repeat 3 --json-out "$OUT/glue_after.json" 2>&1 | quiet | tail -70
if [ -d .ab/glue_before ]; then
    (cd .ab/glue_before && python3 setup.py -q build_ext --inplace > "$OUT/before_build.log" 2>&1) \
        || tail -5 "$OUT/before_build.log"
    echo "== glue, the tree before, pinned to CPU 2 ($(date -u +%T))"
    (cd .ab/glue_before && PYTHONPATH=$HERE/.ab/glue_before:${PYTHONPATH:-} timeout 110 python3 \
        "$HERE/tools/bench_glue.py" --pin 2 --repeat 2 --json-out "$OUT/glue_before.json" 2>&1 | quiet | tail -70)
fi
echo "== done ($(date -u +%T))"
