"""Balanced sampling on 4 gloo ranks against the single-process sampler, per request.

A batch of jobs (each its own size, frames, steps, guidance and seed) is planned over the
bags of a topology (``planning.inference.sampling.plan_jobs``) and drawn by ``worker.denoise``: each
bag runs its jobs' loops with Ulysses over its ranks, or CFG parallel over its halves.
Every job's latent must be what ``sample_latents`` gives that one request with its seed
(fp32, relative 1e-5), for the Flux family (embedded guidance, and a schnell-like variant
with classifier-free guidance), the Wan family (cross-attention, video frames) and Qwen-Image
(its pipeline's stretched schedule, guidance rescaled to the conditional prediction's norm) and
FLUX.2 (its empirical shift of the image tokens and the step count, embedded guidance).

The batches cover: a request larger than one rank's token budget (planned onto a bag),
an empty rank (a bag with no job), a bag in CFG parallel, requests of different step
counts, and a bag in Ulysses without CFG parallel.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.dist

BUDGET = 72
"""Tokens one GPU may hold of a job's passes (``max_tokens_per_gpu``): the largest guided
job (its two passes of 53 or 69 tokens) fits only a bag of 2 or more."""


def _model(family: str, variant: str):
    import torch

    from knapray.models.families import build_model, get_family

    cfg = get_family(family).small_config(128)  # 4 heads: Ulysses over 4 ranks divides them
    if variant == "cfg" and family == "flux":  # schnell-like: classifier-free guidance instead
        cfg = dataclasses.replace(cfg, guidance_embeds=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # non-degenerate outputs: zero-initialized output layers get values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


# (latent shape (T, H, W), steps, guidance, seed, text tokens)
JOBS = {
    "flux": [((1, 16, 16), 3, 3.5, 1, 5), ((1, 4, 4), 2, 3.5, 2, 3), ((1, 8, 12), 4, 2.0, 3, 0),
             ((1, 6, 6), 3, 3.5, 4, 7)],
    "wan": [((3, 8, 8), 3, 4.0, 1, 5), ((1, 4, 4), 2, 1.0, 2, 3), ((2, 6, 4), 4, 3.0, 3, 6), ((1, 6, 6), 3, 1.0, 4, 2)],
    "qwen_image": [((1, 16, 16), 3, 4.0, 1, 5), ((1, 4, 4), 2, 1.0, 2, 3), ((1, 8, 12), 4, 4.0, 3, 6)],
    "flux2": [((1, 16, 16), 3, 4.0, 1, 5), ((1, 4, 4), 2, 4.0, 2, 3), ((1, 8, 12), 4, 2.5, 3, 0)],
}


def _jobs(model, family: str):
    from knapray.models.sampling import denoise_job, job_noise

    cfg = model.cfg
    rng = np.random.default_rng(7)
    out = []
    for shape, steps, guidance, seed, ntext in JOBS[family]:
        cond = (rng.standard_normal((ntext, cfg.text_dim)).astype(np.float32),
                rng.standard_normal(cfg.pooled_dim).astype(np.float32))
        (noise,) = job_noise(cfg, [shape], [seed])
        job = denoise_job(cfg, noise, cond, steps=steps, guidance=guidance, shift=None, unconditional=None)
        out.append((job, cond, shape, steps, guidance, seed))
    return out


def _draw(rank: int, world: int, family: str, variant: str, topology: str, cfg_parallel: bool, n_jobs: int):
    """This rank's latents, and what it did on the host inside its denoising steps (nothing:
    ``knapray.testing.host_watch``), also around Ulysses and CFG parallel's collectives."""
    from knapray.planning import Topology
    from knapray.testing.host_watch import NoHostWork
    from knapray.worker.denoise import SamplingGroups, denoise_rank

    model = _model(family, variant)
    groups = SamplingGroups.build(Topology.parse(topology, world_size=world), rank)
    jobs = [j[0] for j in _jobs(model, family)[:n_jobs]]
    with NoHostWork() as watch:
        got = denoise_rank(model, jobs, groups, cfg_parallel=cfg_parallel, max_tokens_per_gpu=BUDGET,
                           step_context=watch.step)
    return got, watch.calls, watch.steps


CASES = [
    # family, variant, topology, CFG parallel, jobs
    ("flux", "dev", "g2n1+g1n2", True, 4),  # embedded guidance: one pass a step
    ("flux", "cfg", "g2n1+g1n2", True, 3),  # the large guided job's bag of 2 in CFG parallel
    ("flux", "cfg", "g4n1", False, 4),  # Ulysses over 4, both passes in one bag
    ("wan", "cfg", "g2n1+g1n2", True, 2),  # 2 jobs, 3 bags: a rank with nothing to do
    ("wan", "cfg", "g4n1", True, 4),  # CFG parallel on halves of 2 (Ulysses inside each half)
    ("qwen_image", "cfg", "g2n1+g1n2", True, 3),  # its schedule (stretched to 0.02) and renormed guidance
    ("flux2", "dev", "g2n1+g1n2", True, 3),  # its empirical shift of the tokens and steps, embedded guidance
]


@pytest.mark.parametrize("family, variant, topology, cfg_parallel, n_jobs", CASES)
def test_each_request_is_the_single_process_sample(family, variant, topology, cfg_parallel, n_jobs):
    from knapray.models.sampling import sample_latents
    from knapray.planning import Topology
    from knapray.planning.inference.sampling import cfg_parallel_bag, plan_jobs

    model = _model(family, variant)
    jobs = _jobs(model, family)[:n_jobs]
    topo = Topology.parse(topology, world_size=4)
    plan = plan_jobs([j[0].tokens for j in jobs], [j[0].steps for j in jobs], [j[0].passes for j in jobs], topo,
                     max_tokens_per_gpu=BUDGET)
    # What the case exercises, from the plan every rank derives.
    largest = int(np.argmax([j[0].tokens for j in jobs]))
    if variant == "cfg":
        assert jobs[largest][0].tokens * jobs[largest][0].passes > BUDGET  # over one rank's budget ...
        assert topo.bag_sizes[plan.bag[largest]] >= 2  # ... so it runs on a bag of several ranks
    assert len({j[0].steps for j in jobs}) > 1
    assert (len(set(plan.bag.tolist())) < topo.num_bags) == (n_jobs < topo.num_bags)  # an empty rank where fewer
    if variant == "cfg" and cfg_parallel:
        guided = [plan.bag[k] for k, j in enumerate(jobs) if j[0].passes == 2]
        assert any(cfg_parallel_bag(int(topo.bag_sizes[b]), True) for b in guided)  # a bag in CFG parallel

    got: dict[int, np.ndarray] = {}
    for part, host_calls, steps in run_distributed(_draw, 4, family, variant, topology, cfg_parallel, n_jobs,
                                                   timeout_s=240):
        assert not set(part) & set(got)  # each job comes back from one lead
        assert host_calls == [], host_calls  # no host work inside a step, on any rank
        got.update(part)
    assert sorted(got) == list(range(len(jobs)))
    for k, (job, cond, shape, steps, guidance, seed) in enumerate(jobs):
        (ref,) = sample_latents(model, [cond], [shape], steps=steps, seed=seed, guidance=guidance, shift=None)
        err = float(np.abs(got[k] - ref).max() / np.abs(ref).max())
        assert err <= 1e-5, (k, shape, steps, err)


def test_knapray_sample_world_size_4_is_knapray_sample(tmp_path, capsys):
    """The command a user runs: ``knapray sample --world-size 4`` on a trained run writes
    the latents ``knapray sample`` writes, request by request (guided, sizes differ)."""
    from dist_utils import trained_tiny_run

    from knapray.cli import main

    run, ids = trained_tiny_run(tmp_path, "s")
    args = ["sample", "--run", run, *[a for i in ids[:3] for a in ("--like", str(i))],
            "--size", "64x64", "--size", "16x16", "--size", "32x48", "--steps", "3", "--guidance", "2.5"]
    assert main([*args, "--out", str(tmp_path / "one.png"), "--latents", str(tmp_path / "one.npz")]) == 0
    assert main([*args, "--out", str(tmp_path / "four.png"), "--latents", str(tmp_path / "four.npz"),
                 "--world-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["world_size"] == 4 and report["requests"] == 3
    assert report["topology"] in ("g1n4", "g2n1+g1n2", "g2n2", "g4n1")  # auto: chosen for the batch
    one, four = np.load(tmp_path / "one.npz"), np.load(tmp_path / "four.npz")
    assert sorted(one.files) == sorted(four.files) == ["request_0", "request_1", "request_2"]
    for name in one.files:
        ref = one[name]
        assert four[name].shape == ref.shape
        assert float(np.abs(four[name] - ref).max() / np.abs(ref).max()) <= 1e-5, name
    assert (tmp_path / "four.png").stat().st_size > 0
    # The same, the model sharded (FSDP2) over bags of 2: each rank reads only its shards.
    assert main([*args, "--out", str(tmp_path / "sharded.png"), "--latents", str(tmp_path / "sharded.npz"),
                 "--world-size", "4", "--topology", "g2n2", "--shard", "bags"]) == 0
    sharded = np.load(tmp_path / "sharded.npz")
    for name in one.files:
        assert float(np.abs(sharded[name] - one[name]).max() / np.abs(one[name]).max()) <= 1e-5, name


@pytest.mark.parametrize("extra, words", [
    (["--world-size", "4", "--topology", "g3n1+g1n1"], ["--topology g3n1+g1n1", "4 heads"]),
    (["--world-size", "4", "--topology", "g3n1"], ["--topology g3n1"]),
    (["--topology", "g2n1"], ["--topology", "--world-size N > 1"]),
    (["--shard", "bags"], ["--shard bags", "--world-size N > 1"]),
    (["--world-size", "4", "--shard", "bags"], ["--shard bags", "bags of one"]),
    (["--world-size", "4", "--topology", "auto", "--shard", "bags"], ["--shard bags", "several"]),
])
def test_bad_world_or_topology_is_one_line_before_anything_starts(tmp_path, extra, words, capsys, monkeypatch):
    import knapray.driver.gang as gang
    import knapray.driver.trained as trained
    from dist_utils import sampling_run_dir

    from knapray.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("started before the arguments were checked")

    monkeypatch.setattr(gang, "sample_local", refuse)
    monkeypatch.setattr(trained, "load_weights", refuse)
    code = main(["sample", "--run", str(sampling_run_dir(tmp_path)), "--caption", "a", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    for word in words:
        assert word in err[0], err


def test_the_measured_serving_bench_serves_every_request_once():
    """``knapray bench serve --measure``'s executor: every request of the stream is drawn
    once, after it arrived, on the blocks its policy gives it (knapray: aligned blocks of 1,
    2 or 4; static USP: all four; data parallel: one; batch by batch: the halving bags)."""
    from knapray.benchmarks.serve_measured import serve_measured

    got = serve_measured(["knapray", "usp", "dp", "batches"], [0.5], 6, 0)
    assert got["capacity"] > 0
    for policy, blocks in (("knapray", {(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)}),
                           ("usp", {(0, 1, 2, 3)}), ("dp", {(0,), (1,), (2,), (3,)}),
                           ("batches", {(0, 1), (2,), (3,)})):
        (s,) = got["served"][policy]
        assert len(s.finish) == 6 and np.all(np.isfinite(s.finish)), policy
        assert np.all(s.start >= s.arrival - 1e-9) and np.all(s.finish > s.start), policy
        assert set(s.ranks) <= blocks, (policy, s.ranks)


def _draw_cached(rank: int, world: int, family: str, topology: str):
    from knapray.planning import Topology
    from knapray.worker.denoise import SamplingGroups, denoise_rank

    model = _model(family, "cfg")
    groups = SamplingGroups.build(Topology.parse(topology, world_size=world), rank)
    jobs = [j[0] for j in _jobs(model, family)]
    stats: dict = {}
    got = denoise_rank(model, jobs, groups, cfg_parallel=True, max_tokens_per_gpu=BUDGET, step_cache=1e9, stats=stats)
    return got, stats


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_a_bag_decides_the_step_cache_together(family):
    """The first-block cache over a bag of 4 in CFG parallel (two halves of 2): every rank
    takes the same decision (the norms summed over the bag), so the collectives stay in step
    and each job is what one process gets from the same batch with the same cache."""
    from knapray.worker.denoise import denoise_local

    model = _model(family, "cfg")
    jobs = [j[0] for j in _jobs(model, family)]
    ref = denoise_local(model, jobs, step_cache=1e9)
    got: dict[int, np.ndarray] = {}
    for part, stats in run_distributed(_draw_cached, 4, family, "g4n1", timeout_s=240):
        assert stats["cached_steps"] > 0
        got.update(part)
    for k, z in enumerate(ref):
        assert float(np.abs(got[k] - z).max() / np.abs(z).max()) <= 1e-5, k


def _draw_sharded(rank: int, world: int, family: str, topology: str):
    from knapray.planning import Topology
    from knapray.testing.host_watch import NoHostWork
    from knapray.worker.denoise import SamplingGroups, denoise_rank, prepare_model

    model = _model(family, "cfg")
    groups = SamplingGroups.build(Topology.parse(topology, world_size=world), rank)
    handle = prepare_model(model, "cpu", precision="fp32", compile=False, shard_group=groups.whole)
    jobs = [j[0] for j in _jobs(model, family)]
    with NoHostWork() as watch:
        got = denoise_rank(model, jobs, groups, cfg_parallel=True, step_context=watch.step)
    return got, handle.sharded, watch.calls


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_a_model_sharded_over_its_bag_samples_as_one_process(family):
    """The placement for a model that does not fit one device: FSDP2 over each bag's ranks
    (g2n2: two bags of 2, CFG parallel on halves of one), every unit gathered in the bag as
    it runs; every job is ``sample_latents``' for its seed, and no step waits on the host."""
    from knapray.models.sampling import sample_latents

    model = _model(family, "cfg")
    jobs = _jobs(model, family)
    got: dict[int, np.ndarray] = {}
    for part, sharded, calls in run_distributed(_draw_sharded, 4, family, "g2n2", timeout_s=240):
        assert sharded and calls == [], calls
        got.update(part)
    assert sorted(got) == list(range(len(jobs)))
    for k, (job, cond, shape, steps, guidance, seed) in enumerate(jobs):
        (ref,) = sample_latents(model, [cond], [shape], steps=steps, seed=seed, guidance=guidance, shift=None)
        assert float(np.abs(got[k] - ref).max() / np.abs(ref).max()) <= 1e-5, k


def _draw_stopped(rank: int, world: int):
    from knapray.planning import Topology
    from knapray.worker.denoise import SamplingGroups, denoise_bag

    model = _model("flux", "cfg")
    groups = SamplingGroups.build(Topology.parse("g2n2", world_size=world), rank)
    jobs = [j[0] for j in _jobs(model, "flux")]
    asked = [0]

    def stop() -> set[int]:  # only the lead's answer counts: the others would drop everything
        asked[0] += 1
        return {0} if rank % 2 == 0 and asked[0] == 1 else (set() if rank % 2 == 0 else {0, 1, 2, 3})

    stats: dict = {}
    got = denoise_bag(model, jobs, groups, cfg_parallel=True, stop=stop, stats=stats)
    return got, stats["stopped"]


def test_a_bag_drops_a_stopped_job_together():
    """Two bags of 2 each run every job (g2n2, CFG parallel on halves of one); each lead stops
    job 0 after the first step: both ranks of a bag drop it at once (the lead's word, not
    its partner's), and the other jobs are what one process draws without it."""
    from knapray.worker.denoise import denoise_local

    model = _model("flux", "cfg")
    jobs = [j[0] for j in _jobs(model, "flux")]
    ref = denoise_local(model, jobs[1:])
    parts = run_distributed(_draw_stopped, 4, timeout_s=240)
    for rank, (got, stopped) in enumerate(parts):
        assert stopped == [0]
        if rank % 2 == 0:  # a lead
            assert sorted(got) == [1, 2, 3]
            for k in (1, 2, 3):
                assert float(np.abs(got[k] - ref[k - 1]).max() / np.abs(ref[k - 1]).max()) <= 1e-5
        else:
            assert got == {}
