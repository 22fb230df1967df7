"""Sampling a run of two experts (``flow.expert_boundary``, Wan 2.2 A14B's pair), on the tiny
Wan of tests/dist/test_experts.py trained 4 steps (both experts trained):

- ``knapray sample`` (one process) is diffusers' ``WanPipeline`` on the run's export, the
  high-noise ``transformer`` for a step whose t >= the boundary, ``transformer_2`` below, t of
  the shifted schedule (WanPipeline's timesteps are the shifted sigmas times 1000): the same
  latents from the same noise and embeddings, each expert called on its steps only;
- ``knapray sample --world-size 2`` (Ulysses and CFG parallel over a bag of 2) is ``knapray
  sample``;
- a bag whose jobs stand on both sides of the boundary at one step (another shift: the
  serving gang packs such jobs) runs both experts on that step, each job's latent the
  single-process sample of that job alone; the first-block step cache starts afresh for the
  second expert (a residual is its own model's).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from test_experts import BOUNDARY, _train

pytestmark = pytest.mark.dist

STEPS = 4
"""Wan's shift 5 puts t = 1, 0.94, 0.83, 0.62 at the steps' starts: two steps on each side of
0.875 (unshifted, 1, 0.75, 0.5, 0.25: one step on the high side)."""
SIZE, FRAMES, GUIDANCE, SEED = "48x32", 2, 3.0, 5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run directory, a corpus sample id): the two-expert run, its corpus given an
    unconditional record (3 text tokens: what ``--guidance`` guides against)."""
    import pyarrow.parquet as pq

    from knapray.corpus import shard_paths
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
    from knapray.corpus.unconditional import KEY

    root = tmp_path_factory.mktemp("experts")
    corpus = root / "corpus"
    build_synthetic(SyntheticConfig(mix="g1b3i128f1s0,g1b2i64f1s0,g1b1i256f2s0", steps=10, scale=4, channels=4,
                                    text_dim=16, pooled_dim=0, shards=3, seed=2), corpus, progress=False)
    schema = json.loads((corpus / "schema.json").read_text())
    text = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
    schema[KEY] = {"caption": "", "text": text.tolist(), "pooled": []}
    (corpus / "schema.json").write_text(json.dumps(schema))
    _train(str(corpus), root / "runs", "two", STEPS, nproc=1)
    like = int(pq.read_table(shard_paths(str(corpus))[0], columns=["sample_id"])["sample_id"][0].as_py())
    return str(root / "runs" / "two"), like


def _sample(run_dir: str, like: int, out, *extra: str) -> np.ndarray:
    from knapray.cli import main

    assert main(["sample", "--run", run_dir, "--like", str(like), "--size", SIZE, "--frames", str(FRAMES), "--steps",
                 str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED), "--out", str(out / "grid.png"),
                 "--latents", str(out / "latents.npz"), *extra]) == 0
    return np.load(out / "latents.npz")["request_0"]


def _euler_scheduler(shift: float):
    """diffusers' ``FlowMatchEulerDiscreteScheduler`` on knapray's schedule: sigmas
    ``linspace(1, 1/N, N)`` shifted by ``shift`` (what ``Flux2Pipeline`` and
    ``QwenImagePipeline`` pass it; ``WanPipeline`` asks for N steps alone)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class KnaprayEuler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
            kwargs.setdefault("sigmas", np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps))
            super().set_timesteps(num_inference_steps, device=device, **kwargs)

    return KnaprayEuler(shift=shift)


def test_knapray_sample_switches_experts_as_wan_pipeline_does(run, tmp_path, monkeypatch, capsys):
    from diffusers import WanPipeline

    import knapray.worker.balanced as balanced
    from knapray.cli import main
    from knapray.corpus.unconditional import unconditional_embeddings
    from knapray.driver.run_dir import read_run_config
    from knapray.inference.conditioning import corpus_text
    from knapray.models.families.wan import SAMPLE_SHIFT
    from knapray.models.sampling import job_noise

    run_dir, like = run
    calls: list[tuple[torch.nn.Module, float]] = []
    real = balanced.balanced_forward

    def counted(model, batch, *args, **kwargs):
        calls.append((model, float(batch.timesteps.max())))  # one request: both passes at one t
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(balanced, "balanced_forward", counted)
    (tmp_path / "one").mkdir()
    ours = _sample(run_dir, like, tmp_path / "one", "--json")
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["expert_boundary"] == BOUNDARY and report["shifts"] == [SAMPLE_SHIFT]
    high = [m for m, t in calls if t >= BOUNDARY]
    low = [m for m, t in calls if t < BOUNDARY]
    assert len(high) == len(low) == STEPS // 2 and len(calls) == STEPS  # both experts, each on its side
    assert all(m is high[0] for m in high) and all(m is low[0] for m in low) and high[0] is not low[0]

    cfg = read_run_config(run_dir)
    out = tmp_path / "exported"
    assert main(["export", "--run", run_dir, "--out", str(out), "--ema"]) == 0  # knapray sample's weights: EMA
    pipe = WanPipeline.from_pretrained(out, tokenizer=None, text_encoder=None, vae=None,
                                       scheduler=_euler_scheduler(SAMPLE_SHIFT))
    counts = {"transformer": 0, "transformer_2": 0}
    for name in counts:
        getattr(pipe, name).register_forward_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
    w, h = (int(v) for v in SIZE.split("x"))
    (noise,) = job_noise(cfg.model, [(FRAMES, h // 8, w // 8)], SEED)
    text, _ = corpus_text(cfg.data.corpus, like, 16, 0)
    uncond, _ = unconditional_embeddings(cfg.data.corpus, 16, 0)
    with torch.no_grad():
        want = pipe(prompt_embeds=torch.as_tensor(text)[None], negative_prompt_embeds=torch.as_tensor(uncond)[None],
                    guidance_scale=GUIDANCE, height=h, width=w, num_frames=4 * (FRAMES - 1) + 1,
                    num_inference_steps=STEPS, latents=torch.as_tensor(noise)[None],
                    output_type="latent").frames[0].numpy()
    assert counts == {"transformer": STEPS, "transformer_2": STEPS}  # two steps each, two passes a step
    assert ours.shape == want.shape == noise.shape
    err = float(np.abs(ours - want).max() / np.abs(want).max())
    print(f"knapray sample against WanPipeline, two experts: {err:.1e} relative")
    assert err <= 1e-4, err
    # what the test tells apart: one step on the other expert (WanPipeline switching at 0.95,
    # after the first step) is another sample
    pipe.register_to_config(boundary_ratio=0.95)
    with torch.no_grad():
        alone = pipe(prompt_embeds=torch.as_tensor(text)[None], negative_prompt_embeds=torch.as_tensor(uncond)[None],
                     guidance_scale=GUIDANCE, height=h, width=w, num_frames=4 * (FRAMES - 1) + 1,
                     num_inference_steps=STEPS, latents=torch.as_tensor(noise)[None],
                     output_type="latent").frames[0].numpy()
    apart = float(np.abs(alone - want).max() / np.abs(want).max())
    print(f"one step on the other expert: {apart:.1e} relative")
    assert apart > 100 * max(err, 1e-6), apart

    # the gang: 2 local ranks, one bag (Ulysses over both heads, CFG parallel halves)
    (tmp_path / "two").mkdir()
    gang = _sample(run_dir, like, tmp_path / "two", "--world-size", "2", "--topology", "g2n1")
    gang_err = float(np.abs(gang - ours).max() / np.abs(ours).max())
    print(f"knapray sample --world-size 2 against one process: {gang_err:.1e} relative")
    assert gang_err <= 1e-5, gang_err


def _jobs(cfg):
    """Two guided jobs whose times stand on both sides of the boundary at step 1 (shift 5:
    t = 0.94, high; shift 1: t = 0.75, low), of two sizes."""
    from knapray.models.sampling import denoise_job, job_noise

    rng = np.random.default_rng(11)
    jobs = []
    for shape, shift, seed in (((2, 4, 6), 5.0, 1), ((1, 6, 4), 1.0, 2)):
        (noise,) = job_noise(cfg, [shape], [seed])
        cond = (rng.standard_normal((4, cfg.text_dim)).astype(np.float32), np.zeros(0, np.float32))
        uncond = (rng.standard_normal((2, cfg.text_dim)).astype(np.float32), np.zeros(0, np.float32))
        jobs.append((denoise_job(cfg, noise, cond, steps=STEPS, guidance=GUIDANCE, shift=shift, unconditional=uncond),
                     cond, uncond, shape, shift, seed))
    return jobs


def _bag_of_two(rank: int, world: int, run_dir: str):
    from knapray.driver.trained import load_weights, read_run
    from knapray.planning import Topology
    from knapray.worker.denoise import SamplingGroups, denoise_rank

    cfg, ckpt = read_run(run_dir)
    experts, _ = load_weights(cfg, ckpt)
    groups = SamplingGroups.build(Topology.parse("g2n1", world_size=world), rank)
    return denoise_rank(experts, [j[0] for j in _jobs(cfg.model)], groups, cfg_parallel=True)


def test_a_bag_with_jobs_on_both_sides_runs_both_experts(run):
    from knapray.driver.trained import load_weights, read_run
    from knapray.models.sampling import Experts, sample_latents
    from knapray.worker.denoise import denoise_local

    run_dir, _ = run
    cfg, ckpt = read_run(run_dir)
    experts, ema = load_weights(cfg, ckpt)
    assert isinstance(experts, Experts) and ema and experts.boundary == BOUNDARY
    jobs = _jobs(cfg.model)
    sides = [experts.expert_at(j[0].times[:-1]).tolist() for j in jobs]
    assert sides == [[0, 0, 1, 1], [0, 1, 1, 1]]  # step 1: one job each side
    refs = [sample_latents(experts, [cond], [shape], steps=STEPS, seed=seed, guidance=GUIDANCE, shift=shift,
                           unconditional=uncond)[0] for _, cond, uncond, shape, shift, seed in jobs]
    for got, ref in zip(denoise_local(experts, [j[0] for j in jobs]), refs):
        assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5
    parts = run_distributed(_bag_of_two, 2, run_dir, timeout_s=120)
    assert sorted(parts[0]) == [0, 1] and parts[1] == {}  # the bag's lead returns both
    for k, ref in enumerate(refs):
        err = float(np.abs(parts[0][k] - ref).max() / np.abs(ref).max())
        assert err <= 1e-5, (k, err)

    # the step cache: never reusing a residual (a threshold of 0+) is the uncached sample; always
    # reusing one (1e9) still runs each expert's first step in full
    one = [jobs[0][0]]
    stats: dict = {}
    (never,) = denoise_local(experts, one, step_cache=1e-12)
    assert np.array_equal(never, denoise_local(experts, one)[0])
    denoise_local(experts, one, step_cache=1e9, stats=stats)
    assert stats["full_steps"] == 2 and stats["cached_steps"] == STEPS - 2, stats


def test_requests_of_one_batch_on_both_sides_take_their_own_expert():
    """``sample_latents`` of two requests whose own shifts (FLUX.1-dev's, from their image
    tokens) put them on both sides of a boundary at step 1: each request's latent is its own
    sample (drawn alone, no step of it on the other's expert)."""
    from knapray.models.families import build_model, get_family
    from knapray.models.sampling import Experts, config_shifts, denoise_job, job_noise, sample_latents
    from knapray.worker.denoise import denoise_local

    cfg = get_family("flux").small_config(128)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = build_model(cfg)
        with torch.no_grad():  # non-degenerate outputs: zero-initialized output layers get values
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        models.append(model.eval())
    experts = Experts(tuple(models), 0.83)
    shapes = [(1, 4, 4), (1, 32, 32)]
    rng = np.random.default_rng(4)
    conds = [(rng.standard_normal((3, cfg.text_dim)).astype(np.float32),
              rng.standard_normal(cfg.pooled_dim).astype(np.float32)) for _ in shapes]
    jobs = [denoise_job(cfg, z, c, steps=STEPS, guidance=3.5, shift=None, unconditional=None)
            for z, c in zip(job_noise(cfg, shapes, 9), conds)]
    assert [experts.expert_at(j.times[1]) for j in jobs] == [1, 0]  # step 1: one request each side
    assert len(set(config_shifts(cfg, shapes, None, STEPS))) == 2
    got = sample_latents(experts, conds, shapes, steps=STEPS, seed=9, guidance=3.5, shift=None)
    for k, job in enumerate(jobs):
        (ref,) = denoise_local(experts, [job])
        assert float(np.abs(got[k] - ref).max() / np.abs(ref).max()) <= 1e-5, k
