"""Tiny random Flux.1 transformers saved by diffusers (``save_pretrained``), for the flux
family's tests: several head counts, RoPE axes, depths, with and without guidance."""

from __future__ import annotations

from pathlib import Path

TINY_FLUX = {
    # name: (heads, head_dim, axes_dims_rope, num_layers, num_single_layers, guidance_embeds)
    "dev_h2": (2, 16, (4, 6, 6), 1, 1, True),
    "schnell_h4": (4, 8, (2, 2, 4), 2, 1, False),
    "dev_h6": (6, 8, (0, 4, 4), 1, 2, True),
}
"""Every head count divides 2, the largest bag of the 4-rank tests' g1n2+g2n1."""


def save_tiny_flux(out: Path, heads: int, head_dim: int, axes: tuple[int, int, int], double: int, single: int,
                   guidance: bool, *, seed: int = 0, latent_channels: int = 4, text_dim: int = 24,
                   pooled_dim: int = 20, max_shard_size: str | None = None) -> Path:
    """A ``FluxTransformer2DModel`` with diffusers' own random init, saved as diffusers saves
    it (sharded with an index when ``max_shard_size`` is small)."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=double, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim, guidance_embeds=guidance, axes_dims_rope=tuple(axes),
    )
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return Path(out)


def save_all(root: Path) -> dict[str, Path]:
    """Every ``TINY_FLUX`` config under ``root`` (the first sharded into several files)."""
    return {name: save_tiny_flux(root / name, *spec, seed=i, max_shard_size="40KB" if i == 0 else None)
            for i, (name, spec) in enumerate(TINY_FLUX.items())}


FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))
"""FLUX.1-dev's transformer config (its config.json's architecture fields)."""


def save_flux_headers(out: Path, **config) -> Path:
    """A full-size Flux transformer directory made of headers: diffusers' own model built on
    the meta device gives config.json and every tensor's name and shape; the safetensors
    file is its header and a hole the size of the bf16 data (a sparse file: no disk used).
    What pre-flight reads of a real download, without the 24 GB."""
    from diffusers import FluxTransformer2DModel

    return save_headers(out, FluxTransformer2DModel, {**FLUX1_DEV, **config})


def save_wan_headers(out: Path) -> Path:
    """``save_flux_headers`` for Wan 2.1 T2V 14B (``WanTransformer3DModel``'s defaults are
    its shape): what pre-flight reads of the Wan2.1-T2V-14B-Diffusers transformer."""
    from diffusers import WanTransformer3DModel

    return save_headers(out, WanTransformer3DModel, {})


def save_qwen_image_headers(out: Path) -> Path:
    """``save_flux_headers`` for Qwen-Image (``QwenImageTransformer2DModel``'s defaults are its
    20B shape): what pre-flight reads of the Qwen/Qwen-Image pipeline's transformer."""
    from diffusers import QwenImageTransformer2DModel

    return save_headers(out, QwenImageTransformer2DModel, {})


def save_flux2_headers(out: Path) -> Path:
    """``save_flux_headers`` for FLUX.2 [dev] (``Flux2Transformer2DModel``'s defaults are its
    32B shape): what pre-flight reads of the black-forest-labs/FLUX.2-dev pipeline's
    transformer."""
    from diffusers import Flux2Transformer2DModel

    return save_headers(out, Flux2Transformer2DModel, {})


def save_headers(out: Path, cls, config: dict) -> Path:
    """diffusers' ``cls(**config)`` on the meta device as a sparse checkpoint: config.json,
    and a safetensors file of every tensor's header over a hole the size of its bf16 data."""
    import json
    import os
    import struct

    import torch

    with torch.device("meta"):
        model = cls(**config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(model.to_json_string())
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        size = tensor.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path = out / "diffusion_pytorch_model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    assert os.stat(path).st_blocks * 512 < 1 << 24, "the file system wrote the hole: no sparse files here"
    return out


def save_tiny_qwen_encoders(root: Path, text_dim: int = 32, channels: int = 4) -> dict[str, Path]:
    """Qwen-Image's other models, tiny and random, saved as its pipeline folder holds them:
    ``text_encoder/`` (a Qwen2.5-VL with its tokenizer: a byte-level BPE trained here, with
    the chat template's special tokens) and ``vae/`` (an AutoencoderKLQwenImage of
    ``channels`` latent channels with per-channel mean and std)."""
    import torch
    from diffusers import AutoencoderKLQwenImage
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["a red bicycle on a street at night", "Describe the image by detailing the color"],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                 "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = Qwen2TokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None)
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": text_dim, "intermediate_size": 2 * text_dim,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 2048, "bos_token_id": None, "eos_token_id": 0,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": text_dim, "fullatt_block_indexes": [0]})
    text = root / "text_encoder"
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(text)
    tokenizer.save_pretrained(text)
    vae = root / "vae"
    AutoencoderKLQwenImage(base_dim=8, z_dim=channels, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0][:channels],
                           latents_std=[1.5, 2.0, 0.5, 1.0][:channels]).save_pretrained(vae)
    return {"text_encoder": text, "vae": vae}


CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'][0]['text'] }}"
                 "[/SYSTEM_PROMPT]{% else %}[INST]{{ m['content'][0]['text'] }}[/INST]{% endif %}{% endfor %}")
"""A chat template of Mistral's shape (system prompt, then the user's turn) for the tiny tokenizer."""


def save_tiny_flux2_text_encoder(root: Path, hidden: int = 8) -> Path:
    """FLUX.2's text encoder, tiny and random: a Mistral3ForConditionalGeneration of 30 text
    layers (the pipeline stacks hidden states 10, 20 and 30) of width ``hidden``, with a
    byte-level BPE tokenizer trained here and a chat template, saved as ``root/text_encoder``
    (the tokenizer beside the model)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    bpe.train_from_iterator(["a red bicycle on a street at night", "You are an AI that reasons about images"],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        chat_template=CHAT_TEMPLATE, model_max_length=1024)
    torch.manual_seed(0)
    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": hidden,
                     "intermediate_size": 2 * hidden, "num_hidden_layers": 30, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": hidden // 2, "max_position_embeddings": 1024,
                     "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        vision_config={"model_type": "pixtral", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 4, "image_size": 32, "patch_size": 16},
        image_token_index=7, spatial_merge_size=1)
    out = root / "text_encoder"
    Mistral3ForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
