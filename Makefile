# Two entry points, each self-contained on a fresh machine:
#   make lab    create/update .venv, install everything, open JupyterLab on notebooks/
#               (as root too; prints the URL where no browser can open; make lab PORT=9000)
#   make student  write the student versions of the notebooks (exercises stubbed, no
#               outputs) into student/, not committed; open them with make lab FOLDER=student
#   make test   create/update .venv, install everything, run the unit tests and every notebook,
#               under nbval and in JupyterLab in Chromium (screenshots in out/browser/;
#               notebook 02's explorer runs and turns there)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: lab student test bench figures gpu-check mutants clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the requirements or the package metadata change.
$(VENV)/.installed: requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $@

# Empty: Jupyter's default (8888, or $JUPYTER_PORT); a taken port moves to the next free one.
PORT ?=
FOLDER ?= notebooks

lab: $(VENV)/.installed
	$(BIN)/python tools/lab.py --folder=$(FOLDER) $(if $(PORT),--port=$(PORT))

student: $(VENV)/.installed
	$(BIN)/python tools/student.py student

# Tests run in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one), each on one
# intra-op thread (two threads per worker on two cores spin against each other: 7% slower,
# measured), then the few that measure time (marked alone) with nothing beside them, on
# PyTorch's default threads. Both parts always run.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -p no:cacheprovider tests notebooks --nbval --nbval-current-env -q -rs \
		-n $(TEST_WORKERS) --dist loadfile -m "not alone"; parallel=$$?; \
	$(BIN)/python -m pytest -p no:cacheprovider tests -q -rs -m alone; alone=$$?; \
	test $$parallel -eq 0 && test $$alone -eq 0

figures: $(VENV)/.installed
	$(BIN)/python -m pipeline_lib.viz.figures images/

bench: $(VENV)/.installed
	$(BIN)/python bench/bench_pipe.py

# On a GPU machine: the GPU tests, and Pipe.step on 2 GPUs against the ideal.
gpu-check: $(VENV)/.installed
	$(BIN)/python bench/gpu_check.py

# Mutation testing of the core modules (tens of minutes; not part of CI). Needs
# requirements-dev.txt. Configuration: [tool.mutmut] in pyproject.toml; equivalent survivors:
# mutants-equivalent.md. A fresh run each time (mutmut keeps results in mutants/), niced, on
# one intra-op thread, and with 3 GB of address space per process, so that a mutant that loops
# forever appending to a list dies of MemoryError (a kill) instead of eating the machine's RAM.
mutants: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	rm -rf mutants
	ulimit -v 3000000 && OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 19 $(BIN)/mutmut run
	$(BIN)/python tools/mutation_scores.py --min 90

clean:
	rm -rf $(VENV)
