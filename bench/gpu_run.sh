#!/usr/bin/env bash
# One device call: kernel tests at real shapes, then the benchmarks. Usage: bench/gpu_run.sh OUT_DIR [parts]
# parts (comma-separated, run in this order): tests (the kernel and compiled-decode test files) or attntests (the attention one),
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
