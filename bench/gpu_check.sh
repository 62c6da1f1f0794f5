#!/usr/bin/env bash
# Issue 33's device check, prepared for a session lent an H200 (../.library/device/README.md); not yet run on one.
# The image has torch, safetensors, numpy and pytest but not pydantic: carry wheels for pydantic, pydantic-core
# (cp312), annotated-types and typing-inspection in .whl/ (the README's pip download line), then run
#   bash bench/gpu_check.sh        (about 6 minutes; $OUT gets gpu.txt, kernels.log, gpu_train.jsonl)
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# the CUDA branch of the attention against the reference, and the CPU equivalence tests
python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/unit/pipeline/test_train_kernels.py 2>&1 | tee "$OUT/kernels.log"
# Llama-3.1-8B and Kimi-K2 shapes at the issue's settings (token budget 8,192, TTT 7), then --compile on the first
timeout 300 python3 -m bench.gpu_train --steps 20 --dir /tmp 2>&1 | tee "$OUT/gpu_train.jsonl"
timeout 200 python3 -m bench.gpu_train --shape llama-3.1-8b --steps 20 --compile --dir /tmp 2>&1 | tee -a "$OUT/gpu_train.jsonl"
