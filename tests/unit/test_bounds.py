"""Bounded work (issue 18, item 3) and config files (item 4): every size, count and product a
user gives is refused up front, before anything is allocated, in one line naming the value
and the bound, exit code 2, no traceback; an empty, binary or non-mapping config file and an
unsafe ``run.name`` likewise. The bounds are ``knapray.limits`` (docs/cli.md lists them).

Inputs that allocated or looped without end before the bounds run in a subprocess with a
timeout, so that this file fails rather than hangs where they are not bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from knapray.cli import main
from knapray.limits import (MAX_CORPUS_SAMPLES, MAX_IMAGE_SIDE, MAX_IMAGE_TOKENS, MAX_LOCAL_PROCESSES,
                            MAX_PLANNED_SEQUENCES, MAX_SAMPLES_PER_RANK, MAX_STEP_SEQUENCES, MAX_STEPS,
                            MAX_WORLD_SIZE)
from knapray.config.run import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
QUICK_S = 10.0
"""A refused input returns in well under this, subprocess start included (it took 35 s to
96 s, or the machine's memory, before)."""


def _one_line(code: int, err: str, *names: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def _in_process(argv: list[str], capsys, entry=main) -> tuple[int, str]:
    try:
        code = entry(argv)
    except SystemExit as e:  # argparse exits itself
        code = e.code
    return code, capsys.readouterr().err


def _subprocess(argv: list[str], cwd: Path | None = None, timeout: float = 60) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, check=False)
    return proc.returncode, proc.stderr, time.monotonic() - start


# ---- data codes: every command that parses a mix ----------------------------------------


@pytest.mark.parametrize("command", [["plan", "--topology", "g1n4"], ["simulate", "--topology", "g1n4"]])
def test_a_huge_data_code_is_one_line_before_any_allocation(command, tmp_path):
    code, err, took = _subprocess(["-m", "knapray.cli", *command, "--mix", "g99999999b99999i99999f999s0"],
                                  cwd=tmp_path)
    _one_line(code, err, "g99999999", str(MAX_WORLD_SIZE))
    assert took < QUICK_S, took


@pytest.mark.parametrize("code_text, names", [
    ("g8b99999i256f1s0", ["b99999", str(MAX_SAMPLES_PER_RANK)]),
    ("g8b4i99999f1s0", ["i99999", "resolution"]),
    ("g8b4i256f99999s0", ["f99999", "frames"]),
    ("g8b4i" + "9" * 5000 + "f1s0", ["at most"]),  # int() refuses 5000 digits with its own message
    ("g8b4i16384f4000s1", ["visual tokens", "4194304"]),  # one sample
    ("g8b1024i8192f1s0", ["tokens per rank"]),  # one rank's samples
])
def test_data_code_fields_and_products_are_bounded(code_text, names, capsys):
    start = time.monotonic()
    line = _one_line(*_in_process(["plan", "--mix", code_text], capsys), *names)
    assert len(line) < 400 and time.monotonic() - start < 2


def test_sequences_of_a_step_are_bounded(capsys):
    _one_line(*_in_process(["plan", "--mix", "g1048576b5i256f1s0"], capsys), "sequences per step",
              str(MAX_STEP_SEQUENCES))


def test_a_mix_replicated_past_the_world_bound_is_refused():
    from knapray.planning.shapes.mix import parse_mix, rank_codes

    with pytest.raises(ValueError, match=f"at most {MAX_WORLD_SIZE} ranks"):
        rank_codes(parse_mix("g8b4i256f1s0"), 8 * MAX_WORLD_SIZE)


def test_plan_steps_times_sequences_is_bounded(tmp_path):
    code, err, took = _subprocess(["-m", "knapray.cli", "plan", "--mix", "low-res", "--steps", "100000000"],
                                  cwd=tmp_path)
    _one_line(code, err, "--steps 100000000", str(MAX_PLANNED_SEQUENCES), "--steps <= 32768")
    assert took < QUICK_S, took


def test_simulate_steps_times_sequences_is_bounded(tmp_path):
    code, err, took = _subprocess(["-m", "knapray.cli", "simulate", "--mix", "g1000b1000i256f1s0", "--steps", "100",
                                   "--topology", "g8n125"], cwd=tmp_path)
    _one_line(code, err, "--steps 100", str(MAX_PLANNED_SEQUENCES))
    assert took < QUICK_S, took


def test_synthetic_corpus_builder_bounds_its_codes_and_samples(tmp_path, capsys):
    from knapray.commands import synthetic

    out = str(tmp_path / "c")
    _one_line(*_in_process(["--mix", "g99999999b99999i99999f999s0", "--out", out], capsys, synthetic.main),
              "g99999999", str(MAX_WORLD_SIZE))
    _one_line(*_in_process(["--mix", "low-res", "--steps", "1000000", "--no-payload", "--out", out], capsys,
                           synthetic.main), "1024000000 samples", str(MAX_CORPUS_SAMPLES))
    _one_line(*_in_process(["--mix", "low-res", "--channels", "99999999", "--out", out], capsys, synthetic.main),
              "--channels", "99999999")
    assert not Path(out).exists()


# ---- world sizes, topologies, steps -------------------------------------------------------


def test_a_huge_topology_is_one_line(capsys):
    start = time.monotonic()
    _one_line(*_in_process(["plan", "--mix", "low-res", "--topology", "g99999999n99999"], capsys),
              "g99999999n99999", str(MAX_WORLD_SIZE))
    assert time.monotonic() - start < 2


def test_a_huge_world_size_is_one_line(tmp_path):
    code, err, took = _subprocess(["-m", "knapray.cli", "plan", "--mix", "low-res", "--world-size", str(1 << 40)],
                                  cwd=tmp_path)
    _one_line(code, err, "--world-size", str(1 << 40), str(MAX_WORLD_SIZE))
    assert took < QUICK_S, took


@pytest.mark.parametrize("argv", [["plan", "--mix", "low-res"], ["simulate", "--mix", "low-res"],
                                  ["bench", "planner"]])
def test_steps_are_bounded_in_every_command(argv, capsys):
    _one_line(*_in_process([*argv, "--steps", str(MAX_STEPS + 1)], capsys), "--steps", str(MAX_STEPS))


@pytest.mark.parametrize("command, module, function", [
    ("parity", "knapray.testing.parity", "run_parity"),
    ("bench step", "knapray.benchmarks.step", "run_step_bench"),
    ("reference", "knapray.testing.reference", "run_reference"),
])
def test_local_processes_are_bounded(command, module, function, monkeypatch, capsys):
    import importlib

    def started(*args, **kwargs):
        raise AssertionError(f"{command} started {args[0] if args else ''} processes")

    monkeypatch.setattr(importlib.import_module(module), function, started)
    extra = ["--pretrained", "/nonexistent"] if command == "reference" else []
    _one_line(*_in_process([*command.split(), "--world-size", "1000", *extra], capsys), "--world-size 1000",
              f"at most {MAX_LOCAL_PROCESSES}")


# ---- knapray sample ----------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path):
    from dist_utils import sampling_run_dir

    return sampling_run_dir(tmp_path)


def _sample(run_dir, extra: list[str], monkeypatch, capsys) -> tuple[int, str]:
    import knapray.driver.gang as gang
    import knapray.driver.trained as trained

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the sizes were checked")

    monkeypatch.setattr(gang, "sample_local", refuse)
    monkeypatch.setattr(trained, "load_weights", refuse)
    return _in_process(["sample", "--run", str(run_dir), "--caption", "a", *extra], capsys)


def test_sample_size_is_bounded_before_any_allocation(run_dir, monkeypatch, capsys):
    start = time.monotonic()
    _one_line(*_sample(run_dir, ["--size", "100000x100000"], monkeypatch, capsys), "100000x100000",
              f"at most {MAX_IMAGE_SIDE}")
    assert time.monotonic() - start < 2


def test_sample_tokens_are_bounded(run_dir, monkeypatch, capsys):
    _one_line(*_sample(run_dir, ["--size", "8192x8192"], monkeypatch, capsys), "8192x8192", "262144",
              str(MAX_IMAGE_TOKENS))
    _one_line(*_sample(run_dir, ["--size", "2048x2048", "--frames", "8"], monkeypatch, capsys), "--frames 8",
              str(MAX_IMAGE_TOKENS))
    sizes = [a for _ in range(5) for a in ("--size", "4096x4096")]
    _one_line(*_sample(run_dir, ["--caption", "b", "--caption", "c", "--caption", "d", "--caption", "e", *sizes],
                       monkeypatch, capsys), "5 requests", "327680")


def test_sample_size_is_never_rounded(run_dir, monkeypatch, capsys):
    _one_line(*_sample(run_dir, ["--size", "513x513"], monkeypatch, capsys), "--size 513x513", "multiples of 16",
              "nearest valid: 512x512 or 528x528")
    _one_line(*_sample(run_dir, ["--size", "512x520"], monkeypatch, capsys), "nearest valid: 512x512 or 512x528")
    _one_line(*_sample(run_dir, ["--size", "8x8"], monkeypatch, capsys), "nearest valid: 16x16")


def test_sample_steps_are_bounded(run_dir, monkeypatch, capsys):
    _one_line(*_sample(run_dir, ["--steps", str(10 ** 12)], monkeypatch, capsys), "--steps", str(MAX_STEPS))


# ---- run config values -------------------------------------------------------------------


@pytest.mark.parametrize("override, bound", [
    ("data.max_tokens_per_gpu=1099511627776", "67108864"),
    ("data.global_batch=1000000000000000", "1048576"),
    ("data.samples_per_step=1000000", "65536"),
    ("data.epochs=10000000000", "1000000"),
    ("data.seed=100000000000000000000", str((1 << 63) - 1)),
    ("scaling.num_workers=1000000000", str(MAX_WORLD_SIZE)),
    ("run.max_steps=100000000000", str(MAX_STEPS)),
    ("distributed.timeout_s=1e30", "10000000"),
    ("distributed.timeout_s=100000000000000000000", "10000000"),
    ("optim.grad_accum_steps=10000000", "65536"),
    ("balance.gpus_per_node=100000000", str(MAX_WORLD_SIZE)),
    ("balance.topology=g99999999n99999", str(MAX_WORLD_SIZE)),
])
def test_run_config_counts_are_bounded(override, bound):
    key = override.split("=", 1)[0]
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert message.startswith(f"config {key}: ") and bound in message and "\n" not in message, message
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("override, bound", [
    ("model.hidden_size=160000", "65536"),
    ("model.depth_single=100000", "4096"),
    ("model.num_heads=100000", "4096"),
    ("model.patch_size=[1,2,200]", "64"),
])
def test_model_dimensions_are_bounded(override, bound):
    with pytest.raises(ConfigError, match=rf"^config {override.split('=')[0]}: .*{bound}"):
        load_config(None, [override])


def test_a_model_too_large_for_any_cluster_is_one_line_in_pre_flight(tmp_path, capsys):
    """Each width and depth within its bound, their product not: 2e14 parameters."""
    from dist_utils import build_tiny_corpus

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b2i128f1s0", steps=1)
    argv = ["train", "--config", str(REPO / "jobs" / "configs" / "demo.yaml"), "--set", f"data.corpus={corpus}", "--set", f"run.storage={tmp_path}", "--set",
            "model.hidden_size=60000", "--set", "model.num_heads=10", "--set", "model.rope_axes_dim=[2000,2000,2000]",
            "--set", "model.depth_single=4000", "--check"]
    line = _one_line(*_in_process(argv, capsys), "parameters", "hidden_size=60000", "depth_single=4000")
    assert "at most 1.1e+12" in line


@pytest.mark.parametrize("argv, bound", [
    (["bench", "ledger", "--sizes", "10000,99999999999"], "268435456"),
    (["bench", "planner", "--ranks", "1024,99999999968"], str(MAX_WORLD_SIZE)),
])
def test_bench_sizes_are_bounded(argv, bound, capsys):
    start = time.monotonic()
    _one_line(*_in_process(argv, capsys), "99999999", bound)
    assert time.monotonic() - start < 2


def test_real_large_runs_are_not_refused():
    cfg = load_config(None, ["scaling.num_workers=16384", "balance.gpus_per_node=8", "data.epochs=10",
                             "run.max_steps=5000000", "data.max_tokens_per_gpu=1048576", "data.global_batch=65536",
                             "balance.topology=g8n2048", "distributed.timeout_s=604800"])
    assert cfg.scaling.num_workers == 16384
    from knapray.planning.shapes.mix import parse_mix, rank_codes

    assert len(rank_codes(parse_mix("image+video"), 16384)) == 16384


# ---- config files ------------------------------------------------------------------------


def _config_file(tmp_path: Path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


CONFIG_FILES = [
    ("empty.yaml", b"", ["empty.yaml", "empty"]),
    ("comments.yaml", b"# only a comment\n", ["comments.yaml", "empty"]),
    ("binary.yaml", bytes(range(128, 256)) * 4, ["binary.yaml", "not UTF-8"]),
    ("list.yaml", b"- run\n- data\n", ["list.yaml", "expected a mapping"]),
    ("scalar.yaml", b"just words\n", ["scalar.yaml", "expected a mapping"]),
    ("long-name.yaml", b"run:\n  name: " + b"x" * 300 + b"\n", ["run.name", "300 characters", "128"]),
    ("slash-name.yaml", b"run:\n  name: a/../../b\n", ["run.name", "'a/../../b'"]),
    ("space-name.yaml", b"run:\n  name: my run\n", ["run.name", "'my run'"]),
]


@pytest.mark.parametrize("name, content, names", CONFIG_FILES)
def test_knapray_train_check_refuses_bad_config_files(name, content, names, tmp_path, capsys):
    path = _config_file(tmp_path, name, content)
    line = _one_line(*_in_process(["train", "--config", path, "--check"], capsys), *names)
    assert line.startswith("knapray train: error: ") and len(line) < 400, line


def test_huge_config_file_is_not_read_whole(tmp_path, capsys):
    path = _config_file(tmp_path, "big.yaml", b"run:\n  name: x\n" + b"#" * (2 << 20))
    _one_line(*_in_process(["train", "--config", path, "--check"], capsys), "big.yaml", "is over 1 MiB")


def test_the_launcher_script_refuses_a_binary_config_file(tmp_path):
    name, content, names = CONFIG_FILES[2]  # a UnicodeDecodeError traceback before
    path = _config_file(tmp_path, name, content)
    code, err, _ = _subprocess([str(REPO / "jobs" / "train.py"), "--config", path, "--check"], cwd=tmp_path)
    _one_line(code, err, *names)


@pytest.mark.parametrize("command", [["memory"], ["dryrun"]])
def test_other_commands_taking_config_refuse_an_empty_file(command, tmp_path, capsys):
    path = _config_file(tmp_path, "empty.yaml", b"")
    _one_line(*_in_process([*command, "--config", path], capsys), "empty.yaml", "empty")


# ---- issue 43, item 10: every documented bound answers within a minute -----------------------


def test_yaml_aliases_are_refused_before_they_expand(tmp_path, capsys):
    """A 454-byte alias bomb in a value (9 aliases of 9 aliases ... 9 deep: 9^9 strings once
    expanded) ran train --check past 120 s at 5.4 GB (the error's repr expanded it)."""
    from knapray.config.run import read_config

    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(["defs:"] + [f"  {line}" for line in lines] + ["run:", "  name: *a8", ""]))
    assert len(path.read_bytes()) < 700
    with pytest.raises(ConfigError, match="alias") as e:
        read_config(str(path))
    assert "\n" not in str(e.value)
    code, err, took = _subprocess(["-m", "knapray.cli", "train", "--config", str(path), "--check"], cwd=tmp_path,
                                  timeout=60)
    _one_line(code, err, "bomb.yaml", "alias")
    assert took < QUICK_S, took
    for override in ("run.name=*a", "run.name=[*a]"):
        with pytest.raises(ConfigError):
            read_config(None, [override])


def test_a_deeply_nested_config_value_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("run:\n  name: " + "[" * 5000 + "]" * 5000 + "\n")
    _one_line(*_in_process(["train", "--config", str(path), "--check"], capsys), "deep.yaml")


def test_a_lengths_file_nested_deep_is_one_line(tmp_path, capsys):
    """--lengths on JSON nested 100,000 deep was a RecursionError traceback."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    _one_line(*_in_process(["plan", "--lengths", str(path), "--topology", "g1n2"], capsys), "deep.json",
              "nested too deeply")


def test_dryrun_worlds_are_bounded_and_the_bound_answers_within_a_minute(tmp_path, capsys, monkeypatch):
    """--world-size 1048576 (the general bound) did not answer in 300 s: the dry run draws every
    rank's samples, plans and makes groups in one process. Its own bound (MAX_DRYRUN_WORLD)
    is refused past in one line; at the bound, one rank's inputs (its samples and its balance
    group's plan: the other groups' plans change nothing it computes) take seconds."""
    import knapray.testing.dryrun as dryrun
    from knapray.limits import MAX_DRYRUN_WORLD

    def reached(*args, **kwargs):
        raise AssertionError("the dry run started past its bound")

    monkeypatch.setattr(dryrun, "step_inputs", reached)
    config = str(REPO / "jobs" / "configs" / "demo.yaml")
    _one_line(*_in_process(["dryrun", "--config", config, "--world-size", str(MAX_DRYRUN_WORLD + 1)], capsys),
              "--world-size", str(MAX_DRYRUN_WORLD + 1), str(MAX_DRYRUN_WORLD))
    from knapray.limits import MAX_DRYRUN_PER_STEP_WORLD  # its plan weighs every node's layouts: 11 s at 4,096

    per_step = ["--set", "balance.topology=per-step", "--set", "balance.planner=cost", "--set", "balance.gpus_per_node=8"]
    _one_line(*_in_process(["dryrun", "--config", config, *per_step, "--world-size",
                            str(MAX_DRYRUN_PER_STEP_WORLD + 8)], capsys), "per-step", str(MAX_DRYRUN_PER_STEP_WORLD))
    monkeypatch.undo()
    start = time.monotonic()
    setup = dryrun.check_setup(config, [], world_size=MAX_DRYRUN_WORLD, rank=MAX_DRYRUN_WORLD - 1)
    inputs = dryrun.step_inputs(setup)
    took = time.monotonic() - start
    assert took < 15, took  # 25 s for the plan alone when every one of the 16,384 groups was planned
    topo = inputs.plan.topology
    group = topo.group_ranks(int(topo.group_of_bag[int(topo.bag_of_rank[MAX_DRYRUN_WORLD - 1])]))
    assert inputs.plan.rank_tokens[group.start:group.stop].sum() == sum(
        s.length for r in group for s in inputs.samples[r])


def test_bench_coordinator_ranks_are_bounded_before_ray_starts(monkeypatch, capsys):
    """--ranks 1048576 ended in an ActorUnavailableError traceback after 126 s: the bench
    plays every rank on this machine."""
    ray = pytest.importorskip("ray")
    from knapray.limits import MAX_BENCH_COORDINATOR_RANKS

    def started(*args, **kwargs):
        raise AssertionError("Ray started before the flags were checked")

    monkeypatch.setattr(ray, "init", started)
    over = MAX_BENCH_COORDINATOR_RANKS + 32
    _one_line(*_in_process(["bench", "coordinator", "--ranks", f"32,{over}"], capsys), str(over),
              str(MAX_BENCH_COORDINATOR_RANKS))


def test_synthetic_demo_takes_the_text_dtype_it_is_given(tmp_path, capsys):
    """--demo --text-dtype bf16 wrote fp32 without a word; a flag --demo fixes is refused."""
    import json

    from knapray.commands import synthetic

    out = tmp_path / "demo"
    assert synthetic.main(["--demo", "--text-dtype", "bf16", "--quiet", "--out", str(out)]) == 0
    assert json.loads((out / "schema.json").read_text())["text_dtype"] == "bf16"
    _one_line(*_in_process(["--demo", "--scale", "2", "--out", str(tmp_path / "d2")], capsys, synthetic.main),
              "--demo", "--scale")
    assert not (tmp_path / "d2").exists()
