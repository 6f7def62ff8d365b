# Two entry points, each sets up everything it needs from scratch in .venv:
#   make serve   install and run the service on its embedded default
#   make test    install with the test extras and run the whole suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: serve test clean

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

clean:
	rm -rf $(VENV) build *.egg-info shmserve/*.so .pytest_cache .hypothesis
