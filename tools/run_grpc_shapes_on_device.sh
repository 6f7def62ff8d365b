#!/bin/bash
# The gRPC server-shape comparison of issue 25 (tools/grpc_shapes.py) on a 16-core device host: from
# the repository root, Python 3.12, no network, with the wheels the image lacks in .whl/ (as
# tools/gpu_perf_run.sh: tritonclient and its deps, protobuf 6.33.6; for the grpclib shape also
# grpclib, h2, hpack, hyperframe and a cp312 multidict: without them that shape is left out) and
# $OUT a folder for the reports.  About 7 minutes (each step has its own timeout, 9 minutes in all,
# so one command of the device's 10-minute limit holds it: run it with timeout_s 600).  Writes to
# $OUT: install.log, summary.txt (every table), breakdown.json (where the server's CPU goes, per
# thread), shapes_4k.json (every shape, 1, N/2 and N clients), handlers.json (unary, stream, the
# loop hop), payloads.json (4 KiB and 1 MiB, the grpcio stub and tritonclient).
set -u
OUT=${OUT:-/tmp/grpc-shapes}
. tools/device_env.sh || exit 1
exec > >(tee "$OUT/summary.txt") 2>&1
nproc; date -u; python3 -c "import grpc, sys; print('python', sys.version.split()[0], 'grpcio', grpc.__version__)"
GRPCLIB=grpclib-uvloop
python3 -c "import grpclib, h2" 2>/dev/null || { GRPCLIB=""; echo "grpclib not importable: its shape is left out"; }
P=$(nproc)
H=$((P / 2))
echo "== breakdown: where the server's CPU goes (1 client, stub, 4 KiB, stream handler)"
PERF=""; command -v perf >/dev/null && PERF=--perf
timeout 110 python3 tools/grpc_shapes.py --breakdown $PERF --requests 3000 --rounds 3 \
    --shapes "aio-uvloop,aio-uvloop-iomgr,sync-t1,sync-t4,sync-t4-iomgr${GRPCLIB:+,$GRPCLIB}" \
    --json-out "$OUT/breakdown.json"
echo "== shapes: the door's stream handler, 4 KiB, grpcio stub, 1/$H/$P clients"
timeout 200 python3 tools/grpc_shapes.py --time-limit 170 --rounds 4 --duration 1.0 --sizes 4KiB --clients stub \
    --concurrency "1,$H,$P" --handlers stream \
    --shapes "aio-uvloop,aio-asyncio,aio-uvloop-iomgr,aio-uvloop-latency,sync-t4,sync-t8,sync-t4-iomgr${GRPCLIB:+,$GRPCLIB},aio-uvloop-p4,aio-uvloop-p$H,aio-uvloop-p$P,aio-uvloop-iomgr-p$P,sync-t4-p$H,sync-t4-p$P" \
    --json-out "$OUT/shapes_4k.json" | grep -v "^# round"
echo "== handlers: unary, stream, and stream plus a hop through an asyncio loop (sync), 4 KiB, 1/$P clients"
timeout 90 python3 tools/grpc_shapes.py --time-limit 70 --rounds 4 --duration 1.0 --sizes 4KiB --clients stub \
    --concurrency "1,$P" --handlers unary,stream,hop --shapes "aio-uvloop,sync-t4,sync-t4-p$P" \
    --json-out "$OUT/handlers.json" | grep -v "^# round"
echo "== payloads and clients: 4 KiB and 1 MiB, grpcio stub and tritonclient, 1 and $P clients"
timeout 150 python3 tools/grpc_shapes.py --time-limit 120 --rounds 3 --duration 1.0 --sizes 4KiB,1MiB --clients stub,triton \
    --concurrency "1,$P" --handlers stream --shapes "aio-uvloop,aio-uvloop-bdp,sync-t4,aio-uvloop-p$P" \
    --json-out "$OUT/payloads.json" | grep -v "^# round"
date -u
