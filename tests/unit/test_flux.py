"""The flux family in one process: exact against diffusers' FluxTransformer2DModel (outputs
and gradients of packed mixed-resolution batches), its checkpoint layouts (diffusers, BFL),
pre-flight errors naming the first bad key, config from a checkpoint, the fine-tuning
recipe (resolution shift, guidance input, caption dropout, unconditional record), export,
and sampling's Flux conventions."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (the test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (the test extra)")

from flux_utils import TINY_FLUX, save_all, save_tiny_flux  # noqa: E402

from knapray.models.families import build_model, checkpoint_layout, condition_inputs, param_shapes  # noqa: E402
from knapray.models.families.flux import FluxConfig, section_from_diffusers  # noqa: E402
from knapray.testing.reference import compare, diffusers_reference, load_model, make_inputs, run_reference  # noqa: E402
from knapray.weights.checks import check_pretrained  # noqa: E402
from knapray.weights.source import bfl_config, open_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_all(tmp_path_factory.mktemp("flux"))


def _cfg(path: Path) -> FluxConfig:
    return FluxConfig(**section_from_diffusers(json.loads((path / "config.json").read_text()), str(path)),
                      pretrained=str(path))


# ---- exactness -----------------------------------------------------------------------------


def test_every_tiny_flux_matches_diffusers_outputs_and_gradients(tiny: dict[str, Path]) -> None:
    report = run_reference([str(p) for p in tiny.values()], sequences=4, seed=3)
    for name, path in tiny.items():
        r = report[str(path)]
        assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, (name, r)
        # every tensor of diffusers' model has a gradient and was compared
        assert r["num_grads"] == len(checkpoint_layout(_cfg(path)).keys)
        assert (r["heads"], r["guidance"]) == (TINY_FLUX[name][0], TINY_FLUX[name][5])


def test_reference_command_exits_1_above_its_tolerance(tiny: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    from knapray.cli import main

    args = ["reference", "--pretrained", str(tiny["schnell_h4"]), "--sequences", "1", "--json"]
    assert main([*args, "--tol", "1e-12"]) == 1  # fp32 reassociation alone is more
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = report[str(tiny["schnell_h4"])]
    assert report["passed"] is False and 1e-12 < max(r["out_rel"], r["grad_rel"]) < 1e-5
    assert main(["reference", "--pretrained", str(tiny["schnell_h4"]), "--topology", "g2n1"]) == 2


def test_the_comparison_catches_a_swapped_final_modulation(tiny: dict[str, Path]) -> None:
    """diffusers' norm_out holds (scale, shift), knapray's (shift, scale): loading it without
    the swap is the kind of mistake the check exists for."""
    path = str(tiny["dev_h2"])
    model, cfg, _, _ = load_model(path, None)
    with torch.no_grad():
        w = model.final.mod.lin.weight
        w.copy_(torch.cat(w.chunk(2)[::-1]))
    inputs = make_inputs(cfg, 2, seed=0)
    from knapray.testing.reference import _pack, _split

    batch = _pack(cfg, inputs)
    outs = _split(model(batch).detach(), inputs)
    ref_outs, ref_grads = diffusers_reference(path, inputs)
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    assert compare(cfg, outs, grads, ref_outs, ref_grads)["out_rel"] > 1e-2


# ---- layouts and checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("guidance", [True, False])
def test_diffusers_layout_is_diffusers_state_dict(guidance: bool) -> None:
    from diffusers import FluxTransformer2DModel

    ref = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=10,
                                 guidance_embeds=guidance, axes_dims_rope=(2, 2, 4))
    cfg = FluxConfig(**section_from_diffusers(dict(ref.config), "test"))
    layout = checkpoint_layout(cfg, "diffusers")
    assert layout.first_mismatch({k: v.shape for k, v in ref.state_dict().items()}) is None
    assert cfg.to_diffusers() | {"_class_name": None} == {k: v for k, v in ref.config.items()
                                                           if not k.startswith("_")} | {
        "_class_name": None, "axes_dims_rope": [2, 2, 4]}


def test_bfl_architecture_is_read_from_the_tensor_shapes() -> None:
    from knapray.weights.source import TensorEntry

    cfg = FluxConfig(in_channels=16, hidden_size=256, num_heads=2, depth_double=2, depth_single=3, text_dim=64,
                     pooled_dim=32, rope_axes_dim=(16, 56, 56), guidance_embeds=True)
    layout = checkpoint_layout(cfg, "bfl")
    headers = {k: TensorEntry("f", k, "BF16", shape, 0) for k, shape in layout.shapes.items()}
    assert FluxConfig(**section_from_diffusers(bfl_config(headers, "f"), "f")) == cfg
    del headers["guidance_in.in_layer.weight"], headers["guidance_in.in_layer.bias"]
    del headers["guidance_in.out_layer.weight"], headers["guidance_in.out_layer.bias"]
    assert section_from_diffusers(bfl_config(headers, "f"), "f")["guidance_embeds"] is False  # schnell


def test_a_bfl_single_file_loads_the_same_weights(tiny: dict[str, Path], tmp_path: Path) -> None:
    """The diffusers checkpoint rewritten under BFL's names (one file, ComfyUI's prefix,
    bf16 as BFL ships it) loads into the same parameters."""
    from safetensors.torch import save_file

    path = tiny["dev_h2"]
    model, cfg, _, report = load_model(str(path), None)
    assert report.bytes_read == report.checkpoint_bytes and report.files > 1  # sharded with an index
    params = dict(model.named_parameters())
    bfl = checkpoint_layout(cfg, "bfl")
    tensors = {k: torch.empty(shape) for k, shape in bfl.shapes.items()}
    for p in bfl.pieces:
        tensors[p.key][p.src : p.src + p.rows] = params[p.param].detach()[p.dst : p.dst + p.rows]
    folder = tmp_path / "bfl"
    folder.mkdir()
    save_file({f"model.diffusion_model.{k}": v.to(torch.bfloat16) for k, v in tensors.items()},
              folder / "flux1-tiny.safetensors")
    (folder / "config.json").write_text((path / "config.json").read_text())  # head size 16: RoPE axes from here
    source = open_pretrained(str(folder))
    assert source.layout == "bfl" and source.path.endswith("flux1-tiny.safetensors")
    loaded, _, _, _ = load_model(str(folder), None)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, params[name].detach().to(torch.bfloat16).float()), name


def _rewrite(src: Path, dst: Path, *, drop: str | None = None, add: str | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "diffusion_pytorch_model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, dst / "diffusion_pytorch_model.safetensors")
    return dst


def test_bad_checkpoints_are_one_line_errors_naming_the_first_bad_key(tiny: dict[str, Path], tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    from knapray.cli import main

    good = tiny["schnell_h4"]
    cfg = _cfg(good)
    missing = _rewrite(good, tmp_path / "missing", drop="transformer_blocks.1.attn.add_k_proj.bias")
    with pytest.raises(ValueError, match=r"tensor 'transformer_blocks\.1\.attn\.add_k_proj\.bias' is missing"):
        check_pretrained(FluxConfig(**{**_fields(cfg), "pretrained": str(missing)}))
    extra = _rewrite(good, tmp_path / "extra", add="lora_A.weight")
    with pytest.raises(ValueError, match=r"tensor 'lora_A\.weight' is not part of this model"):
        check_pretrained(FluxConfig(**{**_fields(cfg), "pretrained": str(extra)}))
    with pytest.raises(ValueError, match=r"model\.text_dim=48 but the checkpoint's config gives 24"):
        check_pretrained(FluxConfig(**{**_fields(cfg), "text_dim": 48, "pretrained": str(good)}))
    shape = _rewrite(good, tmp_path / "shape")
    config = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**config, "joint_attention_dim": 32}))
    with pytest.raises(ValueError, match=r"tensor 'context_embedder\.weight' has shape \[32, 24\], the model's "
                                         r"config needs \[32, 32\]"):
        check_pretrained(FluxConfig(**{**_fields(cfg), "text_dim": 32, "pretrained": str(shape)}))
    sd3 = _rewrite(good, tmp_path / "sd3")
    (sd3 / "config.json").write_text(json.dumps({**config, "_class_name": "SD3Transformer2DModel"}))
    truncated = _rewrite(good, tmp_path / "truncated")
    weights = truncated / "diffusion_pytorch_model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    for path, family, message in (
        (sd3, None, "is a SD3Transformer2DModel checkpoint (Stable Diffusion 3), which no knapray family reads"),
        (good, "mmdit", "family mmdit has no checkpoint format"),
        (truncated, None, "lies outside the file's data"),
    ):
        assert main(["reference", "--pretrained", str(path), *(["--family", family] if family else [])]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def _fields(cfg: FluxConfig) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_a_run_config_takes_the_architecture_from_the_checkpoint(tiny: dict[str, Path], tmp_path: Path) -> None:
    from knapray.config.run import ConfigError, load_config
    from knapray.driver.preflight import check_pretrained as preflight
    from knapray.driver.preflight import load_run_config
    from knapray.driver.run_dir import RunError

    path = tiny["dev_h6"]
    corpus = f"data.corpus={tmp_path / 'none'}"
    # load_config reads the YAML only; the run's loader takes the checkpoint's architecture.
    assert load_config(None, [f"model.pretrained={path}", corpus]).model.family == "mmdit"
    cfg = load_run_config(None, [f"model.pretrained={path}", corpus])
    assert isinstance(cfg.model, FluxConfig) and cfg.model == _cfg(path)
    assert cfg.model.guidance_embeds and cfg.model.num_heads == 6 and cfg.model.in_channels == 4
    with pytest.raises(ConfigError, match=r"config model\.hidden_size: 64 disagrees with model\.pretrained .*dev_h6, "
                                          r"whose config gives 48"):
        load_run_config(None, [f"model.pretrained={path}", "model.hidden_size=64", corpus])
    with pytest.raises(ConfigError, match="family mmdit has no checkpoint format"):
        load_run_config(None, [f"model.pretrained={path}", "model.family=mmdit", corpus])
    # A placeholder path still loads (memory estimates); the launcher's pre-flight names it.
    placeholder = load_run_config(None, ["model.family=flux", "model.pretrained=/nowhere/FLUX.1-dev", corpus])
    with pytest.raises(RunError, match=r"^model\.pretrained: /nowhere/FLUX\.1-dev: no such file or directory$"):
        preflight(placeholder)
    preflight(cfg)


def test_memory_model_counts_flux_parameters_exactly() -> None:
    from knapray.planning.costs.memory import ModelShape

    for guidance in (False, True):
        cfg = FluxConfig(in_channels=4, hidden_size=48, num_heads=6, depth_double=1, depth_single=2, text_dim=24,
                         pooled_dim=20, rope_axes_dim=(0, 4, 4), guidance_embeds=guidance)
        shapes = param_shapes(cfg)
        assert ModelShape.of(cfg).num_params == sum(math.prod(s) for s in shapes.values())
        assert ModelShape.of(cfg).num_param_tensors == len(shapes)


# ---- the fine-tuning recipe -----------------------------------------------------------------


def test_resolution_shift_is_diffusers_flux_shift_per_sample() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from knapray.data import build_packed_batch, sample_generator
    from knapray.models.timesteps import ResolutionShift, TimestepDistribution, shift_timesteps

    rs = ResolutionShift()
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    t = torch.tensor([0.1, 0.5, 0.9])
    for tokens in (64, 256, 1024, 4096, 9000):
        mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
        assert rs.mu(tokens) == pytest.approx(mu, rel=1e-12)
        torch.testing.assert_close(shift_timesteps(t, rs.shift(tokens)), sched.time_shift(mu, 1.0, t))
    # In one packed batch, each sample is shifted by its own image token count.
    cfg = FluxConfig(in_channels=4, hidden_size=32, num_heads=2, depth_double=1, depth_single=1, text_dim=8,
                     pooled_dim=8, rope_axes_dim=(4, 6, 6), guidance_embeds=True)
    dist = TimestepDistribution(kind="uniform", resolution=rs)
    samples = [{"sample_id": i, "latent": np.zeros((4, 1, h, h), np.float32), "text": np.zeros((2, 8), np.float32),
                "pooled": np.zeros(8, np.float32)} for i, h in enumerate((4, 16, 64))]
    batch = build_packed_batch(samples, cfg, seed=5, timesteps=dist, guidance=3.5)
    for i, h in enumerate((4, 16, 64)):
        base = torch.rand(1, generator=sample_generator(5, 0, i))
        assert batch.timesteps[i].item() == pytest.approx(shift_timesteps(base, rs.shift((h // 2) ** 2)).item())
    assert batch.guidance.tolist() == [3.5] * 3
    assert set(condition_inputs(build_model(cfg), batch)) == {"timesteps", "pooled", "guidance"}
    empty = build_packed_batch([], cfg, seed=5, timesteps=dist, guidance=3.5)  # a dry rank still conditions
    assert empty.guidance.shape == (0,)


def test_caption_dropout_uses_the_recorded_unconditional_embeddings(tmp_path: Path) -> None:
    from dist_utils import build_tiny_corpus

    from knapray.corpus.encoders import HashTextEncoder
    from knapray.corpus.unconditional import KEY, unconditional_embeddings, unconditional_record
    from knapray.data import CaptionDropout, StepStream, corpus_info, local_rows

    corpus = build_tiny_corpus(tmp_path / "c", "g1b4i256f1s0", steps=8)
    info = corpus_info(corpus)
    assert unconditional_embeddings(corpus, 16, 16)[0].shape == (0, 16)  # no record: 0 tokens, zero pooled
    schema = json.loads((Path(corpus) / "schema.json").read_text())
    encoder = HashTextEncoder(dim=16, pooled_dim=16)
    schema[KEY] = unconditional_record(encoder, 8)
    schema[KEY]["text"] = np.ones((3, 16)).tolist()  # a text encoder that gives "" tokens: the length changes
    (Path(corpus) / "schema.json").write_text(json.dumps(schema))
    text, pooled = unconditional_embeddings(corpus, 16, 16)
    np.testing.assert_array_equal(pooled, encoder.encode("", 8)[1])

    def samples(rate: float, epoch: int) -> list[dict]:
        stream = StepStream.for_corpus(list(local_rows(corpus, 0, 1)), info, samples_per_step=4,
                                       caption_dropout=CaptionDropout(rate, 0, epoch, text, pooled))
        steps = list(stream)
        for step in steps:  # the lengths the planner sees are the samples'
            assert step.meta.seq_lens == tuple(s["seq_len"] for s in step.samples)
        return [s for step in steps for s in step.samples]

    plain, dropped = samples(0.0, 0), samples(0.5, 0)
    assert len(plain) == len(dropped) == 32
    hit = [b["text"] is text for b in dropped]
    assert 8 <= sum(hit) <= 24, sum(hit)
    for a, b, h in zip(plain, dropped, hit):
        if h:
            assert b["pooled"] is pooled and b["seq_len"] == a["seq_len"] - a["text"].shape[0] + 3
        else:
            assert b["seq_len"] == a["seq_len"] and np.array_equal(a["text"], b["text"])
    assert hit == [b["text"] is text for b in samples(0.5, 0)]  # decided by (seed, epoch, id) alone
    assert hit != [b["text"] is text for b in samples(0.5, 1)]


def test_export_writes_a_diffusers_model_one_shard_at_a_time(tiny: dict[str, Path], tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel

    from knapray.worker.checkpoint import Checkpointer, JsonState, training_parts
    from knapray.worker.ema import EMA
    from knapray.driver.export import export_run

    path = tiny["schnell_h4"]
    model, cfg, _, _ = load_model(str(path), None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    run = tmp_path / "run"
    run.mkdir()
    from dataclasses import replace

    from knapray.driver.preflight import load_run_config
    from knapray.driver.run_dir import write_config

    run_cfg = load_run_config(None, [f"model.pretrained={path}", f"data.corpus={tmp_path}"])
    write_config(replace(run_cfg, run=replace(run_cfg.run, storage=str(tmp_path), name="run")))
    ema = EMA(model, 0.9)
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(str(run / "checkpoints"), rank=0, group=None, parts=training_parts(model, opt, ema=ema),
                 state=JsonState({"epoch": 0})).save(4, barrier=lambda: None)
    report = export_run(str(run), str(tmp_path / "out"), max_shard_bytes=60_000, read_bytes=20_000)
    assert len(report.shards) > 2 and (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").exists()
    largest_param = max(4 * math.prod(s) for s in param_shapes(cfg).values())
    assert report.largest_shard_bytes <= 60_000 and report.largest_read_bytes <= max(20_000, largest_param)
    back = FluxTransformer2DModel.from_pretrained(tmp_path / "out")
    sd = back.state_dict()
    params = dict(model.named_parameters())
    for p in checkpoint_layout(cfg).pieces:
        assert torch.equal(sd[p.key][p.src : p.src + p.rows], params[p.param].detach()[p.dst : p.dst + p.rows])
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        export_run(str(run), str(tmp_path / "out"))
    with torch.no_grad():
        for shadow in ema.shadow.values():
            shadow.sub_(0.5)  # the EMA weights differ from the raw ones
    Checkpointer(str(run / "checkpoints"), rank=0, group=None, parts=training_parts(model, opt, ema=ema),
                 state=JsonState({"epoch": 0})).save(5, barrier=lambda: None)
    old_umask = os.umask(0o022)
    try:
        ema_out = export_run(str(run), str(tmp_path / "ema"), ema=True, dtype="bf16")
    finally:
        os.umask(old_umask)
    assert ema_out.ema and ema_out.step == 5 and ema_out.steps == 6 and len(ema_out.shards) == 1
    for name in os.listdir(tmp_path / "ema"):  # safetensors writes 0600: readable by others as config.json is
        assert stat.S_IMODE(os.stat(tmp_path / "ema" / name).st_mode) == 0o644, name
    written = open_pretrained(str(tmp_path / "ema"))
    assert {t.dtype for t in written.tensors.values()} == {"BF16"}
    sd = FluxTransformer2DModel.from_pretrained(tmp_path / "ema").state_dict()
    for p in checkpoint_layout(cfg).pieces:
        want = ema.shadow[p.param][p.dst : p.dst + p.rows].to(torch.bfloat16).float()
        assert torch.equal(sd[p.key][p.src : p.src + p.rows], want), p.key


# ---- sampling -------------------------------------------------------------------------------


def test_sampling_a_dev_model_feeds_guidance_and_shifts_each_request(tiny: dict[str, Path]) -> None:
    from knapray.models.timesteps import ResolutionShift
    from knapray.models.sampling import request_shifts, sample_latents

    model, cfg, _, _ = load_model(str(tiny["dev_h2"]), None)
    seen = []
    forward = model.forward

    def spy(batch, attn=None):
        seen.append((batch.num_sequences, batch.guidance.tolist(), batch.timesteps.tolist()))
        return forward(batch, attn)

    model.forward = spy
    shapes = [(1, 4, 4), (1, 8, 12)]
    conds = [(np.zeros((3, 24), np.float32), np.zeros(20, np.float32))] * 2
    out = sample_latents(model, conds, shapes, steps=3, seed=0, guidance=2.5, shift=None)
    assert [o.shape for o in out] == [(4, 1, 4, 4), (4, 1, 8, 12)]
    assert [s[0] for s in seen] == [2, 2, 2]  # one pass per step: guidance is embedded, not classifier-free
    assert all(s[1] == [2.5, 2.5] for s in seen)
    shifts = request_shifts(model, shapes, None)
    assert shifts == [ResolutionShift().shift(4), ResolutionShift().shift(24)]
    t1 = [s * (2 / 3) / (1 + (s - 1) * (2 / 3)) for s in shifts]  # each request's own second time
    assert seen[1][2] == pytest.approx(t1) and seen[1][2][0] != pytest.approx(seen[1][2][1])


def test_a_run_saved_before_model_families_still_resumes() -> None:
    """Its config.json lacks the fields added since (model.family, model.pretrained, ...):
    at their defaults they are no change, so they do not block a resume."""
    from knapray.config.run import load_config
    from knapray.driver.run_dir import config_changes

    old = load_config(None, []).to_dict()
    for key in ("family", "pretrained"):
        del old["model"][key]
    del old["flow"]["guidance"], old["data"]["caption_dropout"]
    assert config_changes(old, load_config(None, []).to_dict()) == ([], [])
    blocking, _ = config_changes(old, load_config(None, ["model.depth_single=3"]).to_dict())
    assert blocking == ["model.depth_single: 2 -> 3"]
