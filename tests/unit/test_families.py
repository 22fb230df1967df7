"""The family protocol (knapray/models/families): every registered family declares every
fact, of the right type, and its model declares its FSDP units; a family added to the
registry is picked up by the callers that ask the family, without editing them."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping

import pytest
import torch

from knapray.corpus.stages import FamilyEncoding
from knapray.models import families as fams
from knapray.models.config import DiTConfig, MMDiTConfig
from knapray.models.families import FAMILIES, Family, build_model, get_family
from knapray.models.interface import FsdpUnits, StageModel
from knapray.models.mmdit import MMDiT
from knapray.models.packing import PackedBatch

ATTENTION_KINDS = ("joint", "cross")


def _small(fam: Family) -> DiTConfig:
    return fam.small_config(64) if fam.small_config is not None else fam.sized_config(64, 2, 1, 1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_declares_every_fact(name: str) -> None:
    fam = get_family(name)
    assert fam.name == name and isinstance(fam.title, str) and fam.title
    assert isinstance(fam.exact_against, str) and fam.exact_against
    # the config class: a DiTConfig whose own family is this one, with its attention kind
    assert issubclass(fam.config_cls, DiTConfig)
    assert fam.config_cls.__dataclass_fields__["family"].default == name
    assert fam.attention in ATTENTION_KINDS and fam.attention == fam.config_cls.attention_kind
    cfg = _small(fam)
    assert isinstance(cfg, fam.config_cls) and cfg.family == name
    assert isinstance(cfg.condition_dim, int) and cfg.condition_dim >= cfg.hidden_size
    # what it conditions on, samples with, and how its corpus is encoded
    fields = {f.name for f in dataclasses.fields(PackedBatch)}
    conditions = fam.condition_fields(cfg)
    assert isinstance(conditions, tuple) and conditions and set(conditions) <= fields
    shift = fam.sample_shift(cfg)
    assert shift is None or (isinstance(shift, float) and shift > 0)
    enc = fam.encoders
    assert isinstance(enc, FamilyEncoding) and (enc.family, enc.model) == (fam.name, fam.title)
    assert isinstance(enc.pooled, bool) and isinstance(enc.clean_prompts, bool) and isinstance(enc.pipeline, str)
    assert isinstance(enc.text_length, int) and enc.text_length >= 0
    assert isinstance(fam.video, bool) and isinstance(fam.zero_init, bool)
    # how calibration and the gradient check build it
    assert fam.calibrated_as in FAMILIES and get_family(fam.calibrated_as).sized_config is not None
    assert (fam.sized_config is None) != (fam.calibrate_as is None)
    if fam.sized_config is not None:
        assert isinstance(fam.sized_config(64, 2, 1, 1), fam.config_cls)
    # checkpoints and the reference implementation
    assert isinstance(fam.layouts, tuple) and isinstance(fam.lora_presets, Mapping)
    overrides = fam.reference_overrides({})
    assert isinstance(overrides, Mapping)
    assert set(overrides) <= {f.name for f in dataclasses.fields(fam.config_cls)}
    if fam.has_checkpoints:
        assert isinstance(fam.diffusers_class, str) and fam.layouts
        assert callable(fam.diffusers_call) and callable(fam.layout) and callable(fam.section_from_diffusers)
        assert callable(fam.to_diffusers)
    else:
        assert fam.diffusers_call is None and not fam.layouts


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_model_declares_its_fsdp_units(name: str) -> None:
    """Every parameter in exactly one unit (the root owns none); the blocks in execution
    order, as many as the config's; the family's re-initialization where it needs one."""
    fam = get_family(name)
    cfg = _small(fam)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert isinstance(model, fam.model_cls) and isinstance(model, StageModel)
    units = model.fsdp_units()
    assert isinstance(units, FsdpUnits)
    assert len(units.blocks) == cfg.depth_double + cfg.depth_single
    assert units.final is not None and units.embedders
    owners = [id(p) for unit in units for p in unit.parameters()]
    assert len(owners) == len(set(owners))
    assert set(owners) == {id(p) for p in model.parameters()}
    if fam.zero_init:
        model.init_weights(std=0.02)


def test_wan_no_longer_carries_an_empty_double_blocks() -> None:
    """Its state dict is what it was (an empty ModuleList held no key)."""
    wan = get_family("wan")
    with torch.device("meta"):
        model = build_model(wan.small_config(64))
    assert not hasattr(model, "double_blocks") and not hasattr(model, "vector_in")
    assert not any(k.startswith(("double_blocks", "vector_in")) for k in model.state_dict())


# ---- a new family, registered only ----------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class TinyConfig(MMDiTConfig):
    family: str = "tiny"


class TinyModel(MMDiT):
    pass


TINY = Family(
    name="tiny", title="Tiny", config_cls=TinyConfig, model_cls=TinyModel,
    condition_fields=lambda cfg: ("timesteps", "pooled"), exact_against="nothing",
    encoders=FamilyEncoding(family="tiny", model="Tiny", pooled=False, text_length=77, pipeline="TinyPipeline"),
    video=False, sample_shift=lambda cfg: 2.5, calibrate_as="mmdit",
)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(FAMILIES, "tiny", TINY)
    monkeypatch.setattr(fams, "FAMILY_NAMES", tuple(FAMILIES))
    return TINY


def test_a_new_family_is_picked_up_without_editing_callers(tiny, tmp_path) -> None:
    from knapray.commands.calibrate import calibration_config
    from knapray.commands.ingest import _family, _max_text_tokens
    from knapray.models.sampling import request_shifts
    from knapray.planning.costs.memory import ModelShape
    from knapray.config.run import load_config
    from knapray.worker.parallelize import parallelize

    # the run config's model section is the family's class
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  family: tiny\n  hidden_size: 32\n  num_heads: 2\n  rope_axes_dim: [6, 6, 4]\n")
    cfg = load_config(str(path)).model
    assert type(cfg) is TinyConfig
    # its model, parallelized through the units it declares
    model = build_model(cfg)
    assert type(model) is TinyModel
    parallelize(model)
    # sampling, memory planning, the corpus and calibration ask the family
    assert request_shifts(model, [(1, 4, 4), (1, 8, 8)], None) == [2.5, 2.5]
    assert ModelShape.of(cfg).cross_attention is False
    encoding = _family("tiny")
    assert encoding is tiny.encoders
    assert _max_text_tokens(argparse.Namespace(max_text_tokens=None), encoding) == 77
    with pytest.raises(ValueError, match=r"tiny's blocks are MMDiT's: calibrate it as mmdit"):
        calibration_config(32, 2, 1, 1, family="tiny")


def test_a_family_it_cannot_sample_is_refused_in_one_line(tiny, monkeypatch) -> None:
    """A family that declares why knapray cannot sample it (``Family.not_sampled``): a run
    config asking for validation samples, and sampling a run of it, are refused in one line
    naming the reason (no family declares one today: Qwen-Image and FLUX.2 sample as their
    pipelines do)."""
    from knapray.config.run import ConfigError, load_config
    from knapray.models.families import check_samples

    assert not any(f.not_sampled for f in FAMILIES.values() if f.name != "tiny")
    monkeypatch.setitem(FAMILIES, "tiny", dataclasses.replace(tiny, not_sampled="its schedule is not knapray's yet"))
    base = ["model.family=tiny", "model.hidden_size=32", "model.num_heads=2", "model.rope_axes_dim=[6,6,4]"]
    assert load_config(None, base).model.family == "tiny"
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "metrics.validation.every=5", "metrics.validation.captions=[a fox]"])
    assert ("validation samples of a Tiny model (model.family tiny): not supported yet; its schedule is not "
            "knapray's yet") in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^run r: sampling a Tiny model \(model.family tiny\): not supported yet"):
        check_samples(load_config(None, base).model, "run r: sampling")


def test_a_family_registration_must_hold_together() -> None:
    with pytest.raises(ValueError, match="its encoders name"):
        dataclasses.replace(TINY, name="other")
    with pytest.raises(ValueError, match="sized_config or calibrate_as"):
        dataclasses.replace(TINY, sized_config=lambda hidden, heads, depth_double, depth_single: None)
    with pytest.raises(ValueError, match="diffusers_call"):
        dataclasses.replace(TINY, diffusers_class="TinyTransformer")


def test_configs_know_their_own_family_only() -> None:
    """models/config.py imports no family: each config class checks its own name."""
    with pytest.raises(TypeError, match="base of the families' configs"):
        DiTConfig(family="mmdit")
    with pytest.raises(ValueError, match=r"family 'wan' is not MMDiTConfig's \('mmdit'\)"):
        MMDiTConfig(family="wan")
    assert math.isclose(TinyConfig(hidden_size=32, num_heads=2, rope_axes_dim=(6, 6, 4)).head_dim, 16)


def test_the_corpus_mirror_of_the_families_agrees() -> None:
    """corpus/schema keeps the family names and Wan's text length without importing the models."""
    from knapray.corpus.schema import FAMILIES as CORPUS_FAMILIES
    from knapray.corpus.schema import WAN_TEXT_LENGTH

    assert CORPUS_FAMILIES == tuple(FAMILIES)
    assert get_family("wan").encoders.text_length == WAN_TEXT_LENGTH
