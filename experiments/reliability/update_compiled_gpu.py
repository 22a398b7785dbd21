"""Diagnosis: a cache filled by `update()` outside a forward, then `generate` compiled on CUDA, against the same
cache filled by a forward (bench/reliability_gpu.py's defect-3 row). Each run starts from a fresh dynamo state.

    python -m experiments.reliability.update_compiled_gpu
"""

import torch
from transformers import DynamicCache
from transformers.generation.configuration_utils import CompileConfig

from bench.reliability_gpu import VOCAB, random_qwen3
from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name


def main():
    model = random_qwen3(torch.float32)
    name = cache_argument_name(model)
    ids = torch.randint(3, VOCAB, (2, 700), generator=torch.Generator().manual_seed(3)).cuda()

    def filled():
        dynamic = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :-1], use_cache=True, **{name: dynamic})
        cache = OscarCache(model)
        for i, layer in enumerate(dynamic.layers):
            cache.update(layer.keys, layer.values, i)
        return cache

    def forwarded():
        cache = OscarCache(model)
        with torch.no_grad():
            model(input_ids=ids[:, :-1], use_cache=True, **{name: cache})
        return cache

    def describe(cache):
        layer = cache.layers[0]
        codes = layer.history.key_codes
        return (f"{layer!r} keys_buffer {tuple(layer.keys_buffer.shape)} history capacity "
                f"{None if codes is None else codes.shape[2]} unsettled {layer.unsettled} "
                f"counted {layer.counted is not None}")

    modes = {"eager": {"disable_compile": True}, "compiled": {},
             "compiled-no-graphs": {"compile_config": CompileConfig(mode="default")},
             "compiled-fullgraph": {"compile_config": CompileConfig(fullgraph=True)}}
    runs = {}
    for label, make in (("forwarded", forwarded), ("filled", filled)):
        for mode, options in modes.items():
            torch._dynamo.reset()
            cache = make()
            before = describe(cache)
            out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, **options, **{name: cache})
            runs[label, mode] = out
            print(f"{label:9s} {mode:18s} before: {before}\n{'':28s} after:  {describe(cache)}", flush=True)
    base = runs["forwarded", "eager"]
    for key, out in runs.items():
        diff = (out.sequences != base.sequences).any(0).nonzero()
        first = diff[0].item() - 700 if len(diff) else None
        delta = (torch.stack(out.scores) - torch.stack(base.scores)).abs().amax(dim=(1, 2))
        print(f"{key}: first differing step {first}, max |Δ logit| per step "
              f"{[round(x, 3) for x in delta.tolist()[:10]]}")


if __name__ == "__main__":
    main()
