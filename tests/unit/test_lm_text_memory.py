"""The sampling memory model's language-model text encoders (Qwen-Image's Qwen2.5-VL, FLUX.2's
Mistral Small 3.1, each with its vision tower, as their pipelines load them): the parameters
transformers builds from the families' declared configs, on the meta device; and their
outputs as the pipelines take them (FLUX.2: three layers' hidden states per token)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (the test extra)")

from knapray.models.families import get_family  # noqa: E402
from knapray.planning.inference.sampling_memory import ArchSpec, TextEncoderShape  # noqa: E402

TINY = {
    "Qwen2_5_VLForConditionalGeneration": {
        "text_config.vocab_size": 300, "text_config.hidden_size": 32, "text_config.intermediate_size": 48,
        "text_config.num_hidden_layers": 2, "text_config.num_attention_heads": 4, "text_config.num_key_value_heads": 2,
        "vision_config.depth": 2, "vision_config.hidden_size": 16, "vision_config.intermediate_size": 24,
        "vision_config.patch_size": 4, "vision_config.temporal_patch_size": 2, "vision_config.spatial_merge_size": 2,
        "vision_config.out_hidden_size": 32, "tie_word_embeddings": False},
    "Mistral3ForConditionalGeneration": {
        "text_config.vocab_size": 300, "text_config.hidden_size": 32, "text_config.intermediate_size": 48,
        "text_config.num_hidden_layers": 3, "text_config.num_attention_heads": 4, "text_config.num_key_value_heads": 2,
        "text_config.head_dim": 16, "vision_config.num_hidden_layers": 2, "vision_config.hidden_size": 16,
        "vision_config.intermediate_size": 24, "vision_config.patch_size": 4, "spatial_merge_size": 2,
        "multimodal_projector_bias": True, "tie_word_embeddings": True, "layers_out": 3},
}


def _built(spec: ArchSpec) -> int:
    """Parameters of the transformers model of ``spec``'s config, built on the meta device."""
    import transformers

    kw: dict = {"text_config": {}, "vision_config": {}}
    for key, value in spec.values.items():
        if key == "layers_out":
            continue
        head, _, tail = key.partition(".")
        (kw[head].__setitem__(tail, value) if tail else kw.__setitem__(key, value))
    kw["text_config"]["tie_word_embeddings"] = kw["tie_word_embeddings"]
    if spec.cls.startswith("Mistral3"):
        kw["text_config"]["model_type"], kw["vision_config"]["model_type"] = "mistral", "pixtral"
        config = transformers.Mistral3Config(**kw)
    else:
        config = transformers.Qwen2_5_VLConfig(**kw)
    with torch.device("meta"):
        model = getattr(transformers, spec.cls)(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cls", list(TINY))
def test_tiny_configs_count_as_transformers_builds_them(cls):
    spec = ArchSpec.of(cls, TINY[cls], tokens=16)
    assert TextEncoderShape.of(spec).num_params == _built(spec)


@pytest.mark.parametrize("family, billions", [("qwen_image", 8.29), ("flux2", 24.01)])
def test_the_families_text_encoders_at_full_size(family, billions):
    """Qwen2.5-VL 7B (8.29 B with its vision tower) and Mistral Small 3.1 (24.01 B), as the
    families declare them; their outputs as the pipelines take them."""
    spec = get_family(family).encoders.text_models[0]
    shape = TextEncoderShape.of(spec)
    assert shape.num_params == _built(spec)
    assert shape.num_params / 1e9 == pytest.approx(billions, abs=0.01)
    width = {"qwen_image": 3584, "flux2": 3 * 5120}[family]  # the transformer's text_dim
    assert shape.output_bytes(1) == spec.tokens * width * 2
    assert shape.encode_bytes(2) > 2 * spec.tokens * (shape.layers + 1) * shape.width * 2  # every layer's states kept
