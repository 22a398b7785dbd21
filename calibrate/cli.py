"""`oscar-calibrate`: fit OSCAR rotations for a causal LM and write (and optionally upload) them.

    oscar-calibrate --model HuggingFaceTB/SmolLM2-135M-Instruct --data shakespeare --tokens 20000 --out rotations/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from oscar_hf.eval.assets import SMOLLM2_ALIASES, SMOLLM2_PROVENANCE, load_model
from oscar_hf.rotations.rotations import DEFAULT_CLIP_BITS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    from oscar_hf.calibrate.objectives import KEY_OBJECTIVES, VALUE_OBJECTIVES

    p = argparse.ArgumentParser(
        prog="oscar-calibrate",
        description="Fit attention-aware OSCAR KV-cache rotations (R = U·H·P_bitrev) for a transformers causal LM.",
    )
    p.add_argument("--model", required=True,
                   help=f"local folder or Hub repo id of a causal LM ({' or '.join(map(repr, SMOLLM2_ALIASES))}: the "
                        "offline SmolLM2-135M)")
    p.add_argument("--data", required=True,
                   help="a .txt or .jsonl file, a datasets name, or 'shakespeare' (bundled calibration plays)")
    p.add_argument("--tokens", type=int, default=20000, help="calibration tokens for the statistics (default 20000)")
    p.add_argument("--out", required=True, help="output folder")
    data = p.add_argument_group("data")
    data.add_argument("--context", type=int, default=2048, help="tokens per calibration sequence (default 2048)")
    data.add_argument("--text-field", default="text", help="text field of .jsonl records / dataset rows")
    data.add_argument("--split", default="train", help="datasets split (default train)")
    data.add_argument("--data-config", default=None, help="datasets configuration name")
    data.add_argument("--chat-template", action="store_true", help="render plain texts as a user turn of the chat template")
    fit = p.add_argument_group("objective")
    fit.add_argument("--key-objective", default="qqt", choices=sorted(KEY_OBJECTIVES))
    fit.add_argument("--value-objective", default="sst", choices=sorted(VALUE_OBJECTIVES),
                     help="sst = the reference's logit²-weighted form; softmax_diag / softmax_sv = true causal softmax")
    fit.add_argument("--per-head", action="store_true", help="one rotation per KV head (format v2) instead of per layer")
    fit.add_argument("--tiered", action="store_true",
                     help="count only what the cache quantizes: keys after the sink, query-key pairs beyond the recent window")
    fit.add_argument("--sink", type=int, default=64, help="sink tokens of the target cache (with --tiered / clip search)")
    fit.add_argument("--recent", type=int, default=256, help="recent tokens of the target cache (with --tiered / clip search)")
    fit.add_argument("--skip-tokens", type=int, default=0, help="drop the first positions of every sequence")
    fit.add_argument("--chunk-tokens", type=int, default=2048,
                     help="feed longer sequences in chunks of this many tokens (bounded memory)")
    clip = p.add_argument_group("clip ratios")
    clip.add_argument("--clip-search", default="none", choices=["none", "model", "layer"],
                      help="search clip ratios on held-out calibration tokens (attention-output error)")
    clip.add_argument("--clip-tokens", type=int, default=4096, help="held-out calibration tokens for the clip search")
    clip.add_argument("--clip-lowest", type=float, default=0.6,
                      help="lowest clip ratio searched (every order statistic from there up to no clip)")
    clip.add_argument("--encoder", default="minmax", choices=["minmax", "lloyd"],
                      help="the cache's row encoder the clip search assumes (OscarConfig.encoder; recorded)")
    clip.add_argument("--clip-bits", type=int, choices=(2, 4), default=2,
                      help="code width the clip search measures (caches of another width ignore the ratios)")
    clip.add_argument("--key-clip-ratio", type=float, default=0.96, help="key clip ratio without a search (default 0.96)")
    clip.add_argument("--value-clip-ratio", type=float, default=0.92, help="value clip ratio without a search (default 0.92)")
    rank = p.add_argument_group("retrieval ranking (the oscar-hifi preset)")
    rank.add_argument("--rank-retrieval-layers", action="store_true",
                      help="rank the layers by how much retrieval their 2-bit history loses, on needle probes in the "
                           "calibration plays (needs the shakespeare package), and record it for method='oscar-hifi'")
    rank.add_argument("--rank-lengths", default="1024,2048", help="needle probe lengths in tokens")
    out = p.add_argument_group("output")
    out.add_argument("--format", default="safetensors", choices=["safetensors", "zoo", "both"],
                     help="oscar_rotations.safetensors, RotationZoo .pt pair, or both")
    out.add_argument("--push-to-hub", metavar="REPO", help="upload the folder with a model card to this Hub repo")
    out.add_argument("--subfolder", default=None, help="path inside the Hub repo")
    out.add_argument("--private", action="store_true", help="create the Hub repo as private")
    out.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    run = p.add_argument_group("model loading")
    run.add_argument("--dtype", default="float32", choices=sorted(DTYPES) + ["auto"])
    run.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    run.add_argument("--device-map", default=None, help="e.g. 'auto' to spread a large model over GPUs (accelerate)")
    run.add_argument("--revision", default=None, help="model revision")
    run.add_argument("--trust-remote-code", action="store_true")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def load_calibration_model(args):
    """(model, tokenizer, device description) for the parsed arguments."""
    dtype = "auto" if args.dtype == "auto" else DTYPES[args.dtype]
    device = None if args.device_map else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, dtype, device, device_map=args.device_map, revision=args.revision,
                                  trust_remote_code=args.trust_remote_code)
    return model, tokenizer, f"device_map={args.device_map}" if args.device_map else device


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import oscar_hf
    from oscar_hf.calibrate import clip_search
    from oscar_hf.calibrate.data import load_documents, token_sequences
    from oscar_hf.calibrate.hub import push_to_hub, write_model_card
    from oscar_hf.calibrate.objectives import file_objective
    from oscar_hf.calibrate.pipeline import CalibrationSettings, calibrate, calibration_layers
    from oscar_hf.calibrate.statistics import Tiers

    for name in ("tokens", "context", "chunk_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"oscar-calibrate: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.manual_seed(args.seed)
    start = time.time()
    documents = load_documents(args.data, args.text_field, args.split, args.data_config)
    model, tokenizer, device = load_calibration_model(args)
    layers, kv_heads, head_dim = calibration_layers(model)
    held_out = args.clip_tokens if args.clip_search != "none" else 0
    sequences = token_sequences(tokenizer, documents, args.tokens + held_out, args.context, args.chat_template)
    statistics, search = _split_held_out(sequences, held_out)
    progress = not args.no_progress
    tiers = Tiers(args.sink, args.recent, args.skip_tokens) if args.tiered else Tiers(skip_tokens=args.skip_tokens)
    settings = CalibrationSettings(args.key_objective, args.value_objective, args.per_head, tiers, args.chunk_tokens)
    metadata = {
        "model": args.model, "model_revision": args.revision or "", "data": args.data,
        **(SMOLLM2_PROVENANCE if args.model in SMOLLM2_ALIASES else {}),
        "context": str(args.context), "chat_template": str(args.chat_template),
        "library": f"oscar-hf {oscar_hf.__version__}", "device": str(device), "dtype": args.dtype,
        "created_with": "oscar-calibrate " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    rotations = calibrate(model, statistics, settings, progress=progress, metadata=metadata)
    if args.clip_search != "none":
        choice = clip_search.search_clip_ratios(
            model, search, rotations, layers, head_dim, per_layer=args.clip_search == "layer",
            key_grid=clip_search.clip_grid(head_dim, args.clip_lowest),
            value_grid=clip_search.clip_grid(head_dim, args.clip_lowest),
            default_value_clip=args.value_clip_ratio, sink=args.sink, recent=args.recent,
            chunk_tokens=args.chunk_tokens, progress=progress, encoder=args.encoder, bits=args.clip_bits,
        )
        rotations.metadata.update(choice.metadata())
        rotations.metadata["clip_search_tokens"] = str(sum(s.shape[-1] for s in search))
    else:
        rotations.metadata.update({"key_clip_ratio": json.dumps(args.key_clip_ratio),
                                   "value_clip_ratio": json.dumps(args.value_clip_ratio),
                                   "clip_bits": str(DEFAULT_CLIP_BITS)})
    rotations.metadata["encoder"] = args.encoder
    if args.rank_retrieval_layers:
        from oscar_hf import OscarCache
        from oscar_hf.calibrate.retrieval_layers import rank_retrieval_layers, record_retrieval_layers

        template = OscarCache(model.config, rotations=rotations, sink_tokens=args.sink, recent_tokens=args.recent)
        lengths = [int(n) for n in args.rank_lengths.split(",")]
        record_retrieval_layers(rotations, rank_retrieval_layers(model, tokenizer, template, lengths,
                                                                 progress=progress))
    rotations.metadata["seconds"] = f"{time.time() - start:.1f}"
    rotations.metadata["platform"] = platform.platform()
    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.format in ("safetensors", "both"):
        written.append(rotations.save_pretrained(args.out))
    if args.format in ("zoo", "both"):
        written += list(rotations.save_zoo(args.out, file_objective(args.key_objective),
                                           file_objective(args.value_objective)))
    written.append(write_model_card(args.out, rotations.metadata, args.push_to_hub, args.subfolder))
    print(f"{rotations!r} from {rotations.metadata['tokens']} tokens in {rotations.metadata['seconds']} s")
    for path in written:
        print(f"  wrote {path}")
    print(f"  use: OscarCache(model, rotations={args.out!r}{_clip_hint(rotations.metadata, args.format)})")
    if args.push_to_hub:
        url = push_to_hub(args.out, args.push_to_hub, rotations.metadata, args.subfolder, args.private or None,
                          args.token)
        print(f"  uploaded to {args.push_to_hub}: {url}")
    return 0


def _split_held_out(sequences, held_out: int):
    """(statistics sequences, clip-search sequences): the last `held_out` tokens' sequences are held out."""
    if not held_out:
        return sequences, []
    total, index = 0, len(sequences)
    while index > 1 and total < held_out:
        index -= 1
        total += sequences[index].shape[-1]
    if index == len(sequences) or index == 0:
        raise SystemExit("oscar-calibrate: not enough calibration text for both statistics and the clip search")
    return sequences[:index], sequences[index:]


def _clip_hint(metadata, file_format: str) -> str:
    """Extra `OscarCache` arguments the printed usage line needs (recorded clip ratios load with the safetensors)."""
    hint = f", encoder={metadata['encoder']!r}" if metadata.get("encoder", "minmax") != "minmax" else ""
    if file_format == "zoo" and "key_clip_ratio" in metadata:
        hint += f", key_clip_ratio={metadata['key_clip_ratio']}, value_clip_ratio={metadata['value_clip_ratio']}"
    elif file_format == "zoo" and "key_clip_ratios" in metadata:
        hint += ") -- per-layer clip ratios are kept only in the safetensors format (--format both"
    return hint


if __name__ == "__main__":
    raise SystemExit(main())
