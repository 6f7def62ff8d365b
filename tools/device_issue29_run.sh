#!/bin/bash
# The device runs behind docs/performance.md "Priorities", "Fairness between paths", the lane A/B of the
# scheduler and docs/doors.md "Measuring" (issues 29 and 25, 2026-12-03): from the repository root on the
# 16-core GPU host, the wheels its image lacks in .whl/, the tree before the scheduler (b7100ee, `git archive`)
# in .ab/b7100ee, $OUT a folder for the JSON.  Two parts, each within one call:
#   a: the lane round trip before and after, interleaved (1 and 16 clients, 4 KiB), then --priority-mix
#      and --mix (sleepy 1 ms model, and identity)
#   b: tools/doors_bench.py (doors 0, 2, 4, 8), the gRPC shared-memory case (1 MiB x 8) and bench_cancel
#   c: py-spy (carried in .whl) on one worker of each tree under 16 lane clients: where the worker's time goes
#   d: the lane round trip before and after only, 4 rounds interleaved
#   e: the lane round trip of every tree in .ab/ (each a `git archive COMMIT shmserve workers setup.py
#      pyproject.toml __init__.py`, named by its commit) and of this one, 2 rounds interleaved, each run followed
#      by tools/lane_parts.py (one client's call in parts, from its slot's stamps): which commit cost what, where
#   f: tools/lane_pinned.py (every process on a CPU of its own: workers 2 and 3, main 1, clients from 4) on
#      .ab/b7100ee, .ab/a9df4ac (before the compiled checked claim) and this tree, 6 rounds interleaved; then, with
#      EXTRA=1, part e's unpinned bench of b7100ee and this tree (2 rounds) and --mix on a 1 ms model; with GLUE=1,
#      tools/device_issue26_glue.sh, in the same call (TREES: the .ab trees, ROUNDS: how many, NOMIX=1: no --mix)
# usage: OUT=/tmp/i29 bash tools/device_issue29_run.sh a|b|c|d|e|f
set -u
OUT=${OUT:-/tmp/i29}
. tools/device_env.sh || exit 1
export PYTHONUNBUFFERED=1
nproc; nvidia-smi --query-gpu=name --format=csv,noheader; date -u
HERE=$PWD
BENCH="python3 -m shmserve.cli bench"
if [ "$1" = a ] || [ "$1" = d ]; then
    (cd .ab/b7100ee && python3 setup.py -q build_ext --inplace > "$OUT/before_build.log" 2>&1) || tail -5 "$OUT/before_build.log"
    rounds="1 2 3"; [ "$1" = d ] && rounds="1 2 3 4"
    for round in $rounds; do
        for tree in before after; do
            root=$HERE; [ $tree = before ] && root=$HERE/.ab/b7100ee
            echo "== lane $tree round $round ($(date -u +%T))"
            (cd "$root" && PYTHONPATH=$root:${PYTHONPATH:-} timeout 150 python3 -m shmserve.cli bench --spawn-server \
                --mode inline --payload 4KiB --clients 1,16 --requests 20000 --json-out "$OUT/lane_${tree}_$round.json" \
                2>/dev/null | grep -E "^\| 4 KiB")
        done
    done
    [ "$1" = d ] && exit 0
    echo "== priority mix, 1 ms model ($(date -u +%T))"
    timeout 120 $BENCH --spawn-server --priority-mix 1:1,9:8 --duration 10 --model-us 1000 --json-out "$OUT/prio.json" 2>/dev/null
    echo "== mix, 1 ms model ($(date -u +%T))"
    timeout 90 $BENCH --spawn-server --mix inline:2,zero-copy:2,socket:2,http:2 --model-us 1000 --duration 10 \
        --json-out "$OUT/mix_slow.json" 2>/dev/null
    echo "== mix, identity ($(date -u +%T))"
    timeout 90 $BENCH --spawn-server --mix inline:2,zero-copy:2,socket:2,http:2 --duration 10 \
        --json-out "$OUT/mix_identity.json" 2>/dev/null
elif [ "$1" = e ]; then
    trees=$(ls .ab)
    for t in $trees; do (cd .ab/$t && python3 setup.py -q build_ext --inplace > "$OUT/build_$t.log" 2>&1) || tail -3 "$OUT/build_$t.log"; done
    for round in 1 2; do
        for tree in $trees head; do
            root=$HERE; [ $tree = head ] || root=$HERE/.ab/$tree
            echo "== lane $tree round $round ($(date -u +%T))"
            (cd "$root" && PYTHONPATH=$root:${PYTHONPATH:-} timeout 100 python3 -m shmserve.cli bench --spawn-server \
                --mode inline --payload 4KiB --clients 1,16 --requests 20000 --json-out "$OUT/lane_${tree}_$round.json" \
                2>/dev/null | grep -E "^\| 4 KiB")
            echo -n "parts: "
            (cd "$root" && PYTHONPATH=$root:${PYTHONPATH:-} timeout 60 python3 "$HERE/tools/lane_parts.py" --calls 10000 \
                2>&1 | tail -1)
        done
    done
elif [ "$1" = f ]; then
    trees=${TREES:-b7100ee a9df4ac}
    for t in $trees; do (cd .ab/$t && python3 setup.py -q build_ext --inplace > "$OUT/build_$t.log" 2>&1) || tail -3 "$OUT/build_$t.log"; done
    for round in $(seq 1 ${ROUNDS:-6}); do
        for tree in $trees head; do
            root=$HERE; [ $tree = head ] || root=$HERE/.ab/$tree
            echo -n "$tree round $round ($(date -u +%T)): "
            (cd "$root" && PYTHONPATH=$root:${PYTHONPATH:-} timeout 60 python3 "$HERE/tools/lane_pinned.py" --calls 20000 \
                --clients 12 2>&1 | tail -1)
        done
    done
    if [ -n "${EXTRA:-}" ]; then
        for round in 1 2; do
            for tree in b7100ee head; do
                root=$HERE; [ $tree = head ] || root=$HERE/.ab/$tree
                echo "== lane, unpinned, $tree round $round ($(date -u +%T))"
                (cd "$root" && PYTHONPATH=$root:${PYTHONPATH:-} timeout 100 python3 -m shmserve.cli bench --spawn-server \
                    --mode inline --payload 4KiB --clients 1,16 --requests 20000 2>/dev/null | grep -E "^\| 4 KiB")
            done
        done
        if [ -z "${NOMIX:-}" ]; then
            echo "== mix, 1 ms model ($(date -u +%T))"
            timeout 90 $BENCH --spawn-server --mix inline:2,zero-copy:2,socket:2,http:2 --model-us 1000 --duration 8 \
                2>/dev/null | tail -8
        fi
    fi
    [ -n "${GLUE:-}" ] && bash tools/device_issue26_glue.sh
elif [ "$1" = c ]; then
    (cd .ab/b7100ee && python3 setup.py -q build_ext --inplace > "$OUT/before_build.log" 2>&1) || tail -5 "$OUT/before_build.log"
    for tree in before after; do
        root=$HERE; [ $tree = before ] && root=$HERE/.ab/b7100ee
        echo "== py-spy $tree ($(date -u +%T))"
        (cd "$root" && PYTHONPATH=$root:${PYTHONPATH:-} timeout 60 python3 -m shmserve.cli bench --spawn-server \
            --mode inline --payload 4KiB --clients 16 --duration 14 2>/dev/null | grep -E "^\| 4 KiB") &
        sleep 9
        pid=$(pgrep -f '"name":"identity"' | head -1)
        echo "worker $pid: $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-120)"
        timeout 20 /tmp/site/bin/py-spy record -d 5 -r 400 --format raw -o "$OUT/spy_$tree.txt" -p "$pid" --nonblocking 2>&1 | tail -2
        wait
        python3 - "$OUT/spy_$tree.txt" <<'PY'
import collections, sys
own, total = collections.Counter(), collections.Counter()
n = 0
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip().rpartition(" ")
    c = int(count); n += c
    frames = stack.split(";")
    own[frames[-1]] += c
    for f in set(frames):
        total[f] += c
print("samples", n)
print("-- own"); [print(f"{100*c/n:5.1f}% {f[:150]}") for f, c in own.most_common(22)]
print("-- total"); [print(f"{100*c/n:5.1f}% {f[:150]}") for f, c in total.most_common(30)]
PY
    done
else
    echo "== doors ($(date -u +%T))"
    timeout 330 python3 tools/doors_bench.py --doors 0,2,4,8 --clients 1,16 --requests 5000 --json-out "$OUT/doors.json"
    echo "== grpc shm 1 MiB ($(date -u +%T))"
    timeout 120 $BENCH --spawn-server --protocol grpc --mode shm --payload 1MiB --clients 1,8 --requests 300 \
        --json-out "$OUT/grpc_shm.json" 2>/dev/null
    echo "== cancel ($(date -u +%T))"
    timeout 100 python3 tools/bench_cancel.py 2>&1 | tail -12
fi
date -u
