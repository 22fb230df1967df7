"""Training Wan 2.2 TI2V-5B image-to-video on clips' own first frames (``flow.first_frame_share``):
a conditioned clip's first latent frame stays clean at time 0 and out of the loss, the rest of
the batch is drawn exactly as without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knapray.data.batches import build_packed_batch
from knapray.models.families.wan import WanConfig
from knapray.models.flow import flow_loss
from knapray.models.packing import pack_samples


def _cfg(expand: bool = True) -> WanConfig:
    return WanConfig(in_channels=4, patch_size=(1, 2, 2), hidden_size=32, num_heads=2, depth_single=1, text_dim=8,
                     ffn_dim=32, freq_dim=16, text_pad_to=0, expand_timesteps=expand)


def _samples() -> list[dict]:
    rng = np.random.default_rng(0)
    shapes = [(4, 3, 4, 4), (4, 1, 4, 6), (4, 2, 2, 4)]  # a clip of 3 latent frames, an image, a clip of 2
    return [{"sample_id": i, "latent": rng.standard_normal(s).astype(np.float32),
             "text": rng.standard_normal((3, 8)).astype(np.float32), "pooled": np.zeros(0, np.float32)}
            for i, s in enumerate(shapes)]


def test_conditioned_clips_keep_their_first_frame_clean_and_out_of_the_loss():
    cfg = _cfg()
    plain = build_packed_batch(_samples(), cfg, seed=3)
    assert plain.loss_tokens is None and torch.equal(plain.first_frame_timesteps, plain.timesteps)
    clean = pack_samples([{"latent": torch.from_numpy(x["latent"]), "text": torch.from_numpy(x["text"]),
                           "pooled": torch.from_numpy(x["pooled"]), "timestep": 0.0} for x in _samples()], cfg)
    every = build_packed_batch(_samples(), cfg, seed=3, first_frame_share=1.0)
    img_seq = plain.image_seq_index
    frame = plain.pos[~plain.is_text][:, 0]
    kept = (frame == 0) & (img_seq != 1)  # the clips' first frames (the image is generated whole)
    assert torch.equal(every.loss_tokens, ~kept)
    assert torch.equal(every.first_frame_timesteps, torch.where(torch.tensor([True, False, True]),
                                                                torch.zeros(3), plain.timesteps))
    assert torch.equal(every.x_img[kept], clean.x_img[kept])  # the clean latent
    assert torch.equal(every.x_img[~kept], plain.x_img[~kept])  # everything else as drawn without it
    assert torch.equal(every.targets, plain.targets) and torch.equal(every.timesteps, plain.timesteps)
    some = build_packed_batch(_samples(), cfg, seed=3, first_frame_share=0.5)
    assert some.loss_tokens is not None and set((some.first_frame_timesteps == 0).tolist()) <= {True, False}


def test_the_loss_leaves_out_the_tokens_it_is_told_to():
    gen = torch.Generator().manual_seed(0)
    pred, target = torch.randn(10, 6, generator=gen), torch.randn(10, 6, generator=gen)
    mask = torch.tensor([True, False] * 5)
    assert torch.allclose(flow_loss(pred, target, 5, mask), flow_loss(pred[mask], target[mask], 5))


def test_a_model_with_one_time_per_sequence_refuses_the_share():
    from knapray.config.run import load_config

    with pytest.raises(ValueError, match="first_frame_share"):
        build_packed_batch(_samples(), _cfg(expand=False), seed=3, first_frame_share=0.5)
    with pytest.raises(ValueError, match="expand_timesteps") as e:
        load_config(None, ["model.family=wan", "flow.first_frame_share=0.5"])
    assert "\n" not in str(e.value)
