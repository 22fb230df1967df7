"""``knapray dryrun --sample``: the sampling memory model (``knapray.planning.inference.sampling_memory``,
tests/unit/test_sampling_memory.py) measured on fake tensors.

- the three placements of issue 41: FLUX.1-dev at 1024x1024 on 1 GPU and on 4 (one bag of 4),
  Wan 2.1 T2V 14B at 480p, 81 frames, classifier-free guidance, on 8 (one bag of 8, CFG
  parallel; and a run of two such experts, both resident): every phase within 10% of the
  prediction, every pretrained model's weights exactly as counted, on GPUs of 80 GiB;
- a gang that cannot fit (Wan 14B on 24 GiB) is refused in one line, naming what would
  (the line the docs show);
- bad flags are one line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from knapray.planning.costs.memory import GIB
from test_dryrun import dryrun  # noqa: F401 - the fixture: knapray dryrun in this process

REPO = Path(__file__).resolve().parents[2]
FLUX = str(REPO / "jobs" / "configs" / "flux_dev_finetune.yaml")
WAN = str(REPO / "jobs" / "configs" / "wan_t2v_14b.yaml")
WAN_480P = ("--size", "832x480", "--frames", "21", "--guidance", "5")
QWEN = str(REPO / "jobs" / "configs" / "qwen_image_lora.yaml")
FLUX2 = str(REPO / "jobs" / "configs" / "flux2_dev_lora.yaml")
NO_BASE = ("--set", 'model.pretrained=""', "--size", "1024x1024")
"""The LoRA configs name a base folder for the user to set: the dry run builds the model from its widths."""


# ---- the three placements, measured --------------------------------------------------------


@pytest.mark.parametrize("config, world, topology, extra", [
    (FLUX, "1", "g1n1", ()),
    (FLUX, "4", "g4n1", ("--encoders", "keep")),
    (WAN, "8", "g8n1", WAN_480P),
    (QWEN, "8", "g8n1", NO_BASE),  # Qwen2.5-VL 7B encodes; guidance 4 in CFG parallel halves
    (FLUX2, "8", "g8n1", NO_BASE),  # Mistral Small 3.1 (24B) encodes at 512 tokens, 3 layers kept
    (WAN, "8", "g8n1", (*WAN_480P, "--set", "flow.expert_boundary=0.875")),  # two 14B experts resident
], ids=["flux-dev-1gpu", "flux-dev-4gpu-keep", "wan14b-480p-81f-cfg-8gpu", "qwen-image-lora-8gpu",
        "flux2-dev-lora-8gpu", "wan22-two-experts-480p-81f-cfg-8gpu"])
def test_placements_within_10_percent(dryrun, config, world, topology, extra):
    out = dryrun("--sample", "--config", config, "--world-size", world, "--topology", topology, "--json", *extra)
    assert out.stdout.strip(), out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and r["passed"], out.stdout[-4000:]
    assert [p["phase"] for p in r["phases"]] == ["encode", "denoise", "decode"]  # rank 0: encodes, leads a bag
    for p in r["phases"]:
        assert abs(p["error"]) <= 0.10, p
        predicted = p["predicted"]
        weights = (predicted["transformer"] + predicted["encoders"] + predicted["vae"]) * GIB
        # exact counts (the language models' rotary tables, under 1 KiB of buffers, are not counted)
        slack = 1024 if config in (QWEN, FLUX2) and p["phase"] == "encode" else 1
        assert p["measured"]["Parameter"] + p["measured"]["Buffer"] == pytest.approx(weights, abs=slack)
    assert r["fits"] and r["syncs"] == [] and "DRY RUN PASSED" in out.stdout
    if config in (QWEN, FLUX2):  # the language model's weights on rank 0 while it encodes
        encoders = r["phases"][0]["predicted"]["encoders"]
        assert encoders == pytest.approx({QWEN: 8.29e9, FLUX2: 24.01e9}[config] * 2 / GIB, rel=1e-3)
        assert r["passes"] == (2 if config == QWEN else 1)
    if config == WAN:  # CFG parallel: rank 0 runs the conditional pass on the first half of its bag
        assert r["passes"] == 2 and r["role"]["routed_tokens"] == (32760 + 512) // 4
        assert r["role"]["home_tokens"] == 2 * (32760 + 512)
        experts = 2 if "flow.expert_boundary=0.875" in extra else 1
        denoise = r["phases"][1]["predicted"]["transformer"] * GIB
        # bf16, the final layer (its 5120 x 64 projection, bias and shift/scale table) in fp32
        assert denoise == pytest.approx(experts * (14_288_491_584 * 2 + (5120 * 64 + 64 + 2 * 5120) * 2), rel=1e-12)


def test_what_does_not_fit_is_refused_in_one_line(dryrun):
    out = dryrun("--sample", "--config", WAN, "--world-size", "8", "--topology", "g8n1", "--gpu-gib", "24", *WAN_480P)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and out.stdout == "", out.stderr
    line = lines[0]
    assert line.startswith("knapray dryrun: error: does not fit: rank 0 needs 38.76 GiB at its peak (denoise")
    assert "18.90 GiB are usable on 24 GiB GPUs" in line
    assert "--shard bags (the transformer sharded over each bag" in line and "GPUs of 46.1 GiB as placed" in line
    for doc in ("cli.md", "gpu.md"):  # the line the docs show is the command's
        assert line in (REPO / "docs" / doc).read_text(), doc


@pytest.mark.parametrize("args, message", [
    (["--config", FLUX, "--size", "1000x1000"], "--size 1000x1000: with a VAE downsample of 8"),
    (["--config", FLUX, "--frames", "5"], "--frames 5: Flux.1 samples images"),
    (["--config", FLUX, "--world-size", "16", "--topology", "g16n1"], "--topology g16n1: 24 attention heads"),
    (["--config", FLUX, "--world-size", "4", "--topology", "auto"], "--topology auto: the gang chooses bags"),
    (["--config", FLUX, "--world-size", "4", "--rank", "4"], "--rank must be in [0, 4)"),
    (["--config", FLUX, "--encoders", "sometimes"], "argument --encoders: invalid choice"),
    (["--config", FLUX, "--guidance", "-1"], "argument --guidance: expected a finite number >= 0"),
    (["--config", FLUX, "--mix", "image+video"], "--mix: the training dry run's"),
    (["--config", FLUX, "--size", "4112x4112"], "66049 image tokens; at most 65536 a request"),
])
def test_bad_sample_flags_are_one_line_and_exit_2(dryrun, args, message):
    out = dryrun("--sample", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("knapray dryrun: error:") and message in lines[0], lines[0]


def test_sample_flags_need_sample(dryrun):
    out = dryrun("--config", FLUX, "--size", "512x512", "--encoders", "keep")
    assert out.returncode == 2 and out.stderr.strip() == (
        "knapray dryrun: error: --size, --encoders: --sample's (a sampling gang's dry run); a training step's batch "
        "comes from --mix")
