#!/usr/bin/env bash
# Where the default's layers split by KV heads lose time against uniform rows (issue 59, item 1), in one device call:
# one layer's decode attention (`bench.head_split`: uniform, split and 4-bit layers, CUDA-graph timed) at 32k and 100k,
# batch 1 and 8, with the default four waves of splits and with one and two; then the compiled step's kernels at 32k/1
# for the default (`oscar-default`) and for uniform rows (`oscar`), `bench.profile_generate --timeline`.
# Usage: bench/gpu_split_cost.sh OUT_DIR
set -o pipefail
out=${1:?usage: bench/gpu_split_cost.sh OUT_DIR}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m bench.head_split --contexts 32768,100000 --batches 1,8 --split-waves 1,2 --out "$out/head_split.json" \
  2>&1 | tee "$out/head_split.log"
for cache in oscar-default oscar; do
  python3 -m bench.profile_generate --cache $cache --context 32768 --batch 1 --timeline --rows 25 \
    2>&1 | tee "$out/profile-$cache.log"
done
