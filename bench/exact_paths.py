"""Every GPU decode path of an unquantized OscarCache (`method="none"`) against DynamicCache: greedy tokens, logits
and stored rows, printed as a table.

    python -m bench.exact_paths [--context 4096] [--steps 256] [--out exact_paths.json]

A random-weight Qwen3-shaped model (head_dim 128, GQA 2:1, bf16; its output head scaled up so that greedy choices
are decisive rather than near-ties any rounding flips), batch 2 with row 1 left-padded by 500 tokens. Paths:
- `eager`: eager decode steps (on CUDA replayed from CUDA graphs, `kernels.replay`);
- `generate compile`: plain `generate`, which compiles the decode step and replays it from CUDA graphs;
- `compiled forward`: `model.forward = torch.compile(..., fullgraph=True, mode="reduce-overhead")`, generate's own
  compile off.
`method="none"` stores the tiers and the history unquantized. Each path decodes twice:
- teacher-forced (a logits processor makes every step take DynamicCache's token; the raw logits are compared), so
  that the logits and the stored rows (history included, in time order) compare over all steps. They should equal
  DynamicCache's within bf16 rounding: the tiers' attention merges in float32 where SDPA rounds to bf16, and a
  compiled step fuses the model's own projections differently;
- free greedy: where its tokens first part from DynamicCache's, and DynamicCache's margin between its top two
  logits there (a part at a near-tie is rounding; a part at a wide margin is a bug).
`--smoke` runs the script on the CPU with a tiny model and few tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, Qwen3Config, Qwen3ForCausalLM

from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name, compile_config_anywhere


def build(device: str, smoke: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2) if smoke else dict(
        hidden_size=2048, intermediate_size=4096, num_hidden_layers=8)
    config = Qwen3Config(vocab_size=4096, num_attention_heads=16 if not smoke else 4,
                         num_key_value_heads=8 if not smoke else 2, head_dim=128 if not smoke else 64,
                         max_position_embeddings=65536, tie_word_embeddings=False, **size)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=torch.bfloat16)


class Forced(LogitsProcessor):
    """Every step takes the reference's next token (`sequences` `[B, prompt + steps]`)."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        token = self.sequences[:, input_ids.shape[1]]
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, token[:, None], 0.0)


def compared(oscar, dynamic) -> float:
    """Largest difference of any layer's stored K/V from DynamicCache's, relative to the layer's largest value."""
    worst = 0.0
    for i, layer in enumerate(oscar.layers):
        keys, values = layer.dense_kv()
        for got, want in ((keys, dynamic.layers[i].keys), (values, dynamic.layers[i].values)):
            if got.shape != want.shape:
                return float("inf")
            worst = max(worst, ((got.float() - want.float()).abs().max() / want.float().abs().max()).item())
    return worst


@torch.no_grad()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    context, steps = (400, 24) if args.smoke else (args.context, args.steps)
    model = build(device, args.smoke)
    name = cache_argument_name(model)
    ids = torch.randint(3, model.config.vocab_size, (2, context), device=device)
    mask = torch.ones_like(ids)
    mask[1, : context // 8] = 0
    run = dict(attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
               output_logits=True, return_dict_in_generate=True)
    dynamic = DynamicCache(config=model.config)
    want = model.generate(ids, disable_compile=True, **run, **{name: dynamic})
    compile_anywhere = compile_config_anywhere()  # so that --smoke compiles on the CPU too
    rows = []
    for path in ("eager", "generate compile", "compiled forward"):
        result = dict(path=path)
        for forced in (True, False):
            torch._dynamo.reset()
            cache = OscarCache(model, method="none", compile_decode=path == "generate compile")
            eager_forward = model.forward
            options = dict(disable_compile=True) if path != "generate compile" else dict(
                compile_config=compile_anywhere)
            if forced:
                options["logits_processor"] = LogitsProcessorList([Forced(want.sequences)])
            if path == "compiled forward":
                model.forward = torch.compile(model.forward, fullgraph=True,
                                              mode="reduce-overhead" if device == "cuda" else None)
            try:
                got = model.generate(ids, **options, **run, **{name: cache})
            finally:
                model.forward = eager_forward
            if forced:
                result["max_logit_difference"] = max((a.float() - b.float()).abs().max().item()
                                                     for a, b in zip(got.logits, want.logits))
                result["max_row_difference"] = compared(cache, dynamic)
                continue
            same = (got.sequences == want.sequences).all(dim=0)[context:]
            first = int((~same).nonzero()[0]) if not same.all() else None
            result["first_differing_step"] = first
            if first is not None:
                top2 = want.logits[first].float().topk(2, dim=-1).values
                result["margin_there"] = (top2[:, 0] - top2[:, 1]).min().item()
        rows.append(result)
    print(f"\n{device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), context {context}, "
          f"{steps} greedy steps, batch 2 (row 1 left-padded), bf16")
    print("| path | max logit diff, forced | max row diff (rel), forced | free greedy: first step off DynamicCache | "
          "DynamicCache's top-2 margin there |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        first = r["first_differing_step"]
        print(f"| {r['path']} | {r['max_logit_difference']:.3g} | {r['max_row_difference']:.3g} | "
              f"{'none' if first is None else first} | {r.get('margin_there', float('nan')):.3g} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), context=context, steps=steps, rows=rows), f,
                      indent=2)


if __name__ == "__main__":
    main()
