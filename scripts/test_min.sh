#!/usr/bin/env bash
# make test-min: a venv at the floor of every dependency range in pyproject.toml (.venv-min), then a
# smoke subset there: the version check, golden losses of a dense and an MoE family, train.py on
# two families, parity dense + MoE. A floor that does not pass is raised in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
[ -x .venv-min/bin/python ] || python3 -m venv .venv-min
.venv-min/bin/python -m pip install -q --upgrade pip packaging
.venv-min/bin/python scripts/floors.py > .venv-min/floors.txt
sed -i 's/^torch==\(.*\)$/torch==\1+cpu/' .venv-min/floors.txt
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then sed -i 's/+cpu$//' .venv-min/floors.txt; fi
.venv-min/bin/python -m pip install -q -r .venv-min/floors.txt pytest pytest-timeout hypothesis
.venv-min/bin/python -m pip install -q --no-deps -e .
.venv-min/bin/python -m pip check
# (not the extended test of test_versions.py: it runs this script, which would run it again)
.venv-min/bin/python -m pytest -q -x --timeout=600 -m "not extended" tests/test_versions.py \
  "tests/test_golden.py::test_losses_match_the_golden_file[tiny-llama]" \
  "tests/test_golden.py::test_losses_match_the_golden_file[tiny-qwen3-moe]"
for model in tiny-llama tiny-qwen3-moe; do
  .venv-min/bin/deepspeed --num_gpus 2 train.py --deepspeed ds_configs/tiny_llama_cpu.json --model "$model" \
    --steps 2 --seq-len 32 --output-dir "$(mktemp -d)"
done
.venv-min/bin/dhelix parity --model tiny-llama --tp 2 --steps 1 --timeout 300
.venv-min/bin/dhelix parity --model tiny-qwen3-moe --tp 1 --dp 2 --ep 2 --steps 1 --timeout 300
echo "test-min: the floors pass ($(tr '\n' ' ' < .venv-min/floors.txt))"
