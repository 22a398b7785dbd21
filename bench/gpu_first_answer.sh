#!/usr/bin/env bash
# The first-answer measurements of one machine, as processes in order (torch's compile caches stay on this
# machine's disk between them). Usage: bench/gpu_first_answer.sh OUT_DIR PART  (PART: a = the 32k/8 256-token
# calls: oscar-compiled fresh twice and in a second process, dynamic, eager, the default policy, static;
# b = oscar-compiled with the cudagraphs backend in a
# fresh cache dir, the 16-token one-offs, and 100k/4 with chunked prefill; q = a's compiled and rule calls
# and the 16-token one-offs, when device time is short; c = chunked prefill: where one chunked call spends its
# time, one layer's chunk with and without a mask tensor, then 32k and 100k chunked calls; f = a fresh machine's
# very first calls, 256 new tokens, each kind in empty Triton and inductor cache folders: the default OscarCache,
# DynamicCache and StaticCache; p = a machine's first call with
# each kernel compiled at its launch against kernels compiled on threads first, the Triton census in empty cache
# folders, 16 new tokens, chunks of 8,192; r = f's OscarCache and DynamicCache calls, and OscarCache from the
# package in the folder BEFORE (`git archive <commit> oscar_hf | tar -x -C .before`, carried), alternating)
# CTX and BS (default 32768 and 8) set the context and batch of the 256- and 16-token calls (BS=4 fits an H100).
set -o pipefail
out=${1:?usage: bench/gpu_first_answer.sh OUT_DIR PART}
part=${2:?PART: a, b, c, f, p, q or r}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
fa() {
  echo "== $*" | tee -a "$out/first_answer.log"; local began=$SECONDS
  python3 -P -c "import oscar_hf; print('package', oscar_hf.__file__)" 2>&1 | tee -a "$out/first_answer.log"
  python3 -P -m bench.first_answer --out "$out/first_answer.jsonl" "$@" 2>&1 | tee -a "$out/first_answer.log"
  echo "process wall $((SECONDS - began)) s" | tee -a "$out/first_answer.log"
}
# empty Triton and inductor cache folders: the next process compiles as on a new machine
fresh() { export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d); }
if [[ $part == a ]]; then
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar-compiled --calls 2  # the machine's first compile
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar-compiled           # a second process
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches dynamic,oscar-eager,oscar --calls 2
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches static --calls 2
fi
if [[ $part == q ]]; then  # the rule's case alone, when device time is short
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar-compiled --calls 2
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar-compiled
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches dynamic,oscar
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 16 --caches dynamic,oscar
fi
if [[ $part == c ]]; then
  python3 -m experiments.prefill.profile_chunked --context 16384 --batch 4 --chunk 4096 --steps 12 \
    2>&1 | tee -a "$out/profile_chunked.log"
  for mask in "" --mask; do
    python3 -m bench.prefill_attention --contexts 32768 --batch 4 --chunks 8192 $mask --out "$out/prefill$mask.json" \
      2>&1 | tee -a "$out/prefill_attention.log"
  done
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 16 --caches oscar,dynamic --chunk 8192
  fa --context 100000 --batch 4 --new-tokens 16 --caches oscar,dynamic --chunk 8192
fi
if [[ $part == b ]]; then
  TORCHINDUCTOR_CACHE_DIR=/tmp/fresh_cudagraphs fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar-compiled --calls 2 --compile-backend cudagraphs
  fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 16 --caches dynamic,oscar-eager,oscar
  fa --context 100000 --batch 4 --new-tokens 16 --caches dynamic,oscar --chunk 8192
fi
if [[ $part == f ]]; then  # every kind compiles as on a new machine: Triton's and inductor's disk caches empty
  fresh; fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar
  fresh; fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches dynamic
  fresh; fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches static
fi
if [[ $part == r ]]; then  # a change to the first call against the tree before it, each process on a new machine
  before=${BEFORE:?BEFORE: the folder holding the earlier oscar_hf}
  # -P: the working directory's oscar_hf must not shadow the earlier one on PYTHONPATH
  fresh; fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar
  fresh; fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches dynamic
  fresh; PYTHONPATH=$PWD/$before:$PWD fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar
  fresh; fa --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 256 --caches oscar
fi
if [[ $part == p ]]; then
  for threads in 0 16; do
    export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    python3 -m experiments.compile.triton_census --context ${CTX:-32768} --batch ${BS:-8} --new-tokens 16 --chunk 8192 \
      --compile-threads $threads --no-recompile 2>&1 | tee "$out/census-threads$threads.log"
  done
fi
