"""Beyond one GPU: OscarCache under a `device_map`, under tensor parallelism, TP decode throughput, and
data-parallel lm-eval. `bench/multi_gpu.sh OUT_DIR [--smoke]` runs the parts in order; each subcommand here is one
process of a part (some run under `torchrun -m` or `accelerate launch -m`) and writes a JSON file with PASS/FAIL rows.
From the repository root (`python -m bench.multi_gpu` below, `-m bench.multi_gpu` under the launchers):

    python -m bench.multi_gpu prepare WORK          random models (bf16 Qwen3, tiny Llama + tokenizer) and rotations
    python -m bench.multi_gpu device-map WORK OUT   a. device_map="auto" over the GPUs vs one GPU: tokens, placement
    [torchrun] ... tp-generate WORK OUT             b. greedy tokens with per-KV-head rotations (1 GPU, or TP)
    python -m bench.multi_gpu tp-compare WORK OUT   b. the TP run's tokens vs the single-GPU run's
    [torchrun] ... throughput WORK OUT              c. decode tokens/s of a Qwen3-32B-shaped model (fewer layers)
    [accelerate launch] ... lm-eval OUT -- ARGS     d. `python -m oscar_hf.eval.lm_eval ARGS`, recording each rank
    python -m bench.multi_gpu lm-eval-compare OUT   d. the data-parallel results vs the one-process results
    python -m bench.multi_gpu report OUT            results.json and a markdown table of every part

`--smoke`: tiny models on CPU (gloo for torchrun), to check the script; it times nothing meaningful.
Greedy tokens are compared exactly; a mismatch counts as a near-tie (reported, not a failure) when the reference's
margin between its token and the other run's token is within the logit difference of the two runs at that step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from bench import harness
from bench.multi_gpu_report import (
    compare_greedy,
    describe,
    lm_eval_outputs,
    response_diff,
    row,
    write_json,
    write_report,
)
from oscar_hf import OscarCache, Rotations
from oscar_hf.compat import cache_argument_name
from oscar_hf.layer import OscarLayer

# the local lm-eval task of part d (multi_gpu.sh passes its folder as --include_path); its words make the tokenizer
LM_EVAL_TASK_DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                                 "lm_eval_task", "tiny.jsonl")

QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                 rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, bos_token_id=151643,
                 eos_token_id=151645)
TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@dataclass
class Profile:
    """What one run uses: the GPU sizes, or tiny CPU ones (`--smoke`)."""

    device: str
    small_model: dict  # parts a and b
    big_model: dict  # part c (layers set by --layers)
    prompt: int  # prompt tokens, parts a and b
    new_tokens: int
    batch: int
    cache_options: dict  # OscarCache tiers, parts a and b


GPU = Profile("cuda", dict(QWEN3_32B, vocab_size=32768, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                           num_attention_heads=16, max_position_embeddings=32768, bos_token_id=1, eos_token_id=2),
              QWEN3_32B, prompt=3000, new_tokens=32, batch=2, cache_options={})
SMOKE = Profile("cpu", dict(TINY, num_hidden_layers=4), dict(TINY, num_hidden_layers=2), prompt=120, new_tokens=8,
                batch=2, cache_options=dict(sink_tokens=4, recent_tokens=16, demote_block=4))


# ---------------------------------------------------------------------------------------------------------- helpers
def distributed() -> tuple[int, int]:
    """(rank, world size) of this process under torchrun; (0, 1) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def load(path: str, dtype=torch.bfloat16, **placement):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placement).eval()
    model.generation_config.pad_token_id = model.config.eos_token_id
    return model


def prompt_ids(profile: Profile, vocab: int) -> torch.Tensor:
    """The same random `[batch, prompt]` ids in every process."""
    return torch.randint(3, vocab, (profile.batch, profile.prompt), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int, **cache_args) -> tuple[dict, OscarCache]:
    """Greedy tokens `[B, n]` and raw logits `[B, n, V]` (float32, CPU) through a fresh OscarCache."""
    cache = OscarCache(model, **cache_args)
    ids = prompt.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **{cache_argument_name(model): cache})
    return dict(tokens=out.sequences[:, prompt.shape[1]:].cpu(),
                logits=torch.stack(out.logits, 1).float().cpu()), cache


def placement_errors(model, cache: OscarCache) -> list[str]:
    """Every OscarLayer tensor (tiers, history, rotations) on the device of its attention layer's weights."""
    errors = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, OscarLayer):
            continue
        expected = model.model.layers[i].self_attn.k_proj.weight.device
        tensors = dict(keys_buffer=layer.keys_buffer, values_buffer=layer.values_buffer,
                       key_rotation=layer.key_rotation, query_rotation=layer.query_rotation,
                       value_rotation=layer.value_rotation,
                       **{f"history.{name}": getattr(layer.history, name) for name in layer.history._names})
        wrong = [f"{name} on {t.device}" for name, t in tensors.items() if t is not None and t.device != expected]
        if layer.device != expected:
            wrong.append(f"layer.device {layer.device}")
        if not layer.history_length:
            wrong.append("no quantized history")
        if wrong:
            errors.append(f"layer {i} (weights on {expected}): {', '.join(wrong)}")
    return errors


def layers_by_device(model) -> dict[str, list[int]]:
    placement: dict[str, list[int]] = {}
    for i, block in enumerate(model.model.layers):
        placement.setdefault(str(block.self_attn.k_proj.weight.device), []).append(i)
    return placement


def first_device(profile: Profile) -> str:
    return "cuda:0" if profile.device == "cuda" else "cpu"


def tiny_llama(seed: int, vocab: int):
    """A random float32 2-layer Llama (GQA 4:2, head_dim 32) on CPU, for the lm-eval part."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return harness.random_model(LlamaForCausalLM, config, "cpu", torch.float32, seed)


def word_tokenizer(docs_path: str):
    """A whitespace word-level tokenizer over the words of a local lm-eval task's documents (JSON lines with
    `context`, `answer` and `choices`), plus [PAD], [UNK] and [EOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = set()
    with open(docs_path) as f:
        for doc in map(json.loads, f):
            words.update(doc["context"].split(), doc["answer"].split(), *(c.split() for c in doc["choices"]))
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[EOS]", *sorted(words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


# ---------------------------------------------------------------------------------------------------------- parts
def prepare(args, profile: Profile) -> None:
    """WORK/small (bf16 Qwen3), WORK/rotations (random orthogonal `[Hkv, d, d]` per layer), WORK/lm (tiny Llama +
    word-level tokenizer for the local lm-eval task)."""
    t0 = time.perf_counter()
    small = harness.random_qwen3(profile.small_model, profile.device)
    small.save_pretrained(os.path.join(args.work, "small"))
    cfg = small.config
    gen = torch.Generator().manual_seed(2)
    heads, dim = cfg.num_key_value_heads, cfg.head_dim

    def orthogonal():
        return torch.linalg.qr(torch.randn(heads, dim, dim, generator=gen, dtype=torch.float64))[0].float()

    layers = range(cfg.num_hidden_layers)
    Rotations({i: orthogonal() for i in layers}, {i: orthogonal() for i in layers},
              metadata={"objective": "random orthogonal (bench)"}).save_pretrained(os.path.join(args.work, "rotations"))
    lm_dir = os.path.join(args.work, "lm")
    tiny_llama(seed=7, vocab=64).save_pretrained(lm_dir)
    word_tokenizer(LM_EVAL_TASK_DOCS).save_pretrained(lm_dir)
    print(f"prepared {args.work} in {time.perf_counter() - t0:.1f} s", flush=True)


def device_map_part(args, profile: Profile) -> None:
    """a. The small model split over every GPU by device_map="auto" (GPU 0 capped at 60% of the weights) vs one GPU."""
    path = os.path.join(args.work, "small")
    gpus = torch.cuda.device_count() if profile.device == "cuda" else 0
    placement = dict(device_map="auto")
    if gpus >= 2:
        weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
        placement["max_memory"] = {0: int(0.6 * weights), **{i: "100GiB" for i in range(1, gpus)}}
    single = load(path, device_map=first_device(profile))
    prompt = prompt_ids(profile, single.config.vocab_size)
    reference, _ = greedy(single, prompt, profile.new_tokens, rotations="hadamard", **profile.cache_options)
    del single
    split = load(path, **placement)
    got, cache = greedy(split, prompt, profile.new_tokens, rotations="hadamard", **profile.cache_options)
    comparison = compare_greedy(reference, got)
    devices = layers_by_device(split)
    errors = placement_errors(split, cache)
    spread = len(devices) >= min(2, max(gpus, 1))
    rows = [row("a. device_map", f"tokens vs one device (prompt {profile.prompt}, bs {profile.batch})",
                comparison["status"], describe(comparison)),
            row("a. device_map", "layers spread over the GPUs", "PASS" if spread else "FAIL",
                "; ".join(f"{d}: layers {v[0]}-{v[-1]}" for d, v in devices.items())),
            row("a. device_map", "cache tensors on their layer's device", "FAIL" if errors else "PASS",
                "; ".join(errors)[:300] or f"{len(cache.layers)} layers, history {cache.layers[-1].history_length}")]
    write_json(os.path.join(args.out, "device_map.json"),
               dict(rows=rows, comparison=comparison, layers_by_device=devices, placement_errors=errors))


def tp_generate(args, profile: Profile) -> None:
    """b. Greedy generation with per-KV-head rotations, float32 and bfloat16: one process on one device, or one
    rank of `torchrun --nproc_per_node N` with tp_plan="auto"."""
    rank, world = distributed()
    tensor_parallel = world > 1
    rotations = Rotations.from_pretrained(os.path.join(args.work, "rotations"))
    results = {}
    # "none": the same tiers, rotations and merge without quantization, where a 2-bit code cannot flip on an
    # ulp-level difference of the sharded matmuls: the strict check of the head slicing.
    for dtype, method in ((torch.float32, "oscar"), (torch.bfloat16, "oscar"), (torch.float32, "none")):
        placement = dict(tp_plan="auto") if tensor_parallel else dict(device_map=first_device(profile))
        model = load(os.path.join(args.work, "small"), dtype=dtype, **placement)
        prompt = prompt_ids(profile, model.config.vocab_size)
        result, cache = greedy(model, prompt, profile.new_tokens, rotations=rotations, method=method,
                               **profile.cache_options)
        result.update(local_heads=cache.layers[0].key_rotation.shape[0], history=cache.layers[0].history_length)
        results[str(dtype).removeprefix("torch.") + ("" if method == "oscar" else f", method {method}")] = result
        del model, cache
    if rank == 0:
        name = f"tp{world}" if tensor_parallel else "single"
        torch.save(results, os.path.join(args.work, f"tp-generate-{name}.pt"))  # logits: too big for OUT
        print({k: (v["local_heads"], v["history"]) for k, v in results.items()}, flush=True)
    if tensor_parallel:
        torch.distributed.destroy_process_group()


def tp_compare(args, profile: Profile) -> None:
    """b. The TP=2 run against the single-device run, per dtype; each rank holds half the KV heads' rotations."""
    single = torch.load(os.path.join(args.work, "tp-generate-single.pt"))
    parallel = torch.load(os.path.join(args.work, "tp-generate-tp2.pt"))
    rows, comparisons = [], {}
    for dtype, reference in single.items():
        other = parallel[dtype]
        comparison = compare_greedy(reference, other)
        heads_ok = other["local_heads"] * 2 == reference["local_heads"] and other["history"] > 0
        status = comparison["status"] if heads_ok else "FAIL"
        rows.append(row("b. tensor parallel", f"TP=2 vs 1 device, {dtype}", status,
                        f"{describe(comparison)}; rotation heads per rank {other['local_heads']} of "
                        f"{reference['local_heads']}; history {other['history']}"))
        comparisons[dtype] = comparison
    write_json(os.path.join(args.out, "tp_generate.json"), dict(rows=rows, comparisons=comparisons))


def throughput(args, profile: Profile) -> None:
    """c. Decode step time through OscarCache at long contexts: one GPU (builds the random model, `--save`s it for
    the TP run first), or one rank of torchrun loading the saved model with tp_plan="auto"."""
    rank, world = distributed()
    harness.DEVICE = profile.device
    path = os.path.join(args.work, "big")
    options = dict(profile.big_model, num_hidden_layers=args.layers)
    info = dict(layers=args.layers, world_size=world)
    t0 = time.perf_counter()
    if world > 1:
        model = load(path, tp_plan="auto")
        info["load_s"] = time.perf_counter() - t0
    else:
        model = harness.random_qwen3(options, profile.device)
        info["build_s"] = time.perf_counter() - t0
        if args.save:
            t0 = time.perf_counter()
            model.save_pretrained(path)
            info["save_s"] = time.perf_counter() - t0
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # DTensor -> this rank's shard
    info["weights_GB"] = sum(p.numel() * p.element_size() for p in local) / 1e9
    print(f"rank {rank}: {info}", flush=True)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            torch.manual_seed(0)  # the same decode ids on every rank
            measured = harness.safe_measure(model, "oscar", batch, context)
            rows.append(measured)
            print(f"rank {rank}: {json.dumps(measured)}", flush=True)
    if rank == 0:
        write_json(os.path.join(args.out, f"throughput-{'tp%d' % world if world > 1 else '1gpu'}.json"),
                   dict(info=info, rows=rows))
    if world > 1:
        torch.distributed.destroy_process_group()


def lm_eval_run(args, profile: Profile) -> None:
    """d. lm-eval's CLI through `oscar_hf.eval.lm_eval`, writing each rank's OscarLM state (rank, world size, caches
    built, device) to OUT/rank-R.json. `--fake-cuda-count N` (CPU smoke only) makes HFLM's data-parallel check,
    which counts CUDA devices, pass on CPU."""
    if args.fake_cuda_count and not torch.cuda.is_available():
        torch.cuda.device_count = lambda: args.fake_cuda_count
    from oscar_hf.eval.lm_eval import OscarLM, main

    instances = []
    original_init = OscarLM.__init__

    def recording_init(self, *a, **k):
        original_init(self, *a, **k)
        instances.append(self)

    OscarLM.__init__ = recording_init
    main(args.lm_eval_args)
    for lm in instances:
        write_json(os.path.join(args.out, f"rank-{lm.rank}.json"),
                   dict(rank=lm.rank, world_size=lm.world_size, caches_built=lm.caches_built, device=str(lm.device)))


def lm_eval_compare(args, profile: Profile) -> None:
    """d. The data-parallel run (2 ranks, each its own OscarLM and caches) against the one-process run."""
    runs = {name: lm_eval_outputs(os.path.join(args.out, f"lm-eval-{name}")) for name in ("single", "dp")}
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(args.out, "lm-eval-dp", "rank-*.json")))]
    rows = []
    dp_ok = len(ranks) == 2 and all(r["world_size"] == 2 and r["caches_built"] > 0 for r in ranks)
    rows.append(row("d. lm-eval DP", "2 ranks, each with its own OscarCaches", "PASS" if dp_ok else "FAIL",
                    "; ".join(f"rank {r['rank']}/{r['world_size']} on {r['device']}: {r['caches_built']} caches"
                              for r in ranks) or "no rank files"))
    single, dp = runs["single"], runs["dp"]
    for task in sorted(single["samples"]):
        a, b = single["samples"][task], dp["samples"].get(task, {})
        worst = max((response_diff(a[d], b[d]) if d in b else float("inf")) for d in a)
        metrics = {k: v for k, v in single["results"][task].items() if not k.endswith("stderr,none") and k != "alias"}
        metrics_dp = {k: dp["results"].get(task, {}).get(k) for k in metrics}
        ok = len(a) == len(b) and worst <= 1e-3
        rows.append(row("d. lm-eval DP", f"{task}: DP=2 vs 1 process", "PASS" if ok else "FAIL",
                        f"{len(b)}/{len(a)} docs, max response diff {worst:.2e}; {metrics} vs {metrics_dp}"))
    write_json(os.path.join(args.out, "lm_eval.json"), dict(rows=rows, ranks=ranks))


def report(args, profile: Profile) -> None:
    """OUT/results.json and the markdown table; exits 1 when a check failed or nothing ran."""
    failed = write_report(args.out)
    sys.exit(1 if failed else 0)


PARTS = {"prepare": prepare, "device-map": device_map_part, "tp-generate": tp_generate, "tp-compare": tp_compare,
         "throughput": throughput, "lm-eval": lm_eval_run, "lm-eval-compare": lm_eval_compare, "report": report}


def main() -> None:
    argv = sys.argv[1:]
    lm_eval_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("dirs", nargs="+", help="WORK and/or OUT, as the part's usage above says")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU")
    parser.add_argument("--layers", type=int, default=16, help="layers of the Qwen3-32B-shaped model (of 64)")
    parser.add_argument("--contexts", default="32768,100000")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--save", action="store_true", help="throughput on one GPU: save the model for the TP run")
    parser.add_argument("--fake-cuda-count", type=int, default=0, help="lm-eval on CPU: pretend N CUDA devices")
    args = parser.parse_args(argv)
    args.lm_eval_args = lm_eval_args
    uses_work = args.part in ("prepare", "device-map", "tp-generate", "tp-compare", "throughput")
    args.work = args.dirs[0] if uses_work else None
    args.out = args.dirs[-1] if args.part != "prepare" else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    PARTS[args.part](args, SMOKE if args.smoke else GPU)


if __name__ == "__main__":
    main()
