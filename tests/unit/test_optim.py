"""The optimizer, the lr schedule (warm-up, constant, cosine; resume), gradient
accumulation's bookkeeping, and the flow section's timestep distribution."""

from __future__ import annotations

import math

import pytest
import torch

from knapray.models import MMDiT, MMDiTConfig
from knapray.models.flow import sample_timesteps
from knapray.models.timesteps import TimestepDistribution, shift_timesteps
from knapray.config.run import ConfigError, load_config
from knapray.worker.optim import LRSchedule, build_optimizer, decay_horizon, is_last_micro_step, lr_at


def _optim(*overrides: str):
    return load_config(None, [f"optim.{o}" for o in overrides]).optim


# ---- config fields ----------------------------------------------------------------------


def test_config_defaults_and_rules() -> None:
    cfg = load_config()
    assert (cfg.optim.schedule, cfg.optim.decay_steps, cfg.optim.min_lr_ratio) == ("constant", 0, 0.0)
    assert (cfg.optim.grad_accum_steps, cfg.optim.ema_decay, cfg.optim.ema_warmup) == (1, 0.0, True)
    assert (cfg.flow.timesteps, cfg.flow.timestep_mean, cfg.flow.timestep_std, cfg.flow.timestep_shift) == (
        "logit_normal", 0.0, 1.0, 1.0)
    assert (cfg.metrics.wandb_project, cfg.metrics.mlflow_tracking_uri, cfg.metrics.mlflow_experiment) == ("", "", "knapray")
    for bad, words in [
        ("optim.schedule=linear", "config optim.schedule: expected one of 'constant', 'cosine', got 'linear'"),
        ("optim.min_lr_ratio=1.5", "config optim.min_lr_ratio: expected a number in [0, 1], got 1.5"),
        ("optim.grad_accum_steps=0", "config optim.grad_accum_steps: expected an int in [1, 65536], got 0"),
        ("optim.ema_decay=1", "config optim.ema_decay: expected a number in [0, 1), got 1"),
        ("optim.decay_steps=-1", "config optim.decay_steps: expected an int in [0, 1000000000], got -1"),
        ("flow.timesteps=beta", "config flow.timesteps: expected one of 'logit_normal', 'uniform', got 'beta'"),
        ("flow.timestep_std=0", "config flow.timestep_std: expected a number > 0, got 0"),
        ("flow.timestep_shift=-3", "config flow.timestep_shift: expected a number > 0, got -3"),
        ("flow.timestep_mean=.nan", "config flow.timestep_mean: expected a finite number, got nan (float)"),
        ("flow.timestep_mean=abc", "config flow.timestep_mean: expected a number, got 'abc' (str)"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, [bad])
        assert str(info.value).startswith(words), str(info.value)
    assert load_config(None, ["flow.timestep_mean=-0.5"]).flow.timestep_mean == -0.5


# ---- schedule ---------------------------------------------------------------------------


def test_warmup_is_a_line_from_zero_to_lr() -> None:
    cfg = _optim("lr=0.01", "warmup_steps=4")
    lrs = [lr_at(s, cfg) for s in range(7)]
    assert lrs == pytest.approx([0.002, 0.004, 0.006, 0.008, 0.01, 0.01, 0.01])
    assert all(lr > 0 for lr in lrs)


def test_cosine_hand_values_and_floor() -> None:
    cfg = _optim("lr=1.0", "warmup_steps=2", "schedule=cosine", "decay_steps=6", "min_lr_ratio=0.1")
    # after warm-up: progress (s-2)/4 -> 0.1 + 0.9·(1+cos(π p))/2
    expected = {2: 1.0, 3: 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 4: 0.55,
                5: 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 6: 0.1, 7: 0.1, 100: 0.1}
    for step, lr in expected.items():
        assert lr_at(step, cfg) == pytest.approx(lr, abs=1e-12), step
    assert lr_at(0, cfg) == pytest.approx(1 / 3) and lr_at(1, cfg) == pytest.approx(2 / 3)
    lrs = [lr_at(s, cfg) for s in range(2, 8)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_cosine_horizon_defaults_to_max_steps_and_refuses_none() -> None:
    cfg = _optim("schedule=cosine")
    assert decay_horizon(cfg, max_steps=10) == 10
    assert lr_at(10, cfg, max_steps=10) == 0.0 and lr_at(5, cfg, max_steps=10) == pytest.approx(cfg.lr / 2)
    assert decay_horizon(_optim("schedule=cosine", "decay_steps=7"), max_steps=10) == 7  # decay_steps wins
    with pytest.raises(ValueError, match="set optim.decay_steps or run.max_steps"):
        lr_at(0, cfg)
    with pytest.raises(ValueError, match="set optim.decay_steps or run.max_steps"):
        LRSchedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), cfg)
    with pytest.raises(ValueError, match=r"run.max_steps=3 must be > optim.warmup_steps=3"):
        decay_horizon(_optim("schedule=cosine", "warmup_steps=3"), max_steps=3)
    with pytest.raises(ValueError, match=r"optim.decay_steps=2 must be > optim.warmup_steps=5"):
        decay_horizon(_optim("schedule=cosine", "warmup_steps=5", "decay_steps=2"))
    assert decay_horizon(_optim()) == 0 and lr_at(10**6, _optim()) == _optim().lr  # constant needs no end
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_at(-1, cfg, 10)


def _trained(cfg, steps: int, *, resume_at: int | None = None, max_steps: int = 12):
    """Weights and per-step lrs after ``steps`` AdamW steps on a fixed quadratic; with
    ``resume_at`` the optimizer and schedule are rebuilt from state dicts at that step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = build_optimizer([("w", w)], cfg)
    sched = LRSchedule(opt, cfg, max_steps)
    lrs = []
    for step in range(steps):
        if step == resume_at:
            saved_w, saved_opt, saved_sched = w.detach().clone(), opt.state_dict(), sched.state_dict()
            assert saved_sched == {"step": step}
            w = torch.nn.Parameter(saved_w)
            opt = build_optimizer([("w", w)], cfg)
            opt.load_state_dict(saved_opt)
            sched = LRSchedule(opt, cfg, max_steps)
            sched.load_state_dict(saved_sched)
        lrs.append(opt.param_groups[0]["lr"])
        (w.pow(2).sum() * (step + 1)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return w.detach(), lrs


def test_schedule_drives_the_optimizer_and_resumes_bit_identically() -> None:
    cfg = _optim("lr=0.1", "warmup_steps=3", "schedule=cosine", "min_lr_ratio=0.2", "weight_decay=0.1")
    w, lrs = _trained(cfg, 10)
    assert lrs == [lr_at(s, cfg, 12) for s in range(10)]
    w_resumed, lrs_resumed = _trained(cfg, 10, resume_at=6)
    assert lrs_resumed == lrs and torch.equal(w_resumed, w)


def test_a_resumed_schedule_follows_the_new_config() -> None:
    old, new = _optim("lr=0.1"), _optim("lr=0.05", "warmup_steps=2")
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([p], old)
    opt.load_state_dict(build_optimizer([p], old).state_dict())
    sched = LRSchedule(opt, new, start_step=5)
    assert opt.param_groups[0]["lr"] == 0.05 and sched.current_step == 5
    sched.load_state_dict({"step": 1})
    assert sched.get_last_lr() == [pytest.approx(0.05 * 2 / 3)]
    for bad in ({}, {"step": -1}, {"step": 1.5}, {"step": True}):
        with pytest.raises(ValueError, match="LRSchedule state"):
            sched.load_state_dict(bad)


# ---- optimizer --------------------------------------------------------------------------


def test_weight_decay_only_on_matrices() -> None:
    model = MMDiT(MMDiTConfig())
    emb = torch.nn.Embedding(5, 4)
    model.add_module("extra_embedding", emb)
    cfg = _optim("weight_decay=0.05", "betas=[0.8, 0.95]", "lr=2e-4")
    opt = build_optimizer(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.95) and decay["lr"] == 2e-4
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decayed | kept == set(names.values()) and not decayed & kept
    assert "img_in.weight" in decayed and "double_blocks.0.img.qkv.weight" in decayed
    assert {"img_in.bias", "double_blocks.0.img.q_norm.weight", "extra_embedding.weight"} <= kept
    assert all(p.ndim >= 2 for p in decay["params"]) and all(
        p.ndim < 2 or p is emb.weight for p in no_decay["params"])
    # Bare parameters group the same (the embedding, which only a module reveals, frozen
    # here: frozen parameters are left out).
    model.extra_embedding.weight.requires_grad_(False)
    bare = build_optimizer(model.parameters(), cfg)
    assert [list(map(id, g["params"])) for g in bare.param_groups] == [
        list(map(id, decay["params"])), [id(p) for p in no_decay["params"] if p is not emb.weight]]


def test_optimizer_refuses_non_fp32_and_empty() -> None:
    with pytest.raises(ValueError, match=r"parameter w is torch.bfloat16; master weights must be torch.float32"):
        build_optimizer([("w", torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16)))], _optim())
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2), requires_grad=False)], _optim())
    only_bias = build_optimizer([torch.nn.Parameter(torch.zeros(2))], _optim("weight_decay=0.1"))
    assert [g["weight_decay"] for g in only_bias.param_groups] == [0.0]


# ---- gradient accumulation --------------------------------------------------------------


def test_last_micro_step() -> None:
    assert [is_last_micro_step(i, 3) for i in range(7)] == [False, False, True, False, False, True, False]
    assert all(is_last_micro_step(i, 1) for i in range(4))
    with pytest.raises(ValueError, match="grad_accum_steps >= 1"):
        is_last_micro_step(0, 0)


def test_accumulated_micro_batches_equal_one_big_step() -> None:
    """Micro-batch losses normalized by the group's token count add up to the big batch's
    mean loss, so the accumulated step equals the one-batch step (what the trainer relies on)."""
    torch.manual_seed(0)
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    cfg = _optim("lr=0.01")

    def step(chunks: list[torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(1)
        lin = torch.nn.Linear(4, 2)
        opt = build_optimizer(lin, cfg)
        total = sum(len(c) for c in chunks)
        for i, idx in enumerate(chunks):
            ((lin(x[idx]) - y[idx]).pow(2).sum() / total).backward()
            if is_last_micro_step(i, len(chunks)):
                opt.step()
        return torch.cat([lin.weight.detach().flatten(), lin.bias.detach()])

    whole = step([torch.arange(12)])
    accumulated = step([torch.arange(0, 5), torch.arange(5, 7), torch.arange(7, 12)])
    torch.testing.assert_close(accumulated, whole, rtol=1e-6, atol=1e-7)


# ---- timestep distribution --------------------------------------------------------------


def test_flow_config_reaches_sample_timesteps() -> None:
    cfg = load_config(None, ["flow.timesteps=logit_normal", "flow.timestep_mean=0.7", "flow.timestep_std=0.5"])
    dist = cfg.flow.distribution()
    assert dist == TimestepDistribution(kind="logit_normal", mean=0.7, std=0.5, shift=1.0)
    t = dist.sample(4096, generator=torch.Generator().manual_seed(3))
    ref = sample_timesteps(4096, generator=torch.Generator().manual_seed(3), kind="logit_normal", mean=0.7, std=0.5)
    assert torch.equal(t, ref) and t.dtype == torch.float32
    logits = torch.logit(t.double())
    assert abs(logits.mean().item() - 0.7) < 0.05 and abs(logits.std().item() - 0.5) < 0.05

    uniform = load_config(None, ["flow.timesteps=uniform", "flow.timestep_shift=3"]).flow.distribution()
    t = uniform.sample(4096, generator=torch.Generator().manual_seed(4))
    raw = sample_timesteps(4096, generator=torch.Generator().manual_seed(4), kind="uniform")
    torch.testing.assert_close(t, 3 * raw / (1 + 2 * raw))
    assert t.mean() > raw.mean() + 0.1  # shift 3 moves t toward noise
    assert ((t > 0) & (t < 1)).all()


def test_shift_hand_values_and_refusals() -> None:
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    torch.testing.assert_close(shift_timesteps(t, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    assert shift_timesteps(t, 1.0) is t
    torch.testing.assert_close(shift_timesteps(shift_timesteps(t, 3.0), 1 / 3), t)
    with pytest.raises(ValueError, match="timestep shift must be a finite number > 0, got 0"):
        shift_timesteps(t, 0)
    with pytest.raises(ValueError, match=r"unknown timestep distribution 'beta'; valid: \['logit_normal', 'uniform'\]"):
        TimestepDistribution(kind="beta")
    with pytest.raises(ValueError, match="timestep std must be a finite number > 0, got -1"):
        TimestepDistribution(std=-1)
