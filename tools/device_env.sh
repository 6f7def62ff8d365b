# Sourced by the device scripts (gpu_perf_run.sh, doctor_gpu_run.sh, run_grpc_shapes_on_device.sh) from
# the repository root, with $OUT set: makes $OUT, installs the wheels carried in .whl/ (if any) under
# /tmp/site and puts it on PYTHONPATH, then this checkout (`pip install --no-deps --no-build-isolation
# -e .`, its log in $OUT/install.log).  Returns non-zero (after the log's tail) if an install fails.
# usage: OUT=${OUT:-/tmp/name}; . tools/device_env.sh || exit 1
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; return 1; }
