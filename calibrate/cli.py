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
from transformers.utils import logging

from oscar_hf.eval.assets import SMOLLM2_ALIASES, SMOLLM2_PROVENANCE, load_model
from oscar_hf.eval.cli_options import add_model_arguments, add_progress_argument, resolve_device, resolve_dtype
from oscar_hf.kernels.reference.quantize import CODE_SLICES
from oscar_hf.rotations.rotations import DEFAULT_CLIP_BITS

logger = logging.get_logger(__name__)

ADVISED_TOKENS = 1024  # below this the second moments are too noisy to trust (the reference uses 10k-30k)


def build_parser() -> argparse.ArgumentParser:
    from oscar_hf.calibrate.objectives import KEY_OBJECTIVES, VALUE_OBJECTIVES

    p = argparse.ArgumentParser(
        prog="oscar-calibrate",
        description="Fit attention-aware OSCAR KV-cache rotations (R = U·H·P_bitrev) for a transformers causal LM.",
    )
    add_model_arguments(p)
    p.add_argument("--data", required=True,
                   help="a .txt or .jsonl file, a datasets name, or 'shakespeare' (bundled calibration plays)")
    p.add_argument("--tokens", type=int, default=20000,
                   help=f"calibration tokens for the statistics (default 20000; fewer than {ADVISED_TOKENS} warns)")
    p.add_argument("--out", required=True, help="output folder")
    add_progress_argument(p)
    data = p.add_argument_group("data")
    data.add_argument("--context", type=int, default=2048, help="tokens per calibration sequence (default 2048)")
    data.add_argument("--text-field", default="text", help="text field of .jsonl records / dataset rows")
    data.add_argument("--split", default="train", help="datasets split (default train)")
    data.add_argument("--data-config", default=None, help="datasets configuration name")
    data.add_argument("--chat-template", action="store_true",
                      help="render plain texts as a user turn of the chat template")
    fit = p.add_argument_group("objective")
    fit.add_argument("--key-objective", default="qqt", choices=sorted(KEY_OBJECTIVES))
    fit.add_argument("--value-objective", default="sst", choices=sorted(VALUE_OBJECTIVES),
                     help="sst = the reference's logit²-weighted form; softmax_diag / softmax_sv = true causal softmax")
    fit.add_argument("--per-head", action="store_true",
                     help="one rotation per KV head (format v2) instead of per layer")
    fit.add_argument("--tiered", action="store_true",
                     help="count only what the cache quantizes: keys after the sink, query-key pairs beyond the "
                          "recent window")
    fit.add_argument("--sink", type=int, default=64,
                     help="sink tokens of the target cache (with --tiered / clip search)")
    fit.add_argument("--recent", type=int, default=256,
                     help="recent tokens of the target cache (with --tiered / clip search)")
    fit.add_argument("--skip-tokens", type=int, default=0, help="drop the first positions of every sequence")
    fit.add_argument("--chunk-tokens", type=int, default=2048,
                     help="feed longer sequences in chunks of this many tokens (bounded memory)")
    fit.add_argument("--smooth-keys", action=argparse.BooleanOptionalAction, default=None,
                     help="store key smoothing, sqrt(rms(k) / rms(q)) per KV head and RoPE channel pair over "
                          "the calibration text (oscar_hf.calibrate.smoothing): keys are divided by it before the "
                          "rotation, the query multiplied (default: on for safetensors output, which alone holds "
                          "it)")
    clip = p.add_argument_group("clip ratios")
    clip.add_argument("--clip-search", default="none", choices=["none", "model", "layer"],
                      help="search clip ratios on held-out calibration tokens (attention-output error); needs "
                           "--context and --clip-tokens above --sink + --recent + 1")
    clip.add_argument("--clip-tokens", type=int, default=4096, help="held-out calibration tokens for the clip search")
    clip.add_argument("--clip-lowest", type=float, default=0.6,
                      help="lowest clip ratio searched (every order statistic from there up to no clip)")
    clip.add_argument("--encoder", default="minmax", choices=["minmax", "lloyd"],
                      help="the cache's row encoder the clip search assumes (OscarConfig.encoder; recorded)")
    clip.add_argument("--clip-bits", type=int, choices=sorted(CODE_SLICES), default=2,
                      help="code width the clip search measures (caches of another width ignore the ratios)")
    clip.add_argument("--key-clip-ratio", type=float, default=0.96,
                      help="key clip ratio without a search (default 0.96)")
    clip.add_argument("--value-clip-ratio", type=float, default=0.92,
                      help="value clip ratio without a search (default 0.92)")
    rank = p.add_argument_group("retrieval ranking (the oscar-mixed, oscar-hifi and oscar-next presets)")
    rank.add_argument("--ranking", choices=["induction", "needles", "none"], default="induction",
                      help="how to rank the layers and KV heads retrieval depends on, for method='oscar-mixed' and "
                           "'oscar-hifi' (layers) and 'oscar-next' (KV heads); rotations with a ranking store "
                           "oscar-next by default. induction (default): by the attention that copies tokens over a "
                           "repeated random sequence, one forward (oscar_hf.profile); needles: by what the 2-bit "
                           "history loses on needle probes in the calibration plays, answered by the model (minutes; "
                           "needs the shakespeare package and a chat template); none: no ranking")
    rank.add_argument("--rank-retrieval-layers", dest="ranking", action="store_const", const="needles",
                      help="the same as --ranking needles")
    rank.add_argument("--rank-lengths", default="1024,2048", help="needle probe lengths in tokens")
    out = p.add_argument_group("output")
    out.add_argument("--format", default="safetensors", choices=["safetensors", "zoo", "both"],
                     help="oscar_rotations.safetensors, RotationZoo .pt pair, or both")
    out.add_argument("--push-to-hub", metavar="REPO",
                     help="upload the folder with a model card to this Hub repo (repo id and token checked first)")
    out.add_argument("--subfolder", default=None, help="path inside the Hub repo (with --push-to-hub)")
    out.add_argument("--private", action="store_true", help="create the Hub repo as private (with --push-to-hub)")
    out.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the one `hf auth login` stored)")
    run = p.add_argument_group("model loading")
    run.add_argument("--device-map", default=None, help="e.g. 'auto' to spread a large model over GPUs (accelerate)")
    run.add_argument("--revision", default=None, help="model revision")
    run.add_argument("--trust-remote-code", action="store_true")
    run.add_argument("--seed", type=int, default=0)
    return p


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no model and no data, so that a bad setting fails before any work starts
    (`parser.error`: the usage line and the message, exit status 2)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from oscar_hf.calibrate.clip_search import shortest_search_sequence

    for name in ("tokens", "context", "chunk_tokens", "clip_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("sink", "recent", "skip_tokens"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.skip_tokens >= args.context:
        parser.error(f"--skip-tokens {args.skip_tokens} drops every token of a {args.context}-token sequence "
                     "(--context)")
    if args.smooth_keys is None:
        args.smooth_keys = args.format == "safetensors"
    if args.smooth_keys and args.format != "safetensors":
        parser.error(f"--smooth-keys writes scales that RotationZoo files cannot hold; --format {args.format} "
                     "asks for them (use --format safetensors, or --no-smooth-keys)")
    for name in ("key_clip_ratio", "value_clip_ratio"):
        if not 0.0 < getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(args, name)}")
    if args.clip_search != "none":
        if not 0.0 < args.clip_lowest < 1.0:
            parser.error(f"--clip-lowest must be in (0, 1), got {args.clip_lowest}")
        needed = shortest_search_sequence(args.sink, args.recent)
        short = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in ("context", "clip_tokens")
                 if getattr(args, n) < needed]
        if short:
            parser.error(
                f"--clip-search {args.clip_search} needs held-out sequences of at least {needed} tokens "
                f"(--sink {args.sink} + --recent {args.recent} + 2: only then does a query see quantized history), "
                f"but {' and '.join(short)} {'is' if len(short) == 1 else 'are'} shorter: raise "
                f"{'them' if len(short) > 1 else 'it'} to {needed} or more, or lower --sink / --recent"
            )
    if args.ranking == "needles":
        from oscar_hf.calibrate.retrieval_layers import probe_lengths

        try:
            probe_lengths(args.rank_lengths, args.sink, args.recent, "--rank-lengths")
        except ValueError as e:
            parser.error(str(e))
    if args.device_map is not None and args.device is not None:
        parser.error("--device and --device-map exclude each other: give one")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            parser.error(f"--device {args.device!r}: {e}")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: no CUDA GPU is visible")
    if args.model not in SMOLLM2_ALIASES and not os.path.exists(args.model):
        if args.model.startswith((".", "/", "~")):
            parser.error(f"--model {args.model}: no such local folder")
        try:
            validate_repo_id(args.model)
        except HFValidationError:
            parser.error(f"--model {args.model!r}: no such local folder, and not a Hub repo id; the offline "
                         f"SmolLM2-135M is {' or '.join(map(repr, SMOLLM2_ALIASES))}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out}: exists and is not a folder")
    if not args.push_to_hub and (args.subfolder or args.private):
        parser.error("--subfolder and --private apply only with --push-to-hub")
    if args.tokens < ADVISED_TOKENS:
        logger.warning(f"oscar-calibrate: --tokens {args.tokens} is very few: the rotations are eigenbases of "
                       f"second moments, which are noisy below about {ADVISED_TOKENS} tokens (the reference "
                       "calibrates on 10,000-30,000)")


def check_hub(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The `--push-to-hub` pre-flight: repo id and token (fatal), and whether the Hub answers (a warning: the
    folder is saved anyway and the upload tried at the end)."""
    from oscar_hf.calibrate.hub import preflight

    try:
        unreachable = preflight(args.push_to_hub, args.token)
    except ValueError as e:
        parser.error(f"--push-to-hub: {e}")
    if unreachable:
        logger.warning(f"oscar-calibrate: the Hub is unreachable now ({unreachable}); calibrating anyway: the folder "
                       f"is saved to {args.out} and the upload tried at the end")


def load_calibration_model(args):
    """(model, tokenizer, device description) for the parsed arguments."""
    device = None if args.device_map else resolve_device(args.device)
    model, tokenizer = load_model(args.model, resolve_dtype(args.dtype), device, device_map=args.device_map,
                                  revision=args.revision, trust_remote_code=args.trust_remote_code)
    return model, tokenizer, f"device_map={args.device_map}" if args.device_map else device


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.push_to_hub:
        check_hub(parser, args)
    bars = logging.is_progress_bar_enabled()
    if args.no_progress:
        logging.disable_progress_bar()  # transformers' own bars (loading weights) too
    try:
        return _run(args, argv)
    finally:
        if bars:
            logging.enable_progress_bar()


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Calibrate with the checked arguments, write the folder and upload it: the exit status (1: the folder is
    saved but not uploaded)."""
    from oscar_hf.calibrate.data import load_documents
    from oscar_hf.calibrate.pipeline import CalibrationSettings, calibrate, calibration_layers
    from oscar_hf.calibrate.statistics import Tiers

    torch.manual_seed(args.seed)
    start = time.time()
    documents = load_documents(args.data, args.text_field, args.split, args.data_config)
    model, tokenizer, device = load_calibration_model(args)
    layers, _, head_dim = calibration_layers(model)
    statistics, search = _calibration_sequences(args, tokenizer, documents)
    progress = not args.no_progress
    tiers = Tiers(args.sink, args.recent, args.skip_tokens) if args.tiered else Tiers(skip_tokens=args.skip_tokens)
    # smoothing is part of the fit, so the clip search and the ranking below measure the history as it is stored
    settings = CalibrationSettings(args.key_objective, args.value_objective, args.per_head, tiers, args.chunk_tokens,
                                   smooth_keys=args.smooth_keys)
    metadata = _provenance(args, argv, model, device)
    rotations = calibrate(model, statistics, settings, progress=progress, metadata=metadata)
    _record_clip_ratios(args, model, search, rotations, layers, head_dim, progress)
    _rank(args, model, tokenizer, rotations, layers, progress)
    rotations.metadata["seconds"] = f"{time.time() - start:.1f}"
    rotations.metadata["platform"] = platform.platform()
    _write_folder(args, rotations)
    return _upload(args, rotations) if args.push_to_hub else 0


def _rank(args: argparse.Namespace, model, tokenizer, rotations, layers: list[int], progress: bool) -> None:
    """Record the layer and KV-head rankings `--ranking` asks for in `rotations`."""
    if args.ranking == "induction":
        from oscar_hf.profile import profile_model, record_induction_ranking

        record_induction_ranking(rotations, profile_model(model, smoothing=False)[1], layers)
    elif args.ranking == "needles":
        from oscar_hf.calibrate.retrieval_layers import probe_lengths, rank_and_record

        lengths = probe_lengths(args.rank_lengths, args.sink, args.recent, "--rank-lengths")
        rank_and_record(model, tokenizer, rotations, sink=args.sink, recent=args.recent, lengths=lengths,
                        progress=progress)


def _calibration_sequences(args: argparse.Namespace, tokenizer, documents) -> tuple[list, list]:
    """(statistics sequences, clip-search sequences), each a list of `[1, L <= --context]` token ids: `--tokens`
    tokens for the statistics and, with `--clip-search`, `--clip-tokens` more held out for the search."""
    from oscar_hf.calibrate import clip_search
    from oscar_hf.calibrate.data import token_sequences

    held_out = args.clip_tokens if args.clip_search != "none" else 0
    sequences = token_sequences(tokenizer, documents, args.tokens + held_out, args.context, args.chat_template)
    statistics, search = _split_held_out(sequences, held_out)
    if held_out:
        try:
            clip_search.check_search_sequences(search, args.sink, args.recent)
        except ValueError as e:
            raise SystemExit(f"oscar-calibrate: {e}: the calibration text is too short for --clip-tokens "
                             f"{args.clip_tokens} at --context {args.context}") from e
    return statistics, search


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


def _provenance(args: argparse.Namespace, argv: list[str] | None, model, device) -> dict[str, str]:
    """The metadata that says where the rotations come from: model (and its revision), data, context, library,
    device, dtype and the command line (the token hidden)."""
    import oscar_hf

    revision = args.revision or getattr(model.config, "_commit_hash", None)
    return {
        "model": args.model, **({"model_revision": revision} if revision else {}), "data": args.data,
        **(SMOLLM2_PROVENANCE if args.model in SMOLLM2_ALIASES else {}),
        "model_type": str(getattr(model.config, "model_type", "")),
        "context": str(args.context), "chat_template": str(args.chat_template),
        "library": f"oscar-hf {oscar_hf.__version__}", "device": str(device), "dtype": args.dtype,
        "created_with": "oscar-calibrate " + " ".join(_redacted(sys.argv[1:] if argv is None else argv)),
    }


def _record_clip_ratios(args: argparse.Namespace, model, search, rotations, layers: list[int], head_dim: int,
                        progress: bool) -> None:
    """Record in the rotations' metadata the clip ratios, searched on the held-out `search` sequences with
    `--clip-search` or else the given `--key-clip-ratio` / `--value-clip-ratio`, and the encoder they assume."""
    from oscar_hf.calibrate import clip_search

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


def _write_folder(args: argparse.Namespace, rotations) -> None:
    """Save the rotations to `--out` in the `--format` asked for, with a model card, and print what was written
    and the line that loads them."""
    from oscar_hf.calibrate.hub import write_model_card
    from oscar_hf.rotations.io import SAFETENSORS_NAME

    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.format in ("safetensors", "both"):
        rotations.save_pretrained(args.out)
        written.append(os.path.join(args.out, SAFETENSORS_NAME))
    if args.format in ("zoo", "both"):
        written += list(rotations.save_zoo(args.out))
    written.append(write_model_card(args.out, rotations.metadata, args.push_to_hub, args.subfolder))
    print(f"{rotations!r} from {rotations.metadata['tokens']} tokens in {rotations.metadata['seconds']} s")
    for path in written:
        print(f"  wrote {path}")
    print(f"  use: OscarCache(model, rotations={args.out!r}{_encoder_hint(rotations.metadata)})")


def _upload(args: argparse.Namespace, rotations) -> int:
    """Upload the saved folder to `--push-to-hub`: 0, or 1 with the command that uploads it later when the Hub
    cannot be reached or refuses it."""
    from oscar_hf.calibrate.hub import one_line, push_later_command, push_to_hub

    try:
        url = push_to_hub(args.out, args.push_to_hub, rotations.metadata, args.subfolder,
                          args.private or None, args.token)
    except Exception as e:  # whatever the Hub client raises offline or on refusal: the folder is saved
        later = push_later_command(args.out, args.push_to_hub, args.subfolder, args.private)
        print(f"oscar-calibrate: saved the rotations to {args.out} but did not upload them to "
              f"{args.push_to_hub} ({one_line(e)}); upload them later with: {later}", file=sys.stderr)
        return 1
    print(f"  uploaded to {args.push_to_hub}: {url}")
    return 0


def _encoder_hint(metadata) -> str:
    """The `encoder=` argument the printed usage line needs: the recorded encoder is not applied by `OscarCache`
    itself (clip ratios are, from either format)."""
    return f", encoder={metadata['encoder']!r}" if metadata.get("encoder", "minmax") != "minmax" else ""


def _redacted(argv: list[str]) -> list[str]:
    """The command line as recorded in the metadata and the model card: the value of `--token` hidden."""
    words, hide = [], False
    for word in argv:
        words.append("***" if hide else "--token=***" if word.startswith("--token=") else word)
        hide = word == "--token"
    return words


if __name__ == "__main__":
    raise SystemExit(main())
