#!/usr/bin/env bash
# The GPU checks of issue 52 in one run (under 8 minutes on an H200), results as files:
#   scripts/device_check.sh [OUT_DIR]        (default: $OUT, else ./device_check_out)
# 1. the GPU tests: the engine against HF transformers on the device (greedy tokens, prefix hits;
#    tests/platforms/test_cuda_device.py), the Triton kernels compiled, decode graphs against eager,
#    the batched sampler on the device (tests/platforms/cuda/);
# 2. prefixserve/benchmarks/gpu_check.py: decode step times (batch 1, 16 over a shared 1,024-token
#    prefix, 64), an 8,192-token prefill against the bf16 matmul peak measured in the same run,
#    long-doc-qa against HF transformers on the same GPU, the nano-vllm-style throughput run.
# Each part has its own time limit, so one that hangs costs only its share. PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-device_check_out}}"
mkdir -p "$out"
py="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$out/summary.txt"
: > "$summary"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep "Model name"; \
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$out/machine.txt" 2>&1

run() {  # run NAME SECONDS COMMAND...
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - start))s" >> "$summary"
}

run tests 130 "$py" -m pytest -q -x -p no:cacheprovider tests/platforms/test_cuda_device.py tests/platforms/cuda
for check in decode prefill long-doc-qa; do
  run "$check" 80 "$py" -m prefixserve.benchmarks.gpu_check "$check" --out "$out"
done
run throughput 130 "$py" -m prefixserve.benchmarks.gpu_check throughput --out "$out"
tail -n 3 "$out/tests.log" >> "$summary"
cat "$out"/*.json >> "$summary" 2>/dev/null
cat "$summary"
