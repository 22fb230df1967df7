"""Packed MMDiT / DiT: layers, packing, and the per-token contract the distributed executor relies on."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from knapray.attention import LocalAttention, varlen_attention
from knapray.models import (
    MMDiT,
    MMDiTConfig,
    PackedBatch,
    add_noise,
    dit_config,
    flow_inputs,
    flow_loss,
    pack_samples,
    patchify,
    sample_timesteps,
    unpatchify,
)
from knapray.models.layers import apply_rope, rope_frequencies

SMALL = dict(hidden_size=32, num_heads=2, in_channels=2, text_dim=8, pooled_dim=8, mlp_ratio=2.0)
# (text tokens, T, H, W) per sample; the third has no text tokens.
SPECS = [(3, 1, 4, 6), (5, 2, 2, 4), (0, 1, 2, 2)]


def _cfg(**kw) -> MMDiTConfig:
    return MMDiTConfig(**{**SMALL, **kw})


def _model(cfg: MMDiTConfig, seed: int = 0) -> MMDiT:
    torch.manual_seed(seed)
    model = MMDiT(cfg)
    model.init_weights(std=0.1)
    return model


def _samples(cfg: MMDiTConfig, specs: list[tuple[int, int, int, int]], seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (lt, t, h, w) in enumerate(specs):
        sample = {
            "latent": torch.randn(cfg.in_channels, t, h, w, generator=gen),
            "timestep": (i + 1) / (len(specs) + 1),
        }
        if cfg.text_dim:
            sample["text"] = torch.randn(lt, cfg.text_dim, generator=gen)
        if cfg.pooled_dim:
            sample["pooled"] = torch.randn(cfg.pooled_dim, generator=gen)
        out.append(sample)
    return out


class CountingAttention:
    """Wraps an attn callable and counts calls (each must come once per block)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, q, k, v):
        self.calls += 1
        return self.inner(q, k, v)


def _per_token_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Stand-in that mixes q, k, v per token only, so any token subset is self-contained.
    return q * torch.sigmoid(k) + v


# --- config -------------------------------------------------------------------------------


def test_config_patch_dim_and_dit() -> None:
    assert MMDiTConfig().patch_dim == 4 * 1 * 2 * 2
    cfg = dit_config(hidden_size=32, num_heads=2)
    assert (cfg.depth_double, cfg.text_dim) == (0, 0) and cfg.depth_single > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rope_axes_dim=(4, 6, 4)), "sums to 14"),
        (dict(rope_axes_dim=(3, 7, 6)), "even"),
        (dict(num_heads=3), "divisible"),
        (dict(patch_size=(1, 0, 2)), "patch_size"),
        (dict(depth_double=0, depth_single=0), "at least one block"),
        (dict(mlp_ratio=0.0), "mlp_ratio"),
    ],
)
def test_config_rejects_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MMDiTConfig(**kw)


def test_config_from_dict_rejects_unknown_keys() -> None:
    assert MMDiTConfig.from_dict({"patch_size": [1, 2, 2]}).patch_size == (1, 2, 2)
    with pytest.raises(ValueError, match=r"hiden_size.*hidden_size"):
        MMDiTConfig.from_dict({"hiden_size": 8})


# --- RoPE ---------------------------------------------------------------------------------


def test_rope_depends_only_on_position_difference() -> None:
    axes, heads = (4, 6, 6), 2
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, heads, sum(axes), generator=gen)

    def score(pq: list[int], pk: list[int]) -> torch.Tensor:
        cq, sq = rope_frequencies(torch.tensor([pq]), axes, 10000.0)
        ck, sk = rope_frequencies(torch.tensor([pk]), axes, 10000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum(-1)  # (1, H)

    base = score([1, 2, 3], [4, 0, 7])
    shifted = score([1 + 5, 2 + 11, 3 + 2], [4 + 5, 0 + 11, 7 + 2])
    torch.testing.assert_close(base, shifted, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base, score([1, 2, 3], [4, 1, 7]), atol=1e-3)


def test_rope_angles_exact_for_integer_positions() -> None:
    axes, theta = (4, 6, 6), 10000.0
    pos = torch.tensor([[0, 0, 0], [3, 1000, 7]])
    cos, sin = rope_frequencies(pos, axes, theta)
    expected = []
    for axis, dim in enumerate(axes):
        expected += [pos[1, axis].item() * theta ** (-i / dim) for i in range(0, dim, 2)]
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(cos[1].double(), expected.cos(), rtol=0, atol=2e-4)
    torch.testing.assert_close(sin[1].double(), expected.sin(), rtol=0, atol=2e-4)
    x = torch.randn(2, 2, sum(axes))
    torch.testing.assert_close(apply_rope(x, cos, sin)[0], x[0], rtol=0, atol=0)  # position 0: identity
    with pytest.raises(ValueError, match="integer"):
        rope_frequencies(pos.float(), axes, theta)


# --- patchify / packing -------------------------------------------------------------------


@pytest.mark.parametrize("patch", [(1, 2, 2), (2, 1, 3)])
def test_patchify_round_trip(patch: tuple[int, int, int]) -> None:
    latent = torch.randn(3, 2, 4, 6)
    tokens, pos = patchify(latent, patch)
    pt, ph, pw = patch
    grid = (2 // pt, 4 // ph, 6 // pw)
    assert tokens.shape == (math.prod(grid), 3 * pt * ph * pw) and pos.dtype == torch.int64
    torch.testing.assert_close(tokens[0], latent[:, :pt, :ph, :pw].reshape(-1))
    assert pos[-1].tolist() == [g - 1 for g in grid]
    torch.testing.assert_close(unpatchify(tokens, grid, patch, 3), latent, rtol=0, atol=0)
    perm = torch.randperm(tokens.shape[0])
    torch.testing.assert_close(unpatchify(tokens[perm], pos[perm], patch, 3), latent, rtol=0, atol=0)


def test_patchify_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(1, 5, 4\)"):
        patchify(torch.randn(2, 1, 5, 4), (1, 2, 2))
    with pytest.raises(ValueError, match="C, T, H, W"):
        patchify(torch.randn(2, 4, 4), (1, 2, 2))
    with pytest.raises(ValueError, match="grid"):
        unpatchify(torch.randn(6, 8), (1, 2, 2), (1, 2, 2), 2)


def test_pack_samples_layout() -> None:
    cfg = _cfg()
    batch = pack_samples(_samples(cfg, SPECS), cfg)
    lens = [lt + t * (h // 2) * (w // 2) for lt, t, h, w in SPECS]
    assert batch.seq_lens.tolist() == lens and batch.max_seqlen == max(lens)
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 9, 18, 19]
    assert batch.is_text[:4].tolist() == [True, True, True, False]
    assert batch.is_text.sum().item() == batch.x_txt.shape[0] == 8
    assert (batch.pos[batch.is_text] == 0).all()
    assert batch.seq_index.tolist() == [0] * 9 + [1] * 9 + [2]
    assert batch.grids == ((1, 2, 3), (2, 1, 2), (1, 1, 1))

    empty = pack_samples([], cfg)
    assert empty.num_sequences == 0 and empty.x_img.shape == (0, cfg.patch_dim)
    with pytest.raises(ValueError, match="sample 0: latent"):
        pack_samples([{"latent": torch.randn(3, 1, 2, 2), "timestep": 0.5}], cfg)


# --- MMDiT ------------------------------------------------------------------------------------


def test_packed_forward_equals_each_sequence_alone() -> None:
    cfg = _cfg()
    model = _model(cfg)
    samples = _samples(cfg, SPECS)
    packed = model(pack_samples(samples, cfg))
    alone = torch.cat([model(pack_samples([s], cfg)) for s in samples])
    assert packed.shape == (sum(t * (h // 2) * (w // 2) for _, t, h, w in SPECS), cfg.patch_dim)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_attn_called_once_per_block_even_with_no_tokens() -> None:
    cfg = _cfg(depth_double=2, depth_single=3)
    model = _model(cfg)
    batch = pack_samples(_samples(cfg, SPECS), cfg)
    counter = CountingAttention(LocalAttention(batch.cu_seqlens, batch.max_seqlen))
    model(batch, attn=counter)
    assert counter.calls == 5

    counter = CountingAttention(LocalAttention(torch.zeros(1, dtype=torch.int32), 0))
    empty = pack_samples([], cfg)
    vec = model.condition(empty.timesteps, empty.pooled)
    h = model.embed(empty.x_txt, empty.x_img, empty.is_text)
    out = model.head(model.blocks(h, vec, empty.seq_index, empty.pos, empty.is_text, counter), vec,
                     empty.seq_index, empty.is_text)
    assert counter.calls == 5 and out.shape == (0, cfg.patch_dim)
    assert out.requires_grad  # stays in the graph so backward collectives run on empty ranks


def test_every_parameter_gets_nonzero_gradient() -> None:
    cfg = _cfg()
    model = _model(cfg)
    batch = pack_samples(_samples(cfg, SPECS), cfg)
    batch = add_noise(batch, torch.randn(batch.x_img.shape))
    flow_loss(model(batch), batch.targets, batch.x_img.shape[0]).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert dead == []


def test_default_init_is_adaln_zero() -> None:
    cfg = _cfg()
    torch.manual_seed(0)
    model = MMDiT(cfg)
    out = model(pack_samples(_samples(cfg, SPECS[:1]), cfg))
    assert out.abs().max().item() == 0.0  # zero output layer, as in DiT/Flux
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), MMDiT(cfg).parameters()))


@pytest.mark.parametrize("only", ["text", "image"])
def test_double_block_with_one_empty_stream(only: str) -> None:
    cfg = _cfg(depth_single=0)
    model = _model(cfg)
    n = 6
    h = torch.randn(n, cfg.hidden_size)
    is_text = torch.full((n,), only == "text")
    out = model.blocks(h, torch.randn(1, cfg.hidden_size), torch.zeros(n, dtype=torch.long),
                       torch.randint(0, 4, (n, 3)), is_text, LocalAttention(torch.tensor([0, n]), n))
    out.square().sum().backward()
    unused = model.double_blocks[0].img if only == "text" else model.double_blocks[0].txt
    used = model.double_blocks[0].txt if only == "text" else model.double_blocks[0].img
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in unused.parameters())
    assert all(p.grad.abs().sum() > 0 for p in used.parameters())


def test_blocks_on_permuted_token_subset_equal_slice() -> None:
    cfg = _cfg()
    model = _model(cfg)
    batch = pack_samples(_samples(cfg, SPECS), cfg)
    vec = model.condition(batch.timesteps, batch.pooled)
    h = model.embed(batch.x_txt, batch.x_img, batch.is_text)
    full = model.blocks(h, vec, batch.seq_index, batch.pos, batch.is_text, _per_token_attn)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(h.shape[0], generator=gen)[:7]
    seqs = torch.unique(batch.seq_index[ids])
    seqs = seqs[torch.randperm(seqs.numel(), generator=gen)]  # local sequence rows in any order
    remap = torch.full((batch.num_sequences,), -1, dtype=torch.long)
    remap[seqs] = torch.arange(seqs.numel())
    sub = model.blocks(h[ids], vec[seqs], remap[batch.seq_index[ids]], batch.pos[ids], batch.is_text[ids],
                       _per_token_attn)
    torch.testing.assert_close(sub, full[ids], rtol=1e-5, atol=1e-5)


def _rank_inputs(batch: PackedBatch, ids: torch.Tensor, seqs_order: torch.Tensor) -> dict:
    """What a rank holds after routing: token rows ``ids`` and the sequences they touch."""
    txt_row = torch.cumsum(batch.is_text.long(), 0) - 1
    img_row = torch.cumsum((~batch.is_text).long(), 0) - 1
    is_text = batch.is_text[ids]
    seqs = seqs_order[torch.isin(seqs_order, batch.seq_index[ids])]
    remap = torch.full((batch.num_sequences,), -1, dtype=torch.long)
    remap[seqs] = torch.arange(seqs.numel())
    return dict(
        ids=ids, seqs=seqs, seq_index=remap[batch.seq_index[ids]], is_text=is_text, pos=batch.pos[ids],
        x_txt=batch.x_txt[txt_row[ids[is_text]]], x_img=batch.x_img[img_row[ids[~is_text]]],
        img_rows=img_row[ids[~is_text]],
    )


def _run_fake_ranks(model: MMDiT, batch: PackedBatch, chunks: list[torch.Tensor]) -> list[dict]:
    """Run the stages on each chunk in its own thread; attention exchanges through shared memory
    the way a Ulysses all-to-all would: every rank's q, k, v are assembled, attended, split back."""
    world = len(chunks)
    barrier = threading.Barrier(world, timeout=60)
    slots: list = [None] * world
    shared: dict = {}
    results: list[dict] = [{} for _ in range(world)]
    errors: list[BaseException] = []

    def attn_for(rank: int, ids: torch.Tensor):
        def attn(q, k, v):
            slots[rank] = (ids, q, k, v)
            barrier.wait()
            if rank == 0:
                all_ids = torch.cat([s[0] for s in slots])
                full = [q.new_zeros(batch.is_text.shape[0], *q.shape[1:]).index_copy(
                    0, all_ids, torch.cat([s[j] for s in slots])) for j in (1, 2, 3)]
                shared["out"] = varlen_attention(*full, batch.cu_seqlens, batch.max_seqlen, backend="sdpa")
            barrier.wait()
            return shared["out"][ids]
        return attn

    seqs_order = torch.randperm(batch.num_sequences, generator=torch.Generator().manual_seed(3))

    def work(rank: int) -> None:
        try:
            r = _rank_inputs(batch, chunks[rank], seqs_order)
            vec = model.condition(batch.timesteps[r["seqs"]], batch.pooled[r["seqs"]])
            h = model.embed(r["x_txt"], r["x_img"], r["is_text"])
            h = model.blocks(h, vec, r["seq_index"], r["pos"], r["is_text"], attn_for(rank, r["ids"]))
            results[rank] = dict(out=model.head(h, vec, r["seq_index"], r["is_text"]), img_rows=r["img_rows"])
        except BaseException as exc:  # surface worker failures instead of hanging the others
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_chunks_on_fake_ranks_match_single_process_forward_and_backward() -> None:
    cfg = _cfg()
    model = _model(cfg)
    batch = pack_samples(_samples(cfg, SPECS), cfg)
    n = batch.is_text.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    chunks = [perm[:8], perm[8:8], perm[8:]]  # the middle rank holds no tokens

    weight = torch.randn(batch.x_img.shape)
    params = list(model.parameters())
    ref = model(batch)
    ref_grads = torch.autograd.grad((ref * weight).sum(), params)

    results = _run_fake_ranks(model, batch, chunks)
    assert results[1]["out"].shape == (0, cfg.patch_dim)
    for r in results:
        torch.testing.assert_close(r["out"], ref[r["img_rows"]], rtol=1e-5, atol=1e-5)
    loss = sum((r["out"] * weight[r["img_rows"]]).sum() for r in results)
    for grad, ref_grad in zip(torch.autograd.grad(loss, params), ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)


def test_dit_forward_backward() -> None:
    cfg = dit_config(hidden_size=32, num_heads=2, in_channels=2, pooled_dim=8, depth_single=2)
    model = _model(cfg)
    batch = pack_samples(_samples(cfg, [(0, 1, 4, 4), (0, 2, 2, 2)]), cfg)
    assert not batch.is_text.any()
    batch = add_noise(batch, torch.randn(batch.x_img.shape))
    out = model(batch)
    assert out.shape == batch.x_img.shape
    flow_loss(out, batch.targets, out.shape[0]).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(ValueError, match="text_dim=0"):
        model.embed(torch.randn(2, 0), batch.x_img, torch.cat((torch.ones(2, dtype=torch.bool), batch.is_text)))


# --- flow matching ----------------------------------------------------------------------------


def test_flow_inputs_and_add_noise() -> None:
    x0, noise = torch.randn(4, 3), torch.randn(4, 3)
    t = torch.tensor([0.0, 1.0, 0.5, 0.25])
    x_t, target = flow_inputs(x0, noise, t)
    torch.testing.assert_close(x_t[0], x0[0])
    torch.testing.assert_close(x_t[1], noise[1])
    torch.testing.assert_close(x_t[3], 0.75 * x0[3] + 0.25 * noise[3])
    torch.testing.assert_close(target, noise - x0)

    cfg = _cfg()
    batch = pack_samples(_samples(cfg, SPECS), cfg)
    noised = add_noise(batch, torch.zeros(batch.x_img.shape))
    t_img = batch.timesteps[batch.image_seq_index][:, None]
    torch.testing.assert_close(noised.x_img, (1 - t_img) * batch.x_img)
    torch.testing.assert_close(noised.targets, -batch.x_img)


def test_flow_loss_sums_across_ranks_to_global_mean() -> None:
    pred, target = torch.randn(10, 8), torch.randn(10, 8)
    full = flow_loss(pred, target, 10)
    torch.testing.assert_close(full, torch.nn.functional.mse_loss(pred, target))
    parts = flow_loss(pred[:3], target[:3], 10) + flow_loss(pred[3:3], target[3:3], 10) + flow_loss(
        pred[3:], target[3:], 10)
    torch.testing.assert_close(parts, full)
    with pytest.raises(ValueError, match="global_token_count"):
        flow_loss(pred, target, 0)


def test_sample_timesteps_seeded_and_in_range() -> None:
    for kind in ("logit_normal", "uniform"):
        a = sample_timesteps(500, generator=torch.Generator().manual_seed(5), kind=kind)
        b = sample_timesteps(500, generator=torch.Generator().manual_seed(5), kind=kind)
        assert torch.equal(a, b) and a.shape == (500,)
        assert a.min() > 0 and a.max() < 1 and abs(a.mean().item() - 0.5) < 0.05
    with pytest.raises(ValueError, match="'beta'.*uniform"):
        sample_timesteps(3, generator=torch.Generator(), kind="beta")


def test_token_streams_are_index_copies_that_split_and_merge_back() -> None:
    from knapray.models.blocks import TokenStreams

    is_text = torch.tensor([True, False, False, True, False, True])
    streams = TokenStreams.from_mask(is_text)
    assert streams.txt_idx.tolist() == [0, 3, 5] and streams.img_idx.tolist() == [1, 2, 4]
    # Not views: compiled blocks guard on an input's _base, so every step must pass the same kind.
    assert all(t._base is None for t in (streams.txt_idx, streams.img_idx, streams.unorder))
    x = torch.arange(12.0).view(6, 2)
    txt, img = streams.split(x)
    assert torch.equal(txt, x[is_text]) and torch.equal(streams.merge(txt, img), x)


def test_step_record_throughput_over_wall_time_and_over_forward_backward() -> None:
    from knapray.models.flops import peak_tflops
    from knapray.worker.metrics import StepRecord

    rec = StepRecord(step=0, loss=1.0, loss_rel=1.0, tokens=10, seconds=2.0, imbalance=1.0, baseline_imbalance=1.0,
                     compute_s=[1.0, 0.5], comm_s=[0.25, 0.0], wait_plan_s=0.0, planned_by="local",
                     rank_work=[1.0, 1.0], baseline_rank_work=[1.0, 1.0], flops=4e12, peak_tflops=2.0).to_json()
    assert rec["model_tflops_per_gpu"] == pytest.approx(4 / 2.0 / 2)  # over the step's wall time
    assert rec["model_tflops_fwd_bwd_per_gpu"] == pytest.approx(4 / 1.25 / 2)  # over the slowest forward+backward
    assert rec["mfu"] == pytest.approx(0.5)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA GH200 480GB") == 989.0 and peak_tflops("Some GPU") is None


def test_model_flops_count_flux2s_gated_mlps() -> None:
    """FLUX.2 [dev] (32B): SwiGLU MLPs of 3·d, three d x m matrices each, so (8 + 6·3)·L·d²
    per token and block, not Flux's (8 + 4·r); by hand and from the blocks' own matrices."""
    from knapray.models.families.flux2 import Flux2Config, Flux2Transformer
    from knapray.models.flops import attention_share, formula, model_flops

    cfg = Flux2Config()
    d, m, blocks = 6144, 3 * 6144, 8 + 48
    # q, k, v and output d x d each; the MLP's gate, value (d -> m) and output (m -> d)
    per_token = 2 * (4 * d * d + 3 * d * m)
    assert per_token == 26 * d * d
    lens = [4096, 1536, 256]
    attn = 4.0 * sum(n * n for n in lens) * d
    assert model_flops(lens, cfg) == pytest.approx(3 * blocks * (per_token * sum(lens) + attn), rel=1e-12)
    assert model_flops(lens, cfg, passes=1) == pytest.approx(blocks * (per_token * sum(lens) + attn), rel=1e-12)
    assert attention_share(lens, cfg) == pytest.approx(attn / (per_token * sum(lens) + attn), rel=1e-12)
    assert "(26*L*d^2 + 4*L^2*d), d=6144" in formula(cfg) and "56 blocks" in formula(cfg)
    # the blocks' matrices: a token through one stream of a double-stream block, or a single one
    with torch.device("meta"):
        model = Flux2Transformer(cfg)

    def matmul_flops(module: torch.nn.Module) -> int:
        return sum(2 * lin.in_features * lin.out_features for lin in module.modules()
                   if isinstance(lin, torch.nn.Linear))

    assert matmul_flops(model.double_blocks[0].img) == matmul_flops(model.single_blocks[0]) == per_token
    # Flux's GELU MLP (ratio 4) is still (8 + 4·4)
    assert "(24*L*d^2" in formula(MMDiTConfig(mlp_ratio=4.0))
