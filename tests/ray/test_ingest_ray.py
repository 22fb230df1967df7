"""Ingestion as a Ray Data pipeline (decode tasks + an actor pool of encoders holding a
tiny VAE, T5 and CLIP) against the in-process path as the reference: same rows, same
order, same schema.json. One Ray Data run (actor start-up is most of its time)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers", reason="needs the encoders extra: pip install 'knapray[encoders]'")
pytest.importorskip("transformers", reason="needs the encoders extra: pip install 'knapray[encoders]'")

import tiny_encoders as te

from knapray.corpus import decode_row, read_corpus, read_schema_json
from knapray.corpus.ingest import EncoderSpec, IngestConfig, ingest


@pytest.mark.ray
def test_ray_data_actor_pool_writes_the_rows_of_the_in_process_path(ray_session, tmp_path: Path) -> None:
    images = te.sample_images(tmp_path / "images")
    (images / "extra").mkdir()
    for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png"):  # captioned by sidecars
        (images / "extra" / name).write_bytes((images / name).read_bytes())
        (images / "extra" / name).with_suffix(".txt").write_text("a red fox")
    spec = EncoderSpec(
        vae=str(te.save_vae(tmp_path / "vae")), text_encoder=str(te.save_t5(tmp_path / "t5")),
        pooled_encoder=str(te.save_clip(tmp_path / "clip", projection=False)), device="auto",
    )
    ref = ingest(images, tmp_path / "local", IngestConfig(max_side=64), encoders=spec, progress=False)
    started = time.perf_counter()
    # batch_size 1: five blocks spread over the two actors.
    got = ingest(images, tmp_path / "ray", IngestConfig(max_side=64, workers=2, batch_size=1),
                 encoders=spec, progress=False)
    print(f"ray data ingest of 5 files with 2 actors: {time.perf_counter() - started:.1f} s")
    assert got.written == ref.written == 5

    want, have = read_corpus(tmp_path / "local").to_pylist(), read_corpus(tmp_path / "ray").to_pylist()
    assert [r["source"] for r in have] == [r["source"] for r in want]  # file order kept
    doc, ref_doc = read_schema_json(tmp_path / "ray"), read_schema_json(tmp_path / "local")
    for key in ("dims", "encoders", "captions", "counts", "shard_rows"):
        assert doc[key] == ref_doc[key], key
    assert doc["captions"] == {"column": "text", "metadata": 3, "sidecar": 2, "none": 0}
    assert doc["config"]["workers"] == 2
    dims = doc["dims"]
    for a, b in zip(have, want):
        assert {k: v for k, v in a.items() if not isinstance(v, list)} == {
            k: v for k, v in b.items() if not isinstance(v, list)
        }
        sa = decode_row(a, text_dim=dims["text_dim"], pooled_dim=dims["pooled_dim"])
        sb = decode_row(b, text_dim=dims["text_dim"], pooled_dim=dims["pooled_dim"])
        for key in ("latent", "text", "pooled"):  # other batches and thread counts: float sums reorder
            np.testing.assert_allclose(sa[key], sb[key], atol=2e-5, err_msg=f"{a['source']} {key}")


@pytest.mark.ray
def test_ray_data_actors_write_the_i2v_conditioning_of_the_in_process_path(ray_session, tmp_path: Path) -> None:
    """``--family wan --image-encoder``: each actor builds its conditioning over its own Wan VAE
    and CLIP vision model; rows, dims and records as the in-process path's."""
    from PIL import Image

    from knapray.models.families import FAMILIES

    media = tmp_path / "media"
    media.mkdir()
    rng = np.random.default_rng(0)
    for name, frames in (("clip9.tif", 9), ("clip5.tif", 5), ("still.png", 1)):
        images = [Image.fromarray(f) for f in rng.integers(0, 256, size=(frames, 32, 48, 3), dtype=np.uint8)]
        images[0].save(media / name, save_all=frames > 1, append_images=images[1:])
    spec = EncoderSpec(vae=str(te.save_wan(tmp_path / "vae")), text_encoder=str(te.save_umt5(tmp_path / "umt5")),
                       image_encoder=str(te.save_clip_vision(tmp_path / "clip")), device="cpu",
                       family=FAMILIES["wan"].encoders)
    cfg = dict(max_side=48, max_frames=9, max_text_tokens=512)
    ingest(media, tmp_path / "local", IngestConfig(**cfg), encoders=spec, progress=False)
    ingest(media, tmp_path / "ray", IngestConfig(**cfg, workers=1, batch_size=2), encoders=spec, progress=False)
    doc, ref_doc = read_schema_json(tmp_path / "ray"), read_schema_json(tmp_path / "local")
    for key in ("dims", "encoders", "image_encoder", "columns"):
        assert doc[key] == ref_doc[key], key
    dims = doc["dims"]
    assert (dims["condition_channels"], dims["image_dim"], dims["image_tokens"]) == (8, 8, 5)
    want, have = read_corpus(tmp_path / "local").to_pylist(), read_corpus(tmp_path / "ray").to_pylist()
    assert [r["source"] for r in have] == [r["source"] for r in want]
    for a, b in zip(have, want):
        sa, sb = (decode_row(r, text_dim=dims["text_dim"], pooled_dim=0, condition_channels=8, image_dim=8)
                  for r in (a, b))
        for key in ("latent", "condition", "image_context"):
            np.testing.assert_allclose(sa[key], sb[key], atol=2e-5, err_msg=f"{a['source']} {key}")
