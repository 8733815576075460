#!/usr/bin/env bash
# Creates .venv once (idempotent): CPU torch 2.13.0 where no CUDA GPU is present, the default
# CUDA build otherwise, then the project in editable mode with its dev, plots and docs extras, and
# tutel from a local wheel folder when there is one (WHEELS, default ../shared/wheels; without it
# the project goes on without tutel, whose tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.ds_dhelix_ready
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q torch
else
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev,plots,docs]"
wheels=${WHEELS:-../shared/wheels}
for whl in "$wheels"/tutel-*.whl; do
  if [ -f "$whl" ]; then .venv/bin/python -m pip install -q --no-deps "$whl"; fi
done
touch "$stamp"
