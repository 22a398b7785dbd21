#!/usr/bin/env bash
# One device call for the new architectures (docs/models.md): the sink kernels and CUDA-graph replay on CUDA, then
# `bench.architectures` for the given models. Usage: bench/gpu_architectures.sh OUT_DIR MODELS [ROWS] [CACHES]
# Qwen3.5's linear attention takes flash-linear-attention's kernels when installed (transformers' torch fallback
# otherwise): carry its wheels (.whl) and put them on PYTHONPATH first.
set -o pipefail
out=${1:?usage: bench/gpu_architectures.sh OUT_DIR MODELS [ROWS] [CACHES]}
models=${2:?models}
rows=${3:-32768x1,32768x8,100000x8}
caches=${4:-oscar,dynamic,static}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; from transformers.utils import is_flash_linear_attention_available as f; print(torch.__version__, triton.__version__, transformers.__version__, 'fla', f())" | tee -a "$out/gpu.txt"
if [[ ${TESTS:-1} == 1 ]]; then
  # the sink kernels, and the every-path differential test's CUDA-graph replay of Qwen3-Next, Gemma 4 and gpt-oss
  python3 -m pytest -q -rs --tb=short tests/test_sinks.py tests/test_architectures.py -k "sinks or graph" 2>&1 \
    | tee "$out/tests.log"
fi
python3 -m bench.architectures --models "$models" --rows "$rows" --caches "$caches" 2>&1 | tee "$out/bench-${models//,/_}.log"
