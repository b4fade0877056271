# Two entry points that set themselves up on a fresh machine: `make demo`, `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := torch,jax,gpu,examples,dev
DEMO_ARGS ?=

.PHONY: setup test demo clean

setup: $(STAMP)

# --no-cache-dir: no second copy of the wheels (torch, jaxlib) in pip's cache; CI's disk once ran
# out in the middle of this install
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir --upgrade pip
	$(PY) -m pip install -q --no-cache-dir -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

# Triton kernels run on the CPU through the interpreter. The tests run on up to 4 worker processes
# (pytest-xdist, one per core): on a 2-core machine 560 s against 832 s in one process, 2026-12-02;
# PYTEST_ARGS="-n 0" runs them in one.
PYTEST_ARGS ?= -n auto --maxprocesses 4
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# In the development workspace the CIFAR-10 JPEG copy beside the repo is used when DEMO_ARGS names
# neither --data nor cifar100; elsewhere the demo finds or downloads its data (triaccel.data.resolve_data).
WORKSPACE_DATA := ../shared/data/cifar10-jpeg
DEMO_DATA := $(if $(wildcard $(WORKSPACE_DATA)),$(if $(findstring --data,$(DEMO_ARGS))$(findstring cifar100,$(DEMO_ARGS)),,--data $(WORKSPACE_DATA)))

demo: $(STAMP)
	$(PY) -m examples.cifar.train $(DEMO_DATA) $(DEMO_ARGS)

clean:
	rm -rf $(VENV)
