"""The EMA of the weights: the update against a hand computation (with and without the
decay's warm-up), resume through torch.distributed.checkpoint continuing bit-identically,
swapping the EMA weights in and out, and FSDP2 DTensor shards (2 gloo ranks) against a
single-process reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dist_utils import run_distributed
from knapray.config.run import load_config
from knapray.worker.ema import EMA, NUM_UPDATES, build_ema


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def _probe() -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(7))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + step))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_update_against_hand_computation() -> None:
    for warmup, decays in [(False, [0.9, 0.9, 0.9, 0.9]), (True, [1 / 10, 2 / 11, 3 / 12, 4 / 13])]:
        model = _model()
        w = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        ema = EMA(model, 0.9, warmup=warmup)
        expected = dict(w)
        for step, d in enumerate(decays):
            assert ema.current_decay() == pytest.approx(d)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1 * (step + 1))
            ema.update(model)
            expected = {n: d * expected[n] + (1 - d) * p.detach().double() for n, p in model.named_parameters()}
        assert ema.num_updates == 4
        for n, shadow in ema.shadow.items():
            assert shadow.dtype == torch.float32
            torch.testing.assert_close(shadow.double(), expected[n], rtol=0, atol=1e-6)
    big = EMA(_model(), 0.9999)
    big.num_updates = 89_990
    assert big.current_decay() == pytest.approx(0.9999)
    big.num_updates = 10
    assert big.current_decay() == pytest.approx(11 / 20)


def test_shadow_is_fp32_and_detached_from_bf16_weights() -> None:
    model = _model().to(torch.bfloat16)
    ema = EMA(model, 0.5, warmup=False)
    assert all(s.dtype == torch.float32 and not s.requires_grad for s in ema.shadow.values())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ema.update(model)
    for n, p in _model().named_parameters():
        torch.testing.assert_close(ema.shadow[n], 0.5 * p.detach().bfloat16().float() + 0.5)


def test_build_from_config_and_refusals() -> None:
    assert build_ema(_model(), load_config().optim) is None
    ema = build_ema(_model(), load_config(None, ["optim.ema_decay=0.999", "optim.ema_warmup=false"]).optim)
    assert (ema.decay, ema.warmup) == (0.999, False)
    with pytest.raises(ValueError, match=r"EMA decay must be in \(0, 1\), got 1.0"):
        EMA(_model(), 1.0)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(ValueError, match=r"missing \['1.bias', '1.weight', '2.bias', '2.weight'\], unexpected \[\]"):
        ema.update(other)
    bad = ema.state_dict()
    del bad[NUM_UPDATES]
    bad["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \['num_updates'\], unexpected keys \['extra'\]"):
        ema.load_state_dict(bad)


def _run(steps: int, *, resume_at: int | None = None, ckpt: str = "") -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ema = EMA(model, 0.99)
    for step in range(steps):
        if step == resume_at:
            path = os.path.join(ckpt, f"step{step}")
            dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": ema.state_dict()},
                     checkpoint_id=path)
            model = _model()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()  # the loaded state must replace every value
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            _train_step(model, opt, 0)  # create the optimizer's state to load into
            ema = EMA(model, 0.99)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": ema.state_dict()}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            ema.load_state_dict(state["ema"])
            assert ema.num_updates == step
        _train_step(model, opt, step)
        ema.update(model)
    return {n: s.clone() for n, s in ema.shadow.items()}


def test_resume_through_dcp_continues_bit_identically(tmp_path) -> None:
    straight = _run(6)
    resumed = _run(6, resume_at=3, ckpt=str(tmp_path))
    assert straight.keys() == resumed.keys()
    for n in straight:
        assert torch.equal(straight[n], resumed[n]), n
    # The checkpoint's keys read ema.<parameter name>: what `knapray sample` loads.
    keys = dcp.FileSystemReader(str(tmp_path / "step3")).read_metadata().state_dict_metadata
    assert {f"ema.{n}" for n, _ in _model().named_parameters()} | {"ema.num_updates"} <= set(keys)


def test_swap_into_runs_the_ema_weights_and_restores() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = EMA(model, 0.5, warmup=False)
    for step in range(3):
        _train_step(model, opt, step)
        ema.update(model)
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(2, 4)
    reference = _model()
    reference.load_state_dict(ema.shadow)
    with ema.swap_into(model) as swapped:
        assert swapped is model
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), own[n]), n
    assert not torch.equal(own["0.weight"], ema.shadow["0.weight"])
    with pytest.raises(RuntimeError, match="sampling failed"):
        with ema.swap_into(model):
            raise RuntimeError("sampling failed")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), own[n]), n


# ---- FSDP2 ------------------------------------------------------------------------------


def _fsdp_ema(rank: int, world_size: int, ckpt: str) -> dict:
    """FSDP2-sharded model + EMA: 4 steps, a DCP save after step 2 and a resumed copy.
    Returns numpy arrays: tensors cross the result queue by file descriptor, which is
    gone once the rank's process exits."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, EMA]:
        model = _model()
        fully_shard(model[0])
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        return model, opt, EMA(model, 0.9)

    model, opt, ema = build()
    shadow = ema.shadow["0.weight"]
    assert isinstance(shadow, DTensor) and shadow.placements == model[0].weight.placements
    assert shadow.to_local().shape == model[0].weight.to_local().shape == (8 // world_size, 4)
    for step in range(4):
        if step == 2:
            dcp.save({"ema": ema.state_dict(), "model": model.state_dict(), "optimizer": opt.state_dict()},
                     checkpoint_id=ckpt)
        _train_step(model, opt, step)
        ema.update(model)
    def gathered(tensors) -> dict:
        return {n: t.detach().full_tensor().numpy() for n, t in tensors}

    full = gathered(ema.shadow.items())
    with ema.swap_into(model), torch.no_grad():
        swapped = gathered(model.named_parameters())
        sampled = model(_probe()).numpy()  # FSDP2 all-gathers the swapped-in shards
    with torch.no_grad():
        own_output = model(_probe()).numpy()  # runs the model's own weights again
    model.reshard()  # the root keeps its all-gathered weights after a forward without backward
    after = gathered(model.named_parameters())

    model2, opt2, ema2 = build()
    _train_step(model2, opt2, 0)  # optimizer state to load into
    state = {"ema": ema2.state_dict(), "model": model2.state_dict(), "optimizer": opt2.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    ema2.load_state_dict(state["ema"])
    for step in (2, 3):
        _train_step(model2, opt2, step)
        ema2.update(model2)
    resumed = gathered(ema2.shadow.items())
    return {"ema": full, "swapped": swapped, "after": after, "resumed": resumed, "updates": ema2.num_updates,
            "sampled": sampled, "own_output": own_output}


@pytest.mark.dist
def test_fsdp2_shards_match_single_process(tmp_path) -> None:
    results = run_distributed(_fsdp_ema, 2, str(tmp_path / "ckpt"))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ema = EMA(model, 0.9)
    for step in range(4):
        _train_step(model, opt, step)
        ema.update(model)
    reference = _model()
    reference.load_state_dict(ema.shadow)
    for out in results:
        assert out["updates"] == 4
        torch.testing.assert_close(torch.from_numpy(out["sampled"]), reference(_probe()).detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(out["own_output"]), model(_probe()).detach(), rtol=1e-5, atol=1e-6)
        got = {k: {n: torch.from_numpy(a) for n, a in out[k].items()} for k in ("ema", "swapped", "after", "resumed")}
        for n, p in model.named_parameters():
            torch.testing.assert_close(got["ema"][n], ema.shadow[n], rtol=1e-5, atol=1e-6)
            assert torch.equal(got["swapped"][n], got["ema"][n]), n
            torch.testing.assert_close(got["after"][n], p.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(got["resumed"][n], got["ema"][n]), n
