"""Two experts in one run (``flow.expert_boundary``, Wan 2.2 A14B's high- and low-noise
transformers), on a tiny Wan on gloo ranks: each optimizer step
trains one expert on timesteps from its side of the boundary, chosen alike on every rank, by a
resume and at another world size; both are checkpointed (``model``/``model_2``...) and resumed
bit for bit; ``knapray export`` writes ``transformer/``, ``transformer_2/`` and a
model_index.json with the boundary, which diffusers' ``WanPipeline`` loads, each transformer
computing what knapray's expert computes."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from dist_utils import run_distributed, run_metrics

pytestmark = pytest.mark.dist

BOUNDARY = 0.875
WAN = ["model.family=wan", "model.hidden_size=32", "model.num_heads=2", "model.depth_single=2", "model.text_dim=16",
       "model.ffn_dim=32", "model.freq_dim=16", "model.text_pad_to=0"]
"""A tiny Wan (heads of 16 channels) for the synthetic corpus (text width 16, no pooled vector)."""


SETS = [*WAN, "data.global_batch=4", "balance.topology=bags_of:2", f"flow.expert_boundary={BOUNDARY}",
        "flow.expert_share=0.5", "optim.ema_decay=0.9"]


def _run(rank: int, world: int, corpus: str, runs: str, name: str, steps: int) -> None:
    """Train run ``name`` to ``steps`` steps on this gloo rank (resuming from its newest
    checkpoint), its config.json written as a launcher's pre-flight writes it."""
    from dist_utils import local_trainer

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, runs, name, [*SETS, f"run.max_steps={steps}"])
    if rank == 0:
        write_config(trainer.cfg)
    trainer.train()


def _train(corpus: str, runs, name: str, steps: int, nproc: int) -> None:
    run_distributed(_run, nproc, corpus, str(runs), name, steps, timeout_s=180)



def _checkpoint(run_dir) -> str:
    return sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step-*")))[-1]


def _tensors(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint ``path`` holds under ``prefix`` (model, model_2, ema_2...)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from knapray.worker.checkpoint import SafeFileSystemReader, safe_load

    meta = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    state = {prefix: {k[len(prefix) + 1:]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
                      if k.startswith(prefix + ".") and isinstance(m, TensorStorageMetadata)}}
    safe_load(state, path)
    return state[prefix]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    out = tmp_path_factory.mktemp("corpus")
    build_synthetic(SyntheticConfig(mix="g1b3i128f1s0,g1b2i64f1s0,g1b1i256f2s0", steps=10, scale=4, channels=4,
                                    text_dim=16, pooled_dim=0, shards=3, seed=2), out, progress=False)
    return str(out)


def test_two_experts_resume_bit_for_bit_at_any_world_size_and_export_a_pipeline(corpus, tmp_path):
    """6 steps on 2 gloo ranks uninterrupted; the same stopped after 3 and resumed on 2 ranks (bit
    for bit: losses and every expert's weights, optimizer and EMA) and on 1 rank (the same
    schedule, losses within 1e-5). Both experts trained, each on its steps only."""
    _train(corpus, tmp_path, "whole", 6, nproc=2)
    _train(corpus, tmp_path, "same", 3, nproc=2)
    shutil.copytree(tmp_path / "same", tmp_path / "other", symlinks=True)
    _train(corpus, tmp_path, "same", 6, nproc=2)
    _train(corpus, tmp_path, "other", 6, nproc=1)
    ref = run_metrics(tmp_path / "whole")
    schedule = [m["expert"] for m in ref]
    assert set(schedule) == {0, 1}, schedule  # both trained (share 0.5, this seed)
    same, other = run_metrics(tmp_path / "same"), run_metrics(tmp_path / "other")
    assert [m["expert"] for m in same] == [m["expert"] for m in other] == schedule
    assert [m["loss"] for m in same] == [m["loss"] for m in ref]  # bit for bit
    for a, b in zip(other, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    # the ledger records the expert of every step, the same across the resumes
    from knapray.worker.ledger_files import read_ledger

    for name, rows in (("whole", ref), ("same", same), ("other", other)):
        cols = read_ledger(str(tmp_path / name)).columns()
        assert dict(zip(cols["step"].tolist(), cols["expert"].tolist())) == {m["step"]: m["expert"] for m in rows}
        assert set(cols["attempt"][cols["step"] > 2].tolist()) == ({0} if name == "whole" else {1})
    ckpt_ref, ckpt_same = _checkpoint(tmp_path / "whole"), _checkpoint(tmp_path / "same")
    for prefix in ("model", "model_2", "ema", "ema_2", "optimizer", "optimizer_2"):
        ref_t, got_t = _tensors(ckpt_ref, prefix), _tensors(ckpt_same, prefix)
        assert ref_t.keys() == got_t.keys() and ref_t, prefix
        for k in ref_t:
            assert torch.equal(ref_t[k], got_t[k]), (prefix, k)
    with open(os.path.join(ckpt_ref, "trainer.json")) as f:
        state = json.load(f)["experts"]
    assert state["boundary"] == BOUNDARY and state["share"] == 0.5
    assert state["names"] == ["transformer", "transformer_2"]

    # export: both experts and the boundary, loaded by WanPipeline; each transformer is the
    # checkpoint's expert (knapray's forward with its weights against diffusers' on one sequence)
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from knapray.cli import main
    from knapray.models.families import build_model, checkpoint_layout, get_family
    from knapray.driver.run_dir import read_run_config
    from knapray.testing.reference import Inputs

    out = tmp_path / "exported"
    assert main(["export", "--run", str(tmp_path / "whole"), "--out", str(out)]) == 0
    with open(out / "model_index.json") as f:
        index = json.load(f)
    assert index["boundary_ratio"] == BOUNDARY and index["expand_timesteps"] is False  # a time per sequence
    pipe = WanPipeline.from_pretrained(out, tokenizer=None, text_encoder=None, vae=None,
                                       scheduler=UniPCMultistepScheduler())
    assert pipe.config.boundary_ratio == BOUNDARY and pipe.config.expand_timesteps is False
    cfg = read_run_config(str(tmp_path / "whole")).model
    family = get_family(cfg.family)
    gen = torch.Generator().manual_seed(0)
    seq = Inputs(latent=torch.randn(4, 2, 4, 4, generator=gen), text=torch.randn(5, 16, generator=gen),
                 pooled=torch.zeros(0), timestep=0.9, guidance=None, target=None)
    outputs = []
    for prefix, transformer in (("model", pipe.transformer), ("model_2", pipe.transformer_2)):
        ours = build_model(cfg)
        ours.load_state_dict(_tensors(ckpt_ref, prefix))
        batch = family_batch(cfg, seq)
        with torch.no_grad():
            got = ours(batch)
            want = family.diffusers_call(transformer.float().eval(), cfg, seq)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), prefix
        outputs.append(got)
    assert not torch.equal(*outputs)  # two experts, two models
    assert checkpoint_layout(cfg)  # (the layout the export went through)


def family_batch(cfg, seq):
    """One sequence as knapray's packed batch."""
    from knapray.models import pack_samples

    return pack_samples([{"latent": seq.latent, "text": seq.text, "pooled": seq.pooled, "timestep": seq.timestep}], cfg)


def _sides(rank: int, world: int, corpus: str, runs: str) -> list[tuple[int, int, float, float]]:
    """Train 6 steps with every packed batch's timesteps recorded: (step, expert of its group,
    lowest and highest t)."""
    from dist_utils import local_trainer
    import knapray.worker.trainer as trainer_module

    seen = []
    trainer = local_trainer(rank, world, corpus, runs, "sides", [*WAN, "run.max_steps=6",
                                                                    f"flow.expert_boundary={BOUNDARY}",
                                                                    "balance.topology=g1n1"])
    real = trainer_module.build_packed_batch

    def recording(*args, **kwargs):
        batch = real(*args, **kwargs)
        seen.append((kwargs["timesteps"].low, kwargs["timesteps"].high, float(batch.timesteps.min()),
                     float(batch.timesteps.max())))
        return batch

    trainer_module.build_packed_batch = recording
    try:
        trainer.train()
    finally:
        trainer_module.build_packed_batch = real
    return [(lo, hi, tmin, tmax) for lo, hi, tmin, tmax in seen]


def test_each_step_draws_timesteps_from_its_experts_side(corpus, tmp_path):
    """The default share (the distribution's own mass above the boundary: 2.6% for a logit-normal
    without shift), and every batch's timesteps inside its expert's side."""
    (seen,) = run_distributed(_sides, 1, corpus, str(tmp_path / "runs"), timeout_s=120)
    assert seen
    for low, high, tmin, tmax in seen:
        assert (low, high) in ((BOUNDARY, 1.0), (0.0, BOUNDARY))
        assert low <= tmin and tmax < high


def test_bad_expert_configs_are_refused_in_one_line(corpus, tmp_path):
    from knapray.config.run import load_config

    base = [f"data.corpus={corpus}", *WAN]
    for extra, words in ((["flow.expert_boundary=0.875", "flow.timestep_range=[0.5,1.0]"], "timestep_range"),
                         (["flow.expert_share=0.3"], "expert_boundary"),
                         (["flow.expert_boundary=1.0"], "expert_boundary"),
                         (["flow.expert_boundary=0.875", "metrics.validation.every=5"], "validation")):
        with pytest.raises(ValueError, match=words) as e:
            load_config(None, base + extra)
        assert "\n" not in str(e.value)
    # a run of two experts resumes as two experts (their checkpoint parts), never as one
    from knapray.driver.run_dir import config_changes

    one, two = (load_config(None, base + extra).to_dict() for extra in ([], ["flow.expert_boundary=0.875"]))
    blocking, _ = config_changes(two, one)
    assert blocking == ["flow.expert_boundary: 0.875 -> 0.0"]


def _tiny_pipeline(root) -> str:
    """A Wan 2.2-like pipeline folder of the tiny Wan: model_index.json with the boundary, and
    two transformers of different random weights."""
    from diffusers import WanTransformer3DModel

    for i, name in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(10 + i)
        WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2).save_pretrained(
            os.path.join(root, name))
    with open(os.path.join(root, "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanPipeline", "boundary_ratio": BOUNDARY,
                   "transformer": ["diffusers", "WanTransformer3DModel"],
                   "transformer_2": ["diffusers", "WanTransformer3DModel"]}, f)
    return str(root)


def _knapray_expert(run_cfg, pipeline: str, ckpt: str, prefix: str, index: int):
    """knapray's expert ``index`` of a LoRA run: its base from the pipeline's folder, its
    adapters from the checkpoint."""
    import dataclasses

    from knapray.models.families import build_model
    from knapray.models.lora import init_adapters, is_adapter
    from knapray.weights.load import load_pretrained
    from knapray.weights.source import expert_path

    cfg = dataclasses.replace(run_cfg.model, pretrained=expert_path(pipeline, index))
    model = build_model(cfg)
    init_adapters(model, cfg.lora, 0)
    load_pretrained(model, cfg)
    adapters = {k: v for k, v in _tensors(ckpt, prefix).items() if is_adapter(k)}
    assert adapters
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected
    return model.eval()


def _lora_run(rank: int, world: int, corpus: str, runs: str, pipeline: str) -> None:
    from dist_utils import local_trainer

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, runs, "lora", [
        "model.family=wan", f"model.pretrained={pipeline}", "model.lora.rank=4", "model.text_pad_to=0",
        "data.global_batch=2", "balance.topology=g1n1", f"flow.expert_boundary={BOUNDARY}", "flow.expert_share=0.5",
        "run.max_steps=4", "optim.lr=1e-2"])
    if rank == 0:
        write_config(trainer.cfg)
    trainer.train()


def test_lora_on_both_experts_from_a_pipeline_folder_exported_as_wan22_loras(corpus, tmp_path):
    """A LoRA run of two experts from a Wan 2.2-like pipeline folder: each expert's base is its
    own transformer; ``export --lora`` writes one file per expert, which diffusers' WanPipeline
    loads (the second with ``load_into_transformer_2``) and computes what knapray's experts do."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from knapray.cli import main
    from knapray.driver.run_dir import read_run_config
    from knapray.models.families import get_family

    pipeline = _tiny_pipeline(tmp_path / "wan22")
    run_distributed(_lora_run, 1, corpus, str(tmp_path / "runs"), pipeline, timeout_s=180)
    run = tmp_path / "runs" / "lora"
    assert {m["expert"] for m in run_metrics(run)} == {0, 1}
    out = tmp_path / "adapters"
    assert main(["export", "--run", str(run), "--out", str(out), "--lora"]) == 0
    pipe = WanPipeline.from_pretrained(pipeline, tokenizer=None, text_encoder=None, vae=None,
                                       scheduler=UniPCMultistepScheduler())
    plain = [pipe.transformer, pipe.transformer_2]
    x = torch.randn(1, 4, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    text = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(1))

    def call(m):
        with torch.no_grad():
            return m(hidden_states=x, timestep=torch.tensor([900.0]), encoder_hidden_states=text, return_dict=False)[0]

    before = [call(m) for m in plain]
    pipe.load_lora_weights(str(out / "transformer"), adapter_name="high")
    pipe.load_lora_weights(str(out / "transformer_2"), adapter_name="low", load_into_transformer_2=True)
    run_cfg, ckpt = read_run_config(str(run)), _checkpoint(run)
    for i, (transformer, prefix) in enumerate(((pipe.transformer, "model"), (pipe.transformer_2, "model_2"))):
        got = call(transformer)
        assert not torch.allclose(got, before[i])  # the adapters change it
        ours = _knapray_expert(run_cfg, pipeline, ckpt, prefix, i)
        seq_in = _inputs_of(x, text)
        with torch.no_grad():
            mine = ours(family_batch(run_cfg.model, seq_in))
        want = get_family("wan").diffusers_call(transformer, run_cfg.model, seq_in)
        assert torch.allclose(want, _patch(got, run_cfg.model)), i  # (the same call as above)
        assert (mine - want).abs().max() <= 1e-5 * want.abs().max(), i


def _inputs_of(x, text):
    from knapray.testing.reference import Inputs

    return Inputs(latent=x[0], text=text[0], pooled=torch.zeros(0), timestep=0.9, guidance=None, target=None)


def _patch(out, cfg):
    from knapray.models.packing import patchify

    return patchify(out[0], cfg.patch_size)[0]
