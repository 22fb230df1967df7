"""One dialect across the `knapray` subcommands: a flag that two subcommands share has the
same destination, action, type and choices in both (``knapray.commands.flags`` defines
them once); a run config is ``--config``/``--set`` wherever one applies; renamed spellings
are one line naming the new one; each benchmark is its own subcommand with its own flags."""

from __future__ import annotations

import argparse
import itertools

import pytest

from knapray.cli import main, subcommand_parsers
from knapray.commands.flags import AC_MODES, DEVICES, DTYPES, FSDP_MODES
from knapray.limits import MAX_STEPS, MAX_WORLD_SIZE


@pytest.fixture(scope="module")
def parsers():
    return subcommand_parsers()


def _options(parser) -> dict[str, argparse.Action]:
    """Option string -> action, renamed spellings (help suppressed) left out."""
    return {s: a for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def _signature(action: argparse.Action) -> tuple:
    kind = getattr(action.type, "__name__", action.type)
    return (action.dest, type(action).__name__, kind, tuple(action.choices or ()), action.nargs, action.const)


def test_a_shared_flag_means_the_same_in_every_subcommand(parsers):
    seen: dict[str, dict[str, tuple]] = {}
    for name, parser in parsers.items():
        for option, action in _options(parser).items():
            seen.setdefault(option, {})[name] = _signature(action)
    drift = {opt: by for opt, by in seen.items() if len(set(by.values())) > 1}
    assert not drift, drift
    # The concepts of issue 17, where each must exist with these choices.
    where = {
        "--config": ["train", "memory", "calibrate"],
        "--set": ["train", "memory", "calibrate"],
        "--dtype": ["ingest", "calibrate"],
        "--device": ["ingest", "calibrate", "sample"],
        "--ac": ["memory", "calibrate", "parity", "bench step"],
        "--fsdp": ["memory", "parity", "bench step"],
        "--world-size": ["plan", "simulate", "memory", "parity", "bench step"],
        "--gpus-per-node": ["plan", "simulate", "memory", "parity", "bench step"],
    }
    for option, names in where.items():
        assert set(names) <= set(seen[option]), (option, sorted(seen[option]))
    choices = {"--dtype": DTYPES, "--device": DEVICES, "--ac": AC_MODES, "--fsdp": FSDP_MODES}
    for option, valid in choices.items():
        assert {sig[3] for sig in seen[option].values()} == {tuple(valid)}, option
    assert {sig[2] for sig in seen["--world-size"].values()} == {f"int[1,{MAX_WORLD_SIZE}]"}
    assert {sig[2] for sig in seen["--steps"].values()} == {f"int[1,{MAX_STEPS}]"}  # bounded: see knapray.limits


def test_each_benchmark_has_only_its_own_flags(parsers):
    benches = {n: set(_options(p)) for n, p in parsers.items() if n.startswith("bench ")}
    assert sorted(benches) == ["bench coordinator", "bench data", "bench kernels", "bench ledger", "bench planner",
                               "bench rivals", "bench sample", "bench serve", "bench step"]
    assert set(_options(parsers["bench"])) == {"-h", "--help"}
    # --ranks: world sizes (planner, coordinator); --dir: where a bench writes its files (ledger, data);
    # --hidden, --heads, --warmup: the model's width and heads, untimed first runs (step, kernels);
    # --world-size, --mix, --scale: gloo processes and the data codes they train on (step, rivals);
    # --repeat: timed repetitions, the median taken (kernels, sample)
    common = {"-h", "--help", "--steps", "--seed", "--json", "--ranks", "--dir", "--hidden", "--heads", "--warmup",
              "--world-size", "--mix", "--scale", "--repeat"}
    for (a, fa), (b, fb) in itertools.combinations(benches.items(), 2):
        assert fa & fb <= common, (a, b, fa & fb - common)
    assert "--sizes" in benches["bench ledger"] and "--fsdp" in benches["bench step"]


def test_values_are_read_the_same_way(parsers):
    calibrate = parsers["calibrate"]
    args = calibrate.parse_args(["--ac", "--dtype", "bfloat16"])  # the old spellings still read
    assert args.ac == "full" and args.dtype == "bf16"
    assert parsers["memory"].parse_args(["--config", "x.yaml", "--ac"]).ac == "full"
    assert parsers["ingest"].parse_args(["--input", "a", "--out", "b", "--dtype", "float16"]).dtype == "fp16"


@pytest.mark.parametrize("argv, names", [
    (["simulate", "--mix", "image+video", "--set", "inter_node_bw=25e9"], ["--set inter_node_bw=25e9", "--cost"]),
    (["plan", "--mix", "g8b4i256f1s0", "--set", "d_model=64"], ["--cost FIELD=VALUE"]),
    (["calibrate", "--ac", "every_k"], ["every_k", "--ac full"]),
    (["calibrate", "--set", "model.hidden_size=64"], ["--set", "--config"]),
    (["ingest", "--input", "a", "--out", "b", "--dtype", "half"], ["--dtype", "'half'", "'bf16'"]),
    (["bench", "planner", "--sizes", "10"], ["unrecognized arguments: --sizes"]),
])
def test_a_wrong_spelling_is_one_line_and_exit_2(argv, names, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("knapray"), err
    for name in names:
        assert name in err[0], (name, err[0])


def test_calibrate_takes_the_run_configs_model_and_mode(tmp_path, parsers):
    from knapray.commands.calibrate import calibration_args

    config = tmp_path / "run.yaml"
    config.write_text("model: {hidden_size: 96, num_heads: 6, depth_double: 3, depth_single: 5}\n"
                      "parallel: {precision: bf16, activation_checkpointing: full, compile: true}\n")
    got = calibration_args(parsers["calibrate"].parse_args(["--config", str(config), "--heads", "3"]))
    assert (got["hidden"], got["heads"], got["depth_double"], got["depth_single"]) == (96, 3, 3, 5)  # a flag wins
    assert (got["dtype"], got["ac"], got["compile"], got["device"]) == ("bfloat16", True, True, "cpu")
    plain = calibration_args(parsers["calibrate"].parse_args([]))
    assert (plain["hidden"], plain["dtype"], plain["ac"], plain["device"]) == (128, None, False, None)
