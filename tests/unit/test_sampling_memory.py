"""Sampling's memory: the pure model (``knapray.planning.inference.sampling_memory``): the model's
categories add up, the encoders' policies and the ranks' roles place what the engine places,
the families' encoders counted exactly and their working memory as the module docstring
counts it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from knapray.planning import Topology
from knapray.planning.costs.memory import GIB
from knapray.planning.inference.sampling_memory import (
    ArchSpec,
    PhaseBytes,
    SampleJob,
    SamplingMemoryModel,
    TextEncoderShape,
    VAEShape,
    alternatives,
    bag_steps,
    rank_role,
)

REPO = Path(__file__).resolve().parents[2]
FLUX = str(REPO / "jobs" / "configs" / "flux_dev_finetune.yaml")


# ---- the pure model -------------------------------------------------------------------------


def _flux_model(**kw) -> SamplingMemoryModel:
    from knapray.driver.preflight import load_run_config
    from knapray.models.families import get_family

    cfg = load_run_config(FLUX, []).model
    enc = get_family("flux").encoders
    return SamplingMemoryModel.of(cfg, enc.text_models, enc.vae, **kw)


FLUX_JOB = SampleJob(latent=(1, 128, 128), image_tokens=4096, text_tokens=512)


def test_categories_add_up_and_policies_place_the_encoders():
    topo = Topology.parse("g2n1+g1n2", world_size=4)
    steps = bag_steps(topo, [FLUX_JOB])
    lead, member, idle = (rank_role(topo, r, [FLUX_JOB], steps=steps) for r in (0, 1, 2))
    assert (lead.encodes, lead.lead, lead.bag_size, lead.home) == (True, True, 2, 4608)
    assert (member.encodes, member.lead, member.routed, member.routed_text) == (False, False, 2304, 0)
    assert lead.routed == 2304 and lead.routed_text == 512
    assert idle.routed == 0 and not idle.lead
    by_policy = {p: _flux_model(encoders=p).breakdown(lead) for p in ("keep", "offload", "free")}
    t5_clip = _flux_model().encoder_bytes
    assert t5_clip == (4_762_310_656 + 123_060_480) * 2 + 77 * 8  # and CLIP's position ids
    for policy, br in by_policy.items():
        for phase in br.phases:
            assert phase.total == phase.transformer + phase.encoders + phase.vae + phase.latents + phase.working
        encode, denoise, decode = (br.phase(p) for p in ("encode", "denoise", "decode"))
        assert encode.encoders == t5_clip and encode.working > 0
        assert (encode.transformer == 0) == (policy == "free")
        assert denoise.encoders == decode.encoders == (t5_clip if policy == "keep" else 0)
        assert br.total == max(p.total for p in br.phases)
    assert by_policy["keep"].total > by_policy["offload"].total >= by_policy["free"].total
    m = _flux_model()
    assert [p.phase for p in m.breakdown(member).phases] == ["denoise"]  # no encoders, no VAE
    assert m.breakdown(idle).total == m.transformer_bytes()  # a bag without a job: the weights alone


def test_bag_sharding_and_alternatives():
    m = _flux_model(placement="bag-sharded")
    whole = replace(m, placement="replicated").transformer_bytes(4)
    assert m.transformer_bytes(1) == whole == 11_901_408_320 * 2 + 19_077_184 * 2  # the final layer fp32
    assert whole / 4 < m.transformer_bytes(4) < whole / 2  # a quarter plus the largest unit gathered
    topo = Topology.parse("g4n1", world_size=4)
    roles = [rank_role(topo, r, [FLUX_JOB]) for r in range(4)]
    fits = alternatives(replace(m, placement="replicated"), roles, 24 * GIB)
    assert [(a.placement, a.encoders) for a in fits] == [("bag-sharded", "keep"), ("bag-sharded", "offload"),
                                                         ("bag-sharded", "free")]
    assert all(a.rank == 0 for a in fits)
    replicated = replace(m, placement="replicated")
    need, peak = replicated.gpu_gib_needed(roles[0]), replicated.breakdown(roles[0]).total
    assert replicated.usable_bytes(int(need * GIB)) >= peak > replicated.usable_bytes(int((need - 0.1) * GIB))


def test_two_experts_hold_two_transformers_and_work_as_one():
    """A run of two experts (``flow.expert_boundary``): both transformers resident (whole, or
    each sharded with one unit gathered at a time), the working memory one model's."""
    one, two = _flux_model(), _flux_model(experts=2)
    assert two.transformer_bytes() == 2 * one.transformer_bytes()
    sharded_one, sharded_two = (replace(m, placement="bag-sharded") for m in (one, two))
    largest = sharded_one.transformer_bytes(4) - -(-one.transformer_bytes() // 4)
    assert sharded_two.transformer_bytes(4) == -(-2 * one.transformer_bytes() // 4) + largest
    topo = Topology.parse("g1n1", world_size=1)
    lead = rank_role(topo, 0, [FLUX_JOB])
    b1, b2 = one.breakdown(lead), two.breakdown(lead)
    for p1, p2 in zip(b1.phases, b2.phases):
        assert p2.working == p1.working and p2.transformer == (2 * p1.transformer if p1.transformer else 0)
    with pytest.raises(ValueError, match="experts"):
        _flux_model(experts=3)


def test_text_encoder_and_vae_working_memory():
    """The counts of the module docstring at the sizes measured on fake tensors."""
    from knapray.models.families import get_family

    t5, clip = (TextEncoderShape.of(s) for s in get_family("flux").encoders.text_models)
    assert t5.encode_bytes(1) == 126_099_456  # 120.25 MiB and the ids, as measured
    assert clip.tokens == 77 and clip.encode_bytes(2) == 2 * 8 * 2 * 77 + 2 * 77 * (3 * 3072 + 4 * 768) * 2
    kl = VAEShape.of(get_family("flux").encoders.vae)
    wan = VAEShape.of(get_family("wan").encoders.vae)
    assert (kl.downsample, kl.video, wan.downsample, wan.temporal_downsample, wan.frames(21)) == (8, False, 8, 4, 81)
    assert kl.decode_bytes(1, 128, 128) == 16 * 128 * 128 * 6 + 3 * 256 * 1024 * 1024 * 2
    # Wan 2.1's VAE at 480p: 7.6 GiB beside its input for 81 frames, 2.6 GiB for one (measured: 7.60, 2.57)
    assert 7.5 < wan.decode_bytes(21, 60, 104) / GIB < 7.7 and 2.5 < wan.decode_bytes(1, 60, 104) / GIB < 2.7


@pytest.mark.parametrize("family, cls", [("qwen_image", "AutoencoderKLQwenImage"), ("flux2", "AutoencoderKLFlux2")])
def test_the_newer_families_vaes_are_counted_as_diffusers_builds_them(family, cls):
    """Qwen-Image's VAE (Wan 2.1's network under its own name) and FLUX.2's (an AutoencoderKL
    of 32 channels; its patch statistics are buffers): the parameters diffusers' model of
    the family's declared config has, built on the meta device."""
    import diffusers
    import torch

    from knapray.models.families import get_family

    spec = get_family(family).encoders.vae
    with torch.device("meta"):
        model = getattr(diffusers, cls)(**spec.values)
    shape = VAEShape.of(spec)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.video == (family == "qwen_image") and shape.downsample == 8


def test_unmodelled_architectures_are_named():
    with pytest.raises(ValueError, match="text encoder GemmaModel: not modelled"):
        TextEncoderShape.of(ArchSpec.of("GemmaModel", {}))
    with pytest.raises(ValueError, match="only Wan 2.1's VAE"):
        VAEShape.of(ArchSpec.of("AutoencoderKLWan", {"is_residual": True, "attn_scales": [], "patch_size": 2}))
    with pytest.raises(ValueError, match="unknown encoders 'sometimes'"):
        _flux_model(encoders="sometimes")
    with pytest.raises(ValueError, match="passes must be 1 or 2"):
        SampleJob(latent=(1, 8, 8), image_tokens=16, text_tokens=0, passes=3)
    assert PhaseBytes("denoise", transformer=1, working=2).to_gib()["total"] == 3 / GIB
