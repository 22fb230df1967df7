"""The sampling gang ``knapray serve`` holds: 4 Ray actors (one gloo world) that each load a
trained run once and draw batches of jobs planned over bags. Every job's latent is the
single-process sampler's for its own seed; a rank killed mid-batch loses its bag's jobs
only, a job submitted before the gang has restarted (rank 0, which prepares every job, the
rank lost) waits for the restarted gang, and it draws them again."""

from __future__ import annotations

import time

import numpy as np
import pytest

from knapray.driver.gang import SamplerRank

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from dist_utils import trained_tiny_run

    return trained_tiny_run(tmp_path_factory.mktemp("gang"), "g")


@pytest.fixture(scope="module")
def gang(ray_session, trained):
    from knapray.driver.gang import Gang

    g = Gang.start(trained[0], 4, topology="auto")  # each batch on its best topology
    yield g
    g.close()


def _reference(run: str, job):
    from knapray.corpus.unconditional import unconditional_embeddings
    from knapray.driver.trained import load_weights, read_run
    from knapray.inference.conditioning import corpus_text
    from knapray.models.sampling import sample_latents

    cfg, ckpt = read_run(run)
    model, _ = load_weights(cfg, ckpt)
    m = cfg.model
    cond = corpus_text(cfg.data.corpus, job.like, m.text_dim, m.pooled_dim)
    uncond = unconditional_embeddings(cfg.data.corpus, m.text_dim, m.pooled_dim)
    (z,) = sample_latents(model, [cond], [(1, job.height // 8, job.width // 8)], steps=job.steps, seed=job.seed,
                          guidance=job.guidance if job.guidance is not None else 1.0, shift=job.shift,
                          unconditional=uncond)
    return z


def test_a_batch_of_mixed_jobs_is_each_the_single_process_sample(gang, trained):
    from knapray.inference.jobs import Job

    run, ids = trained
    assert gang.topology == "auto"
    jobs = [Job(None, 64, 64, steps=3, guidance=2.0, seed=1, like=ids[0]),
            Job(None, 16, 16, steps=2, guidance=1.0, seed=2, like=ids[1]),
            Job(None, 32, 48, steps=4, guidance=3.0, seed=3, like=ids[2]),
            Job(None, 48, 48, steps=1, guidance=1.5, seed=4, like=ids[3])]
    results = gang.generate(jobs, decode=False)
    for job, r in zip(jobs, results):
        assert r.error is None and not r.lost, r.error
        ref = _reference(run, job)
        assert float(np.abs(r.latent - ref).max() / np.abs(ref).max()) <= 1e-5
    pictures = gang.generate(jobs[:2] + [Job(None, 40, 40, like=ids[0])])  # decoded; a bad size fails alone
    # The synthetic corpus records no decoder: a latent's preview, at latent resolution
    assert pictures[0].frames.shape == (1, 8, 8, 3) and pictures[0].frames.dtype == np.uint8
    assert pictures[1].frames.shape == (1, 2, 2, 3)
    assert pictures[2].frames is None and "40x40" in pictures[2].error and not pictures[2].lost
    blocks = {r.ranks for r in results}
    assert blocks <= {(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)}, blocks  # aligned blocks


def test_a_rank_lost_mid_run_loses_its_blocks_jobs_only(gang, trained):
    import ray

    from knapray.inference.jobs import Job

    run, ids = trained
    # Four long jobs; rank 0, the lead of a running block, is killed while they run.
    futures = [gang.submit(Job(None, 32, 32, steps=1500, seed=5 + i, like=ids[i]), decode=False) for i in range(4)]
    deadline = time.monotonic() + 60
    while not gang._running and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    block, run_ = next((b, r) for b, r in gang._running.items() if gang.blocks[b][0] == 0)
    victims = {s.key for s in run_["subs"]}
    first, size = gang.blocks[block]
    ray.kill(gang.actors[first])
    # Rank 0 prepares every job: one submitted now, while the gang has not restarted (its other
    # blocks still run), waits for the restarted gang and is drawn by it, not lost (before: sent
    # to the dead rank 0 and answered lost, so that serving's one retry of a job whose block
    # lost a rank was lost again whenever it came back before the restart).
    late = gang.submit(Job(None, 32, 32, steps=3, seed=5, like=ids[0]), decode=False)
    results = {f.key: f.result(timeout=180) for f in futures}
    for key, r in results.items():
        if key in victims:
            assert r.lost and r.latent is None and r.ranks == tuple(range(first, first + size))
        else:
            assert not r.lost and r.error is None and r.latent is not None, r.error
    late = late.result(timeout=180)
    assert not late.lost and late.error is None, late.error
    again = gang.generate([Job(None, 32, 32, steps=3, seed=5, like=ids[0])], decode=False)[0]  # a restarted gang
    assert not again.lost and again.error is None, again.error
    ref = _reference(run, Job(None, 32, 32, steps=3, seed=5, like=ids[0]))
    for r in (late, again):
        assert float(np.abs(r.latent - ref).max() / np.abs(ref).max()) <= 1e-5


def test_a_job_cancelled_while_it_runs_stops_and_its_block_takes_the_next(gang, trained):
    from knapray.inference.jobs import Job

    run, ids = trained
    long = gang.submit(Job(None, 32, 32, steps=100_000, seed=7, like=ids[0]), decode=False)
    deadline = time.monotonic() + 60
    while not gang._running and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    t0 = time.monotonic()
    assert gang.cancel(long.key) == "stopping"
    result = long.result(timeout=60)
    assert result.cancelled and result.latent is None and time.monotonic() - t0 < 30
    short = gang.generate([Job(None, 32, 32, steps=2, seed=8, like=ids[1])], decode=False)[0]
    assert short.error is None and short.latent is not None
    # Long jobs start on every rank at once (packed); two more then wait, all ranks being busy.
    running = [gang.submit(Job(None, 32, 32, steps=100_000, seed=9 + i, like=ids[0]), decode=False) for i in range(6)]
    deadline = time.monotonic() + 60
    while sum(len(r["subs"]) for r in gang._running.values()) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not gang.scheduler.busy.sum() < 4  # every rank busy
    waiting = [gang.submit(Job(None, 32, 32, steps=100_000, seed=20 + i, like=ids[0]), decode=False) for i in range(2)]
    time.sleep(0.5)
    assert [gang.cancel(f.key) for f in waiting] == ["dropped", "dropped"]
    assert [gang.cancel(f.key) for f in running] == ["stopping"] * 6
    assert all(f.result(timeout=60).cancelled for f in waiting + running)
    assert gang.cancel(running[0].key) == "unknown"  # answered and forgotten


SLEEP_STEPS = 7
"""A batch of jobs of this many steps makes ``SleepyRank`` 1 sleep inside its bag's loop."""


class SleepyRank(SamplerRank):
    """The gang's rank class, but rank 1 stops answering at its second step of a block of
    ``SLEEP_STEPS``-step jobs (its bag partner waits for it inside the next all-to-all);
    every other block runs as ``SamplerRank`` runs it."""

    def _tick(self, step: int) -> None:
        super()._tick(step)
        if self.rank == 1 and step == 1 and self._batch_steps == SLEEP_STEPS:
            time.sleep(120)

    def run_block(self, spec, keys, djobs, decode):
        self._batch_steps = max(j.steps for j in djobs)
        return super().run_block(spec, keys, djobs, decode)


def test_a_rank_stuck_in_a_collective_fails_its_bag_within_the_timeout(ray_session, trained, monkeypatch):
    import ray

    import knapray.driver.gang as gang_module
    from knapray.driver.gang import Gang
    from knapray.inference.jobs import Job

    monkeypatch.setattr(gang_module, "_actor_class", lambda: ray.remote(max_concurrency=4)(SleepyRank))
    run, ids = trained
    g = Gang.start(run, 4, topology="g2n2", timeout_s=10.0)  # two bags of 2: the sleeper's, and (2, 3)
    try:
        jobs = [Job(None, 64, 64, steps=SLEEP_STEPS, seed=1, like=ids[0]),
                Job(None, 64, 64, steps=SLEEP_STEPS, seed=2, like=ids[1]),
                Job(None, 48, 48, steps=SLEEP_STEPS, seed=3, like=ids[2])]
        t0 = time.monotonic()
        results = g.generate(jobs, decode=False)
        took = time.monotonic() - t0
        assert took < 90, took  # the sleeper's 120 s were not waited for
        stuck = [r for r in results if r.ranks == (0, 1)]
        assert stuck, [r.ranks for r in results]  # a job ran on the sleeper's bag (ranks 0 and 1)
        for r in results:
            if r.ranks == (0, 1):
                assert r.lost and r.latent is None and "no step" in r.error
            else:
                assert not r.lost and r.error is None and r.latent is not None
        again = g.generate([Job(None, 64, 64, steps=3, seed=1, like=ids[0])], decode=False)[0]  # a new gang
        assert not again.lost and again.error is None
        ref = _reference(run, Job(None, 64, 64, steps=3, seed=1, like=ids[0]))
        assert float(np.abs(again.latent - ref).max() / np.abs(ref).max()) <= 1e-5
    finally:
        g.close()


# ---- several LoRA adapters of one base -------------------------------------------------------


def _lora_run(root, corpus, base, name: str, rank: int, targets: str, seed: int):
    """A LoRA run directory of the tiny Flux ``base`` as a trainer leaves one (config.json, a
    checkpoint of its adapters with the base's record), its adapters drawn at random so that
    every one of them changes what the model computes."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    from knapray.config.run import load_config
    from knapray.driver.run_dir import RUN_FORMAT
    from knapray.models.families import build_model
    from knapray.models.lora import init_adapters, is_adapter
    from knapray.weights.checks import base_record
    from knapray.worker.checkpoint import COMPLETE, TRAINER_STATE

    cfg = load_config(None, [f"data.corpus={corpus}", "model.family=flux", f"model.pretrained={base}",
                             "model.in_channels=4", "model.hidden_size=32", "model.num_heads=2",
                             "model.depth_double=1", "model.depth_single=1", "model.text_dim=24",
                             "model.pooled_dim=20", "model.rope_axes_dim=[4,6,6]", "model.guidance_embeds=true",
                             f"model.lora.rank={rank}", f"model.lora.targets=[{targets}]", f"run.name={name}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device="cpu")
    init_adapters(model, cfg.model.lora, seed)
    gen = torch.Generator().manual_seed(seed)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    for n, p in adapters.items():
        if ".lora_B." in n:
            p.normal_(0, 0.2, generator=gen)
    run = root / "runs" / name
    step = run / "checkpoints" / "step-000000001"
    dcp.save({"model": adapters}, checkpoint_id=str(step), no_dist=True)
    (step / TRAINER_STATE).write_text(json.dumps({"step": 1, "lora_base": base_record(cfg.model)}))
    (step / COMPLETE).write_text("")
    (run / "config.json").write_text(json.dumps({"format_version": RUN_FORMAT, **cfg.to_dict()}))
    return str(run)


def _alone(run: str, job) -> np.ndarray:
    """The job's latent from one process holding ``run`` as it was trained (its adapter the
    model's own), as ``knapray sample`` draws it."""
    from knapray.driver.trained import load_weights, read_run
    from knapray.inference.conditioning import corpus_text
    from knapray.models.sampling import denoise_job, job_noise
    from knapray.worker.denoise import denoise_local

    cfg, ckpt = read_run(run)
    model, _ = load_weights(cfg, ckpt)
    m = cfg.model
    cond = corpus_text(cfg.data.corpus, job.like, m.text_dim, m.pooled_dim)
    (noise,) = job_noise(m, [(1, job.height // 8, job.width // 8)], [job.seed])
    (z,) = denoise_local(model, [denoise_job(m, noise, cond, steps=job.steps, guidance=3.5, shift=None,
                                             unconditional=None)])
    return z


def _three_lora_runs(root):
    """A tiny corpus, a tiny Flux base and three LoRA runs of it (``own``: rank 4 on
    attention; ``second``: rank 8 on every linear layer; ``third``: rank 2 on attention)."""
    from flux_utils import save_tiny_flux

    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    corpus = root / "corpus"
    build_synthetic(SyntheticConfig(mix="g2b2i128f1s0", steps=1, scale=4, channels=4, text_dim=24, pooled_dim=20,
                                    max_text_tokens=16, shards=1), corpus, progress=False)
    base = save_tiny_flux(root / "base", 2, 16, (4, 6, 6), 1, 1, True, text_dim=24, pooled_dim=20)
    runs = (_lora_run(root, corpus, base, "own", 4, "attention", 1),
            _lora_run(root, corpus, base, "second", 8, "all-linear", 2),
            _lora_run(root, corpus, base, "third", 2, "attention", 3))
    return corpus, base, runs


@pytest.mark.timeout(300)
def test_one_base_serves_several_adapters_each_as_alone(ray_session, tmp_path):
    """A served LoRA run (its own adapter, rank 4 on attention), a second adapter given at
    start (rank 8 on every linear layer) and a third added while the gang serves: a batch
    asking for all three gives each job what its run alone gives it; an unknown adapter, or
    a run of another base, is refused in one line."""
    from flux_utils import save_tiny_flux

    from knapray.driver.gang import Gang
    from knapray.inference.jobs import Job

    corpus, _, (own, second, third) = _three_lora_runs(tmp_path)
    other = _lora_run(tmp_path, corpus, save_tiny_flux(tmp_path / "other", 2, 16, (4, 6, 6), 1, 1, True, seed=9,
                                                       text_dim=24, pooled_dim=20), "other", 4, "attention", 4)
    g = Gang.start(own, 2, device="cpu", adapters={"second": second})
    try:
        g.add_adapter("third", third)
        jobs = [Job(None, 32, 32, steps=3, seed=11, like=0),
                Job(None, 16, 32, steps=2, seed=12, like=1, adapter="second"),
                Job(None, 32, 16, steps=3, seed=13, like=2, adapter="third"),
                Job(None, 32, 32, steps=3, seed=11, like=0, adapter="second")]
        results = g.generate(jobs, decode=False)
        for job, r, run in zip(jobs, results, (own, second, third, second)):
            assert r.error is None, r.error
            ref = _alone(run, job)
            assert float(np.abs(r.latent - ref).max() / np.abs(ref).max()) <= 1e-5, job.adapter
        assert float(np.abs(results[0].latent - results[3].latent).max()) > 1e-3  # the adapters differ
        (bad,) = g.generate([Job(None, 32, 32, steps=2, like=0, adapter="nope")])
        assert "adapter: 'nope'" in bad.error and "'second', 'third'" in bad.error
        with pytest.raises(ValueError, match="another base"):
            g.add_adapter("other", other)
    finally:
        g.close()
