"""The command blocks of README.md and docs/*.md run as written.

Every command in a fenced shell block (a line starting with knapray, python, torchrun,
make, ray, pip, ...; ``\\`` continues it) must match a rule of ``RULES``, which says what
this test does with it and why:

- ``run``: runs it, with the rule's substitutions (tiny models for ``/models/FLUX.1-dev``,
  matplotlib's sample pictures for ``~/pictures``, fewer steps) and extra arguments;
- ``check``: a training command, run with ``--check`` (every pre-flight check, no worker);
- ``error``: an example of an error: it must fail with one line and exit code 2;
- ``parse``: its arguments are parsed by the command's own parser (every flag exists, every
  value is valid), not run, for the reason the rule gives;
- ``skip``: not a knapray command we can run here, for the reason the rule gives.

A command no rule matches fails the test: a new README command needs a rule. The rules
match commands by content, not by file or heading, so they keep working when the README's
sections move into docs/.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = ("", "sh", "bash", "shell", "console")
COMMAND_WORDS = ("knapray", "make", "python", "python3", "torchrun", "ray", "pip", "export", "bash")


@dataclass(frozen=True)
class Command:
    where: str
    """file:line of its first line."""
    block: str
    """file:line of its block (the commands of a block run in order, in one directory)."""
    text: str
    """The command, continuation lines joined, a trailing comment dropped (shell-quoted)."""


def fenced_blocks(path: Path):
    """(language, first line number, lines) of every fenced block."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        yield m.group(1), i + 2, lines[i + 1 : j]
        i = j + 1


def _is_command(line: str) -> bool:
    words = line.split()
    while words and re.match(r"^[A-Z_]+=\S*$", words[0]):  # leading VAR=value assignments
        words = words[1:]
    # "knapray train: error: ..." is a command's output, not a command
    return bool(words) and words[0] in COMMAND_WORDS and not (len(words) > 1 and words[1].endswith(":"))


def _words(parts: list[str]) -> list[str] | None:
    """The shell words of a command's lines (a trailing backslash joins the next line; a
    quoted argument may span lines, as python -c "..."); None while it is not complete."""
    if parts[-1].rstrip().endswith("\\"):
        return None
    text = "".join(p.rstrip().removesuffix("\\") + " " if p.rstrip().endswith("\\") else p + "\n" for p in parts)
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # no closing quotation yet
        return None


def commands() -> list[Command]:
    """Every command of every shell block (output lines, comments and trees left out)."""
    found = []
    for path in DOCS:
        name = path.relative_to(REPO)
        for lang, first, lines in fenced_blocks(path):
            if lang not in SHELL_LANGS:
                continue
            pending: tuple[int, list[str]] | None = None
            for k, raw in enumerate(lines):
                line = raw.strip().removeprefix("$ ")
                if pending is None and not _is_command(line):
                    continue
                start, parts = pending or (first + k, [])
                parts.append(line if pending is None else raw)
                words = _words(parts)
                if words is None:  # it goes on: a trailing backslash, or a quote still open
                    pending = (start, parts)
                    continue
                pending = None
                found.append(Command(f"{name}:{start}", f"{name}:{first - 1}", shlex.join(words)))
    return found


# ---- what to do with each command ------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    pattern: str
    """A regex searched in the command."""
    action: str
    """run | check | error | parse | skip."""
    why: str = ""
    """Why it is not run as written (parse, skip), or what a substitution stands for."""
    subs: tuple[tuple[str, str], ...] = ()
    """(written, substituted) pairs; ``{W}`` in the substitute is the work directory."""
    extra: tuple[str, ...] = ()
    """Arguments appended (a later --set wins)."""
    setup: Callable[[Path], None] | None = field(default=None, compare=False)
    """Run before the command, in the work directory."""
    verify: Callable[[Path, str], None] | None = field(default=None, compare=False)
    """Run after it with the work directory and its output: what the recipe promises."""


def _steps_json(work: Path) -> None:
    """A --lengths file for g1n16+g4n2+g8n1 (32 ranks): two steps of a few lengths per rank."""
    steps = [[[64 + 7 * r + 31 * s, 16 + r] for r in range(32)] for s in range(2)]
    (work / "steps.json").write_text(json.dumps(steps))


def _widths_from_the_corpus(work: Path, out: str) -> None:
    """demo.yaml pins no widths: the run took the ingested corpus's (the tiny Flux-layout
    VAE's 16 latent channels, the tiny T5's 16, the tiny CLIP's 12) and trained."""
    cfg = json.loads((work / "runs" / "pictures" / "config.json").read_text())
    assert (cfg["model"]["in_channels"], cfg["model"]["text_dim"], cfg["model"]["pooled_dim"]) == (16, 16, 12), out
    assert (work / "runs" / "pictures" / "metrics.jsonl").read_text().strip(), out
    # Ray's and Ray Data's own log lines stay in the session's logs (before: Ray Data's
    # "Estimated parquet encoding ratio" and "... reader batch size" INFO lines came through).
    assert not re.search(r"^\d{4}-\d\d-\d\d [\d:,]+\s+(INFO|WARNING) ", out, re.M), out


def _lora_trained(work: Path, out: str) -> None:
    """Adapters trained on the stand-in's transformer; the checkpoint holds them alone."""
    from knapray.worker.checkpoint import completed_checkpoints, saved_keys

    (ckpt,) = completed_checkpoints(str(work / "runs" / "pictures-lora" / "checkpoints"))
    keys = [k for k in saved_keys(ckpt) if k.startswith("model.")]
    assert keys and all(".lora_" in k for k in keys), out


def _lora_exported(work: Path, out: str) -> None:
    """What diffusers loads: peft keys of the transformer's layers."""
    from safetensors import safe_open

    with safe_open(str(work / "pictures-lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.") and ".lora_" in k for k in keys), out


def _one_caption_two_sizes(work: Path, out: str) -> None:
    """One caption at both sizes, WIDTHxHEIGHT as written, decoded by the corpus's VAE."""
    assert "2 images: 512x512, 768x384 pixels" in out and "DiffusersVAE" in out, out
    assert (work / "grid.png").stat().st_size > 0


def _four_ranks(work: Path, out: str) -> None:
    """Two captions at two sizes drawn by 4 local processes, decoded by the corpus's VAE."""
    assert "2 images: 512x512, 768x384 pixels" in out and "DiffusersVAE" in out, out
    assert (work / "grid4.png").stat().st_size > 0


def _wan22_stand_in(work: Path) -> None:
    """The tiny Wan 2.2 A14B stand-in folder and two short clips (9 and 5 frames)."""
    import tiny_encoders as te

    if not (work / "models" / "Wan2.2-T2V-A14B-Diffusers").exists():
        te.save_wan22_layout(work / "models" / "Wan2.2-T2V-A14B-Diffusers")
        te.sample_clips(work / "clips")


def _both_experts_trained(work: Path, out: str) -> None:
    """Each expert trained steps of its own, from its own transformer, and the checkpoint holds
    both experts' adapters alone."""
    from knapray.worker.checkpoint import completed_checkpoints, saved_keys

    shared = re.search(r"transformer \(high noise\) trained (\d+) of these steps, transformer_2 \(low noise\) (\d+)", out)
    assert shared and min(map(int, shared.groups())) >= 1 and sum(map(int, shared.groups())) == 4, out
    (ckpt,) = completed_checkpoints(str(work / "runs" / "clips-lora" / "checkpoints"))
    for prefix in ("model.", "model_2."):
        keys = [k for k in saved_keys(ckpt) if k.startswith(prefix)]
        assert keys and all(".lora_" in k for k in keys), (prefix, out)
    # the coordinator's ledger has each step's expert, as the metrics do
    run = work / "runs" / "clips-lora"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert {r["step"]: r["expert"] for r in ledger} == {m["step"]: m["expert"] for m in metrics}, out


def _two_expert_loras(work: Path, out: str) -> None:
    """One diffusers LoRA file per expert, in its folder."""
    from safetensors import safe_open

    for expert in ("transformer", "transformer_2"):
        with safe_open(str(work / "clips-lora" / expert / "pytorch_lora_weights.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all(k.startswith("transformer.") and ".lora_" in k for k in keys), out


def _loaded_into_both(work: Path, out: str) -> None:
    """diffusers' WanPipeline took each expert's adapters into its own transformer."""
    assert "0.875 dict_keys(['high']) dict_keys(['low'])" in out, out


WAN22 = "tiny models in a Wan2.2-T2V-A14B-Diffusers-shaped folder (tests/tiny_encoders.save_wan22_layout)"
TINY = "tiny models in a FLUX.1-dev-shaped folder (tests/tiny_encoders.save_flux_layout)"
FAST = "a few steps, 2 workers (bags g2n1), so that it takes seconds"
RULES = (
    Rule(r"^make (run|test)\b", "skip", "make run is the demo of two 4-worker Ray runs (1-2 min here; its launcher "
         "runs below with the own-images recipe); make test is this suite"),
    Rule(r"^pip install", "skip", "installs packages: the test extra carries the encoders extra's packages"),
    Rule(r"^knapray ingest .*FLUX\.1-dev", "run", TINY,
         subs=(("/models/FLUX.1-dev", "{W}/models/FLUX.1-dev"), ("~/pictures", "{W}/pictures"))),
    Rule(r"^knapray ingest --family wan .*Wan2\.2-T2V-A14B", "run", WAN22,
         subs=(("/models/Wan2.2-T2V-A14B-Diffusers", "{W}/models/Wan2.2-T2V-A14B-Diffusers"), ("~/clips", "{W}/clips")),
         extra=("--max-side", "48", "--max-frames", "9"), setup=_wan22_stand_in),
    Rule(r"^knapray train --config jobs/configs/wan22_a14b\.yaml --set data\.corpus=corpora/clips", "run",
         "after the ingest above (its corpus); the tiny Wan 2.2 stand-in's experts, so the config's 14B widths are "
         "set to theirs; 4 steps on 2 CPU workers in fp32, the high-noise expert's share 0.5 (at the config's shift "
         "it is 37%: 4 steps might all be one expert's)",
         extra=("--set", "model.pretrained={W}/models/Wan2.2-T2V-A14B-Diffusers", "--set", "model.in_channels=4",
                "--set", "model.hidden_size=32", "--set", "model.num_heads=2", "--set", "model.depth_single=2",
                "--set", "model.text_dim=16", "--set", "model.ffn_dim=32", "--set", "model.freq_dim=16",
                "--set", "flow.expert_share=0.5", "--set", "run.max_steps=4", "--set", "scaling.num_workers=2",
                "--set", "scaling.use_gpu=false", "--set", "balance.topology=g2n1", "--set", "balance.gpus_per_node=2",
                "--set", "parallel.precision=fp32", "--set", "scaling.cpus_per_worker=1",
                "--set", "data.samples_per_step=1"),
         verify=_both_experts_trained),
    Rule(r"^knapray export --run runs/clips-lora", "run", "the two-expert LoRA run just trained",
         verify=_two_expert_loras),
    Rule(r"(?s)^python -c .*Wan2\.2-T2V-A14B", "run", WAN22,
         subs=(("/models/Wan2.2-T2V-A14B-Diffusers", "{W}/models/Wan2.2-T2V-A14B-Diffusers"),),
         verify=_loaded_into_both),
    Rule(r"^knapray (train --config jobs/configs/(wan_t2v_14b|wan22_a14b)\.yaml|export --run "
         r"/mnt/shared/knapray-runs/wan22)",
         "parse", "Wan 2.2's two 14B experts on a GPU cluster; tests/dist/test_wan_ingest.py trains, exports and loads a "
         "tiny Wan, tests/dist/test_experts.py two tiny experts in one run, tests/unit/test_timestep_range.py the "
         "range"),
    Rule(r"^knapray train .* --steps 8$", "error", "an example of a flag knapray train does not take"),
    Rule(r"^knapray sample .*--captoin", "error", "an example of a misspelt flag"),
    Rule(r"^knapray train .*model\.text_dim=4096 --check", "error", "an example of a refused config",
         extra=("--set", "data.corpus={W}/demo-corpus")),
    Rule(r"^knapray train .*--check", "run", "the demo corpus replaced by a small one",
         extra=("--set", "data.corpus={W}/demo-corpus")),
    Rule(r"^knapray train --config jobs/configs/flux_dev_lora\.yaml", "run",
         "after the own-images recipe above (its corpus); the tiny FLUX.1-dev stand-in's transformer, so the "
         "config's FLUX.1-dev widths are set to the stand-in's; 2 steps on 2 CPU workers (1 CPU each, not the "
         "config's 8: an embedded Ray of 18 CPUs on this 2-core machine) in fp32",
         subs=(("/models/FLUX.1-dev", "{W}/models/FLUX.1-dev"),),
         extra=("--set", "model.hidden_size=32", "--set", "model.num_heads=2", "--set", "model.depth_double=1",
                "--set", "model.depth_single=1", "--set", "model.text_dim=16", "--set", "model.pooled_dim=12",
                "--set", "model.rope_axes_dim=[4,6,6]", "--set", "run.max_steps=2", "--set", "scaling.num_workers=2",
                "--set", "scaling.use_gpu=false", "--set", "balance.topology=g2n1", "--set", "balance.gpus_per_node=2",
                "--set", "parallel.precision=fp32", "--set", "checkpoint.every=0",
                "--set", "scaling.cpus_per_worker=1"),
         verify=_lora_trained),
    Rule(r"^knapray export --run runs/pictures-lora", "run", "the LoRA run just trained", verify=_lora_exported),
    Rule(r"^knapray train ", "run", FAST,
         extra=("--set", "run.max_steps=2", "--set", "scaling.num_workers=2", "--set", "balance.topology=g2n1"),
         verify=_widths_from_the_corpus),
    Rule(r"^knapray sample .*--world-size 4", "run", "2 Euler steps instead of 28", extra=("--steps", "2"),
         verify=_four_ranks),
    Rule(r"^knapray sample ", "run", "2 Euler steps instead of 28", extra=("--steps", "2"),
         verify=_one_caption_two_sizes),
    Rule(r"^knapray serve ", "parse", "serves until Ctrl-C; tests/ray/test_serve_http.py serves runs over real HTTP "
         "(concurrent good, malformed and oversized requests)"),
    Rule(r"^knapray plan --mix \.\.\.", "skip", "an elided mix ('...'): the full plan commands run"),
    Rule(r"^knapray plan --lengths steps\.json", "run", "steps.json written here (2 steps of 32 ranks)",
         setup=_steps_json),
    Rule(r"^knapray plan --mix ", "run", "5 steps instead of 50", subs=(("--steps 50", "--steps 5"),)),
    Rule(r"^knapray simulate --mix image\+video --topology auto", "run"),
    Rule(r"^knapray simulate --paper-table", "parse", "the paper tables plan 32 and 1024 GPUs (20 s and more); "
         "tests/unit/test_simulate.py and tests/unit/test_pertopo.py check their rows"),
    Rule(r"^knapray parity ", "parse", "spawns 4 gloo processes (~20 s each); tests/dist/test_parity.py runs these cases"),
    Rule(r"^knapray memory --config jobs/configs/flux_dev_lora\.yaml", "run"),
    Rule(r"^knapray export --run runs/NAME --out lora-(kohya|comfy)/ --lora --format", "parse", "a placeholder run "
         "directory; tests/unit/test_lora_unit.py exports a LoRA run's adapters in both formats and diffusers' "
         "converters read them back"),
    Rule(r"^knapray export --run runs/NAME --out lora/ --lora", "parse", "a placeholder run directory; "
         "tests/dist/test_lora.py exports a LoRA run it trained and loads it into a FluxPipeline"),
    Rule(r"^knapray calibrate ", "parse", "times the model's blocks for minutes (or on CUDA); tests/unit/test_calibrate.py "
         "calibrates and validates a small model"),
    Rule(r"^torchrun --nproc-per-node 8 .*scaling\.use_gpu=true", "parse", "needs 8 CUDA GPUs"),
    Rule(r"^torchrun --nproc-per-node 4 .*per-step", "check", "the demo corpus replaced by a small one; training "
         "per-step on gloo is tests/dist/test_block_groups.py's", extra=("--set", "data.corpus={W}/demo-corpus")),
    Rule(r"^PYTHON=python3 make gpu-check", "skip", "needs a CUDA GPU"),
    Rule(r"^PYTHON=python3 make gpu-bench", "skip", "needs a CUDA GPU; tests/dist/test_torchrun.py runs the same "
         "make target on CPU (GPU_BENCH_FLAGS=--cpu) in a Python without the packages the GPU machine lacks"),
    Rule(r"^ray start ", "skip", "starts a Ray head on fixed ports (another session's Ray may hold them); "
         "jobs/submit_demo.sh does the same on free ports"),
    Rule(r"^bash jobs/submit_demo\.sh", "skip", "waits 30-90 s for a head start here; tests/ray/test_submit_demo.py "
         "runs its failure path (a head that does not answer in time: nothing submitted, the head stopped)"),
    Rule(r"^export RAY_AUTH_MODE", "skip", "environment of the ray job CLI"),
    Rule(r"^ray job submit .*flux_cluster\.yaml", "parse", "needs the cluster's corpus under /mnt/data; "
         "tests/unit/test_preflight.py checks flux_cluster.yaml against a corpus of its widths"),
    Rule(r"^ray job submit ", "check", "the entrypoint after --, its paths under the work directory",
         subs=(("/shared/corpora/demo", "{W}/demo-corpus"), ("/shared/knapray-runs", "{W}/shared-runs"))),
    Rule(r"^ray (job status|job logs|up) ", "skip", "needs a submitted job / a cloud account"),
    Rule(r"^knapray \S+ .*'\[--", "skip", "a usage synopsis (options in brackets), not a command; the command's "
         "--help has the same options, and tests/unit/test_cli_dialect.py checks them"),
    Rule(r"^knapray dryrun --sample .*--gpu-gib 24", "error", "Wan 2.1 14B's sampling gang on 24 GiB GPUs: refused "
         "before anything is built"),
    Rule(r"^knapray dryrun --sample --config jobs/configs/flux2_dev_lora\.yaml", "parse", "FLUX.2 with its 24B "
         "text encoder on fake tensors; tests/unit/test_sample_dryrun.py runs this placement"),
    Rule(r"^knapray dryrun --sample ", "parse", "each builds full-size models on fake tensors (13-20 s here); "
         "tests/unit/test_sample_dryrun.py runs the three placements"),
    Rule(r"^knapray dryrun --config jobs/configs/flux_cluster\.yaml", "parse", "the 64-rank Flux dry run takes "
         "35 s here; tests/unit/test_dryrun.py runs it"),
    Rule(r"^knapray dryrun --config jobs/configs/qwen_image_lora\.yaml", "parse", "Qwen-Image's 60 blocks on fake "
         "tensors take 77 s here; tests/unit/test_dryrun.py runs the config with 12 of them"),
    Rule(r"^knapray dryrun --config jobs/configs/flux2_dev_lora\.yaml", "parse", "FLUX.2 [dev]'s 56 blocks on fake "
         "tensors take 24 s here; tests/unit/test_dryrun.py runs the config with 8 + 8 of them"),
    Rule(r"(?s)^python -c .*FluxTransformer2DModel", "run", "two tiny random Flux checkpoints, saved by diffusers"),
    Rule(r"^knapray reference .*--world-size [2-9]", "parse", "spawns 4 gloo processes; tests/dist/test_flux_dist.py runs "
         "the balanced reference check"),
    Rule(r"^knapray reference ", "run"),
    Rule(r"^knapray bench kernels", "run", "a tiny shape on the CPU (the documented ones are GPU-size)",
         extra=("--device", "cpu", "--hidden", "64", "--heads", "2", "--seq-lens", "40,24", "--dtype", "fp32",
                "--warmup", "0", "--repeat", "1")),
    Rule(r"^knapray bench data ", "parse", "builds and reads ~560 MB of Flux-width corpora for minutes; "
         "tests/unit/test_data_path.py checks the readers it times"),
    Rule(r"^knapray bench planner --ranks", "parse", "16384 ranks take seconds per step and solver; "
         "tests/unit/test_cli_plan.py runs the bench's scaling rows on small worlds"),
)


def rule_for(command: Command) -> Rule | None:
    return next((r for r in RULES if re.search(r.pattern, command.text)), None)


ALL = commands()


def test_every_documented_command_has_a_rule():
    assert len(ALL) >= 20, ALL  # the extraction found the blocks
    missing = [f"{c.where}: {c.text}" for c in ALL if rule_for(c) is None]
    assert not missing, "README/docs commands without a rule in tests/ray/test_readme_commands.py:\n" + "\n".join(missing)
    for rule in RULES:
        assert rule.action in ("run", "check", "error", "parse", "skip"), rule
        assert rule.why or rule.action in ("run", "check"), f"{rule.pattern}: say why it is not run as written"


# ---- running them -------------------------------------------------------------------------------


def _argv(command: Command, rule: Rule, work: Path) -> list[str]:
    text = command.text
    for written, instead in rule.subs:
        text = text.replace(written, instead.replace("{W}", str(work)))
    argv = shlex.split(text) + [a.replace("{W}", str(work)) for a in rule.extra]
    if argv[:3] == ["ray", "job", "submit"]:
        argv = argv[argv.index("--") + 1 :]
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        argv = argv[1:]
    return argv


def _parser_of(argv: list[str]):
    """(parser, its arguments) of a knapray, jobs/train.py or torchrun command."""
    if argv[0] == "knapray":
        from knapray.cli import build_parser

        return build_parser(), argv[1:]
    if argv[:2] == ["python", "jobs/train.py"]:
        from knapray.commands.flags import Parser
        from knapray.commands.train import add_arguments

        p = Parser(prog="jobs/train.py")
        add_arguments(p)
        return p, argv[2:]
    if argv[0] == "torchrun":
        from knapray.commands.torchrun import build_parser

        return build_parser(), argv[argv.index("knapray.commands.torchrun") + 1 :]
    raise AssertionError(f"no parser for {argv}")


def _small_corpus(path: Path) -> None:
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    if not (path / "schema.json").exists():
        build_synthetic(SyntheticConfig(mix="g4b2i128f1s0,g4b1i64f2s1", steps=1, scale=4, channels=4, text_dim=16,
                                        pooled_dim=16, max_text_tokens=16, shards=2), path, progress=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The work directory every command runs in: jobs/ of the repository and a small corpus
    (tiny models and pictures are added for the commands that need them)."""
    work = tmp_path_factory.mktemp("readme")
    (work / "jobs").symlink_to(REPO / "jobs", target_is_directory=True)
    _small_corpus(work / "demo-corpus")
    return work


def _run_here(argv: list[str], work: Path, monkeypatch, capfd) -> tuple[int, str]:
    """Run a command in ``work``; knapray train starts its own embedded Ray, so it runs as
    a process of its own, the others in this one."""
    monkeypatch.chdir(work)
    if argv[:2] == ["knapray", "train"] and "--check" not in argv:
        pytest.importorskip("ray")
        # Its own embedded Ray: no RAY_ADDRESS, and a temp dir of its own, so that neither
        # joins a cluster another process started with `ray start` (ray_current_cluster).
        ray_tmp = tempfile.mkdtemp(prefix="kr-", dir="/tmp")  # short: Ray's socket paths
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(PYTHONPATH=str(REPO), RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.2", RAY_TMPDIR=ray_tmp)
        try:
            out = subprocess.run([sys.executable, "-m", "knapray.cli", *argv[1:]], cwd=work, env=env,
                                 capture_output=True, text=True, timeout=420)
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        return out.returncode, out.stdout + out.stderr
    if argv[0] == "knapray":
        from knapray.cli import main

        try:
            code = main(argv[1:])
        except SystemExit as e:  # a flag the command does not take: argparse exits itself
            code = e.code
    elif argv[0] == "torchrun":
        from knapray.commands.torchrun import main

        monkeypatch.setenv("WORLD_SIZE", argv[argv.index("--nproc-per-node") + 1])
        code = main(argv[argv.index("knapray.commands.torchrun") + 1 :])
    elif argv[:2] == ["python", "jobs/train.py"]:
        from knapray.commands.train import main

        code = main(argv[2:])
    elif argv[:2] == ["python", "-c"]:
        out = subprocess.run([sys.executable, "-c", argv[2]], cwd=work, capture_output=True, text=True, timeout=300)
        return out.returncode, out.stdout + out.stderr
    else:
        raise AssertionError(f"cannot run {argv}")
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def _parse_cases() -> list:
    return [pytest.param(c, id=f"{c.where} {c.text[:60]}") for c in ALL
            if (r := rule_for(c)) is not None and r.action == "parse"]


def _block_cases() -> list:
    blocks: dict[str, list[Command]] = {}
    for c in ALL:
        r = rule_for(c)
        if r is not None and r.action in ("run", "check", "error"):
            blocks.setdefault(c.block, []).append(c)
    def marks(cs: list[Command]):  # a block that trains on Ray is in the Ray tier
        return [pytest.mark.ray] if any(_starts_ray(c) for c in cs) else []

    return [pytest.param(cs, id=f"{b} {cs[0].text[:50]}", marks=marks(cs)) for b, cs in blocks.items()]


def _starts_ray(command: Command) -> bool:
    words = shlex.split(command.text)
    return words[:2] == ["knapray", "train"] and "--check" not in words


@pytest.mark.parametrize("command", _parse_cases())
def test_commands_not_run_here_parse(command):
    """Their flags exist and their values are valid (the reason they do not run is in RULES)."""
    parser, args = _parser_of(_argv(command, rule_for(command), Path("/nonexistent")))
    try:
        parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{command.where}: {command.text}: arguments refused (exit {e.code})")


@pytest.mark.parametrize("block", _block_cases())
def test_command_blocks_run(block, work, monkeypatch, capfd):
    """A block's commands in order, in one directory: the own-images recipe trains on what
    its ingest wrote and samples from what it trained."""
    if any("FLUX.1-dev" in c.text for c in block):
        pytest.importorskip("diffusers")
        import tiny_encoders as te

        if not (work / "models").exists():
            te.save_flux_layout(work / "models" / "FLUX.1-dev")
            te.sample_images(work / "pictures")
    for command in block:
        rule = rule_for(command)
        if rule.setup is not None:
            rule.setup(work)
        argv = _argv(command, rule, work) + (["--check"] if rule.action == "check" else [])
        code, out = _run_here(argv, work, monkeypatch, capfd)
        if rule.action == "error":
            lines = out.strip().splitlines()
            assert code == 2 and len(lines) == 1 and "error:" in lines[0], f"{command.where}: {out[-3000:]}"
            continue
        assert code == 0, f"{command.where}: {shlex.join(argv)}\n{out[-3000:]}"
        if rule.action == "check":
            assert "pre-flight passed" in out, out
        if rule.verify is not None:
            rule.verify(work, out)
