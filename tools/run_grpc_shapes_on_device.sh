#!/bin/bash
# The gRPC server-shape comparison of issue 25 (tools/grpc_shapes.py) on a 16-core device host: from
# the repository root, Python 3.12, no network, with the wheels the image lacks in .whl/ (as
# tools/gpu_perf_run.sh: tritonclient and its deps, protobuf 6.33.6; for the h2lean and h2 shapes
# h2 4.x, hpack 4.x, hyperframe 6.x; for grpclib's also grpclib 0.4 and a cp312 multidict: a shape
# whose library is missing is left out) and $OUT a folder for the reports.  About 8 minutes (each
# step has its own timeout, under 9 minutes in all, so one command of the device's 10-minute limit
# holds it: run it with timeout_s 600).  Writes to $OUT: install.log, summary.txt (every table),
# breakdown.json (where the server's CPU goes, per thread), shapes_4k.json (every shape, 1, N/2 and
# N clients), handlers.json (unary, stream, the loop hop), payloads.json (4 KiB and 1 MiB, the grpcio
# stub and tritonclient).
set -u
OUT=${OUT:-/tmp/grpc-shapes}
. tools/device_env.sh || exit 1
exec > >(tee "$OUT/summary.txt") 2>&1
nproc; date -u; python3 -c "import grpc, sys; print('python', sys.version.split()[0], 'grpcio', grpc.__version__)"
# the shapes on libraries beside grpcio: h2lean needs hpack, h2 needs h2 (both in shmserve's test extras),
# grpclib needs grpclib; a shape whose library is missing is left out (and said so)
OWN=""
for pair in hpack:h2lean-uvloop h2:h2-uvloop grpclib:grpclib-uvloop; do
    if python3 -c "import ${pair%%:*}" 2>/dev/null; then OWN="$OWN,${pair#*:}"; else echo "no ${pair%%:*}: ${pair#*:} left out"; fi
done
P=$(nproc)
H=$((P / 2 > 2 ? P / 2 : 2))
LEAN=""; case "$OWN" in *h2lean*) LEAN=",h2lean-uvloop-p$H,h2lean-uvloop-p$P";; esac
echo "== breakdown: where the server's CPU goes (1 client, stub, 4 KiB, stream handler)"
PERF=""; command -v perf >/dev/null && PERF=--perf
timeout 100 python3 tools/grpc_shapes.py --breakdown $PERF --requests 2000 --rounds 3 \
    --shapes "aio-uvloop,aio-uvloop-iomgr,sync-t1,sync-t4,sync-t4-iomgr$OWN" --json-out "$OUT/breakdown.json"
echo "== shapes: the door's stream handler, 4 KiB, grpcio stub, 1/$H/$P clients"
timeout 210 python3 tools/grpc_shapes.py --time-limit 180 --rounds 3 --duration 1.0 --sizes 4KiB --clients stub \
    --concurrency "1,$H,$P" --handlers stream \
    --shapes "aio-uvloop,aio-asyncio,aio-uvloop-iomgr,sync-t4,sync-t8,sync-t4-iomgr$OWN,aio-uvloop-p4,aio-uvloop-p$H,aio-uvloop-p$P,aio-uvloop-iomgr-p$P,sync-t4-p$H,sync-t4-p$P$LEAN" \
    --json-out "$OUT/shapes_4k.json" | grep -v "^# round"
echo "== handlers: unary, stream, and stream plus a hop through an asyncio loop (sync), 4 KiB, 1/$P clients"
timeout 80 python3 tools/grpc_shapes.py --time-limit 60 --rounds 4 --duration 1.0 --sizes 4KiB --clients stub \
    --concurrency "1,$P" --handlers unary,stream,hop --shapes "aio-uvloop,sync-t4,sync-t4-p$P" \
    --json-out "$OUT/handlers.json" | grep -v "^# round"
echo "== payloads and clients: 4 KiB and 1 MiB, grpcio stub and tritonclient, 1 and $P clients"
LEAN1=""; case "$OWN" in *h2lean*) LEAN1=",h2lean-uvloop";; esac
timeout 130 python3 tools/grpc_shapes.py --time-limit 100 --rounds 3 --duration 1.0 --sizes 4KiB,1MiB --clients stub,triton \
    --concurrency "1,$P" --handlers stream --shapes "aio-uvloop,aio-uvloop-bdp,sync-t4,aio-uvloop-p$P$LEAN1" \
    --json-out "$OUT/payloads.json" | grep -v "^# round"
date -u
