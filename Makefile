# Two commands on a fresh machine (Python 3.11, no GPU):  make train   and   make test
# Both bootstrap .venv idempotently (re-installing only when pyproject.toml changed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch (a local wheel on the project's machines); an unpinned torch would pull CUDA.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev,mpi]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/gem train --name default

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
