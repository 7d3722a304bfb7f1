# Two entry points, each self-contained on a fresh machine:
#   make lab    create/update .venv, install everything, open JupyterLab on notebooks/
#   make test   create/update .venv, install everything, run the unit tests and every notebook
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: lab test bench figures gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the requirements or the package metadata change.
$(VENV)/.installed: requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $@

lab: $(VENV)/.installed
	$(BIN)/jupyter lab notebooks/

test: $(VENV)/.installed
	$(BIN)/python -m pytest -p no:cacheprovider tests notebooks --nbval --nbval-current-env -q

figures: $(VENV)/.installed
	$(BIN)/python -m pipeline_lib.viz.figures images/

bench: $(VENV)/.installed
	$(BIN)/python bench/bench_pipe.py

# On a GPU machine: the GPU tests, and Pipe.step on 2 GPUs against the ideal.
gpu-check: $(VENV)/.installed
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV)
