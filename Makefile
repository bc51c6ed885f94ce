# Two commands: `make demo` sets up and runs the demo, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned here, not in pyproject: the CPU build of this version installs without a
# multi-GB CUDA download. On a GPU machine, install the torch you need first.
TORCH_PIN ?= torch==2.13.0
TRANSFORMERS_PIN ?= transformers==5.17.0

.PHONY: setup test demo clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIN) $(TRANSFORMERS_PIN)
	$(BIN)/pip install --quiet -e '.[test,nixl,mooncake-cpu]'
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest tests --durations=25

demo: setup
	$(BIN)/moeserve demo
	$(BIN)/moeserve demo --pd

clean:
	rm -rf $(VENV) .pytest_cache
