"""Retrieval levers in exact simulation (SmolLM2-135M, CPU): one row format at a time, scored on the needle suite
and on held-out text. The open question it serves is issue #44: retrieval out of the box, with formats at 2.25 bits
per element or fewer.

A format is a cache the package builds, `<preset>[+<field>=<value>...]` (`OscarConfig` fields, JSON values or
names), simulated through the package's own code: `SimulationPlan.from_cache` reads each layer's history back as
`kernels.reference.quantize` stores it, with the cache's settings per layer (encoder, clips and the clips the
rotations record, pairs, high-precision layers and KV heads, key smoothing). A format may add what-ifs, formats the
package does not store, `/<what-if>`; each runs the package's encoders (`quantize_pack`, then
`unpack_dequantize`) with one change:

- `/pairs=compact`: one-byte (scale, zero) pairs on every row, the 4-bit rows too (the package keeps float16 pairs
  there);
- `/tokens=<n>`: one (scale, zero) pair for n adjacent tokens of a KV head (the encoder run on the n rows as one
  row), the pair's bits divided by n;
- `/codebook`: Gaussian Lloyd-Max levels on the `encoder=sigma` pair (its grid's centre is the row's mean, its step
  `GAUSSIAN_UNIFORM_STEP` deviations): each element takes the nearest Lloyd-Max level instead of the nearest grid
  level; same bits (rows with `encoder=sigma` only; the 4-bit rows stay uniform);
- `/rank`: the high-precision share taken from a ranking made under this format's own rows
  (`calibrate.retrieval_layers`, calibration-play probes) instead of the one the rotations record.

Scores per format:
- `copy`: teacher-forced copy accuracy on the needle suite: BF16's answer is fed after the prompt (prefill = the
  prompt, then token by token) and the fact's answer tokens the simulated model predicts (argmax) are counted;
  `probes`: probes where every fact token is predicted (an upper bound on greedy hits); `exact`: probes where every
  answer token up to the fact's last is predicted, so greedy decoding would repeat BF16's answer (a lower bound);
- `ppl`/`kl`: decode-equivalent perplexity and next-token KL vs BF16 on held-out text (prefill 512, then decoding);
- `bits`: stored bits per history element, (scale, zero) pairs counted (`row_bytes` of each layer's rows).

  python -m experiments.retrieval.levers --rotations rotations/smollm2-135m-hadamard --formats hadamard quarot \
      "quarot+encoder=sigma+scale_dtype=compact" oscar-mixed "oscar-mixed/pairs=compact" --out out/levers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.calibrate.retrieval_layers import (
    full_precision_answers,
    rank_retrieval_heads,
    rank_retrieval_layers,
    record_retrieval_heads,
    record_retrieval_layers,
)
from oscar_hf.eval.assets import EVALUATION_PLAYS, load_model, play_tokens
from oscar_hf.eval.decode_equivalent import SimulationPlan, simulate_logits
from oscar_hf.eval.diagnostics.needle_attention import copy_targets
from oscar_hf.eval.needles import make_needle_suite
from oscar_hf.kernels.reference.quantize import (
    COMPACT,
    GAUSSIAN_UNIFORM_STEP,
    dequantize_rows,
    pair_bytes,
    quantize_pack,
    quantize_rows,
    row_bytes,
    unpack_dequantize,
)
from oscar_hf.layer import OscarLayer
from oscar_hf.model_support import attention_shape
from oscar_hf.rotations import Rotations

# Gaussian Lloyd-Max levels, positive half, in standard deviations (Max 1960)
LLOYD_MAX_LEVELS = {2: (0.4528, 1.5104),
                    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326)}


@dataclass
class Format:
    spec: str
    method: str
    options: dict
    compact_pairs: bool = False
    tokens: int = 1
    codebook: bool = False
    rank: bool = False

    @property
    def what_if(self) -> bool:
        """Whether the rows differ from what the package stores (the ranking alone does not change them)."""
        return self.compact_pairs or self.tokens > 1 or self.codebook


def parse(spec: str) -> Format:
    """`<preset>[+<field>=<value>...][/<what-if>...]` (module docstring)."""
    cache_part, *what_ifs = spec.split("/")
    method, *assignments = cache_part.split("+")
    options = {}
    for assignment in assignments:
        name, sep, value = assignment.partition("=")
        if not sep:
            raise SystemExit(f"{spec!r}: expected +<field>=<value>, got {assignment!r}")
        try:
            options[name] = json.loads(value)
        except json.JSONDecodeError:
            options[name] = value  # a name, such as scale_dtype=compact or encoder=sigma
    fmt = Format(spec, method, options)
    for what_if in what_ifs:
        name, _, value = what_if.partition("=")
        if (name, value) == ("pairs", "compact"):
            fmt.compact_pairs = True
        elif name == "tokens" and value.isdigit() and int(value) >= 1:
            fmt.tokens = int(value)
        elif (name, value) == ("codebook", ""):
            fmt.codebook = True
        elif (name, value) == ("rank", ""):
            fmt.rank = True
        else:
            raise SystemExit(f"{spec!r}: unknown what-if {what_if!r} (pairs=compact, tokens=<n>, codebook, rank)")
    return fmt


# ------------------------------------------------------------------------------------------------ rows
def row_runs(config: OscarConfig, layer: int, kv_heads: int, fmt: Format) -> list[tuple[list[int], OscarConfig]]:
    """The layer's KV heads by the settings their rows are stored with: (heads, settings) pairs."""
    high = set(config.high_precision_kv_heads(layer))
    runs = [([h for h in range(kv_heads) if h not in high], config), (sorted(high), config.high_precision())]
    if fmt.compact_pairs:
        runs = [(heads, dataclasses.replace(c, scale_dtype=COMPACT)) for heads, c in runs]
    return [(heads, c) for heads, c in runs if heads]


def row_bits(config: OscarConfig, head_dim: int, tokens: int = 1) -> float:
    """Stored bits per element of one row, its pair shared by `tokens` rows."""
    if not config.quantize:
        return 16.0
    pair = pair_bytes(config.scale_dtype)
    return 8 * (row_bytes(head_dim, config.bits, config.scale_dtype) - pair + pair / tokens) / head_dim


def codebook_rows(x: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Rows `x` `[..., d]` read back from the nearest Gaussian Lloyd-Max level of the `sigma` encoder's stored pair
    (what-if `/codebook`)."""
    codes, pair = quantize_rows(x, bits, None, scale_dtype, "sigma")
    zeros = torch.zeros_like(codes[..., :1])
    offset = dequantize_rows(zeros, pair, bits)  # the stored grid's level 0 and step, read through the package
    step = dequantize_rows(zeros + 1, pair, bits) - offset
    half = torch.tensor(LLOYD_MAX_LEVELS[bits], device=x.device)
    levels = (2**bits - 1) / 2 + torch.cat([-half.flip(0), half]) / GAUSSIAN_UNIFORM_STEP[bits]  # in grid steps
    values = offset + step * levels  # [..., 2^bits]
    nearest = (x[..., :, None] - values[..., None, :]).abs().argmin(-1)
    return values.gather(-1, nearest)


def read_back(rows: torch.Tensor, config: OscarConfig, side: str, fmt: Format) -> torch.Tensor:
    """Rotated float32 rows `[B, H, L, d]` as `config` stores them, changed by the format's what-ifs."""
    b, h, length, d = rows.shape
    n = fmt.tokens
    pad = -length % n
    x = torch.cat([rows, rows[:, :, -1:].expand(b, h, pad, d)], dim=2) if pad else rows
    x = x.reshape(b, h, (length + pad) // n, n * d)
    if fmt.codebook and config.encoder == "sigma":
        out = codebook_rows(x, config.bits, config.scale_dtype)
    else:
        clip = getattr(config, f"{side}_clip_ratio")
        out = unpack_dequantize(*quantize_pack(x, config.bits, clip, config.scale_dtype, config.encoder),
                                config.bits)
    return out.reshape(b, h, length + pad, d)[:, :, :length]


def what_if_rows(configs: dict[int, OscarConfig], kv_heads: int, fmt: Format):
    """`SimulationPlan.row_format` of a what-if: each layer's runs of KV heads read back by `read_back`."""
    def row_format(rows, layer, side):
        out = torch.empty_like(rows)
        for heads, config in row_runs(configs[layer], layer, kv_heads, fmt):
            out[:, heads] = read_back(rows[:, heads], config, side, fmt)
        return out

    return row_format


def layer_configs(cache: OscarCache) -> dict[int, OscarConfig]:
    return {layer.layer_idx: layer.config for layer in cache.layers if isinstance(layer, OscarLayer)}


# ------------------------------------------------------------------------------------------------ study
class Study:
    def __init__(self, args):
        self.rotations = args.rotations
        self.model, self.tokenizer = load_model("smollm2", torch.float32, "cpu")
        shape = attention_shape(self.model.config)
        self.layer_ids, self.head_dim, self.kv_heads = shape.oscar_layer_ids, shape.head_dim, shape.num_kv_heads
        self.probes = make_needle_suite(self.tokenizer, args.lengths, args.depths, args.kinds.split(","),
                                        args.distractors, seed=args.seed)
        self.answers = self._bf16_answers(self.probes, args.out)
        self.text = play_tokens(self.tokenizer, EVALUATION_PLAYS[0], args.ppl_tokens)
        self.prefill = 512
        with torch.no_grad():
            self.reference = self.model(input_ids=self.text, use_cache=False).logits[0].float()

    def _bf16_answers(self, probes, out: str) -> list[tuple]:
        path = os.path.join(out, "bf16_answers.json")
        stored = {}
        if os.path.exists(path):
            with open(path) as f:
                stored = json.load(f)
        found = []
        for probe in tqdm(probes, desc="BF16 answers"):
            key = f"{probe.kind}:{probe.group}:{probe.depth}:{probe.distractors}:{probe.answer}:{probe.length}"
            if key not in stored:
                stored[key] = full_precision_answers(self.model, [probe], progress=False)[0]
            targets = [i for i in copy_targets(self.tokenizer, stored[key], probe.answer) if i > 0]
            if targets:
                found.append((probe, stored[key], targets))
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(stored, f)
        return found

    def _rotations(self):
        if self.rotations in (None, "hadamard"):
            return Rotations.hadamard(self.layer_ids, self.head_dim)
        return Rotations.from_pretrained(self.rotations)

    def cache(self, fmt: Format) -> OscarCache:
        """The format's cache (an unused template); with `/rank`, its share taken from a ranking under its rows."""
        rotations = self.rotations or "hadamard"
        if fmt.rank:
            rotations = self._rotations()
            base = OscarCache(self.model.config, rotations=rotations, method=fmt.method,
                              **fmt.options | {"high_precision_layers": [], "high_precision_heads": [],
                                               "high_precision_layer_share": 0.0, "high_precision_head_share": 0.0})
            row_format = what_if_rows(layer_configs(base), self.kv_heads, fmt) if fmt.what_if else None
            config = OscarConfig.from_method(fmt.method, **fmt.options)
            if config.high_precision_layer_share:
                record_retrieval_layers(rotations, rank_retrieval_layers(
                    self.model, self.tokenizer, base, progress=False, row_format=row_format))
            if config.high_precision_head_share:
                record_retrieval_heads(rotations, rank_retrieval_heads(
                    self.model, self.tokenizer, base, progress=False, row_format=row_format))
        return OscarCache(self.model.config, rotations=rotations, method=fmt.method, **fmt.options)

    def bits(self, configs: dict[int, OscarConfig], fmt: Format) -> float:
        rows = [row_bits(config, self.head_dim, fmt.tokens)
                for layer, c in configs.items() for heads, config in row_runs(c, layer, self.kv_heads, fmt)
                for _ in heads]
        return sum(rows) / len(rows)

    @torch.no_grad()
    def evaluate(self, fmt: Format) -> dict:
        start = time.time()
        cache = self.cache(fmt)
        configs = layer_configs(cache)
        row_format = what_if_rows(configs, self.kv_heads, fmt) if fmt.what_if else None

        def plan(prefill: int) -> SimulationPlan:
            return SimulationPlan.from_cache(cache, prefill=prefill, row_format=row_format)

        copied = total = whole = exact = 0
        for probe, answer, targets in tqdm(self.answers, desc=fmt.spec, leave=False):
            ids = torch.cat([probe.input_ids, torch.tensor([answer])], dim=1)
            logits = simulate_logits(self.model, ids, plan(probe.length))
            predicted = logits[0, probe.length - 1:-1].argmax(-1) == ids[0, probe.length:]
            right = predicted[targets]
            copied += int(right.sum())
            total += len(targets)
            whole += bool(right.all())
            exact += bool(predicted[: max(targets) + 1].all())  # greedy decoding would repeat BF16 up to the fact
        logits = simulate_logits(self.model, self.text, plan(self.prefill))[0].float()
        scored = slice(self.prefill, self.text.shape[1] - 1)
        targets = self.text[0, self.prefill + 1:]
        logp = torch.log_softmax(logits[scored], -1)
        ref = torch.log_softmax(self.reference[scored], -1)
        nll = -logp.gather(1, targets[:, None]).mean().item()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        ref_nll = -ref.gather(1, targets[:, None]).mean().item()
        config = cache.oscar_config
        high = ([list(pair) for pair in config.high_precision_heads] if config.high_precision_heads
                else list(config.high_precision_layers))
        return {"format": fmt.spec, "high_precision": high, "bits": round(self.bits(configs, fmt), 3),
                "copy": copied / total if total else float("nan"), "probes": f"{whole}/{len(self.answers)}",
                "exact": f"{exact}/{len(self.answers)}", "ppl": math.exp(nll), "ppl_bf16": math.exp(ref_nll),
                "ppl_delta": math.exp(nll - ref_nll) - 1, "kl": kl, "seconds": round(time.time() - start, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Formats: <preset>[+<field>=<value>...][/pairs=compact|/tokens=<n>|/codebook"
                                       "|/rank...]; see the module docstring.")
    p.add_argument("--formats", nargs="+", default=["hadamard", "quarot+encoder=sigma+scale_dtype=compact"])
    p.add_argument("--rotations", default=None, help="a rotations folder (one that records a ranking for the "
                                                     "presets with a high-precision share), or hadamard")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048])
    p.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.5, 0.8])
    p.add_argument("--kinds", default="number,words,uuid")
    p.add_argument("--distractors", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3])
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/levers")
    args = p.parse_args(argv)
    formats = [parse(spec) for spec in args.formats]  # a typo fails before the model loads
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count() or 1)
    study = Study(args)
    print(f"{len(study.answers)} of {len(study.probes)} probes: BF16 answers with the fact")
    path = os.path.join(args.out, "levers.jsonl")
    for fmt in formats:
        row = study.evaluate(fmt)
        row["rotations"] = args.rotations or "hadamard"
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
