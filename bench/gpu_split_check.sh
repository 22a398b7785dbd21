#!/usr/bin/env bash
# One device call for a change to how split layers decode (issue 59, item 1), most wanted first: the CUDA history
# kernel's GPU tests; the default against uniform rows through `generate` (`bench.generate --caches
# oscar-default,oscar`) at 32k/1 and 100k/8; one layer's decode attention (`bench.head_split`), with the tree before
# the change too where BEFORE names one; where the default's compiled step spends its time at 32k/1.
# Usage: bench/gpu_split_check.sh OUT_DIR [BEFORE]  (BEFORE: `git archive <commit> oscar_hf | tar -x -C BEFORE`,
# carried)
set -o pipefail
out=${1:?usage: bench/gpu_split_check.sh OUT_DIR [BEFORE]}
before=${2:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -x -k "not compiles" tests/test_kernels_cuda_history.py tests/test_kernels_head_split.py 2>&1 | tee "$out/tests.log" \
  | tail -15 || { echo "the GPU tests failed: no timings"; exit 1; }
for cell in "32768 1" "100000 8"; do
  set -- $cell
  python3 -m bench.generate --contexts $1 --batches $2 --oscar-batches $2 --caches oscar-default,oscar 2>&1 \
    | tee -a "$out/steps.log"
done
for tree in after ${before:+before}; do
  root=$PWD; [[ $tree == before ]] && root=$PWD/$before
  # -P: the working directory's oscar_hf must not shadow the earlier one on PYTHONPATH
  echo "== head_split, $tree" | tee -a "$out/head_split.log"
  PYTHONPATH=$root:$PWD python3 -P -m bench.head_split --contexts 32768,100000 --batches 1,8 \
    --out "$out/head_split-$tree.json" 2>&1 | tee -a "$out/head_split.log"
done
python3 -m bench.profile_generate --cache oscar-default --context 32768 --batch 1 --timeline --rows 25 \
  2>&1 | tee "$out/profile-oscar-default.log"
