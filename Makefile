# The two commands of the README: `make run` (main job on the embedded default) and `make test`.
SHELL := /bin/bash
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export NO_MKDOCS_2_WARNING ?= 1
CONFIG ?= ds_configs/tiny_llama_cpu.json
NUM_RANKS ?= 2
ARGS ?=

.PHONY: venv run lint test test-all test-min docs docs-serve
venv:
	@bash scripts/bootstrap.sh

run: venv
	.venv/bin/deepspeed --num_gpus $(NUM_RANKS) train.py --deepspeed $(CONFIG) $(ARGS)

lint: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test: venv lint
	.venv/bin/python -m pytest -q -x --timeout=900 --durations=25 -m "not extended" tests

test-all: venv lint
	.venv/bin/python -m pytest -q -x --timeout=900 --durations=25 tests

# a venv at the floor of every dependency range (.venv-min) and a smoke subset there
test-min:
	bash scripts/test_min.sh

docs: venv
	.venv/bin/mkdocs build --strict

docs-serve: venv
	.venv/bin/mkdocs serve
