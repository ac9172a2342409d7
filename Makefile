# Two commands do all set-up on a fresh machine:
#   make demo   venv + gpulab + Fashion-MNIST, then train LeNet on every available device
#   make test   venv + gpulab + Fashion-MNIST, then the test suite
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
# torch is pinned: on this project's CPU machines 2.13.0 is a CPU build on local disk; an
# unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-all setup data bench clean

demo: setup data
	$(VENV)/bin/gpulab train --devices auto

# --durations=15: the run ends with its 15 slowest tests (README's "Tests" says what the suite takes where).
test: setup data
	$(PY) -m pytest -q --durations=15

test-all: setup data
	$(PY) -m pytest -q -m "" --durations=15

bench: setup data
	$(VENV)/bin/gpulab bench all

# The stamp names the torch asked for, so `make TORCH=...` installs it into an existing venv too.
INSTALLED = $(VENV)/.installed-$(shell printf '%s' '$(TORCH)' | md5sum | cut -c1-10)

setup: $(INSTALLED)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

# torch first: installing gpulab before it would pull an unpinned torch.
$(INSTALLED): $(VENV)/bin/python pyproject.toml
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e ".[dev,onnx,frameworks]"
	rm -f $(VENV)/.installed*
	touch $@

data: setup
	bash scripts/ensure-data.sh $(PY)

clean:
	rm -rf $(VENV) runs .pytest_cache
