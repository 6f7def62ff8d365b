# Two entry points, each sets up everything it needs from scratch in .venv:
#   make serve   install and run the service on its embedded default
#   make test    install with the test extras and run the whole suite
# (make test-hotpath-python: the lane tests again on the hot path's Python reference)
# Every step says what it does and about how long it takes before it starts, and pip's own steps
# show as they happen (a line each: what it collects, builds and installs), so a wait is never
# silent; a step that fails stops make (pipefail: pip's status, not the filter's).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
SAY    := @printf 'make: %s\n'
PIP_STEPS := sed -u -n -E '/^(Collecting|Processing|Obtaining|Installing collected|Successfully)|^ +(Installing build|Getting requirements|Preparing|Building)/p'

.PHONY: serve test test-hotpath-python test-hotpath-asan clean

$(BIN)/python:
	$(SAY) "creating the virtual environment $(VENV) (about 15 s)"
	$(PYTHON) -m venv $(VENV)
	$(SAY) "upgrading pip in $(VENV) (about 10 s)"
	$(BIN)/python -m pip install --quiet --upgrade pip

serve: $(BIN)/python
	$(SAY) "installing shmserve and its dependencies into $(VENV) (about a minute the first time, 15 s after)"
	@$(BIN)/python -m pip install -e . | $(PIP_STEPS)
	$(SAY) "starting the service: it says 'ready' once its workers have loaded and warmed up the demo model"
	$(BIN)/shmserve serve $(SERVE_ARGS)

test: $(BIN)/python
	# the CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(SAY) "installing the CPU build of torch into $(VENV) (a minute or two the first time, seconds after)"
	@$(BIN)/python -m pip install 'torch==2.13.0' | $(PIP_STEPS)
	$(SAY) "installing shmserve with its test extras into $(VENV) (about two minutes the first time, 15 s after)"
	@$(BIN)/python -m pip install -e '.[test]' | $(PIP_STEPS)
	$(SAY) "running the tests (about 10 minutes on 2 cores)"
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the lane and worker tests again on the Python reference of the hot path (shmserve/hotpath.py)
HOTPATH_TESTS := tests/test_hotpath.py tests/test_lanes.py tests/test_dispatcher.py tests/test_worker_batching.py \
	tests/test_worker_regions.py tests/test_client.py tests/test_hostile_regions.py tests/test_dtypes.py \
	tests/test_batching.py tests/test_serving.py tests/test_output_sizes.py
test-hotpath-python: $(BIN)/python
	SHMSERVE_HOTPATH=python $(BIN)/python -m pytest -p no:cacheprovider $(HOTPATH_TESTS) $(PYTEST_ARGS)

# the equivalence tests against an ASan + UBSan build of shmserve/_hotpath.c (gcc)
test-hotpath-asan: $(BIN)/python
	$(BIN)/python tools/hotpath_asan.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info shmserve/*.so .pytest_cache .hypothesis
