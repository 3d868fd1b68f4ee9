# make train: the default training run (a GPT-MoE, 4 gloo workers, HSDP 2x2, ep 2, 200 steps) on this machine.
# make test:  the test suite.
# Both create .venv on first use: torch==2.13.0 is installed first, pinned (any other resolution can pull gigabytes
# of wheels), then this package in editable mode with its train and test extras (test includes hf: transformers).
# Extra pip flags for torch (e.g. a wheel index): make TORCH_PIP_ARGS='--index-url ...'. Extra flags for the job or
# pytest: make train ARGS='--steps 50'.

PYTHON ?= python3
VENV := .venv
TORCH_VERSION := 2.13.0
TORCH_PIP_ARGS ?=

.PHONY: train test clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
		|| $(VENV)/bin/pip install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(VENV)/bin/pip install -e '.[train,test]'
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/python -m shardfusion.train $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q $(ARGS)

clean-venv:
	rm -rf $(VENV)
