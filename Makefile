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

# The suite in two parts (tests/conftest.py says why): the tests that may share the cores, a
# pytest-xdist worker per usable core plus one (usable: the affinity mask capped by the cgroup's
# quota, as gpulab counts them; xdist's own `-n auto` counts physical cores, one on a 2-vCPU SMT
# VM; the extra worker fills the time the others spend waiting on the clock: hang timeouts, killed
# ranks; --dist loadscope: a module's tests in one worker, so its shared runs are made once), then
# those marked `alone` (the profiler's: they measure the machine) one after another. Both parts run
# even when the first fails; each ends with its 15 slowest tests (docs/benchmarks.md's "Tests: what
# the suite takes where").
SHARED = -n $(shell $(PY) -c "from gpulab.host import usable_cores; print(usable_cores() + 1)") --dist loadscope

test: setup data
	$(PY) -m pytest -q --durations=15 $(SHARED) -m "not slow and not alone"; shared=$$?; \
	$(PY) -m pytest -q --durations=15 -m "not slow and alone"; alone=$$?; \
	exit $$(( shared || alone ))

test-all: setup data
	$(PY) -m pytest -q --durations=15 $(SHARED) -m "not alone"; shared=$$?; \
	$(PY) -m pytest -q --durations=15 -m "alone"; alone=$$?; \
	exit $$(( shared || alone ))

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
