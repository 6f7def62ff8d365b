# Two entry points, each sets up everything it needs from scratch in .venv:
#   make serve   install and run the service on its embedded default
#   make test    install with the test extras and run the whole suite
# (make test-hotpath-python: the lane tests again on the hot path's Python reference)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: serve test test-hotpath-python test-hotpath-asan clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

serve: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/shmserve serve $(SERVE_ARGS)

test: $(BIN)/python
	# the CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet 'torch==2.13.0'
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the lane and worker tests again on the Python reference of the hot path (shmserve/hotpath.py)
HOTPATH_TESTS := tests/test_hotpath.py tests/test_lanes.py tests/test_dispatcher.py tests/test_worker_batching.py \
	tests/test_worker_regions.py tests/test_client.py tests/test_hostile_regions.py tests/test_dtypes.py \
	tests/test_batching.py tests/test_serving.py
test-hotpath-python: $(BIN)/python
	SHMSERVE_HOTPATH=python $(BIN)/python -m pytest -p no:cacheprovider $(HOTPATH_TESTS) $(PYTEST_ARGS)

# the equivalence tests against an ASan + UBSan build of shmserve/_hotpath.c (gcc)
test-hotpath-asan: $(BIN)/python
	$(BIN)/python tools/hotpath_asan.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info shmserve/*.so .pytest_cache .hypothesis
