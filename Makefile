# The torch pin lives here only: the CPU build our CI machine has on local disk.
# Override for a GPU cluster, e.g. `make venv TORCH="torch==2.13.0 --index-url ..."`.
TORCH ?= torch==2.13.0
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: venv
	OMP_NUM_THREADS=1 TRICORN_STRICT_WARNINGS=1 $(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

demo: venv
	$(PY) scripts/demo.py

lint: venv
	$(VENV)/bin/ruff check tricorn tests bench scripts pretrain_gpt.py
	$(VENV)/bin/ruff format --check tricorn tests bench scripts pretrain_gpt.py

clean:
	rm -rf $(VENV) demo_out
