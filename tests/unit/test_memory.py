"""The per-GPU memory model (knapray.planning.costs.memory) against the live model, and the
``knapray memory`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from knapray.cli import main
from knapray.testing.memory_check import measure_step
from knapray.models import MMDiTConfig, dit_config
from knapray.models.families import get_family
from knapray.models.families.flux2 import Flux2Config
from knapray.planning.costs.memory import (
    GIB,
    MemoryModel,
    ModelShape,
    memory_model_for_run,
    parse_checkpointing,
)
from knapray.testing.batches import mix_batches

FLUX = MMDiTConfig(
    in_channels=16, patch_size=(1, 2, 2), hidden_size=3072, num_heads=24, depth_double=19, depth_single=38,
    text_dim=4096, pooled_dim=768, rope_axes_dim=(16, 56, 56),
)
FLUX2 = Flux2Config()  # FLUX.2 [dev]
FLUX2_SMALL = dict(hidden_size=64, num_heads=4, depth_double=2, depth_single=2, in_channels=4, text_dim=32,
                   rope_axes_dim=(4, 4, 4, 4))
SMALL = {
    "mmdit": MMDiTConfig(hidden_size=64, num_heads=4, depth_double=2, depth_single=2),
    "dit": dit_config(hidden_size=64, num_heads=4),
    "flux2": Flux2Config(**FLUX2_SMALL),
}
# Two packed batches per model: ~200-450 and ~1000-1200 tokens, text and image.
MIXES = ["g1b3i256f1s0", "g1b2i512f2s0"]


# ---- parameters -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        MMDiTConfig(),
        dit_config(),
        MMDiTConfig(qk_norm=False, pooled_dim=0, mlp_ratio=2.5),
        MMDiTConfig(text_dim=0, depth_double=3, depth_single=0),
        FLUX,
        FLUX2,
        Flux2Config(guidance_embeds=False),
        SMALL["flux2"],
        Flux2Config(**{**FLUX2_SMALL, "guidance_embeds": False, "depth_double": 0}),
    ],
    ids=["mmdit", "dit", "no-qk-norm", "double-only", "flux", "flux2-dev", "flux2-no-guidance", "flux2-small",
         "flux2-small-single-only"],
)
def test_parameter_counts_match_the_model(cfg):
    # FLUX.2: no biases, SwiGLU MLPs, one shared modulation (ModelShape.biases, gated_mlp,
    # shared_modulation, from the config class)
    with torch.device("meta"):  # Flux size without its 48 GB, FLUX.2 [dev] without its 129 GB
        model = get_family(cfg.family).model_cls(cfg)
    shape = ModelShape.of(cfg)
    params = list(model.parameters())
    assert shape.num_params == sum(p.numel() for p in params)
    assert shape.num_param_tensors == len(params)
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    assert shape.num_linear_params == linear
    if cfg is FLUX:
        assert 11.8e9 < shape.num_params < 12.0e9  # Flux.1: 12 B
    if cfg is FLUX2:
        assert shape.num_params == 32_223_281_152 and shape.num_param_tensors == 299  # FLUX.2 [dev]: 32 B


# ---- prediction vs measurement (CPU) ------------------------------------------------------


@pytest.mark.parametrize("checkpointing", ["none", "full", "every_k", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SMALL))
def test_prediction_within_15_percent_of_measurement(name, dtype, checkpointing):
    cfg = SMALL[name]
    for mix in MIXES:
        batch = mix_batches(mix, cfg, scale=2, seed=0)[0]
        r = measure_step(cfg, batch, dtype=dtype, checkpointing=checkpointing, ac_every=2)
        pred, meas = r["predicted"]["activations"], r["activations"]
        print(f"{name} {str(dtype)[6:]} ac={checkpointing} tokens={r['tokens']}: "
              f"predicted {pred} B, measured {meas} B, ratio {pred / meas:.4f}")
        assert abs(pred / meas - 1) <= 0.15
        # Parameters, gradients and AdamW state exactly (of the model cast to dtype).
        for key in ("params", "grads", "optimizer"):
            assert r[key] == r["predicted"][key]
    if dtype == torch.float32:  # the memory model's fp32 master state is the same
        pred = MemoryModel(shape=ModelShape.of(cfg), precision="fp32").breakdown(0)
        assert (pred.params, pred.grads, pred.optimizer) == (r["params"], r["grads"], r["optimizer"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_qk_norm_saves_what_the_memory_model_counts(dtype):
    """QK-RMSNorm of q and k, measured with saved-tensor hooks: the fp32 copy of a bf16 input,
    the fp32 normed tensor the gain multiplies, the per-head rsqrt (not the input-dtype
    normed tensor the model once counted)."""
    from knapray.testing.memory_check import saved_activation_bytes
    from knapray.models.layers import RMSNorm

    n, heads, head_dim = 37, 4, 16
    norms = [RMSNorm(head_dim), RMSNorm(head_dim)]
    q, k = (torch.randn(n, heads, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    params = [p for m in norms for p in m.parameters()]
    _, saved = saved_activation_bytes(lambda: (norms[0](q), norms[1](k)), exclude=[*params, q, k])
    shape = ModelShape(hidden_size=heads * head_dim, num_heads=heads, depth_double=0, depth_single=1,
                       mlp_hidden=4 * heads * head_dim, patch_dim=4)
    assert saved == n * shape._qk_norm(dtype.itemsize)


def test_checkpointing_keeps_only_block_inputs():
    # Measured: checkpointing every block removes each block's saved tensors except its
    # input, d * b bytes per token.
    cfg = SMALL["dit"]
    batch = mix_batches(MIXES[1], cfg, scale=2, seed=0)[0]
    plain = measure_step(cfg, batch, optimizer=False)
    full = measure_step(cfg, batch, checkpointing="full", optimizer=False)
    shape = ModelShape.of(cfg)
    per_token_block = shape.single_block_bytes(4, "reference")
    dropped = (plain["activations"] - full["activations"]) / plain["tokens"]
    expected = cfg.depth_single * (per_token_block - cfg.hidden_size * 4)
    assert dropped == pytest.approx(expected, rel=0.05)
    # selective keeps, beyond each block's input, its attention kernel's output and
    # log-sum-exp (measured: what the forward's selective cache holds)
    selective = measure_step(cfg, batch, checkpointing="selective", optimizer=False)
    kept = (selective["activations"] - full["activations"]) / selective["tokens"]
    assert kept == pytest.approx(cfg.depth_single * shape.attention_kept_bytes(4), rel=0.05)


# ---- the model itself ------------------------------------------------------------------


def flux(**kw) -> MemoryModel:
    return MemoryModel(shape=ModelShape.of(FLUX), **kw)


def test_per_block_bytes_of_flux_width():
    s = ModelShape.of(FLUX)
    d = s.hidden_size
    # The module docstring's figures: 74d and 64d bytes per token in bf16, plus the
    # logsumexp / rsqrt / LN-stats terms (a few dozen bytes).
    assert 74 * d <= s.double_block_bytes(2) < 74 * d + 64 * s.num_heads
    assert 64 * d <= s.single_block_bytes(2) < 64 * d + 64 * s.num_heads
    # The CPU reference path's SDPA runs on views of q, k, v: a single block's are views of
    # linear1's output, so it saves d fewer than a kernel on the Ulysses buffer; a double
    # block the same.
    assert s.single_block_bytes(2, "reference") == s.single_block_bytes(2) - 2 * d
    assert s.double_block_bytes(2, "reference") == s.double_block_bytes(2)


def test_sharding_divides_the_state():
    none, full, hybrid = (flux(world_size=64, sharding=m) for m in ("none", "full", "hybrid"))
    n = ModelShape.of(FLUX).num_params
    assert none.breakdown(0).params == 4 * n
    assert full.breakdown(0).params == 4 * -(-n // 64)
    assert hybrid.shard_size == 8 and hybrid.breakdown(0).optimizer < none.breakdown(0).optimizer / 7.9
    # Autocast keeps bf16 copies of the Linear weights only without FSDP, only in bf16.
    assert none.breakdown(0).autocast_weights == 2 * ModelShape.of(FLUX).num_linear_params
    assert full.breakdown(0).autocast_weights == 0
    assert flux(precision="fp32").breakdown(0).autocast_weights == 0
    # FSDP's gathered blocks and reduce buffers exist only with FSDP.
    assert none.breakdown(0).fsdp_buffers == 0 < full.breakdown(0).fsdp_buffers
    with pytest.raises(ValueError, match="hybrid sharding needs whole nodes: world size 12"):
        flux(world_size=12, sharding="hybrid")


def test_checkpointing_modes():
    tokens = 8192
    modes = ("none", "every_k", "full", "selective")
    acts = {m: flux(checkpointing=m, sharding="full", world_size=8).breakdown(tokens) for m in modes}
    assert acts["full"].activations < acts["every_k"].activations < acts["none"].activations
    assert acts["full"].activations < acts["selective"].activations < acts["every_k"].activations
    assert acts["selective"].recompute < acts["full"].recompute
    assert acts["none"].recompute == 0 < acts["full"].recompute
    assert acts["full"].total < acts["every_k"].total < acts["none"].total
    m = MemoryModel(shape=ModelShape.of(dit_config(depth_single=7)), checkpointing="every_k", ac_every=3)
    assert m.checkpointed() == [False, False, True, False, False, True, False]
    assert parse_checkpointing("every_3") == ("every_k", 3)
    assert parse_checkpointing("every_1") == ("full", 1)
    assert parse_checkpointing("every_k", 4) == ("every_k", 4)


def test_max_tokens_is_the_largest_that_fits():
    gpu = 80 * GIB
    m = flux(world_size=64, sharding="hybrid", checkpointing="full")
    t = m.max_tokens_per_gpu(gpu)
    assert t > 20_000
    assert m.fits(t, gpu) and not m.fits(t + 1, gpu)
    assert m.usable_bytes(gpu) == int((gpu - 3 * GIB) * 0.9)
    # Replicated Flux state (16 B per parameter + autocast copies) does not fit at all.
    assert flux(world_size=64).max_tokens_per_gpu(gpu) == 0
    assert flux(world_size=64, sharding="full").max_tokens_per_gpu(gpu) < t


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"sharding": "zero3"}, "unknown sharding 'zero3'; valid: none, full, hybrid"),
        ({"checkpointing": "some"}, "unknown checkpointing 'some'; valid: none, full, every_k"),
        ({"precision": "fp16"}, "unknown precision 'fp16'; valid: bf16, fp32"),
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"fragmentation": 1.5}, r"fragmentation must be in \[0, 1\)"),
    ],
)
def test_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        flux(**kw)


def test_bad_token_counts():
    with pytest.raises(ValueError, match="text_tokens <= tokens"):
        flux().breakdown(10, text_tokens=11)
    with pytest.raises(ValueError, match="unknown activation checkpointing 'half'"):
        parse_checkpointing("half")


def test_run_config_sections_are_read():
    from knapray.config.run import load_config

    cfg = load_config(None, ["scaling.num_workers=32", "scaling.use_gpu=true", "parallel.fsdp=hybrid",
                             "parallel.activation_checkpointing=every_k", "parallel.ac_every=4",
                             "balance.gpus_per_node=4"])
    cfg.model = FLUX
    m = memory_model_for_run(cfg)
    assert (m.world_size, m.gpus_per_node, m.sharding, m.checkpointing, m.ac_every, m.precision) == (
        32, 4, "hybrid", "every_k", 4, "bf16"
    )
    m = memory_model_for_run(cfg, world_size=16, sharding="full", checkpointing="none")
    assert (m.world_size, m.sharding, m.checkpointing) == (16, "full", "none")
    # The defaults: no sharding, no checkpointing, fp32 on CPU workers.
    cfg = load_config(None, ["balance.gpus_per_node=4"])
    cfg.model = FLUX
    m = memory_model_for_run(cfg)
    assert (m.sharding, m.checkpointing, m.precision, m.gpus_per_node) == ("none", "none", "fp32", 4)


def test_two_experts_hold_two_models_state_and_train_one():
    """flow.expert_boundary (jobs/configs/wan22_a14b.yaml): both experts' parameter shards,
    AdamW state and EMA, one's gradients, buffers and activations; full training and LoRA
    (each expert its own base and adapters)."""
    from knapray.config.run import load_config
    from knapray.models.families import adapter_counts

    config = str(Path(__file__).resolve().parents[2] / "jobs" / "configs" / "wan22_a14b.yaml")
    for sets in ([], ["model.lora.rank=16"]):
        cfg = load_config(config, sets + ["optim.ema_decay=0.9999"])
        trainable = adapter_counts(cfg.model)
        two = memory_model_for_run(cfg, trainable=trainable)
        cfg.flow.expert_boundary = 0.0
        one = memory_model_for_run(cfg, trainable=trainable)
        assert (two.experts, one.experts, two.ema) == (2, 1, True)
        a, b = two.breakdown(16384), one.breakdown(16384)
        assert (a.params, a.optimizer, a.ema) == (2 * b.params, 2 * b.optimizer, 2 * b.ema)
        assert (a.grads, a.fsdp_buffers, a.activations, a.overlap) == (b.grads, b.fsdp_buffers, b.activations,
                                                                        b.overlap)
        assert a.total - b.total == b.params + b.optimizer + b.ema
        t = trainable[0] if trainable else one.shape.num_params
        assert b.ema == 4 * -(-t // 16)  # an fp32 shadow of the trained parameters' shards
    # the shipped config: 14,288,491,584 parameters an expert; fits 80 GiB on its 16 GPUs
    cfg = load_config(config)
    mem = memory_model_for_run(cfg)
    assert mem.shape.num_params == 14_288_491_584 and mem.world_size == 16 and not mem.ema
    assert mem.fits(cfg.data.max_tokens_per_gpu, 80 * GIB)


@pytest.mark.parametrize("lora, tokens, text, sequences, measured", [
    (False, 16_579, 16_083, 288, 7.92),  # the default mix: text-heavy
    (False, 17_541, 1_061, 8, 14.73),  # g8b1i512f17s0: 17-frame clips
    (True, 16_579, 16_083, 288, 3.82),
    (True, 17_541, 1_061, 8, 10.08),
])
def test_wan_terms_predict_the_dry_runs_peaks(lora, tokens, text, sequences, measured):
    """Wan 2.1 14B's width, 4 blocks, rank 0 of 8: the peaks knapray dryrun measured with
    RMSNorm as CUDA's fused kernel (2026-11-30, docs/gpu.md), within 5%. The LoRA text-heavy
    row's peak is the cross-attention's backward on the text rows (a frozen base has no
    reduce-scatter to hide it); a full fine-tune's text rows add nothing over FSDP's."""
    from knapray.config.run import load_config
    from knapray.models.families import adapter_counts

    config = str(Path(__file__).resolve().parents[2] / "jobs" / "configs" / "wan_t2v_14b.yaml")
    cfg = load_config(config, ["model.depth_single=4"] + (["model.lora.rank=16"] if lora else []))
    mem = memory_model_for_run(cfg, world_size=8, gpus_per_node=8, trainable=adapter_counts(cfg.model))
    pred = mem.breakdown(tokens, text_tokens=text, sequences=sequences)
    assert pred.total / GIB == pytest.approx(measured, rel=0.05)
    d, b, image = mem.shape.hidden_size, mem.compute_bytes, tokens - text
    text_working = pred.backward_working - image * 16 * d  # bf16: 16·d bytes per image token
    assert text_working == (text * 4 * d * b if lora else 0)


# ---- the command -----------------------------------------------------------------------


def _write_config(path: Path, model: MMDiTConfig, **parallel) -> str:
    import yaml

    import dataclasses
    import json

    m = json.loads(json.dumps(dataclasses.asdict(model)))  # tuples as lists, the lora section as a mapping
    data = {"model": m, "balance": {"gpus_per_node": 8}, "run": {"name": "t"},
            "scaling": {"num_workers": 64, "use_gpu": True}, "parallel": {"precision": "bf16", **parallel}}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_memory_command_flux(tmp_path, capsys):
    config = _write_config(tmp_path / "flux.yaml", FLUX)
    assert main(["memory", "--config", config, "--fsdp", "hybrid", "--ac", "full", "--tokens-per-gpu",
                 "32768", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["fits"] and result["tokens_per_gpu"] == 32768 and result["shard_size"] == 8
    assert result["total_gib"] == pytest.approx(sum(
        result["breakdown"][k] for k in result["breakdown"] if k != "step_buffers"))
    assert result["max_tokens_per_gpu"] > 32768
    assert any(line.strip().startswith("activations") for line in out)
    # Replicated, the same config does not fit: the command says so and still exits 0.
    assert main(["memory", "--config", config, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not result["fits"] and result["max_tokens_per_gpu"] == 0


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--fsdp", "zero3"], "argument --fsdp: invalid choice: 'zero3' (choose from 'none', 'full', 'hybrid')"),
        (["--ac", "half"], "argument --ac: invalid choice: 'half' (choose from 'none', 'full', 'every_k', 'selective')"),
        (["--world-size", "12", "--fsdp", "hybrid"], "world size 12 is not a multiple of gpus_per_node=8"),
        (["--tokens-per-gpu", "-1"], "argument --tokens-per-gpu: expected an integer in [0, 67108864], got '-1'"),
        (["--gpu-gib", "0"], "argument --gpu-gib: expected a finite number > 0, got '0'"),
    ],
)
def test_memory_command_bad_values(tmp_path, capsys, args, msg):
    config = _write_config(tmp_path / "small.yaml", SMALL["mmdit"])
    try:
        code = main(["memory", "--config", config, *args])
    except SystemExit as e:  # argparse's own exit for a bad argument
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("knapray memory: error:") and msg in err


def test_memory_command_missing_config(tmp_path, capsys):
    assert main(["memory", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


# ---- GPU: the CUDA allocator's peak ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_cuda_peak_within_15_percent(checkpointing):
    cfg = MMDiTConfig(hidden_size=1024, num_heads=8, depth_double=2, depth_single=2, rope_axes_dim=(16, 56, 56))
    batch = mix_batches("g1b2i1024f1s0", cfg, scale=1, seed=0)[0]
    r = measure_step(cfg, batch, dtype=torch.bfloat16, checkpointing=checkpointing, device="cuda", optimizer=False)
    print(r)
    assert abs(r["predicted"]["activations"] / r["activations"] - 1) <= 0.15
    if checkpointing == "selective":
        # Measured on an H200 (torch 2.11, 2026-11-27): 476 MB against 998 MB predicted, where
        # CPU's MemTracker puts selective's backward peak equal to full's (as the model
        # does); why CUDA's is lower is not known yet (docs/gpu.md), so only the bound holds.
        assert r["cuda_fwd_bwd_peak"] <= 1.15 * r["predicted"]["fwd_bwd_peak"]
        return
    assert abs(r["predicted"]["fwd_bwd_peak"] / r["cuda_fwd_bwd_peak"] - 1) <= 0.15
