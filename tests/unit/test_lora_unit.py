"""``model.lora`` in one process: the config's one-line errors, pre-flight, which layers a
preset selects, adapters that start as the base, and the export layout against diffusers
for both families (tiny checkpoints saved by diffusers, random adapters put on knapray's
model, the exported tensors loaded into diffusers' transformer: the same outputs in fp32).
The training path (4 gloo ranks, FSDP, resume, export, a wrong base) is
tests/dist/test_lora.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("peft", reason="needs peft (the lora extra)")

from knapray.models.config import LoraConfig  # noqa: E402
from knapray.models.families import build_model  # noqa: E402
from knapray.models.lora import base_name, init_adapters, is_adapter  # noqa: E402
from knapray.testing.parity import parity_config  # noqa: E402


@pytest.mark.parametrize("values, message", [
    ({"rank": -1}, "lora.rank must be an int >= 0, got -1"),
    ({"rank": 4, "dropout": 1.0}, "lora.dropout must be in [0, 1), got 1.0"),
    ({"rank": 4, "init": "zeros"}, "lora.init must be one of ['gaussian', 'kaiming'], got 'zeros'"),
    ({"rank": 4, "targets": ["(unclosed"]}, "lora.targets: '(unclosed' is not a regular expression"),
])
def test_bad_lora_values_are_one_line(values, message):
    with pytest.raises(ValueError) as e:
        LoraConfig(**values)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_run_config_lora_errors_name_the_key(tmp_path):
    from knapray.config.run import ConfigError
    from knapray.driver.preflight import load_run_config

    with pytest.raises(ConfigError, match=r"config model.lora.rank: expected an int in \[0, 4096\], got -2"):
        load_run_config(None, ["model.lora.rank=-2"])
    with pytest.raises(ConfigError, match=r"config model.lora: unknown key\(s\) \['rnak'\]"):
        load_run_config(None, ["model.lora.rnak=4"])


def test_preflight_refuses_lora_without_base_or_matching_targets(monkeypatch):
    from knapray.config.run import TrainConfig
    from knapray.driver.preflight import check_lora
    from knapray.driver.run_dir import RunError

    cfg = TrainConfig()
    cfg.model.lora = LoraConfig(rank=4)
    with pytest.raises(RunError, match="model.lora trains adapters on a pretrained base: set model.pretrained"):
        check_lora(cfg)
    cfg.model.pretrained = "/nowhere"  # check_lora builds on the meta device; the base is check_pretrained's
    cfg.model.lora = LoraConfig(rank=4, targets=("no_such_layer",))
    with pytest.raises(RunError, match="'no_such_layer' selects no linear layer of this model"):
        check_lora(cfg)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(RunError, match=r"needs the peft package .* pip install 'knapray\[lora\]'"):
        check_lora(cfg)


def test_presets_select_the_attention_projections_and_start_as_the_base():
    cfg = dataclasses.replace(parity_config(), lora=LoraConfig(rank=4))
    model = build_model(cfg)
    wrapped = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n})
    blocks = cfg.depth_double + cfg.depth_single
    assert len(wrapped) == 2 * 2 * cfg.depth_double + 2 * cfg.depth_single and blocks > 1
    assert all(w.endswith((".qkv", ".proj", ".linear1", ".linear2")) for w in wrapped)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if is_adapter(n)}
    torch.manual_seed(0)
    plain = build_model(parity_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not is_adapter(name):
                p.copy_(dict(plain.named_parameters())[base_name(name)])
    init_adapters(model, cfg.lora, seed=3)
    a = [p for n, p in model.named_parameters() if ".lora_A." in n]
    assert all(x.abs().sum() > 0 for x in a)  # lora_A drawn, lora_B zero: the output is the base's
    from knapray.testing.batches import mix_batches

    batch = mix_batches("g1b2i256f1s0", cfg, scale=4, seed=0, world_size=None, max_text_tokens=8)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(batch), plain(batch), rtol=0, atol=0)
    again = build_model(cfg)
    init_adapters(again, cfg.lora, seed=3)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        if is_adapter(n):
            assert torch.equal(p, q), n  # the same adapters from the same seed


def _randomize_adapters(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter(n):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


PIPELINES = {"flux": "FluxPipeline", "qwen_image": "QwenImagePipeline", "flux2": "Flux2Pipeline"}
"""The pipeline whose ``lora_state_dict`` reads a family's community formats (diffusers'
kohya and ComfyUI converters)."""


@pytest.mark.parametrize("family, fmt", [("flux", "diffusers"), ("wan", "diffusers"), ("qwen_image", "diffusers"),
                                         ("flux2", "diffusers"), ("flux", "kohya"), ("qwen_image", "kohya"),
                                         ("flux2", "kohya"), ("qwen_image", "comfyui"), ("flux2", "comfyui")])
def test_exported_adapters_load_into_diffusers_with_the_same_outputs(family, fmt, tmp_path):
    """Random adapters on every linear layer of the blocks (``all-linear``: for Flux, the
    fused qkv / linear1 / linear2 split over several diffusers layers), exported through the
    family's layout with alpha / r folded in, loaded by diffusers' ``load_lora_adapter``; in
    kohya's and ComfyUI's formats (the family's original names), read first by the family
    pipeline's ``lora_state_dict`` (diffusers' converters of those formats)."""
    pytest.importorskip("diffusers")
    from knapray.testing.reference import _pack, _split, diffusers_call, make_inputs
    from knapray.testing.reference import reference_config
    from knapray.weights.checks import checkpoint_family
    from knapray.weights.load import load_pretrained
    from knapray.driver.lora_export import lora_tensors
    from knapray.weights.source import open_pretrained

    if family == "flux":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from flux_utils import save_tiny_flux
        from diffusers import FluxTransformer2DModel as Ref

        path = str(save_tiny_flux(tmp_path / "t", 2, 16, (4, 6, 6), 1, 1, True, text_dim=16, pooled_dim=12))
    elif family == "qwen_image":
        from diffusers import QwenImageTransformer2DModel as Ref

        torch.manual_seed(0)
        Ref(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=12, axes_dims_rope=(4, 6, 6)).save_pretrained(tmp_path / "t")
        path = str(tmp_path / "t")
    elif family == "flux2":
        from diffusers import Flux2Transformer2DModel as Ref

        torch.manual_seed(0)
        Ref(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=(4, 4, 4, 4)).save_pretrained(tmp_path / "t")
        path = str(tmp_path / "t")
    else:
        from diffusers import WanTransformer3DModel as Ref

        torch.manual_seed(0)
        Ref(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=12, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True).save_pretrained(tmp_path / "t")
        path = str(tmp_path / "t")
    source = open_pretrained(path)
    # diffusers' kohya converter of Flux.1 splits a single block's linear1 at FLUX.1's own widths
    # (3072 x 3 + 12288): at a tiny width the rest of the blocks is what it can read back
    targets = ((r"double_blocks\..+", r"single_blocks\.\d+\.linear2") if (family, fmt) == ("flux", "kohya")
               else ("all-linear",))
    cfg = dataclasses.replace(reference_config(source, checkpoint_family(source, family)),
                              lora=LoraConfig(rank=3, alpha=6, targets=targets))
    model = build_model(cfg)
    model.to_empty(device="cpu")
    load_pretrained(model, cfg)
    _randomize_adapters(model, seed=1)
    params = dict(model.named_parameters())
    adapters = {n.split(".lora_A.")[0]: (p.detach(), params[n.replace(".lora_A.", ".lora_B.")].detach())
                for n, p in params.items() if ".lora_A." in n}
    ref = Ref.from_pretrained(path, torch_dtype=torch.float32)
    written = lora_tensors(adapters, cfg, cfg.lora.scale, fmt)
    if fmt != "diffusers":
        import diffusers

        _check_original_names(written, cfg, fmt)
        written = getattr(diffusers, PIPELINES[family]).lora_state_dict(dict(written))
    ref.load_lora_adapter(written, prefix="transformer")
    inputs = make_inputs(cfg, 2, seed=4)
    with torch.no_grad():
        ours = _split(model(_pack(cfg, inputs)), inputs)
        theirs = [diffusers_call(ref, cfg, s) for s in inputs]
        plain = Ref.from_pretrained(path, torch_dtype=torch.float32)
        base = [diffusers_call(plain, cfg, s) for s in inputs]
    for a, b, c in zip(ours, theirs, base):
        assert (a - b).norm() / b.norm() <= 1e-5
        assert (c - b).norm() / b.norm() > 1e-2  # the adapters matter


def test_a_lora_format_a_family_has_no_names_for_is_refused_in_one_line() -> None:
    from knapray.driver.lora_export import format_layout
    from knapray.models.families import get_family

    cfg = get_family("wan").small_config(64)
    with pytest.raises(ValueError) as e:
        format_layout(cfg, "kohya")
    assert str(e.value) == ("--format kohya: Wan adapters are written in diffusers' format only (--format diffusers); "
                            "kohya names exist for Flux.1, Qwen-Image, FLUX.2")
    assert format_layout(cfg, "diffusers").name == "diffusers"


def _check_original_names(written: dict, cfg, fmt: str) -> None:
    """Every module a kohya or ComfyUI file names is a tensor of the family's original
    checkpoint (what ComfyUI matches a LoRA's keys against), with the adapter's shapes."""
    from knapray.driver.lora_export import format_layout

    shapes = format_layout(cfg, fmt).shapes
    if fmt == "kohya":
        by_flat = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): v for k, v in shapes.items()}
        modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in written}
        for m in modules:
            down, up = written[f"{m}.lora_down.weight"], written[f"{m}.lora_up.weight"]
            assert (up.shape[0], down.shape[1]) == tuple(by_flat[m][:2]) and written[f"{m}.alpha"].dim() == 0
    else:
        for k, v in written.items():
            assert k.startswith("diffusion_model.")
            module = k.removeprefix("diffusion_model.").rsplit(".", 2)[0]
            rows, cols = shapes[f"{module}.weight"][:2]
            assert v.shape[1 if k.endswith("lora_A.weight") else 0] == (cols if k.endswith("lora_A.weight") else rows)


def test_adapters_compile_and_checkpoint_as_eager():
    """peft's layers inside compiled (inductor), selectively checkpointed blocks: the same
    outputs and adapter gradients as eager without checkpointing."""
    from knapray.attention import LocalAttention
    from knapray.models import flow_loss
    from knapray.models.families import MMDIT_LORA
    from knapray.models.lora import inject
    from knapray.testing.batches import mix_batches
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import parallelize

    cfg = dataclasses.replace(parity_config(), depth_double=1, depth_single=1)
    lora = LoraConfig(rank=4)
    batch = mix_batches("g1b2i256f1s0,g1b1i512f1s0", cfg, scale=4, seed=1, world_size=None, max_text_tokens=40)[0]

    def run(parallel):
        torch.manual_seed(0)
        model = build_model(cfg)
        model.init_weights(std=0.1)  # no zero-initialized output layer: gradients reach the blocks
        inject(model, lora, dict(MMDIT_LORA))
        init_adapters(model, lora, seed=1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
        parallelize(model, parallel)
        out = model(batch, LocalAttention(batch.cu_seqlens, batch.max_seqlen))
        flow_loss(out, batch.targets, batch.x_img.shape[0]).backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    ref_out, ref = run(ParallelConfig())
    out, grads = run(ParallelConfig(compile=True, activation_checkpointing="selective"))
    assert set(grads) == set(ref) and all(ref[n].norm() > 0 for n in ref)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)


def test_export_lora_names_the_steps_trained_and_writes_a_file_others_can_read(tmp_path, capsys):
    """A run that trained 2 steps holds its checkpoint as ``step-000000001`` (trainer.json's
    step is the last step's index, counted from 0): the report says 2 steps. The file is
    0644 under a umask of 022, as any file written with open() (safetensors writes 0600)."""
    import json
    import os
    import stat
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flux_utils import save_tiny_flux

    from knapray.cli import main
    from knapray.driver.preflight import load_run_config
    from knapray.driver.run_dir import write_config
    from knapray.worker.checkpoint import Checkpointer, JsonState, training_parts

    base = save_tiny_flux(tmp_path / "base", 2, 16, (4, 6, 6), 1, 1, True, text_dim=16, pooled_dim=12)
    cfg = load_run_config(None, [f"model.pretrained={base}", f"data.corpus={tmp_path}", "model.lora.rank=2",
                                 f"run.storage={tmp_path}", "run.name=lora"])
    write_config(cfg)
    model = build_model(cfg.model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    Checkpointer(os.path.join(cfg.run_dir, "checkpoints"), rank=0, group=None, parts=training_parts(model, opt),
                 state=JsonState({"epoch": 0})).save(1, barrier=lambda: None)  # after steps 0 and 1
    old = os.umask(0o022)
    try:
        assert main(["export", "--run", cfg.run_dir, "--out", str(tmp_path / "out"), "--lora", "--json"]) == 0
    finally:
        os.umask(old)
    text, doc = capsys.readouterr().out.strip().splitlines()
    assert "adapters after 2 steps" in text and "step-000000001" in text, text
    assert json.loads(doc)["steps"] == 2
    assert stat.S_IMODE(os.stat(tmp_path / "out" / "pytorch_lora_weights.safetensors").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o755
    # kohya's and ComfyUI's formats: BFL's names, each file what the format's readers look for
    from safetensors.torch import load_file

    for fmt, file, key in (("kohya", "lora_kohya.safetensors", "lora_unet_double_blocks_0_img_attn_qkv.alpha"),
                           ("comfyui", "lora_comfyui.safetensors",
                            "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight")):
        assert main(["export", "--run", cfg.run_dir, "--out", str(tmp_path / fmt), "--lora", "--format", fmt]) == 0
        text = capsys.readouterr().out
        assert f"in {fmt}'s format" in text and f"weight_name='{file}'" in text, text
        assert key in load_file(tmp_path / fmt / file)
    # a format without --lora, and a format for a full model: one line each, exit 2
    assert main(["export", "--run", cfg.run_dir, "--out", str(tmp_path / "x"), "--format", "kohya"]) == 2
    err = capsys.readouterr().err
    assert "--format kohya: a LoRA format; add --lora" in err and err.count("\n") == 1
