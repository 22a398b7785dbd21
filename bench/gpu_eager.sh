#!/usr/bin/env bash
# One device call for the eager path (issue 22): host time per attention call with the attention replayed from CUDA
# graphs and launched directly, then the eager-graph and compiled-decode tests. Usage: bench/gpu_eager.sh OUT_DIR [tests]
set -o pipefail
out=${1:?usage: bench/gpu_eager.sh OUT_DIR [test files]}
tests=${2:-tests/test_eager_graphs.py tests/test_compiled_decode.py}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
for mode in graphs direct; do
  flag=""; [[ $mode == direct ]] && flag="--no-eager-graphs"
  timeout 150 python3 -m experiments.compile.eager_host_profile --top 25 $flag > "$out/host_$mode.txt" 2>&1
  echo "== $mode rc=$?"; grep -E "host us|kernels per call" "$out/host_$mode.txt"
done
timeout 420 python3 -m pytest -q -rA --tb=short $tests > "$out/tests.log" 2>&1
echo "== tests rc=$?"; grep -E "passed|failed|PASSED|FAILED|ERROR|Error" "$out/tests.log" | tail -40
