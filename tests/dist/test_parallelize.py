"""FSDP2, activation checkpointing and compile applied by knapray.worker.parallelize, each
against the single-process reference.

- pure: ParallelConfig checks and mesh shapes, no process group;
- one process: checkpointing gives bit-identical gradients and re-runs attention per
  checkpointed block; parameter names do not change; compile over 50 varying packed batches
  (empty, text-less, one sequence, 0..~110 tokens) matches eager and recompiles <= 2 times;
- 4 gloo ranks (``knapray.testing.parity``): balanced + FSDP full / hybrid + checkpointing against
  the reference for g1n4, g2n2, g1n2+g2n1 and unbalanced, with a rank holding no sequences
  and a rank holding no text (routed chunks without text: text weights unused there);
- 2 gloo ranks: bf16 parameters under FSDP (fp32 reduce), global grad-norm clipping of
  sharded gradients, DCP state-dict names, the flat all-reduce refusing sharded parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from knapray.attention import LocalAttention
from knapray.models import MMDiT, add_noise, flow_loss, pack_samples
from knapray.testing.parity import parity_config, passed, run_parity
from knapray.distributed.parallel_dims import ParallelDims
from knapray.config.parallel import ParallelConfig
from knapray.worker.parallelize import parallelize
from knapray.planning.costs.checkpointing import SELECTIVE_KEEPS
from torch.utils._python_dispatch import TorchDispatchMode
from knapray.testing.batches import mix_batches

# As tests/dist/test_parity.py: rank 1 holds nothing; short sequences split over bags; long ones
# split into chunks whose later parts hold no text.
MIX = "g1b2i256f1s0,g1b1i512f1s0,g1b4i64f1s0,g1b1i128f2s0"
TOPOLOGIES = ["g1n4", "g2n2", "g1n2+g2n1"]
TOL = 1e-5


def _model(seed: int = 0) -> MMDiT:
    torch.manual_seed(seed)
    model = MMDiT(parity_config())
    model.init_weights(std=0.1)
    return model


# ---- pure checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fsdp": "zero3"}, "fsdp must be one of ['none', 'full', 'hybrid'], got 'zero3'"),
        ({"activation_checkpointing": "some"},
         "activation_checkpointing must be one of ['none', 'full', 'every_k', 'selective'], got 'some'"),
        ({"activation_checkpointing": "every_k", "ac_every": 0}, "ac_every must be an int >= 1, got 0"),
        ({"precision": "fp16"}, "precision must be one of ['auto', 'bf16', 'fp32'], got 'fp16'"),
        ({"compile_backend": "eager"}, "compile_backend must be one of ['inductor', 'aot_eager'], got 'eager'"),
        ({"compile": "yes"}, "compile must be a bool, got 'yes'"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelConfig(**kwargs)


def test_one_rank_shards_nothing():
    """FSDP at world 1 would only add casts and copies: the run computes under autocast over
    fp32 parameters instead, and the memory model counts it so."""
    from knapray.planning.costs.memory import memory_model_for_run
    from knapray.config.run import load_config
    from knapray.config.parallel import sharding_of

    cfg = load_config(None, ["parallel.fsdp=full", "parallel.precision=bf16", "scaling.num_workers=1"])
    assert cfg.parallel.for_world(1).fsdp == "none" and cfg.parallel.for_world(2).fsdp == "full"
    assert sharding_of("hybrid", 1) == "none" and sharding_of("hybrid", None) == "hybrid"
    assert memory_model_for_run(cfg).sharding == "none"
    assert memory_model_for_run(cfg, world_size=8).sharding == "full"


def test_mesh_shapes_and_checkpointed_blocks():
    assert ParallelDims(world_size=4).mesh_shape("full") == ((4,), ("shard",))
    assert ParallelDims(world_size=4, gpus_per_node=2).mesh_shape("hybrid") == ((2, 2), ("replicate", "shard"))
    assert ParallelDims(world_size=32, gpus_per_node=8).mesh_shape("hybrid") == ((4, 8), ("replicate", "shard"))
    with pytest.raises(ValueError, match="world size 6 is not a multiple of gpus_per_node=4"):
        ParallelDims(world_size=6, gpus_per_node=4).mesh_shape("hybrid")
    with pytest.raises(ValueError, match="fsdp hybrid shards within a node: it needs gpus_per_node"):
        ParallelDims(world_size=4).mesh_shape("hybrid")
    with pytest.raises(ValueError, match="gpus_per_node must be an int >= 1, got 0"):
        ParallelDims(world_size=4, gpus_per_node=0)
    with pytest.raises(ValueError, match="fsdp 'none' has no device mesh"):
        ParallelDims(world_size=4).mesh_shape("none")
    every3 = ParallelConfig(activation_checkpointing="every_k", ac_every=3)
    assert every3.checkpointed(7) == (False, False, True, False, False, True, False)
    assert all(ParallelConfig(activation_checkpointing="full").checkpointed(5))
    assert not any(ParallelConfig().checkpointed(5))


@pytest.mark.parametrize("ac, every", [("every_k", 2), ("every_k", 3), ("full", 2), ("none", 2)])
def test_trainer_memory_model_and_measurement_checkpoint_the_same_blocks(ac, every):
    """One rule (knapray.planning.costs.checkpointing): the blocks parallelize wraps are the
    blocks the memory model counts as recomputed, every_k counting k-1, 2k-1, ..."""
    from knapray.planning.costs.memory import MemoryModel, ModelShape

    cfg = dataclasses.replace(parity_config(), depth_double=2, depth_single=3)
    model = MMDiT(cfg)
    parallelize(model, ParallelConfig(activation_checkpointing=ac, ac_every=every))
    wrapped = [hasattr(b.forward, "__wrapped__") for b in [*model.double_blocks, *model.single_blocks]]
    predicted = MemoryModel(shape=ModelShape.of(cfg), checkpointing=ac, ac_every=every).checkpointed()
    assert wrapped == predicted
    if ac == "every_k":
        assert [i for i, w in enumerate(wrapped) if w] == list(range(every - 1, 5, every))


# ---- one process: activation checkpointing and compile ----------------------------------


class CountingAttention:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, q, k, v):
        self.calls += 1
        return self.inner(q, k, v)


@pytest.mark.parametrize("ac, ac_every, recomputed", [("full", 2, 4), ("every_k", 2, 2), ("every_k", 3, 1)])
def test_checkpointing_gives_identical_gradients_and_recomputes(ac, ac_every, recomputed):
    cfg = dataclasses.replace(parity_config(), depth_double=2, depth_single=2)  # blocks 0..3
    batch = mix_batches(MIX, cfg, scale=4, seed=1, world_size=None, max_text_tokens=40)[0]

    def run(model):
        attn = CountingAttention(LocalAttention(batch.cu_seqlens, batch.max_seqlen))
        out = model(batch, attn)
        flow_loss(out, batch.targets, batch.x_img.shape[0]).backward()
        return out, attn.calls, {n: p.grad for n, p in model.named_parameters()}

    def build():
        torch.manual_seed(0)
        model = MMDiT(cfg)
        model.init_weights(std=0.1)
        return model

    ref_out, ref_calls, ref_grads = run(build())
    model = build()
    parallelize(model, ParallelConfig(activation_checkpointing=ac, ac_every=ac_every))
    out, calls, grads = run(model)
    assert torch.equal(out, ref_out)
    assert list(grads) == list(ref_grads)  # names unchanged: state dicts interchange
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name
    # Backward re-ran the forward (attention included) of each checkpointed block.
    assert ref_calls == 4 and calls == 4 + recomputed


class KernelCount(TorchDispatchMode):
    """Counts executions of the attention kernels selective checkpointing keeps."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func._schema.name in SELECTIVE_KEEPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_selective_checkpointing_keeps_attention_and_recomputes_the_rest(compiled):
    """``selective``: every block checkpointed, outputs and gradients as without
    checkpointing, and the attention kernel runs once per block (``full`` runs it twice),
    compiled blocks included."""
    cfg = dataclasses.replace(parity_config(), depth_double=2, depth_single=2)
    batch = mix_batches(MIX, cfg, scale=4, seed=1, world_size=None, max_text_tokens=40)[0]

    def run(ac):
        torch.manual_seed(0)
        model = MMDiT(cfg)
        model.init_weights(std=0.1)
        parallelize(model, ParallelConfig(activation_checkpointing=ac, compile=compiled))
        attn = CountingAttention(LocalAttention(batch.cu_seqlens, batch.max_seqlen))
        with KernelCount() as kernels:
            out = model(batch, attn)
            flow_loss(out, batch.targets, batch.x_img.shape[0]).backward()
        return out, kernels.runs, attn.calls, {n: p.grad for n, p in model.named_parameters()}

    ref_out, ref_kernels, _, ref_grads = run("none")
    out, kernels, calls, grads = run("selective")
    _, full_kernels, _, _ = run("full")
    tol = dict(rtol=1e-4, atol=1e-5) if compiled else dict(rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **tol)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **tol, msg=name)
    assert ref_kernels > 0 and full_kernels == 2 * ref_kernels
    assert calls == 8 and kernels == ref_kernels  # the blocks re-ran, their attention kernels did not


def _same_step(eager, model, batch, step: int) -> None:
    """One forward and backward of ``batch`` through both models: the compiled one's output
    and every parameter's gradient are the eager one's (rtol 1e-4, atol 1e-5)."""
    outs = []
    for m in (eager, model):
        m.zero_grad(set_to_none=True)
        out = m(batch)
        flow_loss(out, batch.targets, max(batch.x_img.shape[0], 1)).backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5, msg=f"step {step}")
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")


def _varying_batches(cfg, steps: int = 50):
    """Packed batches whose token count and sequence mix change every step: empty batches
    (an empty rank), text-less batches, single sequences, 1..~110 tokens."""
    mixes = ["g1b2i256f1s0,g1b1i512f1s0", "g1b4i64f1s0", "g1b1i128f2s0,g1b3i256f1s0", "g1b1i512f1s0",
             "g1b1i64f1s0", "g1b3i128f1s0"]
    batches = []
    for step in range(steps):
        if step % 16 == 7:
            batches.append(add_noise(pack_samples([], cfg), torch.zeros(0, cfg.patch_dim)))
            continue
        text = 0 if step % 5 == 3 else 48
        batches.append(mix_batches(mixes[step % len(mixes)], cfg, scale=4, seed=step, world_size=None,
                                   max_text_tokens=text)[0])
    return batches


def test_compile_matches_eager_and_recompiles_at_most_twice_over_50_steps():
    cfg = parity_config()
    eager, model = _model(), _model()
    # inductor, as in training
    par = parallelize(model, ParallelConfig(compile=True, activation_checkpointing="every_k", ac_every=2))
    batches = _varying_batches(cfg)
    assert len({int(b.seq_lens.sum()) for b in batches}) >= 20
    assert sum(b.num_sequences == 0 for b in batches) >= 3
    assert any(b.num_sequences and not b.is_text.any() for b in batches)
    assert any(b.num_sequences == 1 for b in batches)
    for step, batch in enumerate(batches):
        _same_step(eager, model, batch, step)
    stats = par.compile_stats
    # Double and single block class, each cut in two by the eager attention. Text counts are
    # unbacked (no graph for a text-less rank), an empty rank runs eagerly; what is left is a
    # rank holding 1 image token (a graph of its own, once).
    assert stats.compiles == 4
    assert par.recompiles <= 2, stats.recompiles


def test_wan_blocks_compile_and_match_eager_over_varying_steps():
    """Wan's blocks call two attentions (self and cross) through its attention ops, which the
    compiled blocks run eagerly like a joint-attention callable."""
    from knapray.models.families.wan import WanConfig, WanTransformer

    cfg = WanConfig(in_channels=4, patch_size=(1, 2, 2), hidden_size=32, num_heads=2, depth_single=2, text_dim=8,
                    ffn_dim=48, freq_dim=16, text_pad_to=24)

    def build():
        torch.manual_seed(0)
        return WanTransformer(cfg)

    eager, model = build(), build()
    par = parallelize(model, ParallelConfig(compile=True))
    batches = _varying_batches(cfg, steps=18)
    for step, batch in enumerate(batches):
        _same_step(eager, model, batch, step)
    assert par.compile_stats.compiles >= 2  # the block, cut by its attentions
    assert par.recompiles <= 2, par.compile_stats.recompiles


def test_wan_i2v_blocks_compile_once_for_any_number_of_image_contexts():
    """Wan 2.1 I2V's blocks take the image context's S·257 rows beside the tokens: a backed
    size like the token counts, so steps of 0 to 5 sequences run on the first graphs."""
    from knapray.models.families.wan import WanConfig, WanTransformer
    from knapray.testing.reference import _clip_inputs, _pack

    cfg = WanConfig(in_channels=12, out_channels=4, image_dim=24, patch_size=(1, 2, 2), hidden_size=32, num_heads=2,
                    depth_single=2, text_dim=8, ffn_dim=48, freq_dim=16)

    def build():
        torch.manual_seed(0)
        return WanTransformer(cfg)

    eager, model = build(), build()
    par = parallelize(model, ParallelConfig(compile=True))
    for step, sequences in enumerate((3, 2, 4, 1, 0, 5, 2)):
        batch = _pack(cfg, _clip_inputs(cfg, sequences, step, (5, 0, 9, 3)))
        _same_step(eager, model, batch, step)
    assert par.recompiles == 0, par.compile_stats.recompiles


# ---- 4 gloo ranks: parity of balanced + FSDP (+ checkpointing) --------------------------


@pytest.mark.dist
@pytest.mark.parametrize(
    "parallelism, gpus_per_node, textless",
    [
        (ParallelConfig(fsdp="full", activation_checkpointing="full"), None, (2,)),
        (ParallelConfig(fsdp="hybrid", activation_checkpointing="every_k"), 2, (0, 3)),
    ],
    ids=["full-ac_full", "hybrid-ac_every2"],
)
def test_balanced_fsdp_matches_single_process_reference(parallelism, gpus_per_node, textless, monkeypatch):
    if parallelism.fsdp == "hybrid":
        # As on torch 2.10 / 2.11, which lack FSDPModule.set_reduce_scatter_unused_params:
        # the ranks' workers run without it (a rank without text, a rank without sequences).
        import knapray.testing.parity

        monkeypatch.setattr(knapray.testing.parity, "_worker", _worker_on_a_torch_without_unused_params)
    report = run_parity(4, TOPOLOGIES, MIX, scale=4, seed=5, max_text_tokens=12, empty_ranks=(1,),
                        textless_ranks=textless, parallelism=parallelism, gpus_per_node=gpus_per_node)
    meta = report["_meta"]
    assert (meta["fsdp"], meta["activation_checkpointing"]) == (parallelism.fsdp, parallelism.activation_checkpointing)
    for case in TOPOLOGIES + ["unbalanced"]:
        r = report[case]
        assert r["num_params"] > 30
        for key in ("out_rel", "loss_rel", "grad_rel_max", "grad_norm_rel"):
            assert r[key] <= TOL, (case, key, r)
        assert r["ranks_without_sequences"] == 1
        # Some rank computed chunks without a text token: its text weights got no use.
        assert r["ranks_without_text"] >= 1, (case, r)
    assert report["unbalanced"]["ranks_computing_nothing"] == 1
    assert report["unbalanced"]["ranks_without_image_tokens"] == 1
    assert report["g2n2"]["sequences_shorter_than_bag"] > 0
    assert passed(report)


def _worker_on_a_torch_without_unused_params(*args):
    from torch.distributed.fsdp import FSDPModule

    import knapray.testing.parity

    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        delattr(FSDPModule, "set_reduce_scatter_unused_params")
    knapray.testing.parity._worker(*args)


# ---- 2 gloo ranks: bf16 parameters, clipping, state dicts --------------------------------


def _bf16_fsdp_worker(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from knapray.distributed.grads import allreduce_gradients

    cfg = parity_config()
    batches = mix_batches("g1b2i256f1s0,g1b3i128f1s0", cfg, scale=4, seed=5, world_size=2, max_text_tokens=24)
    batch = batches[rank]
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    par = parallelize(model, ParallelConfig(fsdp="full", activation_checkpointing="full"),
                      ParallelDims(world_size=world), compute_dtype=torch.bfloat16)
    seen = {}
    model.double_blocks[0].register_forward_pre_hook(
        lambda m, args: seen.update(h=args[0].dtype, vec=args[2].dtype, rope=args[6][0].dtype))
    attn_dtypes = set()
    inner = LocalAttention(batch.cu_seqlens, batch.max_seqlen)

    def attn(q, k, v):
        attn_dtypes.add((q.dtype, k.dtype, v.dtype))
        return inner(q, k, v)

    out = model(batch, attn)
    loss = flow_loss(out, batch.targets, sum(b.x_img.shape[0] for b in batches))
    loss.backward()
    par.reduce_gradients()
    refused = ""
    try:
        allreduce_gradients(model.parameters())
    except ValueError as e:
        refused = str(e)
    norm = par.clip_grad_norm_(0.5)
    clipped_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
    sd = get_model_state_dict(model)
    # numpy: tensors do not survive the trip through the result queue
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    return {
        "out_dtype": out.dtype, "loss_dtype": loss.dtype, "out": out.detach().float().numpy(), "loss": loss.item(),
        "block_inputs": seen, "attn_dtypes": attn_dtypes,
        "param_types": {(type(p).__name__, p.dtype) for p in model.parameters()},
        "grad_types": {(type(p.grad).__name__, p.grad.dtype) for p in model.parameters()},
        "finite": all(bool(np.isfinite(g).all()) for g in grads.values()),
        "norm": float(norm), "clipped_norm": float(clipped_norm),
        "grads": grads if rank == 0 else None, "names": names, "sd_names": list(sd),
        "sd_sharded": all(isinstance(v, DTensor) for v in sd.values()), "refused": refused,
    }


@pytest.mark.dist
def test_bf16_params_under_fsdp_train_close_to_fp32_with_clipping():
    from test_precision import GRAD_RTOL, LOSS_RTOL, OUT_RTOL

    res = run_distributed(_bf16_fsdp_worker, 2)
    cfg = parity_config()
    batches = mix_batches("g1b2i256f1s0,g1b3i128f1s0", cfg, scale=4, seed=5, world_size=2, max_text_tokens=24)
    ref = _model()
    total = sum(b.x_img.shape[0] for b in batches)
    ref_outs, ref_loss = [], 0.0
    for b in batches:
        out = ref(b)
        loss = flow_loss(out, b.targets, total)
        loss.backward()
        ref_outs.append(out.detach())
        ref_loss += loss.item()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values())).item()

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for r in res:
        assert r["out_dtype"] == torch.bfloat16 and r["loss_dtype"] == torch.float32
        # Gathered in bf16 for compute; RoPE tables stay fp32 (FSDP casts only embedder inputs),
        # and so does the per-sequence conditioning vector (its gradient sums over every block).
        assert r["block_inputs"] == {"h": torch.bfloat16, "vec": torch.float32, "rope": torch.float32}
        assert r["attn_dtypes"] == {(torch.bfloat16,) * 3}
        # Sharded parameters, their gradients and so the optimizer stay fp32.
        assert r["param_types"] == {("DTensor", torch.float32)}
        assert r["grad_types"] == {("DTensor", torch.float32)}
        assert r["finite"]
        assert "sharded DTensors" in r["refused"]
        assert r["norm"] == pytest.approx(res[0]["norm"], rel=0)  # one global norm on every rank
        assert r["clipped_norm"] == pytest.approx(0.5, rel=1e-4)
        assert r["sd_names"] == r["names"] and r["sd_sharded"]
    for r, ref_out in zip(res, ref_outs):
        assert rel(torch.from_numpy(r["out"]), ref_out) < OUT_RTOL
    assert abs(sum(r["loss"] for r in res) - ref_loss) < LOSS_RTOL * ref_loss
    assert res[0]["norm"] == pytest.approx(ref_norm, rel=GRAD_RTOL)
    # Clipped by 0.5 / norm: undo it to compare with the unclipped reference.
    grads = torch.cat([torch.from_numpy(res[0]["grads"][n]).flatten() for n in ref_grads]) * (res[0]["norm"] / 0.5)
    assert rel(grads, torch.cat([g.flatten() for g in ref_grads.values()])) < GRAD_RTOL


def _grad_norm_worker(rank: int, world: int) -> dict:
    """Gradients of every kind a step may hold, built the same on every rank, their norm and
    clip on local tensors (``clip_grad_norm_``) against the whole tensors' in float64."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from knapray.worker.parallelize import clip_grad_norm_

    gen = torch.Generator().manual_seed(7)
    flat = init_device_mesh("cpu", (world,))
    hybrid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    whole = [torch.randn(10, 3, generator=gen), torch.randn(2, 5, generator=gen),  # uneven; ranks 2, 3 hold nothing
             torch.randn(7, generator=gen).to(torch.bfloat16), torch.randn(9, 4, generator=gen),
             torch.randn(3, 3, generator=gen), torch.randn(6, generator=gen)]
    partial_local = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + rank))
    grads = [distribute_tensor(whole[0], flat, [Shard(0)]), distribute_tensor(whole[1], flat, [Shard(0)]),
             distribute_tensor(whole[2], flat, [Shard(0)]),
             distribute_tensor(whole[3], hybrid, [Replicate(), Shard(0)]),  # HSDP
             DTensor.from_local(partial_local, flat, [Partial()]), whole[5].clone()]  # a replicated plain one
    full = [g.full_tensor() if isinstance(g, DTensor) else g.clone() for g in grads]
    expected = torch.cat([f.double().reshape(-1) for f in full]).norm().item()
    from types import SimpleNamespace

    params = [SimpleNamespace(grad=g) for g in grads]  # only .grad is read
    max_norm = expected / 4
    norm = clip_grad_norm_(params, max_norm)
    after = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    scale = [(a.double().norm() / f.double().norm()).item() for a, f in zip(after, full)]
    return {"norm": norm.item(), "expected": expected, "scale": scale, "max_norm": max_norm,
            "empty": [int(g.to_local().numel() == 0) for g in grads[:3]]}


@pytest.mark.dist
def test_the_gradient_norm_on_local_shards_is_the_whole_tensors_norm():
    """FSDP's uneven shards (ranks with none), HSDP's replicated shards (counted once), a
    bf16 gradient, a Partial DTensor and a replicated plain gradient: the norm taken on
    local tensors is the norm of the whole tensors on every rank, and the clip scales each
    by max_norm / norm."""
    res = run_distributed(_grad_norm_worker, 4)
    assert any(r["empty"][1] for r in res)  # a rank that holds no shard joins the reduction
    for r in res:
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-5)
        assert r["norm"] == pytest.approx(res[0]["norm"], rel=1e-7)
        # bf16 rounds the scaled gradient: 2^-8 relative
        assert r["scale"] == pytest.approx([r["max_norm"] / r["expected"]] * len(r["scale"]), rel=4e-3)
