"""tests/ray_worker_start.py, the program the test session's Ray starts every Python worker
with in place of Ray's setup_worker.py: a plain worker's environment set as Ray sets it and
the worker exec'd with its arguments; anything else handed to Ray's program unchanged."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

START = pathlib.Path(__file__).resolve().parents[1] / "ray_worker_start.py"
ECHO = "import json, os, sys; print(json.dumps({'who': %r, 'argv': sys.argv[1:], 'A': os.environ.get('A')}))"


def _run(tmp_path, context: dict, language: str = "PYTHON") -> dict:
    worker, rays = tmp_path / "worker.py", tmp_path / "rays_setup_worker.py"
    worker.write_text(ECHO % "worker")
    rays.write_text(ECHO % "rays")
    env = {**os.environ, "KNAPRAY_TEST_RAY_SETUP_WORKER": str(rays), "HOME_X": "home"}
    env.pop("A", None)
    env.pop("KNAPRAY_TEST_RAY_FORK_SERVER", None)  # the exec path (the fork server's: test_ray_worker_fork.py)
    out = subprocess.run(
        [sys.executable, str(START), f"--serialized-runtime-env-context={json.dumps(context)}",
         f"--language={language}", str(worker), "--node-ip-address=127.0.0.1", "--x", "a b"],
        env=env, capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_a_plain_worker_gets_its_environment_and_arguments(tmp_path):
    got = _run(tmp_path, {"env_vars": {"A": "x${HOME_X}y${NOT_SET_ANYWHERE}z"}, "command_prefix": [],
                          "py_executable": sys.executable, "java_jars": []})
    assert got["who"] == "worker"
    assert got["argv"] == ["--node-ip-address=127.0.0.1", "--x", "a b"]
    assert got["A"] == "xhomeyz"  # ${X} expanded, an unknown one emptied (ray._private.utils.update_envs)


def test_anything_else_goes_to_rays_program_unchanged(tmp_path):
    for context, language in (({"command_prefix": ["nice"]}, "PYTHON"), ({"py_executable": "/usr/bin/python9"}, "PYTHON"),
                              ({"override_worker_entrypoint": "w.py"}, "PYTHON"), ({"new_field": 1}, "PYTHON"),
                              ({}, "JAVA")):
        got = _run(tmp_path, context, language)
        assert got["who"] == "rays", (context, language)
        assert got["argv"][:2] == [f"--serialized-runtime-env-context={json.dumps(context)}", f"--language={language}"]
        assert got["argv"][3:] == ["--node-ip-address=127.0.0.1", "--x", "a b"]
        assert got["A"] is None
