#!/usr/bin/env bash
# One device call: kernel tests at real shapes, then the benchmarks. Usage: bench/gpu_run.sh OUT_DIR [parts]
# parts (comma-separated, run in this order): tests (the kernel and compiled-decode test files) or attntests (the attention one),
# steps (the issue-45 step targets: OscarCache and StaticCache + compile at 4k/1 and 32k/1, OscarCache at 100k/8),
# prefill (one layer's 8k chunk: the kernel over 2-bit rows and over BF16 K/V against SDPA, 32k and 100k),
# jobs (sequences per GPU at 100k when prompts are prefilled through generate in chunks; BUDGET GB, default 140),
# generate, attention (add "sweep" to time launch configurations first, "splits" for the split minimums, "breakdown" for kernel times per call), ncu. Logs and JSON land in OUT_DIR.
set -o pipefail
out=${1:?usage: bench/gpu_run.sh OUT_DIR [parts]}
parts=${2:-tests,generate,attention,sweep}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
files=""
[[ ,$parts, == *,tests,* ]] && files="tests/test_kernels_demote.py tests/test_kernels_attention.py tests/test_kernels_cache.py tests/test_compiled_decode.py"
[[ ,$parts, == *,attntests,* ]] && files="tests/test_kernels_attention.py"
for f in $files; do
  python3 -m pytest -q -rs --tb=short "$f" 2>&1 | tee -a "$out/tests.log"
done
if [[ ,$parts, == *,steps,* ]]; then
  python3 -m bench.generate --contexts 4096,32768 --batches 1 --oscar-batches 1 --caches oscar,static \
    --out "$out/steps-batch1.json" 2>&1 | tee "$out/steps.log"
  python3 -m bench.generate --contexts 100000 --batches 8 --oscar-batches 8 --caches oscar \
    --out "$out/steps-100k8.json" 2>&1 | tee -a "$out/steps.log"
fi
if [[ ,$parts, == *,prefill,* ]]; then
  python3 -m bench.prefill_attention --contexts 32768,100000 --batch 4 --chunks 8192 --quick \
    --out "$out/prefill.json" 2>&1 | tee "$out/prefill.log"
fi
if [[ ,$parts, == *,jobs,* ]]; then
  python3 -m bench.generate --contexts 100000 --batches 1,2 --oscar-batches 4,8 --caches oscar-prefill,dynamic-prefill \
    --max-batch --budget-gb ${BUDGET:-140} --out "$out/jobs.json" 2>&1 | tee "$out/jobs.log"
fi
if [[ ,$parts, == *,generate,* ]]; then
  python3 -m bench.generate --max-batch --host-profile --out "$out/generate.json" 2>&1 | tee "$out/generate.log"
fi
if [[ ,$parts, == *,attention,* ]]; then
  sweep=""; [[ ,$parts, == *,sweep,* ]] && sweep="--sweep"; [[ ,$parts, == *,splits,* ]] && sweep="$sweep --sweep-splits"; [[ ,$parts, == *,breakdown,* ]] && sweep="$sweep --breakdown"
  python3 -m bench.attention $sweep --out "$out/attention.json" --launch-out "$out/launch.json" 2>&1 | tee "$out/attention.log"
fi
if [[ ,$parts, == *,ncu,* ]]; then
  timeout 120 ncu --clock-control none -k regex:_attention_partials --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats python3 -m bench.profile_stage1 2>&1 | tee "$out/ncu.log"
fi
