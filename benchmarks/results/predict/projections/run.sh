#!/bin/bash
# The seed's and the peers' configurations projected by dhelix predict (no GPU, no processes):
#   bash benchmarks/results/predict/projections/run.sh      (from the repository root; ~5 min)
# Each writes <name>.json beside this file. Model shapes: configs/ (see README.md there).
set -eu
cd "$(dirname "$0")/../../../.."
C=benchmarks/results/predict/configs
O=benchmarks/results/predict/projections
run() { name=$1; shift; .venv/bin/dhelix predict "$@" --json > $O/$name.json; echo "$name done"; }
L70="--model $C/llama-70b-mha.json --seq-len 4096 --micro-batch-size 1 --micro-batches 16"
L13="--model $C/llama-2-13b.json --seq-len 4096 --micro-batch-size 1 --micro-batches 16 --zero-stage 1"
G13="--model $C/gpt3-13b.json --seq-len 2048 --micro-batch-size 1 --micro-batches 16 --zero-stage 1"
PHI="--model $C/phi-3.5-moe.json --seq-len 4096 --micro-batch-size 1 --micro-batches 16 --zero-stage 1"
for hw in A40 A800; do
  run llama70b-tp8-pp8-$hw $L70 --tp 8 --pp 8 --dp 1 --hardware $hw
  run llama13b-tp8-dp8-$hw $L13 --tp 8 --dp 8 --hardware $hw
  run gpt13b-tp8-dp8-$hw $G13 --tp 8 --dp 8 --hardware $hw
done
run phimoe-tp1-ep8-dp64-A800 $PHI --tp 1 --ep 8 --dp 64 --hardware A800
run phimoe-tp1-ep16-dp64-A800 $PHI --tp 1 --ep 16 --dp 64 --hardware A800
run phimoe-tp4-ep8-dp16-A800 $PHI --tp 4 --ep 8 --dp 16 --hardware A800
run llama70b-tp16-pp4-H100 $L70 --tp 16 --pp 4 --dp 1 --hardware H100
run llama70b-tp8-pp8-H100 $L70 --tp 8 --pp 8 --dp 1 --hardware H100
run llama13b-tp8-H100-domino --model $C/llama-2-13b.json --seq-len 2048 --micro-batch-size 4 --micro-batches 8 \
    --tp 8 --dp 1 --hardware H100
run llama7b-tp8-H100-domino --model $C/llama-2-7b.json --seq-len 2048 --micro-batch-size 4 --micro-batches 8 \
    --tp 8 --dp 1 --hardware H100
run llama7b-tp16-H100-domino --model $C/llama-2-7b.json --seq-len 2048 --micro-batch-size 4 --micro-batches 8 \
    --tp 16 --dp 1 --hardware H100
run qwen3-30b-a3b-ep16-H100 --model $C/qwen3-30b-a3b.json --seq-len 4096 --micro-batch-size 1 --micro-batches 64 \
    --tp 1 --ep 16 --dp 16 --zero-stage 1 --hardware H100
