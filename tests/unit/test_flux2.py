"""The flux2 family against diffusers' Flux2Transformer2DModel: tiny random models ([dev] with
guidance, [klein]-like without) saved with ``save_pretrained``, loaded by knapray from their
folders, outputs and gradients of mixed-resolution batches (one process, and balanced over 4
gloo ranks with sequences split over bags and whole on ranks); RoPE ids and angles as the
pipeline's; the diffusers layout is the model's state dict and the BFL layout is what
diffusers' single-file converter turns into it; the config round-trips; variants refused;
the full-size layout is FLUX.2 [dev]'s."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (the test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (the test extra)")

from knapray.models.families import checkpoint_layout  # noqa: E402
from knapray.models.families.flux2 import Flux2Config, flux2_positions, section_from_diffusers  # noqa: E402
from knapray.testing.reference import run_reference  # noqa: E402

TINY = {  # name: (heads, head_dim, rope axes, double, single, text width, guidance)
    "dev": (2, 16, (4, 4, 4, 4), 2, 2, 24, True),
    "klein": (4, 8, (2, 2, 2, 2), 1, 2, 16, False),
}


def _diffusers_model(heads, head_dim, axes, double, single, text_dim, guidance, in_channels=16):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(patch_size=1, in_channels=in_channels, num_layers=double,
                                   num_single_layers=single, attention_head_dim=head_dim, num_attention_heads=heads,
                                   joint_attention_dim=text_dim, axes_dims_rope=axes, mlp_ratio=3.0,
                                   guidance_embeds=guidance)


def _save(path: Path, *spec) -> Path:
    torch.manual_seed(spec[0] * 100 + spec[3])
    ref = _diffusers_model(*spec)
    with torch.no_grad():  # every RMSNorm gain away from its init of 1, so that a swapped one shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
    ref.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flux2")
    return {name: _save(root / name, *spec) for name, spec in TINY.items()}


def _cfg(path: Path) -> Flux2Config:
    return Flux2Config(**section_from_diffusers(json.loads((path / "config.json").read_text()), str(path)),
                       pretrained=str(path))


def test_every_tiny_flux2_matches_diffusers_outputs_and_gradients(tiny: dict[str, Path]) -> None:
    report = run_reference([str(p) for p in tiny.values()], sequences=4, seed=3)
    for name, path in tiny.items():
        r = report[str(path)]
        print(name, r["out_rel"], r["grad_rel"])
        assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, (name, r)
        assert r["num_grads"] == len(checkpoint_layout(_cfg(path)).keys)  # every tensor compared
        assert r["family"] == "flux2" and r["heads"] == TINY[name][0]


@pytest.mark.dist
def test_balanced_on_4_ranks_matches_diffusers(tiny: dict[str, Path]) -> None:
    """g1n2+g2n1: sequences whole on ranks 0 and 1, split over the bag of ranks 2..3 (Ulysses,
    the 4-axis RoPE ids derived at home before the tokens leave)."""
    report = run_reference([str(tiny["dev"])], world_size=4, topology="g1n2+g2n1", sequences=6, seed=5)
    r = report[str(tiny["dev"])]
    print("balanced", r["out_rel"], r["grad_rel"])
    assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r


def test_rope_ids_and_angles_are_the_pipelines():
    """Two sequences packed (2 text tokens + a 2 x 3 grid, then 3 text tokens + a 1 x 2 grid):
    knapray's ids are Flux2Pipeline's txt_ids and img_ids, and its angles diffusers'
    Flux2PosEmbed's."""
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    from knapray.models.families.flux import flux_rope
    from knapray.models.packing import grid_positions

    z = torch.zeros
    pos = torch.cat((z(2, 3, dtype=torch.int64), grid_positions((1, 2, 3)), z(3, 3, dtype=torch.int64),
                     grid_positions((1, 1, 2))))
    is_text = torch.tensor([True] * 2 + [False] * 6 + [True] * 3 + [False] * 2)
    seq = torch.tensor([0] * 8 + [1] * 5)
    ids = flux2_positions(pos, seq, is_text)
    assert ids[:2].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]] and ids[8:11, 3].tolist() == [0, 1, 2]
    assert ids[2].tolist() == [0, 0, 0, 0] and ids[7].tolist() == [0, 1, 2, 0] and ids[12].tolist() == [0, 0, 1, 0]
    axes = (4, 4, 6, 2)
    cos, sin = flux_rope(ids, axes, 2000.0)
    want_cos, want_sin = Flux2PosEmbed(theta=2000, axes_dim=list(axes))(ids)
    # diffusers repeats each angle for its channel pair; knapray keeps one per pair
    assert torch.equal(cos, want_cos[:, ::2]) and torch.equal(sin, want_sin[:, ::2])


def test_diffusers_layout_is_diffusers_state_dict_and_the_config_round_trips() -> None:
    ref = _diffusers_model(2, 8, (2, 2, 2, 2), 2, 1, 12, True, in_channels=128)
    cfg = Flux2Config(**section_from_diffusers(dict(ref.config), "test"))
    assert (cfg.in_channels, cfg.depth_double, cfg.depth_single, cfg.pooled_dim) == (32, 2, 1, 0)
    layout = checkpoint_layout(cfg, "diffusers")
    assert layout.first_mismatch({k: v.shape for k, v in ref.state_dict().items()}) is None
    mine = cfg.to_diffusers()
    assert {k: v for k, v in mine.items() if k != "_class_name"} == {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in ref.config.items() if not k.startswith("_")}


def test_bfl_layout_is_what_diffusers_single_file_converter_reads(tiny: dict[str, Path]) -> None:
    """knapray's model written in BFL's names, through diffusers' FLUX.2 single-file converter:
    diffusers' tensors, bit for bit (q/k/v split, the final modulation's halves swapped)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    from knapray.testing.reference import load_model

    path = tiny["dev"]
    model, cfg, _, _ = load_model(str(path), None)
    params = {n: p.detach() for n, p in model.named_parameters()}
    bfl = checkpoint_layout(cfg, "bfl").gather(params)
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "final_layer.adaLN_modulation.1.weight" in bfl
    converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    want = load_file(str(path / "diffusion_pytorch_model.safetensors"))
    assert sorted(converted) == sorted(want)
    for key, value in want.items():
        assert torch.equal(converted[key], value), key


def test_bfl_architecture_is_read_from_the_tensor_shapes() -> None:
    """A BFL FLUX.2 file without a config.json (head size 128): its architecture from the
    shapes, told from FLUX.1's by the shared modulation; without guidance ([klein]) too."""
    from knapray.weights.source import TensorEntry, bfl_config

    for guidance, single in ((True, 2), (False, 0)):
        cfg = Flux2Config(in_channels=32, hidden_size=256, num_heads=2, depth_double=1, depth_single=single,
                          text_dim=64, guidance_embeds=guidance)
        headers = {k: TensorEntry("f", k, "BF16", shape, 0) for k, shape in checkpoint_layout(cfg, "bfl").shapes.items()}
        config = bfl_config(headers, "f")
        assert config["_class_name"] == "Flux2Transformer2DModel"
        assert Flux2Config(**section_from_diffusers(config, "f")) == cfg


def test_a_bfl_single_file_loads_the_same_weights(tiny: dict[str, Path], tmp_path: Path) -> None:
    """The diffusers checkpoint rewritten under BFL's names (one file, ComfyUI's prefix, bf16
    as BFL ships it) loads into the same parameters."""
    from safetensors.torch import save_file

    from knapray.testing.reference import load_model
    from knapray.weights.source import open_pretrained

    path = tiny["dev"]
    model, cfg, _, _ = load_model(str(path), None)
    params = {n: p.detach() for n, p in model.named_parameters()}
    bfl = checkpoint_layout(cfg, "bfl").gather(params)
    folder = tmp_path / "bfl"
    folder.mkdir()
    save_file({f"model.diffusion_model.{k}": v.to(torch.bfloat16) for k, v in bfl.items()},
              folder / "flux2-tiny.safetensors")
    (folder / "config.json").write_text((path / "config.json").read_text())  # head size 16: RoPE axes from here
    source = open_pretrained(str(folder))
    assert source.layout == "bfl" and source.path.endswith("flux2-tiny.safetensors")
    loaded, _, _, _ = load_model(str(folder), None)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, params[name].to(torch.bfloat16).float()), name


@pytest.mark.parametrize("key, value, words", [
    ("axes_dims_rope", [16, 56, 56], "axes_dims_rope=[16, 56, 56] must be 4 ints (t, h, w, l)"),
    ("out_channels", 64, "out_channels=64 differs from in_channels=128"),
    ("patch_size", 2, "patch_size=2; FLUX.2 packs 2x2 latent patches"),
    ("pooled_projection_dim", 768, "keys ['pooled_projection_dim'] are not Flux2Transformer2DModel's"),
    ("eps", 1e-5, "eps=1e-05; knapray's FLUX.2 norms use 1e-6"),
])
def test_variants_it_does_not_train_are_refused_in_one_line(key, value, words) -> None:
    with pytest.raises(ValueError) as e:
        section_from_diffusers({key: value}, "ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json: ") and words in str(e.value) and "\n" not in str(e.value)


def test_the_full_size_layout_is_flux2_devs_own():
    """FLUX.2 [dev]'s 32B shape (diffusers' defaults, built on the meta device: names and
    shapes only, as a checkpoint's headers give them): every tensor mapped, none left over,
    in both layouts."""
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        ref = Flux2Transformer2DModel()
    cfg = Flux2Config(**section_from_diffusers(dict(ref.config), "black-forest-labs/FLUX.2-dev/transformer"))
    assert (cfg.hidden_size, cfg.num_heads, cfg.depth_double, cfg.depth_single, cfg.text_dim) == (6144, 48, 8, 48,
                                                                                                   15360)
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    layout = checkpoint_layout(cfg, "diffusers")
    assert layout.first_mismatch(shapes) is None and len(layout.keys) == len(shapes) == 331
    assert sum(math.prod(s) for s in shapes.values()) / 1e9 == pytest.approx(32.22, abs=0.01)
    bfl = checkpoint_layout(cfg, "bfl")
    assert sum(math.prod(s) for s in bfl.shapes.values()) == sum(math.prod(s) for s in shapes.values())


@pytest.mark.parametrize("steps, tokens", [(3, 24), (28, 24), (3, 4400)])
def test_the_shift_is_the_pipelines_empirical_one(steps, tokens) -> None:
    """``Flux2Pipeline``'s mu of the image tokens and the step count (its ``compute_empirical_mu``)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from knapray.models.families.flux2 import sample_shift_of

    assert sample_shift_of(tokens, steps) == pytest.approx(math.exp(compute_empirical_mu(tokens, steps)), rel=1e-12)


@pytest.mark.parametrize("steps, guidance, size", [(3, 4.0, (64, 96)), (2, 2.5, (96, 64))])
def test_sampled_latents_are_the_pipelines(tiny: dict[str, Path], steps, guidance, size) -> None:
    """knapray's sampler on the tiny [dev] model against ``Flux2Pipeline`` (its scheduler as
    released: the empirical shift from the image tokens and the step count; the embedded
    guidance input) from the same noise and text features: the same latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    from knapray.inference.prepare import default_guidance
    from knapray.models.sampling import job_noise, sample_latents
    from knapray.testing.reference import load_model

    model, cfg, _, _ = load_model(str(tiny["dev"]), None)
    assert default_guidance(cfg) == 4.0  # the pipeline's guidance_scale
    height, width = size
    shape = (1, height // 8, width // 8)
    text = torch.randn(7, cfg.text_dim, generator=torch.Generator().manual_seed(3))
    ours = sample_latents(model, [(text.numpy(), np.zeros(0, np.float32))], [shape], steps=steps, seed=7,
                          guidance=guidance, shift=None)[0]
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
        use_dynamic_shifting=True, time_shift_type="exponential"), vae=None, text_encoder=None, tokenizer=None,
        transformer=Flux2Transformer2DModel.from_pretrained(tiny["dev"]))
    noise = torch.from_numpy(job_noise(cfg, [shape], 7)[0])[None, :, 0]  # (1, C, h, w), as sample_latents draws it
    with torch.no_grad():
        out = pipe(prompt_embeds=text[None], guidance_scale=guidance, height=height, width=width,
                   num_inference_steps=steps, latents=pipe._patchify_latents(noise), output_type="latent").images
    ids = pipe._prepare_latent_ids(pipe._patchify_latents(noise))
    want = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(out, ids))[0, :, None].numpy()
    assert ours.shape == want.shape
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max(), np.abs(ours - want).max()


def test_latents_are_its_vaes_normalized_as_the_pipeline(tmp_path: Path) -> None:
    """FLUX.2's VAE (AutoencoderKLFlux2, tiny and random, its batch statistics set) through
    knapray's encoder: the latents Flux2Pipeline's ``_encode_vae_image`` makes (2x2 patches
    normalized channel by channel by the VAE's running mean and variance), un-patchified; and
    decoding them undoes it as the pipeline does before its VAE's decoder."""
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline

    from knapray.corpus.hf import DiffusersVAE, vae_info

    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                             layers_per_block=1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(16) * 0.3)
        vae.bn.running_var.copy_(torch.rand(16) + 0.5)
    vae.save_pretrained(tmp_path / "vae")
    assert vae_info(tmp_path / "vae").patch_norm and vae_info(tmp_path / "vae").downsample == 2
    ours_vae = DiffusersVAE(str(tmp_path / "vae"))
    pixels = np.random.default_rng(0).integers(0, 256, size=(1, 16, 24, 3), dtype=np.uint8)
    ours = ours_vae.encode(pixels)  # (C, 1, 8, 12)
    pipe = Flux2Pipeline(scheduler=None, vae=vae.eval(), text_encoder=None, tokenizer=None, transformer=None)
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.no_grad():
        want = pipe._unpatchify_latents(pipe._encode_vae_image(x, generator=None))[0, :, None].numpy()
    assert ours.shape == want.shape == (4, 1, 8, 12)
    assert np.abs(ours - want).max() <= 1e-5 * np.abs(want).max()
    # decode: the pipeline's denormalization of the patches, then its VAE's decoder
    z = torch.from_numpy(ours[:, 0])[None]
    patches = pipe._patchify_latents(z)
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    with torch.no_grad():
        image = vae.decode(pipe._unpatchify_latents(patches * std + mean)).sample[0].permute(1, 2, 0)
    want_px = ((image.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    assert np.array_equal(ours_vae.decode(ours)[0], want_px)


def test_text_features_are_the_pipelines_and_ingest_writes_a_flux2_corpus(tmp_path: Path, capsys) -> None:
    """FLUX.2's text encoder (a tiny random Mistral3 with a chat template, saved here) through
    knapray: every caption (the empty one too, several in a batch) what Flux2Pipeline's
    ``encode_prompt`` gives: its system message and the caption through the chat template,
    padded to 512 tokens all kept, hidden states 10, 20 and 30 side by side; then ``knapray
    ingest --family flux2`` with it and FLUX.2's VAE writes a corpus that records both."""
    image = pytest.importorskip("PIL.Image")
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline
    from flux_utils import save_tiny_flux2_text_encoder
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration

    from knapray.cli import main
    from knapray.corpus import read_corpus
    from knapray.corpus.hf import HFTextEncoder
    from knapray.models.families import get_family

    text_dir = save_tiny_flux2_text_encoder(tmp_path)
    pipe = Flux2Pipeline(scheduler=None, vae=None, tokenizer=AutoTokenizer.from_pretrained(text_dir),
                         text_encoder=Mistral3ForConditionalGeneration.from_pretrained(text_dir), transformer=None)
    captions = ["a red bicycle", "", "a street at night with a red bicycle"]
    ours = HFTextEncoder(str(text_dir), pooled_vector=False,
                         prompt=get_family("flux2").encoders.prompt).encode_many(captions, max_tokens=512)
    for caption, (text, pooled) in zip(captions, ours):
        with torch.no_grad():
            want = pipe.encode_prompt(caption, device="cpu", max_sequence_length=512)[0][0].numpy()
        assert text.shape == want.shape == (512, 24) and pooled.shape == (0,)
        assert np.abs(text - want).max() <= 1e-5 * np.abs(want).max(), caption

    torch.manual_seed(0)
    AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                       up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                       layers_per_block=1).save_pretrained(tmp_path / "vae")
    media = tmp_path / "media"
    media.mkdir()
    rng = np.random.default_rng(1)
    for name in ("a.png", "b.png"):
        image.fromarray(rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8)).save(media / name)
        (media / name).with_suffix(".txt").write_text(f"picture {name}")
    out = tmp_path / "corpus"
    assert main(["ingest", "--input", str(media), "--out", str(out), "--family", "flux2", "--vae",
                 str(tmp_path / "vae"), "--text-encoder", str(text_dir), "--text-dtype", "bf16", "--quiet"]) == 0
    doc = json.loads((out / "schema.json").read_text())
    assert doc["family"] == "flux2" and doc["dims"]["text_dim"] == 24 and doc["dims"]["pooled_dim"] == 0
    text = doc["encoders"]["text"]
    assert text["prompt_layers"] == [10, 20, 30] and text["prompt_pad_to"] == 512
    assert text["prompt_system"].startswith("You are an AI that reasons about image descriptions")
    assert doc["encoders"]["latent"]["class"] == "AutoencoderKLFlux2" and "2x2 patch" in doc["encoders"]["latent"][
        "normalization"]
    assert [r["text_tokens"] for r in read_corpus(out).to_pylist()] == [512, 512]
