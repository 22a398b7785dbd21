#!/usr/bin/env bash
# One device call: the decode step of a change against the tree before it, in the same call, alternating so that a
# machine's drift shows as spread, not as a difference. Usage: bench/gpu_before_after.sh OUT_DIR BEFORE [CACHES]
# BEFORE: a folder holding the earlier `oscar_hf` package (made here with `git archive <commit> oscar_hf | tar -x -C
# .before`, ignored, and carried). Rows: 32k/1 and 100k/8, `python -m bench.generate` (random-weight Qwen3-8B,
# caches filled by `update`); CACHES defaults to oscar-default (what `OscarCache(model)` stores) and oscar (uniform rows).
# ROUNDS (default 2): before/after pairs, one after the other.
set -o pipefail
out=${1:?usage: bench/gpu_before_after.sh OUT_DIR BEFORE [CACHES]}
before=${2:?before}
caches=${3:-oscar-default,oscar}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
for round in $(seq "${ROUNDS:-2}"); do
  for tree in before after; do
    root=$PWD; [[ $tree == before ]] && root=$PWD/$before
    # the benchmark scripts are today's; the package is the tree's. -P: without it Python puts the working
    # directory (today's oscar_hf) ahead of PYTHONPATH, and both trees would be today's.
    PYTHONPATH=$root:$PWD python3 -P -c "import oscar_hf; print('$tree', oscar_hf.__file__)" | tee -a "$out/steps.log"
    PYTHONPATH=$root:$PWD python3 -P -m bench.generate --contexts 32768 --batches 1 --oscar-batches 1 --caches "$caches" 2>&1 | tee -a "$out/steps.log"
    PYTHONPATH=$root:$PWD python3 -P -m bench.generate --contexts 100000 --batches 8 --oscar-batches 8 \
      --caches "$caches" 2>&1 | tee -a "$out/steps.log"
  done
done
