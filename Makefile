# megatron_dapo make targets. `make install && make train` and `make test` are the two set-up
# commands of the README; everything runs from the repo's own files.
SHELL := /bin/bash
# The first Python >= 3.11 on PATH, 3.11 preferred (tools/find_python.sh); PY=... chooses another.
PY ?= $(shell bash tools/find_python.sh 2>/dev/null)
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
CONFIG ?= configs/tiny_cpu.yaml
# The Python of the targets that work on a run's model or data (eval-aime, data, tensorboard): the project's
# venv, else a `python` that already has megatron_dapo (the cluster image: no CPU venv is made beside its CUDA
# torch), else the venv that `make install` makes (tools/run_python.sh).
HAVE_PY = $(shell bash tools/run_python.sh $(VENV))
RUN_PY = $(or $(HAVE_PY),$(BIN)/python)
RUN_DEPS = $(if $(HAVE_PY),,install)
export PYTHONHASHSEED := 0

.PHONY: install train test test-all lint bench bench-trl verl-env verl-assets liger-env sglang-env gpu-wheels clean train-dapo-32b \
	train-dapo-32b-wo-ds train-dapo-32b-early train-moe tensorboard data eval-aime docker

# torch==2.13.0 first: on the CPU machines it is a CPU build on local disk (an unpinned torch
# would pull a multi-GB CUDA build). A stamp file keeps a re-run to a quick up-to-date check.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PY)" || { bash tools/find_python.sh; exit 2; }
	@command -v $(PY) >/dev/null || { echo "PY=$(PY) is not on PATH"; exit 2; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

train: install
	$(BIN)/python -m megatron_dapo.train --config $(CONFIG) $(ARGS)

# The default suite: everything but the `slow` and `gpu` markers. It includes the tests against real
# SGLang servers (tests/sglang_real), which run in their own venv. The 15 slowest tests, and the 15 that
# used the most CPU with the processes they waited for (tests/conftest.py), are listed at the end, so growth
# is seen when it happens. The two venvs build side by side (a fresh machine: 114 s instead
# of 162 s one after the other). TEST_WORKERS pytest-xdist workers run the tests (2: on 2 cores the suite
# takes 28 minutes instead of 36, many of its tests wait on servers and processes; 3 took 19.9 minutes
# against 17.8 for 2, their multi-process tests contending); the tests of the two
# shared real servers run on one of them, so the servers start once (tests/conftest.py). TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup

# The project's modules are compiled once first: with PYTHONDONTWRITEBYTECODE set, each of the suite's ~700
# processes would compile every module it imports again (the pyc files are gitignored).
test:
	@$(MAKE) --no-print-directory -j2 install sglang-env
	@$(BIN)/python -m compileall -q -j 2 megatron_dapo kernels tests benchmarks tools > /dev/null
	MEGATRON_DAPO_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(BIN)/python -m pytest -q $(XDIST) \
		-m "not slow and not gpu" --durations=15 $(ARGS)

test-all: install sglang-env
	MEGATRON_DAPO_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(BIN)/python -m pytest -q $(XDIST) \
		-m "not gpu" $(ARGS)

SGLANG_VENV ?= .venv-sglang
SGLANG_ENV_FILES := $(wildcard tests/sglang_env/*.sh tests/sglang_env/*.txt tests/sglang_env/*.py \
	tests/sglang_env/*.pth tests/sglang_env/sgl_kernel/*.py)
# The real SGLang server of the tests (0.5.23 beside the CPU torch, its environment shims; about
# 2-3 minutes and 3.5 GB), never a project dependency. A re-run is a no-op until its files change.
sglang-env: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: $(SGLANG_ENV_FILES)
	bash tests/sglang_env/build.sh $(SGLANG_VENV) $(PY)
	touch $@

lint: install
	$(BIN)/ruff check megatron_dapo kernels tests benchmarks
	$(BIN)/python tools/check_line_counts.py

# Every benchmark but the TRL comparison, which needs its own venv (make bench-trl); the SGLang ones
# start real servers from the SGLang venv.
bench: install sglang-env
	@for b in $(filter-out benchmarks/bench_vs_trl.py,$(wildcard benchmarks/bench_*.py)); do \
		echo "== $$b"; MEGATRON_DAPO_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(BIN)/python $$b || exit 1; done

TRL_VENV ?= .venv-trl
# TRL's GRPOTrainer against ours on one workload; TRL lives in its own venv, never a project dependency.
bench-trl: install $(TRL_VENV)/.installed
	OMP_NUM_THREADS=2 $(BIN)/python benchmarks/bench_vs_trl.py --trl-python $(TRL_VENV)/bin/python $(ARGS)

$(TRL_VENV)/.installed:
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(TRL_VENV)/bin/python -m pip install -q "trl==1.13.0" "transformers==5.24.0" "accelerate==1.15.0" \
		"datasets==5.2.0" requests
	touch $@

VERL_VENV ?= .venv-verl
# verl 0.9.1, the reference of the parity tests (tests/assets/verl/), in its own venv: never a project
# dependency. --no-deps skips verl's training stack (vllm, flash-attn, ...); the pinned packages after
# it are exactly what its reward, loss, advantage and rollout-correction modules import (plus
# safetensors to write the assets), at the versions the committed assets were recorded with.
verl-env: $(VERL_VENV)/.installed

$(VERL_VENV)/.installed:
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(VERL_VENV)/bin/python -m pip install -q --no-deps "verl==0.9.1"
	$(VERL_VENV)/bin/python -m pip install -q "packaging==25.0" "numpy==2.4.6" "tensordict==0.10.0" \
		"omegaconf==2.4.0" "transformers==5.10.4" "ray==2.60.0" "codetiming==1.4.0" "math-verify==0.9.0" \
		"sympy==1.14.0" "safetensors==0.8.0"
	touch $@

# Re-record verl's outputs into tests/assets/verl/ (then run the parity tests and commit the assets).
verl-assets: verl-env
	$(VERL_VENV)/bin/python tools/verl_reference.py

LIGER_VENV ?= .venv-liger
# The kernels' peers for benchmarks/bench_kernels.py, in their own venv (never project dependencies):
# Liger-Kernel's fused linear GRPO loss, and verl 0.9.1's core_algos (--no-deps: only the packages
# that `import verl.trainer.ppo.core_algos` needs). `make bench` runs bench_kernels.py against it.
liger-env: $(LIGER_VENV)/.installed

$(LIGER_VENV)/.installed:
	test -x $(LIGER_VENV)/bin/python || $(PY) -m venv $(LIGER_VENV)
	$(LIGER_VENV)/bin/python -m pip install -q --upgrade pip
	$(LIGER_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(LIGER_VENV)/bin/python -m pip install -q "liger-kernel==0.8.5"
	$(LIGER_VENV)/bin/python -m pip install -q --no-deps "verl==0.9.1"
	$(LIGER_VENV)/bin/python -m pip install -q "numpy==2.4.6" "omegaconf==2.4.0" "packaging==26.4" "ray==2.60.0" \
		"tensordict==0.15.3" "transformers==5.24.0" "codetiming==1.4.0" "orjson==3.13.0"
	$(LIGER_VENV)/bin/python -c "import liger_kernel.chunked_loss, verl.trainer.ppo.core_algos"
	touch $@

GPU_WHEELS ?= .gpu-wheels
# The wheels tests/gpu/run_all.sh installs on a GPU machine without network (tests/gpu/wheels.txt: CPython
# 3.12, manylinux x86_64, no dependencies), downloaded into $(GPU_WHEELS) and checked; see docs/gpu.md.
gpu-wheels: install
	$(BIN)/python tools/gpu_wheels.py download --dest $(GPU_WHEELS)

# The 16 x 8 H800 runs submit through SLURM (launch/slurm/dapo_16x8_h800.sbatch). DRY_RUN=1 prints
# every command per node instead and needs no Slurm: the script runs under bash, and outside an
# allocation it previews the 16 nodes its #SBATCH header asks for (made-up names). Extra trainer
# overrides go in ARGS.
SBATCH ?= sbatch
SBATCH_SCRIPT := launch/slurm/dapo_16x8_h800.sbatch
SUBMIT = $(if $(filter 1,$(DRY_RUN)),DRY_RUN=1 bash,$(SBATCH))
TB_PORT ?= 6006
TB_LOGDIR ?= runs
DAPO_MATH ?=
AIME ?=
EVAL_MODEL ?=
EVAL_DATA ?= data/aime-2024.parquet
EVAL_ENGINE ?= sglang
EVAL_SERVERS ?= 2
EVAL_TP ?= 4

train-dapo-32b:
	RECIPE=configs/dapo_qwen2.5_32b.yaml $(SUBMIT) $(SBATCH_SCRIPT) $(ARGS)

train-dapo-32b-wo-ds:
	RECIPE=configs/dapo_wo_ds_qwen2.5_32b.yaml $(SUBMIT) $(SBATCH_SCRIPT) $(ARGS)

train-dapo-32b-early:
	RECIPE=configs/dapo_early_qwen2.5_32b.yaml $(SUBMIT) $(SBATCH_SCRIPT) $(ARGS)

train-moe:
	RECIPE=configs/dapo_qwen3_30b_a3b.yaml $(SUBMIT) $(SBATCH_SCRIPT) $(ARGS)

tensorboard: $(RUN_DEPS)
	$(RUN_PY) -m tensorboard.main --logdir $(TB_LOGDIR) --host 127.0.0.1 --port $(TB_PORT)

data: $(RUN_DEPS)
	@test -n "$(DAPO_MATH)$(AIME)" || { echo "usage: make data DAPO_MATH=path/to/dapo-math-17k.parquet AIME=path/to/aime-2024.parquet"; exit 2; }
	$(RUN_PY) -m megatron_dapo.data.prepare $(if $(DAPO_MATH),--dapo-math $(DAPO_MATH)) $(if $(AIME),--aime $(AIME)) --out-dir data $(ARGS)

# AIME 2024 avg@32 / pass@k of a checkpoint or HF directory (DAPO's sampling: T=1.0, top_p=0.7), through
# EVAL_SERVERS SGLang servers of EVAL_TP GPUs each that the evaluator launches (a trainer checkpoint is
# exported to HF first); EVAL_ENGINE=local generates in one process (small models).
eval-aime: $(RUN_DEPS)
	@test -n "$(EVAL_MODEL)" || { echo "usage: make eval-aime EVAL_MODEL=path/to/hf-or-mcore-dir [EVAL_DATA=...] [EVAL_TP=4 EVAL_SERVERS=2 | EVAL_ENGINE=local]"; exit 2; }
	$(RUN_PY) -m megatron_dapo.eval --model $(EVAL_MODEL) --data $(EVAL_DATA) --n 32 --temperature 1.0 \
		--top-p 0.7 --max-tokens 20480 --engine $(EVAL_ENGINE) \
		$(if $(filter sglang,$(EVAL_ENGINE)),--servers $(EVAL_SERVERS) rollout.tensor_model_parallel_size=$(EVAL_TP)) $(ARGS)

# The cluster image: NGC PyTorch + SGLang + this project (docker/Dockerfile). BASE_IMAGE and
# SGLANG_VERSION must agree on torch's major.minor (the build checks it).
IMAGE ?= megatron-dapo:latest
BASE_IMAGE ?=
SGLANG_VERSION ?=
docker:
	docker build -f docker/Dockerfile $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
		$(if $(SGLANG_VERSION),--build-arg SGLANG_VERSION=$(SGLANG_VERSION)) -t $(IMAGE) .

clean:
	rm -rf $(VENV) $(TRL_VENV) $(VERL_VENV) $(LIGER_VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache
