"""Run under torchrun by test_tensor_parallel.py: one TP rank of a tiny model with per-KV-head rotations."""

import os
import sys

import torch
from transformers import AutoModelForCausalLM

from oscar_hf import OscarCache, Rotations
from oscar_hf.compat import cache_argument_name

model_dir, rotations_dir, out_dir = sys.argv[1:4]
tensor_parallel = "WORLD_SIZE" in os.environ
model = AutoModelForCausalLM.from_pretrained(model_dir, **({"tp_plan": "auto"} if tensor_parallel else {}))
cache = OscarCache(model, rotations=Rotations.from_pretrained(rotations_dir), method="oscar",
                   sink_tokens=4, recent_tokens=8, demote_block=2)
ids = torch.randint(1, 96, (2, 50), generator=torch.Generator().manual_seed(0))
name = cache_argument_name(model)
logits = []
with torch.no_grad():
    for start, end in ((0, 30), (30, 31), (31, 32), (32, 50)):
        logits.append(model(input_ids=ids[:, start:end], use_cache=True, **{name: cache}).logits)
rank = int(os.environ.get("RANK", 0)) if tensor_parallel else "single"
torch.save({"logits": torch.cat(logits, 1), "local_heads": cache.layers[0].key_rotation.shape[0],
            "history": cache.layers[0].history_length}, os.path.join(out_dir, f"rank-{rank}.pt"))
