"""Issue 23's defects 1, 3 and 5 through the GPU kernels (Triton demotion and attention, the CUDA history kernel
where it applies) and through the front door, `model.generate` eager and as transformers compiles it on CUDA.

A random-weight Qwen3 at the real head_dim 128 (GQA 8:4, 4 layers), its output head scaled up so that greedy
choices are decisive. Default tiers (sink 64, recent 256, demotion blocks of 8). Prints one table; exits 1 if a
check fails.

    python -m bench.reliability_gpu [--out reliability_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from oscar_hf import OscarCache
from oscar_hf.compat import cache_argument_name

VOCAB = 512
MODES = {"eager": {"disable_compile": True}, "compiled": {}}


def random_qwen3(dtype: torch.dtype, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                         max_position_embeddings=65536, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.pad_token_id = 0
    return model.to(device="cuda", dtype=dtype)


def left_padded(lengths, seed=0):
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
        ids[row, : width - length] = 0
    return ids.cuda(), mask.cuda()


def generate(model, ids, cache, mode, steps, **kwargs):
    cache.compile_decode = mode == "compiled"
    return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, **MODES[mode], **kwargs,
                          **{cache_argument_name(model): cache})


def dense_bytes(model, tokens: int, batch: int = 1) -> int:
    c = model.config
    return 2 * batch * tokens * c.num_key_value_heads * c.head_dim * model.dtype.itemsize * c.num_hidden_layers


def padded_rows_like_solo(model, mode):
    """Defect 1, tokens: each row of a left-padded batch decodes as it does alone (paddings multiples of 8)."""
    lengths = [1200, 600, 200]
    ids, mask = left_padded(lengths, seed=1)
    out = generate(model, ids, OscarCache(model), mode, 32, attention_mask=mask)
    width, worst, equal = ids.shape[1], 0.0, True
    for row, length in enumerate(lengths):
        solo = generate(model, ids[row:row + 1, width - length:], OscarCache(model), mode, 32)
        equal &= torch.equal(out.sequences[row, width:], solo.sequences[0, length:])
        a, b = torch.stack(out.scores)[:, row], torch.stack(solo.scores)[:, 0]
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    # compiled, a demoted code at a rounding boundary may flip between the batch and the solo run (inductor
    # computes K/V in another order than eager): the tokens must agree, the logits only closely
    return equal and worst < 1e-2, (f"tokens equal {equal}, max |Δ logit| / max |logit| {worst:.1e} (rows "
                                    "1200/600/200, 32 steps)")


def mixed_batch_bytes(model, mode, all_padding=False):
    """Defect 1, bytes: the issue's 2,000 + 100 batch (or 2,000 + an all-padding row) against its rows' solo
    caches plus the padding's history codes and one BF16 window."""
    lengths = [2000, 1 if all_padding else 100]
    ids, mask = left_padded(lengths, seed=2)
    if all_padding:
        mask[1] = 0
    cache = OscarCache(model)
    generate(model, ids, cache, mode, 8, attention_mask=mask)
    layer = cache.layers[0]
    solos = 0
    for row in range(2):
        real = mask[row].bool()
        if real.any():
            solo = OscarCache(model)
            generate(model, ids[row:row + 1, real], solo, mode, 8)
            solos += solo.nbytes()
    pad_history = layer.history_length * layer.history.token_bytes() * layer.keys_buffer.shape[1]
    cfg = cache.oscar_config
    window = (cfg.sink_tokens + cfg.recent_tokens + cfg.demote_block) * dense_bytes(model, 1)
    bound = solos + pad_history * model.config.num_hidden_layers + window
    dynamic = dense_bytes(model, 2008, batch=2)
    ok = cache.nbytes() <= bound and cache.nbytes() < 0.4 * dynamic and layer.sink_length == cfg.sink_tokens
    return ok, (f"sink {layer.sink_length}, history {layer.history_length}, {cache.nbytes() / 2**20:.1f} MiB "
                f"<= bound {bound / 2**20:.1f} MiB, {cache.nbytes() / dynamic:.2f}x DynamicCache")


def update_outside_a_forward(model, mode, method):
    """Defect 3: K/V given to `update()` with no forward, then `generate`, decode as a forward-filled cache.

    Method `none` must agree at every step. Quantized, the two caches' later layers hold K/V computed through
    different attentions (SDPA for the DynamicCache that supplies them, OSCAR's for the forward-filled one), equal
    to about 1e-6: a code at a rounding boundary may flip, so the tiers must match and the first steps agree."""
    ids = torch.randint(3, VOCAB, (2, 700), generator=torch.Generator().manual_seed(3)).cuda()
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], use_cache=True, **{cache_argument_name(model): dynamic})
    filled = OscarCache(model, method=method)
    for i, layer in enumerate(dynamic.layers):
        filled.update(layer.keys, layer.values, i)
    reference = OscarCache(model, method=method)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], use_cache=True, **{cache_argument_name(model): reference})
    a = generate(model, ids, filled, mode, 24)
    b = generate(model, ids, reference, mode, 24)
    steps = (a.sequences[:, 700:] == b.sequences[:, 700:]).all(0)
    agree = int(steps.long().cumprod(0).sum())
    delta = (torch.stack(a.scores[:8]) - torch.stack(b.scores[:8])).abs().max().item()
    same_tiers = [repr(x) for x in filled.layers] == [repr(x) for x in reference.layers]
    ok = same_tiers and delta < 1e-3 and (agree == 24 if method == "none" else agree >= 8)
    return ok, (f"tiers equal {same_tiers}, {agree}/24 steps agree, max |Δ logit| over 8 steps {delta:.1e}, "
                f"history {filled.layers[0].history_length}")


def huge_finite_inputs(model, mode, module_name):
    """Defect 5: 7e4 written into layer 0's keys (after k_norm) or values at three history tokens of a prefill;
    every decode step's logits stay finite and the stored (scale, zero) pairs too."""
    attention = model.model.layers[0].self_attn
    module = getattr(attention, module_name)
    head_dim = attention.head_dim

    def inject(mod, args, out):
        out = out.clone()
        for p in (100, 150, 200):
            row = out[:, p, 0] if out.dim() == 4 else out[:, p, :head_dim]
            row[..., : head_dim // 2] = 7e4
            row[..., head_dim - 1] = -7e4
        return out

    ids = torch.randint(3, VOCAB, (1, 600), generator=torch.Generator().manual_seed(4)).cuda()
    cache = OscarCache(model)
    hook = module.register_forward_hook(inject)
    try:
        with torch.no_grad():
            first = model(input_ids=ids[:, :-1], use_cache=True, **{cache_argument_name(model): cache}).logits
    finally:
        hook.remove()
    out = generate(model, ids, cache, mode, 16)
    layer = cache.layers[0]
    pairs = [getattr(layer.history, name)[:, :, : layer.history_length].float()
             for name in ("key_scale_zero", "value_scale_zero")]
    finite = bool(torch.isfinite(first).all() and torch.isfinite(torch.stack(out.scores)).all())
    pairs_finite = all(bool(torch.isfinite(p).all()) for p in pairs)
    saturated = pairs[0 if module_name == "k_norm" else 1][..., 0].max().item()
    return finite and pairs_finite, f"logits finite {finite}, pairs finite {pairs_finite}, largest scale {saturated:.0f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file for the table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    fp32, bf16 = random_qwen3(torch.float32), random_qwen3(torch.bfloat16)
    checks = [
        ("1 padded rows = solo runs (fp32)", lambda m: padded_rows_like_solo(fp32, m)),
        ("1 2000+100 batch bytes (bf16)", lambda m: mixed_batch_bytes(bf16, m)),
        ("1 2000 + all-padding row bytes (bf16)", lambda m: mixed_batch_bytes(bf16, m, all_padding=True)),
        ("3 update() outside a forward, none (fp32)", lambda m: update_outside_a_forward(fp32, m, "none")),
        ("3 update() outside a forward, oscar (fp32)", lambda m: update_outside_a_forward(fp32, m, "hadamard")),
        ("5 7e4 in keys after k_norm (bf16)", lambda m: huge_finite_inputs(bf16, m, "k_norm")),
        ("5 7e4 in values (bf16)", lambda m: huge_finite_inputs(bf16, m, "v_proj")),
    ]
    rows, failed = [], 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print("| defect / check | mode | ok | s | measured |\n|---|---|---|---:|---|", flush=True)
    for name, check in checks:
        for mode in MODES:
            torch._dynamo.reset()
            start = time.time()
            try:
                ok, text = check(mode)
            except Exception as e:  # noqa: BLE001 -- a crash is a failed check, reported in the table like the others
                ok, text = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            failed += not ok
            rows.append({"check": name, "mode": mode, "ok": ok, "seconds": round(time.time() - start, 1), "measured": text})
            print(f"| {name} | {mode} | {'yes' if ok else 'NO'} | {time.time() - start:.0f} | {text} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
