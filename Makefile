# make demo: create .venv, install, train the demo GPT over 2 local processes.
# make test: create .venv if needed, install, lint with ruff (pyproject's [tool.ruff]), run the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshc-installed
# The CPU build of PyTorch; a GPU user installs the CUDA build of the same version first (see README).
TORCH ?= torch==2.13.0

.PHONY: demo test install clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshc demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) meshc-out .pytest_cache
