"""A corpus's record of how it was encoded (schema.json), rebuilt for sampling: the text
encoder that embeds captions as the corpus's were, the decoder of its latents, the image
encoder of a Wan 2.1 I2V run's conditioning, and a corpus sample's own text embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np


def corpus_records(corpus: str) -> tuple[dict, dict, dict]:
    """(text encoder record, latent encoder record, dims) from the corpus's schema.json."""
    from knapray.corpus import read_schema_json

    try:
        doc = read_schema_json(corpus)
    except (OSError, ValueError) as e:
        raise ValueError(f"the run's corpus: {e}") from None
    records = doc.get("encoders") or {}
    return records.get("text") or {}, records.get("latent") or {}, doc["dims"]


TEXT_ENCODERS = ("HashTextEncoder", "HFTextEncoder")
"""Text encoders a corpus can record that ``corpus_codecs`` rebuilds for captions."""


def corpus_codecs(corpus: str, device: str = "cpu") -> tuple[Any, Any, dict]:
    """(text encoder or None, latent decoder or None, schema dims) rebuilt from the
    corpus's schema.json, both on ``device`` (``corpus_text_encoder``, ``corpus_decoder``)."""
    return corpus_text_encoder(corpus, device), corpus_decoder(corpus, device), corpus_records(corpus)[2]


def corpus_text_encoder(corpus: str, device: str = "cpu") -> Any:
    """The text encoder the corpus records (None: none knapray rebuilds), on ``device``: in
    bf16 on a GPU (as the pipelines run T5, umT5 and CLIP), fp32 on the CPU."""
    from knapray.corpus.encoders import HashTextEncoder

    text_rec = corpus_records(corpus)[0]
    if text_rec.get("class") == "HashTextEncoder":
        return HashTextEncoder(dim=int(text_rec["dim"]), pooled_dim=int(text_rec["pooled_dim"]))
    if text_rec.get("class") != "HFTextEncoder":
        return None
    from knapray.corpus.hf import HFTextEncoder, PromptFormat

    t, p = text_rec["text"], text_rec["pooled"]
    prompt = PromptFormat.from_record(text_rec)
    separate = p is not None and p["path"] != t["path"]
    # Wan's record: no pooled vector (pooled_dim 0), captions cleaned as WanPipeline cleans them
    return HFTextEncoder(t["path"], text_tokenizer=t["tokenizer"], pooled=p["path"] if separate else None,
                         pooled_tokenizer=p["tokenizer"] if separate else None, device=device,
                         dtype=_half_on_gpu(device), pooled_vector=int(text_rec.get("pooled_dim", 1)) > 0,
                         wan_prompts="prompt_clean" in text_rec, prompt=prompt)


def corpus_decoder(corpus: str, device: str = "cpu") -> Any:
    """The decoder of the corpus's latents (None: none recorded), on ``device``: an image VAE
    in bf16 on a GPU, a video VAE in fp32 (as WanPipeline runs AutoencoderKLWan), the CPU fp32."""
    from knapray.corpus.encoders import PixelPatchEncoder

    latent_rec = corpus_records(corpus)[1]
    if latent_rec.get("class") == "PixelPatchEncoder":
        return PixelPatchEncoder(channels=int(latent_rec["channels"]), downsample=int(latent_rec["downsample"]),
                                 temporal_downsample=int(latent_rec["temporal_downsample"]),
                                 seed=int(latent_rec["seed"]))
    if "path" not in latent_rec:
        return None
    from knapray.corpus.hf import DiffusersVAE

    video = int(latent_rec.get("temporal_downsample", 1)) > 1
    return DiffusersVAE(latent_rec["path"], device=device, dtype="fp32" if video else _half_on_gpu(device))


def conditioning_image_encoder(corpus: str, model_cfg: Any, path: str | None = None,
                               processor: str | None = None) -> Any:
    """The image encoder of a run whose model takes a conditioning image's tokens
    (``model.image_dim``: Wan 2.1 I2V), as a ``corpus.hf.ImageEncoderInfo``: ``path``
    (``--image-encoder``; its processor ``processor``, else its own directory) when given, else
    the one the corpus records (schema.json ``encoders.image``: what ingest encoded its clips
    with); None where neither is. ValueError in one line naming a directory that cannot be read
    or whose tokens are not the model's; ``path`` for a model without image tokens."""
    from knapray.corpus.hf import image_encoder_info

    image_dim = int(getattr(model_cfg, "image_dim", 0) or 0)
    if path is None and processor is not None:
        raise ValueError(f"--image-processor {processor}: given without --image-encoder")
    if not image_dim:
        if path is not None:
            raise ValueError(f"--image-encoder {path}: this run's model takes no image tokens (model.image_dim is 0)")
        return None
    if path is not None:
        flag, where = "--image-encoder", path
    else:
        from knapray.corpus import read_schema_json

        record = (read_schema_json(corpus).get("encoders") or {}).get("image") or {}
        if "path" not in record:
            return None
        flag, where, processor = "the corpus's image encoder", record["path"], record.get("processor")
    try:
        info = image_encoder_info(where, processor, flag=flag)
    except (OSError, ValueError) as e:
        hint = "" if path is not None else " (give --image-encoder DIR, the CLIPVisionModel it was ingested with)"
        raise ValueError(f"{e}{hint}") from None
    if (info.dim, info.tokens) != (image_dim, int(model_cfg.image_tokens)):
        raise ValueError(f"{flag} {where}: {info.tokens} tokens of width {info.dim}; the model takes "
                         f"{model_cfg.image_tokens} of width {image_dim} (model.image_tokens, model.image_dim)")
    return info


def corpus_conditioning(corpus: str, vae: Any, info: Any, device: str = "cpu") -> Any:
    """The conditioning image's encoder of a Wan 2.1 I2V run, as ingest built it
    (``corpus.hf.WanI2VConditioning``): over ``vae`` (the corpus's, ``corpus_decoder``'s: not a
    second copy) and the image encoder ``info`` (``conditioning_image_encoder``), on ``device`` in
    the dtype the corpus records for it (fp32 where it records none)."""
    from knapray.corpus import read_schema_json
    from knapray.corpus.hf import WanI2VConditioning

    record = (read_schema_json(corpus).get("encoders") or {}).get("image") or {}
    return WanI2VConditioning(vae, info.path, info.processor, device, record.get("dtype", "fp32"))


def _half_on_gpu(device: str) -> str:
    return "bf16" if str(device).startswith("cuda") else "fp32"


def corpus_text(corpus: str, sample_id: int, text_dim: int, pooled_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A corpus sample's text and pooled embeddings."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from knapray.corpus import decode_row, shard_paths

    for path in shard_paths(corpus):
        table = pq.read_table(path)
        hit = table.filter(pc.equal(table["sample_id"], sample_id))
        if hit.num_rows:
            row = decode_row(hit.to_pylist()[0], text_dim=text_dim, pooled_dim=pooled_dim)
            return row["text"], row["pooled"]
    raise ValueError(f"--like {sample_id}: no sample with that id in {corpus}")
