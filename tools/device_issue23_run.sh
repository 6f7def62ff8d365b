#!/bin/bash
# The device run behind docs/gpu.md "Security round (issue 23) on the H200" and "`shmserve doctor` on
# the H200", and docs/performance.md "KServe v2 doors before and after the security round (issue 23)"
# (2026-12-02).  From the repository root (the commit to measure) on a machine with an NVIDIA GPU, with
# the wheels its image lacks in .whl/ or already on PYTHONPATH (as tools/gpu_perf_run.sh), $OUT a folder
# for what comes back, and $OLD a checkout of the commit to compare against (the one before the security
# round: f693aef; its C extensions are built in place there; unset: new against itself).  In this order,
# each part under a timeout so that the whole fits in $BUDGET seconds (default 525):
#   1. pytest -m gpu tests/ (tests/test_scale_out.py left out: it needs jsonschema and kubernetes-validate
#      and holds no GPU test), then the other tests of test_gpu_v2.py and test_doctor_worker.py;
#   2. shmserve bench over unix, http and grpc, 4 KiB and 1 MiB, 1 and 8 clients, every mode: old, new,
#      old, new (two of each: the noise), JSON in $OUT/bench; $DUR seconds a case, by default what the
#      budget leaves (1 to 3 s: each run is 28 cases and about 15 s of server start and floors);
#   3. the single-process doors' ceiling: 4 KiB inline, 16 clients, unix, http and grpc (new);
#   4. a summary of the bench JSON ($OUT/summary.md): each version's median of its runs, new/old, and
#      the old/old and new/new ratios beside them (run 2 over run 1);
#   5. tools/doctor_gpu_run.sh (doctor with no server and against a live server, doctor's tests) in
#      $OUT/doctor, with what time is left.
# With $PACK set, $OUT is tarred into $PACK after each part (a device run that returns few files).
# On the H200 host (16 cores) on 2026-12-02 it took 428 s: GPU tests 117 s, four bench runs of 57 s
# at 1 s a case, the ceiling 18 s, doctor 48 s.
# usage: OUT=/tmp/issue23 OLD=/path/to/old-checkout [DUR=3] [BUDGET=525] [PACK=f.tgz] bash tools/device_issue23_run.sh
set -u
OUT=${OUT:-/tmp/issue23}
OLD=${OLD:-}
BUDGET=${BUDGET:-525}
PAYLOADS=${PAYLOADS:-4KiB,1MiB}  # the bench matrix (narrower only to try the script out)
CLIENTS=${CLIENTS:-1,8}
NEW=$PWD
mkdir -p "$OUT/bench" "$OUT/tests"
pack() { [ -n "${PACK:-}" ] && tar -czf "$PACK" -C "$OUT" . ; return 0; }
stamp() { echo "== $* ($(date -u +%T), ${SECONDS}s)"; }
left() { echo $(( BUDGET - SECONDS - ${1:-0} )); }  # seconds of the budget left, less $1

. tools/device_env.sh || exit 1  # wheels under /tmp/site on PYTHONPATH, this checkout editable
SITE=${PYTHONPATH:-}
nproc; nvidia-smi --query-gpu=name,pci.bus_id,driver_version --format=csv,noheader; date -u
[ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$PWD" ] && git rev-parse HEAD  # only a checkout of its own
python3 -c "import sys, torch, shmserve; print(sys.version.split()[0], torch.__version__, shmserve.__file__)"
if [ -n "$OLD" ]; then
    (cd "$OLD" && python3 setup.py -q build_ext --inplace > "$OUT/old_build.log" 2>&1) || { tail -20 "$OUT/old_build.log"; OLD=; }
    # the old checkout's package ahead of the new one's editable install, run from its directory (python
    # -m puts the current directory first, and the old bench starts its server and clients with python -m)
    [ -n "$OLD" ] && (cd "$OLD" && PYTHONPATH="$OLD${SITE:+:$SITE}" python3 -c "import shmserve; print('old:', shmserve.__file__)")
fi

stamp "1. GPU tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ --ignore=tests/test_scale_out.py -rs \
    > "$OUT/tests/gpu.txt" 2>&1; echo "exit $?"; tail -15 "$OUT/tests/gpu.txt"
timeout 60 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_gpu_v2.py tests/test_doctor_worker.py -rs \
    > "$OUT/tests/v2_doctor_worker.txt" 2>&1; echo "exit $?"; tail -6 "$OUT/tests/v2_doctor_worker.txt"
pack

# what is left after the ceiling (40 s) and doctor (100 s), over four runs of 28 cases and ~15 s each
DUR=${DUR:-$(python3 -c "print(round(min(3.0, max(1.0, (($(left 140)) / 4 - 15) / 28 - 1.0)), 1))")}
bench() {  # bench VERSION RUN: one run of the v2-doors matrix
    local dir=$NEW path=$SITE
    [ "$1" = old ] && { dir=$OLD; path="$OLD${SITE:+:$SITE}"; }
    stamp "2. bench $1 run $2, $DUR s a case"
    (cd "$dir" && PYTHONPATH="$path" timeout 200 python3 -m shmserve.cli bench --spawn-server --protocol unix,http,grpc \
        --payload "$PAYLOADS" --clients "$CLIENTS" --duration "$DUR" --json-out "$OUT/bench/$1$2.json") | grep "^|"
}
if [ -n "$OLD" ]; then PAIR1="old 1,new 1"; PAIR2="old 2,new 2"; else PAIR1="new 1,new 2"; PAIR2="new 3,new 4"; fi
t0=$SECONDS; bench ${PAIR1%,*}; bench ${PAIR1#*,}; pack
if [ "$(left $(( 140 + SECONDS - t0 )))" -gt 0 ]; then  # the second pair only if it fits as the first did
    bench ${PAIR2%,*}; bench ${PAIR2#*,}
else
    echo "no second pair: the first took $(( SECONDS - t0 )) s, $(left) s left"
fi
pack

stamp "3. the doors' ceiling, 16 clients"
timeout 90 python3 -m shmserve.cli bench --spawn-server --protocol unix,http,grpc --payload 4KiB --clients 16 \
    --mode inline --duration 3 --json-out "$OUT/bench/ceiling16.json" | grep "^|"
pack

stamp "4. summary"
python3 - "$OUT/bench" <<'EOF' | tee "$OUT/summary.md"
import json, statistics, sys
from pathlib import Path
def results(f):  # a run cut short by its timeout leaves an empty file
    try:
        return json.loads(f.read_text())["results"]
    except (OSError, ValueError, KeyError):
        print(f"({f.name}: no results)")
runs = {}
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    if f.stem != "ceiling16" and results(f):
        runs.setdefault(f.stem.rstrip("0123456789"), []).append(results(f))
def table(results):
    return {(r["protocol"], r["mode"], r["payload"], r["clients"]): r for r in results}
def med(version, key, case):
    return statistics.median(table(res)[case][key] for res in runs[version])
def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
def ratio(a, b):
    return f"{a / b:.2f}" if b else "-"
def spread(version, key, case):  # the second run over the first: the noise of one version
    vals = [table(res)[case][key] for res in runs[version]]
    return ratio(vals[1], vals[0]) if len(vals) > 1 else "-"
if "new" in runs:
    old = "old" if "old" in runs else "new"  # without an old checkout: new against itself
    print("| protocol | mode | payload | clients | p50 µs old | p50 µs new | p50 new/old | old/old | new/new "
          "| req/s old | req/s new | req/s new/old | old/old | new/new |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in table(runs["new"][0]):
        p_old, p_new, r_old, r_new = med(old, "p50_us", case), med("new", "p50_us", case), \
            med(old, "rps", case), med("new", "rps", case)
        print(f"| {case[0]} | {case[1]} | {size(case[2])} | {case[3]} | {p_old:g} | {p_new:g} | {ratio(p_new, p_old)} | "
              f"{spread(old, 'p50_us', case)} | {spread('new', 'p50_us', case)} | {r_old:g} | {r_new:g} | "
              f"{ratio(r_new, r_old)} | {spread(old, 'rps', case)} | {spread('new', 'rps', case)} |")
    print("\necho floors, p50 µs, each run in turn (the same code in both: the machine's noise)")
    for version, version_runs in runs.items():
        for i, res in enumerate(version_runs, 1):
            floors = {f"{r['protocol']} {size(r['payload'])}": r["echo_floor_p50_us"] for r in res}
            print(f"  {version}{i}:", ", ".join(f"{k} {v}" for k, v in floors.items()))
ceiling = Path(sys.argv[1]) / "ceiling16.json"
if ceiling.exists() and results(ceiling):
    print("\n| 16 clients, 4 KiB | mode | p50 µs | p99 µs | req/s | floor p50 µs |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for r in results(ceiling):
        print(f"| {r['protocol']} | {r['mode']} | {r['p50_us']} | {r['p99_us']} | {r['rps']} | {r['echo_floor_p50_us']} |")
EOF
pack

stamp "5. doctor (tools/doctor_gpu_run.sh), $(left 5) s left"
if [ "$(left 5)" -gt 20 ]; then
    OUT="$OUT/doctor" timeout "$(left 5)" bash tools/doctor_gpu_run.sh; echo "exit $?"
fi
pack
stamp "done"
