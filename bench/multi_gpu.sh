#!/usr/bin/env bash
# Beyond one GPU (issue 6): every part of bench.multi_gpu (a, b, d, then c), each step under a time limit, all within
# BUDGET_S seconds; logs, JSON and results.json land in OUT_DIR; prints a markdown table; exits 1 if anything failed.
# Usage (from the repository root): bench/multi_gpu.sh OUT_DIR [--smoke]
# Environment: BUDGET_S (default 480), LAYERS (Qwen3-32B-shaped layers, default 16), CONTEXTS (default 32768,100000),
# BATCHES (default 1,8), PYTHON (default python3). A .whl folder is installed first (lm-eval for part d).
set -u
out=$(realpath -m "${1:?usage: bench/multi_gpu.sh OUT_DIR [--smoke]}")
smoke=${2:-}
py=${PYTHON:-python3}
budget=${BUDGET_S:-480}
mkdir -p "$out" && : > "$out/steps.tsv"
work=$(mktemp -d /tmp/multi_gpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

torchrun=("$py" -m torch.distributed.run --standalone --nproc_per_node 2)
launch=("$py" -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no
        --dynamo_backend no)
if [ "$smoke" = --smoke ]; then
  flags=(--smoke); sizes=(--layers 2 --contexts 300,500 --batches 1,2); device=cpu
  export OMP_NUM_THREADS=1  # two processes share the cores; more threads only contend
  dp_env=(env ACCELERATE_USE_CPU=1); dp_flags=(--fake-cuda-count 2)
else
  flags=(); sizes=(--layers "${LAYERS:-16}" --contexts "${CONTEXTS:-32768,100000}" --batches "${BATCHES:-1,8}")
  device=cuda:0; dp_env=(); dp_flags=()
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
versions="import importlib.metadata as m
print({n: m.version(n) for n in ('torch', 'transformers', 'accelerate', 'triton', 'pyarrow', 'fsspec', 'pandas')})"
"$py" -c "$versions" | tee -a "$out/gpu.txt"

start=$SECONDS
step() {  # step PART NAME LIMIT_S COMMAND...: run under min(LIMIT_S, time left), tee its log, record its exit code
  local part=$1 name=$2 limit=$3; shift 3
  local left=$((budget - (SECONDS - start))) log="$out/$name.log" t0=$SECONDS rc
  if ((left < 20)); then
    printf '%s\t%s\ttimeskip\t0\t%s\n' "$part" "$name" "$log" >> "$out/steps.tsv"; return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit} s, ${left} s left): $*" | tee "$log"
  timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  printf '%s\t%s\t%s\t%s\t%s\n' "$part" "$name" "$rc" "$((SECONDS - t0))" "$log" >> "$out/steps.tsv"
}

mg=(-m bench.multi_gpu)  # python -m, torchrun -m and accelerate launch -m alike
step prepare prepare 90 "$py" "${mg[@]}" prepare "$work" "${flags[@]}"
step "a. device_map" device_map 90 "$py" "${mg[@]}" device-map "$work" "$out" "${flags[@]}"
step "b. tensor parallel" tp_single 60 "$py" "${mg[@]}" tp-generate "$work" "$out" "${flags[@]}"
step "b. tensor parallel" tp_tp2 90 "${torchrun[@]}" "${mg[@]}" tp-generate "$work" "$out" "${flags[@]}"
step "b. tensor parallel" tp_compare 30 "$py" "${mg[@]}" tp-compare "$work" "$out" "${flags[@]}"
if "$py" -c "import lm_eval" 2>/dev/null; then
  lm_args=(--model "$work/lm" --model_args "method=hadamard,sink_tokens=4,recent_tokens=8,demote_block=2"
           --tasks tiny_oscar_mc,tiny_oscar_ppl,tiny_oscar_gen --include_path tests/lm_eval_task --batch_size 2
           --log_samples)
  step "d. lm-eval DP" lm_eval_single 90 "$py" "${mg[@]}" lm-eval "$out/lm-eval-single" -- "${lm_args[@]}" \
    --device $device --output_path "$out/lm-eval-single"
  step "d. lm-eval DP" lm_eval_dp 120 "${dp_env[@]}" "${launch[@]}" "${mg[@]}" lm-eval "$out/lm-eval-dp" "${dp_flags[@]}" \
    -- "${lm_args[@]}" --device "${device%:0}" --output_path "$out/lm-eval-dp"
  step "d. lm-eval DP" lm_eval_compare 30 "$py" "${mg[@]}" lm-eval-compare "$out"
else
  echo "=== part d skipped: lm_eval cannot be imported (put its wheels in .whl, see bench/multi_gpu_wheels.txt)"
  printf '%s\t%s\tnolm_eval\t0\t-\n' "d. lm-eval DP" lm_eval >> "$out/steps.tsv"
fi
# c. last: the largest (a 19 GB checkpoint at 16 layers), it gets whatever time is left
step "c. throughput" throughput_1gpu 180 "$py" "${mg[@]}" throughput "$work" "$out" --save "${sizes[@]}" "${flags[@]}"
step "c. throughput" throughput_tp2 150 "${torchrun[@]}" "${mg[@]}" throughput "$work" "$out" "${sizes[@]}" "${flags[@]}"
rm -rf "$work/big"
echo "=== total $((SECONDS - start)) s"
"$py" "${mg[@]}" report "$out" 2>&1 | tee "$out/report.md"
exit "${PIPESTATUS[0]}"
