#!/usr/bin/env bash
# Precision per KV head on the GPU, in two device calls. Usage: bench/gpu_heads.sh OUT_DIR tests|attention|generate
# [bench.head_split options, e.g. --split-waves 1,2]
# tests: the split-layer, kernel-cache, compact-pair and CUDA-history tests, then the split layer's decode
# attention (bench.head_split);
# attention: bench.head_split alone, then generate; generate: decode speed through plain generate at 32k / batch 1 for oscar-next's row format, all layers at 2 bits,
# 4 layers at 4 bits, and 29 of 288 KV heads at 4 bits (the same share of the history).
set -o pipefail
out=${1:?usage: bench/gpu_heads.sh OUT_DIR tests|generate}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
if [[ $2 == tests ]]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2  # oscar_hf.calibrate is mapped, not on PYTHONPATH
  python3 -m pytest -q -rs --tb=short tests/test_head_precision.py tests/test_kernels_cache.py tests/test_kernels_compact.py \
    tests/test_kernels_cuda_history.py tests/test_kernels_head_split.py tests/test_compiled_decode.py tests/test_kernels_attention.py 2>&1 | tail -25 | tee "$out/tests.log"
  python3 -m bench.head_split "${@:3}" --out "$out/head_split.json" 2>&1 | tee "$out/head_split.log"
fi
if [[ $2 == attention ]]; then
  python3 -m bench.head_split "${@:3}" --out "$out/head_split.json" 2>&1 | tee "$out/head_split.log"
fi
if [[ $2 == generate || $2 == attention ]]; then
  python3 -m bench.generate --contexts 32768 --batches 1 --oscar-batches 1 --caches oscar-compact --out "$out/generate_2bit.json" 2>&1 | grep -v Warning | tail -8 | tee "$out/generate.log"
  python3 -m bench.generate --contexts 32768 --batches 1 --oscar-batches 1 --caches oscar-compact --hifi-layers 4 --out "$out/generate_layers.json" 2>&1 | grep -v Warning | tail -8 | tee -a "$out/generate.log"
  python3 -m bench.generate --contexts 32768 --batches 1 --oscar-batches 1 --caches oscar-compact --hifi-heads 29 --out "$out/generate_heads.json" 2>&1 | grep -v Warning | tail -8 | tee -a "$out/generate.log"
fi
