"""LoRA fine-tuning (``model.lora``) of a tiny diffusers Flux on 4 gloo ranks, balanced and
FSDP-sharded, in one spawn: 8 steps straight (checkpoints at steps 3 and 7), then the same
run resumed from step 3's checkpoint. Then, in this process: only adapters changed (the
base as the file holds it), the resume matched bit for bit, the checkpoint holds adapters
only, validation samples were drawn, ``knapray export --lora`` loads into a diffusers FluxPipeline whose transformer
computes what knapray's model with the adapters computes, and a resume on another base is
refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch


from needs import needs  # noqa: E402
import tiny_encoders as te  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from flux_utils import save_tiny_flux  # noqa: E402

pytestmark = [pytest.mark.dist, needs("diffusers", "peft")]

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[attention]", "parallel.fsdp=full",
        "balance.topology=g1n2+g2n1", "optim.lr=0.03", "data.epochs=8", "checkpoint.every=4", "run.max_steps=8",
        "flow.guidance=3.5", "metrics.validation.every=4", "metrics.validation.like=[1]",
        "metrics.validation.sizes=[32x32]", "metrics.validation.steps=2"]


def _numpy(state: dict) -> dict:
    return {k: v.detach().float().numpy().copy() for k, v in state.items()}


def _train_then_resume(rank: int, world: int, corpus: str, run_root: str, pretrained: str) -> dict:
    import os

    import torch.distributed as dist
    from dist_utils import local_trainer
    from torch.distributed.tensor import DTensor

    from knapray.driver.run_dir import write_config

    def full(model):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}

    overrides = [f"model.pretrained={pretrained}", *LORA]
    trainer = local_trainer(rank, world, corpus, run_root, "flux-lora", overrides)
    if rank == 0:
        write_config(trainer.cfg)  # what a launcher's pre-flight writes: export reads it
    trainable = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    optimized = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    first = _numpy(full(trainer.model))
    summary = trainer.train()
    straight = _numpy(full(trainer.model))
    trainer.close()
    dist.barrier()
    ckpts = os.path.join(run_root, "flux-lora", "checkpoints")
    if rank == 0:
        shutil.rmtree(os.path.join(ckpts, "step-000000007"))  # resume from step 3's checkpoint
    dist.barrier()
    again = local_trainer(rank, world, corpus, run_root, "flux-lora", overrides)
    resumed_from = again.resumed_from
    again.train()
    resumed = _numpy(full(again.model))
    again.close()
    return {"losses": [r["loss_rel"] for r in summary["records"]], "trainable": trainable, "optimized": optimized,
            "first": first, "straight": straight, "resumed": resumed, "resumed_from": resumed_from}


def test_lora_finetune_resume_export_and_refuse_another_base(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    from knapray.cli import main
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
    from knapray.models.families import build_model
    from knapray.models.lora import base_name, is_adapter
    from knapray.testing.reference import _pack, _split, diffusers_call, make_inputs
    from knapray.worker.checkpoint import saved_keys
    from knapray.driver.run_dir import RunError, decide_start, read_run_config
    from knapray.weights.load import load_pretrained
    from knapray.weights.source import open_pretrained

    models = tmp_path / "models"
    pretrained = save_tiny_flux(models / "transformer", 2, 16, (4, 6, 6), 1, 1, True, text_dim=16, pooled_dim=12)
    corpus = tmp_path / "corpus"
    build_synthetic(SyntheticConfig(mix="g2b2i256f1s0,g2b1i512f1s0", steps=6, scale=4, channels=4, text_dim=16,
                                    pooled_dim=12, shards=2, seed=3), corpus, progress=False)
    runs = tmp_path / "runs"
    results = run_distributed(_train_then_resume, 4, str(corpus), str(runs), str(pretrained), timeout_s=300)
    r0 = results[0]

    # Only adapters train: the optimizer holds them alone, the base ends as the file holds it.
    assert r0["trainable"] and all(is_adapter(n) for n in r0["trainable"])
    sizes = {n: v.size for n, v in r0["first"].items()}
    assert r0["optimized"] * 4 >= sum(sizes[n] for n in r0["trainable"])  # each rank its FSDP shard
    cfg = read_run_config(str(runs / "flux-lora")).model
    file_model = build_model(dataclass_replace_lora(cfg, 0))
    file_model.to_empty(device="cpu")
    load_pretrained(file_model, dataclass_replace_lora(cfg, 0))
    on_file = {n: p.detach().numpy() for n, p in file_model.named_parameters()}
    for name, value in r0["straight"].items():
        if not is_adapter(name):
            np.testing.assert_array_equal(value, on_file[base_name(name)], err_msg=name)
    changed = [n for n in r0["trainable"] if ".lora_B." in n and np.abs(r0["straight"][n]).max() > 0]
    assert len(changed) == len(r0["trainable"]) // 2  # every lora_B left zero
    losses = r0["losses"]
    assert len(losses) == 8 and np.mean(losses[-3:]) < np.mean(losses[:3]), losses  # relative to zero velocity

    # The resume from step 1 ends where the straight run ended, bit for bit.
    assert r0["resumed_from"] == 3
    for name in r0["trainable"]:
        np.testing.assert_array_equal(r0["resumed"][name], r0["straight"][name], err_msg=name)

    # Validation samples of the LoRA run (base + adapters) at steps 3 and 7.
    assert sorted(p.name for p in (runs / "flux-lora" / "validation").iterdir()) == [
        "step-000003.png", "step-000007.png"]

    # The checkpoint holds adapters only.
    ckpt = runs / "flux-lora" / "checkpoints" / "step-000000007"
    model_keys = [k for k in saved_keys(str(ckpt)) if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)

    # knapray export --lora -> FluxPipeline.load_lora_weights: the transformer computes what
    # knapray's model with these adapters computes.
    out = tmp_path / "lora"
    assert main(["export", "--run", str(runs / "flux-lora"), "--out", str(out), "--lora", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["rank"] == 4 and report["scale"] == 2.0 and report["step"] == 7
    # knapray sample draws from the LoRA run: the base from model.pretrained, the adapters
    # from the checkpoint (the synthetic corpus has no VAE: a latent preview)
    assert main(["sample", "--run", str(runs / "flux-lora"), "--like", "1", "--size", "32x32", "--steps", "2",
                 "--out", str(tmp_path / "grid.png"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["requests"] == 1
    vae, clip, t5 = te.save_vae(models / "vae"), te.save_clip(models / "clip", projection=False), te.save_t5(models / "t5")
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=AutoencoderKL.from_pretrained(vae),
        text_encoder=CLIPTextModel.from_pretrained(clip), tokenizer=AutoTokenizer.from_pretrained(clip),
        text_encoder_2=T5EncoderModel.from_pretrained(t5), tokenizer_2=AutoTokenizer.from_pretrained(t5),
        transformer=FluxTransformer2DModel.from_pretrained(pretrained, torch_dtype=torch.float32),
    )
    pipe.load_lora_weights(str(out))

    tuned = build_model(cfg)
    tuned.to_empty(device="cpu")
    load_pretrained(tuned, cfg)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if is_adapter(name):
                p.copy_(torch.from_numpy(r0["straight"][name]))
    inputs = make_inputs(cfg, 3, seed=5)
    with torch.no_grad():
        ours = _split(tuned(_pack(cfg, inputs)), inputs)
        theirs = [diffusers_call(pipe.transformer, cfg, s) for s in inputs]
        plain = FluxTransformer2DModel.from_pretrained(pretrained, torch_dtype=torch.float32)
        untuned = [diffusers_call(plain, cfg, s) for s in inputs]
    for a, b, c in zip(ours, theirs, untuned):
        assert (a - b).norm() / b.norm() <= 1e-5
        assert (c - b).norm() / b.norm() > 1e-3  # the adapter changed the output

    # A resume on another base (same path, other weights) is refused in one line.
    save_tiny_flux(pretrained, 2, 16, (4, 6, 6), 1, 1, True, text_dim=16, pooled_dim=12, seed=9)
    run_cfg = read_run_config(str(runs / "flux-lora"))
    with pytest.raises(RunError, match="was trained on the base") as e:
        decide_start(run_cfg, [str(ckpt)])
    assert "\n" not in str(e.value) and str(pretrained) in str(e.value)
    assert open_pretrained(str(pretrained)).tensors  # still a loadable checkpoint: only the base differs


def dataclass_replace_lora(cfg, rank: int):
    import dataclasses

    from knapray.models.config import LoraConfig

    return dataclasses.replace(cfg, lora=LoraConfig(rank=rank))


def _bf16_base_or_fp32(rank: int, world: int, corpus: str, run_root: str, pretrained: str) -> dict:
    from dist_utils import local_trainer
    from torch.distributed.tensor import DTensor

    import knapray.models.lora as lora

    out = {}
    held = lora.hold_base_in
    for name, hold, extra in (("bf16-base", held, []), ("fp32-base", lambda model, dtype, fp8=(): 0, []),
                              ("fp8-base", held, ["model.lora.base_dtype=fp8"])):
        lora.hold_base_in = hold
        try:
            trainer = local_trainer(rank, world, corpus, run_root, name, [
                f"model.pretrained={pretrained}", "model.lora.rank=4", "parallel.fsdp=full",
                "parallel.precision=bf16", "balance.topology=g2n1", "optim.lr=0.01", "run.max_steps=3",
                "data.epochs=3", "flow.guidance=3.5", *extra])
        finally:
            lora.hold_base_in = held
        dtypes = {str(p.dtype) for n, p in trainer.model.named_parameters() if not p.requires_grad and p.ndim >= 2}
        losses = [r["loss"] for r in trainer.train()["records"]]
        adapters = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().numpy().copy()
                    for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.close()
        out[name] = {"dtypes": sorted(dtypes), "losses": losses, "adapters": adapters}
    return out


def test_a_bf16_run_holds_the_frozen_base_in_bf16_and_computes_the_same(tmp_path: Path) -> None:
    """Under bf16 FSDP the forward gathers the base in bf16 anyway: holding its weight
    matrices in bf16 (half the memory) gives the same losses and adapters, bit for bit, as
    holding fp32 copies. With ``model.lora.base_dtype: fp8`` the blocks' weights are float8
    shards (gathered in bf16 by FSDP) and the losses stay within the fp8 bound of
    tests/unit/test_fp8_base.py."""
    pretrained = save_tiny_flux(tmp_path / "transformer", 2, 16, (4, 6, 6), 1, 1, True, text_dim=16, pooled_dim=12)
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    corpus = tmp_path / "corpus"
    build_synthetic(SyntheticConfig(mix="g2b2i256f1s0,g2b1i512f1s0", steps=4, scale=4, channels=4, text_dim=16,
                                    pooled_dim=12, shards=2, seed=3), corpus, progress=False)
    (r0, _) = run_distributed(_bf16_base_or_fp32, 2, str(corpus), str(tmp_path / "runs"), str(pretrained),
                              timeout_s=240)
    assert r0["bf16-base"]["dtypes"] == ["torch.bfloat16"] and r0["fp32-base"]["dtypes"] == ["torch.float32"]
    assert r0["bf16-base"]["losses"] == r0["fp32-base"]["losses"] and len(r0["bf16-base"]["losses"]) == 3
    for name, value in r0["fp32-base"]["adapters"].items():
        np.testing.assert_array_equal(r0["bf16-base"]["adapters"][name], value, err_msg=name)
    fp8, bf16 = r0["fp8-base"], r0["bf16-base"]
    assert fp8["dtypes"] == ["torch.bfloat16", "torch.float8_e4m3fn"]
    off = [abs(a - b) / abs(b) for a, b in zip(fp8["losses"], bf16["losses"])]
    print(f"\nfp8 base under FSDP on 2 ranks: losses off the bf16 base's by {max(off):.1e} at most over 3 steps")
    assert len(off) == 3 and max(off) <= 2e-3 and fp8["losses"] != bf16["losses"], (fp8["losses"], bf16["losses"])
