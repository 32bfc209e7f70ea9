#!/usr/bin/env bash
# tgengine GPU check: one short command on any CUDA machine; installs nothing.
#
#   bench/gpu_check.sh                      # default model, first GPU
#   MODEL=/path/to/hf-model bench/gpu_check.sh
#   OUT=/tmp/gpu-check DEVICE=cuda:1 bench/gpu_check.sh
#
# Runs, each under its own time limit (at most 7 minutes in all, plus at most 1 minute to
# convert the default model the first time):
#   1. the CPU float32 greedy parity tests (pytest tests/test_parity.py), if pytest is here;
#   2. greedy parity against transformers on the GPU, float32 (TF32 off) and bfloat16;
#   3. bench throughput: the issue's mixed workload, tgengine vs transformers generate
#      (batch 8/16/32) and generate_batch, bfloat16, KV cache sized from free GPU memory;
#   4. bench lifecycle: stop/pause/sleep/wakeup with 16 running requests, memory, RSS drift;
# then prints one table (python -m tgengine bench summary OUT). JSON, text and PNG files of
# every bench stay in OUT.
#
# The model: $MODEL, else the default model (SmolLM2-135M-Instruct, converted once into
# ~/.cache/tgengine; converting needs network), else -- offline -- a random-weight model of
# the same shape (tgengine.bench.synthetic): its speed is the real model's; its parity
# check still compares both engines on the same weights.
#
# Environment: PYTHON (default: python), MODEL, OUT (default: a new temp dir), DEVICE
# (default: cuda), DTYPE (default: bfloat16), QUICK=1 (tiny sizes: a smoke test of this
# script, e.g. DEVICE=cpu QUICK=1 MODEL=tiny-model-dir bench/gpu_check.sh).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
OUT=${OUT:-$(mktemp -d)/tgengine-gpu-check}
QUICK_ARGS=()
if [[ "${QUICK:-0}" == "1" ]]; then QUICK_ARGS=(--quick --threads 1); fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
failures=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, remember a failure
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)" >&2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/log.txt" 2>&1
  local status=$?
  echo "   $name: exit $status after $((SECONDS - start)) s" >&2
  if [[ $status -ne 0 ]]; then failures+=("$name (exit $status)"); fi
}

if [[ "$DEVICE" == cuda* ]]; then
  if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "error: torch sees no CUDA device (torch $("$PYTHON" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
  fi
  "$PYTHON" -c 'import torch; print("gpu:", torch.cuda.get_device_name(0), "torch", torch.__version__)' >&2
fi

if [[ -z "${MODEL:-}" ]]; then
  MODEL=$(timeout 60 "$PYTHON" -c 'from tgengine.default_model import ensure_default_model as e; print(e())' 2>>"$OUT/log.txt" | tail -n 1)
  if [[ -z "$MODEL" || ! -f "$MODEL/config.json" ]]; then
    echo "default model unavailable (offline?): using a random-weight model of its shape" >&2
    MODEL=$("$PYTHON" -m tgengine.bench.synthetic "$OUT/synthetic-smollm2" 2>>"$OUT/log.txt" | tail -n 1)
  fi
fi
echo "model: $MODEL; results: $OUT" >&2
COMMON=(--model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --out "$OUT" --no-progress "${QUICK_ARGS[@]}")

if "$PYTHON" -c 'import pytest' 2>/dev/null && [[ -f tests/test_parity.py ]]; then
  step "cpu parity tests" 90 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_parity.py
fi
step "gpu parity" 60 "$PYTHON" -m tgengine bench parity "${COMMON[@]}"
step "throughput" 210 "$PYTHON" -m tgengine bench throughput "${COMMON[@]}"
step "lifecycle" 60 "$PYTHON" -m tgengine bench lifecycle "${COMMON[@]}"

echo
"$PYTHON" -m tgengine bench summary "$OUT"
if [[ ${#failures[@]} -gt 0 ]]; then
  echo
  echo "failed: ${failures[*]} (see $OUT/log.txt)"
  exit 1
fi
