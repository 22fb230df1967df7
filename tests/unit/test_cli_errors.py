"""Every user error of the `knapray` command is one line naming the value, exit code 2,
no traceback."""

from __future__ import annotations

import pytest

from knapray.cli import main


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse exits itself
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("argv, names", [
    (["plan", "--mix", "g8b4i256f1s0", "--world-size", "-32"], ["--world-size", "-32", "[1, 1048576]"]),
    (["plan", "--mix", "g8b4i256f1s0", "--gamma", "nan"], ["--gamma", "nan", "finite"]),
    (["plan", "--mix", "g8b4i256f1s0", "--steps", "many"], ["--steps", "many"]),
    (["plan", "--lengths", "/nonexistent/steps.json"], ["/nonexistent/steps.json", "cannot read"]),
    (["plan"], ["exactly one of --mix"]),
    (["plan", "--mix", "g8b4i256f1s0", "--topology", "g3x"], ["g3x"]),
    (["plan", "--mix", "nonsense"], ["nonsense"]),
    (["simulate", "--mix", "image+video", "--steps", "0"], ["--steps", "'0'"]),
    (["bench", "planner", "--steps", "-1"], ["--steps", "-1"]),
    (["parity", "--world-size", "0"], ["--world-size", "'0'"]),
    (["parity", "--tol=-1e-5"], ["--tol", "> 0"]),
    (["calibrate", "--hidden", "-128"], ["--hidden"]),
    (["no-such-command"], ["invalid choice"]),
])
def test_bad_input_is_one_line_and_exit_2(argv, names, capsys):
    code, err = _run(argv, capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("knapray"), err
    for name in names:
        assert name in err[0], (name, err[0])


def test_bad_json_names_the_file_and_the_place(tmp_path, capsys):
    bad = tmp_path / "steps.json"
    bad.write_text("[[[1, 2], [3]], ")
    code, err = _run(["plan", "--lengths", str(bad)], capsys)
    assert code == 2 and len(err) == 1 and str(bad) in err[0] and "not valid JSON" in err[0]
    bad.write_text('[[[1, "x"]]]')
    code, err = _run(["plan", "--lengths", str(bad)], capsys)
    assert code == 2 and "integer >= 1" in err[0]


def test_front_door_subcommands_and_version(capsys):
    for argv in (["train", "--help"], ["ingest", "--help"], ["sample", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--compare-unbalanced" in out and "--vae" in out and "--caption" in out and "knapray 0." in out
    code, err = _run(["train", "--config", "/nonexistent.yaml"], capsys)
    assert code == 2 and len(err) == 1 and "nonexistent.yaml" in err[0]
