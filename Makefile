# make demo: create .venv, install, train the demo GPT over 2 local processes.
# make test: create .venv if needed, install (and Debian's chromium: make browser), lint with ruff (pyproject's
# [tool.ruff]), run the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshc-installed
# The CPU build of PyTorch; a GPU user installs the CUDA build of the same version first (see README).
TORCH ?= torch==2.13.0

.PHONY: demo test install clean browser bench-deps

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshc demo

# Debian's Chromium for the report's browser tests (tests/compiler/test_report_html.py drives it headless over
# the DevTools protocol); where it cannot be installed (not root, no registry), those tests skip and say why,
# except under CI (CI set and not false/0/no, as .ci/run's environment sets it): there a browser test that
# skips would pass unseen, so this target fails, and so would the tests (tests/cdp.py: require_chromium).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium >/dev/null) || case "$$(printf %s "$$CI" | tr A-Z a-z)" in \
		""|0|false|no) echo "make browser: could not install chromium; the browser tests will be skipped";; \
		*) echo "make browser: could not install chromium, and CI=$$CI: under CI the browser tests must run;" \
			"install chromium (apt-get install chromium)" >&2; exit 1;; esac

# The peers the benchmarks measure side by side (not needed by the tests): DeepSpeed, and Debian's libaio for its
# nvme offload's async_io op (benchmarks/offload_bench.py).
bench-deps: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	@test -e /usr/include/libaio.h || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		libaio-dev >/dev/null) || echo "make bench-deps: could not install libaio-dev; DeepSpeed's nvme rows will say why"

test: $(STAMP) browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=10

clean:
	rm -rf $(VENV) meshc-out .pytest_cache
