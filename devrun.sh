set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 setup.py build_ext --inplace -q 2>&1 | tail -2
python3 -m pip list 2>/dev/null | grep -i -E "onnx|pytest|hypothesis|prometheus|rich|uvloop|numpy|torch " 
nproc
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_torch_backend.py tests/test_lanes.py tests/test_rings.py tests/test_atomics.py tests/test_batching.py 2>&1 | tail -15
timeout 300 python3 tools/gpu_check.py --json $OUT/gpu_check.json 2>&1 | tail -40
timeout 200 python3 -m shmserve.cli bench --spawn-server --payload 4KiB --mode both --clients 1 --requests 3000 2>&1 | tail -5
timeout 200 python3 -m shmserve.cli bench --spawn-server --model identity_batched --payload 4KiB --mode both --clients 8 --duration 4 2>&1 | tail -5
ls /dev/shm
