"""Issue 21, part 3: the levers on retrieval, one at a time, in exact simulation (SmolLM2-135M, CPU).

Every row format is simulated exactly by the decode-equivalent evaluation (`SimulationPlan(row_format=...)`): the
history is read back as that format stores it, in the rotation's basis; sink and recent stay BF16.

Per format:
- `copy`: teacher-forced copy accuracy on the needle suite: the BF16 answer is fed after the prompt (prefill = the
  prompt, then token by token) and we count the fact's answer tokens the simulated model predicts (argmax), errors
  propagated through the layers; `probes`: probes where every fact token is predicted (a greedy hit, given the
  answer's prefix: an upper bound on greedy hits); `exact`: probes where every answer token up to the fact's last is
  predicted, so greedy decoding would repeat BF16's answer through the fact (a lower bound on greedy hits);
- `ppl`/`KL`: decode-equivalent perplexity and next-token KL vs BF16 on held-out text (prefill 512, then decoding);
- `bits`: stored bits per history element, (scale, zero) or (mean, std) pairs in fp16 counted.

  python -m experiments.retrieval.levers --formats u2c,u2,u2l,s2,n2,u3,u4 --out out/levers
  python -m experiments.retrieval.levers --formats u2,u3,mix4:auto8:u2c --rotations rotations/smollm2-135m

Format names:
- `u<k>[/<v>][g<group>][c][l]`: uniform min-max rows (`c`: clip 0.96/0.92; `l`: least-squares encoder);
- `n<k>[/<v>]`: a Gaussian Lloyd-Max codebook on the standardized row;
- `s<k>[/<v>]`: the uniform format with a Gaussian-optimal grid around the row's mean (scale from the standard
  deviation, not the range; the variant measured in docs/retrieval.md, which the package's `encoder="sigma"`
  follows with the population deviation);
- `salient<pct>:<base>`: the tokens with the largest key norms per head kept in BF16;
- a trailing `q` on `u`/`s` formats (`u2cq`, `s2q`) stores each row's pair in 16 bits instead of 32, as the
  package's compact pairs (`scale_dtype="compact"`: the scale rounded up to a power of 2^(1/16), the zero point in
  8-bit fixed point); at head_dim 64 that frees 0.25 bits per element for layers at higher precision;
- `mix<bits>[q]:<layers>:<base>`: layers (`0-5+29`) at higher uniform precision (`auto<n>`: the top n of
  `calibrate.retrieval_layers.rank_retrieval_layers` for the base format, ranked on probes from the calibration
  plays, as `oscar-calibrate --rank-retrieval-layers` ranks them for `oscar-hifi`);
- `mixh<bits>[q]:<heads>:<base>`: (layer, KV head) pairs (`17.0+18.2`) at higher uniform precision (`auto<n>`: the
  top n by `needle_attention.kv_head_sensitivity` on the same probes): precision per head instead of per layer;
- `smooth<alpha>[p][v]:<base>`: per-channel key smoothing before the rotation: keys (post-RoPE, model basis) are
  divided by `s = rms(K)^alpha / rms(Q)^(1 - alpha)` per (layer, KV head, channel), rotated and stored as `base`,
  and multiplied back after reading (the query would take `s` instead: scores unchanged before quantization).
  Alpha 0.5 balances the score error `sum_c q_c^2 s_c^2 * mean_c k_c^2 / s_c^2` (Cauchy-Schwarz). `p`: one scale per
  RoPE pair (c, c + d/2), the geometric mean of the pair's, so that the scales commute with RoPE and fold into
  the query and key projections; `v`: the values too, by `rms(V)^1/2 / |W_o column|^1/2` (the output projection's
  weight on that channel, over the KV head's query heads). Statistics: 2,048 tokens of a calibration play.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from oscar_hf.rotations.math import rotate

from oscar_hf import OscarCache
from oscar_hf.calibrate.retrieval_layers import full_precision_answers, rank_retrieval_layers, retrieval_trace
from oscar_hf.eval.assets import CALIBRATION_PLAYS, EVALUATION_PLAYS, load_model, play_tokens
from oscar_hf.eval.decode_equivalent import SimulationPlan, simulate_logits
from oscar_hf.eval.diagnostics.needle_attention import copy_targets, kv_head_sensitivity
from oscar_hf.eval.needles import make_needle_suite
from oscar_hf.kernels.reference.quantize import COMPACT, compact_rows, dequantize_rows, fake_quantize

SCALE = torch.float16
PAIR_BITS = 32  # one fp16 pair per group
CLIPS = {"key": 0.96, "value": 0.92}
# Gaussian Lloyd-Max levels (positive half, in standard deviations)
GAUSSIAN_LEVELS = {2: (0.4528, 1.5104), 3: (0.2451, 0.7560, 1.3439, 2.1520),
                   4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326)}


@dataclass
class Format:
    name: str
    read_back: object  # (rows [B, H, L, d] float32, layer, side) -> rows
    bits: object  # (layer, side, d) -> bits per element


def _grouped(fn, rows: torch.Tensor, group: int) -> torch.Tensor:
    shape = rows.shape
    return fn(rows.reshape(*shape[:-1], shape[-1] // group, group)).reshape(shape)


COMPACT_PAIR_BITS = 16  # one byte each for the scale and the zero point (the package's scale_dtype="compact")


def compact_pair(rows: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Rows read back with the float `scale`/`zero` `[..., 1]` a format chose, stored as the package stores
    compact pairs (`kernels.reference.quantize.compact_rows`)."""
    return dequantize_rows(*compact_rows(rows, bits, scale[..., 0], zero[..., 0]), bits)


def uniform(key_bits: int, value_bits: int, group: int | None = None, clip: bool = False,
            encoder: str = "minmax", compact: bool = False) -> tuple:
    widths = {"key": key_bits, "value": value_bits}
    pair_bits = COMPACT_PAIR_BITS if compact else PAIR_BITS

    def read_back(rows, layer, side):
        g = group or rows.shape[-1]
        ratio = CLIPS[side] if clip else None
        if compact:
            return _grouped(lambda x: fake_quantize(x, widths[side], ratio, COMPACT, encoder), rows, g)
        return _grouped(lambda x: fake_quantize(x, widths[side], ratio, SCALE, encoder), rows, g)

    return read_back, lambda layer, side, d: widths[side] + pair_bits / (group or d)


def gaussian(key_bits: int, value_bits: int) -> tuple:
    widths = {"key": key_bits, "value": value_bits}

    def read_back(rows, layer, side):
        half = torch.tensor(GAUSSIAN_LEVELS[widths[side]], device=rows.device)
        levels = torch.cat([-half.flip(0), half])
        mean = rows.mean(-1, keepdim=True).to(SCALE).float()
        std = rows.std(-1, keepdim=True).clamp_min(1e-8).to(SCALE).float()
        z = (rows - mean) / std
        return mean + std * levels[(z[..., None] - levels).abs().argmin(-1)]

    return read_back, lambda layer, side, d: widths[side] + PAIR_BITS / d


# the step of the mean-squared-error-optimal uniform quantizer of a Gaussian, in standard deviations
GAUSSIAN_UNIFORM_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352}


def sigma_scaled(key_bits: int, value_bits: int, compact: bool = False) -> tuple:
    """The stored format and dequantizer of `u<k>` ((scale, zero) per row, codes `floor(x / scale + zero + 0.5)`), but
    the grid is the Gaussian-optimal uniform one around the row's mean instead of spanning its min and max:
    scale = step(bits) * std, zero = (2^bits - 1) / 2 - mean / scale."""
    widths = {"key": key_bits, "value": value_bits}

    def read_back(rows, layer, side):
        bits = widths[side]
        levels = float(2**bits - 1)
        scale = (GAUSSIAN_UNIFORM_STEP[bits] * rows.std(-1, keepdim=True)).clamp_min(1e-8).to(SCALE).float()
        zero = (levels / 2 - rows.mean(-1, keepdim=True) / scale).to(SCALE).float()
        if compact:
            return compact_pair(rows, bits, scale, zero)
        codes = torch.floor(rows / scale + zero + 0.5).clamp(0, levels)
        return (codes - zero) * scale

    return read_back, lambda layer, side, d: widths[side] + (COMPACT_PAIR_BITS if compact else PAIR_BITS) / d


def salient(fraction: float, base: Format) -> tuple:
    """The `fraction` of tokens with the largest key norm, per (row, KV head), kept exact on both sides; a key's
    norm is the same in any orthogonal basis, so the value side selects by the same tokens."""
    chosen: dict[int, torch.Tensor] = {}

    def read_back(rows, layer, side):
        out = base.read_back(rows, layer, side)
        if side == "key":
            count = max(1, round(fraction * rows.shape[2]))
            top = rows.norm(dim=-1).topk(count, dim=-1).indices
            chosen[layer] = torch.zeros(rows.shape[:3], dtype=torch.bool, device=rows.device).scatter_(-1, top, True)
        keep = chosen[layer][..., None]
        return torch.where(keep, rows.to(torch.bfloat16).float(), out)

    return read_back, lambda layer, side, d: (1 - fraction) * base.bits(layer, side, d) + fraction * 16


def mixed(layers: set[int], high: Format, base: Format) -> tuple:
    def read_back(rows, layer, side):
        return (high if layer in layers else base).read_back(rows, layer, side)

    return read_back, lambda layer, side, d: (high if layer in layers else base).bits(layer, side, d)


def mixed_heads(heads: set[tuple[int, int]], kv_heads: int, high: Format, base: Format) -> tuple:
    """(layer, KV head) pairs in `heads` read back as `high`, every other head as `base`."""
    def read_back(rows, layer, side):
        chosen = [h for (lyr, h) in heads if lyr == layer]
        out = base.read_back(rows, layer, side)
        if chosen:
            out[:, chosen] = high.read_back(rows[:, chosen], layer, side)
        return out

    def bits(layer, side, d):
        share = sum(lyr == layer for lyr, _ in heads) / kv_heads
        return share * high.bits(layer, side, d) + (1 - share) * base.bits(layer, side, d)

    return read_back, bits


def smoothed(alpha: float, pairs: bool, values: bool, context, base: Format) -> tuple:
    """Keys (and with `values` the values) smoothed per channel before the rotation (module docstring)."""
    scales = context.smoothing_scales(alpha, pairs, values)

    def read_back(rows, layer, side):
        if side == "value" and not values:
            return base.read_back(rows, layer, side)
        rotation = context.template_rotation(layer, side)
        s = scales[layer][side][None, :, None, :]  # [1, Hkv, 1, d]
        smooth = rotate(rotate(rows, rotation, transpose=True) / s, rotation)
        return rotate(rotate(base.read_back(smooth, layer, side), rotation, transpose=True) * s, rotation)

    return read_back, base.bits


def parse(name: str, context) -> Format:
    m = re.fullmatch(r"u(\d)(?:/(\d))?(?:g(\d+))?(c)?(l)?(q)?", name)
    if m:
        k = int(m[1])
        return Format(name, *uniform(k, int(m[2] or k), int(m[3]) if m[3] else None, bool(m[4]),
                                     "lloyd" if m[5] else "minmax", bool(m[6])))
    m = re.fullmatch(r"n(\d)(?:/(\d))?", name)
    if m:
        return Format(name, *gaussian(int(m[1]), int(m[2] or m[1])))
    m = re.fullmatch(r"s(\d)(?:/(\d))?(q)?", name)
    if m:
        return Format(name, *sigma_scaled(int(m[1]), int(m[2] or m[1]), bool(m[3])))
    m = re.fullmatch(r"smooth([\d.]+)(p)?(v)?:(.+)", name)
    if m:
        return Format(name, *smoothed(float(m[1]), bool(m[2]), bool(m[3]), context, parse(m[4], context)))
    m = re.fullmatch(r"salient([\d.]+):(.+)", name)
    if m:
        return Format(name, *salient(float(m[1]) / 100, parse(m[2], context)))
    m = re.fullmatch(r"mix(\d)(q)?:([\w+-]+):(.+)", name)
    if m:
        base = parse(m[4], context)
        layers = context.sensitive_layers(base, int(m[3][4:])) if m[3].startswith("auto") else _layer_list(m[3])
        return Format(f"{name} {sorted(layers)}", *mixed(layers, parse(f"u{m[1]}{m[2] or ''}", context), base))
    m = re.fullmatch(r"mixh(\d)(q)?:([\w.+]+):(.+)", name)
    if m:
        base = parse(m[4], context)
        if m[3].startswith("auto"):
            heads = context.sensitive_heads(base, int(m[3][4:]))
        else:
            heads = {(int(a), int(b)) for a, b in (part.split(".") for part in m[3].split("+"))}
        shown = "+".join(f"{a}.{b}" for a, b in sorted(heads))
        return Format(f"{name} {shown}", *mixed_heads(heads, context.kv_heads,
                                                      parse(f"u{m[1]}{m[2] or ''}", context), base))
    raise SystemExit(f"unknown format {name!r}")


def _layer_list(text: str) -> set[int]:
    """"0-5+29" -> {0, 1, 2, 3, 4, 5, 29}."""
    layers = set()
    for part in text.split("+"):
        first, _, last = part.partition("-")
        layers.update(range(int(first), int(last or first) + 1))
    return layers


class Study:
    def __init__(self, args):
        self.model, self.tokenizer = load_model("smollm2", torch.float32, "cpu")
        self.template = OscarCache(self.model.config, rotations=args.rotations or "hadamard",
                                   method="oscar" if args.rotations else "hadamard")
        self.probes = make_needle_suite(self.tokenizer, args.lengths, args.depths, args.kinds.split(","),
                                        args.distractors, seed=args.seed)
        self.answers = self._bf16_answers(self.probes, args.out)
        self.text = play_tokens(self.tokenizer, EVALUATION_PLAYS[0], args.ppl_tokens)
        self.prefill = 512
        with torch.no_grad():
            self.reference = self.model(input_ids=self.text, use_cache=False).logits[0].float()
        self.layers = self.model.config.num_hidden_layers
        config = self.model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self._traces = {}

    def _bf16_answers(self, probes, out: str) -> list[tuple]:
        path = os.path.join(out, "bf16_answers.json")
        stored = json.load(open(path)) if os.path.exists(path) else {}
        found = []
        for probe in tqdm(probes, desc="BF16 answers"):
            key = f"{probe.kind}:{probe.group}:{probe.depth}:{probe.distractors}:{probe.answer}:{probe.length}"
            if key not in stored:
                stored[key] = full_precision_answers(self.model, [probe], progress=False)[0]
            targets = [i for i in copy_targets(self.tokenizer, stored[key], probe.answer) if i > 0]
            if targets:
                found.append((probe, stored[key], targets))
        os.makedirs(out, exist_ok=True)
        json.dump(stored, open(path, "w"))
        return found

    def template_rotation(self, layer: int, side: str) -> torch.Tensor | None:
        return self.template.layers[layer].key_rotation if side == "key" else self.template.layers[layer].value_rotation

    @torch.no_grad()
    def smoothing_scales(self, alpha: float, pairs: bool, values: bool) -> dict:
        """Per layer and side, `[Hkv, d]` channel scales from root-mean-square statistics of the BF16 forward on
        2,048 tokens of the first calibration play (module docstring, `smooth`); geometric mean 1 per head."""
        if not hasattr(self, "_channel_rms"):
            rms = {}

            def record(probe):
                q = probe.query  # [B, Hq, L, D]
                b, hq, length, d = q.shape
                q = q.reshape(b, self.kv_heads, hq // self.kv_heads, length, d)
                rms[probe.layer_idx] = dict(
                    query=q.pow(2).mean(dim=(0, 2, 3)).sqrt(), key=probe.keys.pow(2).mean(dim=(0, 2)).sqrt(),
                    value=probe.values.pow(2).mean(dim=(0, 2)).sqrt(),
                    out=probe.module.o_proj.weight.float().reshape(-1, self.kv_heads, hq // self.kv_heads, d)
                    .pow(2).sum(dim=(0, 2)).sqrt())
            text = play_tokens(self.tokenizer, CALIBRATION_PLAYS[0], 2048)
            plan = SimulationPlan.from_cache(self.template, prefill=text.shape[1], recorder=record)
            simulate_logits(self.model, text, plan)
            self._channel_rms = rms
        scales = {}
        for layer, stat in self._channel_rms.items():
            key = stat["key"].clamp_min(1e-6) ** alpha / stat["query"].clamp_min(1e-6) ** (1 - alpha)
            value = (stat["value"].clamp_min(1e-6) / stat["out"].clamp_min(1e-6)) ** 0.5
            out = {}
            for side, x in (("key", key), ("value", value)):
                if pairs:  # one scale per RoPE pair (c, c + d/2): the geometric mean of the two
                    half = x.shape[-1] // 2
                    tied = (x[:, :half] * x[:, half:]).sqrt()
                    x = torch.cat([tied, tied], dim=-1)
                out[side] = x / x.log().mean(-1, keepdim=True).exp()
            scales[layer] = out
        return scales

    def plan(self, fmt: Format, prefill: int) -> SimulationPlan:
        return SimulationPlan.from_cache(self.template, prefill=prefill, row_format=fmt.read_back)

    def sensitive_layers(self, base: Format, count: int) -> set[int]:
        """The shipped ranking (`calibrate.retrieval_layers`: calibration-play probes), for the base format."""
        ranking = rank_retrieval_layers(self.model, self.tokenizer, self.template, row_format=base.read_back)
        return set(ranking[:count])

    def sensitive_heads(self, base: Format, count: int) -> set[tuple[int, int]]:
        """The top `count` (layer, KV head) pairs by `kv_head_sensitivity` on the shipped ranking's probes."""
        if base.name not in self._traces:
            self._traces[base.name] = retrieval_trace(self.model, self.tokenizer, self.template,
                                                      row_format=base.read_back)
        trace = self._traces[base.name]
        score = kv_head_sensitivity(trace, self.kv_heads)
        order = score.flatten().argsort(descending=True)[:count]
        return {(trace.layers[int(i) // self.kv_heads], int(i) % self.kv_heads) for i in order}

    @torch.no_grad()
    def evaluate(self, fmt: Format) -> dict:
        start = time.time()
        copied = total = whole = exact = 0
        for probe, answer, targets in tqdm(self.answers, desc=fmt.name, leave=False):
            ids = torch.cat([probe.input_ids, torch.tensor([answer])], dim=1)
            logits = simulate_logits(self.model, ids, self.plan(fmt, probe.length))
            predicted = logits[0, probe.length - 1:-1].argmax(-1) == ids[0, probe.length:]
            right = predicted[targets]
            copied += int(right.sum())
            total += len(targets)
            whole += bool(right.all())
            exact += bool(predicted[: max(targets) + 1].all())  # greedy decoding would repeat BF16 up to the fact
        logits = simulate_logits(self.model, self.text, self.plan(fmt, self.prefill))[0].float()
        scored = slice(self.prefill, self.text.shape[1] - 1)
        targets = self.text[0, self.prefill + 1:]
        logp = torch.log_softmax(logits[scored], -1)
        ref = torch.log_softmax(self.reference[scored], -1)
        nll = -logp.gather(1, targets[:, None]).mean().item()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        ref_nll = -ref.gather(1, targets[:, None]).mean().item()
        bits = sum(fmt.bits(layer, side, self.head_dim) for layer in range(self.layers)
                   for side in ("key", "value")) / (2 * self.layers)
        return dict(format=fmt.name, bits=round(bits, 3), copy=copied / total, probes=f"{whole}/{len(self.answers)}",
                    exact=f"{exact}/{len(self.answers)}",
                    ppl=math.exp(nll), ppl_bf16=math.exp(ref_nll), ppl_delta=math.exp(nll - ref_nll) - 1, kl=kl,
                    seconds=round(time.time() - start, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="u2c,u2,u2l,u3,u4")
    p.add_argument("--rotations", default=None)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048])
    p.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.5, 0.8])
    p.add_argument("--kinds", default="number,words,uuid")
    p.add_argument("--distractors", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3])
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/levers")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1)
    study = Study(args)
    print(f"{len(study.answers)} of {len(study.probes)} probes: BF16 answers with the fact")
    path = os.path.join(args.out, "levers.jsonl")
    for name in args.formats.split(","):
        row = study.evaluate(parse(name, study))
        row["rotations"] = args.rotations or "hadamard"
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
