# `make demo` and `make test` create the virtual environment on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel on this machine; installed before the package so no dependency can pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.rlpo_installed

.PHONY: venv demo test clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlpo-mega train configs/demo_cpu.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests -q -p no:cacheprovider

clean:
	rm -rf $(VENV) *.egg-info
