"""Tiny randomly initialized encoders saved like real checkpoints, for the adapter tests:
a diffusers AutoencoderKL (Flux-style shift and scale), a Wan video VAE, a T5 encoder, a
umT5 encoder and a CLIP text model, each with a tokenizer built here (no network: a WordLevel
vocabulary of the test captions wrapped in PreTrainedTokenizerFast), and a CLIP vision model
with its image processor. Also a folder of the sample
images matplotlib ships, captioned by a metadata.jsonl."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

WORDS = (
    "a the of in and with red blue fox dog jumps over lazy grace hopper navy uniform "
    "portrait woman present pack box logo matplotlib word plot"
).split()
CAPTIONS = {
    "grace_hopper.jpg": "a portrait of Grace Hopper in navy uniform",
    "Minduka_Present_Blue_Pack.png": "a blue present pack",
    "sub/logo2.png": "the matplotlib logo",
}
SIDECAR = "a red fox"  # written beside grace_hopper.jpg: metadata.jsonl must win over it
VAE_SHIFT, VAE_SCALE = 0.1159, 0.3611  # Flux's factors


def _word_level(specials: list[str], template: str):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(specials + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(s, vocab[s]) for s in specials if s in template]
    )
    return tok, vocab


def save_vae(out: Path) -> Path:
    """AutoencoderKL, block_out_channels (8, 16): 4 latent channels, downsample 2."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, sample_size=32,
        norm_num_groups=8, layers_per_block=1, shift_factor=VAE_SHIFT, scaling_factor=VAE_SCALE,
    )
    vae.save_pretrained(out)
    return out


def save_wan(out: Path) -> Path:
    """AutoencoderKLWan with 4 levels: downsample 8, 4 frames per latent frame, per-channel
    latents_mean/std."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[2.0, 1.5, 0.5, 1.0],
    )
    vae.save_pretrained(out)
    return out


def save_hunyuan(out: Path) -> Path:
    """AutoencoderKLHunyuanVideo with 3 blocks: downsample 4, 4 frames per latent frame,
    scaling_factor 0.5."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, latent_channels=4, norm_num_groups=4,
        layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=4, scaling_factor=0.5,
    )
    vae.save_pretrained(out)
    return out


def save_t5(out: Path) -> Path:
    """T5EncoderModel (d_model 16) with a tokenizer appending </s>, like T5's."""
    import torch
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    tok, vocab = _word_level(["<pad>", "</s>", "<unk>"], "$A </s>")
    torch.manual_seed(0)
    T5EncoderModel(
        T5Config(vocab_size=len(vocab), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    ).save_pretrained(out)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    ).save_pretrained(out)
    return out


def save_umt5(out: Path) -> Path:
    """UMT5EncoderModel (d_model 16; Wan's text encoder is umT5-XXL) with T5's word-level
    tokenizer appending </s>."""
    import torch
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    tok, vocab = _word_level(["<pad>", "</s>", "<unk>"], "$A </s>")
    torch.manual_seed(2)
    UMT5EncoderModel(
        UMT5Config(vocab_size=len(vocab), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    ).save_pretrained(out)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    ).save_pretrained(out)
    return out


def save_clip(out: Path, *, projection: bool) -> Path:
    """CLIPTextModel (hidden 12), or CLIPTextModelWithProjection (projection 10), with a
    tokenizer adding start and end tokens, like CLIP's."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, PreTrainedTokenizerFast

    specials = ["<|startoftext|>", "<|endoftext|>", "<unk>"]
    tok, vocab = _word_level(specials, "<|startoftext|> $A <|endoftext|>")
    config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=12, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=3, projection_dim=10, max_position_embeddings=77,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    torch.manual_seed(1)
    (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).save_pretrained(out)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1], pad_token=specials[1],
        unk_token="<unk>", model_max_length=77,
    ).save_pretrained(out)
    return out


def save_clip_vision(out: Path) -> Path:
    """CLIPVisionModel (image_size 28, patch_size 14, hidden 8: 5 tokens; Wan 2.1 I2V's image
    encoder is CLIP ViT-H/14, 257 x 1280) with a CLIPImageProcessor cropping 28x28, as its
    image_encoder/ and image_processor/ hold them, here in one folder."""
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(3)
    CLIPVisionModel(CLIPVisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2, image_size=28,
        patch_size=14, projection_dim=8,
    )).save_pretrained(out)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(out)
    return out


def sample_images(out: Path) -> Path:
    """matplotlib's sample images (128x128 RGBA, 600x512, 542x130 RGBA), one in a sub
    folder, captioned by metadata.jsonl (file_name relative to it); a contradicting
    sidecar .txt beside one of them."""
    import matplotlib

    src = Path(matplotlib.get_data_path()) / "sample_data"
    for rel in CAPTIONS:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / Path(rel).name, out / rel)
    (out / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": rel, "text": cap}) + "\n" for rel, cap in CAPTIONS.items())
    )
    (out / "grace_hopper.txt").write_text(SIDECAR)
    return out


def save_flux_layout(root: Path) -> Path:
    """A FLUX.1-dev-shaped model folder of tiny models: ``vae/`` (AutoencoderKL with 16
    latent channels and downsample 8, Flux's factors), ``text_encoder/`` + ``tokenizer/``
    (CLIP) and ``text_encoder_2/`` + ``tokenizer_2/`` (T5), and ``transformer/`` (a Flux of
    width 32 taking those widths: ``TINY_FLUX_TRANSFORMER``), so that a command written for
    the real folder runs with only its root substituted."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(
        block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16, sample_size=64,
        norm_num_groups=4, layers_per_block=1, shift_factor=VAE_SHIFT, scaling_factor=VAE_SCALE,
    ).save_pretrained(root / "vae")
    save_t5(root / "text_encoder_2")
    save_clip(root / "text_encoder", projection=False)
    for model, tokenizer in (("text_encoder_2", "tokenizer_2"), ("text_encoder", "tokenizer")):
        (root / tokenizer).symlink_to(root / model, target_is_directory=True)
    from diffusers import FluxTransformer2DModel

    FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER).save_pretrained(root / "transformer")
    return root


TINY_FLUX_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                             num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=12,
                             guidance_embeds=True, axes_dims_rope=(4, 6, 6))
"""The tiny FLUX.1-dev stand-in's transformer: the VAE's 16 latent channels (x 2 x 2), the
tiny T5's 16 and CLIP's 12 widths."""


def save_wan22_layout(root: Path) -> Path:
    """A Wan2.2-T2V-A14B-Diffusers-shaped pipeline folder of tiny models: ``vae/``
    (``save_wan``), ``text_encoder/`` + ``tokenizer/`` (umT5, ``save_umt5``), the two experts
    ``transformer/`` and ``transformer_2/`` (tiny Wans of different random weights taking those
    widths: ``TINY_WAN_TRANSFORMER``) and model_index.json with A14B's ``boundary_ratio``, so
    that a command written for the real folder runs with only its root substituted."""
    import json

    import torch
    from diffusers import WanTransformer3DModel

    save_wan(root / "vae")
    save_umt5(root / "text_encoder")
    (root / "tokenizer").symlink_to(root / "text_encoder", target_is_directory=True)
    from diffusers import UniPCMultistepScheduler

    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0).save_pretrained(
        root / "scheduler")  # (A14B's: shift 12)
    for i, name in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(20 + i)
        WanTransformer3DModel(**TINY_WAN_TRANSFORMER).save_pretrained(root / name)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": 0.875, "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"]}))
    return root


TINY_WAN_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)
"""The tiny Wan 2.2 stand-in's experts: the tiny AutoencoderKLWan's 4 latent channels, the
tiny umT5's 16."""


def sample_clips(out: Path, frames: tuple[int, ...] = (9, 5)) -> Path:
    """Clips as multi-frame TIFFs (lossless, read without a video decoder) of random pixels,
    32 x 48, with captions in metadata.jsonl."""
    import json

    import numpy as np
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    captions = {}
    for i, n in enumerate(frames):
        images = [Image.fromarray(f) for f in rng.integers(0, 256, size=(n, 32, 48, 3), dtype=np.uint8)]
        images[0].save(out / f"clip{i}.tif", save_all=True, append_images=images[1:])
        captions[f"clip{i}.tif"] = f"a clip of {n} frames"
    (out / "metadata.jsonl").write_text("".join(json.dumps({"file_name": k, "text": v}) + "\n"
                                                for k, v in captions.items()))
    return out


def write_media(out: Path, frames: dict[str, int], captions: dict[str, str], seed: int = 0) -> dict:
    """``frames``: file name -> frames, written as random 32 x 48 pixels (a multi-frame TIFF for
    a clip, a PNG for a still), with ``captions`` in metadata.jsonl. Returns each file's pixels
    ((frames, 32, 48, 3) uint8), in ``frames``' order from one generator of ``seed``."""
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pixels = {}
    for name, n in frames.items():
        pixels[name] = rng.integers(0, 256, size=(n, 32, 48, 3), dtype=np.uint8)
        images = [Image.fromarray(f) for f in pixels[name]]
        images[0].save(out / name, save_all=n > 1, append_images=images[1:])
    (out / "metadata.jsonl").write_text("".join(json.dumps({"file_name": k, "text": v}) + "\n"
                                                for k, v in captions.items()))
    return pixels
