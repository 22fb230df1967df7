"""The sampling engine (``knapray.worker.denoise``) as a GPU runs it, checked on the CPU:

- no host work inside a denoising step: everything a step needs is built before it, so no
  value is read back and no tensor is built from host data inside the loop (every Tensor
  ``.item/.tolist/.cpu/.numpy`` and ``torch.tensor/as_tensor/from_numpy`` patched, and the
  dispatcher watched for ``nonzero``, boolean masks and blocking copies);
- compiled once: 30 batches of varied sizes after the warm-up recompile nothing;
- forward truth: a compiled bf16 trajectory against float64 eager, per family, at each of
  8 steps within 1.5x of what rounding the matrix products' inputs to bf16 alone gives
  (``knapray.testing.sample_truth``); a residual stream accumulated in bf16 fails it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch


def _small(family: str, variant: str = "", width: int = 64):
    from knapray.models.families import build_model, get_family

    cfg = get_family(family).small_config(width)
    if variant == "cfg" and family == "flux":  # classifier-free guidance instead of the embedded input
        cfg = dataclasses.replace(cfg, guidance_embeds=False)
    torch.manual_seed(0)
    return build_model(cfg).eval()


def _jobs(cfg, seed: int = 0, count: int = 3, steps: tuple[int, ...] = (3, 2, 4)):
    from knapray.models.sampling import denoise_job, job_noise

    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        side = int(rng.integers(2, 6)) * 2
        frames = int(rng.integers(1, 3)) if cfg.family == "wan" else 1
        text = int(rng.integers(0, 9))
        cond = (rng.standard_normal((text, cfg.text_dim)).astype(np.float32),
                rng.standard_normal(cfg.pooled_dim).astype(np.float32))
        (noise,) = job_noise(cfg, [(frames * cfg.patch_size[0], side, side + 2)], [seed * 100 + k])
        out.append(denoise_job(cfg, noise, cond, steps=steps[k % len(steps)], guidance=[3.0, 1.0, 2.0][k % 3],
                               shift=None, unconditional=None))
    return out


@pytest.mark.parametrize("family, variant, precision", [
    ("flux", "dev", "fp32"), ("flux", "cfg", "bf16"), ("wan", "cfg", "fp32"), ("wan", "cfg", "bf16")])
def test_no_host_work_inside_a_denoising_step(family, variant, precision):
    from knapray.testing.host_watch import NoHostWork
    from knapray.worker.denoise import denoise_local, prepare_model

    model = _small(family, variant)
    prepare_model(model, "cpu", precision=precision, compile=False)
    jobs = _jobs(model.cfg)  # three jobs of 2, 3 and 4 steps: three segments, guided and not
    with NoHostWork() as watch:
        out = denoise_local(model, jobs, step_context=watch.step)
    assert watch.steps == 4 and watch.calls == [], watch.calls
    assert [z.shape for z in out] == [j.noise.shape for j in jobs] and all(np.isfinite(z).all() for z in out)


def test_the_host_work_watch_catches_a_read_back_and_a_host_built_tensor(monkeypatch):
    """The watch above can fail: a step that reads a value back, or builds a tensor from a
    host list (what the loop did before it was planned per segment), is named."""
    import knapray.worker.denoise as denoise
    from knapray.testing.host_watch import NoHostWork

    model = _small("flux", "dev")
    step = denoise._BagLoop._step

    def chatty(self, seg, i, x):
        t = torch.tensor([1.0])  # a host-built tensor per step
        return step(self, seg, i, x) * t

    monkeypatch.setattr(denoise._BagLoop, "_step", chatty)
    with NoHostWork() as watch:
        denoise.denoise_local(model, _jobs(model.cfg), step_context=watch.step)
    assert any(c.startswith("torch.tensor at") for c in watch.calls), watch.calls

    def reading(self, seg, i, x):
        out = step(self, seg, i, x)
        float(out.abs().max())  # a value read back every step
        return out

    monkeypatch.setattr(denoise._BagLoop, "_step", reading)
    with NoHostWork() as watch, pytest.raises(Exception):
        denoise.denoise_local(model, _jobs(model.cfg), step_context=watch.step)
    assert any("device sync" in c for c in watch.calls), watch.calls


@pytest.fixture(scope="module", params=["flux", "flux2"])
def compiled_flux(request):
    """Flux's (and FLUX.2's: its shared modulation's text rows unbacked too) small blocks in
    bf16, compiled by inductor and warmed up, as a GPU rank holds them."""
    from knapray.worker.denoise import prepare_model, warm_up

    model = _small(request.param, "dev")
    handle = prepare_model(model, "cpu", precision="bf16", compile=True)
    warm_up(model)
    return model, handle


def test_compiled_sampling_recompiles_at_most_twice_over_30_batches_of_varied_sizes(compiled_flux):
    """The blocks compile once at warm-up (a block whose attention call sat in a nested
    method, not in ``forward``, was compiled again from there, its text axis specialized)."""
    from knapray.worker.denoise import denoise_local

    model, handle = compiled_flux
    compiles = handle.compile_stats.compiles
    assert compiles >= 2 and handle.recompiles == 0  # the warm-up compiled the blocks
    for b in range(30):
        jobs = _jobs(model.cfg, seed=b + 1, count=1 + b % 3, steps=(1, 2))
        denoise_local(model, jobs)
    assert handle.recompiles <= 2, handle.recompiles
    assert handle.compile_stats.compiles == compiles  # nothing new was compiled either


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_compiled_bf16_sampling_is_as_exact_as_its_matmul_inputs(family, capsys):
    from knapray.testing.sample_truth import RATIO_BAR, trajectory_errors

    report = trajectory_errors(family, device="cpu", compile=True, steps=8)
    with capsys.disabled():
        print("\n" + report.summary())
    assert report.tokens > 2000 and report.steps == 8 and len(report.errors) == 8
    assert 1e-3 < min(report.yardstick) and max(report.yardstick) < 2e-2, report.summary()  # bf16 is bf16
    assert max(report.ratios) <= RATIO_BAR, report.summary()
    assert report.final_error < 1e-2, report.summary()


WAN_IMAGE_TO_VIDEO = {
    "ti2v": {"expand_timesteps": True},
    "i2v": {"image_dim": 32, "image_tokens": 64, "in_channels": 8, "out_channels": 4, "text_pad_to": 512},
}
"""Wan 2.2 TI2V (a clean first latent frame, a time per token) and Wan 2.1 I2V (4 condition
channels after the latent's, 64 image tokens of 32 features, text padded to 512)."""


@pytest.mark.parametrize("variant", sorted(WAN_IMAGE_TO_VIDEO))
def test_compiled_bf16_image_to_video_sampling_is_as_exact_as_its_matmul_inputs(variant, capsys):
    """Sampling from a conditioning image as a GPU rank runs it (bf16, compiled): the clean
    first frame kept at time 0 (TI2V), the condition's channels concatenated to the latent and
    the image tokens on every pass (I2V), against float64 eager over a clip of 4 latent frames."""
    from knapray.testing.sample_truth import RATIO_BAR, trajectory_errors

    report = trajectory_errors("wan", device="cpu", compile=True, steps=4, frames=4, side=48,
                               config=WAN_IMAGE_TO_VIDEO[variant])
    with capsys.disabled():
        print(f"\n{variant}: {report.summary()}")
    assert report.tokens > 2000 and report.steps == 4 and len(report.errors) == 4
    assert 1e-4 < min(report.yardstick) and max(report.yardstick) < 2e-2, report.summary()
    assert max(report.ratios) <= RATIO_BAR, report.summary()
    assert report.final_error < 1e-2, report.summary()


def test_the_forward_truth_fails_on_a_residual_stream_accumulated_in_bf16():
    from knapray.testing.sample_truth import RATIO_BAR, bf16_stream, trajectory_errors

    report = trajectory_errors("flux", device="cpu", compile=False, steps=2, variant=bf16_stream)
    assert min(report.ratios) > RATIO_BAR, report.summary()


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_the_step_cache_skips_the_blocks_only_when_the_first_block_barely_moved(family):
    """Threshold tiny: nothing cached, the latents are the uncached ones bit for bit; huge:
    every step after a segment's first is cached, and the latents move off the uncached ones
    (finite, at most as far as skipping everything would take them)."""
    from knapray.testing.sample_truth import small_model
    from knapray.worker.denoise import denoise_local

    model = small_model(family)  # every block moves the stream (adaLN-zero's blocks would not)
    jobs = _jobs(model.cfg, steps=(4, 3, 4))
    plain = denoise_local(model, jobs)
    stats: dict = {}
    never = denoise_local(model, jobs, step_cache=1e-12, stats=stats)
    assert stats["cached_steps"] == 0 and stats["full_steps"] == 4  # 3 + 1 over two segments, every one full
    assert all(np.array_equal(a, b) for a, b in zip(never, plain))
    stats = {}
    always = denoise_local(model, jobs, step_cache=1e9, stats=stats)
    assert stats["full_steps"] == 2 and stats["cached_steps"] == 2  # each segment's first step runs in full
    assert all(np.isfinite(z).all() for z in always)
    assert any(not np.array_equal(a, b) for a, b in zip(always, plain))


def test_the_diffusers_loop_beside_knapray_computes_what_knapray_computes():
    """The GPU section's two sides (``knapray.testing.sample_bench``) time the same loop: in
    fp32, diffusers' FluxTransformer2DModel with knapray's weights (through the export
    layout) and knapray's engine give the same latents from the same request."""
    pytest.importorskip("diffusers")
    from knapray.testing.gpu_check import SAMPLE_REHEARSAL as shape
    from knapray.testing.sample_bench import diffusers_flux, flux_config, prepared, relative, request, time_diffusers, \
        time_knapray

    cfg = flux_config(shape["hidden"], shape["heads"], shape["double"], shape["single"])
    job = request(cfg, shape["side"], shape["text"], shape["steps"])
    model = prepared(cfg, "cpu", "fp32", compile=False)
    ours = time_knapray("knapray", model, job, repeats=1)
    theirs = time_diffusers("diffusers", diffusers_flux(model), cfg, job, compiled=False, repeats=1)
    assert ours.latents.shape == theirs.latents.shape == job.noise.shape
    assert relative(ours.latents, theirs.latents) < 1e-5


def test_bench_sample_prints_the_ratio_last(capsys):
    import json

    from knapray.cli import main

    assert main(["bench", "sample", "--hidden", "64", "--heads", "2", "--double", "1", "--single", "1", "--side", "64",
                 "--text", "8", "--steps", "3", "--repeat", "1", "--step-cache", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ratio"] > 0 and [r["name"] for r in out["rows"]] == ["fp32 eager", "bf16 compiled"]
    (cached,) = out["step_cache"]
    assert cached["cached_steps"] == 2 and cached["full_steps"] == 1 and cached["error"] > 0  # skipped, and it shows
    assert main(["bench", "sample", "--step-cache", "11", "--json"]) == 2
    assert capsys.readouterr().err.strip().startswith("knapray bench sample: error: --step-cache 11")


def test_a_job_stopped_between_steps_leaves_and_the_others_go_on():
    """A serving bag's ``stop``: job 1 is dropped after the loop's second step; it gives no
    latent, and the others are what they are without it."""
    from knapray.worker.denoise import SamplingGroups, denoise_bag, denoise_local

    model = _small("flux", "cfg")
    jobs = _jobs(model.cfg, steps=(4, 3, 4))
    seen = []

    def stop() -> set[int]:
        seen.append(len(seen))
        return {1} if len(seen) >= 2 else set()

    stats: dict = {}
    got = denoise_bag(model, jobs, SamplingGroups.alone(), stop=stop, stats=stats)
    assert sorted(got) == [0, 2] and stats["stopped"] == [1]
    alone = denoise_local(model, [jobs[0], jobs[2]])
    for k, ref in zip((0, 2), alone):
        assert float(np.abs(got[k] - ref).max() / np.abs(ref).max()) <= 1e-5
    assert len(seen) == 4  # asked after every step: 2 steps with job 1, 2 more without it


def test_a_bare_cuda_device_is_given_the_current_index(monkeypatch):
    """``prepare_model(model, "cuda")`` (the GPU bench's sampling section) failed on torch 2.11's
    ``torch.cuda.set_device``: "Expected a torch.device with a specified index". The device is
    made explicit first."""
    from knapray.worker.denoise import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed(torch.device("cuda:1")) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu")) == torch.device("cpu")
