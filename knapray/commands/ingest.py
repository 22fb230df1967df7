"""``knapray ingest`` (also ``python -m knapray.commands.ingest``): encode a folder of images
and videos into a corpus (knapray/corpus/ingest.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from knapray.corpus.ingest import EncoderSpec, IngestConfig, ingest
from knapray.corpus.schema import FAMILIES, TEXT_DTYPES, WAN_TEXT_LENGTH
from knapray.corpus.stages import FamilyEncoding
from knapray.planning.shapes.mix import MAX_TEXT_TOKENS


DESCRIPTION = (
    "Encode a folder of images (and videos, if a decoder is installed) into "
    "a knapray corpus: parquet shards + schema.json. Latents from a diffusers VAE (--vae), "
    "text from T5/CLIP (--text-encoder, --pooled-encoder), Wan 2.1 I2V conditioning from a CLIP vision "
    "model (--image-encoder), all from local directories; "
    "without them, weightless stand-ins. Captions from metadata.jsonl, else sidecar .txt."
)


def build_parser() -> argparse.ArgumentParser:
    from knapray.commands.flags import Parser

    p = Parser(prog="ingest_images", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_device, add_dtype, add_seed, float_in, int_at_least, text_tokens
    from knapray.limits import MAX_EMBED_DIM, MAX_SHARDS

    p.add_argument("--input", required=True, help="folder searched recursively")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    g = p.add_argument_group("encoders (local directories; pip install 'knapray[encoders]')")
    g.add_argument("--vae", metavar="DIR", help="diffusers VAE: AutoencoderKL (Flux, SD3, SDXL; videos "
                   "frame by frame) or AutoencoderKLWan / AutoencoderKLHunyuanVideo (time compressed)")
    g.add_argument("--text-encoder", metavar="DIR", help="T5 (T5EncoderModel) or CLIP text model: its "
                   "token embeddings are the text tokens")
    g.add_argument("--text-tokenizer", metavar="DIR", help="tokenizer of --text-encoder, when not in its "
                   "directory (Flux: tokenizer_2/)")
    g.add_argument("--pooled-encoder", metavar="DIR", help="CLIP text model: its pooled output is the "
                   "pooled vector (default: --text-encoder's when CLIP, the token mean when T5)")
    g.add_argument("--pooled-tokenizer", metavar="DIR", help="tokenizer of --pooled-encoder, when not in "
                   "its directory (Flux: tokenizer/)")
    g.add_argument("--image-encoder", metavar="DIR", help="--family wan: CLIP vision model (CLIPVisionModel, Wan "
                   "2.1 I2V's image_encoder/): each row also holds its image-to-video conditioning as "
                   "WanImageToVideoPipeline computes it from the first frame (the condition latent, by --vae, and "
                   "the image tokens)")
    g.add_argument("--image-processor", metavar="DIR", help="CLIPImageProcessor of --image-encoder, when not in "
                   "its directory (Wan 2.1 I2V: image_processor/)")
    add_device(g)
    add_dtype(g, help="model dtype (auto: bf16 on cuda, fp32 on cpu); rows are float32")
    g.add_argument("--vae-batch", type=int_at_least(1), default=8, help="frames per VAE call")
    g.add_argument("--text-batch", type=int_at_least(1), default=32, help="captions per text-model call")
    g.add_argument("--encoder-factory", metavar="MODULE:NAME", help="callable returning a LatentEncoder, "
                   "instead of --vae")
    g.add_argument("--text-encoder-factory", metavar="MODULE:NAME", help="callable returning a "
                   "TextEncoder, instead of --text-encoder")
    g.add_argument("--family", default=None, help=f"the model family the corpus is for ({', '.join(FAMILIES)}), "
                   "recorded in schema.json (pre-flight refuses a model of another family). wan: umT5 tokens "
                   f"unpadded (WanPipeline pads to {WAN_TEXT_LENGTH} with zeros: schema.json text_pad_to), at most "
                   f"{WAN_TEXT_LENGTH}, prompts cleaned as WanPipeline does, no pooled vector (pooled_dim 0)")
    s = p.add_argument_group("stand-in encoders (used without --vae / --text-encoder)")
    s.add_argument("--channels", type=int_at_least(1, MAX_EMBED_DIM), default=4, help="latent channels")
    s.add_argument("--downsample", type=int_at_least(1), default=8, help="spatial downsample")
    add_seed(s, help="seed of the RGB->C matrix")
    s.add_argument("--text-dim", type=int_at_least(1, MAX_EMBED_DIM), default=64, help="text embedding width")
    s.add_argument("--pooled-dim", type=int_at_least(1, MAX_EMBED_DIM), default=32, help="pooled width")
    r = p.add_argument_group("parallelism")
    r.add_argument("--workers", type=int_at_least(0), default=0, help="0: in this process, no Ray; N: Ray Data with "
                   "N encode actors (one GPU each when on cuda); joins RAY_ADDRESS's cluster if set")
    r.add_argument("--cpus-per-worker", type=float_in(gt=0), default=1.0, help="CPUs reserved per encode actor")
    r.add_argument("--batch-size", type=int_at_least(1), default=16, help="files per decode task / encode call")
    d = p.add_argument_group("data")
    d.add_argument("--caption-column", default="text", help="caption key in metadata.jsonl")
    d.add_argument("--trigger", default="", help="a trigger word put before every caption ('WORD, caption'; "
                   "recorded in schema.json). Files under a top-level folder named N_name are N samples each "
                   "(kohya's repeats)")
    d.add_argument("--max-side", type=int_at_least(1), default=512, help="shrink frames to this longest side (px)")
    d.add_argument("--max-frames", type=int_at_least(1), default=16, help="frames kept per video")
    d.add_argument("--frame-stride", type=int_at_least(1), default=1, help="keep every n-th video frame")
    d.add_argument("--max-text-tokens", type=text_tokens, help=f"caption token limit (default {MAX_TEXT_TOKENS}; "
                   f"--family wan: {WAN_TEXT_LENGTH})")
    d.add_argument("--shards", type=int_at_least(1, MAX_SHARDS), default=1, help="target number of parquet files")
    d.add_argument("--text-dtype", choices=TEXT_DTYPES, default="fp32", help="store text embeddings as fp32 or "
                   "bf16 (half the bytes; rounded as torch rounds, read back exactly; default fp32)")
    d.add_argument("--follow-symlinks", action="store_true",
                   help="also read files that are symbolic links, wherever they point (default: only regular "
                        "files whose real path lies inside --input; folders reached through a link are never entered)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError) as e:
        parser.error(str(e))


def cli(args: argparse.Namespace) -> int:
    """``knapray ingest``: ``run``, with a factory that does not fit or a missing extra as
    one line (ValueError) like every other bad input."""
    try:
        return run(args)
    except (TypeError, ImportError) as e:
        raise ValueError(str(e)) from None


def _family(name: str | None) -> FamilyEncoding | None:
    """``--family``'s encoding (``knapray.models.families.Family.encoders``)."""
    if name is None:
        return None
    from knapray.models.families import FAMILIES, FAMILY_NAMES  # the command line knows the families

    if name not in FAMILIES:
        raise ValueError(f"family {name!r} is not one of {FAMILY_NAMES}")
    return FAMILIES[name].encoders


def _max_text_tokens(args: argparse.Namespace, family: FamilyEncoding | None) -> int:
    if args.max_text_tokens is not None:
        return int(args.max_text_tokens)
    if family is None:
        return MAX_TEXT_TOKENS
    # the pipeline's own length: Wan's padded text, FLUX.2's padded chat (all of it kept)
    return family.text_length or (family.prompt.pad_to if family.prompt is not None else 0) or MAX_TEXT_TOKENS


def run(args: argparse.Namespace) -> int:
    """Ingest as the parsed arguments say; bad input raises (ValueError, FileExistsError, ...)."""
    family = _family(args.family)
    cfg = IngestConfig(
        max_side=args.max_side, max_frames=args.max_frames, frame_stride=args.frame_stride,
        max_text_tokens=_max_text_tokens(args, family), shards=args.shards, caption_column=args.caption_column,
        batch_size=args.batch_size, workers=args.workers, cpus_per_worker=args.cpus_per_worker,
        text_dtype=args.text_dtype, follow_symlinks=args.follow_symlinks, trigger=args.trigger,
    )
    spec = EncoderSpec(
        vae=args.vae, text_encoder=args.text_encoder, text_tokenizer=args.text_tokenizer,
        pooled_encoder=args.pooled_encoder, pooled_tokenizer=args.pooled_tokenizer,
        image_encoder=args.image_encoder, image_processor=args.image_processor,
        device=args.device, dtype=args.dtype, vae_batch=args.vae_batch, text_batch=args.text_batch,
        encoder_factory=args.encoder_factory, text_encoder_factory=args.text_encoder_factory,
        channels=args.channels, downsample=args.downsample, seed=args.seed,
        text_dim=args.text_dim, pooled_dim=args.pooled_dim, family=family,
    )
    report = ingest(Path(args.input), Path(args.out), cfg, encoders=spec, progress=not args.quiet)
    print(
        f"{report.written} samples in {report.seconds:.1f} s, skipped {report.skipped or 'none'} "
        f"-> {report.schema_path}"
    )
    return 0


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
